//! A request that ends in an error response, and the OpenAI-shaped JSON body every failure
//! gives the client (as a response, or as a stream's last event).

use std::fmt::Write as _;

use routed_experts::{Error, ErrorKind, Half};

use super::pool::Side;
use super::stream_merger::StreamError;

/// Whose fault an error is, as logs, metrics and error bodies name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Blame {
    /// The client's request (4xx).
    Client,
    /// A prefill server.
    Prefill,
    /// A decode server.
    Decode,
    /// The two halves' routing, which does not merge.
    Merge,
    /// The proxy itself (its limits, its shutdown).
    Proxy,
}

impl Blame {
    /// "client", "prefill", "decode", "merge" or "proxy".
    pub fn name(self) -> &'static str {
        match self {
            Blame::Client => "client",
            Blame::Prefill => "prefill",
            Blame::Decode => "decode",
            Blame::Merge => "merge",
            Blame::Proxy => "proxy",
        }
    }
}

impl std::fmt::Display for Blame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl From<Side> for Blame {
    fn from(side: Side) -> Self {
        match side {
            Side::Prefill => Blame::Prefill,
            Side::Decode => Blame::Decode,
        }
    }
}

/// An error answer: status, message and how the response is shaped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// Whose fault it is.
    pub side: Blame,
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
    /// The routing rule a failed merge broke: the core's error kind by name (`"gap"`,
    /// `"missing_routing"`, ...; format.md §8), so a client branches without reading the
    /// message. `None` for every other fault.
    pub kind: Option<&'static str>,
}

impl Fault {
    /// A fault of `side` with `status` and `message`, shaped plainly.
    pub fn new(side: Blame, status: u16, message: impl Into<String>) -> Self {
        Fault {
            side,
            status,
            message: message.into(),
            retry_after: None,
            retryable: false,
            param: None,
            allow: None,
            close: false,
            kind: None,
        }
    }

