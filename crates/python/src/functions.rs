//! Module-level functions: merge, response bodies.

use pyo3::prelude::*;

use crate::errors::PyResult;

use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

use super::convert::{self, text_arg};
use super::payload::{payload_arg, RoutedExperts};
use routed_experts::formats::{self, Format, Hints};
use routed_experts::response::{self, MergeOptions};
use routed_experts::{merge as core_merge, DTypeChoice, Payload};

/// A payload argument that must be a `RoutedExperts` (borrowed, never copied); anything else is a
/// `PayloadError` naming the argument.
fn payload_ref<'a, 'py>(
    value: &'a Bound<'py, PyAny>,
    name: &str,
) -> PyResult<&'a Bound<'py, RoutedExperts>> {
    value.cast::<RoutedExperts>().map_err(|_| {
        routed_experts::Error::field(name, "a RoutedExperts", convert::a_value_of(value)).into()
    })
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
    let (p, d) = (
        payload_arg(prefill, "prefill")?,
        payload_arg(decode, "decode")?,
    );
    Ok(RoutedExperts::new(py.detach(|| core_merge::merge(&p, &d))?))
}

pub(crate) fn hints(
    start: Option<u64>,
    num_layers: Option<usize>,
    top_k: Option<usize>,
    dtype: Option<&Bound<'_, PyAny>>,
) -> PyResult<Hints> {
    let dtype = dtype
        .filter(|d| !d.is_none())
        .map(convert::dtype_arg)
        .transpose()?;
    Ok(Hints {
        start,
        num_layers,
        top_k,
        dtype,
    })
}

/// The routing of the choice whose `index` is `choice` in a response body, or None when the body
/// is a response none of whose choices carries routing. A choice the body does not have (a
/// PayloadError of kind "field" naming `choice`), a choice without routing beside choices with
/// it ("rows_lost"), and a body that is no response (`{}`, an error reply, whose message is
/// quoted: "not_response") are errors. Only the routing value is decoded; the rest of the body
/// is skipped.
/// Routing is found where each producer puts it (format.md §3.2: `choices[i].routed_experts`,
/// `choices[i].message`, `choices[i].meta_info`, `sglext`, `meta_info`, `nvext`), in the formats
/// written there; for vLLM 0.21's split shape, the whole sequence (top-level
/// `prompt_routed_experts`, then the choice's rows). The rows are checked against the body's
/// token counts (format.md §3.3), and a routing-like key anywhere else is a PayloadError naming
/// its path. The hints supply what a format does not carry.
#[pyfunction]
#[pyo3(signature = (body, choice = 0, *, start = None, num_layers = None, top_k = None, dtype = None, max_bytes = None))]
#[allow(clippy::too_many_arguments)]
pub fn from_response(
    py: Python<'_>,
    body: &Bound<'_, PyAny>,
    #[pyo3(from_py_with = crate::convert::arg::choice)] choice: u64,
    #[pyo3(from_py_with = crate::convert::opt::start)] start: Option<u64>,
    #[pyo3(from_py_with = crate::convert::opt::num_layers)] num_layers: Option<usize>,
    #[pyo3(from_py_with = crate::convert::opt::top_k)] top_k: Option<usize>,
    dtype: Option<&Bound<'_, PyAny>>,
    #[pyo3(from_py_with = crate::convert::opt::max_bytes)] max_bytes: Option<usize>,
) -> PyResult<Option<RoutedExperts>> {
    let text = convert::body_arg(body, "body")?;
    let hints = hints(start, num_layers, top_k, dtype)?;
    let limit = max_bytes.unwrap_or_else(crate::limits::max_bytes);
    let found = py.detach(|| response::from_response(&text, choice, &hints, limit))?;
    Ok(found.map(RoutedExperts::new))
}

