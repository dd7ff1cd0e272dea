//! Packing samples into one batch for the trainer (format.md §6): one dtype, concatenated rows,
//! cumulative sequence lengths, optional padding to a multiple of N rows.

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::merge::check_same_rows;
use crate::payload::{Payload, Shape};

/// Rows of the packed batch and the cumulative sequence lengths `[0, n0, n0+n1, ...]`.
/// Padding rows (zeros, to reach a multiple of `pad_to_multiple`) come after the last sample
/// and are not counted in `cu_seqlens`. The packed shape (in `dtype`) is held to `max_bytes`
/// before anything is allocated.
pub fn layout(
    samples: &[&Payload],
    pad_to_multiple: Option<usize>,
    dtype: DType,
    max_bytes: usize,
) -> Result<(usize, Vec<usize>)> {
    let Some(first) = samples.first() else {
        return Err(Error::field(
            "samples",
            "at least one sample",
            "an empty list",
        ));
    };
    let mut cu = Vec::with_capacity(samples.len() + 1);
    let mut rows = 0usize;
    cu.push(rows);
    for (i, s) in samples.iter().enumerate() {
        check_same_rows(first.shape(), s.shape(), "sample 0", &format!("sample {i}"))?;
        rows = rows
            .checked_add(s.num_tokens())
            .ok_or_else(|| Error::payload("pack: more than 2**64 rows in all"))?;
        cu.push(rows);
    }
    let total = match pad_to_multiple {
        None => rows,
        Some(0) => return Err(Error::field("pad_to_multiple", "a positive integer", 0)),
        Some(n) => rows.div_ceil(n).checked_mul(n).ok_or_else(|| {
            Error::payload(format!(
                "pack: {rows} rows padded to a multiple of {n} overflow"
            ))
        })?,
    };
    let shape = Shape {
        tokens: total,
        ..first.shape()
    };
    crate::limits::check_shape(shape, dtype, max_bytes).map_err(|e| match pad_to_multiple {
        Some(n) => e.context(format!("pack of {rows} rows with pad_to_multiple={n}")),
        None => e.context(format!("pack of {rows} rows")),
    })?;
    Ok((total, cu))
}

/// Write every sample's values, converted to `D`, one after the other into `dst` (whose tail past
/// the samples is left as it is: zeros in a fresh array).
pub fn pack_into<D: Element>(samples: &[&Payload], dst: &mut [D]) -> Result<()> {
    let mut rest = dst;
    for (i, s) in samples.iter().enumerate() {
        let n = s.num_tokens() * s.num_layers() * s.top_k();
        let (head, tail) = rest.split_at_mut(n);
        s.write_as::<D>(head)
            .map_err(|e| e.context(format!("sample {i}")))?;
        rest = tail;
    }
    Ok(())
}
