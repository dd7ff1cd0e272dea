//! Reading routing out of a response body: one value decoded whatever its format and held
//! to its body's token counts, a choice's routing, the rows a value holds.

use std::borrow::Cow;

use crate::error::{Error, ErrorKind, Result};
use crate::formats::sidecar::{self, SidecarFields};
use crate::formats::{self, Format, Hints};
use crate::payload::Payload;

use crate::body::coverage;
use crate::body::shared_prompt;
use crate::body::split;
use crate::body::{read_body_decoding, BodyRouting, Found};
use crate::formats::Rule;

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
                return Err(Error::new(
                    ErrorKind::Unplaced,
                    format!(
                        "{}: a value read as {} where producers write {}: not read as routing of \
                     this place (a format moved, or text that is not routing)",
                        f.path,
                        format.name(),
                        f.place.formats()
                    ),
                ));
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

/// The routing of the choice whose index is `choice`, or `None` when the body is a response
/// whose choices carry no routing at all (a choice the body does not have, a choice without
/// routing beside choices with it, and a body that is no response are errors). For
/// vLLM 0.21's split shape and the shared-prompt answer (format.md §3.4, §4.1), the whole
/// sequence: the prompt rows, then the choice's own.
pub fn from_response(
    body: &[u8],
    choice: u64,
    hints: &Hints,
    max_bytes: usize,
) -> Result<Option<Payload>> {
    let mut found = read_body_decoding(body, choice, max_bytes)?;
    let in_choice = |e: Error| e.context(format!("choice {choice}"));
    if let Some(prompt) = found.prompt.as_ref().filter(|p| p.fields.is_some()) {
        return shared_prompt::sequence(&found, prompt, choice, hints, max_bytes)
            .map_err(in_choice);
    }
    if let Some(prompt) = &found.prompt {
        return split::sequence(&found, prompt, choice, hints, max_bytes).map_err(in_choice);
    }
    // The first value of the choice, as `BodyRouting::value` finds it.
    let Some(at) = found.values.iter().position(|f| f.index == choice) else {
        return without_value(body, &found, choice);
    };
    decode_owned(found.values.swap_remove(at), hints, max_bytes)
        .map(|(_, p)| Some(p))
        .map_err(in_choice)
}

/// Why `found` has no value for `choice`: `None` only for a response that has the choice and
/// no routing in any choice; a choice it does not have is a `Field` error on `choice`, a choice
/// without routing beside choices with it `RowsLost`, a body that is no response `NotResponse`.
fn without_value(body: &[u8], found: &BodyRouting, choice: u64) -> Result<Option<Payload>> {
    let mut indexes: Vec<u64> = found.choices.iter().map(|(i, _)| *i).collect();
    indexes.extend(found.values.iter().map(|f| f.index));
    indexes.sort_unstable();
    indexes.dedup();
    let out_of_range = |indexes: &[u64]| {
        let mut list: Vec<String> = indexes.iter().take(8).map(u64::to_string).collect();
        if indexes.len() > 8 {
            list.push(format!("... {} in all", indexes.len()));
        }
        Error::field(
            "choice",
            format!("one of the body's choices ({})", list.join(", ")),
            choice,
        )
    };
    if let Some(routed) = found.values.first() {
        if found.choices.iter().any(|(i, _)| *i == choice) {
            return Err(Error::new(
                ErrorKind::RowsLost,
                format!(
                    "choice {choice} carries no routing beside choices that do (choice {}, at \
                     {}): its rows are lost{}",
                    routed.index,
                    routed.path,
                    match routed.path.starts_with("$.choices") {
                        true => "",
                        false => " (SGLang's OpenAI endpoints send choice 0's alone, there)",
                    }
                ),
            ));
        }
        return Err(out_of_range(&indexes));
    }
    crate::body::check_response(body)?;
    if indexes.contains(&choice) || (indexes.is_empty() && choice == 0) {
        return Ok(None);
    }
    Err(match indexes.is_empty() {
        false => out_of_range(&indexes),
        true => Error::field("choice", "0 (the body holds one result)", choice),
    })
}
