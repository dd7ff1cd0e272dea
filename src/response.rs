//! Routing inside whole response bodies: find it without building the rest of the body, and
//! merge prefill and decode bodies by replacing only the routing values' bytes (SPEC 4).

use std::borrow::Cow;
use std::ops::Range;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::b64;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::formats::{self, Format, Hints};
use crate::merge;
use crate::payload::Payload;
use crate::sidecar::{self, SidecarText};

/// One routing value found in a body: the choice it belongs to and where its bytes are.
#[derive(Debug, Clone)]
pub struct Found<'a> {
    pub index: u64,
    pub span: Range<usize>,
    pub raw: &'a RawValue,
    /// `meta_info.routed_experts_dtype` (SGLang), when the body names one.
    pub dtype: Option<DType>,
}

// Only the keys that can lead to routing are named; serde skips everything else without
// building it. The routing values stay raw JSON borrowed from the body.
#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow, default)]
    choices: Option<Vec<Choice<'a>>>,
    /// SGLang `/generate`.
    #[serde(borrow, default)]
    meta_info: Option<Holder<'a>>,
    /// NVIDIA Dynamo.
    #[serde(borrow, default)]
    nvext: Option<Holder<'a>>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default)]
    index: Option<u64>,
    /// vLLM, prime-rl.
    #[serde(borrow, default)]
    routed_experts: Option<&'a RawValue>,
    /// SGLang chat/completions.
    #[serde(borrow, default)]
    sgl_ext: Option<Holder<'a>>,
}

#[derive(Deserialize)]
struct Holder<'a> {
    #[serde(borrow, default)]
    routed_experts: Option<&'a RawValue>,
    #[serde(borrow, default)]
    routed_experts_dtype: Option<Cow<'a, str>>,
}

/// Every routing value in `body`, in body order, with the index of its choice. Locations:
/// `choices[i].routed_experts`, `choices[i].sgl_ext.routed_experts`, `meta_info.routed_experts`
/// and `nvext.routed_experts` (choice 0, or the position in a top-level array of SGLang batch
/// results). A choice with no `index` key takes its position in `choices`.
pub fn find_routing(body: &[u8]) -> Result<Vec<Found<'_>>> {
    let bad = |e: serde_json::Error| {
        Error::payload(format!("response body: invalid JSON or layout: {e}"))
    };
    let bodies: Vec<Body> = match body.iter().find(|c| !c.is_ascii_whitespace()) {
        Some(b'[') => serde_json::from_slice(body).map_err(bad)?,
        _ => vec![serde_json::from_slice(body).map_err(bad)?],
    };
    let mut found = Vec::new();
    for (pos, b) in bodies.into_iter().enumerate() {
        for h in [b.meta_info, b.nvext].into_iter().flatten() {
            push_holder(&mut found, body, pos as u64, h)?;
        }
        for (i, choice) in b.choices.unwrap_or_default().into_iter().enumerate() {
            let index = choice.index.unwrap_or(i as u64);
            if let Some(raw) = choice.routed_experts {
                found.push(Found {
                    index,
                    span: span_of(body, raw),
                    raw,
                    dtype: None,
                });
            }
            if let Some(h) = choice.sgl_ext {
                push_holder(&mut found, body, index, h)?;
            }
        }
    }
    found.retain(|f| f.raw.get() != "null");
    found.sort_by_key(|f| f.span.start);
    Ok(found)
}

fn push_holder<'a>(
    found: &mut Vec<Found<'a>>,
    body: &[u8],
    index: u64,
    h: Holder<'a>,
) -> Result<()> {
    if let Some(raw) = h.routed_experts {
        let dtype = h
            .routed_experts_dtype
            .as_deref()
            .map(DType::parse)
            .transpose()?;
        found.push(Found {
            index,
            span: span_of(body, raw),
            raw,
            dtype,
        });
    }
    Ok(())
}

/// Byte range of a raw value inside the body it was borrowed from.
fn span_of(body: &[u8], raw: &RawValue) -> Range<usize> {
    let start = raw.get().as_ptr() as usize - body.as_ptr() as usize;
    start..start + raw.get().len()
}

