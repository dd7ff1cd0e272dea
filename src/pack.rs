//! Packing samples into one batch for the trainer (SPEC 6): one dtype, concatenated rows,
//! cumulative sequence lengths, optional padding to a multiple of N rows.

use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::merge::check_same_rows;
use crate::payload::Payload;

/// Rows of the packed batch and the cumulative sequence lengths `[0, n0, n0+n1, ...]`.
/// Padding rows (zeros, to reach a multiple of `pad_to_multiple`) come after the last sample
/// and are not counted in `cu_seqlens`.
pub fn layout(samples: &[&Payload], pad_to_multiple: Option<usize>) -> Result<(usize, Vec<usize>)> {
    let mut cu = Vec::with_capacity(samples.len() + 1);
    cu.push(0usize);
    for (i, s) in samples.iter().enumerate() {
        check_same_rows(
            samples[0].shape(),
            s.shape(),
            "sample 0",
            &format!("sample {i}"),
        )?;
        cu.push(cu[cu.len() - 1] + s.num_tokens());
    }
    let rows = cu[cu.len() - 1];
    let total = match pad_to_multiple {
        None => rows,
        Some(0) => return Err(Error::field("pad_to_multiple", "a positive integer", 0)),
        Some(n) => rows.div_ceil(n) * n,
    };
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
