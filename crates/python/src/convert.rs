//! Python values -> core inputs: JSON text, sidecar dicts, dtype names, numpy arrays.

use std::borrow::Cow;

use numpy::{PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;

use crate::errors::{Failure, PyResult};

use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyMemoryView, PyString, PyTuple,
};
use serde_json::Value;

use routed_experts::formats::{self, Hints};
use routed_experts::sidecar::{DataField, SidecarFields};
use routed_experts::{DType, DTypeChoice, Payload, Shape};

/// A response body: JSON text as `text_arg` takes it, or a body already parsed into a dict (or
/// a list, for SGLang batches), written back to JSON text first.
pub fn body_arg<'a>(value: &'a Bound<'_, PyAny>, name: &str) -> PyResult<Text<'a>> {
    if value.is_instance_of::<PyDict>() || value.is_instance_of::<PyList>() {
        return Ok(Text::Owned(json_text(
            value,
            name,
            "a JSON-serialisable dict",
        )?));
    }
    if let Some(text) = model_json(value, name)? {
        return Ok(Text::Owned(text));
    }
    text_arg(value, name)
}

/// A pydantic model's JSON (the OpenAI SDK's `Completion`, `ChatCompletion` and their stream
/// chunks are pydantic models that keep a server's extra fields, routing among them, in
/// `model_extra`): what the server sent, its fields that were set (`exclude_unset`), written by
/// pydantic's own serializer. Found by its method, so the SDK is never imported.
pub fn model_json(value: &Bound<'_, PyAny>, name: &str) -> PyResult<Option<Vec<u8>>> {
    if value.is_instance_of::<PyString>()
        || value.is_instance_of::<PyBytes>()
        || !value.hasattr("model_dump_json")?
        || !value.hasattr("model_extra")?
    {
        return Ok(None);
    }
    let kwargs = pyo3::types::PyDict::new(value.py());
    kwargs.set_item("exclude_unset", true)?;
    let text = value
        .call_method("model_dump_json", (), Some(&kwargs))
        .map_err(|e| {
            routed_experts::Error::field(
                name,
                "a response body",
                format!("a pydantic model its model_dump_json refuses ({e})"),
            )
        })?;
    let text = text.cast::<PyString>().map_err(|_| {
        routed_experts::Error::field(
            name,
            "a response body",
            "a model_dump_json that is not a str",
        )
    })?;
    Ok(Some(str_utf8(text, name)?.as_bytes().to_vec()))
}

/// A parsed Python value written back to JSON text with `json.dumps`; what it refuses (objects
/// that are not JSON, nesting beyond the recursion limit) is malformed input about `field`.
pub fn json_text(value: &Bound<'_, PyAny>, field: &str, expected: &str) -> PyResult<Vec<u8>> {
    let text = value
        .py()
        .import("json")?
        .getattr("dumps")?
        .call1((value,))
        .map_err(|e| {
            routed_experts::Error::field(
                field,
                expected,
                format!("a value json.dumps refuses ({e})"),
            )
        })?;
    Ok(str_utf8(text.cast::<PyString>()?, field)?
        .as_bytes()
        .to_vec())
}

/// An argument's text: borrowed from a `bytes` or `str`, or copied once from a buffer that
/// could change while the GIL is released (a `memoryview`'s into the `bytes` it makes, a
/// `bytearray`'s), or written by the call (JSON of a dict).
pub enum Text<'a> {
    Borrowed(&'a [u8]),
    Bytes(PyBackedBytes),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Text<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Text::Borrowed(b) => b,
            Text::Bytes(b) => b,
            Text::Owned(v) => v,
        }
    }
}

