//! `_replay_ids`: each router's replay ids from a batch of routing rows, for `rx.replay`
//! (format.md §6.2). The checks and the copy are the core's (`routed_experts::replay`).

use numpy::{PyArray2, PyArray3, PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::PyResult;
use routed_experts::replay::{router_ids, BatchId, IndexId, RowNames, Rows};

/// For router `i`, layer `layers[i]` of every row of `batch` (a C-contiguous `rows x layers x
/// top_k` integer array), checked (ids in `[0, num_experts)`, none twice in a row, `places[i]`
/// naming the router in errors) and written as `dtype` ("int64" or "int32") into a new
/// `[routers, rows, top_k]` array, with a `[routers, rows]` bool array of the rows replayed.
/// Rows `mask` drops or holding `-1` throughout get ids spread over the experts. `origin`: a
/// C-contiguous int64 `[rows, 2]` array, each row's sample and position, for errors to name it
/// by (a negative sample: `row {position}`). GIL released.
#[pyfunction]
#[pyo3(signature = (batch, layers, mask, num_experts, places, dtype, origin=None))]
#[allow(clippy::too_many_arguments)]
pub fn _replay_ids<'py>(
    py: Python<'py>,
    batch: &Bound<'py, PyAny>,
    layers: Vec<usize>,
    mask: Option<&Bound<'py, PyAny>>,
    num_experts: u64,
    places: Vec<String>,
    dtype: &str,
    origin: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let origin = match origin {
        Some(o) => Some(
            o.cast::<numpy::PyArray2<i64>>()
                .map_err(|_| {
                    routed_experts::Error::field("origin", "a 2-d int64 array", "another")
                })?
                .readonly(),
        ),
        None => None,
    };
    let names = match &origin {
        Some(o) => RowNames::Origin(o.as_slice().map_err(|_| {
            routed_experts::Error::field("origin", "a contiguous array", "a strided one")
        })?),
        None => RowNames::Index,
    };
    if places.len() != layers.len() {
        return Err(routed_experts::Error::field(
            "places",
            format!("one per router ({})", layers.len()),
            places.len(),
        )
        .into());
    }
    let mask = match mask {
        Some(m) => Some(
            m.cast::<numpy::PyArray1<bool>>()
                .map_err(|_| routed_experts::Error::field("mask", "a 1-d bool array", "another"))?
                .readonly(),
        ),
        None => None,
    };
    let valid = match &mask {
        Some(m) => Some(m.as_slice().map_err(|_| {
            routed_experts::Error::field("mask", "a contiguous array", "a strided one")
        })?),
        None => None,
    };
    macro_rules! try_element {
        ($($t:ty),*) => {$(
            if let Ok(a) = batch.cast::<PyArrayDyn<$t>>() {
                let &[tokens, width, top_k] = a.shape() else {
                    return Err(routed_experts::Error::field(
                        "batch", "3 dimensions (rows, layers, top_k)", format!("shape {:?}", a.shape()),
                    ).into());
                };
                let ro = a.readonly();
                let src = ro.as_slice().map_err(|_| {
                    routed_experts::Error::field("batch", "a C-contiguous array", "a strided one")
                })?;
                let rows = Rows { tokens, layers: width, top_k };
                return match dtype {
                    "int64" => fill::<$t, i64>(py, src, rows, &layers, valid, num_experts, &places, names),
                    "int32" => fill::<$t, i32>(py, src, rows, &layers, valid, num_experts, &places, names),
                    other => Err(routed_experts::Error::field(
                        "dtype", "\"int64\" or \"int32\"", format!("{other:?}"),
                    ).into()),
                };
            }
        )*};
    }
    try_element!(u8, i8, u16, i16, u32, i32, u64, i64);
    let dt = batch.getattr("dtype")?.str()?.to_cow()?.into_owned();
    Err(
        routed_experts::Error::field("batch", "an integer numpy array", format!("dtype {dt}"))
            .into(),
    )
}

#[allow(clippy::too_many_arguments)]
fn fill<'py, T: BatchId + numpy::Element, O: IndexId + numpy::Element>(
    py: Python<'py>,
    src: &[T],
    rows: Rows,
    layers: &[usize],
    valid: Option<&[bool]>,
    num_experts: u64,
    places: &[String],
    names: RowNames<'_>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    // The ids are left uninitialised: zeroing would be one more pass over every byte.
    // SAFETY: `router_ids` writes every id of every router's part (a replayed row its ids, any
    // other row its spread), and on an error the array is dropped unread.
    let ids = unsafe { PyArray3::<O>::new(py, [layers.len(), rows.tokens, rows.top_k], false) };
    let flags = PyArray2::<bool>::zeros(py, [layers.len(), rows.tokens], false);
    // SAFETY: both arrays were just created here, C-contiguous; nothing else sees them yet.
    let (out, replayed) = unsafe { (ids.as_slice_mut(), flags.as_slice_mut()) };
    let (out, replayed) = (
        out.map_err(|_| routed_experts::Error::malformed("a new numpy array is not contiguous"))?,
        replayed
            .map_err(|_| routed_experts::Error::malformed("a new numpy array is not contiguous"))?,
    );
    py.detach(|| {
        router_ids(
            src,
            rows,
            layers,
            valid,
            num_experts,
            places,
            names,
            out,
            replayed,
        )
    })?;
    Ok((ids.into_any(), flags.into_any()))
}
