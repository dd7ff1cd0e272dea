//! The PyO3 binding layer: conversions between Python objects and the core, nothing more.

pub mod convert;
pub mod functions;
pub mod payload;
pub mod trajectory;

use std::mem::MaybeUninit;

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
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

/// A new `bytes` of `len` bytes, all written by `fill` with the GIL released. Unlike
/// `PyBytes::new_with`, nothing is zeroed first: for tens of MB that would be a second pass over
/// every page. `fill` gets the memory as `MaybeUninit` and must write every byte.
pub fn bytes_filled<'py>(
    py: Python<'py>,
    len: usize,
    fill: impl FnOnce(&mut [MaybeUninit<u8>]) + Send,
) -> PyResult<Bound<'py, PyBytes>> {
    let size =
        ffi::Py_ssize_t::try_from(len).map_err(|_| crate::Error::payload("output too large"))?;
    // SAFETY: PyBytes_FromStringAndSize(NULL, n) returns a new bytes object (or NULL with an
    // exception set) whose n-byte buffer is ours to fill until it is shared; it is shared only
    // after `fill` has written every byte.
    unsafe {
        let ptr = ffi::PyBytes_FromStringAndSize(std::ptr::null(), size);
        let bytes = Bound::from_owned_ptr_or_err(py, ptr)?.cast_into_unchecked::<PyBytes>();
        let buf = std::slice::from_raw_parts_mut(
            ffi::PyBytes_AsString(ptr).cast::<MaybeUninit<u8>>(),
            len,
        );
        py.detach(|| fill(buf));
        Ok(bytes)
    }
}

/// A new numpy array of `dims` (numpy owns it, writable) filled by `fill` with the GIL released:
/// values go straight into numpy's buffer, with no intermediate one.
pub fn numpy_filled<'py, D: crate::Element + numpy::Element>(
    py: Python<'py>,
    dims: (usize, usize, usize),
    fill: impl FnOnce(&mut [D]) -> crate::Result<()> + Send,
) -> PyResult<Bound<'py, PyAny>> {
    use numpy::{PyArray3, PyArrayMethods};
    let arr = PyArray3::<D>::zeros(py, dims, false);
    // SAFETY: the array was just created here; nothing else can see it yet.
    let dst = unsafe { arr.as_slice_mut() }.expect("a new array is contiguous");
    py.detach(|| fill(dst))?;
    Ok(arr.into_any())
}
