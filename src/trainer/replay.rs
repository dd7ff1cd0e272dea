//! A router's replay ids from a batch of routing rows (format.md §6.2): one layer's
//! `[tokens, top_k]` ids, read from the batch's `[tokens, layers, top_k]` rows, checked (in
//! `[0, num_experts)`, no id twice in a row) and written in the trainer's index dtype, with
//! rows that hold no routing given ids spread over the experts. One pass over the rows read.

use crate::error::{Error, ErrorKind, Result};

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

/// An integer id as it sits in a batch. Only `-1` has a meaning below zero (no routing, when a
/// router's ids are `-1` throughout: format.md §7); any other negative id is corrupt.
pub trait BatchId: Copy + Sync {
    /// The id, or `Err` with the negative value it holds.
    fn id(self) -> std::result::Result<u64, i64>;
}

macro_rules! batch_id {
    (unsigned: $($t:ty),*) => {$(
        impl BatchId for $t {
            fn id(self) -> std::result::Result<u64, i64> {
                Ok(self as u64)
            }
        }
    )*};
    (signed: $($t:ty),*) => {$(
        impl BatchId for $t {
            fn id(self) -> std::result::Result<u64, i64> {
                u64::try_from(self).map_err(|_| self as i64)
            }
        }
    )*};
}
batch_id!(unsigned: u8, u16, u32, u64);
batch_id!(signed: i8, i16, i32, i64);

/// How errors name a batch's rows: by their index (`row 7`), or by the sample and position each
/// came from (`sample 1, position 12`: the place a user knows, where a packed or sharded batch's
/// index is not).
#[derive(Clone, Copy, Debug, Default)]
pub enum RowNames<'a> {
    /// `row {index}`.
    #[default]
    Index,
    /// Two values a row, its sample then its position (`2 x tokens` in all); a negative sample
    /// names the row `row {position}` (a row whose sample is not known, or one row checked
    /// apart from its batch).
    Origin(&'a [i64]),
}

impl RowNames<'_> {
    fn name(&self, row: usize) -> String {
        match self {
            RowNames::Origin(pairs) if pairs[2 * row] >= 0 => {
                format!("sample {}, position {}", pairs[2 * row], pairs[2 * row + 1])
            }
            RowNames::Origin(pairs) => format!("row {}", pairs[2 * row + 1]),
            RowNames::Index => format!("row {row}"),
        }
    }
}

