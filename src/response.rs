//! Routing inside whole response bodies: find it without building the rest of the body, and
//! merge prefill and decode bodies by replacing only the routing values' bytes (format.md §4).

use std::borrow::Cow;
use std::mem::MaybeUninit;
use std::ops::Range;

use crate::b64;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::formats::{self, Format, Hints};
use crate::jsonscan::Scanner;
use crate::merge;
use crate::payload::Payload;
use crate::sidecar::{self, SidecarFields, SidecarText};

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
}

/// Where routing sits in response bodies (format.md §3.2), and who puts it there: the one table the
/// walker below follows, docs/format.md and the README repeat, and error messages quote.
pub const LOCATIONS: &[(&str, &str)] = &[
    ("choices[i].routed_experts", "vLLM, prime-rl"),
    ("choices[i].message.routed_experts", "NeMo-RL"),
    (
        "sglext.routed_experts",
        "SGLang chat/completions 0.5.9-0.5.23 (choice 0)",
    ),
    (
        "meta_info.routed_experts",
        "SGLang /generate (choice 0, or the position in a batch list)",
    ),
    ("nvext.routed_experts", "NVIDIA Dynamo (choice 0)"),
];

const ROUTING_KEY: &[u8] = b"routed_experts";
const KV_TRANSFER_PARAMS: &[u8] = b"kv_transfer_params";

/// Every routing value in `body`, in body order, with the index of its choice, found at the
/// places `LOCATIONS` lists; the top-level holders serve choice 0, or their position in a
/// top-level array of SGLang batch results. A choice with no `index` key takes its position in
/// `choices`; `null` routing is no routing.
///
/// Strict where it matters (format.md §8): a `routed_experts` key anywhere else, or a routing key,
/// `choices` or `index` twice in one object, is a `PayloadError`; keys are compared unescaped.
/// One pass, no DOM: everything else is skipped (strings at memchr speed).
pub fn find_routing(body: &[u8]) -> Result<Vec<Found<'_>>> {
    Ok(walk(body, false)?.found)
}

/// What one walk of a body collects: its routing values, and where top-level
/// `kv_transfer_params` sits (vLLM's disaggregated-serving handshake), if it is there.
struct Walk<'a> {
    found: Vec<Found<'a>>,
    kv_transfer_params: Option<Range<usize>>,
}

/// Walk a body; `want_kv` also reads (and polices) top-level `kv_transfer_params`.
fn walk(body: &[u8], want_kv: bool) -> Result<Walk<'_>> {
    let mut s = Scanner::new(body, "response body").watch(ROUTING_KEY);
    let mut w = Walk {
        found: Vec::new(),
        kv_transfer_params: None,
    };
    if s.peek() == Some(b'[') {
        s.array(|s, i| top_object(s, i as u64, &mut w.found, None))?;
    } else {
        let kv = want_kv.then_some(&mut w.kv_transfer_params);
        top_object(&mut s, 0, &mut w.found, kv)?;
    }
    s.end()?;
    let found = &w.found;
    for (i, f) in found.iter().enumerate() {
        if let Some(g) = found[..i].iter().find(|g| g.index == f.index) {
            return Err(Error::payload(format!(
                "response body: two routing values for choice {}, at {} and at {}",
                f.index, g.path, f.path
            )));
        }
    }
    Ok(w)
}

/// What a prefill/decode proxy reads from a prefill body before it calls decode, in one walk
/// of the body (the same walk as [`find_routing`], none of the routing decoded).
#[derive(Debug)]
pub struct PrefillBody<'a> {
    /// The raw JSON text of top-level `kv_transfer_params` (what the decode request must carry
    /// for vLLM's KV connector), or `None` when the key is absent or `null`.
    pub kv_transfer_params: Option<&'a [u8]>,
    /// The routing values, as [`find_routing`] finds them.
    pub routing: Vec<Found<'a>>,
}

/// Read a prefill body as a proxy needs it: `kv_transfer_params` and the routing values, strict
/// as [`find_routing`] is (a `kv_transfer_params` key given twice is a `PayloadError` too: the
/// two halves of a request must never be joined by a guess).
pub fn read_prefill(body: &[u8]) -> Result<PrefillBody<'_>> {
    let w = walk(body, true)?;
    let kv_transfer_params = w
        .kv_transfer_params
        .map(|r| &body[r])
        .filter(|t| *t != b"null");
    Ok(PrefillBody {
        kv_transfer_params,
        routing: w.found,
    })
}

