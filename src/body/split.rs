//! vLLM 0.21's split routing (format.md §3.4): the prompt's rows once, at the top of the body
//! (`prompt_routed_experts`), and each choice's generated rows in the choice, both as nested
//! lists of int16 ids. Read as one sequence from position 0; prefill and decode bodies of this
//! shape merge by taking the prompt rows from prefill.

use std::ops::Range;

use crate::body::{BodyRouting, Counts, Found};
use crate::error::{Error, ErrorKind, Result};
use crate::formats::{self, Format, Hints};
use crate::payload::dtype::with_element;
use crate::payload::merge;
use crate::payload::{DTypeChoice, Payload};

/// The release that writes this shape, for messages.
const WHO: &str = "vLLM 0.21's split routing";

/// Hints that place rows (a start) do not apply: the split shape fixes every position.
fn check_no_start(hints: &Hints, decode_start: Option<u64>) -> Result<()> {
    match hints.start.or(decode_start).filter(|&s| s != 0) {
        Some(s) => Err(Error::field(
            "start",
            format!("no start for {WHO} (its prompt rows begin at position 0)"),
            s,
        )),
        None => Ok(()),
    }
}

/// Decode one nested-lists value of a split body, with the shape and dtype hints only.
fn decode_lists(f: &Found, hints: &Hints, start: u64, max_bytes: usize) -> Result<Payload> {
    let hints = Hints {
        start: Some(start),
        ..*hints
    };
    match formats::decode_json_value(f.text, &hints, max_bytes)? {
        (Format::Lists, p) => Ok(p),
        (other, _) => Err(Error::malformed(format!(
            "{WHO}: expected nested lists, got a {} value",
            other.name()
        ))
        .context(&f.path)),
    }
}

/// The prompt rows, checked against the body's prompt length.
fn prompt_rows(
    prompt: &Found,
    counts: &Counts,
    hints: &Hints,
    max_bytes: usize,
) -> Result<Payload> {
    let p = decode_lists(prompt, hints, 0, max_bytes)?;
    if let Some((n, at)) = counts.prompt {
        if p.num_tokens() as u64 != n {
            return Err(Error::malformed(format!(
                "{WHO}: prompt_routed_experts holds {} rows but the body counts {n} prompt \
                 tokens ({at}); vLLM 0.21 returns one row per prompt token (and, for a batch of \
                 prompts, only the first prompt's rows, which no choice can be matched to)",
                p.num_tokens()
            )));
        }
    }
    Ok(p)
}

/// The whole sequence of one choice of a split body: the prompt rows at positions `[0, P)`,
/// then the choice's generated rows. Rows that are zero in every id (top_k > 1) are marked
/// missing: vLLM 0.21 leaves prefix-cached positions at zero, and no router picks one expert
/// twice.
pub fn sequence(
    body: &BodyRouting,
    prompt: &Found,
    choice: u64,
    hints: &Hints,
    max_bytes: usize,
) -> Result<Option<Payload>> {
    check_no_start(hints, None)?;
    if !body.choices.iter().any(|(i, _)| *i == choice) {
        return Ok(None);
    }
    let counts = body.counts(choice);
    let prompt = prompt_rows(prompt, &counts, hints, max_bytes)?;
    let start = prompt.num_tokens() as u64;
    let whole = match body.value(choice) {
        Some(f) => {
            let generated = decode_lists(f, hints, start, max_bytes)?;
            check_generated(&generated, &counts)?;
            let ends = [
                (&prompt, 0, prompt.num_tokens()),
                (&generated, 0, generated.num_tokens()),
            ];
            merge::concat(0, &ends).map_err(|e| e.context(WHO))?
        }
        None => {
            // No generated rows: right after one generated token (max_tokens=1, as a P/D
            // prefill runs), rows lost otherwise (a preempted request, a stop string).
            match counts.generated {
                Some((g, _)) if g <= 1 => prompt,
                Some((g, at)) => {
                    return Err(Error::new(
                        ErrorKind::RowsLost,
                        format!(
                            "{WHO}: choice {choice} generated {g} tokens ({at}) but its \
                         routed_experts is null, so the routing of its generated tokens is lost \
                         (vLLM 0.21 returns null after a preemption or a stop-string finish)"
                        ),
                    ))
                }
                None => {
                    return Err(Error::new(
                        ErrorKind::Unplaced,
                        format!(
                        "{WHO}: choice {choice}'s routed_experts is null and the body does not \
                         say how many tokens it generated, so whether rows are missing cannot \
                         be told"
                    ),
                    ))
                }
            }
        }
    };
    mark_unrecorded(whole).map(Some)
}

