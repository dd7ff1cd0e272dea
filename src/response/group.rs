//! A group's routing read once (format.md §4.1, §6): the rows its choices share, the prompt's,
//! held once, and each choice's own rows beside them, so a GRPO group of `n` choices is held at
//! its information's size, not `n` copies of its prompt, until it is packed
//! ([`pack::layout_parts`](crate::pack::layout_parts) takes the parts as they are).

use std::collections::HashSet;

use crate::body::{read_body, shared_prompt, split, BodyRouting};
use crate::error::{Error, ErrorKind, Result};
use crate::formats::Hints;
use crate::payload::Payload;

use super::read::decode_found;

/// A response body's choices as parts: what they share, and what is each one's own.
#[derive(Debug, Default, PartialEq)]
pub struct Group {
    /// The rows the choices that share them hold in common: the prompt's (a shared-prompt
    /// answer's `prompt_routed_experts`, or, in an answer whose choices each hold their whole
    /// sequence, the rows before the prompt's end that every such choice holds alike).
    pub shared: Option<Payload>,
    /// Every choice with routing, by index.
    pub choices: Vec<GroupChoice>,
}

/// One choice of a [`Group`].
#[derive(Debug, PartialEq)]
pub struct GroupChoice {
    /// The choice's index.
    pub index: u64,
    /// Whether its sequence is [`Group::shared`]'s rows, then [`own`](Self::own); else `own` is
    /// its whole sequence.
    pub shares: bool,
    /// Its rows after the shared ones (its whole sequence when it shares none).
    pub own: Payload,
}

/// Every choice of `body` with routing, its rows split into what the group shares and what is
/// its own. Positions are never guessed: the shared rows are the shared-prompt answer's, or the
/// rows before the prompt's end that the body's counts state (`usage.prompt_tokens`, prompt
/// ids) and that every choice holds byte for byte alike; a choice whose rows differ there is
/// held whole. A choice without routing beside choices with it is `RowsLost`; a body without
/// routing is an empty group.
pub fn group_from_response(body: &[u8], hints: &Hints, max_bytes: usize) -> Result<Group> {
    group_of(read_body(body)?, hints, max_bytes)
}

/// [`group_from_response`] of a body already walked.
pub(crate) fn group_of(found: BodyRouting, hints: &Hints, max_bytes: usize) -> Result<Group> {
    if let Some(prompt) = found.prompt.as_ref().filter(|p| p.fields.is_some()) {
        return shared_answer(&found, prompt, hints, max_bytes);
    }
    let mut group = Group::default();
    if let Some(prompt) = &found.prompt {
        // vLLM 0.21's split rows: each choice read whole (its zero rows marked missing).
        for (index, _) in &found.choices {
            let in_choice = |e: Error| e.context(format!("choice {index}"));
            let read = split::sequence(&found, prompt, *index, hints, max_bytes);
            if let Some(own) = read.map_err(in_choice)? {
                group.choices.push(GroupChoice {
                    index: *index,
                    shares: false,
                    own,
                });
            }
        }
        return Ok(group);
    }
    let mut seen = HashSet::new();
    for f in &found.values {
        if !seen.insert(f.index) {
            continue; // the same routing at a second place (SGLang, Dynamo): read once
        }
        let (_, rows) = decode_found(f, hints, max_bytes)
            .map_err(|e| e.context(format!("choice {}", f.index)))?;
        let prompt = f.counts.prompt.map(|(p, _)| p);
        let choice = split_off(&mut group.shared, rows, prompt, f.index)?;
        group.choices.push(choice);
    }
    check_every_choice(&found, &group)?;
    Ok(group)
}

/// `rows` of choice `index` as the group's: the shared rows taken from it (the first choice
/// that reaches the prompt's end gives them), or checked against them.
fn split_off(
    shared: &mut Option<Payload>,
    rows: Payload,
    prompt: Option<u64>,
    index: u64,
) -> Result<GroupChoice> {
    let whole = |own| GroupChoice {
        index,
        shares: false,
        own,
    };
    let Some(p) = prompt.filter(|&p| rows.start() < p && p <= rows.stop()) else {
        return Ok(whole(rows));
    };
    let held = (p - rows.start()) as usize;
    match shared {
        None => {
            // The first choice's rows become the shared ones and its own, views of its one
            // buffer (which holds just those): no copy.
            let (prompt_rows, own) = rows.split_at(p)?;
            *shared = Some(prompt_rows);
            return Ok(GroupChoice {
                index,
                shares: true,
                own,
            });
        }
        Some(s) => {
            let alike = s.start() == rows.start()
                && s.num_tokens() == held
                && s.dtype() == rows.dtype()
                && s.bytes() == rows.rows(0, held);
            if !alike {
                return Ok(whole(rows));
            }
        }
    }
    Ok(GroupChoice {
        index,
        shares: true,
        own: rows.slice(p, rows.stop())?,
    })
}

