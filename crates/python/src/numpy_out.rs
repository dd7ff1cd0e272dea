//! numpy arrays handed to Python without a second copy: new ones filled with the GIL released,
//! read-only views over memory a Python object owns, and the dtype of a core dtype.

use pyo3::prelude::*;

use crate::errors::PyResult;

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
        .map_err(|_| routed_experts::Error::malformed("a new numpy array is not contiguous"))?;
    routed_experts::buffer::prefault(dst.as_mut_ptr().cast(), std::mem::size_of_val(dst));
    py.detach(|| fill(dst))?;
    Ok(arr.into_any())
}

/// The `numpy.dtype` of a core dtype.
pub fn numpy_dtype(py: Python<'_>, dtype: routed_experts::DType) -> Bound<'_, numpy::PyArrayDescr> {
    routed_experts::dtype::with_element!(dtype, T => <T as numpy::Element>::get_dtype(py))
}
