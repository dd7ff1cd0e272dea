//! Merging a prefill body's routing into a decode body (format.md §4): each decode routing value
//! replaced by its merge with prefill's, on the base64 text where the halves line up, every
//! other byte unchanged.

use std::borrow::Cow;

use super::options::{one_choice, side_hints, MergeOptions};
use super::read::decode_found;
use super::spliced::{checked_copy, groups_valid, Piece, Spliced};

use crate::error::{Error, Half, Result};
use crate::formats::sidecar::{self, SidecarText};
use crate::formats::{self, Format};
use crate::kernels::b64;
use crate::payload::merge;

use crate::body::coverage;
use crate::body::split;
use crate::body::{read_body, BodyRouting, Found};
use crate::formats::Rule;

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
    let mut opts = opts;
    if let Some(start) = super::decode_start::derive(&decode.values, &opts)? {
        opts.decode_start = Some(start);
    }
    if let Some(at) = prefill.weights.as_ref().or(decode.weights.as_ref()) {
        return Err(split::weights_error(at));
    }
    for f in prefill.values.iter().chain(&decode.values) {
        if let Some(key) = f.fields.as_ref().and_then(|x| x.extra_key.as_deref()) {
            return Err(crate::formats::sidecar::extra_key_error(&f.path, key));
        }
    }
    // vLLM 0.21's split bodies already carry the prompt's rows once: they merge as they are.
    if opts.shared_prompt && prefill.prompt.is_none() && decode.prompt.is_none() {
        return super::shared_prompt::answer(&prefill.values, decode_body, decode, &opts);
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

/// Merge two routing values into the pieces of the JSON text that replaces the decode value.
fn merge_found<'a>(p: &Found<'a>, d: &Found<'a>, opts: &MergeOptions) -> Result<Vec<Piece<'a>>> {
    // Compact values carry their own start: the start hints are for formats that carry none.
    // Two compact values merge on their text (keep_format changes nothing: compact stays compact).
    if p.fields.is_some()
        && d.fields.is_some()
        && opts.hints.num_layers.is_none()
        && opts.hints.top_k.is_none()
        && opts.hints.dtype.is_none()
    {
        return merge_sidecars(p, d, opts);
    }
    // vLLM's `.npy` halves merged on their text: copied where it lines up (kept as `.npy`),
    // else decoded and encoded a block at a time.
    if opts.splice {
        if let Some(pieces) = super::npy_text::merge_npy_text(p, d, opts) {
            return Ok(pieces);
        }
    }
    let prefill_hints = side_hints(p, opts.hints.start, opts);
    let decode_hints = side_hints(d, opts.decode_start.or(opts.hints.start), opts);
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