/// How many rows (token positions) a routing value holds. A compact sidecar's shape is read and
/// checked against its data's length without decoding; other formats are decoded (their shape
/// sits inside the encoded bytes).
pub fn routing_rows(f: &Found, hints: &Hints, max_bytes: usize) -> Result<usize> {
    match &f.fields {
        Some(fields) => Ok(sidecar::validate(fields.clone(), max_bytes)?
            .header
            .shape
            .tokens),
        None => Ok(decode_found(f, hints, max_bytes)?.1.num_tokens()),
    }
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

/// One top-level object: its routing holders, and (when `kv` is given) the span of its
/// `kv_transfer_params`.
fn top_object<'a>(
    s: &mut Scanner<'a>,
    position: u64,
    found: &mut Vec<Found<'a>>,
    mut kv: Option<&mut Option<Range<usize>>>,
) -> Result<()> {
    if s.peek() != Some(b'{') {
        return Err(s.error("a JSON object"));
    }
    let mut once = Once::new([b"choices", b"meta_info", b"nvext", b"sglext"]);
    s.object(|s, key| {
        once.see(s, key)?;
        if let (KV_TRANSFER_PARAMS, Some(slot)) = (key, kv.as_deref_mut()) {
            if slot.is_some() {
                return Err(s.duplicate(key));
            }
            *slot = Some(s.value()?);
            return Ok(());
        }
        match key {
            b"choices" => match s.peek() {
                Some(b'[') => s.array(|s, i| choice(s, i as u64, found)),
                Some(b'n') => s.value().map(drop),
                _ => Err(s.error("a list of choices").context("`choices`")),
            },
            b"meta_info" | b"nvext" | b"sglext" => holder(s, position, found),
            ROUTING_KEY => Err(s.unexpected_watched()),
            _ => s.value().map(drop),
        }
    })
}

fn choice<'a>(s: &mut Scanner<'a>, position: u64, found: &mut Vec<Found<'a>>) -> Result<()> {
    if s.peek() != Some(b'{') {
        return Err(s
            .error("a choice object")
            .context(format!("`choices[{position}]`")));
    }
    let (mut index, first) = (None, found.len());
    let mut once = Once::new([b"index", ROUTING_KEY, b"message"]);
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
            ROUTING_KEY => routing_value(s, position, None, found),
            b"message" => holder(s, position, found),
            _ => s.value().map(drop),
        }
    })?;
    // The index key may come after the routing: fix up what this choice added.
    for f in &mut found[first..] {
        f.index = index.unwrap_or(position);
    }
    Ok(())
}

/// An object whose `routed_experts` key holds routing (`message`, `sglext`, `meta_info`,
/// `nvext`); anything else in it is skipped, under the watch for misplaced routing.
fn holder<'a>(s: &mut Scanner<'a>, index: u64, found: &mut Vec<Found<'a>>) -> Result<()> {
    match s.peek() {
        Some(b'{') => {}
        // A holder that is not an object cannot hold routing: skip it as any other value.
        _ => return s.value().map(drop),
    }
    let (mut dtype, first) = (None, found.len());
    let mut once = Once::new([ROUTING_KEY, b"routed_experts_dtype"]);
    s.object(|s, key| {
        once.see(s, key)?;
        match key {
            ROUTING_KEY => routing_value(s, index, None, found),
            b"routed_experts_dtype" if s.peek() == Some(b'"') => {
                let st = s.string()?;
                let name = s.string_value(&st)?;
                dtype = Some(
                    DType::parse(&String::from_utf8_lossy(&name))
                        .map_err(|e| e.context("routed_experts_dtype"))?,
                );
                Ok(())
            }
            _ => s.value().map(drop),
        }
    })?;
    for f in &mut found[first..] {
        f.dtype = f.dtype.or(dtype);
    }
    Ok(())
}

fn routing_value<'a>(
    s: &mut Scanner<'a>,
    index: u64,
    dtype: Option<DType>,
    found: &mut Vec<Found<'a>>,
) -> Result<()> {
    // A compact sidecar is read here, in the walk's one pass over its (large) data string.
    let (span, fields) = if s.peek() == Some(b'{') {
        let start = s.pos();
        let fields = sidecar::read_fields(s)?;
        (start..s.pos(), Some(fields))
    } else {
        (s.value()?, None)
    };
    let text = &s.buf()[span.clone()];
    if text != b"null" {
        found.push(Found {
            index,
            span,
            text,
            dtype,
            path: s.path(),
            fields,
        });
    }
    Ok(())
}

