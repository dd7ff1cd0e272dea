//! Opt-in checks a trainer runs before a step (format.md §7): ids out of range, duplicate experts in
//! one token's top_k, all-zero token rows (the signature of lost prompt rows in P/D serving).

use crate::error::{Error, ErrorKind, Result};
use crate::payload::dtype::{with_element, Element};
use crate::payload::Payload;

/// Whether a token row is marked missing: every id `-1`, the sentinel NeMo-RL and tunix write
/// for a token whose routing was not recorded. Only signed dtypes can hold it (an unsigned
/// 255 or 65535 is an expert id). An empty row is not missing.
pub fn is_missing<T: Element>(row: &[T]) -> bool {
    !row.is_empty() && row.iter().all(|&v| v.into() == -1)
}

/// Per token row of `p`: whether it carries real routing, for a trainer's loss mask. The rows
/// from `real_rows` on (padding added by `to_training`) and rows marked missing are false.
pub fn routed_mask(p: &Payload, real_rows: usize) -> Vec<bool> {
    let row = p.num_layers() * p.top_k();
    with_element!(p.dtype(), T => {
        let values = p.values::<T>();
        (0..p.num_tokens())
            .map(|t| t < real_rows && !is_missing(&values[t * row..(t + 1) * row]))
            .collect()
    })
}

/// Which checks to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Checks {
    /// Ids must be `< num_experts` (and never negative, which is checked always).
    pub num_experts: Option<u64>,
    /// An expert twice in one token's top_k.
    pub duplicates: bool,
    /// A token row that is zero in every layer (lost prompt rows).
    pub zero_rows: bool,
    /// A token row marked missing (all `-1`, [`is_missing`]). Off by default: missing routes
    /// are data a trainer masks, and they are counted whether this is on or not. Their `-1`s
    /// are never counted as ids out of range.
    pub missing_rows: bool,
}

/// Counts of each failure, with the first (position, layer) of each.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Ids out of range.
    pub out_of_range: usize,
    /// The first id out of range: (position, layer, value).
    pub first_out_of_range: Option<(u64, usize, i64)>,
    /// (token, layer) groups whose top_k holds an expert twice.
    pub duplicates: usize,
    /// The first duplicate: (position, layer, value).
    pub first_duplicate: Option<(u64, usize, i64)>,
    /// Token rows that are zero in every layer.
    pub zero_rows: usize,
    /// The position of the first all-zero row.
    pub first_zero_row: Option<u64>,
    /// Token rows marked missing (all `-1`).
    pub missing_rows: usize,
    /// The position of the first missing row.
    pub first_missing_row: Option<u64>,
}

impl Report {
    /// Whether every check passed (missing rows fail only when `checks.missing_rows` is on).
    pub fn is_clean(&self, checks: &Checks) -> bool {
        self.out_of_range == 0
            && self.duplicates == 0
            && self.zero_rows == 0
            && (self.missing_rows == 0 || !checks.missing_rows)
    }

    /// The first failure as an error, in the order out-of-range, duplicate, zero row.
    pub fn into_result(self, checks: &Checks) -> Result<()> {
        if let Some((pos, layer, v)) = self.first_out_of_range {
            let range = match checks.num_experts {
                Some(n) => format!("ids in 0..{n}"),
                None => "non-negative ids".to_string(),
            };
            return Err(Error::new(ErrorKind::Id { position: pos, layer }, format!(
                "expected {range}, got {v} at position {pos}, layer {layer} ({} out of range in all)",
                self.out_of_range
            )));
        }
        if let Some((pos, layer, v)) = self.first_duplicate {
            return Err(Error::new(ErrorKind::Id { position: pos, layer }, format!(
                "expected distinct experts in each top_k, got expert {v} twice at position {pos}, layer {layer} \
                 ({} duplicated groups in all)",
                self.duplicates
            )));
        }
        if let Some(pos) = self.first_zero_row {
            return Err(Error::new(
                ErrorKind::RowsLost,
                format!(
                "expected routing in every row, got an all-zero row at position {pos} ({} in all: \
                 prompt rows lost in prefill/decode serving?)",
                self.zero_rows
            ),
            ));
        }
        if let (true, Some(pos)) = (checks.missing_rows, self.first_missing_row) {
            return Err(Error::new(
                ErrorKind::RowsLost,
                format!(
                    "expected routing in every row, got a row marked missing (all -1) at position \
                 {pos} ({} in all)",
                    self.missing_rows
                ),
            ));
        }
        Ok(())
    }
}

/// Count every failure of `checks`.
pub fn report(p: &Payload, checks: &Checks) -> Report {
    with_element!(p.dtype(), T => scan(p, p.values::<T>(), checks))
}

/// A `PayloadError` at the first failure of `checks`, naming its position and layer.
pub fn validate(p: &Payload, checks: &Checks) -> Result<()> {
    report(p, checks).into_result(checks)
}