/// Every choice of a response body with routing, as `pack`'s samples: a tuple of the rows it
/// shares with the group's other choices (the prompt's; one object, the same in every tuple
/// that shares it) and its own rows after them, or a tuple of its whole routing when it shares
/// none; ordered by choice index. A GRPO group is so held at its information's size, not `n`
/// copies of its prompt, until it is packed. The shared rows are a shared-prompt answer's
/// `prompt_routed_experts` (format.md §4.1), or, in an answer whose choices each hold their
/// whole sequence, the rows before the prompt's end (the body's `usage.prompt_tokens` or prompt
/// ids) that every such choice holds alike. A choice without routing beside choices with it is
/// a PayloadError (rows lost); a body without routing gives an empty list.
#[pyfunction]
#[pyo3(signature = (body, *, start = None, num_layers = None, top_k = None, dtype = None, max_bytes = None))]
pub fn group_from_response<'py>(
    py: Python<'py>,
    body: &Bound<'py, PyAny>,
    #[pyo3(from_py_with = crate::convert::opt::start)] start: Option<u64>,
    #[pyo3(from_py_with = crate::convert::opt::num_layers)] num_layers: Option<usize>,
    #[pyo3(from_py_with = crate::convert::opt::top_k)] top_k: Option<usize>,
    dtype: Option<&Bound<'py, PyAny>>,
    #[pyo3(from_py_with = crate::convert::opt::max_bytes)] max_bytes: Option<usize>,
) -> PyResult<Vec<Bound<'py, PyTuple>>> {
    let text = convert::body_arg(body, "body")?;
    let hints = hints(start, num_layers, top_k, dtype)?;
    let limit = max_bytes.unwrap_or_else(crate::limits::max_bytes);
    let group = py.detach(|| response::group_from_response(&text, &hints, limit))?;
    group_samples(py, group)
}

/// A group as `pack`'s samples, ordered by choice index: (shared, own) or (whole,) tuples, the
/// shared rows one object in every tuple.
pub(crate) fn group_samples(
    py: Python<'_>,
    mut group: response::Group,
) -> PyResult<Vec<Bound<'_, PyTuple>>> {
    group.choices.sort_by_key(|c| c.index);
    let shared = group
        .shared
        .map(|p| Bound::new(py, RoutedExperts::new(p)))
        .transpose()?;
    let mut samples = Vec::with_capacity(group.choices.len());
    for c in group.choices {
        let own = Bound::new(py, RoutedExperts::new(c.own))?.into_any();
        samples.push(match (&shared, c.shares) {
            (Some(s), true) => PyTuple::new(py, [s.clone().into_any(), own])?,
            _ => PyTuple::new(py, [own])?,
        });
    }
    Ok(samples)
}

/// The decode body with every routing value merged with the prefill routing of the same choice
/// index (a one-choice prefill body serves every decode choice). Every other byte of the decode
/// body is returned unchanged; the merged value is a compact sidecar unless `keep_format`.
///
/// `start`, `num_layers`, `top_k`, `dtype` supply what a format does not carry (vLLM's .npy
/// has no start; SGLang's flat values no shape); `decode_start` gives the decode values' start
/// when it differs from prefill's (a delta). Compact sidecars carry their own start, so the
/// start hints are not applied to them (a router can always pass the requested prompt start).
/// `splice=False` forces the decode/concat/encode path (same result; the flag exists to compare
/// the two). `require_routing=True` refuses a decode body without routing when the prefill body
/// has some (MergeError "missing routing on the decode side"), for proxies. `shared_prompt=True`
/// writes a group's prompt rows once, at the top-level `prompt_routed_experts`, and each choice's
/// own rows after them, all as compact sidecars (format.md §4.1); `from_response` reads each
/// choice whole from it.
#[pyfunction]
#[pyo3(signature = (prefill_body, decode_body, *, start = None, decode_start = None, num_layers = None, top_k = None, dtype = None, keep_format = false, splice = true, max_bytes = None, require_routing = false, shared_prompt = false))]
#[allow(clippy::too_many_arguments)]
pub fn merge_response<'py>(
    py: Python<'py>,
    prefill_body: &Bound<'py, PyAny>,
    decode_body: &Bound<'py, PyAny>,
    #[pyo3(from_py_with = crate::convert::opt::start)] start: Option<u64>,
    #[pyo3(from_py_with = crate::convert::opt::decode_start)] decode_start: Option<u64>,
    #[pyo3(from_py_with = crate::convert::opt::num_layers)] num_layers: Option<usize>,
    #[pyo3(from_py_with = crate::convert::opt::top_k)] top_k: Option<usize>,
    dtype: Option<&Bound<'py, PyAny>>,
    #[pyo3(from_py_with = crate::convert::flag::keep_format)] keep_format: bool,
    #[pyo3(from_py_with = crate::convert::flag::splice)] splice: bool,
    #[pyo3(from_py_with = crate::convert::opt::max_bytes)] max_bytes: Option<usize>,
    #[pyo3(from_py_with = crate::convert::flag::require_routing)] require_routing: bool,
    #[pyo3(from_py_with = crate::convert::flag::shared_prompt)] shared_prompt: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    let (p, d) = (
        convert::body_arg(prefill_body, "prefill_body")?,
        convert::body_arg(decode_body, "decode_body")?,
    );
    let opts = MergeOptions {
        max_bytes: max_bytes.unwrap_or_else(crate::limits::max_bytes),
        splice,
        hints: hints(start, num_layers, top_k, dtype)?,
        decode_start,
        keep_format,
        require_routing,
        // The body is assembled here: nothing is left to write later.
        defer_recode: false,
        shared_prompt,
    };
    let spliced = py.detach(|| response::merge_response_pieces(&p, &d, opts))?;
    // One copy: the pieces (mostly slices of the inputs) go straight into the result bytes.
    crate::bytes_out::bytes_filled(py, spliced.len(), |out| spliced.write_into(out))
}

