//! A new Python `bytes` written straight from Rust, with the GIL released and no second copy.

use std::mem::MaybeUninit;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::PyResult;

/// A new `bytes` of `len` bytes, all written by `fill` with the GIL released. Unlike
/// `PyBytes::new_with`, nothing is zeroed first: for tens of MB that would be a second pass over
/// every page. `fill` gets the memory as `MaybeUninit` and must write every byte, or fail.
pub fn bytes_filled<'py>(
    py: Python<'py>,
    len: usize,
    fill: impl FnOnce(&mut [MaybeUninit<u8>]) -> routed_experts::Result<()> + Send,
) -> PyResult<Bound<'py, PyBytes>> {
    let size = ffi::Py_ssize_t::try_from(len)
        .map_err(|_| routed_experts::Error::malformed("output too large"))?;
    // SAFETY: PyBytes_FromStringAndSize(NULL, n) returns a new bytes object (or NULL with an
    // exception set) whose n-byte buffer is ours to fill until it is shared; it is shared only
    // after `fill` has written every byte.
    unsafe {
        let ptr = ffi::PyBytes_FromStringAndSize(std::ptr::null(), size);
        let bytes = Bound::from_owned_ptr_or_err(py, ptr)?.cast_into_unchecked::<PyBytes>();
        let data = ffi::PyBytes_AsString(ptr).cast::<u8>();
        routed_experts::buffer::prefault(data, len);
        let buf = std::slice::from_raw_parts_mut(data.cast::<MaybeUninit<u8>>(), len);
        // On an error the object is released unread (its bytes were never shared).
        py.detach(|| fill(buf))?;
        Ok(bytes)
    }
}
