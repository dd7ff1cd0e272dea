//! Agreement between two routings of the same token positions (rollout against the trainer's
//! recompute, one engine against another, two runs): how often each router (token x layer)
//! picked the same set of experts, in one pass over both.
//!
//! Each router's top_k is compared as a multiset: order inside a row does not matter. Valid
//! routing never repeats an expert in one top_k, and then this is set comparison; a repeated
//! id counts as often as it appears, so a routing agrees with itself exactly whatever it holds
//! (as sorting each row and comparing does). Rows marked missing (all `-1`, see [`crate::quality::validate::is_missing`])
//! on either side are excluded and counted.

use crate::error::{Error, ErrorKind, Result};
use crate::payload::dtype::{with_element, Element};
use crate::payload::Payload;
use crate::quality::validate::is_missing;

/// The counts two routings agree by, over the positions both cover. The fractions are methods;
/// each is NaN when no row was compared (every shared position missing on one side).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Agreement {
    /// Layers of each token.
    pub num_layers: usize,
    /// Experts chosen per token and layer.
    pub top_k: usize,
    /// First absolute position compared (the later of the two starts).
    pub start: u64,
    /// End of the compared positions, exclusive (the earlier of the two stops).
    pub stop: u64,
    /// Token rows compared (missing on neither side).
    pub compared_rows: u64,
    /// Token rows left out because one side or both marked them missing.
    pub excluded_rows: u64,
    /// Per layer: routers whose expert sets are equal.
    pub exact_per_layer: Vec<u64>,
    /// Per layer: the sum over routers of |A ∩ B| (multiset intersection).
    pub overlap_per_layer: Vec<u64>,
    /// Compared tokens with at least one layer whose sets differ.
    pub tokens_with_difference: u64,
    /// Routers whose sets differ, over every compared token.
    pub differing_routers: u64,
    /// Per layer: the layer has no router (its top_k zero throughout on both sides, with
    /// `top_k > 1`: vLLM 0.22+ and SGLang write dense layers so). Such a layer is left out of
    /// every figure (its per-layer fractions are NaN), as `validate` and `expert_load` read it:
    /// two dense layers "agreeing" would count as replay working where there is no router.
    pub no_router: Vec<bool>,
}

impl Agreement {
    fn routers(&self) -> f64 {
        let routed = self.no_router.iter().filter(|&&none| !none).count();
        self.compared_rows as f64 * routed as f64
    }

    /// The sum of a per-layer count over the layers that have a router.
    fn routed_sum(&self, per_layer: &[u64]) -> u64 {
        per_layer
            .iter()
            .zip(&self.no_router)
            .filter(|(_, &none)| !none)
            .map(|(&c, _)| c)
            .sum()
    }

    /// Fraction of routers whose expert sets match exactly.
    pub fn exact_match(&self) -> f64 {
        self.routed_sum(&self.exact_per_layer) as f64 / self.routers()
    }

    /// Mean over routers of |A ∩ B| / top_k.
    pub fn overlap(&self) -> f64 {
        self.routed_sum(&self.overlap_per_layer) as f64 / (self.routers() * self.top_k as f64)
    }

    /// Fraction of compared tokens with at least one layer whose sets differ.
    pub fn tokens_with_difference(&self) -> f64 {
        self.tokens_with_difference as f64 / self.compared_rows as f64
    }

    /// Mean number of routers (layers) per compared token whose sets differ.
    pub fn differing_per_token(&self) -> f64 {
        self.differing_routers as f64 / self.compared_rows as f64
    }

    /// Per layer: the fraction of routers whose sets match exactly (NaN for a layer with no
    /// router).
    pub fn exact_match_per_layer(&self) -> Vec<f64> {
        let n = self.compared_rows as f64;
        self.per_layer(&self.exact_per_layer, n)
    }

