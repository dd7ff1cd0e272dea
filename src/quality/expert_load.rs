//! Expert load: how often each layer's router picked each expert, over one payload or a batch,
//! with the per-layer balance figures derived from it.

use crate::error::{Error, ErrorKind, Result};
use crate::payload::dtype::{with_element, Element};
use crate::payload::Payload;
use crate::quality::validate::is_missing;

/// A `(num_layers, num_experts)` table of how many times each layer picked each expert, and
/// the token rows it was counted over. Rows marked missing (all `-1`) are skipped and counted.
/// A layer whose top_k is zero throughout a payload (every counted row, with `top_k > 1`: a
/// router never picks one expert twice) is a layer with no router, as
/// [`validate`](crate::quality::validate) reads it: vLLM 0.22+ and SGLang write dense layers so. It is
/// not counted as picks of expert 0, so a dense layer's figures are NaN (it counted nothing),
/// never a false imbalance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertLoad {
    num_layers: usize,
    num_experts: usize,
    counts: Vec<u64>,
    rows: u64,
    missing_rows: u64,
}

impl ExpertLoad {
    /// An empty table. Refused: no layer, no expert, or a table (8 bytes a cell) over `limit`
    /// bytes, checked before it is allocated.
    pub fn new(num_layers: usize, num_experts: usize, limit: usize) -> Result<Self> {
        if num_experts == 0 {
            return Err(Error::field("num_experts", "at least 1", 0));
        }
        if num_layers == 0 {
            return Err(Error::field("num_layers", "at least 1", 0));
        }
        let cells = num_layers.checked_mul(num_experts);
        let bytes = cells.and_then(|c| c.checked_mul(8));
        match bytes {
            Some(b) if b <= limit => {}
            _ => {
                return Err(Error::field(
                    "num_experts",
                    format!("a count table of at most {limit} bytes (8 per layer and expert)"),
                    format!("{num_experts} experts x {num_layers} layers"),
                ))
            }
        }
        Ok(ExpertLoad {
            num_layers,
            num_experts,
            counts: vec![0; num_layers * num_experts],
            rows: 0,
            missing_rows: 0,
        })
    }

    /// Count every id of `p`. Refused, with nothing counted: a different layer count, or an id
    /// that is negative or `>= num_experts` (naming its position and layer).
    pub fn add(&mut self, p: &Payload) -> Result<()> {
        if p.num_layers() != self.num_layers {
            return Err(Error::field(
                "num_layers",
                format!("{} as in the other payloads", self.num_layers),
                p.num_layers(),
            ));
        }
        with_element!(p.dtype(), T => self.add_values(p, p.values::<T>()))
    }

    fn add_values<T: Element>(&mut self, p: &Payload, values: &[T]) -> Result<()> {
        let (k, experts) = (p.top_k(), self.num_experts);
        let row = self.num_layers * k;
        if row == 0 {
            self.rows += p.num_tokens() as u64;
            return Ok(());
        }
        // Counted in parts on the machine's cores. In each part every id is checked before
        // anything is counted, so the counting loop has no checks; a refused payload counts
        // nothing (the parts' tables are added only when every part passed).
        let cells = self.counts.len();
        let parts = crate::kernels::parallel::over_rows(
            values.len() / row,
            std::mem::size_of_val(values),
            |r| {
                let part = &values[r.start * row..r.end * row];
                // Unsigned dtypes have no missing rows: one max, in the element type itself so it
                // vectorises (in i64 it was a scalar loop, 11 ms on 24.6 MB), decides.
                let in_range = T::DTYPE.min() == 0
                    && part.iter().copied().max().map_or(0, Into::into) < experts as i64;
                if !in_range {
                    if let Some((t, l, id)) = first_bad_id(part, row, k, experts) {
                        return Err((r.start + t, l, id));
                    }
                }
                let mut table = vec![0u64; cells];
                let (rows, missing) = count(part, row, k, &mut table, experts);
                Ok((table, rows, missing))
            },
        );
        let mut counted = Vec::with_capacity(parts.len());
        for part in parts {
            match part {
                Ok(c) => counted.push(c),
                Err((t, l, id)) => {
                    let pos = p.start() + t as u64;
                    return Err(Error::new(
                        ErrorKind::Id {
                            position: pos,
                            layer: l,
                        },
                        format!(
                            "expected expert ids in 0..{experts}, got {id} at position {pos}, \
                             layer {l}"
                        ),
                    ));
                }
            }
        }
        let (mut mine, mut rows, mut missing) = (vec![0u64; cells], 0u64, 0u64);
        for (table, r, m) in counted {
            for (total, c) in mine.iter_mut().zip(table) {
                *total += c;
            }
            rows += r;
            missing += m;
        }
        // A layer this payload holds as zeros throughout (every id of every counted row) has no
        // router: read from the counts, so the counting loop stays branch-free.
        if k > 1 && rows > 0 {
            for layer in mine.chunks_exact_mut(experts) {
                if layer[0] == rows * k as u64 && layer[1..].iter().all(|&c| c == 0) {
                    layer[0] = 0;
                }
            }
        }
        for (total, c) in self.counts.iter_mut().zip(mine) {
            *total += c;
        }
        self.rows += rows;
        self.missing_rows += missing;
        Ok(())
    }

