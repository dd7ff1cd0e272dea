//! vLLM's disaggregated-serving protocol as the proxy speaks it: the client's body checked, and
//! what prefill and decode each receive. The client's fields are kept as their raw JSON text
//! (field order and number spelling included); only the fields the protocol sets are rewritten.

use indexmap::IndexMap;
use serde_json::value::RawValue;

use super::config::PromptRouting;
use super::fault::{push_json_string, Blame, Fault};

/// Nesting the proxy passes on (objects and arrays, the body itself included). JSON readers
/// upstream are recursive; a deeper body is the client's error, found before any upstream call.
pub const MAX_DEPTH: usize = 256;

/// What vLLM's disaggregated prefill expects: compute the prompt, keep the KV cache for a
/// remote decode, return the parameters the decode server needs to fetch it.
pub const PREFILL_KV_TRANSFER_PARAMS: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// The header that carries a request's id, to the upstreams and back to the client.
pub const REQUEST_ID: &str = "x-request-id";

/// The endpoints the proxy serves, each with its own request shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions` (`max_completion_tokens` beside `max_tokens`).
    Chat,
    /// vLLM's token-in/token-out `/inference/v1/generate` (0.22+): `token_ids`, with the
    /// sampling settings, `routed_experts_prompt_start` among them, in `sampling_params`.
    Generate,
}

impl Api {
    /// Every endpoint, as its path.
    pub const PATHS: [(&'static str, Api); 3] = [
        ("/v1/completions", Api::Completions),
        ("/v1/chat/completions", Api::Chat),
        ("/inference/v1/generate", Api::Generate),
    ];

    /// The endpoint at exactly `path`.
    pub fn of(path: &str) -> Option<(&'static str, Api)> {
        Api::PATHS.into_iter().find(|(p, _)| *p == path)
    }
}

/// A client's completion request, its top-level fields as raw JSON text.
#[derive(Debug)]
pub struct ClientBody {
    api: Api,
    fields: IndexMap<String, Box<RawValue>>,
    /// `sampling_params` of a generate request, its fields as raw JSON text.
    sampling: Option<IndexMap<String, Box<RawValue>>>,
    /// `routed_experts_prompt_start`: where the client wants routing to start.
    pub start: Option<u64>,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// `stream_options.include_usage` of a stream request: its last chunk carries `usage`.
    pub include_usage: bool,
    /// `routed_experts_prompt_routing`: how the client wants its choices' prompt rows answered
    /// (the proxy's `prompt_routing` when not given). The proxy's field: no engine receives it.
    pub prompt_routing: Option<PromptRouting>,
    /// The key of the request's `session_id` (vLLM's stable identity of related requests,
    /// such as a rollout's turns): its turns go to the same servers.
    pub session: Option<u64>,
}

impl ClientBody {
    /// Read the client's body; anything the proxy cannot pass on is a 400 naming what is
    /// wrong: invalid UTF-8, not JSON (NaN and Infinity are not), not an object, nested past
    /// [`MAX_DEPTH`], a `routed_experts_prompt_start` that is not a non-negative integer, a
    /// `stream` that is not a boolean; for a generate request, `sampling_params` that is not an
    /// object.
    pub fn parse(raw: &[u8], api: Api) -> Result<Self, Fault> {
        let bad =
            |why: String| Fault::new(Blame::Client, 400, format!("invalid request body: {why}"));
        if !simdutf::validate_utf8(raw) {
            return Err(bad("not UTF-8 text".into()));
        }
        let depth = nesting(raw);
        if depth > MAX_DEPTH {
            return Err(bad(format!(
                "the request body cannot be written back as JSON (nested {depth} levels deep, \
                 over the limit of {MAX_DEPTH})"
            )));
        }
        let fields: IndexMap<String, Box<RawValue>> = match serde_json::from_slice(raw) {
            Ok(f) => f,
            Err(e) if e.classify() == serde_json::error::Category::Data => {
                return Err(bad("the request body must be a JSON object".into()))
            }
            Err(e) => return Err(bad(format!("not JSON ({e})"))),
        };
        let sampling = match (api, fields.get("sampling_params").map(|v| v.get())) {
            (Api::Generate, Some(text)) if text != "null" => Some(
                serde_json::from_str::<IndexMap<String, Box<RawValue>>>(text).map_err(|_| {
                    Fault::bad_field(
                        "sampling_params",
                        format!(
                            "invalid request body: sampling_params must be an object, got {}",
                            clip(text)
                        ),
                    )
                })?,
            ),
            _ => None,
        };
        let start_field = match api {
            Api::Generate => sampling
                .as_ref()
                .and_then(|f| f.get("routed_experts_prompt_start")),
            _ => fields.get("routed_experts_prompt_start"),
        };
        let start = match start_field.map(|v| v.get()) {
            None | Some("null") => None,
            Some(text) => Some(text.parse::<u64>().map_err(|_| {
                Fault::bad_field(
                    "routed_experts_prompt_start",
                    format!(
                        "invalid request body: routed_experts_prompt_start must be a \
                         non-negative integer, got {}",
                        clip(text)
                    ),
                )
            })?),
        };
        let stream = match fields.get("stream").map(|v| v.get()) {
            None | Some("null") | Some("false") => false,
            Some("true") => true,
            Some(text) => {
                return Err(Fault::bad_field(
                    "stream",
                    format!(
                        "invalid request body: stream must be true or false, got {}",
                        clip(text)
                    ),
                ))
            }
        };
        // Anything but an object with `include_usage: true` asks for no usage chunk; the
        // engine judges the field as a whole where the stream is relayed.
        let include_usage = stream
            && fields.get("stream_options").is_some_and(|v| {
                serde_json::from_str::<IndexMap<String, Box<RawValue>>>(v.get())
                    .is_ok_and(|o| o.get("include_usage").is_some_and(|u| u.get() == "true"))
            });
        let prompt_routing = match fields.get(PROMPT_ROUTING).map(|v| v.get()) {
            None | Some("null") => None,
            Some(text) => Some(
                serde_json::from_str::<String>(text)
                    .map_err(|_| format!("a string, got {}", clip(text)))
                    .and_then(|name| PromptRouting::parse(&name))
                    .map_err(|e| {
                        Fault::bad_field(
                            PROMPT_ROUTING,
                            format!("invalid request body: {PROMPT_ROUTING}: {e}"),
                        )
                    })?,
            ),
        };
        let session = match fields.get("session_id").map(|v| v.get()) {
            None | Some("null") => None,
            Some(text) => Some(super::policy::session_key(text.as_bytes())),
        };
        Ok(ClientBody {
            api,
            fields,
            sampling,
            start,
            stream,
            include_usage,
            prompt_routing,
            session,
        })
    }

