//! Where routing sits in a response body, and what else the body says about it: one walk finds
//! each routing value (format.md §3.2), vLLM 0.21's separate prompt rows, the token counts the
//! rows are checked against (§3.3), and any routing-like key at a place no producer uses.

pub(crate) mod coverage;
pub(crate) mod not_response;
pub(crate) mod shared_prompt;
pub(crate) mod split;

pub use crate::kernels::runs::Base64Runs;
pub(crate) use not_response::check_response;

use std::ops::Range;

use crate::error::{Error, ErrorKind, Result};
use crate::formats::sidecar::{self, SidecarFields};
pub use crate::formats::Place;
use crate::kernels::jsonscan::{Scanner, Watch};
use crate::kernels::predecoded::Predecoded;
use crate::payload::dtype::DType;

/// One routing value found in a body: the choice it belongs to and where its bytes are.
#[derive(Debug, Clone)]
pub struct Found<'a> {
    /// The choice's index (its `index` key, else its position).
    pub index: u64,
    /// Where the value's bytes are in the body.
    pub span: Range<usize>,
    /// The value's raw JSON text (an object, a string or a list).
    pub text: &'a [u8],
    /// `meta_info.routed_experts_dtype` (SGLang), when the body names one.
    pub dtype: Option<DType>,
    /// Where it was found, e.g. `$.choices[0].routed_experts`.
    pub path: String,
    /// A compact sidecar's fields, read while the body was walked (`None` for other formats).
    pub fields: Option<SidecarFields<'a>>,
    /// The value is a JSON string without escapes: its content is `text` without the quotes,
    /// as read (no second scan to unescape it).
    pub plain_string: bool,
    /// The value is a JSON string whose content the walk found to be base64 characters then at
    /// most two `=` (in the scan that found its end): text copied from it needs only its length
    /// and padding checked.
    pub base64: bool,
    /// The token counts the body gives for this value's sequence (format.md §3.3).
    pub counts: Counts,
    /// The kind of place it was found at.
    pub place: Place,
}