/// Any routing format of the wild, detected, as a payload: a dict or JSON text of a compact
/// sidecar; `nrlre1:<dtype>:<T>x<L>x<K>:<base64>` (NeMo-RL); base64 of an `.npy` file (vLLM);
/// any other base64 string as SGLang flat values (needs `num_layers` and `top_k`; int32 unless
/// `dtype`); nested lists (lmdeploy); a numpy array. `start` supplies the position a format
/// does not carry; a hint that contradicts the payload is an error, not a guess.
#[pyfunction]
#[pyo3(signature = (value, *, start = None, num_layers = None, top_k = None, dtype = None, max_bytes = None))]
pub fn decode(
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    #[pyo3(from_py_with = crate::convert::opt::start)] start: Option<u64>,
    #[pyo3(from_py_with = crate::convert::opt::num_layers)] num_layers: Option<usize>,
    #[pyo3(from_py_with = crate::convert::opt::top_k)] top_k: Option<usize>,
    dtype: Option<&Bound<'_, PyAny>>,
    #[pyo3(from_py_with = crate::convert::opt::max_bytes)] max_bytes: Option<usize>,
) -> PyResult<RoutedExperts> {
    Ok(RoutedExperts::new(
        decode_any(
            py,
            value,
            &hints(start, num_layers, top_k, dtype)?,
            max_bytes,
        )?
        .1,
    ))
}

/// Decode a Python value of any format, with the format found.
pub fn decode_any(
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    hints: &Hints,
    max_bytes: Option<usize>,
) -> PyResult<(Format, Payload)> {
    let limit = max_bytes.unwrap_or_else(crate::limits::max_bytes);
    if let Ok(p) = value.cast::<RoutedExperts>() {
        let p = p.get().inner.clone();
        formats::check_hints(Format::Compact, &p.header(), hints)?;
        return Ok((Format::Compact, p));
    }
    if let Ok(d) = value.cast::<PyDict>() {
        return Ok((Format::Compact, convert::decode_dict(d, hints, limit)?));
    }
    if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
        // Nested lists (lmdeploy) go through JSON text so that one parser checks them.
        let text = convert::json_text(value, "lists", "nested lists of integers")?;
        return Ok(py.detach(|| formats::decode_text(&text, hints, limit))?);
    }
    if value.hasattr("__array__")? {
        let choice = hints.dtype.map_or(DTypeChoice::Compact, DTypeChoice::Exact);
        let p = convert::payload_from_array(value, hints.start.unwrap_or(0), choice)?;
        formats::check_hints(Format::Lists, &p.header(), hints)?;
        return Ok((Format::Lists, p));
    }
    let text = text_arg(value, "value")?;
    let text = formats::input_text(&text)?;
    Ok(py.detach(|| formats::decode_text(&text, hints, limit))?)
}

