//! A request that ends in an error response, and the OpenAI-shaped JSON body every failure
//! gives the client (as a response, or as a stream's last event).

use std::fmt::Write as _;

/// Whose fault an error is, as logs, metrics and error bodies say it.
pub type SideName = &'static str;

/// An error answer: status, message and how the response is shaped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// "client", "prefill", "decode", "merge" or "proxy".
    pub side: SideName,
    /// The HTTP status.
    pub status: u16,
    /// What went wrong (never an upstream's address).
    pub message: String,
    /// Seconds for a 503's `Retry-After`.
    pub retry_after: Option<u64>,
    /// The connection to the upstream was never made: safe to try another server.
    pub retryable: bool,
    /// The request field at fault.
    pub param: Option<&'static str>,
    /// The methods a 405's path takes.
    pub allow: Option<&'static str>,
    /// Close the client's connection with the response (its unread rest must not be read as
    /// another request).
    pub close: bool,
}

impl Fault {
    /// A fault of `side` with `status` and `message`, shaped plainly.
    pub fn new(side: SideName, status: u16, message: impl Into<String>) -> Self {
        Fault {
            side,
            status,
            message: message.into(),
            retry_after: None,
            retryable: false,
            param: None,
            allow: None,
            close: false,
        }
    }

    /// A 400 of the client's, naming the field at fault.
    pub fn bad_field(param: &'static str, message: impl Into<String>) -> Self {
        Fault {
            param: Some(param),
            ..Fault::new("client", 400, message)
        }
    }

    /// With `Retry-After: seconds`.
    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// Closing the connection.
    pub fn closing(mut self) -> Self {
        self.close = true;
        self
    }

    /// The JSON body: OpenAI's shape (`message`, `type`, `param`, `code`) plus `side`.
    pub fn body(&self) -> Vec<u8> {
        error_body(self.status, self.side, &self.message, self.param)
    }

    /// The body as a server-sent event.
    pub fn event(&self) -> Vec<u8> {
        let mut out = b"data: ".to_vec();
        out.extend_from_slice(&self.body());
        out.extend_from_slice(b"\n\n");
        out
    }
}

/// `{"error": {"message", "type", "param", "side", "code"}}`.
pub fn error_body(status: u16, side: &str, message: &str, param: Option<&str>) -> Vec<u8> {
    let kind = if status < 500 {
        "invalid_request_error"
    } else {
        "upstream_error"
    };
    let mut out = String::with_capacity(message.len() + 128);
    out.push_str(r#"{"error":{"message":"#);
    push_json_string(&mut out, message);
    let _ = write!(out, r#","type":"{kind}","param":"#);
    match param {
        Some(p) => push_json_string(&mut out, p),
        None => out.push_str("null"),
    }
    out.push_str(r#","side":"#);
    push_json_string(&mut out, side);
    let _ = write!(out, r#","code":{status}}}}}"#);
    out.into_bytes()
}

/// `text` as a JSON string literal.
pub fn push_json_string(out: &mut String, text: &str) {
    // serde_json's writer escapes exactly what JSON requires; a String target cannot fail.
    out.push_str(&serde_json::to_string(text).unwrap_or_else(|_| "\"\"".into()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_are_json_with_every_field() {
        let f = Fault::bad_field("stream", "a \"quoted\"\nline");
        let v: serde_json::Value = serde_json::from_slice(&f.body()).unwrap();
        let e = &v["error"];
        assert_eq!(e["message"], "a \"quoted\"\nline");
        assert_eq!(e["type"], "invalid_request_error");
        assert_eq!(e["param"], "stream");
        assert_eq!(e["side"], "client");
        assert_eq!(e["code"], 400);
        let v: serde_json::Value =
            serde_json::from_slice(&Fault::new("decode", 502, "x").body()).unwrap();
        assert_eq!(v["error"]["type"], "upstream_error");
        assert!(v["error"]["param"].is_null());
        assert!(Fault::new("decode", 502, "x").event().ends_with(b"}}\n\n"));
    }
}
