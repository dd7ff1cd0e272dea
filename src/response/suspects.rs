//! Sampling a routing value's rows for the marks of a broken engine (all-zero rows, ids out of
//! range), without decoding the whole value: what a proxy looks at on every reply.

use std::borrow::Cow;

use super::options::{one_choice, MergeOptions};
use super::read::decode_found;

use crate::error::Result;
use crate::formats::npy;
use crate::formats::sidecar::{self};
use crate::formats::{self, Hints};
use crate::kernels::b64;
use crate::kernels::buffer::AlignedBytes;
use crate::payload::dtype::with_element;
use crate::payload::{Header, Payload, Shape};
use crate::quality::validate::{self, Suspect};

use crate::body::Found;

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
pub(crate) fn npy_header<'t>(
    f: &Found<'t>,
    hints: &Hints,
) -> Result<Option<(&'t [u8], Header, usize)>> {
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
    let Some(len) = npy::header_len(&fixed) else {
        return Ok(None);
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

/// [`npy_header`] of a plain JSON string at a place vLLM writes, its shape within `max_bytes`
/// and held to `hints`, as the whole decode holds it: for readers that take the rows from the
/// text (`None`: decoded whole instead, for its errors).
pub(crate) fn checked_npy_header<'t>(
    f: &Found<'t>,
    hints: &Hints,
    max_bytes: usize,
) -> Option<(&'t [u8], Header, usize)> {
    if !f.plain_string || !f.place.allows(formats::Format::VllmNpy) {
        return None;
    }
    let (text, header, offset) = npy_header(f, hints).ok()??;
    crate::limits::check_shape(header.shape, header.dtype, max_bytes).ok()?;
    formats::check_hints(formats::Format::VllmNpy, &header, hints).ok()?;
    Some((text, header, offset))
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
