//! One exception family for Python (`RoutedExpertsError`, with `PayloadError` and `MergeError`
//! beneath it), and the error every binding function returns: a Python exception, or a core
//! error that becomes one of ours.

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use routed_experts::{ErrorKind, Half};

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
/// together, a missing half among them, a `MergeError`). The message is the core's, and a
/// limit passed says how Python raises it.
pub fn py_err(e: routed_experts::Error) -> PyErr {
    let mut message = e.to_string();
    if let ErrorKind::TooLarge { .. } = e.kind() {
        // The core names the limit; the knob that raises it is this binding's.
        message.push_str(" (raise it with routed_experts.set_max_bytes or max_bytes=)");
    }
    let err = if e.kind().is_malformed_input() {
        PayloadError::new_err(message)
    } else {
        MergeError::new_err(message)
    };
    // Which rule, as attributes a caller branches on (`except MergeError as e: if e.kind ==
    // "gap"`). Errors are rare: taking the interpreter here costs nothing that matters.
    Python::attach(|py| {
        let value = err.value(py);
        let _ = value.setattr("kind", e.kind().name());
        if let Ok(details) = details(py, e.kind()) {
            let _ = value.setattr("details", details);
        }
    });
    err
}

/// The values a kind carries, by name (`{"stop": 3, "start": 5}` for a gap).
fn details<'py>(py: Python<'py>, kind: &ErrorKind) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match kind {
        ErrorKind::Field {
            field,
            expected,
            actual,
        } => {
            d.set_item("field", field)?;
            d.set_item("expected", expected)?;
            d.set_item("actual", actual)?;
        }
        ErrorKind::Json { at, expected } => {
            d.set_item("at", at)?;
            d.set_item("expected", expected)?;
        }
        ErrorKind::Counts { rows, start } => {
            d.set_item("rows", rows)?;
            d.set_item("start", start)?;
        }
        ErrorKind::Row { router, row } => {
            d.set_item("router", router)?;
            d.set_item("row", row)?;
        }
        ErrorKind::Id { position, layer } | ErrorKind::Overlap { position, layer } => {
            d.set_item("position", position)?;
            d.set_item("layer", layer)?;
        }
        ErrorKind::TooLarge { bytes, limit } => {
            d.set_item("bytes", bytes)?;
            d.set_item("limit", limit)?;
        }
        ErrorKind::Unpadded { rows, multiple } => {
            d.set_item("rows", rows)?;
            d.set_item("multiple", multiple)?;
        }
        ErrorKind::Gap { stop, start } => {
            d.set_item("stop", stop)?;
            d.set_item("start", start)?;
        }
        ErrorKind::Shape { first, second } => {
            d.set_item("first", first)?;
            d.set_item("second", second)?;
        }
        ErrorKind::MissingRouting(half) => {
            let half = match half {
                Half::Prefill => "prefill",
                Half::Decode => "decode",
            };
            d.set_item("half", half)?;
        }
        // What no caller branches on, and new kinds until they are given here: the name only.
        _ => {}
    }
    Ok(d)
}
