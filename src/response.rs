//! Routing inside whole response bodies: find it without building the rest of the body, and
//! merge prefill and decode bodies by replacing only the routing values' bytes (format.md §4).

use std::borrow::Cow;
use std::mem::MaybeUninit;

use crate::b64;
use crate::buffer::AlignedBytes;
use crate::dtype::with_element;
use crate::error::{Error, Half, Result};
use crate::formats::{self, Format, Hints};
use crate::merge;
use crate::npy;
use crate::payload::{Header, Payload, Shape};
use crate::sidecar::{self, SidecarFields, SidecarText};
use crate::validate::{self, Suspect};

use crate::body::{read_body, read_body_decoding, BodyRouting, Found};
use crate::coverage::{self, Rule};
use crate::split;

/// Decode one routing value, whatever its format, and check its rows against the token counts
/// its body states (format.md §3.3).
pub fn decode_found(f: &Found, hints: &Hints, max_bytes: usize) -> Result<(Format, Payload)> {
    decode_fields(f, f.fields.clone(), hints, max_bytes)
}

/// [`decode_found`] of a value the caller gives up: a compact sidecar it decoded as it read the
/// body (`read_body_decoding`) becomes the payload without a copy.
fn decode_owned(mut f: Found, hints: &Hints, max_bytes: usize) -> Result<(Format, Payload)> {
    let fields = f.fields.take();
    decode_fields(&f, fields, hints, max_bytes)
}

/// Decode `f`, whose sidecar fields (if it is one) are `fields`.
fn decode_fields(
    f: &Found,
    fields: Option<SidecarFields>,
    hints: &Hints,
    max_bytes: usize,
) -> Result<(Format, Payload)> {
    let hints = Hints {
        dtype: hints.dtype.or(f.dtype),
        ..*hints
    };
    let (format, p) = match fields {
        Some(fields) => (
            Format::Compact,
            formats::decode_compact_fields(fields, &hints, max_bytes)?,
        ),
        None => {
            let text = match f.text {
                [b'"', content @ .., b'"'] if f.plain_string => Cow::Borrowed(content),
                _ => formats::json_string_content(f.text)?,
            };
            let format = formats::detect(&text).map_err(|e| e.context(&f.path))?;
            if !f.place.allows(format) {
                return Err(Error::payload(format!(
                    "{}: a value read as {} where producers write {}: not read as routing of \
                     this place (a format moved, or text that is not routing)",
                    f.path,
                    format.name(),
                    f.place.formats()
                )));
            }
            (
                format,
                formats::decode_as(format, &text, &hints, max_bytes)?,
            )
        }
    };
    let rule = Rule::of(format, f.place);
    coverage::check(rule, format, &p.header(), &f.counts, hints.start.is_some())?;
    Ok((format, coverage::without_filler(rule, p, &f.counts)?))
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

/// Look at up to `sample` rows of a routing value, at positions from `from` on, for rows that
/// look like an engine's fault ([`Suspect`]); also return where the value ends. A compact
/// sidecar's sampled rows are decoded alone (a few hundred bytes each), other formats whole.
pub fn suspect_rows(
    f: &Found,
    hints: &Hints,
    max_bytes: usize,
    from: u64,
    sample: usize,
) -> Result<(Suspect, u64)> {
    let (text, h, offset) = match &f.fields {
        Some(fields) => {
            // As decode_found reads it: an older sidecar without a start takes the hint's.
            let mut fields = fields.clone();
            if fields.start.is_none() {
                fields.start = hints.start.map(serde_json::Value::from);
            }
            let text = sidecar::validate(fields, max_bytes)?;
            (text.data, text.header, 0)
        }
        None => match npy_header(f, hints)? {
            Some((text, h, offset)) => (Cow::Borrowed(text), h, offset),
            None => {
                let (_, p) = decode_found(f, hints, max_bytes)?;
                let mut s = Suspect::default();
                s.add_payload(&p, from, sample);
                return Ok((s, p.stop()));
            }
        },
    };
    let mut s = Suspect::default();
    let first = from.saturating_sub(h.start).min(h.shape.tokens as u64) as usize;
    let row = h.row_bytes();
    for t in validate::sample_rows(h.shape.tokens - first, sample) {
        let t = first + t;
        let at = offset + t * row;
        let bytes = b64::decode_range(&text, at, at + row)?;
        let one = Payload::new(
            h.start + t as u64,
            Shape {
                tokens: 1,
                ..h.shape
            },
            h.dtype,
            AlignedBytes::from_slice(&bytes),
        )?;
        with_element!(h.dtype, T => s.add_row(one.values::<T>(), h.shape.top_k));
    }
    Ok((s, h.stop()))
}

/// A vLLM `.npy` value's base64 text, header and data offset, read from its first groups alone
/// (`None` for other formats, or text with escapes, which are decoded whole instead).
fn npy_header<'t>(f: &Found<'t>, hints: &Hints) -> Result<Option<(&'t [u8], Header, usize)>> {
    let Some(text) = f
        .text
        .strip_prefix(b"\"")
        .and_then(|t| t.strip_suffix(b"\""))
    else {
        return Ok(None);
    };
    if !text.starts_with(formats::NPY_B64_PREFIX) || text.len() < 16 {
        return Ok(None);
    }
    // Escaped text (legal JSON, never what vLLM writes) fails to decode here: decoded whole.
    let Ok(total) = b64::decoded_len(text, "vllm_npy") else {
        return Ok(None);
    };
    let Ok(fixed) = b64::decode_range(text, 0, total.min(12)) else {
        return Ok(None);
    };
    let len = match fixed.get(6..12) {
        Some([1, 0, a, b, ..]) => 10 + u16::from_le_bytes([*a, *b]) as usize,
        Some([_, _, a, b, c, d]) => 12 + u32::from_le_bytes([*a, *b, *c, *d]) as usize,
        _ => return Ok(None),
    };
    let Ok(head) = b64::decode_range(text, 0, total.min(len)) else {
        return Ok(None);
    };
    let head = npy::parse_header(&head)?;
    if total.checked_sub(head.data_offset) != Some(head.shape.nbytes(head.dtype)?) {
        return Ok(None); // the whole decode says what is wrong
    }
    let start = hints.start.unwrap_or(0);
    Ok(Some((
        text,
        Header::new(start, head.shape, head.dtype)?,
        head.data_offset,
    )))
}