    /// Per layer: the mean of |A ∩ B| / top_k (NaN for a layer with no router).
    pub fn overlap_per_layer(&self) -> Vec<f64> {
        let n = self.compared_rows as f64 * self.top_k as f64;
        self.per_layer(&self.overlap_per_layer, n)
    }

    fn per_layer(&self, counts: &[u64], n: f64) -> Vec<f64> {
        counts
            .iter()
            .zip(&self.no_router)
            .map(|(&c, &none)| if none { f64::NAN } else { c as f64 / n })
            .collect()
    }
}

/// Compare `a` and `b` on the positions both cover. Errors (`PayloadError`): no shared
/// position (naming both ranges), different layers or top_k, a top_k or layer count of 0, and a
/// negative id in a row that is not marked missing (naming side, position and layer).
pub fn agreement(a: &Payload, b: &Payload) -> Result<Agreement> {
    let (la, lb) = (a.num_layers(), b.num_layers());
    let (ka, kb) = (a.top_k(), b.top_k());
    if la != lb {
        return Err(Error::field(
            "num_layers",
            format!("{la} on both sides"),
            lb,
        ));
    }
    if ka != kb {
        return Err(Error::field("top_k", format!("{ka} on both sides"), kb));
    }
    if la == 0 || ka == 0 {
        let what = format!("shape [tokens, {la}, {ka}]");
        return Err(Error::field(
            "shape",
            "at least one layer and top_k >= 1",
            what,
        ));
    }
    let start = a.start().max(b.start());
    let stop = a.stop().min(b.stop());
    if start >= stop {
        return Err(Error::malformed(format!(
            "expected routings that share positions, got [{}, {}) and [{}, {})",
            a.start(),
            a.stop(),
            b.start(),
            b.stop()
        )));
    }
    // Both offsets and the count fit in usize: they are row indices of existing payloads.
    let rows = (stop - start) as usize;
    let (from_a, from_b) = ((start - a.start()) as usize, (start - b.start()) as usize);
    let row = la * ka;
    let (c, no_router) = with_element!(a.dtype(), A => with_element!(b.dtype(), B => {
        let va = &a.values::<A>()[from_a * row..(from_a + rows) * row];
        let vb = &b.values::<B>()[from_b * row..(from_b + rows) * row];
        let c = count(va, vb, ka, la, start)?;
        // Only a layer that agreed everywhere can be zero on both sides: look at those alone.
        let none: Vec<bool> = (0..la)
            .map(|l| {
                ka > 1
                    && c.compared > 0
                    && c.exact[l] == c.compared
                    && zero_throughout(va, l, ka, row)
                    && zero_throughout(vb, l, ka, row)
            })
            .collect();
        (c, none)
    }));
    Ok(Agreement {
        num_layers: la,
        top_k: ka,
        start,
        stop,
        compared_rows: c.compared,
        excluded_rows: c.excluded,
        exact_per_layer: c.exact,
        overlap_per_layer: c.overlap,
        tokens_with_difference: c.differing_tokens,
        differing_routers: c.differing,
        no_router,
    })
}

/// Whether layer `layer`'s top_k is zero in every row of `v` not marked missing.
fn zero_throughout<T: Element>(v: &[T], layer: usize, k: usize, row: usize) -> bool {
    v.chunks_exact(row)
        .filter(|token| !is_missing(token))
        .all(|token| {
            token[layer * k..(layer + 1) * k]
                .iter()
                .all(|&x| Into::<i64>::into(x) == 0)
        })
}