/// Token counts a body states for one choice's sequence: the prompt's length and the number of
/// tokens generated. Either may be unknown; a count is only taken from a place that counts this
/// choice alone (a `usage` shared by several choices gives no generated count).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Prompt tokens, and where the count was read.
    pub prompt: Option<(u64, &'static str)>,
    /// Generated tokens, and where the count was read.
    pub generated: Option<(u64, &'static str)>,
}

impl Counts {
    /// Fill what `self` lacks from `other`.
    fn or(self, other: Counts) -> Counts {
        Counts {
            prompt: self.prompt.or(other.prompt),
            generated: self.generated.or(other.generated),
        }
    }
}

/// Where routing sits in response bodies (format.md §3.2), and who puts it there: the one table the
/// walker below follows, docs/format.md repeats, and error messages quote.
pub const LOCATIONS: &[(&str, &str)] = &[
    (
        "choices[i].routed_experts",
        "vLLM 0.22+ (.npy), vLLM 0.21 (generated rows), prime-rl",
    ),
    (
        "prompt_routed_experts (top level)",
        "vLLM 0.21 (prompt rows of every choice)",
    ),
    ("choices[i].message.routed_experts", "NeMo-RL"),
    (
        "choices[i].meta_info.routed_experts",
        "SGLang chat 0.5.13+ with return_meta_info",
    ),
    (
        "sglext.routed_experts",
        "SGLang chat/completions 0.5.9+ (choice 0)",
    ),
    (
        "meta_info.routed_experts",
        "SGLang /generate, lmdeploy (choice 0, or the position in a batch list)",
    ),
    ("nvext.routed_experts", "NVIDIA Dynamo (choice 0)"),
    (
        "nvext.engine_data.routed_experts",
        "NVIDIA Dynamo, engine data asked for (choice 0)",
    ),
];

pub(crate) const ROUTING_KEY: &[u8] = b"routed_experts";
const PROMPT_ROUTING_KEY: &[u8] = b"prompt_routed_experts";
const DTYPE_KEY: &[u8] = b"routed_experts_dtype";
/// NVIDIA Dynamo's receipt for outputs it moved to its object store (PRs #14385, #14975-#14978).
const ARTIFACT_KEY: &[u8] = b"generation_artifact";
const KV_TRANSFER_PARAMS: &[u8] = b"kv_transfer_params";

/// Whether a key names routing: it contains `routed` then `expert` with nothing but `_`, `-` or
/// nothing between, in any case (`routed_experts`, `routedExperts`, `completion_routed_experts`,
/// `routed_expert_weights`, ...). The walker reads such keys only where [`LOCATIONS`] puts them;
/// anywhere else, a key of this kind is an error naming its path, so a producer that renames or
/// moves its routing is refused, never read as a body without routing (format.md §3.2).
pub fn is_routing_key(key: &[u8]) -> bool {
    const ROUTED: &[u8] = b"routed";
    const EXPERT: &[u8] = b"expert";
    let lower_eq = |text: &[u8], word: &[u8]| {
        text.len() >= word.len()
            && text
                .iter()
                .zip(word)
                .all(|(c, w)| c.to_ascii_lowercase() == *w)
    };
    (0..key.len()).any(|i| {
        if !lower_eq(&key[i..], ROUTED) {
            return false;
        }
        let mut j = i + ROUTED.len();
        while let Some(b'_' | b'-') = key.get(j) {
            j += 1;
        }
        lower_eq(&key[j..], EXPERT)
    })
}

const ROUTING_WATCH: Watch = Watch {
    matches: is_routing_key,
    what: "routing",
};

/// What one walk of a body finds.
#[derive(Debug, Default, Clone)]
pub struct BodyRouting<'a> {
    /// The routing values of the choices, in body order (the top-level holders serve choice 0,
    /// or their position in a top-level array of SGLang batch results).
    pub values: Vec<Found<'a>>,
    /// vLLM 0.21's top-level `prompt_routed_experts`: the prompt rows every choice shares, when
    /// present and not `null`. The choices' values then hold only their generated rows.
    pub prompt: Option<Found<'a>>,
    /// Whether the body has a top-level `prompt_routed_experts` key, even `null` (vLLM 0.21
    /// writes it in every body): its choices' nested lists are then generated rows only.
    pub prompt_key: bool,
    /// Every choice the body has, with or without routing: (index, token counts).
    pub choices: Vec<(u64, Counts)>,
    /// Where a `routed_expert_weights` key sits, if the body has one: readers may skip the
    /// weights, a merge may not (it would pass decode's weights on unmerged).
    pub weights: Option<String>,
    /// Where top-level `kv_transfer_params` sits (vLLM's disaggregated-serving handshake).
    pub(crate) kv_transfer_params: Option<Range<usize>>,
    /// The one routing value still to be decoded as it is read, if any ([`read_body_decoding`]).
    decode: Option<Wanted>,
}

/// Which routing value a walk decodes as it reads it, and its size limit.
#[derive(Debug, Clone, Copy)]
struct Wanted {
    index: u64,
    max_bytes: usize,
}

impl<'a> BodyRouting<'a> {
    /// The routing value of the choice whose index is `choice`.
    pub fn value(&self, choice: u64) -> Option<&Found<'a>> {
        self.values.iter().find(|f| f.index == choice)
    }

    /// The token counts of the choice whose index is `choice` (default when it is absent).
    pub fn counts(&self, choice: u64) -> Counts {
        self.choices
            .iter()
            .find(|(i, _)| *i == choice)
            .map(|(_, c)| *c)
            .unwrap_or_default()
    }

    /// Whether the body carries any routing at all.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty() && self.prompt.is_none()
    }
}