/// Decode one routing value, whatever its format.
pub fn decode_found(f: &Found, hints: &Hints, max_bytes: usize) -> Result<(Format, Payload)> {
    let hints = Hints {
        dtype: hints.dtype.or(f.dtype),
        ..*hints
    };
    match &f.fields {
        Some(fields) => Ok((
            Format::Compact,
            formats::decode_compact_fields(fields.clone(), &hints, max_bytes)?,
        )),
        None => formats::decode_json_value(f.text, &hints, max_bytes),
    }
}

/// The routing of the choice whose index is `choice`, or `None` when it carries none.
pub fn from_response(
    body: &[u8],
    choice: u64,
    hints: &Hints,
    max_bytes: usize,
) -> Result<Option<Payload>> {
    let found = find_routing(body)?;
    found
        .iter()
        .find(|f| f.index == choice)
        .map(|f| {
            decode_found(f, hints, max_bytes)
                .map(|(_, p)| p)
                .map_err(|e| e.context(format!("choice {choice}")))
        })
        .transpose()
}

/// How [`merge_response`] works.
#[derive(Clone, Copy, Debug)]
pub struct MergeOptions {
    /// Limit on each decoded payload.
    pub max_bytes: usize,
    /// Join base64 text directly when the cut falls on a 3-byte boundary (same result, faster).
    pub splice: bool,
    /// Hints for the prefill values (and the decode values, unless `decode_start` is given).
    pub hints: Hints,
    /// The start of the decode values, for formats that carry none (a delta from `P-1`).
    pub decode_start: Option<u64>,
    /// Write the merged value in the decode value's format instead of a compact sidecar.
    pub keep_format: bool,
    /// Refuse a decode body without routing when the prefill body has some (a proxy's policy:
    /// a client that asked for routing must not get a 200 without it). Off by default: format.md §4
    /// passes a decode body without routing through unchanged.
    pub require_routing: bool,
}

impl MergeOptions {
    /// Defaults: splice on, no hints, merged values written as compact sidecars.
    pub fn new(max_bytes: usize) -> Self {
        MergeOptions {
            max_bytes,
            splice: true,
            hints: Hints::default(),
            decode_start: None,
            keep_format: false,
            require_routing: false,
        }
    }
}

/// The merged body as pieces (mostly slices of the inputs), so it is assembled with one copy
/// straight into its final buffer.
pub struct Spliced<'a> {
    pieces: Vec<Piece<'a>>,
    merged: usize,
}

/// One piece of a merged body.
#[derive(Debug)]
enum Piece<'a> {
    /// Bytes copied as they are.
    Copy(Cow<'a, [u8]>),
    /// Whole base64 groups of a routing value, checked as they are copied: each chunk is checked
    /// while the copy has it in cache, so the text is read once. `whole` is the value's entire
    /// text and `context` where it sits, to report a bad character as the decoding path would.
    Base64 {
        text: &'a [u8],
        last: bool,
        whole: &'a [u8],
        context: String,
    },
}

impl<'a> From<Cow<'a, [u8]>> for Piece<'a> {
    fn from(bytes: Cow<'a, [u8]>) -> Self {
        Piece::Copy(bytes)
    }
}

impl Piece<'_> {
    fn len(&self) -> usize {
        match self {
            Piece::Copy(b) => b.len(),
            Piece::Base64 { text, .. } => text.len(),
        }
    }

    /// Say which choice the piece belongs to (for its error message).
    fn in_choice(mut self, index: u64) -> Self {
        if let Piece::Base64 { context, .. } = &mut self {
            *context = format!("choice {index}: {context}");
        }
        self
    }

    /// Copy into the start of `out`, checking base64 on the way; return the rest of `out`.
    fn write<'o>(&self, out: &'o mut [MaybeUninit<u8>]) -> Result<&'o mut [MaybeUninit<u8>]> {
        let (text, last, whole, context) = match self {
            Piece::Copy(b) => return Ok(b64::write_uninit(out, b)),
            Piece::Base64 {
                text,
                last,
                whole,
                context,
            } => (*text, *last, *whole, context),
        };
        let mut rest = out;
        let chunks = text.len().div_ceil(CHECK_CHUNK);
        for (i, chunk) in text.chunks(CHECK_CHUNK).enumerate() {
            if !b64::groups_valid(chunk, last && i + 1 == chunks) {
                return Err(b64::error_in(whole, "data").context(context));
            }
            rest = b64::write_uninit(rest, chunk);
        }
        Ok(rest)
    }
}

