//! Where decode's rows start when the caller does not say (format.md §4): vLLM never echoes the
//! start a router asked for, but its `.npy` rows end before the last sampled token, at
//! `P + G - 1`, so a body that counts the choice's prompt (`P`) and generated (`G`) tokens fixes
//! it: `start = P + G - 1 - rows`. It is taken only when it is a start a router asks decode
//! for (0, `P - 1` or `P`); any other is refused naming `decode_start`, never guessed.

use super::options::MergeOptions;
use super::suspects::checked_npy_header;

use crate::body::Found;
use crate::error::{Error, ErrorKind, Result};
use crate::formats::Hints;

/// The start of `decode`'s rows by the rule above, when no start was given and a value of vLLM's
/// `.npy` text in a body that counts its tokens fixes one; `None` where nothing fixes it (the
/// merge then reads the values as it always has, and the coverage check names what is wrong).
pub(crate) fn derive(decode: &[Found], opts: &MergeOptions) -> Result<Option<u64>> {
    if opts.decode_start.is_some() || opts.hints.start.is_some() {
        return Ok(None);
    }
    let hints = Hints {
        start: None,
        ..opts.hints
    };
    let mut derived: Option<(u64, u64)> = None; // (start, the choice it came from)
    for f in decode {
        let (Some((prompt, prompt_at)), Some((generated, generated_at))) =
            (f.counts.prompt, f.counts.generated)
        else {
            continue;
        };
        let Some((_, header, _)) = checked_npy_header(f, &hints, opts.max_bytes) else {
            continue;
        };
        let rows = header.shape.tokens as u64;
        let end = prompt.saturating_add(generated).saturating_sub(1);
        // More rows than positions: the coverage check says so with the body's counts.
        let Some(start) = end.checked_sub(rows) else {
            continue;
        };
        let asked = [0, prompt.saturating_sub(1), prompt];
        if !asked.contains(&start) {
            return Err(Error::new(
                ErrorKind::Counts { rows, start },
                format!(
                    "cannot place decode's rows: choice {} holds {rows} rows, and the body counts \
                     {prompt} prompt tokens ({prompt_at}) and {generated} generated \
                     ({generated_at}), so they start at {start}, which is none of the starts a \
                     router asks decode for (0, {}, {prompt}); pass decode_start \
                     (--decode-start) if that is what the request asked",
                    f.index,
                    prompt.saturating_sub(1)
                ),
            ));
        }
        match derived {
            Some((other, at)) if other != start => {
                return Err(Error::new(
                    ErrorKind::Counts { rows, start },
                    format!(
                        "cannot place decode's rows: by the body's token counts choice {at}'s \
                         start at {other} and choice {}'s at {start}, but one request asks one \
                         start; pass decode_start (--decode-start)",
                        f.index
                    ),
                ))
            }
            _ => derived = Some((start, f.index)),
        }
    }
    Ok(derived.map(|(start, _)| start))
}

#[cfg(test)]
mod tests {
    use crate::error::ErrorKind;
    use crate::formats::npy;
    use crate::kernels::b64;
    use crate::limits::DEFAULT_MAX_BYTES;
    use crate::payload::{DTypeChoice, Payload, Shape};
    use crate::response::{merge_response, MergeOptions};

    /// One choice's body as vLLM sends it: rows `[from, to)` of `truth` as `.npy` text, and
    /// the usage counts when given.
    fn body(truth: &Payload, from: usize, to: usize, counts: Option<(usize, usize)>) -> Vec<u8> {
        let row = truth.header().row_bytes();
        let shape = Shape {
            tokens: to - from,
            ..truth.shape()
        };
        let mut file = npy::write_header(truth.dtype(), shape);
        file.extend_from_slice(&truth.bytes()[from * row..to * row]);
        let text = String::from_utf8(b64::encode(&file)).unwrap();
        let usage = counts.map_or(String::new(), |(p, g)| {
            format!(r#","usage":{{"prompt_tokens":{p},"completion_tokens":{g}}}"#)
        });
        format!(r#"{{"choices":[{{"index":0,"text":"x","routed_experts":"{text}"}}]{usage}}}"#)
            .into_bytes()
    }

    fn truth(rows: usize) -> Payload {
        let values: Vec<i64> = (0..rows as i64 * 4).map(|v| (v * 5) % 31).collect();
        Payload::from_values(&values, Shape::new(rows, 2, 2), 0, DTypeChoice::Compact).unwrap()
    }

    #[test]
    fn a_start_the_router_asks_is_derived_from_the_decode_bodys_counts() {
        let (p, g) = (9usize, 4usize);
        let t = truth(p + g - 1);
        let prefill = body(&t, 0, p, Some((p, 1)));
        for start in [0, p - 1, p] {
            let decode = body(&t, start, p + g - 1, Some((p, g)));
            let given = MergeOptions {
                decode_start: Some(start as u64),
                ..MergeOptions::new(DEFAULT_MAX_BYTES)
            };
            let want = merge_response(&prefill, &decode, given).unwrap();
            let got = merge_response(&prefill, &decode, MergeOptions::new(DEFAULT_MAX_BYTES));
            assert_eq!(got.unwrap(), want, "start {start}");
        }
    }

    #[test]
    fn a_start_no_router_asks_is_refused_naming_decode_start() {
        let (p, g) = (9usize, 4usize);
        let t = truth(p + g - 1);
        let prefill = body(&t, 0, p, Some((p, 1)));
        let decode = body(&t, 3, p + g - 1, Some((p, g)));
        let e = merge_response(&prefill, &decode, MergeOptions::new(DEFAULT_MAX_BYTES));
        let e = e.unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::Counts { rows: 9, start: 3 }),
            "{e}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains(
                "start at 3, which is none of the starts a router asks decode for (0, 8, 9)"
            ),
            "{msg}"
        );
        assert!(msg.contains("pass decode_start"), "{msg}");
        // A start given is taken as given: derivation never overrides the caller.
        let given = MergeOptions {
            decode_start: Some(3),
            ..MergeOptions::new(DEFAULT_MAX_BYTES)
        };
        assert!(merge_response(&prefill, &decode, given).is_ok());
    }

    #[test]
    fn without_counts_nothing_is_derived() {
        let t = truth(12);
        let prefill = body(&t, 0, 9, None);
        let decode = body(&t, 8, 12, None);
        let opts = MergeOptions::new(DEFAULT_MAX_BYTES);
        let read = crate::body::read_body(&decode).unwrap();
        assert_eq!(super::derive(&read.values, &opts).unwrap(), None);
        // Read from 0, decode's 4 rows lie inside prefill's 9: refused, never placed at 0.
        assert!(merge_response(&prefill, &decode, opts).is_err());
    }
}
