//! Routing inside whole response bodies: find it without building the rest of the body, and
//! merge prefill and decode bodies by replacing only the routing values' bytes (SPEC 4).

use std::ops::Range;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::b64;
use crate::error::{Error, Result};
use crate::merge;
use crate::payload::Payload;
use crate::sidecar::{self, SidecarText};

/// One routing value found in a body: the choice it belongs to and where its bytes are.
#[derive(Debug, Clone)]
pub struct Found<'a> {
    pub index: u64,
    pub span: Range<usize>,
    pub raw: &'a RawValue,
}

// Only the keys that can lead to routing are named; serde skips everything else without
// building it. The routing values stay raw JSON borrowed from the body.
#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow, default)]
    choices: Option<Vec<Choice<'a>>>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default)]
    index: Option<u64>,
    #[serde(borrow, default)]
    routed_experts: Option<&'a RawValue>,
}

/// Every routing value in `body`, in body order, with the index of its choice (a choice with no
/// `index` key takes its position in `choices`).
pub fn find_routing(body: &[u8]) -> Result<Vec<Found<'_>>> {
    let parsed: Body = serde_json::from_slice(body)
        .map_err(|e| Error::payload(format!("response body: invalid JSON or layout: {e}")))?;
    let mut found = Vec::new();
    for (pos, choice) in parsed.choices.unwrap_or_default().into_iter().enumerate() {
        if let Some(raw) = choice.routed_experts {
            found.push(Found {
                index: choice.index.unwrap_or(pos as u64),
                span: span_of(body, raw),
                raw,
            });
        }
    }
    found.sort_by_key(|f| f.span.start);
    Ok(found)
}

/// Byte range of a raw value inside the body it was borrowed from.
fn span_of(body: &[u8], raw: &RawValue) -> Range<usize> {
    let start = raw.get().as_ptr() as usize - body.as_ptr() as usize;
    start..start + raw.get().len()
}

/// Decode one routing value (a compact sidecar object).
pub fn decode_value(raw: &RawValue, max_bytes: usize) -> Result<Payload> {
    value_text(raw, max_bytes)?.decode()
}

fn value_text(raw: &RawValue, max_bytes: usize) -> Result<SidecarText<'_>> {
    sidecar::validate(sidecar::parse_fields(raw.get().as_bytes())?, max_bytes)
}

/// The routing of the choice whose index is `choice`, or `None` when it carries none.
pub fn from_response(body: &[u8], choice: u64, max_bytes: usize) -> Result<Option<Payload>> {
    let found = find_routing(body)?;
    found
        .iter()
        .find(|f| f.index == choice)
        .map(|f| decode_value(f.raw, max_bytes).map_err(|e| e.context(format!("choice {choice}"))))
        .transpose()
}

#[derive(Clone, Copy, Debug)]
pub struct MergeOptions {
    pub max_bytes: usize,
    /// Join base64 text directly when the cut falls on a 3-byte boundary (same result, faster).
    pub splice: bool,
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
        let merged = merge_values(p.raw, d.raw, opts)
            .map_err(|e| e.context(format!("choice {}", d.index)))?;
        replacements.push((d.span.clone(), merged));
    }
    Ok(splice_body(decode_body, &replacements))
}

/// Merge two routing values into the canonical sidecar text.
pub fn merge_values(prefill: &RawValue, decode: &RawValue, opts: MergeOptions) -> Result<Vec<u8>> {
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
            from_response(b.as_bytes(), 1, DEFAULT_MAX_BYTES)
                .unwrap()
                .unwrap()
                .start(),
            2
        );
        assert!(from_response(b.as_bytes(), 0, DEFAULT_MAX_BYTES)
            .unwrap()
            .is_none());
    }
}
