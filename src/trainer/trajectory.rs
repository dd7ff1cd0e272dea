//! Multi-turn stitching (format.md §5): payloads of successive turns accumulated by absolute position,
//! and the handoff to the trainer (alignment to the sample's token count).

use crate::error::{Error, ErrorKind, Result};
use crate::kernels::buffer::AlignedBytes;
use crate::payload::dtype::with_element;
use crate::payload::dtype::DType;
use crate::payload::merge::check_same_rows;
use crate::payload::{Payload, Shape};

/// What to do with rows the trajectory already holds when a payload covers them again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overlap {
    /// Keep the held rows: the routing used when those tokens were sampled (default).
    Keep,
    /// Take the new payload's rows.
    Replace,
    /// Require equal rows; a difference is a MergeError.
    Check,
}

impl Overlap {
    /// The policy of a name: `"keep"`, `"replace"` or `"check"`.
    pub fn parse(name: &str) -> Result<Overlap> {
        match name {
            "keep" => Ok(Overlap::Keep),
            "replace" => Ok(Overlap::Replace),
            "check" => Ok(Overlap::Check),
            other => Err(Error::field(
                "overlap",
                "\"keep\", \"replace\" or \"check\"",
                format!("{other:?}"),
            )),
        }
    }
}

/// How `to_training` fills rows the trajectory lacks at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pad {
    /// Repeat the last row (default).
    Repeat,
    /// Zero rows.
    Zero,
}

impl Pad {
    /// The padding of a name: `"repeat"` or `"zero"`.
    pub fn parse(name: &str) -> Result<Pad> {
        match name {
            "repeat" => Ok(Pad::Repeat),
            "zero" => Ok(Pad::Zero),
            other => Err(Error::field(
                "pad",
                "\"repeat\" or \"zero\"",
                format!("{other:?}"),
            )),
        }
    }
}

/// The contiguous routing of one rollout so far. Rows live in one buffer that grows
/// geometrically, so a 100-turn rollout costs about one copy of its rows.
#[derive(Clone, Debug, Default)]
pub struct Trajectory {
    rows: Option<Payload>,
}

impl Trajectory {
    /// An empty trajectory.
    pub fn new() -> Self {
        Trajectory { rows: None }
    }

    /// A trajectory holding exactly `p`'s rows (how a pickled one is rebuilt).
    pub fn from_payload(p: Payload) -> Self {
        Trajectory { rows: Some(p) }
    }

    /// Position of the first row (`None` while empty).
    pub fn start(&self) -> Option<u64> {
        self.rows.as_ref().map(Payload::start)
    }

    /// Position after the last row (`None` while empty).
    pub fn stop(&self) -> Option<u64> {
        self.rows.as_ref().map(Payload::stop)
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.rows.as_ref().map_or(0, Payload::num_tokens)
    }

    /// Whether no rows are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type rows are held in (`None` while empty).
    pub fn dtype(&self) -> Option<DType> {
        self.rows.as_ref().map(Payload::dtype)
    }

    /// The rows held so far (`None` before the first append).
    pub fn payload(&self) -> Option<&Payload> {
        self.rows.as_ref()
    }

    /// Add a turn's payload by absolute position; the grown trajectory must fit `max_bytes`.
    /// Nothing changes when it fails.
    pub fn append(&mut self, p: &Payload, overlap: Overlap, max_bytes: usize) -> Result<()> {
        let Some(held) = self.rows.as_mut() else {
            self.rows = Some(p.clone());
            return Ok(());
        };
        check_same_rows(held.shape(), p.shape(), "the trajectory", "the payload")?;
        if p.start() < held.start() {
            return Err(Error::inconsistent(format!(
                "payload starts at position {} before the trajectory's start {}",
                p.start(),
                held.start()
            )));
        }
        if p.start() > held.stop() {
            let kind = ErrorKind::Gap {
                stop: held.stop(),
                start: p.start(),
            };
            return Err(Error::new(kind, format!(
                "gap: the trajectory covers positions [{}, {}) but the payload starts at {}, so rows [{}, {}) are missing",
                held.start(),
                held.stop(),
                p.start(),
                held.stop(),
                p.start()
            )));
        }
        // The grown trajectory is held to the size limit too, checked before anything changes.
        let dtype = DType::promote(held.dtype(), p.dtype());
        let grown = Shape {
            tokens: (p.stop().max(held.stop()) - held.start()) as usize,
            ..held.shape()
        };
        crate::limits::check_shape(grown, dtype, max_bytes)
            .map_err(|e| e.context("the trajectory would grow past the size limit"))?;
        // Overlapping positions [p.start, overlap_end); new ones [overlap_end, p.stop).
        let overlap_end = p.stop().min(held.stop());
        let (p_from, p_mid) = (0, (overlap_end - p.start()) as usize);
        let held_from = (p.start() - held.start()) as usize;
        if overlap == Overlap::Check {
            first_difference(held, held_from, p, p_from, p_mid)?;
        }
        if dtype != held.dtype() {
            *held = held.astype(dtype)?;
        }
        if overlap == Overlap::Replace && p_mid > 0 {
            let row = held.num_layers() * held.top_k();
            with_element!(dtype, D => {
                let dst = &mut held.values_mut::<D>()[held_from * row..(held_from + p_mid) * row];
                p.write_rows_as::<D>(p_from, p_mid, dst)?;
            });
        }
        held.append_rows(p, p_mid, p.num_tokens())
    }