    /// A 400 of the client's, naming the field at fault.
    pub fn bad_field(param: &'static str, message: impl Into<String>) -> Self {
        Fault {
            param: Some(param),
            ..Fault::new(Blame::Client, 400, message)
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

    /// The JSON body: OpenAI's shape (`message`, `type`, `param`, `code`) plus `side` and
    /// `kind`.
    pub fn body(&self) -> Vec<u8> {
        error_body(
            self.status,
            self.side.name(),
            &self.message,
            self.param,
            self.kind,
        )
    }

    /// The body as a server-sent event.
    pub fn event(&self) -> Vec<u8> {
        let mut out = b"data: ".to_vec();
        out.extend_from_slice(&self.body());
        out.extend_from_slice(b"\n\n");
        out
    }
}

/// `{"error": {"message", "type", "param", "side", "code", "kind"}}` (`param` and `kind` are
/// null when there is none).
pub fn error_body(
    status: u16,
    side: &str,
    message: &str,
    param: Option<&str>,
    rule: Option<&str>,
) -> Vec<u8> {
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
    let _ = write!(out, r#","code":{status},"kind":"#);
    match rule {
        Some(r) => push_json_string(&mut out, r),
        None => out.push_str("null"),
    }
    out.push_str("}}");
    out.into_bytes()
}

/// `text` as a JSON string literal.
pub fn push_json_string(out: &mut String, text: &str) {
    // serde_json's writer escapes exactly what JSON requires; a String target cannot fail.
    out.push_str(&serde_json::to_string(text).unwrap_or_else(|_| "\"\"".into()));
}

/// A merge that failed: the half without routing when one is missing (the core says which),
/// else the pair's routing; a limit passed names the proxy's own setting. The body carries the
/// core's kind.
pub fn merge_fault(e: Error) -> Fault {
    let text = e.to_string();
    let fault = match e.kind() {
        ErrorKind::MissingRouting(Half::Prefill) => Fault::new(Blame::Prefill, 502, text),
        ErrorKind::MissingRouting(Half::Decode) => Fault::new(Blame::Decode, 502, text),
        // The proxy's own cap: the operator's knob is named, not the Python API's.
        ErrorKind::TooLarge { .. } => Fault::new(
            Blame::Merge,
            502,
            format!("the routing is larger than this proxy merges: {text} (--max-merge-bytes)"),
        ),
        ErrorKind::Unplaced => Fault::new(
            Blame::Merge,
            502,
            format!(
                "routing from an upstream that cannot be placed (has the engine's format \
                 changed?): {text}"
            ),
        ),
        kind if kind.is_malformed_input() => Fault::new(
            Blame::Merge,
            502,
            format!("malformed routing from an upstream: {text}"),
        ),
        _ => Fault::new(
            Blame::Merge,
            502,
            format!("prefill and decode routing do not merge: {text}"),
        ),
    };
    Fault {
        kind: Some(e.kind().name()),
        ..fault
    }
}

/// A decode stream that failed.
pub fn stream_fault(e: StreamError) -> Fault {
    match e {
        StreamError::NoDone => Fault::new(
            Blame::Decode,
            502,
            "the decode stream ended before data: [DONE]",
        ),
        StreamError::LineTooLong(n) => Fault::new(
            Blame::Decode,
            502,
            format!("decode stream: a line of more than {n} bytes (the limit on one event)"),
        ),
        StreamError::Merge(e) => merge_fault(e),
    }
}

/// A 4xx is about the client's request: its status is passed on. A 5xx is the upstream's
/// fault (502). The client reads the upstream's own message once (its `error.message`,
/// `message` or `detail` when the body is JSON, else the text as sent), never JSON quoted
/// inside JSON.
pub fn status_fault(side: Side, url: &str, status: u16, body: &[u8]) -> Fault {
    let head = &body[..body.len().min(2000)];
    // Escaped before it reaches the log: a newline or an escape sequence in a server's answer
    // must not be able to forge a log line.
    let logged = one_line(&String::from_utf8_lossy(head));
    let s = side.name();
    log::warn!(target: "routed_experts::proxy", "{s} server {url} answered {status}: {logged}");
    let code = if status < 500 { status } else { 502 };
    Fault::new(
        side.into(),
        code,
        format!(
            "the {s} server answered {status}: {}",
            upstream_message(body)
        ),
    )
}

/// What an upstream's error body says, for a client to read: the message of a JSON error
/// (OpenAI's `{"error": {"message"}}`, `{"message"}`, FastAPI's `{"detail"}`), else the body's
/// first 2,000 bytes as text.
fn upstream_message(body: &[u8]) -> String {
    let clip = |t: &str| t.chars().take(2000).collect::<String>();
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
        let said = v
            .pointer("/error/message")
            .or_else(|| v.get("message"))
            .or_else(|| v.get("detail"));
        match said {
            Some(serde_json::Value::String(m)) => return clip(m),
            Some(other) if !other.is_null() => return clip(&other.to_string()),
            _ => {}
        }
    }
    clip(String::from_utf8_lossy(&body[..body.len().min(2000)]).trim())
}

/// `text` for a log line: control characters escaped (`\n`, `\u{1b}`), so an upstream's text
/// cannot forge a line or move the cursor; quotes and everything else as written (a message
/// reads `server's`, not `server\'s`).
pub(crate) fn one_line(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    out
}

/// A reply in a content coding the proxy cannot merge (it asks for identity).
pub fn encoded_fault(side: Side, url: &str, encoding: String) -> Fault {
    let s = side.name();
    let shown: String = one_line(&encoding).chars().take(40).collect();
    log::warn!(target: "routed_experts::proxy", "{s} server {url} answered in Content-Encoding {shown}");
    Fault::new(
        side.into(),
        502,
        format!(
            "the {s} server answered in Content-Encoding \"{shown}\"; the proxy merges only \
             identity bodies (it sends Accept-Encoding: identity)"
        ),
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_logged_text_keeps_its_quotes_and_escapes_its_controls() {
        let said = "the prefill server's \"reply\"\nFAKE LINE\u{1b}[2J";
        assert_eq!(
            one_line(said),
            "the prefill server's \"reply\"\\nFAKE LINE\\u{1b}[2J"
        );
    }

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
        assert!(
            e["kind"].is_null(),
            "only a failed merge names a routing rule"
        );
        let v: serde_json::Value =
            serde_json::from_slice(&Fault::new(Blame::Decode, 502, "x").body()).unwrap();
        assert_eq!(v["error"]["type"], "upstream_error");
        assert!(v["error"]["param"].is_null());
        assert!(Fault::new(Blame::Decode, 502, "x")
            .event()
            .ends_with(b"}}\n\n"));
    }

    /// A failed merge is told by its kind: the half without routing is blamed, a limit passed
    /// names the proxy's setting (not the Python API's), unplaceable routing says so.
    #[test]
    fn a_failed_merge_is_answered_by_its_kind() {
        let cases = [
            (
                ErrorKind::MissingRouting(Half::Prefill),
                Blame::Prefill,
                "x",
            ),
            (ErrorKind::MissingRouting(Half::Decode), Blame::Decode, "x"),
            (
                ErrorKind::TooLarge {
                    bytes: 10,
                    limit: 5,
                },
                Blame::Merge,
                "(--max-merge-bytes)",
            ),
            (ErrorKind::Unplaced, Blame::Merge, "cannot be placed"),
            (ErrorKind::Malformed, Blame::Merge, "malformed routing"),
            (ErrorKind::Inconsistent, Blame::Merge, "do not merge"),
        ];
        for (kind, blame, says) in cases {
            let f = merge_fault(Error::new(kind.clone(), "x"));
            assert_eq!((f.side, f.status), (blame, 502), "{kind:?}");
            assert!(f.message.contains(says), "{kind:?}: {}", f.message);
            let body: serde_json::Value = serde_json::from_slice(&f.body()).unwrap();
            assert_eq!(body["error"]["kind"], kind.name(), "{kind:?}");
        }
    }

    /// An upstream's JSON error is quoted once: the client decodes its message, not JSON
    /// escaped inside JSON.
    #[test]
    fn upstream_errors_are_quoted_once() {
        let vllm = br#"{"error":{"message":"prompt \"x\" is too long","type":"BadRequestError","code":400}}"#;
        let f = status_fault(Side::Prefill, "http://p", 400, vllm);
        assert_eq!(f.status, 400);
        assert_eq!(
            f.message,
            r#"the prefill server answered 400: prompt "x" is too long"#
        );
        let v: serde_json::Value = serde_json::from_slice(&f.body()).unwrap();
        assert_eq!(
            v["error"]["message"],
            r#"the prefill server answered 400: prompt "x" is too long"#
        );
        let fastapi = br#"{"detail":[{"loc":["body"],"msg":"bad"}]}"#;
        let f = status_fault(Side::Decode, "http://d", 422, fastapi);
        assert_eq!(
            f.message,
            r#"the decode server answered 422: [{"loc":["body"],"msg":"bad"}]"#
        );
        let f = status_fault(Side::Decode, "http://d", 503, b"  Service Unavailable\n");
        assert_eq!(
            (f.status, f.message.as_str()),
            (502, "the decode server answered 503: Service Unavailable")
        );
        let long = vec![b'a'; 5000];
        let f = status_fault(Side::Decode, "http://d", 500, &long);
        assert_eq!(
            f.message.len(),
            "the decode server answered 500: ".len() + 2000
        );
    }
}