/// The payload in `format`: "compact" gives the sidecar dict; "vllm_npy", "sglang" and "nemo"
/// give the str those producers emit; "lists" gives nested lists.
#[pyfunction]
#[pyo3(signature = (payload, format = Format::Compact), text_signature = "(payload, format='compact')")]
pub fn encode<'py>(
    py: Python<'py>,
    payload: &Bound<'py, PyAny>,
    #[pyo3(from_py_with = crate::convert::word::format)] format: Format,
) -> PyResult<Bound<'py, PyAny>> {
    let p = &payload_ref(payload, "payload")?.get().inner;
    if format == Format::Lists {
        check_list_objects(p, crate::limits::max_bytes())?;
    }
    let text = py.detach(|| formats::encode(p, format))?;
    // base64, the nemo envelope and JSON digits are ASCII.
    let s = PyString::new(
        py,
        std::str::from_utf8(&text).expect("encoded formats are ASCII"),
    );
    match format {
        Format::Compact | Format::Lists => Ok(py.import("json")?.getattr("loads")?.call1((s,))?),
        _ => Ok(s.into_any()),
    }
}

/// Nested Python lists cost far more than the payload: 56 bytes per list object (one per token
/// and one per (token, layer)) and an 8-byte pointer per value. Refuse, before building any,
/// lists whose memory would pass the size limit: a `[10**8, 0, 8]` payload holds no values but
/// would be 10**8 lists.
fn check_list_objects(p: &Payload, limit: usize) -> PyResult<()> {
    const LIST_BYTES: usize = 56;
    let s = p.shape();
    let lists = s
        .layers
        .checked_add(1)
        .and_then(|l| l.checked_mul(s.tokens))
        .and_then(|n| n.checked_add(1));
    let bytes = lists
        .and_then(|n| n.checked_mul(LIST_BYTES))
        .and_then(|n| n.checked_add(s.elems().ok()?.checked_mul(8)?));
    match bytes {
        Some(n) if n <= limit => Ok(()),
        _ => Err(routed_experts::Error::malformed(format!(
            "`format`: \"lists\" of shape {} would build {} Python lists and values, over the \
             limit of {limit} bytes (raise it with routed_experts.set_max_bytes)",
            s,
            bytes.map_or("more than 2**64 bytes of".to_string(), |n| format!(
                "{n} bytes of"
            ))
        ))
        .into()),
    }
}

/// The format `decode` would detect for a value: "compact", "vllm_npy", "sglang", "nemo", "lists".
/// Text that is none of them is a PayloadError saying what it looks like (format.md §3.2).
#[pyfunction]
pub fn detect_format(value: &Bound<'_, PyAny>) -> PyResult<&'static str> {
    if value.is_instance_of::<PyDict>() || value.cast::<RoutedExperts>().is_ok() {
        return Ok(Format::Compact.name());
    }
    if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
        return Ok(Format::Lists.name());
    }
    let text = text_arg(value, "value")?;
    Ok(formats::detect(&formats::input_text(&text)?)?.name())
}

