//! The error of a setting or a server list, apart from the settings' table so the server pool,
//! which the table names, can return it without the two importing each other.

/// A setting or a server list that cannot serve: `setting` names it (a setting's name as
/// [`SETTINGS`](crate::config::SETTINGS) and [`TEXT_SETTINGS`](crate::config::TEXT_SETTINGS)
/// name them, or `prefill`, `decode`, `upstreams_file` for the servers), `message` says what was
/// expected and what was given (its `Display`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The setting at fault.
    pub setting: String,
    /// What was wrong with it.
    pub message: String,
}

impl ConfigError {
    /// The error of `setting` with `message`.
    pub fn new(setting: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            setting: setting.into(),
            message: message.into(),
        }
    }
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_names_the_setting_and_shows_only_its_message() {
        let e = ConfigError::new("max_in_flight", "max_in_flight must be at least 1, got 0");
        assert_eq!(e.setting, "max_in_flight");
        assert_eq!(e.to_string(), "max_in_flight must be at least 1, got 0");
        let source: &dyn std::error::Error = &e;
        assert!(source.source().is_none());
        // The settings' own errors are of this type, under their names.
        let e = crate::config::setting("no_such").unwrap_err();
        assert_eq!(
            (e.setting.as_str(), e.message.as_str()),
            ("no_such", "unknown proxy setting \"no_such\"")
        );
    }
}
