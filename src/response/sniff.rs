//! What a file handed to a tool is, before it is read as routing (format.md §3.2): empty, a raw
//! `.npy`, other binary data, a routing value (and its format), a response body (with or
//! without routing), a server's error reply, other JSON, or other text. One answer that every
//! command's message is built from, so a PNG is never called "a routing value".

use std::collections::BTreeMap;

use serde::de::IgnoredAny;

use crate::body::not_response::{error_reply, has_response_key};
use crate::formats::{self, Format};

/// What [`sniff`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sniffed {
    /// Nothing, or only white space.
    Empty,
    /// A file `np.save` wrote (vLLM's rows before they are base64-encoded).
    RawNpy,
    /// Binary data that is no routing: what it looks like (an image, an archive, a pickle).
    Binary(String),
    /// A routing value in this format.
    Routing(Format),
    /// A response body.
    Response {
        /// Whether any of its choices carries routing.
        routed: bool,
        /// The tokens its choices generated, when the body counts them and they agree (a
        /// prefill half generates one: a merge's swapped inputs are told by it).
        generated: Option<u64>,
    },
    /// A server's error reply: its message, quoted.
    ErrorReply(String),
    /// JSON that is neither a routing value nor a response: what it is.
    OtherJson(String),
    /// Text that is none of the above: what it looks like.
    Text(String),
}

impl Sniffed {
    /// A short name for what was found: `empty`, `npy`, `binary`, `routing`, `response`,
    /// `error_reply`, `json`, `text`.
    pub fn name(&self) -> &'static str {
        match self {
            Sniffed::Empty => "empty",
            Sniffed::RawNpy => "npy",
            Sniffed::Binary(_) => "binary",
            Sniffed::Routing(_) => "routing",
            Sniffed::Response { .. } => "response",
            Sniffed::ErrorReply(_) => "error_reply",
            Sniffed::OtherJson(_) => "json",
            Sniffed::Text(_) => "text",
        }
    }
}

/// What `text` is. Reads no routing: a response's values are found, not decoded, and a JSON
/// object's top-level keys are read without building its values.
pub fn sniff(text: &[u8]) -> Sniffed {
    let t = text.trim_ascii();
    if t.is_empty() {
        return Sniffed::Empty;
    }
    if t.starts_with(b"\x93NUMPY") {
        return Sniffed::RawNpy;
    }
    let printable = std::str::from_utf8(t)
        .is_ok_and(|s| !s.chars().any(|c| c.is_control() && !c.is_whitespace()));
    if !printable {
        return Sniffed::Binary(formats::describe_not_routing(t));
    }
    let response = || match crate::body::read_body(t) {
        Ok(r) => {
            let mut counts = r.choices.iter().map(|(_, c)| c.generated.map(|(g, _)| g));
            let first = counts.next().flatten();
            let generated = first.filter(|g| counts.all(|c| c == Some(*g)));
            Sniffed::Response {
                routed: !r.is_empty(),
                generated,
            }
        }
        Err(_) => Sniffed::Response {
            routed: false,
            generated: None,
        },
    };
    match t[0] {
        b'{' => match serde_json::from_slice::<BTreeMap<String, IgnoredAny>>(t) {
            Err(e) => Sniffed::Text(format!(
                "text that starts as a JSON object but is not one ({e})"
            )),
            Ok(keys) => {
                if let Some(message) = error_reply(t, &keys) {
                    return Sniffed::ErrorReply(message);
                }
                if has_response_key(keys.keys()) {
                    return response();
                }
                if keys.contains_key("data") || keys.contains_key("shape") {
                    return Sniffed::Routing(Format::Compact);
                }
                let shown: Vec<String> = keys.keys().take(6).map(|k| format!("{k:?}")).collect();
                Sniffed::OtherJson(match shown.is_empty() {
                    true => "an empty JSON object".to_string(),
                    false => format!("a JSON object of keys {}", shown.join(", ")),
                })
            }
        },
        // SGLang's batch of results (objects), or nested lists of ids.
        b'[' if t[1..].trim_ascii_start().first() == Some(&b'{') => {
            match crate::body::check_response(t) {
                Ok(()) => response(),
                Err(_) => {
                    Sniffed::OtherJson("a JSON array of objects that are not responses".into())
                }
            }
        }
        _ => match formats::input_text(t).and_then(|v| formats::detect(&v)) {
            Ok(format) => Sniffed::Routing(format),
            Err(_) => Sniffed::Text(formats::describe_not_routing(t)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_of_file_is_told_apart() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "empty"),
            (b"  \n", "empty"),
            (b"\x93NUMPY\x01\x00v\x00{'descr': '|u1'}", "npy"),
            (b"\x89PNG\r\n\x1a\n\x00\x00", "binary"),
            (b"\x1f\x8b\x08\x00", "binary"),
            (br#"{"data":"AAE=","shape":[1,1,2],"start":0}"#, "routing"),
            (b"[[[1, 2]], [[3, 4]]]", "routing"),
            (br#"{"choices":[{"index":0,"text":"x"}]}"#, "response"),
            (br#"{"text":"x","meta_info":{"id":"a"}}"#, "response"),
            (br#"[{"text":"x","meta_info":{}}]"#, "response"),
            (br#"{"error":{"message":"bad request"}}"#, "error_reply"),
            (b"{}", "json"),
            (br#"{"prompt":"hi"}"#, "json"),
            (b"[{\"a\":1}]", "json"),
            (b"hello there", "text"),
            (b"{not json", "text"),
        ];
        for (text, name) in cases {
            assert_eq!(
                sniff(text).name(),
                *name,
                "{:?}",
                String::from_utf8_lossy(text)
            );
        }
        let routed = br#"{"choices":[{"index":0,"routed_experts":{"data":"AAE=","shape":[1,1,2],"start":0}}],"usage":{"prompt_tokens":2,"completion_tokens":1}}"#;
        let want = Sniffed::Response {
            routed: true,
            generated: Some(1),
        };
        assert_eq!(sniff(routed), want);
        let none = Sniffed::Response {
            routed: false,
            generated: None,
        };
        assert_eq!(sniff(br#"{"choices":[]}"#), none);
        let Sniffed::ErrorReply(m) = sniff(br#"{"object":"error","message":"no model"}"#) else {
            panic!()
        };
        assert_eq!(m, "\"no model\"");
    }
}