/// Every routing value in `body`, in body order, with the index of its choice, found at the
/// places `LOCATIONS` lists; the top-level holders serve choice 0, or their position in a
/// top-level array of SGLang batch results. A choice with no `index` key takes its position in
/// `choices`; `null` routing is no routing. (vLLM 0.21's prompt rows are not among them:
/// [`read_body`] returns those too.)
///
/// Strict where it matters (format.md §8): a routing-like key ([`is_routing_key`]) anywhere
/// else, or a routing key, `choices` or `index` twice in one object, is a `PayloadError`; keys
/// are compared unescaped. One pass, no DOM: everything else is skipped (strings at memchr
/// speed).
pub fn find_routing(body: &[u8]) -> Result<Vec<Found<'_>>> {
    Ok(read_body(body)?.values)
}

/// Everything [`find_routing`] finds, and vLLM 0.21's prompt rows, each choice's token counts
/// and any routing weights, in the same one walk.
pub fn read_body(body: &[u8]) -> Result<BodyRouting<'_>> {
    walk(body, false, None, None, None)
}

/// [`read_body`] of the skeleton a [`BodyReader`](crate::response::BodyReader) kept: each
/// compact sidecar's `data` placeholder read as the bytes `predecoded` holds for it.
pub(crate) fn read_body_predecoded<'a>(
    skeleton: &'a [u8],
    predecoded: &'a Predecoded,
) -> Result<BodyRouting<'a>> {
    walk(skeleton, false, None, None, Some(predecoded))
}

/// [`read_body`], and the first routing value of choice `index`, when it is a compact sidecar,
/// decoded in the same pass (its `fields.decoded`, up to `max_bytes`): for a reader of that one
/// choice, whose (large) data text is then read once.
pub(crate) fn read_body_decoding(
    body: &[u8],
    index: u64,
    max_bytes: usize,
) -> Result<BodyRouting<'_>> {
    walk(body, false, Some(Wanted { index, max_bytes }), None, None)
}

/// Walk a body; `want_kv` also reads (and polices) top-level `kv_transfer_params`; `runs`, the
/// body's base64 runs found as it arrived; `predecoded`, the strings a reader decoded as it did.
fn walk<'a>(
    body: &'a [u8],
    want_kv: bool,
    decode: Option<Wanted>,
    runs: Option<&Base64Runs>,
    predecoded: Option<&'a Predecoded>,
) -> Result<BodyRouting<'a>> {
    let mut s = Scanner::new(body, "response body")
        .watch(ROUTING_WATCH)
        .with_runs(runs)
        .with_predecoded(predecoded);
    let mut w = BodyRouting {
        decode,
        ..BodyRouting::default()
    };
    if s.peek() == Some(b'[') {
        s.array(|s, i| top_object(s, i as u64, &mut w, false, true))?;
    } else {
        top_object(&mut s, 0, &mut w, want_kv, false)?;
    }
    s.end()?;
    settle_duplicates(&w.values)?;
    if w.prompt_key && w.prompt.is_none() {
        if let Some(f) = w
            .values
            .iter()
            .find(|f| f.place == Place::Choice && f.text.starts_with(b"["))
        {
            return Err(Error::new(
                ErrorKind::Unplaced,
                format!(
                    "response body: {} holds nested lists and prompt_routed_experts is null: vLLM \
                 0.21's generated rows without the prompt's, which cannot be placed",
                    f.path
                ),
            ));
        }
    }
    if let Some(p) = w.prompt.as_ref().filter(|p| p.fields.is_some()) {
        // A shared-prompt answer (format.md §4.1): every choice's value a compact sidecar too.
        if let Some(f) = w.values.iter().find(|f| f.fields.is_none()) {
            return Err(Error::new(
                ErrorKind::Unplaced,
                format!(
                    "response body: a compact prompt_routed_experts (a shared-prompt answer)                      beside routing that is not a compact sidecar at {} (the shared answer                      writes every value as one; the two cannot be joined by position)",
                    f.path
                ),
            )
            .context(&p.path));
        }
    } else if let Some(p) = &w.prompt {
        if let Some(f) = w.values.iter().find(|f| !f.text.starts_with(b"[")) {
            return Err(Error::new(
                ErrorKind::Unplaced,
                format!(
                "response body: top-level prompt_routed_experts (vLLM 0.21's split rows) beside \
                 routing that is not nested lists at {} (no vLLM release writes both shapes; the \
                 two cannot be joined by position)",
                f.path
            ),
            )
            .context(&p.path));
        }
    }
    Ok(w)
}

