//! What an operator sets: the `routed-experts proxy` flags, with their defaults.

use std::time::Duration;

const MIB: usize = 1024 * 1024;

/// The proxy's timeouts and limits. `Config::default()` holds the documented defaults;
/// [`Config::check`] refuses values that would serve nothing.
#[derive(Clone, Debug)]
pub struct Config {
    /// Prefill servers' base URLs (`http://HOST:PORT[/PREFIX]`).
    pub prefill: Vec<String>,
    /// Decode servers' base URLs.
    pub decode: Vec<String>,
    /// How long an upstream may stay silent (a plain request waits for a whole generation).
    pub read_timeout: Duration,
    /// How long opening a connection to an upstream may take.
    pub connect_timeout: Duration,
    /// Completion requests served at once; beyond: 503 + Retry-After.
    pub max_in_flight: usize,
    /// Largest client body; beyond: 413 and the connection closed.
    pub max_request_bytes: usize,
    /// Time to receive a client's whole body, from its head; beyond: 408 and close.
    pub body_timeout: Duration,
    /// Bytes of bodies held at once: client bodies being received and upstream bodies being
    /// read or merged; beyond: 503 + Retry-After.
    pub max_buffered_bytes: usize,
    /// Largest upstream body or stream event; beyond: 502.
    pub max_upstream_bytes: usize,
    /// Failures in a row that take an upstream out of rotation.
    pub eject_after: u32,
    /// How long an ejected upstream stays out before a trial request.
    pub eject_seconds: Duration,
    /// Sent as `Authorization: Bearer` instead of the client's header.
    pub upstream_api_key: Option<String>,
    /// Time from accept (or from the end of the previous response) to a whole request head;
    /// beyond: 408 and close (an idle keep-alive connection is closed without a reply).
    pub header_timeout: Duration,
    /// Largest request head (request line and headers); beyond: 431 and close.
    pub max_header_bytes: usize,
    /// Client connections open at once; beyond, a new one gets 503 and is closed (logged).
    pub max_connections: usize,
    /// The whole of a completion request, streams included; beyond: 504, or an error event
    /// that ends a stream.
    pub request_timeout: Duration,
    /// How long a write to a client may wait (a client that stops reading); beyond, the
    /// connection is closed.
    pub write_timeout: Duration,
    /// On SIGTERM/SIGINT (or `stop`): requests under way get this long to finish, then their
    /// upstream calls are cancelled and their connections closed.
    pub shutdown_timeout: Duration,
    /// Largest routing one merge may decode (decoded bytes of a half or of the merge);
    /// beyond: 502 blaming the upstream.
    pub max_merge_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            prefill: Vec::new(),
            decode: Vec::new(),
            read_timeout: Duration::from_secs(600),
            connect_timeout: Duration::from_secs(10),
            max_in_flight: 256,
            max_request_bytes: 64 * MIB,
            body_timeout: Duration::from_secs(60),
            max_buffered_bytes: 1024 * MIB,
            max_upstream_bytes: 256 * MIB,
            eject_after: 3,
            eject_seconds: Duration::from_secs(10),
            upstream_api_key: None,
            header_timeout: Duration::from_secs(30),
            max_header_bytes: 64 * 1024,
            max_connections: 4096,
            request_timeout: Duration::from_secs(3600),
            write_timeout: Duration::from_secs(60),
            shutdown_timeout: Duration::from_secs(30),
            max_merge_bytes: routed_experts::DEFAULT_MAX_BYTES,
        }
    }
}

/// hyper's smallest read buffer, which bounds the smallest header limit it can apply.
pub const MIN_HEADER_BYTES: usize = 8192;

impl Config {
    /// `Err(message)` naming the first setting that cannot serve (a zero limit or timeout, a
    /// bad upstream URL); `Ok(())` otherwise.
    pub fn check(&self) -> Result<(), String> {
        for (name, d) in [
            ("read_timeout", self.read_timeout),
            ("connect_timeout", self.connect_timeout),
            ("body_timeout", self.body_timeout),
            ("eject_seconds", self.eject_seconds),
            ("header_timeout", self.header_timeout),
            ("request_timeout", self.request_timeout),
            ("write_timeout", self.write_timeout),
        ] {
            if d.is_zero() {
                return Err(format!("{name} must be a positive number of seconds"));
            }
        }
        for (name, n) in [
            ("max_in_flight", self.max_in_flight),
            ("max_request_bytes", self.max_request_bytes),
            ("max_buffered_bytes", self.max_buffered_bytes),
            ("max_upstream_bytes", self.max_upstream_bytes),
            ("eject_after", self.eject_after as usize),
            ("max_connections", self.max_connections),
            ("max_merge_bytes", self.max_merge_bytes),
        ] {
            if n < 1 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        if self.max_header_bytes < MIN_HEADER_BYTES {
            return Err(format!(
                "max_header_bytes must be at least {MIN_HEADER_BYTES}, got {}",
                self.max_header_bytes
            ));
        }
        for (side, urls) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            if urls.is_empty() {
                return Err(format!("give at least one {side} server"));
            }
            for url in urls {
                super::upstream::Target::parse(url).map_err(|e| format!("{side}: {e}"))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config {
            prefill: vec!["http://127.0.0.1:1".into()],
            decode: vec!["http://127.0.0.1:2/prefix".into()],
            ..Config::default()
        }
    }

    #[test]
    fn defaults_serve_and_zero_limits_are_named() {
        assert_eq!(config().check(), Ok(()));
        let c = Config {
            max_in_flight: 0,
            ..config()
        };
        assert_eq!(c.check().unwrap_err(), "max_in_flight must be at least 1");
        let c = Config {
            write_timeout: Duration::ZERO,
            ..config()
        };
        assert!(c.check().unwrap_err().starts_with("write_timeout"));
        let c = Config {
            max_header_bytes: 100,
            ..config()
        };
        assert!(c.check().unwrap_err().contains("at least 8192"));
    }

    #[test]
    fn upstream_urls_are_checked() {
        let c = Config {
            decode: vec!["localhost:8000".into()],
            ..config()
        };
        assert!(c.check().unwrap_err().starts_with("decode: "));
        let c = Config {
            prefill: vec![],
            ..config()
        };
        assert_eq!(c.check().unwrap_err(), "give at least one prefill server");
    }
}