/// Pack samples into one batch (format.md §6): `samples` are payloads, trajectories, or integer
/// arrays (numpy, CPU tensors; their rows count from position 0), converted to `dtype` (default
/// int32; int64 on request; None for the smallest that holds them all) and laid end to end.
/// Returns `(batch, cu_seqlens)` (int32, `[0, n0, n0+n1, ...]`), or with `mask=True`
/// `(batch, cu_seqlens, mask)`: a bool per batch row, False for padding, for rows a sample has
/// no routing for, and for rows marked missing (all -1). Those rows are zeros in the batch:
/// no -1 reaches it. `num_tokens` (one count per sample) puts each sample's rows at their
/// positions in a sample of that many tokens (routing covers at most every token; vLLM's last
/// sampled token has none). `pad_each_to_multiple` pads every sample to a multiple of that many
/// rows (counted in `cu_seqlens`: what `shard`'s context parallelism needs); `pad_to_multiple`
/// pads the batch at its end (not counted).
#[pyfunction]
#[pyo3(signature = (samples, dtype = Some(routed_experts::DType::I32), pad_to_multiple = None, *, num_tokens = None, pad_each_to_multiple = None, mask = false), text_signature = "(samples, dtype='int32', pad_to_multiple=None, *, num_tokens=None, pad_each_to_multiple=None, mask=False)")]
pub fn pack<'py>(
    py: Python<'py>,
    samples: &Bound<'py, PyAny>,
    #[pyo3(from_py_with = convert::opt_typed::dtype)] dtype: Option<routed_experts::DType>,
    #[pyo3(from_py_with = convert::opt::pad_to_multiple)] pad_to_multiple: Option<usize>,
    num_tokens: Option<&Bound<'py, PyAny>>,
    #[pyo3(from_py_with = convert::opt::pad_each_to_multiple)] pad_each_to_multiple: Option<usize>,
    #[pyo3(from_py_with = convert::flag::mask)] mask: bool,
) -> PyResult<Bound<'py, PyAny>> {
    use numpy::PyArray1;
    let samples = pack_samples(samples)?;
    let parts: Vec<Vec<&Payload>> = samples.iter().map(Sample::parts).collect();
    let parts: Vec<&[&Payload]> = parts.iter().map(Vec::as_slice).collect();
    let (dtype, layout, first) = packing(
        &parts,
        dtype,
        num_tokens,
        pad_to_multiple,
        pad_each_to_multiple,
    )?;
    let cu: Vec<i64> = layout.cu_seqlens.iter().map(|&c| c as i64).collect();
    let cu_seqlens = PyArray1::from_vec(py, cu).call_method1("astype", ("int32",))?;
    let dims = (layout.rows, first.num_layers(), first.top_k());
    let mut rows_mask = vec![false; if mask { layout.rows } else { 0 }];
    let batch = routed_experts::dtype::with_element!(dtype, D => {
        crate::numpy_out::numpy_filled::<D>(py, dims, |dst| {
            let m = mask.then_some(&mut rows_mask[..]);
            routed_experts::pack::pack_parts_into(&parts, &layout, dst, m)
        })?
    });
    if !mask {
        return Ok(PyTuple::new(py, [batch, cu_seqlens])?.into_any());
    }
    let rows_mask = PyArray1::from_vec(py, rows_mask).into_any();
    Ok(PyTuple::new(py, [batch, cu_seqlens, rows_mask])?.into_any())
}

/// What `pack` and `pack_shard` share: the samples' dtype (`dtype`, or the smallest that holds
/// them all), their layout, and the first sample's first part (its layers and top_k).
fn packing<'a>(
    parts: &[&'a [&'a Payload]],
    dtype: Option<routed_experts::DType>,
    num_tokens: Option<&Bound<'_, PyAny>>,
    pad_to_multiple: Option<usize>,
    pad_each_to_multiple: Option<usize>,
) -> PyResult<(
    routed_experts::DType,
    routed_experts::pack::Layout,
    &'a Payload,
)> {
    let mut payloads = parts.iter().flat_map(|p| p.iter().copied());
    let Some(first) = payloads.next() else {
        return Err(routed_experts::Error::field(
            "samples",
            "at least one sample",
            "an empty list",
        )
        .into());
    };
    let dtype = match dtype {
        Some(dtype) => dtype,
        None => payloads.fold(first.dtype(), |d, p| {
            routed_experts::DType::promote(d, p.dtype())
        }),
    };
    let opts = routed_experts::pack::PackOptions {
        num_tokens: num_tokens
            .map(|n| convert::offsets_arg("num_tokens", n))
            .transpose()?,
        pad_each_to_multiple,
        pad_to_multiple,
    };
    let layout =
        routed_experts::pack::layout_parts(parts, &opts, dtype, crate::limits::max_bytes())?;
    Ok((dtype, layout, first))
}

