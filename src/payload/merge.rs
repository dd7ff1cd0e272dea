//! Prefill/decode merge by absolute position (format.md §4), and the row concatenation it shares with
//! multi-turn stitching.

use crate::error::{Error, ErrorKind, Result};
use crate::payload::dtype::with_element;
use crate::payload::dtype::DType;
use crate::payload::{Header, Payload, Shape};

/// How two halves combine: all of prefill's rows, then decode's rows from `skip` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Rows of decode that prefill already covers (skipped).
    pub skip: usize,
    /// The merged payload's header.
    pub header: Header,
}

/// Check that the halves fit together and say how. Only headers are needed, so a router can
/// validate before decoding anything.
pub fn plan(prefill: &Header, decode: &Header) -> Result<Plan> {
    check_same_rows(prefill.shape, decode.shape, "prefill", "decode")?;
    if decode.start > prefill.stop() {
        let kind = ErrorKind::Gap {
            stop: prefill.stop(),
            start: decode.start,
        };
        return Err(Error::new(kind, format!(
            "gap: prefill covers positions [{}, {}) but decode starts at {}, so rows [{}, {}) are missing",
            prefill.start,
            prefill.stop(),
            decode.start,
            prefill.stop(),
            decode.start
        )));
    }
    if decode.stop() < prefill.stop() {
        return Err(Error::inconsistent(format!(
            "inconsistent halves: decode covers positions [{}, {}), ending before prefill's end at {}",
            decode.start,
            decode.stop(),
            prefill.stop()
        )));
    }
    // The rows decode holds for positions prefill already covers; `decode.start` counts, not
    // `prefill.seq_len` (skipping the latter is the bug this library exists to avoid).
    let skip = (prefill.stop() - decode.start) as usize;
    let tokens = prefill
        .shape
        .tokens
        .checked_add(decode.shape.tokens - skip)
        .ok_or_else(|| Error::inconsistent("the merged payload has more than 2**64 rows"))?;
    let shape = Shape {
        tokens,
        ..prefill.shape
    };
    let dtype = DType::promote(prefill.dtype, decode.dtype);
    Ok(Plan {
        skip,
        header: Header::new(prefill.start, shape, dtype)?,
    })
}

/// `num_layers` and `top_k` must agree for rows of two payloads to be joined.
pub(crate) fn check_same_rows(a: Shape, b: Shape, a_name: &str, b_name: &str) -> Result<()> {
    if (a.layers, a.top_k) != (b.layers, b.top_k) {
        let kind = ErrorKind::Shape {
            first: (a.layers, a.top_k),
            second: (b.layers, b.top_k),
        };
        return Err(Error::new(kind, format!(
            "{a_name} has {} layers x top_k {} but {b_name} has {} layers x top_k {}: they must match",
            a.layers, a.top_k, b.layers, b.top_k
        )));
    }
    Ok(())
}

/// The merged payload: prefill's rows, then decode's rows from `skip` on, in the promoted dtype.
pub fn merge(prefill: &Payload, decode: &Payload) -> Result<Payload> {
    let plan = plan(&prefill.header(), &decode.header())?;
    concat(
        plan.header.start,
        &[
            (prefill, 0, prefill.num_tokens()),
            (decode, plan.skip, decode.num_tokens()),
        ],
    )
}

/// Rows `[from, to)` of each piece, one after the other, starting at position `start`, in the
/// dtype that holds every piece (never truncated). Pieces must agree on layers and top_k.
pub fn concat(start: u64, pieces: &[(&Payload, usize, usize)]) -> Result<Payload> {
    let Some(&(first, _, _)) = pieces.first() else {
        return Err(Error::inconsistent("nothing to concatenate"));
    };
    let dtype = pieces
        .iter()
        .fold(first.dtype(), |d, (p, _, _)| DType::promote(d, p.dtype()));
    let tokens = pieces
        .iter()
        .try_fold(0usize, |n, (_, from, to)| n.checked_add(to - from))
        .ok_or_else(|| Error::inconsistent("the concatenation has more than 2**64 rows"))?;
    let mut out = Payload::zeros(
        start,
        Shape {
            tokens,
            ..first.shape()
        },
        dtype,
    )?;
    let row = first.num_layers() * first.top_k();
    with_element!(dtype, D => {
        let mut dst = out.values_mut::<D>();
        for &(p, from, to) in pieces {
            check_same_rows(first.shape(), p.shape(), "the first payload", "a later payload")?;
            let (head, rest) = dst.split_at_mut((to - from) * row);
            p.write_rows_as::<D>(from, to, head)?;
            dst = rest;
        }
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::DTypeChoice;

    fn rows(start: u64, values: &[i64]) -> Payload {
        let shape = Shape::new(values.len(), 1, 1);
        Payload::from_values(values, shape, start, DTypeChoice::Compact).unwrap()
    }

    #[test]
    fn spec_forms_of_decode_all_merge_to_the_truth() {
        // prompt of 3 tokens (positions 0..3), 2 generated -> rows for 0..4.
        let prefill = rows(0, &[10, 20, 30]);
        let truth = rows(0, &[10, 20, 30, 40]);
        for decode in [rows(0, &[0, 0, 0, 40]), rows(2, &[30, 40]), rows(3, &[40])] {
            assert_eq!(merge(&prefill, &decode).unwrap(), truth);
        }
    }

    #[test]
    fn concat_of_nothing_is_an_error_and_of_pieces_their_rows_in_order() {
        // Reachable only from Rust (every caller in the crate passes pieces): named, not a panic.
        let none = concat(0, &[]).unwrap_err();
        assert_eq!(none.to_string(), "nothing to concatenate");
        let (a, b) = (rows(0, &[1, 2, 3]), rows(7, &[300, 4]));
        let joined = concat(5, &[(&a, 1, 3), (&b, 0, 1)]).unwrap();
        assert_eq!(joined, rows(5, &[2, 3, 300]));
    }

    #[test]
    fn errors_give_positions() {
        let prefill = rows(0, &[1, 2, 3]);
        let gap = merge(&prefill, &rows(4, &[5])).unwrap_err();
        assert!(gap.to_string().contains("rows [3, 4) are missing"), "{gap}");
        assert_eq!(gap.kind(), &ErrorKind::Gap { stop: 3, start: 4 });
        let short = merge(&prefill, &rows(0, &[0, 0])).unwrap_err();
        assert!(
            short
                .to_string()
                .contains("ending before prefill's end at 3"),
            "{short}"
        );
        let wide = Payload::zeros(3, Shape::new(1, 2, 1), DType::U8).unwrap();
        let e = merge(&prefill, &wide).unwrap_err();
        let want = ErrorKind::Shape {
            first: (1, 1),
            second: (2, 1),
        };
        assert_eq!(e.kind(), &want);
        assert_eq!(short.kind(), &ErrorKind::Inconsistent);
    }

    #[test]
    fn dtypes_promote() {
        let merged = merge(&rows(0, &[1, 2]), &rows(2, &[300])).unwrap();
        assert_eq!(merged.dtype(), DType::U16);
        assert_eq!(merged.values::<u16>(), &[1, 2, 300]);
    }
}
