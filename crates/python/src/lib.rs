//! The Python extension `routed_experts._core`: conversions between Python objects and the
//! core (`routed_experts`) and the proxy (`routed_experts_proxy`), nothing more. The hot paths
//! run in those crates with the GIL released; what is here reads arguments, builds numpy arrays
//! and bytes without a second copy, and turns the core's errors into Python's.

// `with_element!` instantiates generic code for every dtype; in the int64 arm `.into()` to i64
// is the identity, which is what the generic code means.
#![allow(clippy::useless_conversion)]
// PyO3's generated wrappers are the documentation Python sees (`__doc__`), not rustdoc.
#![allow(missing_docs)]

pub mod convert;
pub mod errors;
pub mod functions;
pub mod payload;
pub mod proxy;
pub mod quality;
pub mod replay;
pub mod trajectory;

use std::sync::atomic::{AtomicUsize, Ordering};

use std::mem::MaybeUninit;

use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors::PyResult;
use pyo3::types::PyBytes;

/// A new `bytes` of `len` bytes, all written by `fill` with the GIL released. Unlike
/// `PyBytes::new_with`, nothing is zeroed first: for tens of MB that would be a second pass over
/// every page. `fill` gets the memory as `MaybeUninit` and must write every byte, or fail.
pub fn bytes_filled<'py>(
    py: Python<'py>,
    len: usize,
    fill: impl FnOnce(&mut [MaybeUninit<u8>]) -> routed_experts::Result<()> + Send,
) -> PyResult<Bound<'py, PyBytes>> {
    let size = ffi::Py_ssize_t::try_from(len)
        .map_err(|_| routed_experts::Error::payload("output too large"))?;
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

/// `dims` as numpy's `npy_intp`. Every payload's shape fits (`payload::MAX_DECLARED_BYTES`), so
/// this only guards against a caller's size slipping past the limits unchecked.
fn npy_dims(dims: (usize, usize, usize)) -> PyResult<[numpy::npyffi::npy_intp; 3]> {
    let one = |d: usize| {
        numpy::npyffi::npy_intp::try_from(d).map_err(|_| {
            routed_experts::Error::field("shape", "dimensions below 2**63", format!("{dims:?}"))
        })
    };
    Ok([one(dims.0)?, one(dims.1)?, one(dims.2)?])
}

/// A new zero-filled C-order numpy array of `dims` (numpy owns it, writable). numpy's failure
/// (a shape it refuses, no memory) is its Python exception, never a panic.
fn new_zeros<'py, D: numpy::Element>(
    py: Python<'py>,
    dims: (usize, usize, usize),
) -> PyResult<Bound<'py, numpy::PyArray3<D>>> {
    use numpy::npyffi::PY_ARRAY_API;
    use numpy::PyArrayDescrMethods;
    let mut dims = npy_dims(dims)?;
    // SAFETY: `dims` points to 3 npy_intp that live across the call; PyArray_Zeros steals the
    // descriptor reference that `into_dtype_ptr` hands over, and returns a new reference to a
    // 3-d array of D, or NULL with a Python exception set (turned into Err here).
    unsafe {
        let ptr = PY_ARRAY_API.PyArray_Zeros(
            py,
            3,
            dims.as_mut_ptr(),
            D::get_dtype(py).into_dtype_ptr(),
            0,
        );
        Ok(Bound::from_owned_ptr_or_err(py, ptr)?.cast_into_unchecked())
    }
}

/// A read-only numpy array of `dims` over `data` (C order, no copy) whose base is `owner`.
///
/// # Safety
/// `data` must hold `dims.0 * dims.1 * dims.2` aligned values of `D`, owned by `owner` and
/// neither mutated nor freed while `owner` lives.
pub unsafe fn readonly_array<'py, D: numpy::Element>(
    owner: &Bound<'py, PyAny>,
    dims: (usize, usize, usize),
    data: *const D,
) -> PyResult<Bound<'py, PyAny>> {
    use numpy::npyffi::{get_type_object, NpyTypes, PyArrayObject, PY_ARRAY_API};
    use numpy::PyArrayDescrMethods;
    let py = owner.py();
    let mut dims = npy_dims(dims)?;
    // SAFETY: the array type object and descriptor are numpy's (the descriptor reference is
    // stolen); `dims` points to 3 npy_intp for the call; NULL strides mean C order; flags 0
    // leave the array read-only. `data` is valid for the whole array per this function's
    // contract, and stays so because `owner` becomes the array's base (SetBaseObject steals
    // the new reference `into_ptr` gives, and releases it itself when it fails). A NULL or a
    // failure is the Python exception numpy set.
    unsafe {
        let ptr = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            get_type_object(py, NpyTypes::PyArray_Type),
            D::get_dtype(py).into_dtype_ptr(),
            3,
            dims.as_mut_ptr(),
            std::ptr::null_mut(),
            data as *mut std::ffi::c_void,
            0,
            std::ptr::null_mut(),
        );
        let arr = Bound::from_owned_ptr_or_err(py, ptr)?;
        let base = owner.clone().into_ptr();
        if PY_ARRAY_API.PyArray_SetBaseObject(py, ptr as *mut PyArrayObject, base) < 0 {
            return Err(PyErr::fetch(py).into());
        }
        Ok(arr)
    }
}

