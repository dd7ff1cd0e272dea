//! `Trajectory`: the orchestrator's accumulator of a multi-turn rollout's routing.

use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;

use crate::errors::PyResult;

use pyo3::types::PyTuple;

use super::payload::{new_numpy, payload_arg, RoutedExperts};
use routed_experts::trajectory::{Overlap, Pad, Trajectory as Core};

/// The routing of one rollout, turn after turn, by absolute position.
///
/// `append` takes each turn's payload: it must start inside or right at the end of what is held
/// (a gap raises MergeError); rows held already are resolved by `overlap`: "keep" (default: the
/// routing used when those tokens were sampled), "replace", or "check" (must be equal). Dtypes
/// are promoted, never truncated. Rows grow in one buffer (amortised), not one copy per turn.
///
/// Safe to share between threads: appends serialize, and every read sees the trajectory
/// between two appends, never during one.
#[pyclass(frozen, module = "routed_experts._core", name = "Trajectory")]
#[derive(Default)]
pub struct Trajectory {
    // Frozen, so pyo3 never raises a borrow error; the lock serializes instead. It is taken only
    // with the GIL released (`locked`), so a thread holding it never waits for the GIL while
    // another holds the GIL and waits for it.
    inner: Mutex<Core>,
}

impl Trajectory {
    /// Run `f` on the trajectory with the GIL released and the lock held.
    fn locked<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut Core) -> R + Send) -> R {
        py.detach(|| f(&mut lock(&self.inner)))
    }
}

