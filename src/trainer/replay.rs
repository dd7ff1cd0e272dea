//! A router's replay ids from a batch of routing rows (format.md §6.2): one layer's
//! `[tokens, top_k]` ids, read from the batch's `[tokens, layers, top_k]` rows, checked (in
//! `[0, num_experts)`, no id twice in a row) and written in the trainer's index dtype, with
//! rows that hold no routing given ids spread over the experts. One pass over the rows read.

use crate::error::{Error, Result};

/// The shape of a batch of routing rows: `tokens x layers x top_k`, row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    /// Token rows.
    pub tokens: usize,
    /// Layers per row.
    pub layers: usize,
    /// Experts per token.
    pub top_k: usize,
}

/// An id type a trainer indexes with (torch gathers with int64 or int32).
pub trait IndexId: Copy + Send {
    /// `v`, which is below `num_experts` (so it fits: `num_experts` was checked to).
    fn from_id(v: u64) -> Self;
    /// The largest id this type holds.
    const MAX: u64;
}

impl IndexId for i64 {
    fn from_id(v: u64) -> Self {
        v as i64 // below num_experts <= i64::MAX
    }
    const MAX: u64 = i64::MAX as u64;
}

impl IndexId for i32 {
    fn from_id(v: u64) -> Self {
        v as i32 // below num_experts <= i32::MAX
    }
    const MAX: u64 = i32::MAX as u64;
}

/// An integer id as it sits in a batch: negative means "no routing" (the `-1` of a row an
/// engine marks missing).
pub trait BatchId: Copy + Sync {
    /// The id, or `None` when it is negative.
    fn id(self) -> Option<u64>;
}

macro_rules! batch_id {
    (unsigned: $($t:ty),*) => {$(
        impl BatchId for $t {
            fn id(self) -> Option<u64> {
                Some(self as u64)
            }
        }
    )*};
    (signed: $($t:ty),*) => {$(
        impl BatchId for $t {
            fn id(self) -> Option<u64> {
                u64::try_from(self).ok()
            }
        }
    )*};
}
batch_id!(unsigned: u8, u16, u32, u64);
batch_id!(signed: i8, i16, i32, i64);

/// Each router's ids of every row of `batch`: router `i` reads layer `layers[i]` and writes
/// its `tokens x top_k` ids into `out[i]` (`out` holds the routers one after the other) and
/// whether each row was replayed into `replayed[i]` (`tokens` each). The batch is read once,
/// row by row (each router reading its own layer would read every row once per router). A row
/// is replayed when `valid` (if given) says so and none of its ids is negative; its ids must be
/// below `num_experts` and distinct, else a `Payload` error naming `places[i]`, the row and its
/// ids. A row not replayed takes experts `(r x top_k + j) % num_experts` for `j < top_k`
/// (distinct when `top_k <= num_experts`, spread over the experts: never the repeated expert 0
/// of zero padding).
#[allow(clippy::too_many_arguments)]
pub fn router_ids<T: BatchId, O: IndexId>(
    batch: &[T],
    rows: Rows,
    layers: &[usize],
    valid: Option<&[bool]>,
    num_experts: u64,
    places: &[String],
    out: &mut [O],
    replayed: &mut [bool],
) -> Result<()> {
    let Rows {
        tokens,
        layers: width,
        top_k,
    } = rows;
    let routers = layers.len();
    let cells = tokens
        .checked_mul(width)
        .and_then(|n| n.checked_mul(top_k))
        .ok_or_else(|| Error::payload("the batch's shape overflows"))?;
    let per_router = tokens * top_k; // at most `cells`, which fits
    if batch.len() != cells
        || Some(out.len()) != per_router.checked_mul(routers)
        || Some(replayed.len()) != tokens.checked_mul(routers)
        || places.len() != routers
    {
        return Err(Error::payload(format!(
            "a batch of {tokens} x {width} x {top_k} for {routers} routers needs {cells} ids, \
             {routers} x {per_router} out, {routers} x {tokens} flags and {routers} places; got \
             {}, {}, {} and {}",
            batch.len(),
            out.len(),
            replayed.len(),
            places.len()
        )));
    }
    if let Some(&layer) = layers.iter().find(|&&l| l >= width) {
        return Err(Error::field("layers", format!("each below {width}"), layer));
    }
    if valid.is_some_and(|v| v.len() != tokens) {
        return Err(Error::field(
            "mask",
            format!("{tokens} entries (one per row)"),
            valid.map_or(0, <[bool]>::len),
        ));
    }
    if num_experts == 0 || num_experts > O::MAX || top_k as u64 > num_experts {
        return Err(Error::field(
            "num_experts",
            format!("at least top_k ({top_k}) and at most {}", O::MAX),
            num_experts,
        ));
    }
    if tokens == 0 || top_k == 0 {
        return Ok(());
    }
    // Rows split among the cores (contiguous runs): each part writes its rows of every router.
    let threads = crate::kernels::parallel::threads_for(std::mem::size_of_val(batch)).min(tokens);
    let per_part = tokens.div_ceil(threads);
    let mut parts: Vec<Part<'_, O>> = (0..threads)
        .map(|t| Part {
            rows: (t * per_part).min(tokens)..((t + 1) * per_part).min(tokens),
            out: Vec::with_capacity(routers),
            replayed: Vec::with_capacity(routers),
        })
        .collect();
    for (mut o, mut f) in out
        .chunks_exact_mut(per_router)
        .zip(replayed.chunks_exact_mut(tokens))
    {
        for part in parts.iter_mut() {
            let n = part.rows.len();
            let (mine, rest) = std::mem::take(&mut o).split_at_mut(n * top_k);
            part.out.push(mine);
            o = rest;
            let (mine, rest) = std::mem::take(&mut f).split_at_mut(n);
            part.replayed.push(mine);
            f = rest;
        }
    }
    let check = Check {
        rows,
        layers,
        valid,
        num_experts,
        places,
    };
    // Parts come back in row order: the first error is the first bad row, as on one thread.
    crate::kernels::parallel::each(parts, |part| check.fill(batch, part))
        .into_iter()
        .collect()
}