/// A new numpy array of `dims` (numpy owns it, writable) filled by `fill` with the GIL released:
/// values go straight into numpy's buffer, with no intermediate one.
pub fn numpy_filled<'py, D: routed_experts::Element + numpy::Element>(
    py: Python<'py>,
    dims: (usize, usize, usize),
    fill: impl FnOnce(&mut [D]) -> routed_experts::Result<()> + Send,
) -> PyResult<Bound<'py, PyAny>> {
    use numpy::PyArrayMethods;
    let arr = new_zeros::<D>(py, dims)?;
    // SAFETY: the array was just created here, C-contiguous; nothing else can see it yet.
    let dst = unsafe { arr.as_slice_mut() }
        .map_err(|_| routed_experts::Error::payload("a new numpy array is not contiguous"))?;
    routed_experts::buffer::prefault(dst.as_mut_ptr().cast(), std::mem::size_of_val(dst));
    py.detach(|| fill(dst))?;
    Ok(arr.into_any())
}

/// The `numpy.dtype` of a core dtype.
pub fn numpy_dtype(py: Python<'_>, dtype: routed_experts::DType) -> Bound<'_, numpy::PyArrayDescr> {
    routed_experts::dtype::with_element!(dtype, T => <T as numpy::Element>::get_dtype(py))
}

/// The Python API's cap on decoded bytes (`set_max_bytes`): the core takes it as a value on
/// every call; this is where Python's process-wide setting lives.
static MAX_BYTES: AtomicUsize = AtomicUsize::new(routed_experts::DEFAULT_MAX_BYTES);

/// The cap every call without `max_bytes=` decodes under.
pub fn max_bytes() -> usize {
    MAX_BYTES.load(Ordering::Relaxed)
}

#[pyo3::pymodule]
mod _core {
    use pyo3::prelude::*;

    #[pymodule_export]
    use crate::errors::{ConfigError, MergeError, PayloadError, RoutedExpertsError};
    #[pymodule_export]
    use crate::functions::{
        _read_prefill, _sniff, decode, detect_format, encode, from_response, group_from_response,
        merge, merge_response, pack, pack_shard, shard,
    };
    #[pymodule_export]
    use crate::payload::{_from_raw, RoutedExperts};
    #[pymodule_export]
    use crate::proxy::{
        _ProxyServer, _check_proxy_settings, _proxy_choices, _proxy_protocol, _proxy_settings,
        _proxy_text_settings, StreamMerger,
    };
    #[pymodule_export]
    use crate::quality::{agreement, expert_load, Agreement, ExpertLoad};
    #[pymodule_export]
    use crate::replay::_replay_ids;
    #[pymodule_export]
    use crate::trajectory::{_trajectory_from_payload, Trajectory};

    /// Cap on the decoded size of one payload, in bytes (default 1 GiB); larger payloads are
    /// refused before anything is allocated.
    #[pyfunction]
    fn set_max_bytes(#[pyo3(from_py_with = crate::convert::arg::n)] n: usize) {
        super::MAX_BYTES.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// The current cap on decoded bytes (see `set_max_bytes`).
    #[pyfunction]
    fn get_max_bytes() -> usize {
        super::max_bytes()
    }

    /// The crate's version (`routed_experts.__version__`), from the build.
    #[pymodule_export]
    #[allow(non_upper_case_globals)] // Python's name for it
    const __version__: &str = env!("CARGO_PKG_VERSION");

    /// The proxy's Rust log records go to Python's `logging` (logger `routed_experts.proxy`).
    /// Levels are looked up on each record, so `logging` settings made later still apply.
    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        let logger = pyo3_log::Logger::new(m.py(), pyo3_log::Caching::Nothing)?
            .filter(log::LevelFilter::Info);
        // Another extension may have installed a `log` logger first; then ours stays off.
        let _ = logger.install();
        // The formats' names, in the core's order: Python's choices come from here, not a list
        // of its own (tests/test_new_user.py holds the stub's `_Format` to it).
        let names = routed_experts::Format::ALL.map(routed_experts::Format::name);
        m.add("FORMATS", pyo3::types::PyTuple::new(m.py(), names)?)?;
        // The core's error kinds, as the `kind` of the exceptions it raises; an exception
        // raised elsewhere (argument checks in Python) has kind None and no details.
        let kinds = routed_experts::ErrorKind::NAMES;
        m.add("_ERROR_KINDS", pyo3::types::PyTuple::new(m.py(), kinds)?)?;
        let base = m.getattr("RoutedExpertsError")?;
        base.setattr("kind", m.py().None())?;
        let empty = m.py().import("types")?.getattr("MappingProxyType")?;
        base.setattr("details", empty.call1((pyo3::types::PyDict::new(m.py()),))?)?;
        Ok(())
    }
}