/// Rows a router samples from each side of a merge that went through: up to `sample` a value,
/// decode's from the end of prefill's rows on (its prompt rows are zeros by design). Values
/// that cannot be read are skipped (the merge has read them all already).
pub fn merge_suspects(
    prefill: &[Found],
    decode: &[Found],
    opts: &MergeOptions,
    sample: usize,
) -> (Suspect, Suspect) {
    let (mut p_seen, mut d_seen) = (Suspect::default(), Suspect::default());
    let decode_hints = Hints {
        start: opts.decode_start.or(opts.hints.start),
        ..opts.hints
    };
    for d in decode {
        let p = prefill
            .iter()
            .find(|p| p.index == d.index)
            .or_else(|| one_choice(prefill));
        // The hints as the merge applied them: start hints are not for compact sidecars.
        let placed = |f: &Found, h: &Hints| Hints {
            start: if f.fields.is_some() { None } else { h.start },
            ..*h
        };
        let from =
            match p.map(|p| suspect_rows(p, &placed(p, &opts.hints), opts.max_bytes, 0, sample)) {
                Some(Ok((seen, stop))) => {
                    p_seen.merge(seen);
                    stop
                }
                _ => 0,
            };
        let hints = placed(d, &decode_hints);
        if let Ok((seen, _)) = suspect_rows(d, &hints, opts.max_bytes, from, sample) {
            d_seen.merge(seen);
        }
    }
    (p_seen, d_seen)
}

/// The routing of the choice whose index is `choice`, or `None` when it carries none. For
/// vLLM 0.21's split shape, the whole sequence: the prompt rows, then the choice's own.
pub fn from_response(
    body: &[u8],
    choice: u64,
    hints: &Hints,
    max_bytes: usize,
) -> Result<Option<Payload>> {
    let mut found = read_body_decoding(body, choice, max_bytes)?;
    let in_choice = |e: Error| e.context(format!("choice {choice}"));
    if let Some(prompt) = &found.prompt {
        return split::sequence(&found, prompt, choice, hints, max_bytes).map_err(in_choice);
    }
    // The first value of the choice, as `BodyRouting::value` finds it.
    let Some(at) = found.values.iter().position(|f| f.index == choice) else {
        return Ok(None);
    };
    decode_owned(found.values.swap_remove(at), hints, max_bytes)
        .map(|(_, p)| Some(p))
        .map_err(in_choice)
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
    /// The decode body's routing values, as the merge found them.
    decode: Vec<Found<'a>>,
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
        /// `whole` was found to be base64 characters by the scan that read it
        /// (`SidecarFields::data_base64`): only lengths and padding are left to check.
        scanned: bool,
    },
}