/// One thread's rows, and its piece of every router's output.
struct Part<'o, O> {
    rows: std::ops::Range<usize>,
    out: Vec<&'o mut [O]>,
    replayed: Vec<&'o mut [bool]>,
}

/// What every part checks its rows against.
struct Check<'a> {
    rows: Rows,
    layers: &'a [usize],
    valid: Option<&'a [bool]>,
    num_experts: u64,
    places: &'a [String],
}

impl Check<'_> {
    fn fill<T: BatchId, O: IndexId>(&self, batch: &[T], mut part: Part<'_, O>) -> Result<()> {
        let Rows {
            layers: width,
            top_k,
            ..
        } = self.rows;
        let num_experts = self.num_experts;
        let mut ids = vec![0u64; top_k];
        for (k, r) in part.rows.clone().enumerate() {
            let row = &batch[r * width * top_k..][..width * top_k];
            let row_valid = self.valid.is_none_or(|v| v[r]);
            for (i, &layer) in self.layers.iter().enumerate() {
                let dst = &mut part.out[i][k * top_k..][..top_k];
                let mut routed = row_valid;
                for (slot, &v) in ids.iter_mut().zip(&row[layer * top_k..][..top_k]) {
                    match v.id() {
                        Some(id) => *slot = id,
                        None => routed = false,
                    }
                }
                part.replayed[i][k] = routed;
                if routed {
                    for (j, &id) in ids.iter().enumerate() {
                        if id >= num_experts {
                            let what =
                                format!("expert ids must be below num_experts {num_experts}");
                            return Err(row_error(&self.places[i], r, &ids, what));
                        }
                        // top_k is small (8 for the models that matter): pairs beat a set.
                        if ids[..j].contains(&id) {
                            let what = "a row's expert ids must be distinct (a top-k router \
                                        never picks one twice)";
                            return Err(row_error(&self.places[i], r, &ids, what.into()));
                        }
                    }
                    for (d, &id) in dst.iter_mut().zip(&ids) {
                        *d = O::from_id(id);
                    }
                } else {
                    // r * top_k + j passes u64 only for rows no batch has; wrapping keeps it
                    // total.
                    let base = (r as u64).wrapping_mul(top_k as u64);
                    for (j, d) in dst.iter_mut().enumerate() {
                        *d = O::from_id(base.wrapping_add(j as u64) % num_experts);
                    }
                }
            }
        }
        Ok(())
    }
}