/// Each router's ids of every row of `batch`: router `i` reads layer `layers[i]` and writes
/// its `tokens x top_k` ids into `out[i]` (`out` holds the routers one after the other) and
/// whether each row was replayed into `replayed[i]` (`tokens` each). The batch is read once,
/// row by row (each router reading its own layer would read every row once per router).
///
/// A router's row is replayed when `valid` (if given) says so and its ids are not `-1`
/// throughout (no routing: format.md §7). Its ids must be in `[0, num_experts)` and distinct,
/// else an [`ErrorKind::Row`] error naming `places[i]` and the row (as `names` says), with its
/// ids: a `-1` beside real ids and any other negative id are corrupt, never read as "no
/// routing", and ids all zero get a message of their own (zero padding, or a token the engine
/// routed none for: its mask is missing). A row not replayed takes experts
/// `(r x top_k + j) % num_experts` for `j < top_k` (distinct when `top_k <= num_experts`,
/// spread over the experts: never the repeated expert 0 of zero padding). The first bad row
/// (rows in order, then routers) is the one reported, however the work is split.
#[allow(clippy::too_many_arguments)]
pub fn router_ids<T: BatchId, O: IndexId>(
    batch: &[T],
    rows: Rows,
    layers: &[usize],
    valid: Option<&[bool]>,
    num_experts: u64,
    places: &[String],
    names: RowNames<'_>,
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
        .ok_or_else(|| Error::malformed("the batch's shape overflows"))?;
    let per_router = tokens * top_k; // at most `cells`, which fits
    if batch.len() != cells
        || Some(out.len()) != per_router.checked_mul(routers)
        || Some(replayed.len()) != tokens.checked_mul(routers)
        || places.len() != routers
    {
        return Err(Error::malformed(format!(
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
    if let RowNames::Origin(pairs) = names {
        if Some(pairs.len()) != tokens.checked_mul(2) {
            return Err(Error::field(
                "origin",
                format!("{tokens} x 2 values (sample and position of each row)"),
                pairs.len(),
            ));
        }
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
        names,
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
    names: RowNames<'a>,
}

impl Check<'_> {
    fn fill<T: BatchId, O: IndexId>(&self, batch: &[T], mut part: Part<'_, O>) -> Result<()> {
        let Rows {
            layers: width,
            top_k,
            ..
        } = self.rows;
        let num_experts = self.num_experts;
        for (k, r) in part.rows.clone().enumerate() {
            let row = &batch[r * width * top_k..][..width * top_k];
            let row_valid = self.valid.is_none_or(|v| v[r]);
            for (i, &layer) in self.layers.iter().enumerate() {
                let dst = &mut part.out[i][k * top_k..][..top_k];
                let src = &row[layer * top_k..][..top_k];
                let routed = row_valid && !src.iter().all(|&v| v.id() == Err(-1));
                part.replayed[i][k] = routed;
                if routed {
                    if let Some(what) = self.bad_ids(src) {
                        return Err(self.row_error(i, r, src, what));
                    }
                    for (d, &v) in dst.iter_mut().zip(src) {
                        *d = O::from_id(v.id().unwrap_or_default()); // checked just above
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

    /// What is wrong with a replayed row's ids, if anything.
    fn bad_ids<T: BatchId>(&self, src: &[T]) -> Option<String> {
        let num_experts = self.num_experts;
        for (j, &v) in src.iter().enumerate() {
            match v.id() {
                Err(-1) => {
                    return Some(
                        "-1 (no routing) beside real ids (a row without routing is -1 \
                         throughout)"
                            .into(),
                    )
                }
                Err(_) => return Some(format!("expert ids must be in [0, {num_experts})")),
                Ok(id) if id >= num_experts => {
                    return Some(format!("expert ids must be in [0, {num_experts})"))
                }
                // top_k is small (8 for the models that matter): pairs beat a set.
                Ok(id) if src[..j].iter().any(|&u| u.id() == Ok(id)) => {
                    return Some(if src.iter().all(|&u| u.id() == Ok(0)) {
                        "no routing (ids all zero: zero padding, or a token the engine routed \
                         none for, as the last sampled token of vLLM's P + G - 1 rows): pass \
                         the mask of rx.pack(..., mask=True) or pack with num_tokens"
                            .into()
                    } else {
                        "a row's expert ids must be distinct (a top-k router never picks one \
                         twice)"
                            .into()
                    });
                }
                Ok(_) => {}
            }
        }
        None
    }

    fn row_error<T: BatchId>(&self, router: usize, row: usize, src: &[T], what: String) -> Error {
        let ids: Vec<i128> = src
            .iter()
            .map(|&v| v.id().map_or_else(i128::from, i128::from))
            .collect();
        let place = &self.places[router];
        let at = self.names.name(row);
        Error::new(
            ErrorKind::Row { router, row },
            format!("{place}, {at}: {what}, got {ids:?}"),
        )
    }
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
            RowNames::Index,
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
            RowNames::Index,
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
            RowNames::Index,
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
            RowNames::Index,
            &mut out,
            &mut replayed,
        );
        assert_eq!(
            e.unwrap_err().to_string(),
            "router 4, row 2: expert ids must be in [0, 8), got [9, 1]"
        );
        let twice: [u16; 12] = [3, 3, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1];
        let e = router_ids(
            &twice,
            ROWS,
            &[0],
            None,
            8,
            &one("r"),
            RowNames::Index,
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
            RowNames::Index,
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
            RowNames::Index,
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
            RowNames::Index,
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
            RowNames::Index,
            &mut small,
            &mut replayed,
        );
        assert!(e.unwrap_err().to_string().contains("at most 2147483647"));
    }

    fn first_error<T: BatchId>(batch: &[T], valid: Option<&[bool]>, names: RowNames<'_>) -> Error {
        let mut out = [0i64; 6];
        let mut replayed = [false; 3];
        router_ids(
            batch,
            ROWS,
            &[1],
            valid,
            8,
            &one("r"),
            names,
            &mut out,
            &mut replayed,
        )
        .unwrap_err()
    }

    #[test]
    fn only_minus_one_throughout_means_no_routing() {
        // A negative id other than -1 is corrupt, never filler (issue 54, item 3).
        let e = first_error(
            &[0i8, 0, 3, -5, 0, 0, 4, -1, 0, 0, 1, 2],
            None,
            RowNames::Index,
        );
        assert_eq!(
            e.to_string(),
            "r, row 0: expert ids must be in [0, 8), got [3, -5]"
        );
        assert_eq!(e.kind(), &ErrorKind::Row { router: 0, row: 0 });
        // -1 beside a real id, even where the rest is fine.
        let e = first_error(
            &[0i64, 0, 3, 4, 0, 0, 4, -1, 0, 0, 1, 2],
            None,
            RowNames::Index,
        );
        assert!(
            e.to_string()
                .starts_with("r, row 1: -1 (no routing) beside real ids"),
            "{e}"
        );
        assert_eq!(e.kind(), &ErrorKind::Row { router: 0, row: 1 });
        // A masked-off row is not read at all, whatever it holds.
        let mut out = [0i64; 6];
        let mut replayed = [false; 3];
        let batch = [0i16, 0, 3, -5, 0, 0, -1, -1, 0, 0, 1, 2];
        let valid = [false, true, true];
        router_ids(
            &batch,
            ROWS,
            &[1],
            Some(&valid),
            8,
            &one("r"),
            RowNames::Index,
            &mut out,
            &mut replayed,
        )
        .unwrap();
        assert_eq!(replayed, [false, false, true]);
        assert_eq!(out, [0, 1, 2, 3, 1, 2]);
    }

    #[test]
    fn a_row_of_zeros_says_it_has_no_routing_and_names_the_sample() {
        let origin = [0i64, 5, 1, 0, 1, 1];
        let e = first_error(
            &[0u8, 0, 3, 4, 0, 0, 0, 0, 0, 0, 1, 2],
            None,
            RowNames::Origin(&origin),
        );
        let text = e.to_string();
        assert!(
            text.starts_with("r, sample 1, position 0: no routing (ids all zero"),
            "{text}"
        );
        assert!(text.contains("mask=True"), "{text}");
        // A negative sample names the row by its index.
        let origin = [-1i64, 0, -1, 1, -1, 2];
        let e = first_error(
            &[0u8, 0, 3, 3, 0, 0, 1, 0, 0, 0, 1, 2],
            None,
            RowNames::Origin(&origin),
        );
        assert!(e
            .to_string()
            .starts_with("r, row 0: a row's expert ids must be distinct"));
        // The origin must name every row.
        let mut out = [0i64; 6];
        let mut replayed = [false; 3];
        let e = router_ids(
            &[0u8; 12],
            ROWS,
            &[1],
            None,
            8,
            &one("r"),
            RowNames::Origin(&[0, 1]),
            &mut out,
            &mut replayed,
        )
        .unwrap_err();
        assert!(
            e.to_string().starts_with("`origin`: expected 3 x 2 values"),
            "{e}"
        );
    }
}