/// Text that JSON can be parsed from: borrowed from `bytes`/`str`, copied once from mutable
/// buffers (a `bytearray` or what a `memoryview` shows could change while the GIL is
/// released). Anything else is a `PayloadError` naming the argument `name`.
pub fn text_arg<'a>(value: &'a Bound<'_, PyAny>, name: &str) -> PyResult<Text<'a>> {
    if let Ok(b) = value.cast::<PyBytes>() {
        return Ok(Text::Borrowed(b.as_bytes()));
    }
    if let Ok(s) = value.cast::<PyString>() {
        return Ok(Text::Borrowed(str_utf8(s, name)?.as_bytes()));
    }
    if let Ok(b) = value.cast::<PyByteArray>() {
        return Ok(Text::Owned(b.to_vec()));
    }
    if value.is_instance_of::<PyMemoryView>() {
        // `tobytes` is the one copy (what the view shows, in order); the `bytes` is kept as is.
        let bytes = value.call_method0("tobytes")?.cast_into::<PyBytes>()?;
        return Ok(Text::Bytes(PyBackedBytes::from(bytes)));
    }
    let kind = py_type_name(value);
    if kind != NOT_JSON {
        // Already parsed JSON, but not an object: malformed input, not a programming error.
        return Err(routed_experts::Error::field(name, "a JSON object", kind).into());
    }
    if value.hasattr("__array__").unwrap_or(false) {
        // An array is routing, not JSON: say how to make it a payload this call takes.
        return Err(routed_experts::Error::field(
            name,
            "JSON as bytes, str or a dict, or a RoutedExperts (an array becomes one with \
             routed_experts.RoutedExperts.from_array(array, start=...))",
            a_value_of(value),
        )
        .into());
    }
    Err(
        routed_experts::Error::field(name, "JSON as bytes, str or a dict", a_value_of(value))
            .into(),
    )
}

const NOT_JSON: &str = "a non-JSON Python object";

/// A `str` as UTF-8; one that has none (a lone surrogate, as `json.loads` can produce from a
/// `"\ud800"` escape) is malformed input. Borrowed, not copied: a parsed body's `data` string
/// can be tens of MB.
pub fn str_utf8<'a>(s: &'a Bound<'_, PyString>, field: &str) -> PyResult<&'a str> {
    utf8_view(s).ok_or_else(|| {
        // The failed conversion set UnicodeEncodeError; our error replaces it.
        drop(PyErr::take(s.py()));
        routed_experts::Error::field(
            field,
            "text that can be UTF-8",
            "a str with a lone surrogate",
        )
        .into()
    })
}

// `PyUnicode_AsUTF8AndSize` joined the limited API in 3.10, so PyO3's abi3-py39 build does
// not declare it (and `PyString::to_str` is missing there). CPython has exported it with this
// signature since 3.3, so every interpreter this abi3 wheel loads into (3.9+) provides it.
extern "C" {
    fn PyUnicode_AsUTF8AndSize(
        unicode: *mut pyo3::ffi::PyObject,
        size: *mut pyo3::ffi::Py_ssize_t,
    ) -> *const std::os::raw::c_char;
}

/// The UTF-8 text CPython caches inside `s`, or None (with an exception set) when `s` has a
/// lone surrogate.
fn utf8_view<'a>(s: &'a Bound<'_, PyString>) -> Option<&'a str> {
    let mut size: pyo3::ffi::Py_ssize_t = 0;
    // SAFETY: `s` is a live str (we hold a reference and the GIL). On success CPython returns
    // a pointer to `size` bytes of valid UTF-8 that it caches inside the str object and frees
    // only with it; `s` is borrowed for 'a, so the slice cannot outlive the object, and a str
    // is immutable, so the bytes do not change. On failure it returns NULL.
    unsafe {
        let ptr = PyUnicode_AsUTF8AndSize(s.as_ptr(), &mut size);
        if ptr.is_null() {
            return None;
        }
        let bytes = std::slice::from_raw_parts(ptr.cast::<u8>(), usize::try_from(size).ok()?);
        Some(std::str::from_utf8_unchecked(bytes))
    }
}