/// Whether `text` (cut from `whole`) is valid on its own as whole base64 groups.
fn groups_valid(text: &[u8], last: bool, scanned: bool) -> bool {
    if scanned {
        b64::groups_valid_scanned(text, last)
    } else {
        b64::groups_valid(text, last)
    }
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
        let (text, last, whole, context, scanned) = match self {
            Piece::Copy(b) => return Ok(b64::write_uninit(out, b)),
            Piece::Base64 {
                text,
                last,
                whole,
                context,
                scanned,
            } => (*text, *last, *whole, context, *scanned),
        };
        let (head, rest) = out.split_at_mut(text.len());
        let valid = if scanned {
            b64::groups_valid_scanned(text, last) && {
                b64::write_uninit(head, text);
                true
            }
        } else {
            b64::copy_checked(text, head, last)
        };
        if !valid {
            return Err(b64::error_in(whole, "data").context(context));
        }
        Ok(rest)
    }
}

impl<'a> Spliced<'a> {
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

    /// The decode body's routing values, as the merge found them (what [`suspect_rows`] looks
    /// at on the decode side).
    pub fn decode_values(&self) -> &[Found<'a>] {
        &self.decode
    }

    /// The body as slices in order, its base64 text checked, nothing copied: each slice is
    /// part of one of the two input bodies, or of this value (the small rewritten parts). For
    /// a server that writes them out with one vectored write instead of assembling the body.
    pub fn checked_slices(&self) -> Result<Vec<&[u8]>> {
        self.check()?;
        Ok(self
            .pieces
            .iter()
            .map(|piece| match piece {
                Piece::Copy(b) => &b[..],
                Piece::Base64 { text, .. } => text,
            })
            .collect())
    }

    /// The body's pieces in order, its base64 text checked, taken out of this value (which
    /// then holds none; what it says of the merge stays): borrowed pieces are parts of the two
    /// input bodies, owned ones the parts the merge wrote, handed over without a copy (a
    /// re-encoded routing value is most of the body).
    pub fn take_checked_parts(&mut self) -> Result<Vec<Cow<'a, [u8]>>> {
        self.check()?;
        Ok(std::mem::take(&mut self.pieces)
            .into_iter()
            .map(|piece| match piece {
                Piece::Copy(b) => b,
                Piece::Base64 { text, .. } => Cow::Borrowed(text),
            })
            .collect())
    }

    /// Check the base64 text the pieces copy as it is.
    fn check(&self) -> Result<()> {
        for piece in &self.pieces {
            if let Piece::Base64 {
                text,
                last,
                whole,
                context,
                scanned,
            } = piece
            {
                if !groups_valid(text, *last, *scanned) {
                    return Err(b64::error_in(whole, "data").context(context));
                }
            }
        }
        Ok(())
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
/// [`read_prefill`](crate::body::read_prefill) or [`read_body`] on `prefill_body`), so a proxy walks
/// that body once.
pub fn merge_response_found<'a>(
    prefill_body: &'a [u8],
    prefill_routing: &BodyRouting<'a>,
    decode_body: &'a [u8],
    opts: MergeOptions,
) -> Result<Spliced<'a>> {
    merge_pieces(prefill_body, Some(prefill_routing), decode_body, opts)
}