/// `pack` then `shard` in one pass, without the batch (format.md §6.1): the rank's rows and
/// layers of the batch `pack` would make, written straight into a new array or into `out`.
/// Returns what `shard(*pack(samples, ..., mask=True), ...)` returns: `(batch, cu_seqlens,
/// mask)`, the mask None unless `mask=True`. `out` (reused from step to step; a pinned tensor's
/// `.numpy()`) is a writable C-contiguous numpy array of the pack's dtype holding at least the
/// share's values; the batch returned is a view of its front, every value of it written.
#[pyfunction]
#[pyo3(signature = (samples, dtype = Some(routed_experts::DType::I32), pad_to_multiple = None, *, num_tokens = None, pad_each_to_multiple = None, mask = false, cp_size = 1, cp_rank = 0, cp_split = routed_experts::shard::CpSplit::Zigzag, tp_size = 1, tp_rank = 0, layers = None, out = None), text_signature = "(samples, dtype='int32', pad_to_multiple=None, *, num_tokens=None, pad_each_to_multiple=None, mask=False, cp_size=1, cp_rank=0, cp_split='zigzag', tp_size=1, tp_rank=0, layers=None, out=None)")]
#[allow(clippy::too_many_arguments)]
pub fn pack_shard<'py>(
    py: Python<'py>,
    samples: &Bound<'py, PyAny>,
    #[pyo3(from_py_with = convert::opt_typed::dtype)] dtype: Option<routed_experts::DType>,
    #[pyo3(from_py_with = convert::opt::pad_to_multiple)] pad_to_multiple: Option<usize>,
    num_tokens: Option<&Bound<'py, PyAny>>,
    #[pyo3(from_py_with = convert::opt::pad_each_to_multiple)] pad_each_to_multiple: Option<usize>,
    #[pyo3(from_py_with = convert::flag::mask)] mask: bool,
    #[pyo3(from_py_with = convert::arg::cp_size)] cp_size: usize,
    #[pyo3(from_py_with = convert::arg::cp_rank)] cp_rank: usize,
    #[pyo3(from_py_with = convert::word::cp_split)] cp_split: routed_experts::shard::CpSplit,
    #[pyo3(from_py_with = convert::arg::tp_size)] tp_size: usize,
    #[pyo3(from_py_with = convert::arg::tp_rank)] tp_rank: usize,
    #[pyo3(from_py_with = convert::opt_pair::layers)] layers: Option<(usize, usize)>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Share<'py>> {
    use numpy::PyArray1;
    let samples = pack_samples(samples)?;
    let parts: Vec<Vec<&Payload>> = samples.iter().map(Sample::parts).collect();
    let parts: Vec<&[&Payload]> = parts.iter().map(Vec::as_slice).collect();
    let (dtype, layout, first) = packing(
        &parts,
        dtype,
        num_tokens,
        pad_to_multiple,
        pad_each_to_multiple,
    )?;
    let rank = routed_experts::shard::Rank {
        cp_size,
        cp_rank,
        cp_split,
        tp_size,
        tp_rank,
        layers,
    };
    let (num_layers, top_k) = (first.num_layers(), first.top_k());
    let plan = routed_experts::shard::plan(&layout.cu_seqlens, layout.rows, num_layers, &rank)?;
    let dims = (plan.num_rows(), plan.layers.len(), top_k);
    let mut rows_mask = vec![false; if mask { plan.num_rows() } else { 0 }];
    let batch = routed_experts::dtype::with_element!(dtype, D => {
        let write = |dst: &mut [D]| {
            let m = mask.then_some(&mut rows_mask[..]);
            routed_experts::pack::pack_share_into(&parts, &layout, &plan, dst, m)
        };
        match out {
            None => crate::numpy_out::numpy_filled::<D>(py, dims, write)?,
            Some(out) => convert::fill_out::<D>(out, dims, write)?,
        }
    });
    let cu: Vec<i64> = plan.cu_seqlens.iter().map(|&c| c as i64).collect();
    let cu_seqlens = PyArray1::from_vec(py, cu).call_method1("astype", ("int32",))?;
    let rows_mask = mask.then(|| PyArray1::from_vec(py, rows_mask).into_any());
    Ok((batch, cu_seqlens, rows_mask))
}