/// The fields of a sidecar given as a Python dict. `data` is the dict's `data` item, fetched by
/// the caller so that its text can be borrowed, not copied, for as long as the caller holds it.
fn dict_fields<'a>(
    d: &Bound<'_, PyDict>,
    data: Option<&'a Bound<'_, PyAny>>,
) -> PyResult<SidecarFields<'a>> {
    let small = |key: &str| -> PyResult<Option<Value>> {
        d.get_item(key)?.map(|v| to_json_value(&v, 0)).transpose()
    };
    let mut body_key = None;
    for key in routed_experts::sidecar::BODY_KEYS {
        if d.contains(key)? {
            body_key = Some(key);
        }
    }
    let mut foreign_key = None;
    for (key, _) in routed_experts::sidecar::FOREIGN_KEYS {
        if d.contains(key)? {
            foreign_key = Some(key);
        }
    }
    let mut extra_key = None;
    for key in d.keys() {
        let key = key.str()?.to_string();
        if !routed_experts::sidecar::SIDECAR_KEYS.contains(&key.as_str()) {
            extra_key = Some(key.chars().take(64).collect());
            break;
        }
    }
    Ok(SidecarFields {
        data: data.map(data_field).transpose()?,
        shape: small("shape")?,
        start: small("start")?,
        dtype: small("dtype")?,
        body_key,
        foreign_key,
        extra_key,
        decoded: None,
        data_base64: false,
        predecoded: false,
    })
}

/// A compact sidecar given as a dict, decoded with the GIL released (its data string borrowed).
pub fn decode_dict(d: &Bound<'_, PyDict>, hints: &Hints, max_bytes: usize) -> PyResult<Payload> {
    let data = d.get_item("data")?;
    let fields = dict_fields(d, data.as_ref())?;
    Ok(d.py()
        .detach(|| formats::decode_compact_fields(fields, hints, max_bytes))?)
}

fn data_field<'a>(v: &'a Bound<'_, PyAny>) -> PyResult<DataField<'a>> {
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(DataField::Base64(Cow::Borrowed(
            str_utf8(s, "data")?.as_bytes(),
        )));
    }
    if let Ok(b) = v.cast::<PyBytes>() {
        return Ok(DataField::Base64(Cow::Borrowed(b.as_bytes())));
    }
    Ok(DataField::NotAString(py_type_name(v)))
}

fn py_type_name(v: &Bound<'_, PyAny>) -> &'static str {
    if v.is_none() {
        "null"
    } else if v.is_instance_of::<PyBool>() {
        "a boolean"
    } else if v.is_instance_of::<PyInt>() || v.is_instance_of::<PyFloat>() {
        "a number"
    } else if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        "an array"
    } else if v.is_instance_of::<PyDict>() {
        "an object"
    } else {
        NOT_JSON
    }
}

/// A small Python value (shape, start, dtype) as JSON, so dicts and JSON text share one validator.
pub fn to_json_value(v: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if v.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = v.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(Value::String(str_utf8(s, "str")?.to_owned()));
    }
    if let Ok(f) = v.cast::<PyFloat>() {
        return Ok(serde_json::Number::from_f64(f.value()).map_or(Value::Null, Value::Number));
    }
    if v.is_instance_of::<PyInt>() || v.hasattr("__index__")? {
        let i = v.call_method0("__index__")?;
        if let Ok(n) = i.extract::<u64>() {
            return Ok(Value::from(n));
        }
        if let Ok(n) = i.extract::<i64>() {
            return Ok(Value::from(n));
        }
        // Beyond int64 either way: a number too large for any field, reported as such.
        return Ok(Value::String("an integer beyond 64 bits".to_owned()));
    }
    if (v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>()) && depth < 4 {
        let items: PyResult<Vec<Value>> = v
            .try_iter()?
            .map(|item| to_json_value(&item?, depth + 1))
            .collect();
        return Ok(Value::Array(items?));
    }
    Ok(Value::String(format!("<{}>", v.get_type().name()?)))
}