/// Two values for one choice are an error, except where a producer writes the same routing at
/// two known places: SGLang 0.5.13 to 0.5.18 in `sglext` and in `choices[0].meta_info` (chat
/// with `return_meta_info`), Dynamo in `nvext` and in `nvext.engine_data` (when both are asked
/// for). Such a pair must be the same text; both are kept, so a merge rewrites both, and
/// readers take the first.
fn settle_duplicates(found: &[Found]) -> Result<()> {
    for (i, f) in found.iter().enumerate() {
        if let Some(g) = found[..i].iter().find(|g| g.index == f.index) {
            let echo = echo_pair(&g.path, &f.path);
            if !echo || g.text != f.text {
                let same = if echo { " that differ" } else { "" };
                return Err(Error::new(
                    ErrorKind::Unplaced,
                    format!(
                        "response body: two routing values{same} for choice {}, at {} and at {}",
                        f.index, g.path, f.path
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Whether two paths are a pair of places one producer writes the same routing to.
fn echo_pair(a: &str, b: &str) -> bool {
    let kind = |p: &str| {
        if p == "$.sglext.routed_experts" {
            Some(0)
        } else if p.starts_with("$.choices[") && p.ends_with("].meta_info.routed_experts") {
            Some(1)
        } else if p == "$.nvext.routed_experts" {
            Some(2)
        } else if p == "$.nvext.engine_data.routed_experts" {
            Some(3)
        } else {
            None
        }
    };
    matches!(
        (kind(a), kind(b)),
        (Some(0), Some(1)) | (Some(1), Some(0)) | (Some(2), Some(3)) | (Some(3), Some(2))
    )
}

/// What a prefill/decode proxy reads from a prefill body before it calls decode, in one walk
/// of the body (the same walk as [`read_body`], none of the routing decoded).
#[derive(Debug)]
pub struct PrefillBody<'a> {
    /// The raw JSON text of top-level `kv_transfer_params` (what the decode request must carry
    /// for vLLM's KV connector), or `None` when the key is absent or `null`.
    pub kv_transfer_params: Option<&'a [u8]>,
    /// The routing, as [`read_body`] finds it.
    pub routing: BodyRouting<'a>,
}

/// Read a prefill body as a proxy needs it: `kv_transfer_params` and the routing, strict as
/// [`read_body`] is (a `kv_transfer_params` key given twice is a `PayloadError` too: the two
/// halves of a request must never be joined by a guess).
pub fn read_prefill(body: &[u8]) -> Result<PrefillBody<'_>> {
    read_prefill_scanned(body, None)
}

/// [`read_prefill`] of a body whose long base64 runs were found as it arrived (`runs`, built
/// over exactly these bytes; ignored otherwise): a routing string among them is not scanned
/// again. The result is the same as `read_prefill`'s.
pub fn read_prefill_scanned<'a>(
    body: &'a [u8],
    runs: Option<&Base64Runs>,
) -> Result<PrefillBody<'a>> {
    let w = walk(body, true, None, runs, None)?;
    let kv_transfer_params = w
        .kv_transfer_params
        .clone()
        .map(|r| &body[r])
        .filter(|t| *t != b"null");
    Ok(PrefillBody {
        kv_transfer_params,
        routing: w,
    })
}

/// The keys of one object that may each appear once (their index in a caller's list).
struct Once<const N: usize> {
    keys: [&'static [u8]; N],
    seen: [bool; N],
}

impl<const N: usize> Once<N> {
    fn new(keys: [&'static [u8]; N]) -> Self {
        Once {
            keys,
            seen: [false; N],
        }
    }

    /// Mark `key` seen; a second time is an error.
    fn see(&mut self, s: &Scanner, key: &[u8]) -> Result<()> {
        if let Some(i) = self.keys.iter().position(|k| *k == key) {
            if std::mem::replace(&mut self.seen[i], true) {
                return Err(s.duplicate(key));
            }
        }
        Ok(())
    }
}

/// The token counts one object states directly (`usage`, `meta_info`, a choice).
#[derive(Default)]
struct Stated {
    counts: Counts,
    /// `usage.completion_tokens`: the sum over every choice, so only one choice's count when
    /// the body has one choice.
    usage_generated: Option<u64>,
}

/// One top-level object: its choices, its routing holders, its counts, and (when `want_kv`)
/// the span of its `kv_transfer_params`.
fn top_object<'a>(
    s: &mut Scanner<'a>,
    position: u64,
    w: &mut BodyRouting<'a>,
    want_kv: bool,
    in_list: bool,
) -> Result<()> {
    if s.peek() != Some(b'{') {
        return Err(s.error("a JSON object"));
    }
    let first_value = w.values.len();
    let first_choice = w.choices.len();
    let mut stated = Stated::default();
    let mut once = Once::new([
        b"choices",
        b"meta_info",
        b"nvext",
        b"sglext",
        b"usage",
        b"prompt_token_ids",
        PROMPT_ROUTING_KEY,
    ]);
    s.object(|s, key| {
        once.see(s, key)?;
        match key {
            KV_TRANSFER_PARAMS if want_kv => {
                if w.kv_transfer_params.is_some() {
                    return Err(s.duplicate(key));
                }
                w.kv_transfer_params = Some(s.value()?);
                Ok(())
            }
            b"choices" => match s.peek() {
                Some(b'[') => s.array(|s, i| choice(s, i as u64, w)),
                Some(b'n') => s.value().map(drop),
                _ => Err(s.error("a list of choices").context("`choices`")),
            },
            b"meta_info" => holder(
                s,
                (position, &mut w.decode),
                &mut w.values,
                Holder::Sglang,
                Some(&mut stated.counts),
            ),
            b"nvext" => holder(
                s,
                (position, &mut w.decode),
                &mut w.values,
                Holder::Nvext,
                None,
            ),
            b"sglext" => holder(
                s,
                (position, &mut w.decode),
                &mut w.values,
                Holder::Sglang,
                None,
            ),
            b"usage" => usage(s, &mut stated),
            b"prompt_token_ids" => {
                if let Some(n) = list_len(s)? {
                    stated.counts.prompt = Some((n, "prompt_token_ids"));
                }
                Ok(())
            }
            // Dynamo's receipt on /inference/v1/generate.
            ARTIFACT_KEY => artifact_receipt(s),
            // vLLM 0.21 puts it at the top of a body (never in an SGLang batch list).
            PROMPT_ROUTING_KEY if !in_list => {
                let mut one = Vec::new();
                routing_value(s, (0, &mut None), Place::Prompt, &mut one)?;
                w.prompt_key = true;
                w.prompt = one.pop();
                Ok(())
            }
            _ => s.skip_member(key),
        }
    })?;
    // Counts stated at the top serve every choice that states none of its own; usage's
    // generated count only when it counts one choice.
    let one_choice = w.choices.len() - first_choice <= 1;
    let top = Counts {
        generated: stated.counts.generated.or(stated
            .usage_generated
            .filter(|_| one_choice)
            .map(|n| (n, "usage.completion_tokens"))),
        ..stated.counts
    };
    for (_, c) in &mut w.choices[first_choice..] {
        // A choice's `token_ids` count its generated tokens only beside a list of prompt ids
        // (vLLM writes both when asked for token ids): in a stream, `token_ids` is the event's
        // delta, and the first event, the only one with prompt ids, holds every token so far.
        let ids = |p: Option<(u64, &str)>| p.is_some_and(|(_, at)| at == "prompt_token_ids");
        if !ids(c.prompt) && !ids(top.prompt) {
            c.generated = c.generated.filter(|(_, at)| *at != "token_ids");
        }
        *c = c.or(top);
    }
    if w.choices.len() == first_choice {
        // No choices list: the top-level holders are the choice (SGLang, Dynamo).
        w.choices.push((position, top));
    }
    for f in &mut w.values[first_value..] {
        f.counts = w.choices[first_choice..]
            .iter()
            .find(|(i, _)| *i == f.index)
            .map_or(top, |(_, c)| *c);
    }
    Ok(())
}

/// `usage`: `prompt_tokens` and `completion_tokens` (other members skipped, under the watch).
fn usage(s: &mut Scanner, stated: &mut Stated) -> Result<()> {
    if s.peek() != Some(b'{') {
        return s.value().map(drop);
    }
    let mut once = Once::new([b"prompt_tokens", b"completion_tokens"]);
    s.object(|s, key| {
        once.see(s, key)?;
        match key {
            b"prompt_tokens" => {
                if let Some(n) = count(s, "usage.prompt_tokens")? {
                    let top = stated.counts.prompt.or(Some((n, "usage.prompt_tokens")));
                    stated.counts.prompt = top;
                }
                Ok(())
            }
            b"completion_tokens" => {
                stated.usage_generated = count(s, "usage.completion_tokens")?;
                Ok(())
            }
            _ => s.skip_member(key),
        }
    })
}

/// A token count: a non-negative integer, or `null` (no count).
fn count(s: &mut Scanner, field: &str) -> Result<Option<u64>> {
    let r = s.value()?;
    let text = &s.buf()[r];
    if text == b"null" {
        return Ok(None);
    }
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse::<u64>().ok())
        .map(Some)
        .ok_or_else(|| {
            Error::field(
                field,
                "a non-negative integer",
                String::from_utf8_lossy(text),
            )
            .context("response body")
        })
}

/// The length of a list of token ids (`null` or anything not a list: no count).
fn list_len(s: &mut Scanner) -> Result<Option<u64>> {
    if s.peek() != Some(b'[') {
        return s.value().map(|_| None);
    }
    let mut n = 0u64;
    s.array(|s, _| {
        n += 1;
        s.value().map(drop)
    })?;
    Ok(Some(n))
}

fn choice<'a>(s: &mut Scanner<'a>, position: u64, w: &mut BodyRouting<'a>) -> Result<()> {
    if s.peek() != Some(b'{') {
        return Err(s
            .error("a choice object")
            .context(format!("`choices[{position}]`")));
    }
    let (mut index, first) = (None, w.values.len());
    let mut counts = Counts::default();
    let mut once = Once::new([
        b"index",
        ROUTING_KEY,
        b"message",
        b"meta_info",
        b"prompt_token_ids",
        b"token_ids",
    ]);
    s.object(|s, key| {
        once.see(s, key)?;
        match key {
            b"index" => {
                let r = s.value()?;
                let n = serde_json::from_slice::<u64>(&s.buf()[r.clone()]).map_err(|_| {
                    Error::field(
                        "index",
                        "a non-negative integer",
                        String::from_utf8_lossy(&s.buf()[r]),
                    )
                    .context("response body")
                })?;
                index = Some(n);
                Ok(())
            }
            // The index so far: a choice's `index` key usually comes before its routing (its
            // values are given the final index below, whatever it is).
            ROUTING_KEY => routing_value(
                s,
                (index.unwrap_or(position), &mut w.decode),
                Place::Choice,
                &mut w.values,
            ),
            b"message" => holder(
                s,
                (index.unwrap_or(position), &mut w.decode),
                &mut w.values,
                Holder::Message,
                None,
            ),
            // SGLang's chat with `return_meta_info` (0.5.13+): the result's meta info per choice.
            b"meta_info" => holder(
                s,
                (index.unwrap_or(position), &mut w.decode),
                &mut w.values,
                Holder::Sglang,
                Some(&mut counts),
            ),
            b"prompt_token_ids" => {
                if let Some(n) = list_len(s)? {
                    counts.prompt = Some((n, "prompt_token_ids"));
                }
                Ok(())
            }
            b"token_ids" => {
                if let Some(n) = list_len(s)? {
                    counts.generated = Some((n, "token_ids"));
                }
                Ok(())
            }
            b"routed_expert_weights" => {
                w.weights.get_or_insert_with(|| s.path());
                s.value().map(drop)
            }
            _ => s.skip_member(key),
        }
    })?;
    // The index key may come after the routing: fix up what this choice added.
    let index = index.unwrap_or(position);
    for f in &mut w.values[first..] {
        f.index = index;
    }
    w.choices.push((index, counts));
    Ok(())
}

/// Which holder an object is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Holder {
    /// A choice's `message`.
    Message,
    /// `sglext`, `meta_info`, a choice's `meta_info`.
    Sglang,
    /// `nvext`, which may hold a second one (`engine_data`).
    Nvext,
    /// `nvext.engine_data`.
    EngineData,
}

impl Holder {
    fn place(self) -> Place {
        match self {
            Holder::Message => Place::Message,
            Holder::Sglang => Place::Sglang,
            Holder::Nvext | Holder::EngineData => Place::Nvext,
        }
    }
}

/// An object whose `routed_experts` key holds routing (`message`, `sglext`, `meta_info`,
/// `nvext`); anything else in it is skipped, under the watch for misplaced routing. A
/// `meta_info` also states token counts (`counts` given).
fn holder<'a>(
    s: &mut Scanner<'a>,
    (index, decode): (u64, &mut Option<Wanted>),
    found: &mut Vec<Found<'a>>,
    kind: Holder,
    mut counts: Option<&mut Counts>,
) -> Result<()> {
    match s.peek() {
        Some(b'{') => {}
        // A holder that is not an object cannot hold routing: skip it as any other value.
        _ => return s.value().map(drop),
    }
    let (mut dtype, first) = (None, found.len());
    let mut once = Once::new([
        ROUTING_KEY,
        DTYPE_KEY,
        b"prompt_tokens",
        b"completion_tokens",
    ]);
    s.object(|s, key| {
        once.see(s, key)?;
        match key {
            // SGLang 0.5.7 and 0.5.8 write `[]` in meta_info for a result without routing.
            ROUTING_KEY if counts.is_some() && empty_list(s) => s.value().map(drop),
            ROUTING_KEY => routing_value(s, (index, &mut *decode), kind.place(), found),
            // Dynamo's receipt on chat and completions.
            ARTIFACT_KEY if kind == Holder::Nvext => artifact_receipt(s),
            // Dynamo hands the backend's engine data through whole when asked for it.
            b"engine_data" if kind == Holder::Nvext => {
                holder(s, (index, &mut *decode), found, Holder::EngineData, None)
            }
            DTYPE_KEY if s.peek() == Some(b'"') => {
                let st = s.string()?;
                let name = s.string_value(&st)?;
                dtype = Some(
                    DType::parse(&String::from_utf8_lossy(&name))
                        .map_err(|e| e.context("routed_experts_dtype"))?,
                );
                Ok(())
            }
            DTYPE_KEY => s.value().map(drop),
            b"prompt_tokens" | b"completion_tokens" if counts.is_some() => {
                let (field, generated) = match key {
                    b"prompt_tokens" => ("meta_info.prompt_tokens", false),
                    _ => ("meta_info.completion_tokens", true),
                };
                if let (Some(n), Some(c)) = (count(s, field)?, counts.as_deref_mut()) {
                    let slot = if generated {
                        &mut c.generated
                    } else {
                        &mut c.prompt
                    };
                    *slot = Some((n, field));
                }
                Ok(())
            }
            _ => s.skip_member(key),
        }
    })?;
    for f in &mut found[first..] {
        f.dtype = f.dtype.or(dtype);
    }
    Ok(())
}