fn merge_pieces<'a>(
    prefill_body: &'a [u8],
    prefill_routing: Option<&BodyRouting<'a>>,
    decode_body: &'a [u8],
    opts: MergeOptions,
) -> Result<Spliced<'a>> {
    // The prefill body is walked only when its routing is needed and was not given.
    let prefill_found = || -> Result<Cow<'_, BodyRouting<'a>>> {
        match prefill_routing {
            Some(found) => Ok(Cow::Borrowed(found)),
            None => Ok(Cow::Owned(read_body(prefill_body)?)),
        }
    };
    let decode = read_body(decode_body)?;
    if decode.is_empty() {
        if opts.require_routing {
            let prefill = prefill_found()?;
            if !prefill.is_empty() {
                return Err(Error::missing_routing(
                    Half::Decode,
                    format!(
                        "missing routing on the decode side: the prefill body carries routing \
                     (at {}) but the decode body has none",
                        prefill
                            .prompt
                            .as_ref()
                            .or(prefill.values.first())
                            .map_or("?", |f| &f.path)
                    ),
                ));
            }
        }
        return Ok(Spliced {
            pieces: vec![Piece::Copy(Cow::Borrowed(decode_body))],
            merged: 0,
            decode: Vec::new(),
        });
    }
    let prefill = prefill_found()?;
    if let Some(at) = prefill.weights.as_ref().or(decode.weights.as_ref()) {
        return Err(split::weights_error(at));
    }
    for f in prefill.values.iter().chain(&decode.values) {
        if let Some(key) = f.fields.as_ref().and_then(|x| x.extra_key.as_deref()) {
            return Err(crate::sidecar::extra_key_error(&f.path, key));
        }
    }
    if prefill.prompt.is_some() || decode.prompt.is_some() {
        let plan = split::merge_plan(
            &prefill,
            &decode,
            &opts.hints,
            opts.decode_start,
            opts.max_bytes,
        )?;
        let pieces = vec![
            Piece::Copy(Cow::Borrowed(&decode_body[..plan.at.start])),
            Piece::Copy(Cow::Borrowed(&prefill_body[plan.with])),
            Piece::Copy(Cow::Borrowed(&decode_body[plan.at.end..])),
        ];
        return Ok(Spliced {
            pieces,
            merged: 1,
            decode: decode.values,
        });
    }
    let prefill = &prefill.values;
    let mut pieces = Vec::with_capacity(decode.values.len() * 6 + 1);
    let mut at = 0;
    for d in &decode.values {
        let p = prefill
            .iter()
            .find(|p| p.index == d.index)
            .or_else(|| one_choice(prefill))
            .ok_or_else(|| {
                Error::missing_routing(
                    Half::Prefill,
                    format!(
                    "missing routing on the prefill side: decode choice {} carries routed_experts \
                     but the prefill body has no routing for it (passing decode's prompt rows on \
                     would corrupt training)",
                    d.index
                ),
                )
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
        merged: decode.values.len(),
        decode: decode.values,
    })
}

/// The routing of a body with routing for one choice only (perhaps at two places): it serves
/// every decode choice.
fn one_choice<'f, 'a>(found: &'f [Found<'a>]) -> Option<&'f Found<'a>> {
    let first = found.first()?;
    found
        .iter()
        .all(|f| f.index == first.index)
        .then_some(first)
}