/// A dtype given as a name (`"uint8"`) or anything `numpy.dtype()` accepts (`np.uint16`).
pub fn dtype_arg(v: &Bound<'_, PyAny>) -> PyResult<DType> {
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(DType::parse(str_utf8(s, "dtype")?)?);
    }
    // numpy's dtypes and scalar types (np.int32, np.dtype("uint16")), by the name numpy gives.
    let not_a_dtype = || -> Failure {
        routed_experts::Error::field("dtype", "a dtype name or numpy dtype", a_value_of(v)).into()
    };
    if v.is_instance_of::<PyBool>() || v.is_instance_of::<PyInt>() || v.is_instance_of::<PyFloat>()
    {
        return Err(not_a_dtype());
    }
    let Ok(np_dtype) = v.py().import("numpy")?.getattr("dtype")?.call1((v,)) else {
        return Err(not_a_dtype());
    };
    Ok(DType::parse(
        &np_dtype.getattr("name")?.cast::<PyString>()?.to_cow()?,
    )?)
}

pub fn dtype_choice(
    dtype: Option<&Bound<'_, PyAny>>,
    num_experts: Option<u64>,
) -> PyResult<DTypeChoice> {
    Ok(match (dtype, num_experts) {
        (Some(d), _) if !d.is_none() => DTypeChoice::Exact(dtype_arg(d)?),
        (_, Some(n)) => DTypeChoice::NumExperts(n),
        _ => DTypeChoice::Compact,
    })
}

/// A numpy integer array (or anything `numpy.asarray` takes) of shape (tokens, layers, top_k)
/// -> payload, converted to the chosen dtype with the GIL released.
pub fn payload_from_array(
    array: &Bound<'_, PyAny>,
    start: u64,
    choice: DTypeChoice,
) -> PyResult<Payload> {
    let py = array.py();
    let arr = py.import("numpy")?.getattr("asarray")?.call1((array,))?;
    macro_rules! try_element {
        ($($t:ty),*) => {$(
            if let Ok(a) = arr.cast::<PyArrayDyn<$t>>() {
                let shape = shape3(a.shape())?;
                let ro = a.readonly();
                let owned;
                let values: &[$t] = match ro.as_slice() {
                    Ok(s) => s,
                    Err(_) => { owned = ro.as_array().iter().copied().collect::<Vec<$t>>(); &owned }
                };
                return Ok(py.detach(|| Payload::from_values(values, shape, start, choice))?);
            }
        )*};
    }
    try_element!(u8, i8, u16, i16, u32, i32, i64);
    if let Ok(a) = arr.cast::<PyArrayDyn<u64>>() {
        // uint64 ids (some producers' default): checked into int64, never wrapped.
        let shape = shape3(a.shape())?;
        let values: Result<Vec<i64>, _> = a
            .readonly()
            .as_array()
            .iter()
            .map(|&v| i64::try_from(v).map_err(|_| v))
            .collect();
        let values = values
            .map_err(|v| routed_experts::Error::field("array", "values that fit int64", v))?;
        return Ok(py.detach(|| Payload::from_values(&values, shape, start, choice))?);
    }
    let dt = arr.getattr("dtype")?.str()?.to_cow()?.into_owned();
    Err(routed_experts::Error::field("array", "an integer array", format!("dtype {dt}")).into())
}

fn shape3(shape: &[usize]) -> PyResult<Shape> {
    match shape {
        [t, l, k] => Ok(Shape::new(*t, *l, *k)),
        other => Err(routed_experts::Error::field(
            "array",
            "3 dimensions (num_tokens, num_layers, top_k)",
            format!("shape {other:?}"),
        )
        .into()),
    }
}

