//! `Trajectory`: the orchestrator's accumulator of a multi-turn rollout's routing.

use pyo3::prelude::*;

use super::functions::payload_arg;
use super::payload::{new_numpy, RoutedExperts};
use crate::trajectory::{Overlap, Pad, Trajectory as Core};

/// The routing of one rollout, turn after turn, by absolute position.
///
/// `append` takes each turn's payload: it must start inside or right at the end of what is held
/// (a gap raises MergeError); rows held already are resolved by `overlap`: "keep" (default: the
/// routing used when those tokens were sampled), "replace", or "check" (must be equal). Dtypes
/// are promoted, never truncated. Rows grow in one buffer (amortised), not one copy per turn.
#[pyclass(module = "routed_experts._core", name = "Trajectory")]
#[derive(Default)]
pub struct Trajectory {
    inner: Core,
}

#[pymethods]
impl Trajectory {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// Add a turn's payload (a RoutedExperts or a compact sidecar).
    #[pyo3(signature = (payload, overlap = "keep"))]
    fn append(
        &mut self,
        py: Python<'_>,
        payload: &Bound<'_, PyAny>,
        overlap: &str,
    ) -> PyResult<()> {
        let overlap = Overlap::parse(overlap)?;
        let inner = &mut self.inner;
        if let Ok(p) = payload.cast::<RoutedExperts>() {
            let p = &p.get().inner;
            return Ok(py.detach(|| inner.append(p, overlap))?);
        }
        let p = payload_arg(payload)?;
        Ok(py.detach(|| inner.append(&p, overlap))?)
    }

    /// Position of the first row (None while empty).
    #[getter]
    fn start(&self) -> Option<u64> {
        self.inner.start()
    }

    /// Position after the last row (None while empty).
    #[getter]
    fn stop(&self) -> Option<u64> {
        self.inner.stop()
    }

    /// The dtype the rows are held in (None while empty).
    #[getter]
    fn dtype(&self) -> Option<&'static str> {
        self.inner.dtype().map(|d| d.name())
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// The rows held so far as one payload (a copy: the trajectory may keep growing).
    #[getter]
    fn payload(&self) -> Option<RoutedExperts> {
        self.inner.payload().cloned().map(RoutedExperts::new)
    }

    /// Drop every row at position `stop` and after.
    fn truncate(&mut self, stop: u64) -> PyResult<()> {
        Ok(self.inner.truncate(stop)?)
    }

    /// An independent copy, for rollouts that branch.
    fn copy(&self) -> Self {
        Trajectory {
            inner: self.inner.clone(),
        }
    }

    fn __copy__(&self) -> Self {
        self.copy()
    }

    /// Rows aligned to a training sample of `num_tokens` tokens, as a writable numpy array:
    /// truncated, or padded at the end ("repeat" the last row, or "zero") by at most
    /// `max_missing` rows. The trajectory must start at position 0.
    #[pyo3(signature = (num_tokens, pad = "repeat", max_missing = 1))]
    fn to_training<'py>(
        &self,
        py: Python<'py>,
        num_tokens: usize,
        pad: &str,
        max_missing: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let pad = Pad::parse(pad)?;
        let inner = &self.inner;
        let aligned = py.detach(|| inner.to_training(num_tokens, pad, max_missing))?;
        new_numpy(py, &aligned, aligned.dtype())
    }

    fn __repr__(&self) -> String {
        match (self.inner.start(), self.inner.stop(), self.inner.dtype()) {
            (Some(a), Some(b), Some(d)) => format!("Trajectory(start={a}, stop={b}, dtype='{d}')"),
            _ => "Trajectory(empty)".to_string(),
        }
    }
}
