//! `RoutedExperts`: an immutable payload whose `array` is a read-only numpy view of the
//! Rust-owned buffer (no copy).

use pyo3::basic::CompareOp;
use pyo3::prelude::*;

use crate::errors::PyResult;

use pyo3::types::{PyBytes, PyDict, PyString, PyTuple};

use std::sync::Arc;

use super::convert;
use numpy::{PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyImportError;
use routed_experts::buffer::AlignedBytes;
use routed_experts::dtype::with_element;
use routed_experts::{limits, sidecar, validate, DType, Payload, Shape};

/// The routing of a contiguous run of token positions: an integer array of shape
/// (num_tokens, num_layers, top_k) whose row 0 is absolute position `start`.
///
/// Immutable. `array` is a read-only zero-copy numpy view; `to_numpy(writable=True)` or
/// `array.copy()` gives an array you may write to.
#[pyclass(frozen, module = "routed_experts._core", name = "RoutedExperts")]
pub struct RoutedExperts {
    pub inner: Payload,
}

impl RoutedExperts {
    pub fn new(inner: Payload) -> Self {
        RoutedExperts { inner }
    }
}

/// A payload argument: a `RoutedExperts`, or a compact sidecar (bytes, str or dict).
pub fn payload_arg(value: &Bound<'_, PyAny>, name: &str) -> PyResult<Payload> {
    match value.cast::<RoutedExperts>() {
        Ok(p) => Ok(p.get().inner.clone()),
        Err(_) => decode_sidecar_obj(value, name, None),
    }
}

/// Decode a compact sidecar given as bytes, str or dict, with the GIL released.
pub fn decode_sidecar_obj(
    value: &Bound<'_, PyAny>,
    name: &str,
    max_bytes: Option<usize>,
) -> PyResult<Payload> {
    let py = value.py();
    let limit = max_bytes.unwrap_or_else(crate::limits::max_bytes);
    if let Ok(d) = value.cast::<PyDict>() {
        return convert::decode_dict(d, &Default::default(), limit);
    }
    let text = convert::text_arg(value, name)?;
    Ok(py.detach(|| sidecar::decode(&text, limit))?)
}

#[pymethods]
impl RoutedExperts {
    /// Decode a compact sidecar `{"data": ..., "shape": [T, L, K], "start": S, "dtype": ...}`
    /// from JSON bytes, a JSON str or an already parsed dict.
    #[staticmethod]
    #[pyo3(signature = (value, *, max_bytes = None))]
    fn from_json(
        value: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = crate::convert::opt::max_bytes)] max_bytes: Option<usize>,
    ) -> PyResult<Self> {
        Ok(Self::new(decode_sidecar_obj(value, "value", max_bytes)?))
    }

    /// Build from an integer array of shape (num_tokens, num_layers, top_k).
    ///
    /// The dtype is the smallest that holds the values (uint8, uint16; int16/int32 with
    /// negatives), or uint8/uint16 by `num_experts`, or `dtype` exactly. A value that does not
    /// fit is an error, never a silent wrap.
    #[staticmethod]
    #[pyo3(signature = (array, start = 0, dtype = None, num_experts = None))]
    fn from_array(
        array: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = crate::convert::arg::start)] start: u64,
        dtype: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = crate::convert::opt::num_experts)] num_experts: Option<u64>,
    ) -> PyResult<Self> {
        let choice = convert::dtype_choice(dtype, num_experts)?;
        Ok(Self::new(convert::payload_from_array(
            array, start, choice,
        )?))
    }

    /// Read-only numpy view (no copy) of shape (num_tokens, num_layers, top_k).
    #[getter]
    fn array<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        readonly_view(slf)
    }

    /// A numpy array you own: `dtype` converts (checked), `writable=True` copies.
    #[pyo3(signature = (dtype = None, *, writable = false))]
    fn to_numpy<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = crate::convert::flag::writable)] writable: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let p = &slf.get().inner;
        let target = dtype
            .map(convert::dtype_arg)
            .transpose()?
            .unwrap_or(p.dtype());
        if target == p.dtype() && !writable {
            return readonly_view(slf);
        }
        new_numpy(slf.py(), p, target)
    }

    /// numpy's array protocol: `np.asarray(p)` is the read-only view (no copy); `copy=True`
    /// or another `dtype` gives an array of its own.
    #[pyo3(signature = (dtype = None, copy = None))]
    fn __array__<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let dtype = dtype.filter(|d| !d.is_none());
        Self::to_numpy(slf, dtype, copy == Some(true))
    }

    #[getter]
    fn start(&self) -> u64 {
        self.inner.start()
    }
    #[getter]
    fn stop(&self) -> u64 {
        self.inner.stop()
    }
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens()
    }
    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }
    #[getter]
    fn top_k(&self) -> usize {
        self.inner.top_k()
    }
    /// The element type as a `numpy.dtype`, as `arr.dtype` is (so both `p.dtype == np.uint8`
    /// and `p.dtype == "uint8"` hold).
    #[getter]
    fn dtype<'py>(&self, py: Python<'py>) -> Bound<'py, numpy::PyArrayDescr> {
        crate::numpy_out::numpy_dtype(py, self.inner.dtype())
    }
    #[getter]
    fn shape(&self) -> (usize, usize, usize) {
        let s = self.inner.shape();
        (s.tokens, s.layers, s.top_k)
    }
    /// Bytes of the decoded array.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.bytes().len()
    }

    fn __len__(&self) -> usize {
        self.inner.num_tokens()
    }

    /// Canonical compact sidecar as JSON bytes: key order data, shape, start, dtype; no spaces.
    fn to_json<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let p = &self.inner;
        crate::bytes_out::bytes_filled(py, sidecar::encoded_len(p), |out| {
            sidecar::encode_into(p, out);
            Ok(())
        })
    }

    /// The compact sidecar as a dict {"data": str, "shape": [T, L, K], "start": S, "dtype": str}.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let p = &self.inner;
        let d = PyDict::new(py);
        let b64 = py.detach(|| routed_experts::sidecar::data_base64(p));
        // base64 output is ASCII, hence valid UTF-8.
        let text = std::str::from_utf8(&b64).expect("base64 is ASCII");
        d.set_item("data", PyString::new(py, text))?;
        d.set_item("shape", vec![p.num_tokens(), p.num_layers(), p.top_k()])?;
        d.set_item("start", p.start())?;
        d.set_item("dtype", p.dtype().name())?;
        Ok(d)
    }

    /// The rows for absolute positions [start, stop) (Python slice semantics are not used:
    /// both bounds are positions in the request's token sequence and must lie inside).
    fn slice(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::convert::arg::start)] start: u64,
        #[pyo3(from_py_with = crate::convert::arg::stop)] stop: u64,
    ) -> PyResult<Self> {
        let p = &self.inner;
        Ok(Self::new(py.detach(|| p.slice(start, stop))?))
    }

    /// The same routing in another dtype; a value that does not fit raises PayloadError.
    fn astype(&self, py: Python<'_>, dtype: &Bound<'_, PyAny>) -> PyResult<Self> {
        let d = convert::dtype_arg(dtype)?;
        let p = &self.inner;
        Ok(Self::new(py.detach(|| p.astype(d))?))
    }

    /// Raise PayloadError at the first failing check, naming its position and layer: ids
    /// negative or `>= num_experts`; an expert twice in one token's top_k (`duplicates`); a
    /// token row that is zero in every layer (`zero_rows`: lost prompt rows in P/D serving); a
    /// row marked missing, all -1 (`missing_rows`, off by default: missing routes are data).
    /// The -1s of a missing row are never called ids out of range.
    #[pyo3(signature = (num_experts = None, duplicates = true, zero_rows = true, missing_rows = false))]
    fn validate(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::convert::opt::num_experts)] num_experts: Option<u64>,
        #[pyo3(from_py_with = crate::convert::flag::duplicates)] duplicates: bool,
        #[pyo3(from_py_with = crate::convert::flag::zero_rows)] zero_rows: bool,
        #[pyo3(from_py_with = crate::convert::flag::missing_rows)] missing_rows: bool,
    ) -> PyResult<()> {
        let checks = validate::Checks {
            num_experts,
            duplicates,
            zero_rows,
            missing_rows,
        };
        let p = &self.inner;
        Ok(py.detach(|| validate::validate(p, &checks))?)
    }

    /// The same checks as `validate`, counted instead of raised: a dict of counts and the first
    /// (position, layer, value) of each kind (None where there is none). Missing rows are
    /// always counted; they make `ok` False only with `missing_rows=True`.
    #[pyo3(signature = (num_experts = None, duplicates = true, zero_rows = true, missing_rows = false))]
    fn validation_report<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = crate::convert::opt::num_experts)] num_experts: Option<u64>,
        #[pyo3(from_py_with = crate::convert::flag::duplicates)] duplicates: bool,
        #[pyo3(from_py_with = crate::convert::flag::zero_rows)] zero_rows: bool,
        #[pyo3(from_py_with = crate::convert::flag::missing_rows)] missing_rows: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let checks = validate::Checks {
            num_experts,
            duplicates,
            zero_rows,
            missing_rows,
        };
        let p = &self.inner;
        let r = py.detach(|| validate::report(p, &checks));
        let d = PyDict::new(py);
        d.set_item("ok", r.is_clean(&checks))?;
        d.set_item("out_of_range", r.out_of_range)?;
        d.set_item("first_out_of_range", r.first_out_of_range)?;
        d.set_item("duplicates", r.duplicates)?;
        d.set_item("first_duplicate", r.first_duplicate)?;
        d.set_item("zero_rows", r.zero_rows)?;
        d.set_item("first_zero_row", r.first_zero_row)?;
        d.set_item("missing_rows", r.missing_rows)?;
        d.set_item("first_missing_row", r.first_missing_row)?;
        Ok(d)
    }

    /// A torch tensor the trainer may write to (its own memory, never a read-only view), of
    /// `torch.int32` (default) or `torch.int64`, the dtypes torch indexes with, whatever the
    /// payload's dtype: a uint16 payload (Kimi K2) becomes int32. Other dtypes are refused:
    /// torch has no `max` or `arange` for uint16 and reads uint8 index tensors as masks.
    /// Needs PyTorch.
    #[pyo3(signature = (dtype = None))]
    fn to_torch<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let torch = py.import("torch").map_err(|_| {
            PyImportError::new_err("RoutedExperts.to_torch needs PyTorch: pip install torch")
        })?;
        let target = match dtype {
            None => DType::I32,
            // torch dtypes print as "torch.int32": the part after the dot is numpy's name.
            Some(d) => {
                let name = d.str()?.to_cow()?.trim_start_matches("torch.").to_owned();
                match DType::parse(&name)? {
                    t @ (DType::I32 | DType::I64) => t,
                    other => {
                        return Err(routed_experts::Error::field(
                            "dtype",
                            "torch.int32 or torch.int64 (the dtypes torch indexes with)",
                            other,
                        )
                        .into())
                    }
                }
            }
        };
        let arr = new_numpy(py, &slf.get().inner, target)?;
        Ok(torch.getattr("from_numpy")?.call1((arr,))?)
    }

    /// The positional transport tuple `(data: bytes, shape: [T, L, K], dtype: str)` of
    /// prime-rl's msgspec `RoutedExperts` struct (raw little-endian bytes, no base64).
    fn to_transport<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let p = &self.inner;
        let shape = vec![p.num_tokens(), p.num_layers(), p.top_k()];
        Ok((PyBytes::new(py, p.bytes()), shape, p.dtype().name()).into_pyobject(py)?)
    }

    /// From the transport tuple `(data, shape, dtype)`, or any object with those three
    /// attributes (prime-rl's msgspec `RoutedExperts` struct itself); `start` supplies the
    /// position it does not carry. `data` is any buffer (bytes, memoryview, numpy array),
    /// copied once into aligned memory.
    #[staticmethod]
    #[pyo3(signature = (value, start = 0))]
    fn from_transport(
        py: Python<'_>,
        value: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = crate::convert::arg::start)] start: u64,
    ) -> PyResult<Self> {
        let fields = ["data", "shape", "dtype"];
        let parts = if fields.iter().all(|f| value.hasattr(*f).unwrap_or(false))
            && !value.is_instance_of::<PyTuple>()
        {
            PyTuple::new(
                py,
                fields
                    .map(|f| value.getattr(f))
                    .into_iter()
                    .collect::<pyo3::PyResult<Vec<_>>>()?,
            )?
            .into_any()
        } else {
            value.clone()
        };
        let (data, shape, dtype): (Bound<'_, PyAny>, Vec<usize>, String) =
            parts.extract().map_err(|_| {
                routed_experts::Error::field(
                    "value",
                    "a tuple (data: bytes, shape: [T, L, K], dtype: str) or an object with \
                     those attributes",
                    // The type, not the repr: a transport tuple holds megabytes of bytes.
                    value
                        .get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_default(),
                )
            })?;
        let [t, l, k] = shape[..] else {
            return Err(routed_experts::Error::field(
                "shape",
                "three integers [num_tokens, num_layers, top_k]",
                format!("{shape:?}"),
            )
            .into());
        };
        _from_raw(py, &data, (t, l, k), start, &dtype)
    }

    fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> PyResult<Py<PyAny>> {
        let py = other.py();
        let Ok(other) = other.cast::<RoutedExperts>() else {
            return Ok(py.NotImplemented());
        };
        let same = self.inner.same_routing(&other.get().inner);
        match op {
            CompareOp::Eq => Ok(same.into_pyobject(py)?.to_owned().into_any().unbind()),
            CompareOp::Ne => Ok((!same).into_pyobject(py)?.to_owned().into_any().unbind()),
            _ => Ok(py.NotImplemented()),
        }
    }

    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "RoutedExperts(start={}, stop={}, shape=({}, {}, {}), dtype='{}')",
            p.start(),
            p.stop(),
            p.num_tokens(),
            p.num_layers(),
            p.top_k(),
            p.dtype()
        )
    }

    /// Pickle: the raw bytes travel as a PickleBuffer under protocol 5 (out of band for Ray's
    /// object store), as bytes otherwise.
    fn __reduce_ex__<'py>(slf: &Bound<'py, Self>, protocol: u32) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let p = &slf.get().inner;
        let data: Bound<'py, PyAny> = if protocol >= 5 {
            let flat = readonly_view(slf)?.call_method1("reshape", (-1,))?;
            let view = flat.call_method1("view", ("uint8",))?;
            py.import("pickle")?
                .getattr("PickleBuffer")?
                .call1((view,))?
        } else {
            PyBytes::new(py, p.bytes()).into_any()
        };
        let rebuild = py.import("routed_experts._core")?.getattr("_from_raw")?;
        let args = (
            data,
            (p.num_tokens(), p.num_layers(), p.top_k()),
            p.start(),
            p.dtype().name(),
        );
        Ok(PyTuple::new(
            py,
            [rebuild, args.into_pyobject(py)?.into_any()],
        )?)
    }
}