/// A count or index argument: a Python int from 0 to 2**64 - 1, else a `RoutedExpertsError`
/// naming the argument (never `OverflowError` or a conversion's `TypeError`).
pub fn count_arg(name: &str, v: &Bound<'_, PyAny>) -> PyResult<usize> {
    let not_an_integer =
        || -> Failure { routed_experts::Error::field(name, "an integer", a_value_of(v)).into() };
    if v.is_instance_of::<PyBool>() {
        return Err(not_an_integer());
    }
    // numpy's integers (and anything else with __index__) count as integers.
    let index;
    let v = if v.is_instance_of::<PyInt>() {
        v
    } else {
        match v.py().import("operator")?.getattr("index")?.call1((v,)) {
            Ok(i) => {
                index = i;
                &index
            }
            Err(_) => return Err(not_an_integer()),
        }
    };
    match v.extract::<i64>() {
        Ok(n) => usize::try_from(n)
            .map_err(|_| routed_experts::Error::field(name, "a non-negative integer", n).into()),
        // Positions are u64 (a payload's start may be any of them).
        Err(_) => v
            .extract::<u64>()
            .ok()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| {
                let shown = v.repr().map(|r| r.to_string()).unwrap_or_default();
                routed_experts::Error::field(name, "an integer below 2**64", shown).into()
            }),
    }
}

/// A 1-d array of non-negative integer offsets (such as `cu_seqlens`), from anything
/// `numpy.asarray` takes.
pub fn offsets_arg(name: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let py = v.py();
    let arr = py.import("numpy")?.getattr("asarray")?.call1((v,))?;
    let kind: String = arr.getattr("dtype")?.getattr("kind")?.extract()?;
    let ndim: usize = arr.getattr("ndim")?.extract()?;
    if ndim != 1 || !(kind == "i" || kind == "u") {
        let dt = arr.getattr("dtype")?.str()?.to_string();
        return Err(routed_experts::Error::field(
            name,
            "a 1-d integer array",
            format!("{ndim} dimensions of {dt}"),
        )
        .into());
    }
    let values = arr.call_method1("astype", ("int64",))?;
    let values = values.cast::<numpy::PyArray1<i64>>()?.readonly();
    values
        .as_array()
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            usize::try_from(c).map_err(|_| {
                routed_experts::Error::field(name, "non-negative entries", format!("{c} at {i}"))
                    .into()
            })
        })
        .collect()
}

/// A new array of `batch`'s dtype holding the share `rank` takes (format.md §6.1), the plan it
/// followed, and the batch's row count.
pub fn shard_array<'py>(
    batch: &Bound<'py, PyAny>,
    cu_seqlens: &[usize],
    rank: &routed_experts::shard::Rank,
) -> PyResult<(Bound<'py, PyAny>, routed_experts::shard::Plan, usize)> {
    let py = batch.py();
    let arr = py.import("numpy")?.getattr("asarray")?.call1((batch,))?;
    macro_rules! try_element {
        ($($t:ty),*) => {$(
            if let Ok(a) = arr.cast::<PyArrayDyn<$t>>() {
                let &[rows, layers, top_k] = a.shape() else {
                    return Err(routed_experts::Error::field(
                        "batch",
                        "3 dimensions (rows, num_layers, top_k)",
                        format!("shape {:?}", a.shape()),
                    ).into());
                };
                let plan = routed_experts::shard::plan(cu_seqlens, rows, layers, rank)?;
                let dims = [plan.num_rows(), plan.layers.len(), top_k];
                let out = numpy::PyArray3::<$t>::zeros(py, dims, false);
                let ro = a.readonly();
                // SAFETY: `out` was just created here, C-contiguous; nothing else sees it yet.
                let dst = unsafe { out.as_slice_mut() }
                    .map_err(|_| routed_experts::Error::malformed("a new numpy array is not contiguous"))?;
                routed_experts::buffer::prefault(dst.as_mut_ptr().cast(), std::mem::size_of_val(dst));
                match ro.as_slice() {
                    Ok(src) => py.detach(|| routed_experts::shard::gather(src, layers, top_k, &plan, dst)),
                    // A strided batch (a view into a larger array): only the rank's rows are
                    // read from it, never a copy of the whole batch.
                    Err(_) => gather_strided(&ro.as_array(), &plan, top_k, dst),
                }
                return Ok((out.into_any(), plan, rows));
            }
        )*};
    }
    try_element!(u8, i8, u16, i16, u32, i32, u64, i64);
    let dt = arr.getattr("dtype")?.str()?.to_cow()?.into_owned();
    Err(routed_experts::Error::field("batch", "an integer array", format!("dtype {dt}")).into())
}

