//! Which token positions a routing value covers, by the format that carried it, held against the
//! token counts its body states (format.md §3.3): a value with more rows than its sequence has
//! tokens, or a start that its counts contradict, is refused, never read as routing of other
//! positions.

use crate::body::Counts;
use crate::error::{Error, ErrorKind, Result};
use crate::formats::{producer, Format, Rule};
use crate::payload::dtype::with_element;
use crate::payload::merge;
use crate::payload::{DTypeChoice, Header, Payload, Shape};

/// A NeMo-RL value without its filler last row, so that it covers what every other producer's
/// does (`[0, P + G - 1)`) and a prefill half's filler never stands in for decode's real row.
/// A row is dropped only when it is the filler: NeMo-RL writes `P + G` rows, the last the
/// filler; a value of `P + G - 1` rows (as `encode(p, "nemo")` writes a payload, which adds no
/// filler) keeps every row. Where the body states both counts, they decide, and a last row of
/// `P + G` that is not the filler is an error; without counts, the last row is dropped when it
/// is the filler (`0, 1, ..., top_k - 1` in every layer).
pub fn without_filler(rule: Rule, p: Payload, counts: &Counts) -> Result<Payload> {
    if rule != Rule::WholeWithFiller || p.num_tokens() == 0 {
        return Ok(p);
    }
    let last = p.num_tokens() - 1;
    let is_filler = last_row_is_filler(&p);
    if let (Some((prompt, _)), Some((generated, _))) = (counts.prompt, counts.generated) {
        let whole = prompt.saturating_add(generated);
        if p.stop() != whole {
            return Ok(p); // P + G - 1 rows: no filler was written
        }
        if !is_filler {
            return Err(Error::new(
                ErrorKind::Unplaced,
                format!(
                "NeMo-RL writes {whole} rows for {prompt} prompt and {generated} generated tokens, \
                 the last (position {last}) its filler 0..{} in every layer; this value's last row \
                 holds other ids: not read",
                p.top_k()
            ),
            ));
        }
    } else if !is_filler {
        return Ok(p);
    }
    // The buffer is cut in place: no copy of the rows kept.
    let (start, dtype) = (p.start(), p.dtype());
    let shape = Shape {
        tokens: last,
        ..p.shape()
    };
    let mut data = p.into_data();
    data.truncate(shape.nbytes(dtype)?);
    Payload::new(start, shape, dtype, data)
}

/// Whether `p`'s last row is NeMo-RL's filler: `0, 1, ..., top_k - 1` in every layer.
fn last_row_is_filler(p: &Payload) -> bool {
    let (k, row) = (p.top_k(), p.num_layers() * p.top_k());
    let Some(last) = p.num_tokens().checked_sub(1) else {
        return false;
    };
    with_element!(p.dtype(), T => {
        let values = p.values::<T>();
        values[last * row..(last + 1) * row]
            .chunks_exact(k.max(1))
            .all(|g| g.iter().enumerate().all(|(i, &v)| Into::<i64>::into(v) == i as i64))
    })
}

/// The filler row put back after `p`, for a merged value written in NeMo-RL's own shape.
pub fn with_filler(rule: Rule, p: Payload) -> Result<Payload> {
    if rule != Rule::WholeWithFiller {
        return Ok(p);
    }
    let (layers, top_k) = (p.num_layers(), p.top_k());
    let filler: Vec<i64> = (0..layers).flat_map(|_| 0..top_k as i64).collect();
    let row = Payload::from_values(
        &filler,
        Shape::new(1, layers, top_k),
        p.stop(),
        DTypeChoice::Exact(p.dtype()),
    )?;
    merge::concat(p.start(), &[(&p, 0, p.num_tokens()), (&row, 0, 1)])
}