    /// Layers of the table.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Experts of the table.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// The counts, row-major `(num_layers, num_experts)`.
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    /// The table, row-major `(num_layers, num_experts)`.
    pub fn into_counts(self) -> Vec<u64> {
        self.counts
    }

    /// Token rows counted.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Token rows skipped because they were marked missing.
    pub fn missing_rows(&self) -> u64 {
        self.missing_rows
    }

    fn layer(&self, l: usize) -> &[u64] {
        &self.counts[l * self.num_experts..(l + 1) * self.num_experts]
    }

    fn mean(&self, l: usize) -> f64 {
        self.layer(l).iter().sum::<u64>() as f64 / self.num_experts as f64
    }

    /// Per layer: the busiest expert's count over the mean count (1.0 is perfectly even; NaN
    /// for a layer that counted nothing).
    pub fn imbalance(&self) -> Vec<f64> {
        (0..self.num_layers)
            .map(|l| *self.layer(l).iter().max().unwrap_or(&0) as f64 / self.mean(l))
            .collect()
    }

    /// Per layer: the coefficient of variation of the counts (population standard deviation
    /// over the mean; 0.0 is perfectly even, NaN for a layer that counted nothing).
    pub fn coefficient_of_variation(&self) -> Vec<f64> {
        (0..self.num_layers)
            .map(|l| {
                let mean = self.mean(l);
                let var = self
                    .layer(l)
                    .iter()
                    .map(|&c| (c as f64 - mean).powi(2))
                    .sum::<f64>()
                    / self.num_experts as f64;
                var.sqrt() / mean
            })
            .collect()
    }

    /// Per layer: how many experts were never chosen.
    pub fn never_chosen_per_layer(&self) -> Vec<u64> {
        (0..self.num_layers)
            .map(|l| self.layer(l).iter().filter(|&&c| c == 0).count() as u64)
            .collect()
    }

    /// The experts no layer ever chose, ascending.
    pub fn never_chosen(&self) -> Vec<u64> {
        (0..self.num_experts)
            .filter(|&e| (0..self.num_layers).all(|l| self.counts[l * self.num_experts + e] == 0))
            .map(|e| e as u64)
            .collect()
    }
}

/// Count every row of `values` not marked missing (ids in 0..experts) into `total`: the rows
/// counted and the rows missing.
fn count<T: Element>(
    values: &[T],
    row: usize,
    k: usize,
    total: &mut [u64],
    experts: usize,
) -> (u64, u64) {
    // 16-bit cells: the table of a model (94 layers x 128 experts: 24 KB) stays in L1 where
    // 32-bit cells would not (measured 1.4x faster). Folded into the total after each chunk of
    // tokens, which adds at most `chunk * k` to one cell: within u16.
    let chunk = (usize::from(u16::MAX) / k).max(1);
    let mut local = vec![0u16; total.len()];
    let (mut rows, mut missing) = (0u64, 0u64);
    for part in values.chunks(chunk * row) {
        for token in part.chunks_exact(row) {
            if is_missing(token) {
                missing += 1;
                continue;
            }
            rows += 1;
            for (group, counts) in token.chunks_exact(k).zip(local.chunks_exact_mut(experts)) {
                for &v in group {
                    let id: i64 = v.into();
                    counts[id as usize] += 1; // in 0..experts: checked by the caller
                }
            }
        }
        for (t, c) in total.iter_mut().zip(local.iter_mut()) {
            *t += u64::from(std::mem::take(c));
        }
    }
    (rows, missing)
}