/// Rebuild a payload from raw native bytes (pickle's constructor, and the transport tuple's):
/// the length is checked against the shape first. The bytes are viewed without a copy when
/// their exporter can never change them (`immutable_exporter`) and they are aligned; otherwise
/// they are copied once into aligned memory.
#[pyfunction]
pub fn _from_raw(
    py: Python<'_>,
    data: &Bound<'_, PyAny>,
    shape: (usize, usize, usize),
    #[pyo3(from_py_with = crate::convert::arg::start)] start: u64,
    dtype: &str,
) -> PyResult<RoutedExperts> {
    let dtype = DType::parse(dtype)?;
    let shape = Shape::new(shape.0, shape.1, shape.2);
    limits::check_shape(shape, dtype, crate::limits::max_bytes())?;
    let want = shape.nbytes(dtype)?;
    let arr = bytes_of_buffer(py, data)?;
    if arr.len() != want {
        let msg = format!("{want} bytes for shape {shape} of {dtype}");
        let got = format!("{} bytes", arr.len());
        return Err(routed_experts::Error::field("data", msg, got).into());
    }
    let ptr = arr.data().cast_const();
    let writeable: bool = arr.getattr("flags")?.getattr("writeable")?.extract()?;
    let viewable = !writeable
        && arr.is_c_contiguous()
        && !ptr.is_null()
        && ptr as usize % 8 == 0
        && immutable_exporter(data)?;
    let bytes = if viewable {
        let owner: Arc<dyn Send + Sync> = Arc::new(arr.unbind());
        // SAFETY: `ptr` is the start of the array's `want` contiguous bytes (checked above);
        // the array views the exporter's buffer and holds it (numpy keeps the exporter alive
        // through the array's base), and the exporter is `bytes` or a sealed Ray object, whose
        // memory never changes. `owner` keeps the array alive: valid and unchanged while
        // `owner` lives, which is from_shared's contract. Non-null and 8-aligned, checked above.
        unsafe { AlignedBytes::from_shared(ptr, want, owner) }
            .ok_or_else(|| routed_experts::Error::malformed("a shared buffer is not 8-aligned"))?
    } else {
        let mut copy = AlignedBytes::zeroed(want);
        // SAFETY: the array's `want` bytes at `ptr` are contiguous (numpy.frombuffer only makes
        // contiguous arrays) and stay valid while we hold `arr`; we keep the GIL for the copy,
        // so no Python code can write to a mutable exporter (a bytearray) meanwhile.
        let src = unsafe { std::slice::from_raw_parts(ptr, want) };
        copy.as_mut_bytes().copy_from_slice(src);
        copy
    };
    Ok(RoutedExperts::new(Payload::new(
        start, shape, dtype, bytes,
    )?))
}