/// Base64 is checked this many characters at a time as it is copied (a multiple of 4, small
/// enough to stay in L1 between the check and the copy).
const CHECK_CHUNK: usize = 16 * 1024;

impl Spliced<'_> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.pieces.iter().map(Piece::len).sum()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Write the body into `out` (which may be uninitialised), `len()` bytes long. Base64 text
    /// still to be checked is checked on the way: an error leaves `out` partly written.
    pub fn write_into(&self, out: &mut [MaybeUninit<u8>]) -> Result<()> {
        let mut rest = out;
        for piece in &self.pieces {
            rest = piece.write(rest)?;
        }
        Ok(())
    }

    /// The body as one vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        b64::try_filled_vec(self.len(), |out| self.write_into(out))
    }

    /// How many routing values of the decode body were merged (0: it carried none, and is
    /// returned as it is).
    pub fn merged_values(&self) -> usize {
        self.merged
    }

    /// The body as slices in order, its base64 text checked, nothing copied: each slice is
    /// part of one of the two input bodies, or of this value (the small rewritten parts). For
    /// a server that writes them out with one vectored write instead of assembling the body.
    pub fn checked_slices(&self) -> Result<Vec<&[u8]>> {
        let mut out = Vec::with_capacity(self.pieces.len());
        for piece in &self.pieces {
            match piece {
                Piece::Copy(b) => out.push(&b[..]),
                Piece::Base64 {
                    text,
                    last,
                    whole,
                    context,
                } => {
                    let chunks = text.len().div_ceil(CHECK_CHUNK);
                    for (i, chunk) in text.chunks(CHECK_CHUNK).enumerate() {
                        if !b64::groups_valid(chunk, *last && i + 1 == chunks) {
                            return Err(b64::error_in(whole, "data").context(context));
                        }
                    }
                    out.push(text);
                }
            }
        }
        Ok(out)
    }
}

/// The decode body with each routing value replaced by its merge with the prefill routing of the
/// same choice index; every other byte unchanged.
pub fn merge_response(
    prefill_body: &[u8],
    decode_body: &[u8],
    opts: MergeOptions,
) -> Result<Vec<u8>> {
    merge_response_pieces(prefill_body, decode_body, opts)?.to_vec()
}

/// `merge_response`, before assembly.
pub fn merge_response_pieces<'a>(
    prefill_body: &'a [u8],
    decode_body: &'a [u8],
    opts: MergeOptions,
) -> Result<Spliced<'a>> {
    merge_pieces(prefill_body, None, decode_body, opts)
}

/// `merge_response_pieces` with the prefill body's routing already found (by
/// [`read_prefill`] or [`find_routing`] on `prefill_body`), so a proxy walks that body once.
pub fn merge_response_found<'a>(
    prefill_body: &'a [u8],
    prefill_routing: &[Found<'a>],
    decode_body: &'a [u8],
    opts: MergeOptions,
) -> Result<Spliced<'a>> {
    merge_pieces(prefill_body, Some(prefill_routing), decode_body, opts)
}