/// The lock, even after a panic elsewhere poisoned it: every mutation of the core either
/// completes or leaves the trajectory unchanged, so the state behind a poisoned lock is whole.
fn lock(m: &Mutex<Core>) -> MutexGuard<'_, Core> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[pymethods]
impl Trajectory {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// Add a turn's payload (a RoutedExperts or a compact sidecar), or the routing of an OpenAI
    /// SDK response object (its choice 0, read as `from_response` reads it).
    #[pyo3(signature = (payload, overlap = Overlap::Keep), text_signature = "($self, payload, overlap='keep')")]
    fn append(
        &self,
        py: Python<'_>,
        payload: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = crate::convert::word::overlap)] overlap: Overlap,
    ) -> PyResult<()> {
        let limit = crate::limits::max_bytes();
        if let Ok(p) = payload.cast::<RoutedExperts>() {
            let p = &p.get().inner;
            return Ok(self.locked(py, |t| t.append(p, overlap, limit))?);
        }
        if let Some(body) = crate::convert::model_json(payload, "payload")? {
            let hints = routed_experts::formats::Hints::default();
            let read =
                py.detach(|| routed_experts::response::from_response(&body, 0, &hints, limit))?;
            let p = read.ok_or_else(|| {
                routed_experts::Error::field(
                    "payload",
                    "a response with routing",
                    "a response without any",
                )
            })?;
            return Ok(self.locked(py, |t| t.append(&p, overlap, limit))?);
        }
        let p = payload_arg(payload, "payload")?;
        Ok(self.locked(py, |t| t.append(&p, overlap, limit))?)
    }

    /// Position of the first row (None while empty).
    #[getter]
    fn start(&self, py: Python<'_>) -> Option<u64> {
        self.locked(py, |t| t.start())
    }

    /// Position after the last row (None while empty).
    #[getter]
    fn stop(&self, py: Python<'_>) -> Option<u64> {
        self.locked(py, |t| t.stop())
    }

    /// The `numpy.dtype` the rows are held in (None while empty).
    #[getter]
    fn dtype<'py>(&self, py: Python<'py>) -> Option<Bound<'py, numpy::PyArrayDescr>> {
        self.locked(py, |t| t.dtype())
            .map(|d| crate::numpy_out::numpy_dtype(py, d))
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.locked(py, |t| t.len())
    }

    /// The rows held so far as one payload (a copy: the trajectory may keep growing).
    #[getter]
    fn payload(&self, py: Python<'_>) -> Option<RoutedExperts> {
        self.locked(py, |t| t.payload().cloned())
            .map(RoutedExperts::new)
    }

    /// Drop every row at position `stop` and after.
    fn truncate(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::convert::arg::stop)] stop: u64,
    ) -> PyResult<()> {
        Ok(self.locked(py, |t| t.truncate(stop))?)
    }

    /// An independent copy, for rollouts that branch.
    fn copy(&self, py: Python<'_>) -> Self {
        Trajectory {
            inner: Mutex::new(self.locked(py, |t| t.clone())),
        }
    }

    fn __copy__(&self, py: Python<'_>) -> Self {
        self.copy(py)
    }

    /// Pickle (multiprocessing, Ray): rebuilt from its payload, which pickles out of band
    /// under protocol 5.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let payload = slf.get().payload(py);
        let rebuild = py
            .import("routed_experts._core")?
            .getattr("_trajectory_from_payload")?;
        Ok(PyTuple::new(
            py,
            [
                rebuild,
                PyTuple::new(py, [payload.into_pyobject(py)?.into_any()])?.into_any(),
            ],
        )?)
    }

    /// Rows aligned to a training sample of `num_tokens` tokens, as a writable numpy array:
    /// truncated, or padded at the end ("repeat" the last row, or "zero") by at most
    /// `max_missing` rows. The trajectory must start at position 0.
    ///
    /// In `dtype`: the payload's by default (as the golden vectors of format.md pin it); ask for
    /// "int32" or "int64" before `torch.from_numpy` (torch reads a uint8 tensor as a mask).
    ///
    /// With `mask=True`, returns `(array, mask)`: `mask` is a bool array of `num_tokens`, True
    /// where the row carries real routing; padded rows and rows marked missing (all -1) are
    /// False.
    #[pyo3(signature = (num_tokens, pad = Pad::Repeat, max_missing = 1, *, mask = false, dtype = None), text_signature = "($self, num_tokens, pad='repeat', max_missing=1, *, mask=False, dtype=None)")]
    fn to_training<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = crate::convert::arg::num_tokens)] num_tokens: usize,
        #[pyo3(from_py_with = crate::convert::word::pad)] pad: Pad,
        #[pyo3(from_py_with = crate::convert::arg::max_missing)] max_missing: usize,
        #[pyo3(from_py_with = crate::convert::flag::mask)] mask: bool,
        #[pyo3(from_py_with = crate::convert::opt_typed::dtype)] dtype: Option<
            routed_experts::DType,
        >,
    ) -> PyResult<Bound<'py, PyAny>> {
        let limit = crate::limits::max_bytes();
        let (aligned, real) = self.locked(py, |t| {
            let real = t.len().min(num_tokens);
            t.to_training(num_tokens, pad, max_missing, limit)
                .map(|a| (a, real))
        })?;
        let dtype = dtype.unwrap_or(aligned.dtype());
        let array = new_numpy(py, &aligned, dtype)?;
        if !mask {
            return Ok(array);
        }
        let routed = py.detach(|| routed_experts::validate::routed_mask(&aligned, real));
        let routed = numpy::PyArray1::from_vec(py, routed);
        Ok(PyTuple::new(py, [array, routed.into_any()])?.into_any())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let (start, stop, dtype) = self.locked(py, |t| (t.start(), t.stop(), t.dtype()));
        match (start, stop, dtype) {
            (Some(a), Some(b), Some(d)) => format!("Trajectory(start={a}, stop={b}, dtype='{d}')"),
            _ => "Trajectory(empty)".to_string(),
        }
    }
}

/// Pickle's constructor for `Trajectory`: one holding `payload` (empty for None).
#[pyfunction]
pub fn _trajectory_from_payload(payload: Option<&Bound<'_, RoutedExperts>>) -> Trajectory {
    let mut core = Core::new();
    if let Some(p) = payload {
        core = Core::from_payload(p.get().inner.clone());
    }
    Trajectory {
        inner: Mutex::new(core),
    }
}