/// Merge two routing values into the pieces of the JSON text that replaces the decode value.
fn merge_found<'a>(p: &Found<'a>, d: &Found<'a>, opts: &MergeOptions) -> Result<Vec<Piece<'a>>> {
    // Compact values carry their own start: the start hints are for formats that carry none.
    // Two compact values merge on their text (keep_format changes nothing: compact stays compact).
    let is_compact = |f: &Found| f.fields.is_some();
    if p.fields.is_some()
        && d.fields.is_some()
        && opts.hints.num_layers.is_none()
        && opts.hints.top_k.is_none()
        && opts.hints.dtype.is_none()
    {
        return merge_sidecars(p, d, opts);
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
    if !opts.keep_format && prefill.dtype() == decode.dtype() {
        // The merged bytes are prefill's, then decode's from `skip` on (merge::merge's rows,
        // same dtype): encoded where they lie, not joined first (vLLM's `.npy` halves take
        // this path; a join is one more copy of every byte).
        let plan = merge::plan(&prefill.header(), &decode.header())?;
        // `skip` is at most decode's rows (plan's checks), so this is within its bytes.
        let rest = &decode.bytes()[plan.skip * decode.header().row_bytes()..];
        return Ok(vec![Piece::Copy(Cow::Owned(sidecar::encode_joined(
            &plan.header,
            prefill.bytes(),
            rest,
        )))]);
    }
    let merged = merge::merge(&prefill, &decode)?;
    let (format, merged) = if opts.keep_format {
        (
            format,
            coverage::with_filler(Rule::of(format, d.place), merged)?,
        )
    } else {
        (Format::Compact, merged)
    };
    Ok(vec![Piece::Copy(Cow::Owned(formats::encode_json(
        &merged, format,
    )?))])
}

/// Merge two compact sidecars' fields into (the pieces of) the canonical sidecar text.
fn merge_sidecars<'a>(
    prefill: &Found<'a>,
    decode: &Found<'a>,
    opts: &MergeOptions,
) -> Result<Vec<Piece<'a>>> {
    // Compact values state their own positions: not held to the body's counts (format.md §3.3).
    let side = |f: &Found<'a>, name: &str| -> Result<SidecarText<'a>> {
        let fields = f.fields.clone().unwrap_or_default();
        sidecar::validate(fields, opts.max_bytes).map_err(|e| e.context(name))
    };
    let p = side(prefill, "prefill")?;
    let d = side(decode, "decode")?;
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
    if !groups_valid(dropped, dropped.len() == d.data.len(), d.data_base64) {
        return Err(b64::error_in(&d.data, "data").context("decode"));
    }
    let mut head =
        b64::decode_range(&p.data, whole, prefill_len).map_err(|e| e.context("prefill"))?;
    head.extend(b64::decode_range(&d.data, skip, skip + fill).map_err(|e| e.context("decode"))?);
    let mut pieces = vec![
        checked_copy(&p.data, 0, whole / 3 * 4, "prefill", p.data_base64)?,
        Piece::Copy(Cow::Owned(b64::encode(&head))),
    ];
    if rest < decode_len {
        pieces.push(if rest % 3 == 0 {
            checked_copy(&d.data, rest / 3 * 4, d.data.len(), "decode", d.data_base64)?
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

/// `text[from..to]` (whole groups) as a piece checked while it is copied (or, when the scan
/// that read `text` found it to be base64 characters, `scanned`, only for its length and
/// padding); text that had escapes (so is owned, not borrowed from the body) is checked here
/// and copied as it is.
fn checked_copy<'a>(
    text: &Cow<'a, [u8]>,
    from: usize,
    to: usize,
    side: &'static str,
    scanned: bool,
) -> Result<Piece<'a>> {
    let last = to == text.len();
    match text {
        Cow::Borrowed(t) => Ok(Piece::Base64 {
            text: &t[from..to],
            last,
            whole: t,
            context: side.to_string(),
            scanned,
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
    use crate::body::{find_routing, read_prefill};
    use crate::dtype::DType;
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
        let found = crate::body::read_body(p).unwrap();
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
        assert!(
            matches!(err.kind(), crate::ErrorKind::MissingRouting(Half::Prefill)),
            "{err}"
        );
    }

    #[test]
    fn read_prefill_finds_kv_params_and_rows_in_one_walk() {
        let b = br#"{"kv_transfer_params":{"remote_block_ids":[3,5],"remote_host":"h"},"choices":[{"index":0,"routed_experts":{"data":"CgsUFR4f","shape":[3,1,2],"start":0}}]}"#;
        let p = read_prefill(b).unwrap();
        assert_eq!(
            p.kv_transfer_params.unwrap(),
            br#"{"remote_block_ids":[3,5],"remote_host":"h"}"#
        );
        let rows =
            routing_rows(&p.routing.values[0], &Hints::default(), DEFAULT_MAX_BYTES).unwrap();
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
        assert!(routing_rows(&p.routing.values[0], &Hints::default(), DEFAULT_MAX_BYTES).is_err());
    }

    #[test]
    fn suspect_rows_sampled_from_text_match_the_decoded_payload() {
        use crate::payload::DTypeChoice;
        // 40 rows of 3 layers x top_k 2: every 7th zero throughout, every 5th a duplicate.
        let values: Vec<i64> = (0..40 * 6)
            .map(|i| {
                let (t, j) = (i / 6, i % 6);
                match () {
                    _ if t % 7 == 3 => 0,
                    _ if t % 5 == 1 && j % 2 == 1 => ((i - 1) % 50 + 1) as i64,
                    _ => (i % 50 + 1) as i64,
                }
            })
            .collect();
        let p = Payload::from_values(
            &values,
            Shape::new(40, 3, 2),
            4,
            DTypeChoice::Exact(DType::U16),
        )
        .unwrap();
        let hints = Hints {
            start: Some(4),
            ..Hints::default()
        };
        for format in [Format::Compact, Format::VllmNpy, Format::Lists] {
            let value = formats::encode_json(&p, format).unwrap();
            let text = format!(
                r#"{{"choices":[{{"index":0,"routed_experts":{}}}]}}"#,
                String::from_utf8(value).unwrap()
            );
            let found = find_routing(text.as_bytes()).unwrap();
            for (from, sample) in [(0, 64), (10, 7), (30, 1000), (99, 5)] {
                let mut want = Suspect::default();
                want.add_payload(&p, from, sample);
                if from == 0 {
                    assert!(want.zero_rows > 0 && want.duplicate_rows > 0, "{want:?}");
                }
                let got = suspect_rows(&found[0], &hints, DEFAULT_MAX_BYTES, from, sample).unwrap();
                assert_eq!(got, (want, 44), "{format:?} from {from}, sample {sample}");
            }
        }
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
