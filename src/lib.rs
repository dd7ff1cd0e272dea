//! routed_experts: parse, merge, stitch and encode MoE routed-experts payloads.
//!
//! The core modules are pure Rust (no pyo3), used by `cargo test` and criterion directly.
//! This file also holds the Python module definition; the classes it registers live in
//! `python/`, compiled only with the `python` feature that maturin enables.

// `with_element!` instantiates generic code for every dtype; in the int64 arm `.into()` to i64
// is the identity, which is what the generic code means.
#![allow(clippy::useless_conversion)]

pub mod b64;
pub mod buffer;
pub mod dtype;
pub mod error;
pub mod formats;
pub mod jsonscan;
pub mod limits;
pub mod merge;
pub mod npy;
pub mod pack;
pub mod payload;
pub mod response;
pub mod sidecar;
pub mod strscan;
pub mod trajectory;
pub mod validate;

pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use payload::{DTypeChoice, Payload, Shape};

#[cfg(feature = "python")]
mod python;

#[cfg(feature = "python")]
#[pyo3::pymodule]
mod _core {
    use pyo3::prelude::*;

    #[pymodule_export]
    use crate::python::functions::{
        decode, detect_format, encode, from_response, merge, merge_response, pack,
    };
    #[pymodule_export]
    use crate::python::payload::{_from_raw, RoutedExperts};
    #[pymodule_export]
    use crate::python::trajectory::{_trajectory_from_payload, Trajectory};
    #[pymodule_export]
    use crate::python::{MergeError, PayloadError, RoutedExpertsError};

    /// Cap on the decoded size of one payload, in bytes (default 1 GiB); larger payloads are
    /// refused before anything is allocated.
    #[pyfunction]
    fn set_max_bytes(n: usize) {
        crate::limits::set_max_bytes(n)
    }

    /// The current cap on decoded bytes (see `set_max_bytes`).
    #[pyfunction]
    fn get_max_bytes() -> usize {
        crate::limits::max_bytes()
    }
}