/// Fill the front of a caller's buffer `out` (a writable, C-contiguous numpy array of `D`, of
/// any shape, reused from call to call) with the `dims` values `fill` writes (the GIL
/// released), and return the view of them shaped `dims`. Anything else is refused, never
/// written into a copy the caller does not see.
pub fn fill_out<'py, D: routed_experts::Element + numpy::Element>(
    out: &Bound<'py, PyAny>,
    dims: (usize, usize, usize),
    fill: impl FnOnce(&mut [D]) -> routed_experts::Result<()> + Send,
) -> PyResult<Bound<'py, PyAny>> {
    use numpy::PyUntypedArray;
    let field = |expected: String, got: String| -> Failure {
        routed_experts::Error::field("out", expected, got).into()
    };
    let Ok(untyped) = out.cast::<PyUntypedArray>() else {
        let expected = "a numpy array (of a pinned tensor: its .numpy())".to_string();
        return Err(field(expected, a_value_of(out)));
    };
    let want = D::DTYPE.name();
    let Ok(arr) = out.cast::<PyArrayDyn<D>>() else {
        let got = untyped.dtype().str()?.to_cow()?.into_owned();
        return Err(field(
            format!("an array of {want} (the pack's dtype)"),
            format!("dtype {got}"),
        ));
    };
    let (rows, layers, top_k) = dims;
    let n = rows
        .checked_mul(layers)
        .and_then(|v| v.checked_mul(top_k))
        .ok_or_else(|| routed_experts::Error::malformed(format!("a share of {dims:?} values")))?;
    if !untyped.is_c_contiguous() {
        return Err(field(
            "a C-contiguous array".into(),
            "a strided view".into(),
        ));
    }
    if !out
        .getattr("flags")?
        .getattr("writeable")?
        .extract::<bool>()?
    {
        return Err(field("a writable array".into(), "a read-only one".into()));
    }
    if untyped.len() < n {
        let expected = format!("at least {n} values (the share's {rows} x {layers} x {top_k})");
        return Err(field(expected, format!("{} values", untyped.len())));
    }
    {
        let mut rw = arr
            .try_readwrite()
            .map_err(|e| field("an array no other call is writing".into(), e.to_string()))?;
        let whole = rw
            .as_slice_mut()
            .map_err(|_| field("a C-contiguous array".into(), "a strided view".into()))?;
        let dst = &mut whole[..n];
        out.py().detach(|| fill(dst))?;
    }
    let py = out.py();
    let front = out
        .call_method1("reshape", (-1,))?
        .get_item(pyo3::types::PySlice::new(py, 0, n as isize, 1))?;
    Ok(front.call_method1("reshape", (rows, layers, top_k))?)
}

/// `shard::gather` for a batch that is not one contiguous slice: the plan's rows and layers,
/// read through the view's strides into `dst`.
fn gather_strided<T: Copy>(
    view: &numpy::ndarray::ArrayViewD<'_, T>,
    plan: &routed_experts::shard::Plan,
    top_k: usize,
    dst: &mut [T],
) {
    use numpy::ndarray::{Axis, Slice};
    let width = plan.layers.len() * top_k;
    let mut out = dst.chunks_exact_mut(width.max(1));
    for r in plan.rows.iter().flat_map(|r| r.clone()) {
        let row = view.index_axis(Axis(0), r);
        let kept = row.slice_axis(Axis(0), Slice::from(plan.layers.clone()));
        if let Some(d) = out.next() {
            for (o, &v) in d.iter_mut().zip(kept.iter()) {
                *o = v;
            }
        }
    }
}

