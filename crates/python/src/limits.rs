//! The Python API's cap on decoded bytes (`set_max_bytes`): the core takes it as a value on
//! every call; this is where Python's process-wide setting lives.

use std::sync::atomic::{AtomicUsize, Ordering};

use pyo3::prelude::*;

static MAX_BYTES: AtomicUsize = AtomicUsize::new(routed_experts::DEFAULT_MAX_BYTES);

/// The cap every call without `max_bytes=` decodes under.
pub fn max_bytes() -> usize {
    MAX_BYTES.load(Ordering::Relaxed)
}

/// Cap on the decoded size of one payload, in bytes (default 1 GiB); larger payloads are
/// refused before anything is allocated.
#[pyfunction]
pub fn set_max_bytes(#[pyo3(from_py_with = crate::convert::arg::n)] n: usize) {
    MAX_BYTES.store(n, Ordering::Relaxed);
}

/// The current cap on decoded bytes (see `set_max_bytes`).
#[pyfunction]
pub fn get_max_bytes() -> usize {
    max_bytes()
}
