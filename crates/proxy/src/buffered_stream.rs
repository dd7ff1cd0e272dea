//! A stream request answered from a plain one (`stream_routing` buffered). vLLM sends no
//! routing on `/v1/completions` or `/v1/chat/completions` streams, so such a request's decode
//! is asked plainly and its merged answer is written as the OpenAI event stream the client
//! asked for: each choice's content, then its finishing chunk carrying every other field of
//! the choice (the routing where the plain body had it), then the body's other top-level
//! fields and, when `stream_options.include_usage` asked, its `usage`, then `data: [DONE]`.
//! Values are copied as their JSON text, never read into numbers or rewritten.

use bytes::Bytes;
use indexmap::IndexMap;
use serde_json::value::RawValue;

use routed_experts::body::BodyRouting;
use routed_experts::response::{merge_response_found, MergeOptions};

use super::fault::{merge_fault, push_json_string, Blame, Fault};
use super::parts::{shared_parts, Part};
use super::request::Api;

/// Top-level fields every chunk repeats (`object` is set per chunk).
const HEAD: [&str; 3] = ["id", "created", "model"];

/// Fields of a choice its content chunk carries; the rest go on its finishing chunk.
const CONTENT: [&str; 5] = ["index", "text", "message", "logprobs", "finish_reason"];

type Fields<'a> = IndexMap<String, &'a RawValue>;

/// The event stream for the plain answer `body` of a completions (`Api::Completions`) or chat
/// request; `include_usage`: the client's `stream_options.include_usage`. An answer that is
/// not an object with a `choices` array of objects is decode's fault (it was merged from it).
pub(crate) fn events_from_body(
    body: &[u8],
    api: Api,
    include_usage: bool,
) -> Result<Vec<u8>, Fault> {
    let bad = |why: &str| {
        Fault::new(
            Blame::Decode,
            502,
            format!("decode's answer cannot be written as a stream: {why}"),
        )
    };
    let top: Fields = serde_json::from_slice(body).map_err(|_| bad("not a JSON object"))?;
    let choices = top.get("choices").ok_or_else(|| bad("no choices"))?;
    let choices: Vec<Fields> = serde_json::from_str(choices.get())
        .map_err(|_| bad("choices is not an array of objects"))?;
    let chat = api == Api::Chat;
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let mut out = Vec::with_capacity(body.len() + 512 * (choices.len() + 2));
    for (position, choice) in choices.iter().enumerate() {
        let index = choice
            .get("index")
            .map_or(position.to_string(), |v| v.get().into());
        let (mut content, mut finishing) = (Object::new(), Object::new());
        content.field("index", &index);
        finishing.field("index", &index);
        if chat {
            let message = choice
                .get("message")
                .ok_or_else(|| bad("a choice has no message"))?;
            let delta = as_delta(message).map_err(|_| bad("a message is not an object"))?;
            content.field("delta", &delta);
            finishing.field("delta", "{}");
        } else {
            content.field("text", choice.get("text").map_or("\"\"", |v| v.get()));
            finishing.field("text", "\"\"");
        }
        content
            .field(
                "logprobs",
                choice.get("logprobs").map_or("null", |v| v.get()),
            )
            .field("finish_reason", "null");
        finishing
            .field("logprobs", "null")
            .field(
                "finish_reason",
                choice.get("finish_reason").map_or("null", |v| v.get()),
            )
            .fields(
                choice
                    .iter()
                    .filter(|(k, _)| !CONTENT.contains(&k.as_str())),
            );
        let (content, finishing) = (content.close(), finishing.close());
        for part in [content, finishing] {
            write_chunk(&mut out, &top, object, &part, std::iter::empty());
        }
    }
    let rest = top.iter().filter(|(k, _)| {
        !HEAD.contains(&k.as_str()) && !matches!(k.as_str(), "object" | "choices" | "usage")
    });
    let usage = top.get_key_value("usage").filter(|_| include_usage);
    if rest.clone().next().is_some() || usage.is_some() {
        write_chunk(&mut out, &top, object, "", rest.chain(usage));
    }
    out.extend_from_slice(b"data: [DONE]\n\n");
    Ok(out)
}