/// The rows of a 1-d boolean `mask` (one entry per batch row) that `plan` takes.
pub fn shard_mask<'py>(
    mask: &Bound<'py, PyAny>,
    plan: &routed_experts::shard::Plan,
    num_rows: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let py = mask.py();
    let arr = py.import("numpy")?.getattr("asarray")?.call1((mask,))?;
    let Ok(a) = arr.cast::<numpy::PyArray1<bool>>() else {
        let dt = arr.getattr("dtype")?.str()?.to_string();
        let shape = arr.getattr("shape")?.repr()?.to_string();
        return Err(routed_experts::Error::field(
            "mask",
            format!("a 1-d bool array of {num_rows} entries"),
            format!("{dt} of shape {shape}"),
        )
        .into());
    };
    if a.len() != num_rows {
        return Err(routed_experts::Error::field(
            "mask",
            format!("{num_rows} entries (one per batch row)"),
            a.len(),
        )
        .into());
    }
    let ro = a.readonly();
    let m = ro.as_array();
    let taken: Vec<bool> = plan
        .rows
        .iter()
        .flat_map(|r| r.clone())
        .map(|i| m[i])
        .collect();
    Ok(numpy::PyArray1::from_vec(py, taken).into_any())
}

/// Extractors for `#[pyo3(from_py_with = ...)]`: each integer argument checked by its own name
/// (PyO3 passes a conversion's `OverflowError` through unnamed), so a negative, huge or
/// non-integer value is a `RoutedExpertsError` naming the argument.
/// One extractor per argument name, for `#[pyo3(from_py_with = ...)]`: `$module::name` reads
/// the argument with `$read(name, value)` and `$opt::name` does the same for one that may be
/// None. Errors name the argument (what PyO3's own conversions do not do in our error family).
macro_rules! named_args {
    ($module:ident, $opt:ident, $read:ident -> $t:ty: $($name:ident),* $(,)?) => {
        #[allow(dead_code)] // not every name is taken both ways
        pub mod $module {
            use pyo3::prelude::*;
            $(
                pub fn $name<T: TryFrom<$t>>(v: &Bound<'_, PyAny>) -> PyResult<T> {
                    // Every `$t` here is `Copy`: the value is shown only when it does not fit.
                    let read: $t = super::$read(stringify!($name), v)?;
                    T::try_from(read).map_err(|_| {
                        crate::errors::py_err(routed_experts::Error::field(
                            stringify!($name),
                            "a smaller integer",
                            format!("{read:?}"),
                        ))
                    })
                }
            )*
        }
        #[allow(dead_code)]
        pub mod $opt {
            use pyo3::prelude::*;
            $(
                pub fn $name<T: TryFrom<$t>>(v: &Bound<'_, PyAny>) -> PyResult<Option<T>> {
                    if v.is_none() {
                        return Ok(None);
                    }
                    super::$module::$name(v).map(Some)
                }
            )*
        }
    };
}

named_args!(
    arg, opt, count_arg -> usize:
    start,
    stop,
    num_layers,
    top_k,
    choice,
    max_bytes,
    decode_start,
    num_experts,
    num_tokens,
    max_missing,
    max_line_bytes,
    n,
    pad_to_multiple,
    pad_each_to_multiple,
    cp_size,
    cp_rank,
    tp_size,
    tp_rank,
    port,
    admin_port,
);

/// The name arguments, each read as the choice it names (an unknown name or a non-str is a
/// `RoutedExpertsError` naming the argument).
pub mod word {
    use pyo3::prelude::*;

    use super::word_arg;
    use crate::errors::py_err;
    use routed_experts::formats::Format;
    use routed_experts::shard::CpSplit;
    use routed_experts::trajectory::{Overlap, Pad};

