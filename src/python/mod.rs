//! The PyO3 binding layer: conversions between Python objects and the core, nothing more.

pub mod convert;
pub mod functions;
pub mod payload;
pub mod trajectory;

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::PyErr;

create_exception!(
    routed_experts,
    RoutedExpertsError,
    PyValueError,
    "Base of every error routed_experts raises on bad input."
);
create_exception!(
    routed_experts,
    PayloadError,
    RoutedExpertsError,
    "Malformed input: bad JSON, bad base64, a shape that does not match the data, a value that does not fit."
);
create_exception!(
    routed_experts,
    MergeError,
    RoutedExpertsError,
    "Inconsistent halves or turns: a gap, mismatched layers or top_k, conflicting overlap."
);

impl From<crate::Error> for PyErr {
    fn from(e: crate::Error) -> PyErr {
        match e {
            crate::Error::Payload(m) => PayloadError::new_err(m),
            crate::Error::Merge(m) => MergeError::new_err(m),
        }
    }
}