/// The events of `decode_body` (decode's plain answer, its routing not yet merged;
/// [`events_from_body`]) as parts with each event's routing merged with prefill's: slices of
/// the events' text and of prefill's body, prefill's rows written as they are sent. So a
/// group's stream is written from the one copy of the prompt's rows prefill sent, never
/// assembled `n` times over. The whole decode body was merged (and so checked) first:
/// `opts.require_routing` is dropped here, since most events carry no routing.
pub(crate) fn merged_events(
    decode_body: &[u8],
    api: Api,
    include_usage: bool,
    prefill: (&Bytes, &BodyRouting<'_>),
    opts: MergeOptions,
) -> Result<Vec<Part>, Fault> {
    let events = Bytes::from(events_from_body(decode_body, api, include_usage)?);
    let opts = MergeOptions {
        require_routing: false,
        defer_recode: true,
        ..opts
    };
    let mut parts = Vec::new();
    let mut at = 0;
    while at < events.len() {
        // Every event is one `data: ` line and a blank line (`write_chunk`).
        let end = find(&events[at..], b"\n\n").map_or(events.len(), |i| at + i + 2);
        let json = at + b"data: ".len()..end - 2;
        if !events[json.clone()].starts_with(b"{") {
            parts.push(Part::Ready(events.slice(at..end)));
            at = end;
            continue;
        }
        parts.push(Part::Ready(events.slice(at..json.start)));
        let event = &events[json.clone()];
        let mut spliced =
            merge_response_found(prefill.0, prefill.1, event, opts).map_err(merge_fault)?;
        parts.extend(shared_parts(&mut spliced, &[prefill.0, &events]).map_err(merge_fault)?);
        parts.push(Part::Ready(events.slice(json.end..end)));
        at = end;
    }
    Ok(parts)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// One `data:` event: the head fields, `object`, the choices (`choices`: their JSON, joined)
/// and `extra` fields.
fn write_chunk<'a>(
    out: &mut Vec<u8>,
    top: &Fields,
    object: &str,
    choices: &str,
    extra: impl Iterator<Item = (&'a String, &'a &'a RawValue)>,
) {
    let mut chunk = Object::new();
    for key in HEAD {
        if let Some(v) = top.get(key) {
            chunk.field(key, v.get());
        }
    }
    chunk.field("object", &format!("\"{object}\""));
    let list = chunk.key("choices");
    list.push('[');
    list.push_str(choices);
    list.push(']');
    chunk.fields(extra);
    let mut text = chunk.close();
    // A line break in valid JSON text is white space between tokens (inside a string it would
    // be escaped): a space in its place keeps the value and the event on one `data:` line.
    if text.contains(['\n', '\r']) {
        text = text.replace(['\n', '\r'], " ");
    }
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// A JSON object written a field at a time, each value as its JSON text (never read or
/// rewritten): the commas between fields are placed here, once.
struct Object {
    text: String,
    empty: bool,
}

impl Object {
    fn new() -> Object {
        Object {
            text: String::from("{"),
            empty: true,
        }
    }

    /// Start the field `key`: the text its value is to be written to.
    fn key(&mut self, key: &str) -> &mut String {
        if !self.empty {
            self.text.push(',');
        }
        self.empty = false;
        push_json_string(&mut self.text, key);
        self.text.push(':');
        &mut self.text
    }

    /// The field `key` with the JSON text `value`.
    fn field(&mut self, key: &str, value: &str) -> &mut Object {
        self.key(key).push_str(value);
        self
    }

    /// Each of `fields` as it is.
    fn fields<'a>(
        &mut self,
        fields: impl Iterator<Item = (&'a String, &'a &'a RawValue)>,
    ) -> &mut Object {
        for (k, v) in fields {
            self.field(k, v.get());
        }
        self
    }

    fn close(mut self) -> String {
        self.text.push('}');
        self.text
    }
}

/// A chat `message` as a stream's `delta`: the same fields, with each tool call given the
/// `index` stream deltas carry (clients join a tool call's pieces by it).
fn as_delta(message: &RawValue) -> Result<String, serde_json::Error> {
    let fields: Fields = serde_json::from_str(message.get())?;
    let calls: Option<Vec<Fields>> = match fields.get("tool_calls") {
        Some(v) if v.get().trim_start().starts_with('[') => Some(serde_json::from_str(v.get())?),
        _ => None,
    };
    let Some(calls) = calls.filter(|c| !c.is_empty()) else {
        return Ok(message.get().to_string());
    };
    let mut delta = Object::new();
    for (k, v) in &fields {
        if k != "tool_calls" {
            delta.field(k, v.get());
            continue;
        }
        let with_index: Vec<String> = calls
            .iter()
            .enumerate()
            .map(|(n, call)| {
                let mut one = Object::new();
                one.field(
                    "index",
                    &call.get("index").map_or(n.to_string(), |v| v.get().into()),
                )
                .fields(call.iter().filter(|(k, _)| k.as_str() != "index"));
                one.close()
            })
            .collect();
        delta.field(k, &format!("[{}]", with_index.join(",")));
    }
    Ok(delta.close())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn events(body: &Value, api: Api, usage: bool) -> Vec<Value> {
        let out = events_from_body(body.to_string().as_bytes(), api, usage).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        text.split("\n\n")
            .filter(|e| !e.is_empty() && *e != "data: [DONE]")
            .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
            .collect()
    }

    fn completion() -> Value {
        json!({"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
               "choices": [
                 {"index": 0, "text": "ab", "logprobs": null, "finish_reason": "length",
                  "stop_reason": null, "token_ids": [1, 2], "routed_experts": "AAA="},
                 {"index": 1, "text": "cd", "logprobs": {"tokens": ["c", "d"]},
                  "finish_reason": "stop", "routed_experts": "BBB="}],
               "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
               "system_fingerprint": "fp", "kv_transfer_params": null})
    }

    #[test]
    fn each_choice_streams_its_content_then_a_finishing_chunk_with_the_rest() {
        let ev = events(&completion(), Api::Completions, false);
        assert_eq!(ev.len(), 5);
        for e in &ev {
            assert_eq!(
                (&e["id"], &e["object"], &e["created"], &e["model"]),
                (
                    &json!("cmpl-1"),
                    &json!("text_completion"),
                    &json!(7),
                    &json!("m")
                )
            );
        }
        assert_eq!(
            ev[0]["choices"],
            json!([{"index": 0, "text": "ab", "logprobs": null,
                                             "finish_reason": null}])
        );
        assert_eq!(
            ev[1]["choices"],
            json!([{"index": 0, "text": "", "logprobs": null,
            "finish_reason": "length", "stop_reason": null, "token_ids": [1, 2],
            "routed_experts": "AAA="}])
        );
        assert_eq!(
            ev[2]["choices"][0]["logprobs"],
            json!({"tokens": ["c", "d"]})
        );
        assert_eq!(ev[3]["choices"][0]["routed_experts"], "BBB=");
        // The body's other fields close the stream; usage only when asked.
        assert_eq!(ev[4]["choices"], json!([]));
        assert_eq!(
            (&ev[4]["system_fingerprint"], &ev[4]["kv_transfer_params"]),
            (&json!("fp"), &Value::Null)
        );
        assert!(ev[4].get("usage").is_none());
        let with = events(&completion(), Api::Completions, true);
        assert_eq!(with[4]["usage"]["total_tokens"], 7);
    }

    #[test]
    fn a_chat_message_is_the_delta_and_tool_calls_get_their_index() {
        let body = json!({"id": "c", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi",
                "tool_calls": [{"id": "t", "type": "function",
                                "function": {"name": "f", "arguments": "{}"}}]},
                "logprobs": null, "finish_reason": "tool_calls", "routed_experts": "AA=="}]});
        let ev = events(&body, Api::Chat, true);
        assert_eq!(
            ev.len(),
            2,
            "no other top-level fields and no usage: no closing chunk"
        );
        assert_eq!(ev[0]["object"], "chat.completion.chunk");
        let delta = &ev[0]["choices"][0]["delta"];
        assert_eq!(
            (&delta["role"], &delta["content"]),
            (&json!("assistant"), &json!("hi"))
        );
        assert_eq!(delta["tool_calls"][0]["index"], 0);
        assert_eq!(delta["tool_calls"][0]["function"]["name"], "f");
        assert_eq!(ev[1]["choices"][0]["delta"], json!({}));
        assert_eq!(ev[1]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(ev[1]["choices"][0]["routed_experts"], "AA==");
    }

    #[test]
    fn values_are_copied_as_their_text() {
        let body = br#"{"id":"x","created":1,"model":"m","choices":[{"index":0,"text":"\u00e9",
            "finish_reason":null,"big":123456789012345678901234567890,"routed_experts":"A"}]}"#;
        let out = events_from_body(body, Api::Completions, false).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains(r#""text":"\u00e9""#), "{text}");
        assert!(text.contains("123456789012345678901234567890"), "{text}");
    }

    #[test]
    fn line_breaks_between_tokens_never_split_an_event() {
        let body = b"{\"choices\":[{\"index\":0,\"text\":\"a\\n\",\r\n\"finish_reason\":\n\n\"stop\",\n\"logprobs\":{\"x\":\n\n[1]}}],\n\n\"usage\":{}}";
        let out = events_from_body(body, Api::Completions, true).unwrap();
        let text = String::from_utf8(out).unwrap();
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 4, "{text}");
        assert!(events
            .iter()
            .all(|e| e.starts_with("data: ") && !e.contains(['\n', '\r'])));
        let finishing: Value = serde_json::from_str(&events[1][6..]).unwrap();
        assert_eq!(finishing["choices"][0]["finish_reason"], "stop");
        let content: Value = serde_json::from_str(&events[0][6..]).unwrap();
        assert_eq!(content["choices"][0]["text"], "a\n");
        assert_eq!(content["choices"][0]["logprobs"], json!({"x": [1]}));
    }

    #[test]
    fn a_groups_events_are_merged_one_by_one_from_one_copy_of_the_prompt() {
        use routed_experts::body::read_body;
        use routed_experts::{merge_response, MergeOptions, DEFAULT_MAX_BYTES};
        let prefill = Bytes::from_static(
            br#"{"choices":[{"index":0,"text":"x","routed_experts":{"data":"CgsUFR4f","shape":[3,1,2],"start":0,"dtype":"uint8"}}]}"#,
        );
        // Two choices, each from position 2 (P - 1): rows [2, 4).
        let decode = br#"{"id":"c","created":1,"model":"m","choices":[{"index":0,"text":"ab","finish_reason":"length","routed_experts":{"data":"FBUoKQ==","shape":[2,1,2],"start":2,"dtype":"uint8"}},{"index":1,"text":"cd","finish_reason":"length","routed_experts":{"data":"FBUyMw==","shape":[2,1,2],"start":2,"dtype":"uint8"}}],"usage":{"prompt_tokens":3,"completion_tokens":4}}"#;
        let opts = MergeOptions::new(DEFAULT_MAX_BYTES);
        let routing = read_body(&prefill).unwrap();
        let parts =
            merged_events(decode, Api::Completions, true, (&prefill, &routing), opts).unwrap();
        let mut sent = Vec::new();
        for part in parts {
            match part {
                Part::Ready(b) => sent.extend_from_slice(&b),
                Part::Recoded { .. } => unreachable!("compact halves are spliced"),
            }
        }
        // The same stream as the events of the whole merged body.
        let merged = merge_response(&prefill, decode, opts).unwrap();
        let want = events_from_body(&merged, Api::Completions, true).unwrap();
        assert_eq!(
            String::from_utf8(sent).unwrap(),
            String::from_utf8(want).unwrap()
        );
    }

    #[test]
    fn an_answer_that_is_not_a_completion_is_decodes_fault() {
        for body in [
            &b"[1]"[..],
            b"{}",
            br#"{"choices":{}}"#,
            br#"{"choices":[1]}"#,
            br#"{"choices":[{"index":0}]}"#,
        ] {
            let api = if body.ends_with(b"0}]}") {
                Api::Chat
            } else {
                Api::Completions
            };
            let e = events_from_body(body, api, false).unwrap_err();
            assert_eq!((e.side, e.status), (Blame::Decode, 502), "{body:?}");
            assert!(
                e.message.contains("cannot be written as a stream"),
                "{}",
                e.message
            );
        }
    }
}