fn merge_pieces<'a>(
    prefill_body: &'a [u8],
    prefill_routing: Option<&[Found<'a>]>,
    decode_body: &'a [u8],
    opts: MergeOptions,
) -> Result<Spliced<'a>> {
    // The prefill body is walked only when its routing is needed and was not given.
    let prefill_found = || -> Result<Cow<'_, [Found<'a>]>> {
        match prefill_routing {
            Some(found) => Ok(Cow::Borrowed(found)),
            None => Ok(Cow::Owned(find_routing(prefill_body)?)),
        }
    };
    let decode = find_routing(decode_body)?;
    if decode.is_empty() {
        if opts.require_routing {
            if let Some(p) = prefill_found()?.first() {
                return Err(Error::merge(format!(
                    "missing routing on the decode side: the prefill body carries routing \
                     (choice {}) but the decode body has none",
                    p.index
                )));
            }
        }
        return Ok(Spliced {
            pieces: vec![Piece::Copy(Cow::Borrowed(decode_body))],
            merged: 0,
        });
    }
    let prefill = prefill_found()?;
    let mut pieces = Vec::with_capacity(decode.len() * 6 + 1);
    let mut at = 0;
    for d in &decode {
        let p = prefill
            .iter()
            .find(|p| p.index == d.index)
            .or(if prefill.len() == 1 {
                prefill.first()
            } else {
                None
            })
            .ok_or_else(|| {
                Error::merge(format!(
                    "missing routing on the prefill side: decode choice {} carries routed_experts \
                     but the prefill body has no routing for it (passing decode's prompt rows on \
                     would corrupt training)",
                    d.index
                ))
            })?;
        pieces.push(Piece::Copy(Cow::Borrowed(&decode_body[at..d.span.start])));
        let merged =
            merge_found(p, d, &opts).map_err(|e| e.context(format!("choice {}", d.index)))?;
        pieces.extend(merged.into_iter().map(|piece| piece.in_choice(d.index)));
        at = d.span.end;
    }
    pieces.push(Piece::Copy(Cow::Borrowed(&decode_body[at..])));
    Ok(Spliced {
        pieces,
        merged: decode.len(),
    })
}

/// Merge two routing values into the pieces of the JSON text that replaces the decode value.
fn merge_found<'a>(p: &Found<'a>, d: &Found<'a>, opts: &MergeOptions) -> Result<Vec<Piece<'a>>> {
    // Compact values carry their own start: the start hints are for formats that carry none.
    // Two compact values merge on their text (keep_format changes nothing: compact stays compact).
    let is_compact = |f: &Found| f.fields.is_some();
    if let (Some(pf), Some(df)) = (&p.fields, &d.fields) {
        if opts.hints.num_layers.is_none()
            && opts.hints.top_k.is_none()
            && opts.hints.dtype.is_none()
        {
            return merge_sidecars(pf.clone(), df.clone(), opts);
        }
    }
    let side_hints = |f: &Found, start: Option<u64>| Hints {
        start: if is_compact(f) { None } else { start },
        ..opts.hints
    };
    let prefill_hints = side_hints(p, opts.hints.start);
    let decode_hints = side_hints(d, opts.decode_start.or(opts.hints.start));
    let (_, prefill) =
        decode_found(p, &prefill_hints, opts.max_bytes).map_err(|e| e.context("prefill"))?;
    let (format, decode) =
        decode_found(d, &decode_hints, opts.max_bytes).map_err(|e| e.context("decode"))?;
    let merged = merge::merge(&prefill, &decode)?;
    let format = if opts.keep_format {
        format
    } else {
        Format::Compact
    };
    Ok(vec![Piece::Copy(Cow::Owned(formats::encode_json(
        &merged, format,
    )?))])
}

/// Merge two compact sidecars' fields into (the pieces of) the canonical sidecar text.
fn merge_sidecars<'a>(
    prefill: SidecarFields<'a>,
    decode: SidecarFields<'a>,
    opts: &MergeOptions,
) -> Result<Vec<Piece<'a>>> {
    let p = sidecar::validate(prefill, opts.max_bytes).map_err(|e| e.context("prefill"))?;
    let d = sidecar::validate(decode, opts.max_bytes).map_err(|e| e.context("decode"))?;
    let plan = merge::plan(&p.header, &d.header)?;
    if opts.splice && can_splice(&p, &d) {
        return splice_text(p, d, &plan);
    }
    merge_decoded(&p, &d)
}

fn merge_decoded<'a>(p: &SidecarText, d: &SidecarText) -> Result<Vec<Piece<'a>>> {
    let prefill = p.decode().map_err(|e| e.context("prefill"))?;
    let decode = d.decode().map_err(|e| e.context("decode"))?;
    let merged = merge::merge(&prefill, &decode)?;
    Ok(vec![Piece::Copy(Cow::Owned(sidecar::encode(&merged)))])
}

/// Halves of one dtype can be joined on their base64 text: the merged bytes are prefill's bytes
/// then decode's from `skip` on, and base64 maps each 3-byte group to 4 characters, so only the
/// group that straddles the cut needs encoding again (and decode's tail, if its groups do not
/// line up with the output's). The other dtype pairs need promotion: decode, merge, encode.
fn can_splice(p: &SidecarText, d: &SidecarText) -> bool {
    p.header.dtype == d.header.dtype
}