fn row_error(place: &str, row: usize, ids: &[u64], what: String) -> Error {
    Error::payload(format!("{place}, row {row}: {what}, got {ids:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(place: &str) -> Vec<String> {
        vec![place.to_string()]
    }

    const ROWS: Rows = Rows {
        tokens: 3,
        layers: 2,
        top_k: 2,
    };

    #[test]
    fn a_layer_is_read_checked_and_missing_rows_are_spread() {
        // Layer 1 of 3 rows: a routed row, a row marked missing (-1), a row the mask drops.
        let batch: [i32; 12] = [0, 0, 5, 6, 0, 0, -1, -1, 0, 0, 7, 1];
        let mut out = [0i64; 6];
        let mut replayed = [false; 3];
        let valid = [true, true, false];
        let places = one("r");
        router_ids(
            &batch,
            ROWS,
            &[1],
            Some(&valid),
            8,
            &places,
            &mut out,
            &mut replayed,
        )
        .unwrap();
        assert_eq!(replayed, [true, false, false]);
        // Rows 1 and 2 take (r * 2 + j) % 8.
        assert_eq!(out, [5, 6, 2, 3, 4, 5]);
        // Two routers in one pass: each its own layer, one after the other in `out`.
        let routed: [i32; 12] = [1, 2, 5, 6, 3, 4, 0, 7, 6, 5, 7, 1];
        let mut both = [0i64; 12];
        let mut flags = [false; 6];
        let places = vec!["a".to_string(), "b".to_string()];
        router_ids(
            &routed,
            ROWS,
            &[1, 0],
            None,
            8,
            &places,
            &mut both,
            &mut flags,
        )
        .unwrap();
        assert_eq!(both, [5, 6, 0, 7, 7, 1, 1, 2, 3, 4, 6, 5]);
        assert_eq!(flags, [true; 6]);
        // Layer 0 holds zeros: expert 0 twice in a row is no router's pick (zero padding).
        let mut narrow = [0i32; 6];
        router_ids(
            &batch,
            ROWS,
            &[0],
            None,
            8,
            &one("r"),
            &mut narrow,
            &mut replayed,
        )
        .unwrap_err();
    }

    #[test]
    fn ids_out_of_range_or_repeated_are_refused_naming_the_row() {
        let mut out = [0i64; 6];
        let mut replayed = [false; 3];
        let high: [u8; 12] = [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 9, 1];
        let e = router_ids(
            &high,
            ROWS,
            &[1],
            None,
            8,
            &one("router 4"),
            &mut out,
            &mut replayed,
        );
        assert_eq!(
            e.unwrap_err().to_string(),
            "router 4, row 2: expert ids must be below num_experts 8, got [9, 1]"
        );
        let twice: [u16; 12] = [3, 3, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1];
        let e = router_ids(
            &twice,
            ROWS,
            &[0],
            None,
            8,
            &one("r"),
            &mut out,
            &mut replayed,
        );
        assert!(e
            .unwrap_err()
            .to_string()
            .starts_with("r, row 0: a row's expert ids must be distinct"));
        // Sizes and arguments are checked before any row is read.
        let short = [0u8; 11];
        assert!(router_ids(
            &short,
            ROWS,
            &[0],
            None,
            8,
            &one("r"),
            &mut out,
            &mut replayed
        )
        .is_err());
        assert!(router_ids(
            &high,
            ROWS,
            &[2],
            None,
            8,
            &one("r"),
            &mut out,
            &mut replayed
        )
        .is_err());
        assert!(router_ids(
            &high,
            ROWS,
            &[0],
            None,
            1,
            &one("r"),
            &mut out,
            &mut replayed
        )
        .is_err());
        let mut small = [0i32; 6];
        let e = router_ids(
            &high,
            ROWS,
            &[0],
            None,
            1 << 40,
            &one("r"),
            &mut small,
            &mut replayed,
        );
        assert!(e.unwrap_err().to_string().contains("at most 2147483647"));
    }
}