/// A choice's generated rows: at most one per generated token (one fewer normally, the last
/// sampled token never ran; as many with speculative decoding).
fn check_generated(generated: &Payload, counts: &Counts) -> Result<()> {
    match counts.generated {
        Some((g, at)) if generated.num_tokens() as u64 > g => Err(Error::malformed(format!(
            "{WHO}: a choice's routed_experts holds {} rows but the body counts {g} generated \
             tokens ({at}); vLLM 0.21 returns at most one row per generated token",
            generated.num_tokens()
        ))),
        _ => Ok(()),
    }
}

/// Rows that are zero in every id, marked missing (`-1`), when top_k > 1 (a row of zeros then
/// picks expert 0 twice, which no router does).
fn mark_unrecorded(p: Payload) -> Result<Payload> {
    let row = p.num_layers() * p.top_k();
    if p.top_k() < 2 || row == 0 {
        return Ok(p);
    }
    let zero_rows: Vec<usize> = with_element!(p.dtype(), T => {
        let values = p.values::<T>();
        (0..p.num_tokens())
            .filter(|&t| values[t * row..(t + 1) * row].iter().all(|&v| Into::<i64>::into(v) == 0))
            .collect()
    });
    if zero_rows.is_empty() {
        return Ok(p);
    }
    let mut values: Vec<i64> = (0..p.num_tokens() * row).map(|i| p.value_at(i)).collect();
    for t in zero_rows {
        values[t * row..(t + 1) * row].fill(-1);
    }
    Payload::from_values(&values, p.shape(), p.start(), DTypeChoice::Compact)
}

/// The one rewrite a merge of two split bodies makes: the decode body's prompt rows (the span
/// `at` in the decode body) become the prefill body's (the span `with` in the prefill body).
/// Every value of both bodies is decoded and checked first: the prompt rows of both halves
/// must be as many, and every value of one shape.
pub struct Rewrite {
    /// The decode body's `prompt_routed_experts` value.
    pub at: Range<usize>,
    /// The prefill body's, which replaces it.
    pub with: Range<usize>,
}

/// Plan the merge of two bodies of which at least one is split; anything but two split bodies
/// of one shape is a `MergeError` saying why.
pub fn merge_plan(
    prefill: &BodyRouting,
    decode: &BodyRouting,
    hints: &Hints,
    decode_start: Option<u64>,
    max_bytes: usize,
) -> Result<Rewrite> {
    for (side, body) in [("prefill", prefill), ("decode", decode)] {
        if body.prompt.as_ref().is_some_and(|p| p.fields.is_some()) {
            return Err(Error::inconsistent(format!(
                "the {side} body is a shared-prompt answer (a compact prompt_routed_experts,                  format.md §4.1): a merged answer, not a half to merge"
            )));
        }
    }
    check_no_start(hints, decode_start)?;
    let (Some(pp), Some(dp)) = (&prefill.prompt, &decode.prompt) else {
        let (split, other) = match prefill.prompt {
            Some(_) => ("prefill", "decode"),
            None => ("decode", "prefill"),
        };
        return Err(Error::inconsistent(format!(
            "the {split} body is {WHO} (top-level prompt_routed_experts) and the {other} body is \
             not: the two servers run different releases, and their rows cannot be joined by \
             position"
        )));
    };
    if let Some(at) = prefill.weights.as_ref().or(decode.weights.as_ref()) {
        return Err(weights_error(at));
    }
    let p =
        prompt_rows(pp, &prefill.counts(0), hints, max_bytes).map_err(|e| e.context("prefill"))?;
    let d =
        prompt_rows(dp, &decode.counts(0), hints, max_bytes).map_err(|e| e.context("decode"))?;
    merge::check_same_rows(p.shape(), d.shape(), "prefill's prompt rows", "decode's")?;
    if p.num_tokens() != d.num_tokens() {
        return Err(Error::inconsistent(format!(
            "{WHO}: prefill returned {} prompt rows and decode {}: the halves are of different \
             prompts",
            p.num_tokens(),
            d.num_tokens()
        )));
    }
    for f in &decode.values {
        let g = decode_lists(f, hints, p.num_tokens() as u64, max_bytes)
            .map_err(|e| e.context(format!("decode choice {}", f.index)))?;
        check_generated(&g, &f.counts)
            .map_err(|e| e.context(format!("decode choice {}", f.index)))?;
        merge::check_same_rows(
            p.shape(),
            g.shape(),
            "prefill's prompt rows",
            "decode's generated rows",
        )?;
    }
    Ok(Rewrite {
        at: dp.span.clone(),
        with: pp.span.clone(),
    })
}

/// A merge of bodies that carry `routed_expert_weights`: the ids would be merged and decode's
/// weights passed on beside them unmerged, so it is refused.
pub fn weights_error(at: &str) -> Error {
    Error::inconsistent(format!(
        "a routed_expert_weights key at {at}: routing weights are not merged (no released \
         producer writes them; prime-rl's PR is open), and passing decode's on beside merged ids \
         would pair the prompt's ids with the wrong weights"
    ))
}