/// Why a group could not be compared by bit masks.
enum Refused {
    /// A negative id (side, index of the value in its side's slice, value).
    Negative(&'static str, usize, i64),
    /// An id too large for the mask: compare by the general path instead.
    Wide,
}

/// The counts of `va` against `vb` (rows from position `start`), by the fastest path the
/// ids allow; a negative id outside a missing row is an error naming side, position, layer.
fn count<A: Element, B: Element>(
    va: &[A],
    vb: &[B],
    k: usize,
    layers: usize,
    start: u64,
) -> Result<RunCounts> {
    // Masks wide enough for every id the dtypes can hold, or for the models in use (384
    // experts); ids past that take the general path, which compares values pairwise.
    let counted = if A::DTYPE.max() < 256 && B::DTYPE.max() < 256 {
        count_parts::<A, B, MaskSet<4>>(va, vb, k, layers)
    } else {
        count_parts::<A, B, MaskSet<8>>(va, vb, k, layers)
    };
    let counted = match counted {
        Err(Refused::Wide) => count_parts::<A, B, PairwiseSet>(va, vb, k, layers),
        other => other,
    };
    match counted {
        Ok(c) => Ok(c),
        Err(Refused::Negative(side, at, v)) => {
            let row = layers * k;
            let (pos, layer) = (start + (at / row) as u64, at % row / k);
            Err(Error::new(
                ErrorKind::Id {
                    position: pos,
                    layer,
                },
                format!(
                    "expected non-negative ids (or a row of -1 for a missing route) in {side}, \
                 got {v} at position {pos}, layer {layer}"
                ),
            ))
        }
        Err(Refused::Wide) => unreachable!("the pairwise path takes any id"),
    }
}

/// The counts of a run of rows (see [`Agreement`]); runs add up.
struct RunCounts {
    exact: Vec<u64>,
    overlap: Vec<u64>,
    compared: u64,
    excluded: u64,
    differing_tokens: u64,
    differing: u64,
}

impl RunCounts {
    fn add(&mut self, other: RunCounts) {
        for (a, b) in self.exact.iter_mut().zip(other.exact) {
            *a += b;
        }
        for (a, b) in self.overlap.iter_mut().zip(other.overlap) {
            *a += b;
        }
        self.compared += other.compared;
        self.excluded += other.excluded;
        self.differing_tokens += other.differing_tokens;
        self.differing += other.differing;
    }
}

/// The rows counted in parts on the machine's cores and added up; the first refusal in
/// position order wins.
fn count_parts<A: Element, B: Element, C: GroupCompare>(
    va: &[A],
    vb: &[B],
    k: usize,
    layers: usize,
) -> std::result::Result<RunCounts, Refused> {
    let row = layers * k;
    let bytes = std::mem::size_of_val(va) + std::mem::size_of_val(vb);
    let parts = crate::kernels::parallel::over_rows(va.len() / row, bytes, |r| {
        let (from, to) = (r.start * row, r.end * row);
        count_with::<A, B, C>(&va[from..to], &vb[from..to], k, layers).map_err(|e| match e {
            Refused::Negative(side, at, v) => Refused::Negative(side, from + at, v),
            wide => wide,
        })
    });
    let mut total: Option<RunCounts> = None;
    for part in parts {
        let part = part?;
        match total.as_mut() {
            Some(t) => t.add(part),
            None => total = Some(part),
        }
    }
    Ok(total.expect("over_rows returns at least one part"))
}

/// How one router's two expert groups are compared: `(|A ∩ B|, A == B)` as multisets.
trait GroupCompare {
    fn compare<A: Element, B: Element>(
        ga: &[A],
        gb: &[B],
    ) -> std::result::Result<(u32, bool), Refused>;
}

/// Sets as bit masks of `64 * W` ids: a few instructions per id, no popcount (which
/// baseline x86-64 lacks). A group with a repeated id goes to the pairwise path, which counts
/// multiplicity.
struct MaskSet<const W: usize>;

impl<const W: usize> GroupCompare for MaskSet<W> {
    #[inline(always)]
    fn compare<A: Element, B: Element>(
        ga: &[A],
        gb: &[B],
    ) -> std::result::Result<(u32, bool), Refused> {
        #[inline(always)]
        fn bit<T: Element>(
            v: T,
            i: usize,
            side: &'static str,
            words: usize,
        ) -> std::result::Result<(usize, u64), Refused> {
            let v: i64 = v.into();
            if v < 0 {
                return Err(Refused::Negative(side, i, v));
            }
            let word = (v >> 6) as usize;
            if word >= words {
                return Err(Refused::Wide);
            }
            Ok((word, 1 << (v & 63)))
        }
        let mut ma = [0u64; W];
        let mut repeated = false;
        for (i, &v) in ga.iter().enumerate() {
            let (w, b) = bit(v, i, "a", W)?;
            repeated |= ma[w] & b != 0;
            ma[w] |= b;
        }
        let mut mb = [0u64; W];
        let mut common = 0u32;
        for (i, &v) in gb.iter().enumerate() {
            let (w, b) = bit(v, i, "b", W)?;
            repeated |= mb[w] & b != 0;
            mb[w] |= b;
            common += u32::from(ma[w] & b != 0);
        }
        if repeated {
            return PairwiseSet::compare(ga, gb);
        }
        // No id repeats on either side: the sets have ga.len() and gb.len() members.
        let equal = common as usize == ga.len() && ga.len() == gb.len();
        Ok((common, equal))
    }
}

/// Any ids, repeated or not: both groups sorted, then merged (top_k is small).
struct PairwiseSet;

impl GroupCompare for PairwiseSet {
    fn compare<A: Element, B: Element>(
        ga: &[A],
        gb: &[B],
    ) -> std::result::Result<(u32, bool), Refused> {
        fn negative<T: Element>(g: &[T], side: &'static str) -> std::result::Result<(), Refused> {
            match g.iter().position(|&v| v.into() < 0) {
                Some(i) => Err(Refused::Negative(side, i, g[i].into())),
                None => Ok(()),
            }
        }
        negative(ga, "a")?;
        negative(gb, "b")?;
        fn sorted<T: Element>(g: &[T]) -> Vec<i64> {
            let mut v: Vec<i64> = g.iter().map(|&x| x.into()).collect();
            v.sort_unstable();
            v
        }
        let (a, b) = (sorted(ga), sorted(gb));
        let (mut i, mut j, mut common) = (0, 0, 0u32);
        while i < a.len() && j < b.len() {
            match a[i].cmp(&b[j]) {
                std::cmp::Ordering::Less => i += 1,
                std::cmp::Ordering::Greater => j += 1,
                std::cmp::Ordering::Equal => {
                    common += 1;
                    i += 1;
                    j += 1;
                }
            }
        }
        Ok((common, a == b))
    }
}

/// Byte equality, with the group sizes of real models (top_k 8 of uint8 or uint16) as one
/// register compare instead of a call to memcmp.
#[inline(always)]
fn bytes_equal(x: &[u8], y: &[u8]) -> bool {
    if let (Ok(a), Ok(b)) = (<[u8; 8]>::try_from(x), <[u8; 8]>::try_from(y)) {
        return u64::from_ne_bytes(a) == u64::from_ne_bytes(b);
    }
    if let (Ok(a), Ok(b)) = (<[u8; 16]>::try_from(x), <[u8; 16]>::try_from(y)) {
        return u128::from_ne_bytes(a) == u128::from_ne_bytes(b);
    }
    x == y
}

fn count_with<A: Element, B: Element, C: GroupCompare>(
    va: &[A],
    vb: &[B],
    k: usize,
    layers: usize,
) -> std::result::Result<RunCounts, Refused> {
    let row = layers * k;
    let mut exact = vec![0u64; layers];
    let mut overlap = vec![0u64; layers];
    let (mut compared, mut excluded, mut differing_tokens, mut differing) = (0, 0, 0, 0);
    // Equal bytes are equal routing (most routers agree when replay works): one compare, no
    // set arithmetic. Only when both sides share a dtype, and for signed dtypes only when no id
    // is negative (the general path refuses those).
    let same = A::DTYPE == B::DTYPE;
    let signed = A::DTYPE.min() < 0;
    let identical = |x: &[A], y: &[B]| {
        same && bytes_equal(bytemuck::cast_slice(x), bytemuck::cast_slice(y))
            && (!signed || x.iter().all(|&v| v.into() >= 0))
    };
    // Whole token rows are compared only while they keep being equal (two runs of one engine):
    // once rows differ somewhere, the per-router compare alone is cheaper.
    let mut rows_equal = true;
    for (t, (ra, rb)) in va.chunks_exact(row).zip(vb.chunks_exact(row)).enumerate() {
        if is_missing(ra) || is_missing(rb) {
            excluded += 1;
            continue;
        }
        compared += 1;
        if rows_equal && identical(ra, rb) {
            exact.iter_mut().for_each(|e| *e += 1);
            overlap.iter_mut().for_each(|o| *o += k as u64);
            continue;
        }
        let mut differ = 0u64;
        for (l, (ga, gb)) in ra.chunks_exact(k).zip(rb.chunks_exact(k)).enumerate() {
            if identical(ga, gb) {
                exact[l] += 1;
                overlap[l] += k as u64;
                continue;
            }
            let (common, equal) = C::compare(ga, gb).map_err(|e| match e {
                Refused::Negative(side, i, v) => Refused::Negative(side, t * row + l * k + i, v),
                wide => wide,
            })?;
            overlap[l] += u64::from(common);
            exact[l] += u64::from(equal);
            differ += u64::from(!equal);
        }
        rows_equal = differ == 0;
        differing += differ;
        differing_tokens += u64::from(differ > 0);
    }
    Ok(RunCounts {
        exact,
        overlap,
        compared,
        excluded,
        differing_tokens,
        differing,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::{DTypeChoice, Shape};

    fn payload(values: &[i64], shape: (usize, usize, usize), start: u64) -> Payload {
        let shape = Shape::new(shape.0, shape.1, shape.2);
        Payload::from_values(values, shape, start, DTypeChoice::Compact).unwrap()
    }

    #[test]
    fn a_layer_zero_on_both_sides_has_no_router_and_is_left_out() {
        // 2 tokens, 2 layers (layer 1 dense: zeros), top_k 2; layer 0 differs in one token.
        let a = payload(&[1, 2, 0, 0, 3, 4, 0, 0], (2, 2, 2), 0);
        let b = payload(&[1, 2, 0, 0, 3, 5, 0, 0], (2, 2, 2), 0);
        let r = agreement(&a, &b).unwrap();
        assert_eq!(r.no_router, vec![false, true]);
        assert_eq!(r.exact_match(), 0.5); // one of two routers of layer 0, not 3 of 4
        assert!(r.exact_match_per_layer()[1].is_nan());
        // Zero on one side only is routing that differs, not a missing router.
        let c = payload(&[1, 2, 0, 0, 3, 4, 0, 1], (2, 2, 2), 0);
        assert_eq!(agreement(&a, &c).unwrap().no_router, vec![false, false]);
    }

    #[test]
    fn a_routing_agrees_with_itself_and_with_any_order_inside_its_rows() {
        let a = payload(&[1, 2, 3, 4, 5, 6, 7, 8], (2, 2, 2), 0);
        let b = payload(&[2, 1, 3, 4, 6, 5, 8, 7], (2, 2, 2), 0);
        for other in [&a, &b] {
            let r = agreement(&a, other).unwrap();
            assert_eq!((r.exact_match(), r.overlap()), (1.0, 1.0));
            assert_eq!(
                (r.tokens_with_difference(), r.differing_per_token()),
                (0.0, 0.0)
            );
        }
    }

    #[test]
    fn counts_by_hand() {
        // Token 0: layer 0 equal, layer 1 shares one of two. Token 1: both layers equal.
        let a = payload(&[1, 2, 3, 4, 5, 6, 7, 8], (2, 2, 2), 0);
        let b = payload(&[2, 1, 3, 9, 5, 6, 7, 8], (2, 2, 2), 0);
        let r = agreement(&a, &b).unwrap();
        assert_eq!(r.exact_per_layer, vec![2, 1]);
        assert_eq!(r.overlap_per_layer, vec![4, 3]);
        assert_eq!((r.tokens_with_difference, r.differing_routers), (1, 1));
        assert_eq!(r.exact_match(), 0.75);
        assert_eq!(r.overlap(), 7.0 / 8.0);
        assert_eq!(r.tokens_with_difference(), 0.5);
        assert_eq!(r.differing_per_token(), 0.5);
    }

    #[test]
    fn only_shared_positions_are_compared_and_disjoint_ranges_are_refused() {
        let a = payload(&[1, 2, 3, 4, 5, 6], (3, 1, 2), 10);
        let b = payload(&[3, 4, 9, 9], (2, 1, 2), 11);
        let r = agreement(&a, &b).unwrap();
        assert_eq!((r.start, r.stop, r.compared_rows), (11, 13, 2));
        assert_eq!(r.exact_per_layer, vec![1]);
        let far = payload(&[1, 2], (1, 1, 2), 13);
        let e = agreement(&a, &far).unwrap_err().to_string();
        assert!(e.contains("[10, 13) and [13, 14)"), "{e}");
    }

    #[test]
    fn missing_rows_are_excluded_and_counted_and_other_negatives_refused() {
        let a = payload(&[-1, -1, -1, -1, 1, 2, 3, 4], (2, 2, 2), 0);
        let b = payload(&[1, 2, 3, 4, 1, 2, 3, 5], (2, 2, 2), 0);
        let r = agreement(&a, &b).unwrap();
        assert_eq!((r.compared_rows, r.excluded_rows), (1, 1));
        assert_eq!(r.exact_per_layer, vec![1, 0]);
        let bad = payload(&[1, 2, 3, 4, 1, -1, 3, 4], (2, 2, 2), 5);
        let b5 = payload(&[1, 2, 3, 4, 1, 2, 3, 5], (2, 2, 2), 5);
        let e = agreement(&bad, &b5).unwrap_err().to_string();
        assert!(e.contains("got -1 at position 6, layer 0"), "{e}");
    }

    #[test]
    fn mixed_and_wide_dtypes_take_the_same_answer() {
        let a = payload(&[1, 2, 300, 7], (1, 2, 2), 0); // uint16
        let b = payload(&[2, 1, 7, 300], (1, 2, 2), 0);
        assert_eq!(agreement(&a, &b).unwrap().exact_match(), 1.0);
        let wide = payload(&[1, 2, 70_000, 7], (1, 2, 2), 0); // int32, past the masks
        let r = agreement(&wide, &a).unwrap();
        assert_eq!(r.exact_per_layer, vec![1, 0]);
        assert_eq!(r.overlap_per_layer, vec![2, 1]);
        // A repeated id counts as often as it appears: [1, 1] against [1, 7] shares one.
        let repeated = payload(&[2, 1, 1, 1], (1, 2, 2), 0);
        let r = agreement(&repeated, &payload(&[1, 2, 1, 7], (1, 2, 2), 0)).unwrap();
        assert_eq!(
            (r.exact_per_layer, r.overlap_per_layer),
            (vec![1, 0], vec![2, 1])
        );
        let r = agreement(&repeated, &repeated).unwrap();
        assert_eq!((r.exact_match(), r.overlap()), (1.0, 1.0));
    }

    #[test]
    fn shapes_that_cannot_be_compared_are_refused() {
        let a = payload(&[1, 2], (1, 1, 2), 0);
        let b = payload(&[1, 2], (1, 2, 1), 0);
        assert!(agreement(&a, &b)
            .unwrap_err()
            .to_string()
            .contains("num_layers"));
        let empty = payload(&[], (1, 1, 0), 0);
        assert!(agreement(&empty, &empty)
            .unwrap_err()
            .to_string()
            .contains("top_k >= 1"));
    }
}