    /// The endpoint the request was sent to.
    pub fn api(&self) -> Api {
        self.api
    }

    /// The request for the prefill server: one token of one choice, no streaming, KV cache
    /// kept for decode. `n` is 1 where the client gave one: the prompt's KV and routing are the
    /// same for every choice, so prefill computes and sends them once, and decode generates the
    /// client's `n` choices from that one cache (format.md §4; a prefill body with one choice's
    /// routing serves every decode choice). `min_tokens` and `min_completion_tokens` are for
    /// decode only (vLLM refuses them above `max_tokens`); every other field goes through
    /// unchanged. A generate request's token limits and `n` are in its `sampling_params`.
    pub fn prefill_request(&self) -> Vec<u8> {
        let one = raw("1");
        let mut f = self.fields.clone();
        match (&self.api, &self.sampling) {
            (Api::Generate, sampling) => {
                let mut s = sampling.clone().unwrap_or_default();
                s.insert("max_tokens".into(), one.clone());
                s.shift_remove("min_tokens");
                if s.contains_key("n") {
                    s.insert("n".into(), one);
                }
                f.insert("sampling_params".into(), object_value(&s));
            }
            (api, _) => {
                if f.contains_key("n") {
                    f.insert("n".into(), one.clone());
                }
                f.insert("max_tokens".into(), one.clone());
                if *api == Api::Chat || f.contains_key("max_completion_tokens") {
                    f.insert("max_completion_tokens".into(), one);
                }
                f.shift_remove("min_tokens");
                f.shift_remove("min_completion_tokens");
            }
        }
        f.shift_remove("stream_options");
        for key in STEERING.iter().chain([&PROMPT_ROUTING]) {
            f.shift_remove(*key);
        }
        f.insert("stream".into(), raw("false"));
        f.insert("kv_transfer_params".into(), raw(PREFILL_KV_TRANSFER_PARAMS));
        write_object(f.iter())
    }

    /// The request for the decode server: the client's, with the `kv_transfer_params` prefill
    /// returned (their raw JSON text) or, when it returned none, `null`: never the client's own,
    /// which could point a decode engine at any host and blocks. [`STEERING`] fields are dropped.
    /// With `start`, routing is asked from that position (`routed_experts_prompt_start`, in
    /// `sampling_params` for a generate request): a decode engine must never be asked for the
    /// rows of prompt positions whose KV it received rather than computed (vLLM 0.32 dies).
    pub fn decode_request(&self, kv_transfer_params: Option<&[u8]>, start: Option<u64>) -> Vec<u8> {
        self.decode_fields(kv_transfer_params, start, false)
    }

    /// [`decode_request`](Self::decode_request) asked without streaming (`stream` false,
    /// `stream_options` dropped): a stream request whose answer the proxy writes as the stream
    /// (`stream_routing` buffered).
    pub fn plain_decode_request(
        &self,
        kv_transfer_params: Option<&[u8]>,
        start: Option<u64>,
    ) -> Vec<u8> {
        self.decode_fields(kv_transfer_params, start, true)
    }

