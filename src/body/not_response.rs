//! Whether a body with no routing and no choices is a response at all (format.md §3.2): an
//! engine's or a router's error reply, or JSON with none of a response's keys, is refused with
//! what it is (an error reply's message quoted), never read as "no routing".

use std::collections::BTreeMap;

use serde::de::IgnoredAny;
use serde_json::Value;

use crate::error::{Error, ErrorKind, Result};

/// Keys only responses have at their top level (OpenAI-compatible servers, vLLM's generate
/// endpoint, SGLang, NVIDIA Dynamo, vLLM 0.21's split rows); not `model`, which requests have.
const RESPONSE_KEYS: &[&str] = &[
    "choices",
    "meta_info",
    "text",
    "output_ids",
    "nvext",
    "sglext",
    "id",
    "request_id",
    "object",
    "usage",
    "created",
    "prompt_routed_experts",
    "routed_experts",
];

/// Whether any of a JSON object's top-level `keys` is one only responses have.
pub(crate) fn has_response_key<'k>(mut keys: impl Iterator<Item = &'k String>) -> bool {
    keys.any(|k| RESPONSE_KEYS.contains(&k.as_str()))
}

/// Bodies past this size are not classified: error replies and stray JSON are small, and a
/// body this large with no choices is a response whose routing is absent.
const CLASSIFIED_BYTES: usize = 1 << 20;

/// How much of an error reply's message is quoted.
const QUOTE_CHARS: usize = 300;

/// `Ok` for a response (or a body too large to be anything else); `NotResponse` naming what
/// `body` is otherwise.
pub(crate) fn check_response(body: &[u8]) -> Result<()> {
    if body.len() > CLASSIFIED_BYTES {
        return Ok(());
    }
    // The body was walked already: JSON it is; a reader that got here with other text has
    // nothing to say about it.
    let Ok(doc) = serde_json::from_slice::<Value>(body) else {
        return Ok(());
    };
    let refuse = |what: String| Err(Error::new(ErrorKind::NotResponse, what));
    match &doc {
        Value::Object(map) => {
            if let Some(message) = error_message(map) {
                return refuse(format!(
                    "the body is an error reply, not a response: {message} (the server refused \
                     the request; no routing was made)"
                ));
            }
            if has_response_key(map.keys()) {
                return Ok(());
            }
            let keys: Vec<String> = map.keys().take(6).map(|k| format!("{k:?}")).collect();
            let what = match keys.is_empty() {
                true => "an empty JSON object".to_string(),
                false => format!("a JSON object of keys {}", keys.join(", ")),
            };
            refuse(format!(
                "the body is not a response: {what} (a response has \"choices\", or SGLang's \
                 \"meta_info\"); pass the whole body the server answered"
            ))
        }
        Value::Array(items)
            if !items.is_empty()
                && items
                    .iter()
                    .all(|i| i.as_object().is_some_and(|m| has_response_key(m.keys()))) =>
        {
            Ok(()) // SGLang's batch of results
        }
        other => refuse(format!(
            "the body is not a response: {} (a response is a JSON object with \"choices\", or \
             SGLang's \"meta_info\")",
            kind_of(other)
        )),
    }
}

/// An error reply's message, quoted, for a body whose top-level `keys` were read: the body is
/// parsed for it only when its keys say it is one (error replies are small).
pub(crate) fn error_reply(body: &[u8], keys: &BTreeMap<String, IgnoredAny>) -> Option<String> {
    let maybe =
        keys.contains_key("error") || keys.contains_key("object") || keys.contains_key("detail");
    if !maybe || body.len() > CLASSIFIED_BYTES {
        return None;
    }
    match serde_json::from_slice::<Value>(body).ok()? {
        Value::Object(map) => error_message(&map),
        _ => None,
    }
}

/// An error reply's message: OpenAI's `{"error": {"message": ...}}`, vLLM's older
/// `{"object": "error", "message": ...}`, FastAPI's `{"detail": ...}`.
fn error_message(map: &serde_json::Map<String, Value>) -> Option<String> {
    let quote = |v: &Value| {
        let text = match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let cut: String = text.chars().take(QUOTE_CHARS).collect();
        let more = if cut.len() < text.len() { "..." } else { "" };
        format!("{cut:?}{more}")
    };
    if let Some(e) = map.get("error").filter(|e| !e.is_null()) {
        return Some(quote(e.get("message").unwrap_or(e)));
    }
    if map.get("object").and_then(Value::as_str) == Some("error") {
        return Some(quote(map.get("message").unwrap_or(&Value::Null)));
    }
    let bare = !has_response_key(map.keys());
    map.get("detail").filter(|_| bare).map(quote)
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a JSON boolean",
        Value::Number(_) => "a JSON number",
        Value::String(_) => "a JSON string",
        Value::Array(a) if a.is_empty() => "an empty JSON array",
        Value::Array(_) => "a JSON array of other values",
        Value::Object(_) => "a JSON object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn said(body: &str) -> String {
        let e = check_response(body.as_bytes()).unwrap_err();
        assert_eq!(*e.kind(), ErrorKind::NotResponse, "{e}");
        e.to_string()
    }

    #[test]
    fn error_replies_are_named_with_their_message() {
        let openai = r#"{"error":{"message":"max_tokens is too large","type":"BadRequestError","code":400}}"#;
        assert!(said(openai).contains("error reply, not a response: \"max_tokens is too large\""));
        let old = r#"{"object":"error","message":"model not found","code":404}"#;
        assert!(said(old).contains("\"model not found\""));
        assert!(said(r#"{"detail":"Not Found"}"#).contains("\"Not Found\""));
        let long = format!(r#"{{"error":"{}"}}"#, "x".repeat(1000));
        assert!(
            said(&long).contains(r#"xxx"... (the server refused"#),
            "{}",
            said(&long)
        );
    }

    #[test]
    fn json_that_is_no_response_is_named() {
        assert!(said("{}").contains("an empty JSON object"));
        let request = said(r#"{"prompt":"hi","max_tokens":4}"#);
        assert!(
            request.contains(r#"keys "max_tokens", "prompt""#),
            "{request}"
        );
        assert!(said("[]").contains("an empty JSON array"));
        assert!(said("[1, 2]").contains("a JSON array of other values"));
    }

    #[test]
    fn responses_without_routing_pass() {
        for body in [
            r#"{"id":"c","choices":[]}"#,
            r#"{"text":"hi","meta_info":{"id":"x"}}"#,
            r#"[{"text":"a","meta_info":{}},{"text":"b","meta_info":{}}]"#,
            r#"{"id":"c","object":"chat.completion.chunk","choices":[],"usage":{}}"#,
        ] {
            assert!(check_response(body.as_bytes()).is_ok(), "{body}");
        }
    }
}