fn scan<T: crate::payload::dtype::Element>(p: &Payload, values: &[T], checks: &Checks) -> Report {
    let (k, row) = (p.top_k(), p.num_layers() * p.top_k());
    let limit = checks
        .num_experts
        .map_or(i64::MAX, |n| i64::try_from(n).unwrap_or(i64::MAX));
    let mut r = Report::default();
    if row == 0 {
        return r;
    }
    for (t, token) in values.chunks_exact(row).enumerate() {
        let pos = p.start() + t as u64;
        if is_missing(token) {
            r.missing_rows += 1;
            r.first_missing_row.get_or_insert(pos);
            continue;
        }
        for (layer, group) in token.chunks_exact(k).enumerate() {
            for &v in group {
                let v: i64 = v.into();
                if v < 0 || v >= limit {
                    r.out_of_range += 1;
                    r.first_out_of_range.get_or_insert((pos, layer, v));
                }
            }
            if checks.duplicates {
                if let Some(v) = repeated_expert(group) {
                    r.duplicates += 1;
                    r.first_duplicate.get_or_insert((pos, layer, v));
                }
            }
        }
        if checks.zero_rows && all_zero(token) {
            r.zero_rows += 1;
            r.first_zero_row.get_or_insert(pos);
        }
    }
    r
}

fn all_zero<T: Element>(ids: &[T]) -> bool {
    ids.iter().all(|&v| Into::<i64>::into(v) == 0)
}

/// An expert a layer's top_k holds twice, if any. A layer zero throughout has no router (vLLM
/// 0.22+ and SGLang count dense layers among their layers and leave them zero): not a
/// duplicate; a row zero throughout is the zero-row check's.
fn repeated_expert<T: Element>(group: &[T]) -> Option<i64> {
    if all_zero(group) {
        return None;
    }
    // Expert ids below 512 (every model's but the largest) are marked in a bitset, one pass;
    // others are compared pairwise (top_k is small: 8 in practice).
    let mut seen = [0u64; 8];
    for (j, &v) in group.iter().enumerate() {
        let v: i64 = v.into();
        let Some(at) = usize::try_from(v).ok().filter(|&at| at < 512) else {
            return (j..group.len())
                .find_map(|j| group[..j].contains(&group[j]).then(|| group[j].into()));
        };
        let (word, bit) = (at / 64, 1u64 << (at % 64));
        if seen[word] & bit != 0 {
            return Some(v);
        }
        seen[word] |= bit;
    }
    None
}

/// Rows of a sample that look like an engine's fault rather than routing: a row zero in every
/// id (with top_k > 1, where a router never picks one expert twice: vLLM 0.26's monolithic
/// FlashInfer kernels returned such rows, vLLM issue #54730), and a layer whose top_k holds an
/// expert twice. A layer that is zero throughout is a layer with no router (the dense layers
/// vLLM 0.22+ and SGLang count among their layers), not a duplicate; rows marked missing are
/// data. For operators: counted, never refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Suspect {
    /// Rows looked at.
    pub checked: u64,
    /// Of those, rows zero in every id.
    pub zero_rows: u64,
    /// Of those, rows with an expert twice in one layer's top_k.
    pub duplicate_rows: u64,
}

impl Suspect {
    /// Look at one token row of `top_k`-wide layer groups.
    pub fn add_row<T: Element>(&mut self, row: &[T], top_k: usize) {
        if top_k < 2 || row.is_empty() || is_missing(row) {
            return;
        }
        self.checked += 1;
        if all_zero(row) {
            self.zero_rows += 1;
            return;
        }
        if row
            .chunks_exact(top_k)
            .any(|g| repeated_expert(g).is_some())
        {
            self.duplicate_rows += 1;
        }
    }

    /// Up to `sample` rows of `p` at positions from `from` on, evenly spaced.
    pub fn add_payload(&mut self, p: &Payload, from: u64, sample: usize) {
        let (k, row) = (p.top_k(), p.num_layers() * p.top_k());
        let first = from.saturating_sub(p.start()).min(p.num_tokens() as u64) as usize;
        let rows = p.num_tokens() - first;
        if row == 0 || rows == 0 || sample == 0 {
            return;
        }
        with_element!(p.dtype(), T => {
            let values = p.values::<T>();
            for t in sample_rows(rows, sample) {
                let t = first + t;
                self.add_row(&values[t * row..(t + 1) * row], k);
            }
        });
    }

    /// Both counts added.
    pub fn merge(&mut self, other: Suspect) {
        self.checked += other.checked;
        self.zero_rows += other.zero_rows;
        self.duplicate_rows += other.duplicate_rows;
    }
}

