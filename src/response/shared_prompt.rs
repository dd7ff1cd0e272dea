//! The shared-prompt answer (format.md §4.1): a group's prompt rows written once, at the
//! top-level `prompt_routed_experts`, and each choice's value holding only the rows after them.
//! A group of `n` choices of one prompt then carries the prompt's routing once instead of `n`
//! times (at 32k prompt tokens on 94 layers, 33 MB once instead of 527 MB at `n = 16`).

use std::borrow::Cow;

use super::options::{side_hints, MergeOptions};
use super::read::decode_found;
use super::spliced::{checked_copy, Piece, Spliced};

use crate::body::{BodyRouting, Found};
use crate::error::{Error, Half, Result};
use crate::formats::sidecar;
use crate::payload::{merge, Header};

/// The key the prompt's rows are written under (vLLM 0.21's, whose split bodies are the
/// precedent: the prompt's rows once, every choice's own beside them).
const PROMPT_KEY: &[u8] = b"\"prompt_routed_experts\":";

/// The decode body with the prompt's rows (prefill's) inserted once at its top and each choice's
/// routing value replaced by a compact sidecar of its rows after the prompt's.
pub(super) fn answer<'a>(
    prefill: &[Found<'a>],
    decode_body: &'a [u8],
    decode: BodyRouting<'a>,
    opts: &MergeOptions,
) -> Result<Spliced<'a>> {
    let prompt = the_prompt(prefill)?;
    let open = decode_body
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .filter(|&i| decode_body[i] == b'{')
        .ok_or_else(|| {
            Error::inconsistent(
                "a shared-prompt answer is written into a body that is one JSON object; this \
                 decode body is a list of results",
            )
        })?;
    if decode.prompt_key {
        return Err(Error::inconsistent(
            "the decode body already has a top-level prompt_routed_experts key: the shared \
             prompt's rows cannot be written beside it",
        ));
    }
    let (header, prompt_pieces) = prompt_rows(prompt, opts).map_err(|e| e.context("prefill"))?;
    let mut pieces = Vec::with_capacity(prompt_pieces.len() + 3 * decode.values.len() + 4);
    pieces.push(Piece::Copy(Cow::Borrowed(&decode_body[..=open])));
    pieces.push(Piece::Copy(Cow::Borrowed(PROMPT_KEY)));
    pieces.extend(prompt_pieces);
    // The body has at least one member (the choices that carry routing).
    pieces.push(Piece::Copy(Cow::Borrowed(b",")));
    let mut at = open + 1;
    for d in &decode.values {
        let own =
            own_rows(&header, d, opts).map_err(|e| e.context(format!("choice {}", d.index)))?;
        pieces.push(Piece::Copy(Cow::Borrowed(&decode_body[at..d.span.start])));
        pieces.extend(own);
        at = d.span.end;
    }
    pieces.push(Piece::Copy(Cow::Borrowed(&decode_body[at..])));
    Ok(Spliced {
        pieces,
        merged: decode.values.len(),
        decode: decode.values,
    })
}

/// Prefill's routing of the prompt: its one choice's (a router asks prefill for one choice), or
/// the one value every choice of it holds.
fn the_prompt<'f, 'a>(prefill: &'f [Found<'a>]) -> Result<&'f Found<'a>> {
    let first = prefill.first().ok_or_else(|| {
        Error::missing_routing(
            Half::Prefill,
            "missing routing on the prefill side: the decode body carries routed_experts but the \
             prefill body has none (passing decode's prompt rows on would corrupt training)",
        )
    })?;
    match prefill.iter().find(|f| f.text != first.text) {
        Some(other) => Err(Error::inconsistent(format!(
            "a shared prompt needs one prefill routing value, but the prefill body holds \
             different values at {} and {}",
            first.path, other.path
        ))),
        None => Ok(first),
    }
}