/// Decode one routing value, whatever its format.
pub fn decode_found(f: &Found, hints: &Hints, max_bytes: usize) -> Result<(Format, Payload)> {
    let hints = Hints {
        dtype: hints.dtype.or(f.dtype),
        ..*hints
    };
    formats::decode_json_value(f.raw, &hints, max_bytes)
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

#[derive(Clone, Copy, Debug)]
pub struct MergeOptions {
    pub max_bytes: usize,
    /// Join base64 text directly when the cut falls on a 3-byte boundary (same result, faster).
    pub splice: bool,
    /// Hints for the prefill values (and the decode values, unless `decode_start` is given).
    pub hints: Hints,
    /// The start of the decode values, for formats that carry none (a delta from `P-1`).
    pub decode_start: Option<u64>,
    /// Write the merged value in the decode value's format instead of a compact sidecar.
    pub keep_format: bool,
}

impl MergeOptions {
    pub fn new(max_bytes: usize) -> Self {
        MergeOptions {
            max_bytes,
            splice: true,
            hints: Hints::default(),
            decode_start: None,
            keep_format: false,
        }
    }
}

/// The decode body with each routing value replaced by its merge with the prefill routing of the
/// same choice index; every other byte unchanged.
pub fn merge_response(
    prefill_body: &[u8],
    decode_body: &[u8],
    opts: MergeOptions,
) -> Result<Vec<u8>> {
    let decode = find_routing(decode_body)?;
    if decode.is_empty() {
        return Ok(decode_body.to_vec());
    }
    let prefill = find_routing(prefill_body)?;
    let mut replacements = Vec::with_capacity(decode.len());
    for d in &decode {
        let p = prefill
            .iter()
            .find(|p| p.index == d.index)
            .or(if prefill.len() == 1 { prefill.first() } else { None })
            .ok_or_else(|| {
                Error::merge(format!(
                    "decode choice {} carries routed_experts but the prefill body has no routing for it \
                     (passing decode's prompt rows on would corrupt training)",
                    d.index
                ))
            })?;
        let merged =
            merge_found(p, d, &opts).map_err(|e| e.context(format!("choice {}", d.index)))?;
        replacements.push((d.span.clone(), merged));
    }
    Ok(splice_body(decode_body, &replacements))
}

/// Merge two routing values into the JSON text that replaces the decode value.
fn merge_found(p: &Found, d: &Found, opts: &MergeOptions) -> Result<Vec<u8>> {
    let both_compact = [p, d].iter().all(|f| f.raw.get().starts_with('{'));
    if both_compact
        && !opts.keep_format
        && opts.hints == Hints::default()
        && opts.decode_start.is_none()
    {
        return merge_values(p.raw, d.raw, opts);
    }
    let decode_hints = Hints {
        start: opts.decode_start.or(opts.hints.start),
        ..opts.hints
    };
    let (_, prefill) =
        decode_found(p, &opts.hints, opts.max_bytes).map_err(|e| e.context("prefill"))?;
    let (format, decode) =
        decode_found(d, &decode_hints, opts.max_bytes).map_err(|e| e.context("decode"))?;
    let merged = merge::merge(&prefill, &decode)?;
    formats::encode_json(
        &merged,
        if opts.keep_format {
            format
        } else {
            Format::Compact
        },
    )
}

/// Merge two compact sidecar values into the canonical sidecar text.
pub fn merge_values(prefill: &RawValue, decode: &RawValue, opts: &MergeOptions) -> Result<Vec<u8>> {
    let p = value_text(prefill, opts.max_bytes).map_err(|e| e.context("prefill"))?;
    let d = value_text(decode, opts.max_bytes).map_err(|e| e.context("decode"))?;
    let plan = merge::plan(&p.header, &d.header)?;
    if opts.splice {
        if let Some(text) = splice_text(&p, &d, &plan)? {
            return Ok(text);
        }
    }
    let prefill = p.decode().map_err(|e| e.context("prefill"))?;
    let decode = d.decode().map_err(|e| e.context("decode"))?;
    let merged = merge::merge(&prefill, &decode)?;
    Ok(sidecar::encode(&merged))
}

fn value_text(raw: &RawValue, max_bytes: usize) -> Result<SidecarText<'_>> {
    sidecar::validate(sidecar::parse_fields(raw.get().as_bytes())?, max_bytes)
}

/// When both halves share a dtype and both cuts fall on 3-byte boundaries, base64 text can be
/// joined as is: prefill's whole text, then decode's text from the first kept row on.
fn splice_text(p: &SidecarText, d: &SidecarText, plan: &merge::Plan) -> Result<Option<Vec<u8>>> {
    let prefill_bytes = p.header.shape.tokens * p.header.row_bytes();
    let skip_bytes = plan.skip * d.header.row_bytes();
    if p.header.dtype != d.header.dtype || prefill_bytes % 3 != 0 || skip_bytes % 3 != 0 {
        return Ok(None);
    }
    // Check all of both texts, so that bad input fails exactly as the decoding path would.
    b64::check(&p.data, "data").map_err(|e| e.context("prefill"))?;
    b64::check(&d.data, "data").map_err(|e| e.context("decode"))?;
    let kept = &d.data[skip_bytes / 3 * 4..];
    Ok(Some(sidecar::encode_from_base64(
        &plan.header,
        &[&p.data, kept],
    )))
}

/// `body` with each span replaced (spans sorted and disjoint).
fn splice_body(body: &[u8], replacements: &[(Range<usize>, Vec<u8>)]) -> Vec<u8> {
    let removed: usize = replacements.iter().map(|(r, _)| r.len()).sum();
    let added: usize = replacements.iter().map(|(_, t)| t.len()).sum();
    let mut out = Vec::with_capacity(body.len() - removed + added);
    let mut at = 0;
    for (range, text) in replacements {
        out.extend_from_slice(&body[at..range.start]);
        out.extend_from_slice(text);
        at = range.end;
    }
    out.extend_from_slice(&body[at..]);
    out
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