/// The shared-prompt answer read as a group: its prompt's rows, each choice's own (held to
/// follow them exactly, as [`shared_prompt::sequence`] holds them).
fn shared_answer(
    found: &BodyRouting,
    prompt: &crate::body::Found,
    hints: &Hints,
    max_bytes: usize,
) -> Result<Group> {
    let shared = shared_prompt::prompt_rows(prompt, hints, max_bytes)?;
    let mut group = Group {
        shared: None,
        choices: Vec::new(),
    };
    let mut seen = HashSet::new();
    for f in &found.values {
        if !seen.insert(f.index) {
            continue;
        }
        let own = shared_prompt::own_rows(&shared, f, hints, max_bytes)
            .map_err(|e| e.context(format!("choice {}", f.index)))?;
        group.choices.push(GroupChoice {
            index: f.index,
            shares: true,
            own,
        });
    }
    group.shared = Some(shared);
    check_every_choice(found, &group)?;
    Ok(group)
}

/// A body's choices either all carry routing or none does: one without it beside others is
/// rows lost, never a shorter group.
fn check_every_choice(found: &BodyRouting, group: &Group) -> Result<()> {
    if group.choices.is_empty() {
        return Ok(());
    }
    let routed: HashSet<u64> = group.choices.iter().map(|c| c.index).collect();
    match found.choices.iter().find(|(i, _)| !routed.contains(i)) {
        Some((i, _)) => Err(Error::new(
            ErrorKind::RowsLost,
            format!("choice {i} carries no routing beside choices that do: its rows are lost"),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::formats::{encode_json, Format};
    use crate::limits::DEFAULT_MAX_BYTES;
    use crate::pack::{layout, layout_parts, pack_into, pack_parts_into, PackOptions};
    use crate::payload::dtype::DType;
    use crate::payload::{DTypeChoice, Shape};
    use crate::response::{from_response, merge_response, MergeOptions};

    /// Rows `[start, stop)`: alike in every choice before `prompt`, the choice's own after.
    fn rows(start: u64, stop: u64, prompt: u64, choice: u64) -> Payload {
        let values: Vec<i64> = (start..stop)
            .flat_map(|t| {
                let salt = if t >= prompt { 17 * (choice + 1) } else { 0 };
                [(t * 5 + salt) as i64 % 90, (t * 5 + salt + 1) as i64 % 90]
            })
            .collect();
        let shape = Shape::new((stop - start) as usize, 1, 2);
        Payload::from_values(&values, shape, start, DTypeChoice::Compact).unwrap()
    }

    /// A body of one choice per value, in `format`, stating `prompt` when given (each choice's
    /// text holds an escaped quote, for readers that lex it).
    pub(in crate::response) fn body(
        values: &[Payload],
        format: Format,
        prompt: Option<u64>,
    ) -> Vec<u8> {
        let choices: Vec<String> = values
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let v = String::from_utf8(encode_json(p, format).unwrap()).unwrap();
                format!(r#"{{"index":{i},"text":"a\"b","routed_experts":{v}}}"#)
            })
            .collect();
        let usage = prompt.map_or(String::new(), |p| {
            format!(r#","usage":{{"prompt_tokens":{p}}}"#)
        });
        format!(r#"{{"id":"x","choices":[{}]{usage}}}"#, choices.join(",")).into_bytes()
    }

    /// The shared-prompt answer of `n` choices over `prompt` tokens, 3 generated each, their
    /// rows made by `rows(start, stop, prompt, choice)`.
    pub(in crate::response) fn shared_answer(
        rows: fn(u64, u64, u64, u64) -> Payload,
        prompt: u64,
        n: u64,
    ) -> Vec<u8> {
        let prefill = body(&[rows(0, prompt, prompt, 0)], Format::Compact, Some(prompt));
        let decode: Vec<Payload> = (0..n)
            .map(|c| rows(prompt - 1, prompt + 3, prompt, c))
            .collect();
        let opts = MergeOptions {
            shared_prompt: true,
            ..MergeOptions::new(DEFAULT_MAX_BYTES)
        };
        merge_response(&prefill, &body(&decode, Format::Compact, None), opts).unwrap()
    }

    /// The group packed from its parts equals the choices packed whole (from_response).
    fn packs_as_whole(body: &[u8], group: &Group) {
        let n = group.choices.len();
        let whole: Vec<Payload> = (0..n as u64)
            .map(|i| {
                from_response(body, i, &Hints::default(), DEFAULT_MAX_BYTES)
                    .unwrap()
                    .unwrap()
            })
            .collect();
        let refs: Vec<&Payload> = whole.iter().collect();
        let parts: Vec<Vec<&Payload>> = group
            .choices
            .iter()
            .map(|c| match (&group.shared, c.shares) {
                (Some(s), true) => vec![s, &c.own],
                _ => vec![&c.own],
            })
            .collect();
        let parts: Vec<&[&Payload]> = parts.iter().map(Vec::as_slice).collect();
        let o = PackOptions::default();
        let (a, b) = (
            layout(&refs, &o, DType::I32, 1 << 20).unwrap(),
            layout_parts(&parts, &o, DType::I32, 1 << 20).unwrap(),
        );
        assert_eq!(a, b);
        let (mut x, mut y) = (vec![0i32; a.rows * 2], vec![0i32; a.rows * 2]);
        pack_into(&refs, &a, &mut x, None).unwrap();
        pack_parts_into(&parts, &b, &mut y, None).unwrap();
        assert_eq!(x, y);
    }

    #[test]
    fn a_group_holds_its_prompt_once_in_either_answer() {
        let (prompt, n) = (12u64, 4u64);
        let values: Vec<Payload> = (0..n).map(|c| rows(0, prompt + 3, prompt, c)).collect();
        for format in [Format::VllmNpy, Format::Compact] {
            let engine = body(&values, format, Some(prompt));
            let g = group_from_response(&engine, &Hints::default(), DEFAULT_MAX_BYTES).unwrap();
            let shared = g.shared.as_ref().expect("the prompt's rows, once");
            assert_eq!((shared.start(), shared.stop()), (0, prompt));
            assert!(g
                .choices
                .iter()
                .all(|c| c.shares && c.own.start() == prompt));
            packs_as_whole(&engine, &g);
        }
        // The shared-prompt answer of the same group.
        let answer = shared_answer(rows, prompt, n);
        let g = group_from_response(&answer, &Hints::default(), DEFAULT_MAX_BYTES).unwrap();
        assert_eq!(g.shared.as_ref().map(Payload::stop), Some(prompt));
        assert_eq!(g.choices.len(), n as usize);
        packs_as_whole(&answer, &g);
    }

    #[test]
    fn the_first_choice_lends_its_buffer_and_the_others_keep_only_their_own_rows() {
        // 2 bytes a row: a 12-row prompt ends on a whole 8-byte word (views), 13 does not.
        for prompt in [12u64, 13] {
            let values: Vec<Payload> = (0..3).map(|c| rows(0, prompt + 3, prompt, c)).collect();
            let b = body(&values, Format::Compact, Some(prompt));
            let g = group_from_response(&b, &Hints::default(), DEFAULT_MAX_BYTES).unwrap();
            let shared = g.shared.clone().unwrap();
            let first = &g.choices[0].own;
            let viewed = prompt == 12;
            assert_eq!(shared.clone().into_data().is_shared(), viewed);
            assert_eq!(first.clone().into_data().is_shared(), viewed);
            if viewed {
                let end = shared.bytes().as_ptr().wrapping_add(shared.bytes().len());
                assert_eq!(first.bytes().as_ptr(), end, "one buffer, no copy");
            }
            for c in &g.choices[1..] {
                assert!(
                    c.shares && !c.own.clone().into_data().is_shared(),
                    "own rows only"
                );
                assert_eq!(c.own.num_tokens(), 3);
            }
            packs_as_whole(&b, &g);
        }
    }

    #[test]
    fn rows_that_differ_or_an_unstated_prompt_are_held_whole() {
        let prompt = 8;
        let mut values: Vec<Payload> = (0..3).map(|c| rows(0, prompt + 2, prompt, c)).collect();
        values[2] = rows(0, prompt + 2, 3, 2); // another prompt's rows: not the group's
        let b = body(&values, Format::Compact, Some(prompt));
        let g = group_from_response(&b, &Hints::default(), DEFAULT_MAX_BYTES).unwrap();
        let shares: Vec<bool> = g.choices.iter().map(|c| c.shares).collect();
        assert_eq!(shares, [true, true, false]);
        assert_eq!(g.choices[2].own.num_tokens(), (prompt + 2) as usize);
        packs_as_whole(&b, &g);
        let b = body(&values, Format::Compact, None);
        let g = group_from_response(&b, &Hints::default(), DEFAULT_MAX_BYTES).unwrap();
        assert!(g.shared.is_none() && g.choices.iter().all(|c| !c.shares));
    }

    #[test]
    fn a_choice_without_routing_beside_others_is_rows_lost() {
        let v =
            String::from_utf8(encode_json(&rows(0, 4, 4, 0), Format::Compact).unwrap()).unwrap();
        let b = format!(r#"{{"choices":[{{"index":0,"routed_experts":{v}}},{{"index":1}}]}}"#);
        let e =
            group_from_response(b.as_bytes(), &Hints::default(), DEFAULT_MAX_BYTES).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::RowsLost), "{e}");
        assert!(e.to_string().contains("choice 1"), "{e}");
        let none = br#"{"choices":[{"index":0},{"index":1}]}"#;
        let g = group_from_response(none, &Hints::default(), DEFAULT_MAX_BYTES).unwrap();
        assert!(g.shared.is_none() && g.choices.is_empty());
    }
}