fn splice_text<'a>(
    p: SidecarText<'a>,
    d: SidecarText<'a>,
    plan: &merge::Plan,
) -> Result<Vec<Piece<'a>>> {
    let prefill_len = p.header.shape.tokens * p.header.row_bytes();
    let decode_len = d.header.shape.tokens * d.header.row_bytes();
    let skip = plan.skip * d.header.row_bytes();
    // Whole groups of prefill keep their text; its last `rem` bytes join decode's first `fill`.
    let whole = prefill_len / 3 * 3;
    let fill = ((3 - (prefill_len - whole)) % 3).min(decode_len - skip);
    let rest = skip + fill;
    // Every character of both texts is validated, so bad input fails exactly as the decoding
    // path would: the straddling groups and a misaligned tail by decoding them; decode's rows
    // that prefill replaces by a check of their own (they are dropped, not copied); the text
    // that is copied as it is, while it is copied (`Piece::Base64`).
    // What the decoding below and the copy do not cover: decode's groups before `skip`, or all
    // of its text when none of it is decoded or copied (every decode row already in prefill).
    let covered_elsewhere = fill > 0 || rest < decode_len;
    let dropped_end = if covered_elsewhere {
        (skip / 3 * 4).min(d.data.len())
    } else {
        d.data.len()
    };
    let dropped = &d.data[..dropped_end];
    if !b64::groups_valid(dropped, dropped.len() == d.data.len()) {
        return Err(b64::error_in(&d.data, "data").context("decode"));
    }
    let mut head =
        b64::decode_range(&p.data, whole, prefill_len).map_err(|e| e.context("prefill"))?;
    head.extend(b64::decode_range(&d.data, skip, skip + fill).map_err(|e| e.context("decode"))?);
    let mut pieces = vec![
        checked_copy(&p.data, 0, whole / 3 * 4, "prefill")?,
        Piece::Copy(Cow::Owned(b64::encode(&head))),
    ];
    if rest < decode_len {
        pieces.push(if rest % 3 == 0 {
            checked_copy(&d.data, rest / 3 * 4, d.data.len(), "decode")?
        } else {
            // Decode's groups are misaligned with the output's (a delta decode): re-encode its
            // tail, which is then only the generated rows.
            let tail =
                b64::decode_range(&d.data, rest, decode_len).map_err(|e| e.context("decode"))?;
            Piece::Copy(Cow::Owned(b64::encode(&tail)))
        });
    }
    Ok(sidecar::wrap_base64(&plan.header, pieces))
}

