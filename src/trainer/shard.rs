//! One rank's share of a packed batch (format.md §6.1): the rows context parallelism gives a
//! rank (zigzag, as TransformerEngine splits packed sequences, or contiguous), then the part of
//! those a tensor-parallel rank routes under sequence parallelism, then the layers of a pipeline
//! stage. The plan is computed from `cu_seqlens` alone; the copy reads only the rank's rows.

use std::ops::Range;

use crate::error::{Error, ErrorKind, Result};

/// How context parallelism cuts each sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpSplit {
    /// 2 x cp_size chunks; rank r takes chunks r and 2 x cp_size - 1 - r (load-balanced for
    /// causal attention). Sample lengths must be multiples of 2 x cp_size.
    Zigzag,
    /// cp_size chunks; rank r takes chunk r. Sample lengths must be multiples of cp_size.
    Contiguous,
}

impl CpSplit {
    /// `"zigzag"` or `"contiguous"`.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "zigzag" => Ok(CpSplit::Zigzag),
            "contiguous" => Ok(CpSplit::Contiguous),
            other => Err(Error::field(
                "cp_split",
                "\"zigzag\" or \"contiguous\"",
                format!("{other:?}"),
            )),
        }
    }
}

/// Which rank's share to take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rank {
    /// Context-parallel group size.
    pub cp_size: usize,
    /// This rank's place in its context-parallel group.
    pub cp_rank: usize,
    /// How context parallelism cuts each sample.
    pub cp_split: CpSplit,
    /// Tensor-parallel group size (sequence parallelism splits the rows this many ways).
    pub tp_size: usize,
    /// This rank's place in its tensor-parallel group.
    pub tp_rank: usize,
    /// The layers of this pipeline stage (`start..stop`); `None`: all.
    pub layers: Option<(usize, usize)>,
}

impl Default for Rank {
    fn default() -> Self {
        Rank {
            cp_size: 1,
            cp_rank: 0,
            cp_split: CpSplit::Zigzag,
            tp_size: 1,
            tp_rank: 0,
            layers: None,
        }
    }
}

/// A rank's share: the batch's rows it takes, in order, its `cu_seqlens` (those of the context-
/// parallel rank: attention sees the sequence the tensor-parallel group gathers), and its
/// layers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The batch's rows the rank takes, in order (adjacent runs joined).
    pub rows: Vec<Range<usize>>,
    /// `[0, m0, m0+m1, ...]`: each sample's rows on the context-parallel rank (n / cp_size).
    pub cu_seqlens: Vec<usize>,
    /// The layers kept.
    pub layers: Range<usize>,
}

impl Plan {
    /// Rows in the share.
    pub fn num_rows(&self) -> usize {
        self.rows.iter().map(|r| r.len()).sum()
    }
}

fn rank_arg(name: &str, size: usize, rank: usize, size_name: &str) -> Result<()> {
    if size == 0 {
        return Err(Error::field(size_name, "a positive integer", 0));
    }
    if rank >= size {
        return Err(Error::field(
            name,
            format!("0 to {} ({size_name}={size})", size - 1),
            rank,
        ));
    }
    Ok(())
}