/// One of `pack`'s samples: a payload as it is, payloads of consecutive positions (a group's
/// shared rows, then a choice's own: `group_from_response`'s tuples), or the payload made from
/// an array (its rows from position 0).
enum Sample<'py> {
    Held(Bound<'py, RoutedExperts>),
    Parts(Vec<Bound<'py, RoutedExperts>>),
    Owned(Payload),
}

impl Sample<'_> {
    fn parts(&self) -> Vec<&Payload> {
        match self {
            Sample::Held(p) => vec![&p.get().inner],
            Sample::Parts(ps) => ps.iter().map(|p| &p.get().inner).collect(),
            Sample::Owned(p) => vec![p],
        }
    }
}

/// A tuple or list whose first item is a payload: one sample's parts, every item a payload.
fn sample_parts<'py>(s: &Bound<'py, PyAny>, i: usize) -> PyResult<Option<Sample<'py>>> {
    let is_sequence = s.is_instance_of::<PyTuple>() || s.is_instance_of::<PyList>();
    if !is_sequence
        || s.get_item(0)
            .is_ok_and(|f| f.cast::<RoutedExperts>().is_err())
    {
        return Ok(None);
    }
    let mut parts = Vec::new();
    for (k, item) in s.try_iter()?.enumerate() {
        let item = item?;
        let Ok(p) = item.cast_into::<RoutedExperts>() else {
            return Err(routed_experts::Error::field(
                "samples",
                "a sample's parts all payloads",
                format!("sample {i}, part {k}: not a RoutedExperts"),
            )
            .into());
        };
        parts.push(p);
    }
    Ok(Some(Sample::Parts(parts)))
}

/// `pack`'s samples: payloads, trajectories (their payload) and integer arrays.
fn pack_samples<'py>(samples: &Bound<'py, PyAny>) -> PyResult<Vec<Sample<'py>>> {
    if samples.is_instance_of::<pyo3::types::PyString>() || samples.cast::<RoutedExperts>().is_ok()
    {
        return Err(
            routed_experts::Error::field("samples", "a list of samples", "one sample").into(),
        );
    }
    let mut out = Vec::new();
    let Ok(items) = samples.try_iter() else {
        let got = convert::a_value_of(samples);
        return Err(routed_experts::Error::field("samples", "a list of samples", got).into());
    };
    for (i, s) in items.enumerate() {
        let s = s?;
        if let Ok(p) = s.cast::<RoutedExperts>() {
            out.push(Sample::Held(p.clone()));
            continue;
        }
        if let Some(parts) = sample_parts(&s, i)? {
            out.push(parts);
            continue;
        }
        if let Ok(t) = s.cast::<crate::trajectory::Trajectory>() {
            let Ok(p) = t.getattr("payload")?.cast_into::<RoutedExperts>() else {
                return Err(routed_experts::Error::field(
                    "samples",
                    "trajectories with rows",
                    format!("an empty trajectory at {i}"),
                )
                .into());
            };
            out.push(Sample::Held(p));
            continue;
        }
        let choice = routed_experts::DTypeChoice::Compact;
        let p = convert::payload_from_array(&s, 0, choice)
            .map_err(|e| convert::prefix_error(s.py(), e.into(), &format!("sample {i}: ")))?;
        out.push(Sample::Owned(p));
    }
    Ok(out)
}

/// What `shard` returns: the rank's rows, its `cu_seqlens`, its mask rows (None without a mask).
type Share<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Option<Bound<'py, PyAny>>,
);

