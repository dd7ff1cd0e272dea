//! The error of a setting or a server list, and the parse of a setting that names one of a few
//! choices, apart from the settings' table so the server pool, which the table names, can use
//! them without the two importing each other.

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

/// The choice among `all` whose `name_of` is `given`; `Err` lists the names ("expected a or
/// b", or "expected one of a, b, c"). What every setting that takes one of a few names parses
/// with (the policies, `routing_format`, `stream_routing`).
pub(crate) fn parse_named<T: Copy>(
    all: &[T],
    name_of: fn(T) -> &'static str,
    given: &str,
) -> Result<T, String> {
    all.iter()
        .copied()
        .find(|c| name_of(*c) == given)
        .ok_or_else(|| {
            let names: Vec<&str> = all.iter().map(|c| name_of(*c)).collect();
            match names.as_slice() {
                [a, b] => format!("expected {a} or {b}, got {given:?}"),
                _ => format!("expected one of {}, got {given:?}", names.join(", ")),
            }
        })
}

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