/// NVIDIA Dynamo's generation artifact receipt (`generation_artifact` at the top of a generate
/// body, in `nvext` on chat): outputs Dynamo moved to its object store, with `routed_experts`
/// null or absent. A receipt that lists routes (`contents` naming them) is refused with where
/// they went: the body does not carry them, and reading it as "no routing" would pass a rollout
/// without routing on. One whose contents cannot be read is refused too (never guessed routeless);
/// `null`, or a receipt of other outputs, is passed by. Its binary object (`DYNEXP1`) is not
/// read: its layout is Dynamo's own and not settled (format.md §3.2).
fn artifact_receipt(s: &mut Scanner) -> Result<()> {
    let path = s.path();
    let at = s.value()?;
    let text = &s.buf()[at];
    if text == b"null" {
        return Ok(());
    }
    let receipt: serde_json::Value = serde_json::from_slice(text)
        .map_err(|e| Error::malformed(format!("{path}: a generation artifact receipt: {e}")))?;
    let field = |k: &str| {
        receipt.get(k).map_or_else(
            || "?".to_string(),
            |v| v.to_string().chars().take(80).collect(),
        )
    };
    let contents = receipt.get("contents").and_then(|c| c.as_array());
    let routes = match contents {
        Some(list) => list.iter().any(|c| {
            c.as_str()
                .is_some_and(|t| t.to_ascii_lowercase().contains("route"))
        }),
        None => {
            return Err(Error::new(
                ErrorKind::Unplaced,
                format!(
                "{path}: NVIDIA Dynamo's generation artifact receipt without a list of contents \
                 (got {}): whether routing moved out of the body cannot be told, so the body is \
                 not read as having none",
                field("contents")
            ),
            ))
        }
    };
    if !routes {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Offloaded,
        format!(
            "{path}: the routing is not in this body: NVIDIA Dynamo moved it to its object store \
         (generation artifact receipt: format {}, contents {}, state {}, object_id {}, \
         actual_bytes {}, sha256 {}); fetch the artifact from Dynamo, or ask it for routing \
         inline (this library does not read Dynamo's artifact objects)",
            field("format"),
            field("contents"),
            field("state"),
            field("object_id"),
            field("actual_bytes"),
            field("sha256"),
        ),
    ))
}