/// One rank's share of a packed batch (format.md §6.1): `batch` (rows x layers x top_k, any
/// integer dtype, numpy or anything `numpy.asarray` takes without a copy, such as a CPU tensor)
/// and its `cu_seqlens`, cut for context parallelism (`cp_split` "zigzag": rank r takes chunks
/// r and 2 x cp_size - 1 - r of each sample's 2 x cp_size; "contiguous": chunk r of cp_size),
/// then for sequence parallelism (the rank's rows in tp_size equal parts, part tp_rank), then
/// to the layers `(start, stop)`. Returns `(batch, cu_seqlens, mask)` for the rank: a new array
/// of the batch's dtype holding only its rows (the GIL released while copied), int32
/// `cu_seqlens` of the context-parallel rank's sample lengths, and the mask's rows (None without
/// a mask). Rows past `cu_seqlens[-1]` (padding) belong to no sample and are left out.
#[pyfunction]
#[pyo3(signature = (batch, cu_seqlens, mask = None, *, cp_size = 1, cp_rank = 0, cp_split = routed_experts::shard::CpSplit::Zigzag, tp_size = 1, tp_rank = 0, layers = None), text_signature = "(batch, cu_seqlens, mask=None, *, cp_size=1, cp_rank=0, cp_split='zigzag', tp_size=1, tp_rank=0, layers=None)")]
#[allow(clippy::too_many_arguments)]
pub fn shard<'py>(
    py: Python<'py>,
    batch: &Bound<'py, PyAny>,
    cu_seqlens: &Bound<'py, PyAny>,
    mask: Option<&Bound<'py, PyAny>>,
    #[pyo3(from_py_with = convert::arg::cp_size)] cp_size: usize,
    #[pyo3(from_py_with = convert::arg::cp_rank)] cp_rank: usize,
    #[pyo3(from_py_with = convert::word::cp_split)] cp_split: routed_experts::shard::CpSplit,
    #[pyo3(from_py_with = convert::arg::tp_size)] tp_size: usize,
    #[pyo3(from_py_with = convert::arg::tp_rank)] tp_rank: usize,
    #[pyo3(from_py_with = convert::opt_pair::layers)] layers: Option<(usize, usize)>,
) -> PyResult<Share<'py>> {
    use routed_experts::shard::Rank;
    let rank = Rank {
        cp_size,
        cp_rank,
        cp_split,
        tp_size,
        tp_rank,
        layers,
    };
    let cu = convert::offsets_arg("cu_seqlens", cu_seqlens)?;
    let (share, plan, num_rows) = convert::shard_array(batch, &cu, &rank)?;
    let cu: Vec<i64> = plan.cu_seqlens.iter().map(|&c| c as i64).collect();
    let cu_out = numpy::PyArray1::from_vec(py, cu).call_method1("astype", ("int32",))?;
    let mask_out = match mask {
        Some(m) => Some(convert::shard_mask(m, &plan, num_rows)?),
        None => None,
    };
    Ok((share, cu_out, mask_out))
}

/// What a file's bytes are, before they are read as routing (format.md §3.2; the command's
/// messages): `(kind, detail, generated)`, kind one of "empty", "npy", "binary", "routing",
/// "response", "error_reply", "json", "text"; detail the format's name (routing), "routed" or
/// "no routing" (response), the quoted message (error_reply), what it looks like (binary, json,
/// text), or None; generated the tokens a response's choices generated, when it counts them
/// and they agree. Reads no routing.
#[pyfunction]
pub fn _sniff(data: &Bound<'_, PyAny>) -> PyResult<(&'static str, Option<String>, Option<u64>)> {
    use routed_experts::response::Sniffed;
    let text = convert::body_arg(data, "data")?;
    let found = data.py().detach(|| routed_experts::response::sniff(&text));
    let (detail, generated) = match &found {
        Sniffed::Empty | Sniffed::RawNpy => (None, None),
        Sniffed::Routing(format) => (Some(format.name().to_string()), None),
        Sniffed::Response { routed, generated } => {
            let said = if *routed { "routed" } else { "no routing" };
            (Some(said.to_string()), *generated)
        }
        Sniffed::Binary(what)
        | Sniffed::ErrorReply(what)
        | Sniffed::OtherJson(what)
        | Sniffed::Text(what) => (Some(what.clone()), None),
    };
    Ok((found.name(), detail, generated))
}