/// The share of `rank` in a batch of `num_rows` rows and `num_layers` layers whose samples
/// `cu_seqlens` delimits (`[0, n0, n0+n1, ...]`; rows past its last entry, such as `pack`'s
/// `pad_to_multiple` padding, belong to no sample and are left out).
pub fn plan(cu_seqlens: &[usize], num_rows: usize, num_layers: usize, rank: &Rank) -> Result<Plan> {
    rank_arg("cp_rank", rank.cp_size, rank.cp_rank, "cp_size")?;
    rank_arg("tp_rank", rank.tp_size, rank.tp_rank, "tp_size")?;
    let layers = match rank.layers {
        None => 0..num_layers,
        Some((start, stop)) if start < stop && stop <= num_layers => start..stop,
        Some((start, stop)) => {
            return Err(Error::field(
                "layers",
                format!("(start, stop) with 0 <= start < stop <= {num_layers}"),
                format!("({start}, {stop})"),
            ))
        }
    };
    match cu_seqlens {
        [0, ..] => {}
        [] => return Err(Error::field("cu_seqlens", "at least [0]", "an empty array")),
        [first, ..] => return Err(Error::field("cu_seqlens", "a first entry of 0", *first)),
    }
    let last = *cu_seqlens.last().unwrap_or(&0);
    if last > num_rows {
        return Err(Error::field(
            "cu_seqlens",
            format!("entries up to the batch's {num_rows} rows"),
            last,
        ));
    }
    let (cp, r) = (rank.cp_size, rank.cp_rank);
    // Without context parallelism a sample stays whole, whatever the split is called.
    let split = if cp == 1 {
        CpSplit::Contiguous
    } else {
        rank.cp_split
    };
    let chunks = match split {
        CpSplit::Zigzag => cp
            .checked_mul(2)
            .ok_or_else(|| Error::field("cp_size", "a size whose double fits in usize", cp))?,
        CpSplit::Contiguous => cp,
    };
    let mut cp_rows = Vec::with_capacity(2 * cu_seqlens.len());
    let mut cu = Vec::with_capacity(cu_seqlens.len());
    cu.push(0usize);
    for (i, w) in cu_seqlens.windows(2).enumerate() {
        let (start, end) = (w[0], w[1]);
        if end < start {
            return Err(Error::field(
                "cu_seqlens",
                "non-decreasing entries",
                format!("{end} after {start} (sample {i})"),
            ));
        }
        let n = end - start;
        if n % chunks != 0 {
            let rule = match split {
                CpSplit::Zigzag => format!("2 x cp_size = {chunks}"),
                CpSplit::Contiguous => format!("cp_size = {chunks}"),
            };
            return Err(unpadded(
                n,
                chunks,
                format!(
                    "sample {i} has {n} rows, not a multiple of {rule} (pad each sample to a \
                     multiple of {chunks} rows before packing)"
                ),
            ));
        }
        let c = n / chunks;
        if c > 0 {
            cp_rows.push(start + r * c..start + (r + 1) * c);
            if split == CpSplit::Zigzag {
                let j = 2 * cp - 1 - r;
                cp_rows.push(start + j * c..start + (j + 1) * c);
            }
        }
        cu.push(cu[cu.len() - 1] + n / cp);
    }
    // Sequence parallelism: the context-parallel rank's rows, end to end, in tp_size parts.
    let total = cu[cu.len() - 1];
    let tp = rank.tp_size;
    if total % tp != 0 {
        return Err(unpadded(
            total,
            tp,
            format!(
                "the rank's {total} rows (after cp_size={cp}) are not a multiple of \
                 tp_size={tp} (pad the batch so that every context-parallel rank's rows split \
                 evenly)"
            ),
        ));
    }
    let part = total / tp;
    let (from, to) = (rank.tp_rank * part, (rank.tp_rank + 1) * part);
    let mut rows: Vec<Range<usize>> = Vec::with_capacity(cp_rows.len());
    let mut at = 0usize; // position of the current run in the rank's rows
    for run in cp_rows {
        let (lo, hi) = (at, at + run.len());
        at = hi;
        let (a, b) = (lo.max(from), hi.min(to));
        if a < b {
            let take = run.start + (a - lo)..run.start + (b - lo);
            match rows.last_mut() {
                Some(prev) if prev.end == take.start => prev.end = take.end,
                _ => rows.push(take),
            }
        }
    }
    Ok(Plan {
        rows,
        cu_seqlens: cu,
        layers,
    })
}

/// [`ErrorKind::Unpadded`]: `rows` that are not a multiple of `multiple`.
fn unpadded(rows: usize, multiple: usize, message: String) -> Error {
    let kind = ErrorKind::Unpadded {
        rows: rows as u64,
        multiple: multiple as u64,
    };
    Error::new(kind, message)
}