/// `text[from..to]` (whole groups) as a piece checked while it is copied; text that had escapes
/// (so is owned, not borrowed from the body) is checked here and copied as it is.
fn checked_copy<'a>(
    text: &Cow<'a, [u8]>,
    from: usize,
    to: usize,
    side: &'static str,
) -> Result<Piece<'a>> {
    let last = to == text.len();
    match text {
        Cow::Borrowed(t) => Ok(Piece::Base64 {
            text: &t[from..to],
            last,
            whole: t,
            context: side.to_string(),
        }),
        Cow::Owned(t) => {
            if !b64::groups_valid(&t[from..to], last) {
                return Err(b64::error_in(t, "data").context(side));
            }
            Ok(Piece::Copy(Cow::Owned(t[from..to].to_vec())))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::DEFAULT_MAX_BYTES;

    const OPTS: MergeOptions = MergeOptions {
        max_bytes: DEFAULT_MAX_BYTES,
        splice: true,
        hints: Hints {
            start: None,
            num_layers: None,
            top_k: None,
            dtype: None,
        },
        decode_start: None,
        keep_format: false,
        require_routing: false,
    };

    fn body(routing: &str) -> String {
        format!(
            r#"{{"id":"x","choices":[{{"index":0,"logprob":-0.12345678901234568, "routed_experts":{routing}}}],"usage":{{}}}}"#
        )
    }

    #[test]
    fn merges_the_spec_example_and_keeps_other_bytes() {
        let prefill = body(r#"{"data":"CgsUFR4f","shape":[3,1,2],"start":0,"dtype":"uint8"}"#);
        let decode = body(r#"{"data":"AAAAAAAAKCk=","shape":[4,1,2],"start":0,"dtype":"uint8"}"#);
        let merged = r#"{"data":"CgsUFR4fKCk=","shape":[4,1,2],"start":0,"dtype":"uint8"}"#;
        for splice in [true, false] {
            let out = merge_response(
                prefill.as_bytes(),
                decode.as_bytes(),
                MergeOptions { splice, ..OPTS },
            )
            .unwrap();
            assert_eq!(String::from_utf8(out).unwrap(), body(merged));
        }
        // Unassembled, and with the prefill routing found first: the same bytes.
        let (p, d) = (prefill.as_bytes(), decode.as_bytes());
        let found = find_routing(p).unwrap();
        let pieces = merge_response_found(p, &found, d, OPTS).unwrap();
        assert_eq!(pieces.merged_values(), 1);
        assert_eq!(
            pieces.checked_slices().unwrap().concat(),
            body(merged).as_bytes()
        );
        let none = merge_response_pieces(p, br#"{"choices":[]}"#, OPTS).unwrap();
        assert_eq!(none.merged_values(), 0);
        // Bad base64 in the spliced text is refused by the unassembled path too.
        let bad = body(r#"{"data":"AAAAAAAAK!k=","shape":[4,1,2],"start":0,"dtype":"uint8"}"#);
        let pieces = merge_response_pieces(p, bad.as_bytes(), OPTS);
        let refused = pieces.and_then(|s| s.checked_slices().map(|v| v.concat()));
        assert!(refused.is_err(), "{refused:?}");
    }

    #[test]
    fn no_routing_returns_decode_unchanged_and_missing_prefill_is_an_error() {
        let plain = r#"{"choices":[{"index":0,"text":"w"}]}"#;
        assert_eq!(
            merge_response(plain.as_bytes(), plain.as_bytes(), OPTS).unwrap(),
            plain.as_bytes()
        );
        let decode = body(r#"{"data":"Hh8oKQ==","shape":[2,1,2],"start":2}"#);
        let err = merge_response(plain.as_bytes(), decode.as_bytes(), OPTS).unwrap_err();
        assert!(matches!(err, Error::Merge(_)), "{err}");
    }

    #[test]
    fn read_prefill_finds_kv_params_and_rows_in_one_walk() {
        let b = br#"{"kv_transfer_params":{"remote_block_ids":[3,5],"remote_host":"h"},"choices":[{"index":0,"routed_experts":{"data":"CgsUFR4f","shape":[3,1,2],"start":0}}]}"#;
        let p = read_prefill(b).unwrap();
        assert_eq!(
            p.kv_transfer_params.unwrap(),
            br#"{"remote_block_ids":[3,5],"remote_host":"h"}"#
        );
        let rows = routing_rows(&p.routing[0], &Hints::default(), DEFAULT_MAX_BYTES).unwrap();
        assert_eq!(rows, 3);
        let none = read_prefill(br#"{"kv_transfer_params":null,"choices":[]}"#).unwrap();
        assert!(none.kv_transfer_params.is_none() && none.routing.is_empty());
        let twice = br#"{"kv_transfer_params":{},"choices":[],"kv_transfer_params":{"a":1}}"#;
        let err = read_prefill(twice).unwrap_err();
        assert!(err.to_string().contains("duplicate"), "{err}");
        // Other readers keep their rules: the key is not theirs to police.
        assert!(find_routing(twice).unwrap().is_empty());
        // A shape that does not match its data is refused without decoding.
        let bad = br#"{"choices":[{"routed_experts":{"data":"CgsU","shape":[3,1,2]}}]}"#;
        let p = read_prefill(bad).unwrap();
        assert!(routing_rows(&p.routing[0], &Hints::default(), DEFAULT_MAX_BYTES).is_err());
    }

    #[test]
    fn from_response_finds_by_index() {
        let b = r#"{"choices":[{"index":1,"routed_experts":{"data":"Hh8oKQ==","shape":[2,1,2],"start":2}},{"index":0}]}"#;
        assert_eq!(
            from_response(b.as_bytes(), 1, &Hints::default(), DEFAULT_MAX_BYTES)
                .unwrap()
                .unwrap()
                .start(),
            2
        );
        assert!(
            from_response(b.as_bytes(), 0, &Hints::default(), DEFAULT_MAX_BYTES)
                .unwrap()
                .is_none()
        );
    }
}