/// Up to `sample` of `0..rows`, evenly spaced, the last row among them.
pub(crate) fn sample_rows(rows: usize, sample: usize) -> impl Iterator<Item = usize> {
    let n = rows.min(sample);
    (0..n).map(move |i| {
        if n == rows {
            i
        } else {
            (i * (rows - 1)) / (n - 1).max(1)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::{DTypeChoice, Shape};

    /// The bitset finds the duplicate the pairwise comparison finds (the first id seen twice),
    /// ids past the bitset and negative ones included.
    #[test]
    fn repeated_expert_is_the_pairwise_answer() {
        let pairwise = |g: &[i64]| -> Option<i64> {
            if g.iter().all(|&v| v == 0) {
                return None;
            }
            (1..g.len()).find_map(|j| g[..j].contains(&g[j]).then_some(g[j]))
        };
        let mut next = crate::test_rng::xorshift(0xfeed_beef_1234_5678);
        let mut found = 0;
        for _ in 0..20_000 {
            let k = 1 + next() as usize % 10;
            let span = [4, 64, 600, 70_000][next() as usize % 4];
            let group: Vec<i64> = (0..k).map(|_| (next() % span) as i64 - 2).collect();
            assert_eq!(repeated_expert(&group), pairwise(&group), "{group:?}");
            found += usize::from(pairwise(&group).is_some());
        }
        assert!(found > 3000, "{found}");
        let wide: Vec<u16> = vec![700, 3, 700];
        assert_eq!(repeated_expert(&wide), Some(700));
    }

    #[test]
    fn suspect_rows_are_counted_and_dense_layers_are_not_duplicates() {
        // Rows: real; zero throughout; a duplicate; a dense (zero) layer then a real one; missing.
        let values = [
            1, 2, 3, 4, 0, 0, 0, 0, 5, 5, 1, 2, 0, 0, 6, 7, -1, -1, -1, -1,
        ];
        let p = Payload::from_values(&values[..], Shape::new(5, 2, 2), 0, DTypeChoice::Compact)
            .unwrap();
        let mut s = Suspect::default();
        s.add_payload(&p, 0, 100);
        assert_eq!(
            s,
            Suspect {
                checked: 4,
                zero_rows: 1,
                duplicate_rows: 1
            }
        );
        let mut late = Suspect::default();
        late.add_payload(&p, 2, 100);
        assert_eq!(
            (late.checked, late.zero_rows, late.duplicate_rows),
            (2, 0, 1)
        );
        assert_eq!(sample_rows(10, 3).collect::<Vec<_>>(), vec![0, 4, 9]);
        assert_eq!(sample_rows(2, 5).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(sample_rows(7, 1).collect::<Vec<_>>(), vec![0]);
    }

    #[test]
    fn finds_each_failure() {
        let values = [1, 2, 3, 4, 0, 0, 0, 0, 5, 5, 9, 1];
        let p = Payload::from_values(&values[..], Shape::new(3, 2, 2), 10, DTypeChoice::Compact)
            .unwrap();
        let all = Checks {
            num_experts: Some(8),
            duplicates: true,
            zero_rows: true,
            missing_rows: true,
        };
        let r = report(&p, &all);
        assert_eq!(r.out_of_range, 1);
        assert_eq!(r.first_out_of_range, Some((12, 1, 9)));
        // (12, 0); the zero layers of position 11 have no router, and its row is a zero row.
        assert_eq!(r.duplicates, 1);
        assert_eq!(r.first_duplicate, Some((12, 0, 5)));
        assert_eq!((r.zero_rows, r.first_zero_row), (1, Some(11)));
        assert!(validate(&p, &Checks::default()).is_ok());
    }

    #[test]
    fn missing_rows_are_reported_not_called_out_of_range() {
        let values = [1, 2, 3, 4, -1, -1, -1, -1, 5, -1, 3, 4];
        let p = Payload::from_values(&values[..], Shape::new(3, 2, 2), 10, DTypeChoice::Compact)
            .unwrap();
        let checks = Checks::default();
        let r = report(&p, &checks);
        assert_eq!((r.missing_rows, r.first_missing_row), (1, Some(11)));
        // A -1 in a row that is not all -1 is an id out of range.
        assert_eq!(
            (r.out_of_range, r.first_out_of_range),
            (1, Some((12, 0, -1)))
        );
        let clean =
            Payload::from_values(&values[..8], Shape::new(2, 2, 2), 0, DTypeChoice::Compact)
                .unwrap();
        assert!(validate(&clean, &checks).is_ok());
        let strict = Checks {
            missing_rows: true,
            ..checks
        };
        let e = validate(&clean, &strict).unwrap_err().to_string();
        assert!(e.contains("marked missing (all -1) at position 1"), "{e}");
        // Unsigned dtypes have no sentinel: 255 is an expert.
        let u8s = Payload::from_values(
            &[255i64, 255][..],
            Shape::new(1, 1, 2),
            0,
            DTypeChoice::Compact,
        )
        .unwrap();
        assert_eq!(report(&u8s, &checks).missing_rows, 0);
    }
}