/// `data`'s buffer as a one-dimensional uint8 numpy array, whatever its item format. numpy
/// reads the buffer protocol for us: PyO3's buffer API is outside the abi3-py39 limited API.
/// A buffer numpy cannot view as contiguous bytes (a strided memoryview) is copied to one.
fn bytes_of_buffer<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, numpy::PyArray1<u8>>> {
    let frombuffer = py.import("numpy")?.getattr("frombuffer")?;
    let arr = match frombuffer.call1((data, "uint8")) {
        Ok(arr) => arr,
        Err(_) => {
            let flat = py
                .import("builtins")?
                .getattr("memoryview")?
                .call1((data,))?
                .call_method0("tobytes")?;
            frombuffer.call1((flat, "uint8"))?
        }
    };
    Ok(arr.cast_into::<numpy::PyArray1<u8>>()?)
}

/// Whether `data`'s memory can never change: a `bytes`, or a buffer of Ray's object store
/// (sealed objects are immutable), directly or behind a read-only memoryview. A read-only
/// buffer alone is not enough: `memoryview(bytearray).toreadonly()` is read-only to us while
/// its owner may still write.
fn immutable_exporter(data: &Bound<'_, PyAny>) -> PyResult<bool> {
    if data.is_exact_instance_of::<PyBytes>() {
        return Ok(true);
    }
    if data.is_instance_of::<pyo3::types::PyMemoryView>() {
        return immutable_exporter(&data.getattr("obj")?);
    }
    let module = data.get_type().module()?;
    Ok(module.to_cow()? == "ray._raylet")
}

/// A read-only numpy view of `slf`'s buffer that keeps `slf` alive.
fn readonly_view<'py>(slf: &Bound<'py, RoutedExperts>) -> PyResult<Bound<'py, PyAny>> {
    let p = &slf.get().inner;
    let s = p.shape();
    with_element!(p.dtype(), T => {
        let values = p.values::<T>();
        // SAFETY: a payload's buffer holds exactly tokens * layers * top_k values of its dtype,
        // 8-aligned (AlignedBytes); the payload is frozen, so never mutated or freed while `slf`,
        // the view's base, lives.
        unsafe { crate::numpy_out::readonly_array::<T>(slf.as_any(), (s.tokens, s.layers, s.top_k), values.as_ptr()) }
    })
}

/// A new writable numpy array (numpy owns it) filled with `p`'s values as `dtype`, converted
/// straight into numpy's buffer with the GIL released.
pub fn new_numpy<'py>(py: Python<'py>, p: &Payload, dtype: DType) -> PyResult<Bound<'py, PyAny>> {
    let s = p.shape();
    with_element!(dtype, D => {
        crate::numpy_out::numpy_filled::<D>(py, (s.tokens, s.layers, s.top_k), |dst| p.write_as(dst))
    })
}