    pub fn format(v: &Bound<'_, PyAny>) -> PyResult<Format> {
        Format::parse(&word_arg("format", v)?).map_err(py_err)
    }

    pub fn cp_split(v: &Bound<'_, PyAny>) -> PyResult<CpSplit> {
        CpSplit::parse(&word_arg("cp_split", v)?).map_err(py_err)
    }

    pub fn overlap(v: &Bound<'_, PyAny>) -> PyResult<Overlap> {
        Overlap::parse(&word_arg("overlap", v)?).map_err(py_err)
    }

    pub fn pad(v: &Bound<'_, PyAny>) -> PyResult<Pad> {
        Pad::parse(&word_arg("pad", v)?).map_err(py_err)
    }
}
named_args!(
    flag, opt_flag, flag_arg -> bool:
    keep_format,
    splice,
    require_routing,
    shared_prompt,
    mask,
    writable,
    duplicates,
    zero_rows,
    missing_rows,
);
named_args!(typed, opt_typed, dtype_named -> routed_experts::DType: dtype);
named_args!(pair, opt_pair, pair_arg -> (usize, usize): layers);

/// "a str", "an int", "an ndarray": what a wrong-typed argument was, for its error.
pub fn a_value_of(v: &Bound<'_, PyAny>) -> String {
    let t = v
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default();
    let article = if t.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    };
    format!("{article} {t}")
}

/// `e` with `prefix` before its message, when it is one of ours (same class); else `e` as it is.
pub fn prefix_error(py: Python<'_>, e: PyErr, prefix: &str) -> PyErr {
    if !e.is_instance_of::<crate::errors::RoutedExpertsError>(py) {
        return e;
    }
    let msg = e.value(py).str().map(|s| s.to_string()).unwrap_or_default();
    match e.get_type(py).call1((format!("{prefix}{msg}"),)) {
        Ok(v) => PyErr::from_value(v),
        Err(_) => e,
    }
}

/// A name argument (a format, a split, a mode): a str, else a `RoutedExpertsError` naming it.
pub fn word_arg(name: &str, v: &Bound<'_, PyAny>) -> PyResult<String> {
    match v.cast::<PyString>() {
        Ok(s) => Ok(str_utf8(s, name)?.to_owned()),
        Err(_) => Err(routed_experts::Error::field(name, "a str", a_value_of(v)).into()),
    }
}

/// A yes/no argument: True or False (numpy's too), never a truthy int or str taken as one.
pub fn flag_arg(name: &str, v: &Bound<'_, PyAny>) -> PyResult<bool> {
    if v.is_instance_of::<PyBool>() {
        return Ok(v.extract()?);
    }
    let t = v.get_type();
    let module = t.module()?.to_string();
    let type_name = t.name()?.to_string();
    if module == "numpy" && (type_name == "bool" || type_name == "bool_") {
        return Ok(v.is_truthy()?);
    }
    Err(routed_experts::Error::field(name, "True or False", a_value_of(v)).into())
}

fn dtype_named(_name: &str, v: &Bound<'_, PyAny>) -> PyResult<DType> {
    dtype_arg(v)
}

/// A `(start, stop)` pair of counts (a tuple or list of two).
pub fn pair_arg(name: &str, v: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
    let items: Option<Vec<Bound<'_, PyAny>>> =
        if v.is_instance_of::<PyTuple>() || v.is_instance_of::<PyList>() {
            v.try_iter()?.collect::<pyo3::PyResult<Vec<_>>>().ok()
        } else {
            None
        };
    match items.as_deref() {
        Some([a, b]) => Ok((count_arg(name, a)?, count_arg(name, b)?)),
        _ => {
            let shown = v.repr().map(|r| r.to_string()).unwrap_or_default();
            Err(
                routed_experts::Error::field(name, "a (start, stop) pair of integers", shown)
                    .into(),
            )
        }
    }
}