/// The first id outside `0..experts` in a row not marked missing: (token, layer, id).
fn first_bad_id<T: Element>(
    values: &[T],
    row: usize,
    k: usize,
    experts: usize,
) -> Option<(usize, usize, i64)> {
    values
        .chunks_exact(row)
        .enumerate()
        .filter(|(_, token)| !is_missing(token))
        .find_map(|(t, token)| {
            let i = token
                .iter()
                .position(|&v| (v.into() as u64) >= experts as u64)?;
            Some((t, i / k, token[i].into()))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::{DTypeChoice, Shape};

    fn payload(values: &[i64], shape: (usize, usize, usize)) -> Payload {
        let shape = Shape::new(shape.0, shape.1, shape.2);
        Payload::from_values(values, shape, 0, DTypeChoice::Compact).unwrap()
    }

    #[test]
    fn counts_by_hand_and_the_figures_derived() {
        // 2 layers, 4 experts, top_k 2, 3 tokens; the middle token is missing.
        let p = payload(&[0, 1, 2, 3, -1, -1, -1, -1, 0, 2, 2, 3], (3, 2, 2));
        let mut load = ExpertLoad::new(2, 4, 1 << 20).unwrap();
        load.add(&p).unwrap();
        assert_eq!(load.counts(), &[2, 1, 1, 0, 0, 0, 2, 2]);
        assert_eq!((load.rows(), load.missing_rows()), (2, 1));
        assert_eq!(load.imbalance(), vec![2.0, 2.0]);
        let cv = load.coefficient_of_variation();
        assert!((cv[0] - (0.5f64).sqrt()).abs() < 1e-12 && (cv[1] - 1.0).abs() < 1e-12);
        assert_eq!(load.never_chosen_per_layer(), vec![1, 2]);
        assert_eq!(load.never_chosen(), Vec::<u64>::new());
        load.add(&p).unwrap();
        assert_eq!(load.counts()[0], 4);
    }

    #[test]
    fn a_layer_zero_throughout_has_no_router_and_is_not_counted() {
        // As vLLM writes a dense layer (layer 1): every id 0. Expert 0 picked by a real router
        // beside another expert still counts.
        let p = payload(&[0, 1, 0, 0, 2, 0, 0, 0], (2, 2, 2));
        let mut load = ExpertLoad::new(2, 4, 1 << 20).unwrap();
        load.add(&p).unwrap();
        assert_eq!(load.counts(), &[2, 1, 1, 0, 0, 0, 0, 0]);
        assert_eq!(load.rows(), 2);
        let imbalance = load.imbalance();
        assert!(imbalance[1].is_nan(), "{imbalance:?}");
        // With top_k 1, expert 0 is a pick like any other.
        let mut load = ExpertLoad::new(1, 2, 1 << 20).unwrap();
        load.add(&payload(&[0, 0, 1], (3, 1, 1))).unwrap();
        assert_eq!(load.counts(), &[2, 1]);
    }

    #[test]
    fn bad_ids_and_tables_are_refused_and_nothing_is_counted() {
        let mut load = ExpertLoad::new(1, 4, 1 << 20).unwrap();
        let e = load
            .add(&payload(&[0, 1, 3, 4], (2, 1, 2)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("got 4 at position 1, layer 0"), "{e}");
        let e = load
            .add(&payload(&[0, -2], (1, 1, 2)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("got -2"), "{e}");
        assert_eq!((load.counts(), load.rows()), (&[0, 0, 0, 0][..], 0));
        assert!(load.add(&payload(&[0, 1], (1, 2, 1))).is_err());
        assert!(ExpertLoad::new(1, 0, 1 << 20).is_err());
        assert!(ExpertLoad::new(94, usize::MAX / 2, usize::MAX).is_err());
        assert!(ExpertLoad::new(94, 1 << 20, 1 << 20).is_err());
    }
}