/// The header of the prompt's rows and the pieces of their compact sidecar: a compact
/// sidecar's text copied (checked as it is copied), vLLM's `.npy` text re-encoded on the
/// sidecar's grid a block at a time (or as it is sent, with `defer_recode`), anything else
/// decoded and encoded.
fn prompt_rows<'a>(p: &Found<'a>, opts: &MergeOptions) -> Result<(Header, Vec<Piece<'a>>)> {
    if p.fields.is_some() {
        let fields = p.fields.clone().unwrap_or_default();
        let side = sidecar::validate(fields, opts.max_bytes)?;
        let data = checked_copy(&side.data, 0, side.data.len(), "prefill", side.data_base64)?;
        return Ok((side.header, sidecar::wrap_base64(&side.header, vec![data])));
    }
    if opts.splice {
        if let Some(done) = super::npy_text::rows_as_compact(p, opts) {
            return Ok(done);
        }
    }
    let (_, payload) = decode_found(p, &side_hints(p, opts.hints.start, opts), opts.max_bytes)?;
    let text = sidecar::encode(&payload);
    Ok((payload.header(), vec![Piece::Copy(Cow::Owned(text))]))
}

/// A decode value's rows after the prompt's, as the pieces of a compact sidecar, once it is
/// checked to join the prompt's rows as a merge would (format.md §4: no gap, no earlier end,
/// one row shape); the rows both hold are the prompt's. vLLM's `.npy` text goes through on its
/// text (as the prompt's does); anything else is decoded and encoded.
fn own_rows<'a>(prompt: &Header, d: &Found<'a>, opts: &MergeOptions) -> Result<Vec<Piece<'a>>> {
    if opts.splice {
        if let Some(pieces) = super::npy_text::own_rows_as_compact(d, prompt, opts) {
            return Ok(pieces);
        }
    }
    let start = opts.decode_start.or(opts.hints.start);
    let (_, rows) = decode_found(d, &side_hints(d, start, opts), opts.max_bytes)
        .map_err(|e| e.context("decode"))?;
    merge::plan(prompt, &rows.header())?;
    let own = rows.slice(prompt.stop(), rows.stop())?;
    Ok(vec![Piece::Copy(Cow::Owned(sidecar::encode(&own)))])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::read_body;
    use crate::error::ErrorKind;
    use crate::formats::{encode_json, Format, Hints};
    use crate::limits::DEFAULT_MAX_BYTES;
    use crate::payload::{DTypeChoice, Payload, Shape};
    use crate::response::{from_response, merge_response, merge_response_pieces, Part};
    use crate::test_rng::xorshift;

    const LAYERS: usize = 3;
    const TOP_K: usize = 2;

    /// Rows `[start, stop)` of a sequence whose row `t` is the same in every choice up to
    /// `prompt` and differs by choice after it.
    fn rows(start: u64, stop: u64, prompt: u64, choice: u64, experts: i64) -> Payload {
        let mut values = Vec::new();
        for t in start..stop {
            for l in 0..LAYERS as u64 {
                let salt = if t >= prompt { 31 * (choice + 1) } else { 0 };
                let first = ((t * 7 + l * 3 + salt) % experts as u64) as i64;
                values.extend([first, (first + 1) % experts]);
            }
        }
        let shape = Shape::new((stop - start) as usize, LAYERS, TOP_K);
        Payload::from_values(&values, shape, start, DTypeChoice::Compact).unwrap()
    }

    fn value(p: &Payload, format: Format) -> String {
        String::from_utf8(encode_json(p, format).unwrap()).unwrap()
    }

    /// A body of one value per choice, as vLLM writes it (`usage` counting every choice).
    fn body(values: &[String], prompt: u64, generated: u64) -> String {
        let choices: Vec<String> = values
            .iter()
            .enumerate()
            .map(|(i, v)| format!(r#"{{"index":{i},"text":"t","routed_experts":{v}}}"#))
            .collect();
        let total = generated * values.len() as u64;
        format!(
            r#"{{"id":"c","choices":[{}],"usage":{{"prompt_tokens":{prompt},"completion_tokens":{total}}}}}"#,
            choices.join(",")
        )
    }

    fn opts(decode_start: u64) -> MergeOptions {
        MergeOptions {
            decode_start: Some(decode_start),
            shared_prompt: true,
            ..MergeOptions::new(DEFAULT_MAX_BYTES)
        }
    }

    /// The answer as a server sends it: recoded parts written as they go.
    fn sent(prefill: &[u8], decode: &[u8], opts: MergeOptions) -> Vec<u8> {
        let mut spliced = merge_response_pieces(prefill, decode, opts).unwrap();
        let mut out = Vec::new();
        for part in spliced.take_checked_recoded_parts().unwrap() {
            match part {
                Part::Bytes(b) => out.extend_from_slice(&b),
                Part::Recoded(r) => r.write_part(0, r.bytes().len(), &mut out).unwrap(),
            }
        }
        out
    }

    #[test]
    fn a_group_carries_its_prompt_once_and_every_choice_reads_whole() {
        let mut next = xorshift(0x5eed);
        for _ in 0..40 {
            let prompt = 1 + next() % 90;
            let generated = 1 + next() % 6;
            let n = 1 + next() % 5;
            let experts = if next() % 2 == 0 { 128 } else { 384 };
            let start = next() % prompt; // the client's start
            let format = |k: u64| match k % 2 {
                0 => Format::VllmNpy,
                _ => Format::Compact,
            };
            let (pf, df) = (format(next()), format(next()));
            let prefill = body(
                &[value(&rows(start, prompt, prompt, 0, experts), pf)],
                prompt,
                1,
            );
            let asked = prompt - 1;
            let decode_values: Vec<String> = (0..n)
                .map(|c| value(&rows(asked, prompt + generated - 1, prompt, c, experts), df))
                .collect();
            let decode = body(&decode_values, prompt, generated);
            let o = MergeOptions {
                hints: Hints {
                    start: Some(start),
                    ..Hints::default()
                },
                defer_recode: next() % 2 == 0,
                splice: next() % 4 != 0,
                ..opts(asked)
            };
            let (p, d) = (prefill.as_bytes(), decode.as_bytes());
            let shared = merge_response(p, d, o).unwrap();
            assert_eq!(sent(p, d, o), shared, "defer_recode writes the same bytes");
            let decoded = MergeOptions { splice: false, ..o };
            assert_eq!(
                merge_response(p, d, decoded).unwrap(),
                shared,
                "the text's path and decoding's agree"
            );
            // Each choice reads as the per-choice answer's does, with the prompt once.
            let per_choice = merge_response(
                p,
                d,
                MergeOptions {
                    shared_prompt: false,
                    ..o
                },
            )
            .unwrap();
            for c in 0..n {
                let want = from_response(&per_choice, c, &Hints::default(), DEFAULT_MAX_BYTES)
                    .unwrap()
                    .unwrap();
                let got = from_response(&shared, c, &Hints::default(), DEFAULT_MAX_BYTES)
                    .unwrap()
                    .unwrap();
                assert!(
                    got.same_routing(&want) && got.start() == start,
                    "choice {c}"
                );
            }
            let found = read_body(&shared).unwrap();
            let top = found.prompt.as_ref().expect("the prompt's rows at the top");
            assert_eq!(top.path, "$.prompt_routed_experts");
            for f in &found.values {
                let own =
                    crate::formats::sidecar::validate(f.fields.clone().unwrap(), DEFAULT_MAX_BYTES)
                        .unwrap();
                assert_eq!(
                    own.header.start, prompt,
                    "a choice's own rows start after the prompt"
                );
                assert_eq!(own.header.shape.tokens as u64, generated - 1);
            }
            if n > 1 && prompt - start > 24 {
                assert!(
                    shared.len() < per_choice.len(),
                    "the prompt is written once"
                );
            }
        }
    }

    #[test]
    fn bad_text_in_rows_the_answer_drops_is_refused_as_decoding_refuses_it() {
        // Decode's first row (the prompt's last, which the answer takes from prefill) has a
        // character that is not base64: refused whichever path writes the choice's own rows.
        let (prompt, generated) = (20u64, 6u64);
        let prefill = body(
            &[value(&rows(0, prompt, prompt, 0, 128), Format::VllmNpy)],
            prompt,
            1,
        );
        let mut own = value(
            &rows(prompt - 1, prompt + generated - 1, prompt, 1, 128),
            Format::VllmNpy,
        );
        own.replace_range(174..175, "!"); // row P - 1 (bytes 128-133; the header is 172 chars)
        let decode = body(&[own], prompt, generated);
        for splice in [true, false] {
            let o = MergeOptions {
                splice,
                ..opts(prompt - 1)
            };
            let got = merge_response(prefill.as_bytes(), decode.as_bytes(), o);
            assert!(got.is_err(), "splice {splice}: {got:?}");
        }
    }

    #[test]
    fn what_does_not_join_is_refused_by_name() {
        let compact = |p: &Payload| value(p, Format::Compact);
        let prefill = body(&[compact(&rows(0, 10, 10, 0, 64))], 10, 1);
        let p = prefill.as_bytes();
        // Decode starting past the prompt's rows: a gap.
        let gap = body(&[compact(&rows(11, 14, 10, 0, 64))], 10, 5);
        let e = merge_response(p, gap.as_bytes(), opts(9)).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                ErrorKind::Gap {
                    stop: 10,
                    start: 11
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("choice 0"), "{e}");
        // Decode routing with none from prefill.
        let decode = body(&[compact(&rows(9, 14, 10, 0, 64))], 10, 5);
        let plain = r#"{"choices":[{"index":0,"text":"x"}]}"#;
        let e = merge_response(plain.as_bytes(), decode.as_bytes(), opts(9)).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::MissingRouting(_)), "{e}");
        // Prefill answering two choices whose routing differs: which is the prompt's?
        let two = body(
            &[
                compact(&rows(0, 10, 10, 0, 64)),
                compact(&rows(0, 10, 5, 1, 64)),
            ],
            10,
            1,
        );
        let e = merge_response(two.as_bytes(), decode.as_bytes(), opts(9)).unwrap_err();
        assert!(e.to_string().contains("different values"), "{e}");
        // The same value twice serves as one.
        let same = body(
            &[
                compact(&rows(0, 10, 10, 0, 64)),
                compact(&rows(0, 10, 10, 0, 64)),
            ],
            10,
            1,
        );
        assert!(merge_response(same.as_bytes(), decode.as_bytes(), opts(9)).is_ok());
        // A list of results has no top to write the prompt at.
        let list = format!("[{decode}]");
        let e = merge_response(p, list.as_bytes(), opts(9)).unwrap_err();
        assert!(e.to_string().contains("one JSON object"), "{e}");
        // A shared answer is not a half to merge again.
        let shared = merge_response(p, decode.as_bytes(), opts(9)).unwrap();
        for (a, b) in [(&shared[..], decode.as_bytes()), (p, &shared[..])] {
            let e = merge_response(a, b, opts(9)).unwrap_err();
            assert!(e.to_string().contains("shared-prompt answer"), "{e}");
        }
    }

    #[test]
    fn a_shared_answer_read_back_is_held_to_its_own_positions() {
        let prompt = value(&rows(0, 10, 10, 0, 64), Format::Compact);
        let read = |own: &str| {
            let b = format!(
                r#"{{"prompt_routed_experts":{prompt},"choices":[{{"index":0,"routed_experts":{own}}},{{"index":1}}]}}"#
            );
            from_response(b.as_bytes(), 0, &Hints::default(), DEFAULT_MAX_BYTES)
                .and_then(|_| from_response(b.as_bytes(), 1, &Hints::default(), DEFAULT_MAX_BYTES))
        };
        let after = value(&rows(12, 14, 10, 0, 64), Format::Compact);
        let e = read(&after).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                ErrorKind::Gap {
                    stop: 10,
                    start: 12
                }
            ),
            "{e}"
        );
        let inside = value(&rows(9, 14, 10, 0, 64), Format::Compact);
        let e = read(&inside).unwrap_err();
        assert!(e.to_string().contains("follow the prompt's exactly"), "{e}");
        // Choice 1 has no rows of its own: lost, not read as the prompt alone.
        let e = read(&value(&rows(10, 14, 10, 0, 64), Format::Compact)).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::RowsLost), "{e}");
        // Beside a compact prompt, a value of another format cannot be placed.
        let npy = value(&rows(10, 14, 10, 0, 64), Format::VllmNpy);
        let e = read(&npy).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Unplaced), "{e}");
        // Other layers or top_k are refused.
        let other = Payload::zeros(
            10,
            Shape::new(2, LAYERS + 1, TOP_K),
            crate::payload::dtype::DType::U8,
        )
        .unwrap();
        let e = read(&value(&other, Format::Compact)).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Shape { .. }), "{e}");
    }
}