    fn decode_fields(&self, kv: Option<&[u8]>, start: Option<u64>, plain: bool) -> Vec<u8> {
        let mut fields = self.fields.clone();
        fields.retain(|k, _| {
            k != "kv_transfer_params" && k != PROMPT_ROUTING && !STEERING.contains(&k.as_str())
        });
        if plain && self.stream {
            fields.insert("stream".into(), raw("false"));
            fields.shift_remove("stream_options");
        }
        if let Some(s) = start {
            let at = raw(&s.to_string());
            match self.api {
                Api::Generate => {
                    let mut sp = self.sampling.clone().unwrap_or_default();
                    sp.insert("routed_experts_prompt_start".into(), at);
                    fields.insert("sampling_params".into(), object_value(&sp));
                }
                _ => {
                    fields.insert("routed_experts_prompt_start".into(), at);
                }
            }
        }
        let mut out = write_object(fields.iter());
        out.pop(); // the closing brace
        if out.len() > 1 {
            out.push(b',');
        }
        out.extend_from_slice(br#""kv_transfer_params":"#);
        out.extend_from_slice(kv.unwrap_or(b"null"));
        out.push(b'}');
        out
    }
}

/// The key the project's vLLM plugin reads in a decode request's `kv_transfer_params`
/// (`routed_experts/vllm_plugin.py`'s `MARKER`).
pub const PLUGIN_MARKER: &str = "routed_experts_plugin";

/// Prefill's `kv_transfer_params` (raw JSON text; none or `null` when it returned none) with
/// [`PLUGIN_MARKER`] set to `true`, for decode. Anything but an object or `null` is prefill's
/// fault: the marker has nowhere to go.
pub fn marked_kv_transfer_params(kv: Option<&[u8]>) -> Result<Vec<u8>, Fault> {
    let mut fields: IndexMap<String, Box<RawValue>> = IndexMap::new();
    if let Some(text) = kv.filter(|t| t.trim_ascii() != b"null") {
        fields = serde_json::from_slice(text).map_err(|_| {
            Fault::new(
                Blame::Prefill,
                502,
                "prefill's kv_transfer_params is not a JSON object: decode cannot be marked \
                 for the vLLM plugin (--vllm-plugin mark)",
            )
        })?;
    }
    fields.insert(PLUGIN_MARKER.into(), raw("true"));
    Ok(write_object(fields.iter()))
}

/// Where decode is asked to start its routing, for a prompt of `prompt` tokens whose routing the
/// client wants from `start` (0 if not given): `max(start, prompt - 1)`. Decode computes at least
/// the prompt's last position itself (an engine always recomputes it, for the first token's
/// logits); positions before it may have come over the KV connector, and their rows are
/// prefill's. `prompt - 1`, not `prompt`: vLLM 0.24's generate asserts
/// `routed_experts_prompt_start < prompt tokens` and kills its engine on `prompt`; the one row
/// both halves then hold is taken from prefill by the merge (format.md §4).
pub fn decode_start(prompt: u64, start: Option<u64>) -> u64 {
    start.unwrap_or(0).max(prompt.saturating_sub(1))
}

/// The request field a client chooses its answer's prompt rows with (format.md §4.1): the
/// proxy's own, taken out of what the engines receive.
pub const PROMPT_ROUTING: &str = "routed_experts_prompt_routing";

/// Fields of a client's body that would steer an engine's disaggregated-serving machinery
/// (where to fetch caches from): the proxy decides those, so a client's are not forwarded.
/// `kv_transfer_params` is set for each side; vLLM's encoder-cache transfer
/// (`ec_transfer_params`, 0.26+) is not the proxy's to give, and is dropped.
pub const STEERING: [&str; 1] = ["ec_transfer_params"];

fn raw(text: &str) -> Box<RawValue> {
    RawValue::from_string(text.to_string()).expect("constant JSON")
}

/// `fields` written as one JSON object value (a rewritten `sampling_params`).
fn object_value(fields: &IndexMap<String, Box<RawValue>>) -> Box<RawValue> {
    let text = String::from_utf8_lossy(&write_object(fields.iter())).into_owned();
    RawValue::from_string(text).expect("an object written from JSON values")
}

fn write_object<'a>(fields: impl Iterator<Item = (&'a String, &'a Box<RawValue>)>) -> Vec<u8> {
    let mut out = String::from("{");
    for (i, (k, v)) in fields.enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_json_string(&mut out, k);
        out.push(':');
        out.push_str(v.get());
    }
    out.push('}');
    out.into_bytes()
}

/// The deepest nesting of objects and arrays in `raw` (brackets inside strings skipped). Only
/// bounds what is passed on; the JSON itself is checked by the parser.
fn nesting(raw: &[u8]) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &b in raw {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// At most 64 characters of a client's value, for an error message.
fn clip(text: &str) -> String {
    match text.char_indices().nth(64) {
        Some((i, _)) => format!("{}...", &text[..i]),
        None => text.to_string(),
    }
}

/// A client's `X-Request-Id` is kept when it is 1 to 128 printable ASCII characters without
/// spaces, so it can neither bloat every upstream request nor forge fields in the log line.
pub fn acceptable_request_id(id: &[u8]) -> bool {
    (1..=128).contains(&id.len()) && id.iter().all(|b| (b'!'..=b'~').contains(b))
}

#[cfg(test)]
mod tests;
