//! Module-level functions: merge, response bodies.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::convert::text_arg;
use super::payload::{decode_sidecar_obj, RoutedExperts};
use crate::response::{self, MergeOptions};
use crate::{limits, merge as core_merge, Payload};

/// A payload argument: a `RoutedExperts`, or a compact sidecar (bytes, str or dict).
pub fn payload_arg(value: &Bound<'_, PyAny>) -> PyResult<Payload> {
    match value.cast::<RoutedExperts>() {
        Ok(p) => Ok(p.get().inner.clone()),
        Err(_) => decode_sidecar_obj(value, None),
    }
}

/// Merge the prompt routing from a prefill server with the routing a decode server returned,
/// by absolute position: prefill's rows, then decode's rows from position `prefill.stop` on.
///
/// Raises MergeError on a gap, on a decode half that ends before prefill's, or on different
/// num_layers/top_k. Mixed dtypes are promoted (uint8 + uint16 -> uint16), never truncated.
#[pyfunction]
pub fn merge(
    py: Python<'_>,
    prefill: &Bound<'_, PyAny>,
    decode: &Bound<'_, PyAny>,
) -> PyResult<RoutedExperts> {
    // Borrow in place when both are payloads already (the common case): no clone.
    if let (Ok(p), Ok(d)) = (
        prefill.cast::<RoutedExperts>(),
        decode.cast::<RoutedExperts>(),
    ) {
        let (p, d) = (&p.get().inner, &d.get().inner);
        return Ok(RoutedExperts::new(py.detach(|| core_merge::merge(p, d))?));
    }
    let (p, d) = (payload_arg(prefill)?, payload_arg(decode)?);
    Ok(RoutedExperts::new(py.detach(|| core_merge::merge(&p, &d))?))
}

/// The routing of the choice whose `index` is `choice` in a response body, or None when that
/// choice carries none. Only the routing value is decoded; the rest of the body is skipped.
#[pyfunction]
#[pyo3(signature = (body, choice = 0, *, max_bytes = None))]
pub fn from_response(
    py: Python<'_>,
    body: &Bound<'_, PyAny>,
    choice: u64,
    max_bytes: Option<usize>,
) -> PyResult<Option<RoutedExperts>> {
    let text = text_arg(body)?;
    let limit = max_bytes.unwrap_or_else(limits::max_bytes);
    let found = py.detach(|| response::from_response(&text, choice, limit))?;
    Ok(found.map(RoutedExperts::new))
}

/// The decode body with every routing value merged with the prefill routing of the same choice
/// index (a one-choice prefill body serves every decode choice). Every other byte of the decode
/// body is returned unchanged. `splice=False` forces the decode/concat/encode path (the result
/// is the same; the flag exists to compare the two).
#[pyfunction]
#[pyo3(signature = (prefill_body, decode_body, *, splice = true, max_bytes = None))]
pub fn merge_response<'py>(
    py: Python<'py>,
    prefill_body: &Bound<'py, PyAny>,
    decode_body: &Bound<'py, PyAny>,
    splice: bool,
    max_bytes: Option<usize>,
) -> PyResult<Bound<'py, PyBytes>> {
    let (p, d) = (text_arg(prefill_body)?, text_arg(decode_body)?);
    let opts = MergeOptions {
        max_bytes: max_bytes.unwrap_or_else(limits::max_bytes),
        splice,
    };
    let out = py.detach(|| response::merge_response(&p, &d, opts))?;
    Ok(PyBytes::new(py, &out))
}

/// Pack samples into one batch: every sample converted to `dtype` (default int32; None for the
/// smallest dtype that holds them all) and concatenated, plus `cu_seqlens` (int32,
/// `[0, n0, n0+n1, ...]`). With `pad_to_multiple`, zero rows follow the last sample up to a
/// multiple of that many rows; they are not counted in `cu_seqlens`.
#[pyfunction]
#[pyo3(signature = (samples, dtype = Some("int32"), pad_to_multiple = None))]
pub fn pack<'py>(
    py: Python<'py>,
    samples: Vec<Bound<'py, RoutedExperts>>,
    dtype: Option<&str>,
    pad_to_multiple: Option<usize>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    use numpy::{PyArray1, PyArray3, PyArrayMethods};
    let payloads: Vec<&Payload> = samples.iter().map(|s| &s.get().inner).collect();
    let Some(first) = payloads.first() else {
        return Err(crate::Error::field("samples", "at least one sample", "an empty list").into());
    };
    let dtype = match dtype {
        Some(name) => crate::DType::parse(name)?,
        None => payloads
            .iter()
            .fold(first.dtype(), |d, p| crate::DType::promote(d, p.dtype())),
    };
    let (rows, cu) = crate::pack::layout(&payloads, pad_to_multiple)?;
    let cu: Vec<i64> = cu.into_iter().map(|c| c as i64).collect();
    let cu_seqlens = PyArray1::from_vec(py, cu).call_method1("astype", ("int32",))?;
    let dims = (rows, first.num_layers(), first.top_k());
    let packed = crate::with_element!(dtype, D => {
        let arr = PyArray3::<D>::zeros(py, dims, false);
        // SAFETY: the array was just created here; nothing else can see it yet.
        let dst = unsafe { arr.as_slice_mut() }.expect("a new array is contiguous");
        py.detach(|| crate::pack::pack_into::<D>(&payloads, dst))?;
        arr.into_any()
    });
    Ok((packed, cu_seqlens))
}