/// Check a decoded value's header (start, rows) against the counts of its body, when the body
/// states both the prompt's and the generated length. `start_given` says whether the start came
/// from the caller (else it was taken as 0, and a value that ends early is a start the caller
/// did not pass).
pub fn check(
    rule: Rule,
    format: Format,
    header: &Header,
    counts: &Counts,
    start_given: bool,
) -> Result<()> {
    let (Some((prompt, prompt_at)), Some((generated, generated_at))) =
        (counts.prompt, counts.generated)
    else {
        return Ok(());
    };
    let (start, rows, stop) = (header.start, header.shape.tokens, header.stop());
    let tokens = prompt.saturating_add(generated);
    let said = format!(
        "the body counts {prompt} prompt tokens ({prompt_at}) and {generated} generated \
         ({generated_at})"
    );
    let name = format.name();
    let counts = ErrorKind::Counts {
        rows: rows as u64,
        start,
    };
    let contradiction = |expected: String| {
        Error::new(
            counts.clone(),
            format!(
            "routing rows contradict the body's token counts: the {name} value holds {rows} rows \
             from position {start}, so they end at {stop}, but {said}, so {expected}"
        ),
        )
    };
    match rule {
        Rule::EndsBeforeLastToken => {
            let end = tokens.saturating_sub(1);
            if stop == end {
                return Ok(());
            }
            let mut msg = contradiction(format!(
                "they end at {end} (every position but the last sampled token's)"
            ))
            .to_string();
            if stop < end && !start_given {
                msg.push_str(&format!(
                    "; if the request asked for routing from a later position (vLLM's \
                     routed_experts_prompt_start, SGLang's routed_experts_start_len), pass that \
                     start ({})",
                    end - rows as u64
                ));
            } else if stop > end && start_given && end >= rows as u64 {
                // Who ignores the start it was asked for, by format (format.md §3.5).
                let who = producer(format)
                    .ignores_start
                    .map(|who| format!(" ({who})"))
                    .unwrap_or_default();
                msg.push_str(&format!(
                    "; the server sent rows from position {}{who}, not from the start given",
                    end - rows as u64
                ));
            }
            Err(Error::new(counts, msg))
        }
        Rule::WholeWithFiller
            if start != 0 || (stop != tokens && stop != tokens.saturating_sub(1)) =>
        {
            Err(contradiction(format!(
                "NeMo-RL's rows are [0, {tokens}), the last a filler (or [0, {}) without it)",
                tokens.saturating_sub(1)
            )))
        }
        Rule::FromZero | Rule::ListsAtChoice if stop > tokens => Err(contradiction(format!(
            "the sequence has {tokens} positions"
        ))),
        Rule::ListsAtChoice
            if start == 0
                && prompt > 0
                && (generated.saturating_sub(1)..=generated).contains(&(rows as u64)) =>
        {
            Err(Error::new(
                ErrorKind::Unplaced,
                format!(
                    "ambiguous routing: the nested lists hold {rows} rows and {said}: read as \
                 lmdeploy's they are positions [0, {rows}) of {tokens}; read as vLLM 0.21's they \
                 are the {generated} generated tokens' rows, whose prompt rows (the top-level \
                 prompt_routed_experts) are missing, as when a router re-serialises the body \
                 through typed structs; the two cannot be told apart, so neither is guessed"
                ),
            ))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::Place;
    use crate::payload::dtype::DType;
    use crate::payload::Shape;

    fn header(start: u64, rows: usize) -> Header {
        Header::new(start, Shape::new(rows, 2, 2), DType::U8).unwrap()
    }

    fn check_at(format: Format, h: &Header, c: &Counts, start_given: bool) -> Result<()> {
        check(Rule::of(format, Place::Choice), format, h, c, start_given)
    }

    fn counts(p: u64, g: u64) -> Counts {
        Counts {
            prompt: Some((p, "usage.prompt_tokens")),
            generated: Some((g, "usage.completion_tokens")),
        }
    }

    #[test]
    fn npy_rows_end_before_the_last_token() {
        let c = counts(7, 5);
        assert!(check_at(Format::VllmNpy, &header(0, 11), &c, false).is_ok());
        assert!(check_at(Format::VllmNpy, &header(6, 5), &c, true).is_ok());
        let err = check_at(Format::VllmNpy, &header(0, 24), &c, false).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("24 rows") && msg.contains("7 prompt tokens"),
            "{msg}"
        );
        // A delta read without its start: the message says which start fits.
        let msg = check_at(Format::VllmNpy, &header(0, 5), &c, false)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("pass that start (6)"), "{msg}");
        // SGLang that ignored the start asked for.
        let msg = check_at(Format::Sglang, &header(4, 11), &c, true)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("from position 0"), "{msg}");
        // Unknown counts: nothing to check.
        let half = Counts {
            generated: None,
            ..c
        };
        assert!(check_at(Format::VllmNpy, &header(0, 24), &half, false).is_ok());
    }

    #[test]
    fn other_formats_by_their_producers_rules() {
        let c = counts(7, 5);
        // Compact values place themselves.
        assert!(check_at(Format::Compact, &header(0, 40), &c, false).is_ok());
        assert!(check_at(Format::Lists, &header(0, 11), &c, false).is_ok());
        assert!(check_at(Format::Lists, &header(0, 13), &c, false).is_err());
        assert!(check_at(Format::Nemo, &header(0, 12), &c, false).is_ok());
        assert!(check_at(Format::Nemo, &header(0, 11), &c, false).is_ok()); // no filler
        let msg = check_at(Format::Nemo, &header(0, 10), &c, false)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("[0, 12)"), "{msg}");
        // NeMo-RL's nested lists (before its PR #3292), at its place, carry the filler too.
        let rule = Rule::of(Format::Lists, Place::Message);
        assert_eq!(rule, Rule::WholeWithFiller);
        assert!(check(rule, Format::Lists, &header(0, 13), &c, false).is_err());
    }

    #[test]
    fn nested_lists_at_a_choice_of_vllm_021s_count_are_ambiguous() {
        // 7 prompt and 5 generated tokens: lmdeploy writes 11 rows (10 after a stop string);
        // vLLM 0.21 writes 4 or 5 generated rows there, its prompt rows at the top level.
        let c = counts(7, 5);
        let rule = Rule::of(Format::Lists, Place::Choice);
        assert_eq!(rule, Rule::ListsAtChoice);
        assert!(check(rule, Format::Lists, &header(0, 11), &c, false).is_ok());
        assert!(check(rule, Format::Lists, &header(0, 10), &c, false).is_ok());
        for rows in [4, 5] {
            let msg = check(rule, Format::Lists, &header(0, rows), &c, false)
                .unwrap_err()
                .to_string();
            assert!(
                msg.contains("ambiguous") && msg.contains("vLLM 0.21"),
                "{msg}"
            );
            assert!(msg.contains("lmdeploy"), "{msg}");
        }
        // Elsewhere (lmdeploy's /generate meta_info) lists are lmdeploy's alone.
        let other = Rule::of(Format::Lists, Place::Sglang);
        assert!(check(other, Format::Lists, &header(0, 5), &c, false).is_ok());
    }

    #[test]
    fn nemo_filler_is_dropped_and_put_back() {
        let values: Vec<i64> = vec![5, 7, 1, 4, 0, 1];
        let p = Payload::from_values(
            &values,
            Shape::new(3, 1, 2),
            0,
            DTypeChoice::Exact(DType::I8),
        )
        .unwrap();
        let none = Counts::default();
        let trimmed = without_filler(Rule::WholeWithFiller, p.clone(), &none).unwrap();
        assert_eq!(trimmed.values::<i8>(), &[5, 7, 1, 4]);
        assert_eq!(
            with_filler(Rule::WholeWithFiller, trimmed.clone()).unwrap(),
            p
        );
        assert_eq!(without_filler(Rule::FromZero, p.clone(), &none).unwrap(), p);
        // With the counts: P + G rows drop the filler, P + G - 1 keep every row.
        let c = counts(2, 1);
        assert_eq!(
            without_filler(Rule::WholeWithFiller, p.clone(), &c).unwrap(),
            trimmed
        );
        let c = counts(2, 2);
        assert_eq!(
            without_filler(Rule::WholeWithFiller, p.clone(), &c).unwrap(),
            p
        );
    }

    #[test]
    fn a_last_row_that_is_not_the_filler_is_never_dropped() {
        // What encode(p, "nemo") writes for a payload: its rows, no filler.
        let real = Payload::from_values(
            &[5i64, 7, 1, 4, 3, 6],
            Shape::new(3, 1, 2),
            0,
            DTypeChoice::Exact(DType::I8),
        )
        .unwrap();
        let none = Counts::default();
        assert_eq!(
            without_filler(Rule::WholeWithFiller, real.clone(), &none).unwrap(),
            real
        );
        // Counted as NeMo-RL's P + G rows, its last row must be the filler.
        let msg = without_filler(Rule::WholeWithFiller, real.clone(), &counts(2, 1))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("position 2") && msg.contains("filler"),
            "{msg}"
        );
    }
}