/// Copy the share into `dst` (the plan's rows x its layers x `top_k`) from `src` (the batch:
/// rows x `num_layers` x `top_k`, row-major).
///
/// # Panics
///
/// When `src` or `dst` is shorter than the plan says (as `copy_from_slice` does): size them
/// from the plan and the batch it was made for.
pub fn gather<T: Copy>(src: &[T], num_layers: usize, top_k: usize, plan: &Plan, dst: &mut [T]) {
    let row = num_layers * top_k;
    if plan.layers == (0..num_layers) {
        // Whole rows: one copy a run.
        let mut at = 0;
        for run in &plan.rows {
            let n = run.len() * row;
            dst[at..at + n].copy_from_slice(&src[run.start * row..run.end * row]);
            at += n;
        }
        return;
    }
    let (from, to) = (plan.layers.start * top_k, plan.layers.end * top_k);
    let mut out = dst.chunks_exact_mut(to - from);
    for run in &plan.rows {
        for r in run.clone() {
            if let Some(d) = out.next() {
                d.copy_from_slice(&src[r * row + from..r * row + to]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(p: &Plan) -> Vec<usize> {
        p.rows.iter().flat_map(|r| r.clone()).collect()
    }

    #[test]
    fn zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r() {
        // Two samples of 8 and 4 rows, cp 2: chunks of 2 and 1 rows.
        let cu = [0, 8, 12];
        let spec = |r| Rank {
            cp_size: 2,
            cp_rank: r,
            ..Rank::default()
        };
        let p0 = plan(&cu, 12, 3, &spec(0)).unwrap();
        assert_eq!(rows(&p0), [0, 1, 6, 7, 8, 11]);
        assert_eq!(p0.cu_seqlens, [0, 4, 6]);
        let p1 = plan(&cu, 12, 3, &spec(1)).unwrap();
        assert_eq!(rows(&p1), [2, 3, 4, 5, 9, 10]);
        assert_eq!(p1.layers, 0..3);
    }

    #[test]
    fn contiguous_sequence_parallel_and_layers_combine() {
        let cu = [0, 6, 10];
        let spec = Rank {
            cp_size: 2,
            cp_rank: 1,
            cp_split: CpSplit::Contiguous,
            tp_size: 5,
            tp_rank: 2,
            layers: Some((1, 3)),
        };
        // cp rank 1: rows 3..6 and 8..10 (5 rows); tp part 2 of 5: the third of them.
        let p = plan(&cu, 10, 4, &spec).unwrap();
        assert_eq!(rows(&p), [5]);
        assert_eq!(p.cu_seqlens, [0, 3, 5]);
        let src: Vec<u16> = (0..10 * 4 * 2).collect();
        let mut dst = vec![0u16; p.num_rows() * 2 * 2];
        gather(&src, 4, 2, &p, &mut dst);
        assert_eq!(dst, [42, 43, 44, 45]); // row 5, layers 1 and 2
    }

    #[test]
    fn bad_shapes_and_arguments_name_what_is_wrong() {
        let err = |cu: &[usize], rank: Rank| plan(cu, 12, 2, &rank).unwrap_err().to_string();
        let cp = |n| Rank {
            cp_size: n,
            ..Rank::default()
        };
        assert!(
            err(&[0, 6], cp(2)).contains("sample 0 has 6 rows, not a multiple of 2 x cp_size = 4")
        );
        assert!(err(
            &[0, 4],
            Rank {
                cp_rank: 2,
                ..cp(2)
            }
        )
        .contains("cp_rank"));
        assert!(err(&[0, 4], cp(0)).contains("cp_size"));
        assert!(err(&[0, 13], cp(1)).contains("cu_seqlens"));
        assert!(err(&[1, 4], cp(1)).contains("first entry of 0"));
        assert!(err(&[0, 4, 2], cp(1)).contains("non-decreasing"));
        assert!(err(
            &[0, 3],
            Rank {
                tp_size: 2,
                ..cp(1)
            }
        )
        .contains("tp_size=2"));
        assert!(err(
            &[0, 4],
            Rank {
                layers: Some((1, 1)),
                ..cp(1)
            }
        )
        .contains("layers"));
        assert!(err(
            &[0, 4],
            Rank {
                cp_size: usize::MAX,
                ..cp(1)
            }
        )
        .contains("cp_size"));
    }
}
