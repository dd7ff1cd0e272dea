//! One exception family for Python (`RoutedExpertsError`, with `PayloadError` and `MergeError`
//! beneath it), and the error every binding function returns: a Python exception, or a core
//! error that becomes one of ours.

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

create_exception!(
    routed_experts,
    ConfigError,
    RoutedExpertsError,
    "A proxy setting that cannot serve: of the wrong type, below its bound, unknown, or an upstream URL that is not http://HOST[:PORT]."
);

/// What a binding function fails with. `?` takes both a `PyErr` and the core's `Error` into it
/// (the core is another crate, so its errors cannot convert into `PyErr` directly), and PyO3
/// raises it as the `PyErr` it holds.
#[derive(Debug)]
pub struct Failure(PyErr);

/// The result of every binding function.
pub type PyResult<T> = Result<T, Failure>;

impl From<PyErr> for Failure {
    fn from(e: PyErr) -> Self {
        Failure(e)
    }
}

impl From<pyo3::CastError<'_, '_>> for Failure {
    fn from(e: pyo3::CastError<'_, '_>) -> Self {
        Failure(e.into())
    }
}

impl From<pyo3::CastIntoError<'_>> for Failure {
    fn from(e: pyo3::CastIntoError<'_>) -> Self {
        Failure(e.into())
    }
}

impl From<std::convert::Infallible> for Failure {
    fn from(e: std::convert::Infallible) -> Self {
        match e {}
    }
}

impl From<routed_experts::Error> for Failure {
    fn from(e: routed_experts::Error) -> Self {
        Failure(py_err(e))
    }
}

impl From<Failure> for PyErr {
    fn from(f: Failure) -> PyErr {
        f.0
    }
}

/// The core's error as the exception of ours that says what kind it is: the one place its
/// kinds meet Python's classes (malformed input is a `PayloadError`; parts that do not fit
/// together, a missing half among them, a `MergeError`). The message is the core's.
pub fn py_err(e: routed_experts::Error) -> PyErr {
    if e.kind().is_malformed_input() {
        PayloadError::new_err(e.to_string())
    } else {
        MergeError::new_err(e.to_string())
    }
}