    /// Drop every row at position `stop` and after (for rollouts that branch).
    pub fn truncate(&mut self, stop: u64) -> Result<()> {
        let Some(held) = self.rows.as_mut() else {
            return Err(Error::inconsistent("cannot truncate an empty trajectory"));
        };
        if stop < held.start() || stop > held.stop() {
            return Err(Error::inconsistent(format!(
                "truncate at {stop} is outside the trajectory's positions [{}, {}]",
                held.start(),
                held.stop()
            )));
        }
        held.truncate_rows((stop - held.start()) as usize);
        Ok(())
    }

    /// Rows aligned to a training sample of `num_tokens` tokens: truncated, or padded at the end
    /// by at most `max_missing` rows. The trajectory must start at position 0. The aligned shape
    /// is held to `max_bytes` before anything is allocated.
    pub fn to_training(
        &self,
        num_tokens: usize,
        pad: Pad,
        max_missing: usize,
        max_bytes: usize,
    ) -> Result<Payload> {
        let Some(held) = self.rows.as_ref() else {
            return Err(Error::inconsistent(
                "the trajectory is empty: nothing to train on",
            ));
        };
        if held.start() != 0 {
            return Err(Error::inconsistent(format!(
                "the trajectory starts at position {}: training needs rows from position 0",
                held.start()
            )));
        }
        let have = held.num_tokens();
        let shape = Shape {
            tokens: num_tokens,
            ..held.shape()
        };
        crate::limits::check_shape(shape, held.dtype(), max_bytes)
            .map_err(|e| e.context(format!("num_tokens={num_tokens}")))?;
        if num_tokens <= have {
            return held.slice(0, num_tokens as u64);
        }
        let missing = num_tokens - have;
        if missing > max_missing {
            return Err(Error::inconsistent(format!(
                "the sample has {num_tokens} tokens but the trajectory only {have} rows: {missing} missing, \
                 more than max_missing={max_missing}"
            )));
        }
        if pad == Pad::Repeat && have == 0 {
            return Err(Error::inconsistent(
                "cannot repeat the last row of a trajectory with no rows",
            ));
        }
        let row = held.row_bytes();
        let mut data = AlignedBytes::with_capacity(shape.nbytes(held.dtype())?);
        data.extend_from_slice(held.bytes());
        for _ in 0..missing {
            match pad {
                Pad::Repeat => data.extend_from_slice(held.rows(have - 1, have)),
                Pad::Zero => data.grow(row).fill(0),
            }
        }
        Payload::new(0, shape, held.dtype(), data)
    }
}

/// MergeError at the first differing value of the overlapping rows.
fn first_difference(
    held: &Payload,
    held_from: usize,
    p: &Payload,
    p_from: usize,
    rows: usize,
) -> Result<()> {
    let row = held.num_layers() * held.top_k();
    for i in 0..rows * row {
        let (a, b) = (
            held.value_at(held_from * row + i),
            p.value_at(p_from * row + i),
        );
        if a != b {
            let (pos, layer) = held.locate(held_from * row + i);
            return Err(Error::new(
                ErrorKind::Overlap {
                    position: pos,
                    layer,
                },
                format!(
                    "overlap check failed: position {pos}, layer {layer} holds {a} but the new \
                     payload has {b}"
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::DEFAULT_MAX_BYTES as LIMIT;
    use crate::payload::DTypeChoice;

    fn rows(start: u64, values: &[i64]) -> Payload {
        Payload::from_values(
            values,
            Shape::new(values.len(), 1, 1),
            start,
            DTypeChoice::Compact,
        )
        .unwrap()
    }

    #[test]
    fn stitches_deltas_and_keeps_held_rows() {
        let mut t = Trajectory::new();
        t.append(&rows(0, &[1, 2, 3]), Overlap::Keep, LIMIT)
            .unwrap();
        t.append(&rows(2, &[9, 4, 5]), Overlap::Keep, LIMIT)
            .unwrap();
        assert_eq!(t.payload().unwrap(), &rows(0, &[1, 2, 3, 4, 5]));
        t.append(&rows(0, &[7, 7]), Overlap::Replace, LIMIT)
            .unwrap();
        assert_eq!(t.payload().unwrap(), &rows(0, &[7, 7, 3, 4, 5]));
        let err = t
            .append(&rows(1, &[7, 0]), Overlap::Check, LIMIT)
            .unwrap_err();
        assert!(
            err.to_string().contains("position 2, layer 0 holds 3"),
            "{err}"
        );
        assert!(t
            .append(&rows(7, &[1]), Overlap::Keep, LIMIT)
            .unwrap_err()
            .to_string()
            .contains("[5, 7)"));
        assert_eq!(t.len(), 5);
    }

    #[test]
    fn training_alignment() {
        let mut t = Trajectory::new();
        t.append(&rows(0, &[1, 2, 3]), Overlap::Keep, LIMIT)
            .unwrap();
        assert_eq!(
            t.to_training(4, Pad::Repeat, 1, LIMIT).unwrap(),
            rows(0, &[1, 2, 3, 3])
        );
        assert_eq!(
            t.to_training(4, Pad::Zero, 1, LIMIT).unwrap(),
            rows(0, &[1, 2, 3, 0])
        );
        assert_eq!(
            t.to_training(2, Pad::Repeat, 1, LIMIT).unwrap(),
            rows(0, &[1, 2])
        );
        assert!(t.to_training(5, Pad::Repeat, 1, LIMIT).is_err());
        t.truncate(1).unwrap();
        assert_eq!(t.payload().unwrap(), &rows(0, &[1]));
    }
}