/// Whether the value next is `[]` (white space allowed inside).
fn empty_list(s: &mut Scanner) -> bool {
    if s.peek() != Some(b'[') {
        return false;
    }
    let rest = &s.buf()[s.pos() + 1..];
    rest.iter().find(|c| !c.is_ascii_whitespace()) == Some(&b']')
}

/// `decode`: the value to decode as it is read, taken by the first value of its index.
fn routing_value<'a>(
    s: &mut Scanner<'a>,
    (index, decode): (u64, &mut Option<Wanted>),
    place: Place,
    found: &mut Vec<Found<'a>>,
) -> Result<()> {
    // A compact sidecar is read here, in the walk's one pass over its (large) data string.
    let (mut plain_string, mut base64) = (false, false);
    let (span, fields) = if s.peek() == Some(b'{') {
        let start = s.pos();
        let fields = match decode.take_if(|w| w.index == index) {
            Some(w) => sidecar::read_fields_decoding(s, w.max_bytes)?,
            None => sidecar::read_fields(s)?,
        };
        (start..s.pos(), Some(fields))
    } else if s.peek() == Some(b'"') {
        let start = s.pos();
        // Routing strings are base64 (vLLM's, SGLang's) or short (NeMo-RL's envelope): the
        // scan for the end checks the alphabet as it goes.
        let st = s.base64_text()?;
        (plain_string, base64) = (!st.escaped, st.base64);
        (start..s.pos(), None)
    } else {
        (s.value()?, None)
    };
    let text = &s.buf()[span.clone()];
    if text != b"null" {
        found.push(Found {
            index,
            span,
            text,
            dtype: None,
            path: s.path(),
            fields,
            plain_string,
            base64,
            counts: Counts::default(),
            place,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
