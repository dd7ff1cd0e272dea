"""Every format in the wild (format.md §3.2): interop vectors, round trips, malformed input,
bodies."""

from __future__ import annotations

import base64
import io
import json
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import routed_experts as rx
from conftest import DTYPES, assert_payload, vector_params

HINT_KEYS = ("start", "num_layers", "top_k")


@pytest.mark.parametrize("case", vector_params("interop"))
def test_interop_vector(case: dict[str, Any]) -> None:
    hints = {k: case[k] for k in HINT_KEYS if k in case}
    assert rx.detect_format(case["input"]) == case["format"]
    p = rx.decode(case["input"], **hints)
    assert_payload(p, case["expect"])
    # Encoding back gives the producer's bytes (lists: the same lists).
    if case["format"] == "lists":
        assert rx.encode(p, "lists") == case["input"]
    elif case["format"] == "sglang":
        assert rx.encode(p, "sglang") == case["input"]  # SGLang emits int32
    else:
        assert rx.encode(p, case["format"]) == case["input"]


def npy_base64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode()


@st.composite
def arrays(draw: st.DrawFn, dtypes: list[str]) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    shape = draw(st.tuples(st.integers(0, 6), st.integers(1, 4), st.integers(1, 4)))
    return draw(hnp.arrays(dtype, shape))


@settings(max_examples=200, deadline=None)
@given(
    arr=arrays(DTYPES),
    start=st.integers(0, 10**6),
)
def test_vllm_npy_is_byte_compatible_with_np_save(arr: np.ndarray, start: int) -> None:
    text = npy_base64(arr)
    p = rx.decode(text, start=start)
    assert p.start == start and p.dtype == str(arr.dtype)
    np.testing.assert_array_equal(p.array, arr)
    assert rx.encode(p, "vllm_npy") == text


@settings(max_examples=300, deadline=None)
@given(arr=arrays(DTYPES), start=st.integers(0, 10**6))
def test_every_format_round_trips(arr: np.ndarray, start: int) -> None:
    p = rx.RoutedExperts.from_array(arr, start=start, dtype=arr.dtype)
    _, layers, top_k = arr.shape
    # compact and vLLM's .npy carry the dtype: it comes back as it went.
    for fmt in ("compact", "vllm_npy"):
        back = rx.decode(rx.encode(p, fmt), start=start, num_layers=layers, top_k=top_k)
        assert back == p and back.dtype == p.dtype, fmt
        assert (back.start, back.shape) == (start, arr.shape), fmt
    # SGLang's int32 and NeMo-RL's carry at most int32: a value beyond it is refused when
    # written, never wrapped. Nested lists write any integer; read without a dtype they take
    # at most int32, and a wider value asks for one.
    fits = arr.size == 0 or (int(arr.min()) >= -(2**31) and int(arr.max()) < 2**31)
    for fmt in ("sglang", "nemo", "lists"):
        if not fits and fmt != "lists":
            with pytest.raises(rx.PayloadError, match="expected values that fit int32"):
                rx.encode(p, fmt)
            continue
        if not fits:
            text = rx.encode(p, fmt)
            with pytest.raises(rx.PayloadError, match="pass an explicit dtype for wider ids"):
                rx.decode(text, start=start)
            back = rx.decode(text, start=start, dtype=str(arr.dtype))
            assert back == p and back.dtype == p.dtype
            continue
        text = rx.encode(p, fmt)
        if text == "":  # SGLang's zero rows: handed over whole, empty input is refused
            with pytest.raises(rx.PayloadError, match="empty input"):
                rx.decode(text, start=start, num_layers=layers, top_k=top_k)
            continue
        back = rx.decode(text, start=start, num_layers=layers, top_k=top_k)
        assert back == p, fmt
        assert (back.start, back.shape) == (start, arr.shape), fmt
    # SGLang carries int32; hints pick another dtype.
    if arr.size and arr.min() >= 0 and arr.max() <= 65535:
        flat16 = base64.b64encode(arr.astype("<u2").tobytes()).decode()
        p16 = rx.decode(flat16, num_layers=layers, top_k=top_k, dtype="uint16", start=start)
        assert p16 == p


def test_nemo_matches_the_envelope_layout() -> None:
    p = rx.RoutedExperts.from_array(np.array([[[1, 2, 3]], [[4, 5, 6]]]))
    text = rx.encode(p, "nemo")
    assert text == "nrlre1:int8:2x1x3:" + base64.b64encode(bytes([1, 2, 3, 4, 5, 6])).decode()
    wide = rx.RoutedExperts.from_array(np.array([[[300]]]))
    assert rx.encode(wide, "nemo").startswith("nrlre1:int16:1x1x1:")


@pytest.mark.parametrize(
    ("value", "hints", "needle"),
    [
        (
            "nrlre1:int8:2x1:AAAA",
            {},
            "nemo: expected nrlre1:<dtype>:<T>x<L>x<K>:<base64>, got 2 dimensions",
        ),
        ("nrlre1:uint8:1x1x3:AAAA", {}, 'nemo: expected .*, got dtype "uint8"'),
        ("nrlre1:int8:1x1x3", {}, "fewer than 4"),
        ("nrlre1:int8:1x1x4:AAAA", {}, "nemo data"),
        ("AAAAAAAA", {}, "sglang: flat base64 values carry no shape"),
        (
            "AAAAAAAA",
            {"num_layers": 4, "top_k": 2},
            "sglang: 6 bytes is not a whole number of rows",
        ),
        ("AAAA*AAA", {"num_layers": 1, "top_k": 1, "dtype": "uint8"}, "not routing .*plain text"),
        # Past the sniffed head, the decoder reads every byte and names the bad one.
        (
            "A" * 8000 + "*AAA" + "A" * 4,
            {"num_layers": 1, "top_k": 1, "dtype": "uint8"},
            "sglang.*got '\\*' at offset 8000",
        ),
        ("k05VTVBZAQB2", {}, "vllm_npy"),
        ("k05VTVBZAQB2AHsnZGVzY3I=", {}, "vllm_npy: header says 118 bytes"),
        ([[[1, 2]], [[3]]], {}, "lists: expected a rectangular .* got top_k 1 at token 1, layer 0"),
        ([[[1, 2.5]]], {}, "lists: .* got 2.5 at token 0, layer 0"),
        ([[1, 2]], {}, "lists: .* got a non-list at token 0, layer 0"),
    ],
)
def test_malformed_inputs_name_the_format(value: Any, hints: dict[str, Any], needle: str) -> None:
    with pytest.raises(rx.PayloadError, match=needle):
        rx.decode(value, **hints)


def npy_with_header(header: str, data: bytes = b"", version: int = 1) -> str:
    head = header.encode()
    size = struct.pack("<H", len(head)) if version == 1 else struct.pack("<I", len(head))
    return base64.b64encode(b"\x93NUMPY" + bytes([version, 0]) + size + head + data).decode()


@pytest.mark.parametrize(
    ("header", "needle"),
    [
        ("{'descr': '|O', 'fortran_order': False, 'shape': (1, 1, 1), }", "pickled object arrays"),
        ("{'descr': '>u2', 'fortran_order': False, 'shape': (1, 1, 1), }", "big-endian"),
        ("{'descr': '<u2', 'fortran_order': True, 'shape': (1, 1, 1), }", "Fortran-ordered"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1), }", "integer dtype"),
        ("{'descr': '|u1', 'fortran_order': False, 'shape': (4,), }", "3-dimensional"),
        ("{'descr': '|u1', 'fortran_order': False, 'shape': (1, 1, 2), }", "expected 2 data bytes"),
    ],
)
def test_npy_rejections(header: str, needle: str) -> None:
    with pytest.raises(rx.PayloadError, match=needle):
        rx.decode(npy_with_header(header, b"\x01"))


def test_npy_version_2_header() -> None:
    header = "{'descr': '<i2', 'fortran_order': False, 'shape': (1, 1, 2), }"
    p = rx.decode(npy_with_header(header, struct.pack("<hh", -1, 7), version=2))
    assert p.dtype == "int16" and p.array.tolist() == [[[-1, 7]]]


@settings(max_examples=1000, deadline=None)
@given(
    header=st.text(max_size=120), data=st.binary(max_size=40), version=st.sampled_from([1, 2, 3, 4])
)
def test_npy_parser_never_crashes_on_arbitrary_headers(
    header: str, data: bytes, version: int
) -> None:
    _accepted_as_numpy_reads_it(npy_with_header(header, data, version=version))


def _accepted_as_numpy_reads_it(text: str) -> None:
    """Refused with a PayloadError, or read as numpy's own np.load reads the same file."""
    try:
        p = rx.decode(text)
    except rx.PayloadError:
        return
    want = np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)
    assert p.dtype == want.dtype.name and p.shape == want.shape
    np.testing.assert_array_equal(p.to_numpy(), want)


@settings(max_examples=500, deadline=None)
@given(
    descr=st.sampled_from(["|u1", "<u2", "<i4", "<i8", ">i4", "|O", "<f8", "u1", "'"]),
    fortran=st.sampled_from(["False", "True", "0", ""]),
    dims=st.lists(st.integers(-2, 2**40), max_size=4),
    data=st.binary(max_size=64),
)
def test_npy_parser_never_crashes_on_structured_headers(
    descr: str, fortran: str, dims: list[int], data: bytes
) -> None:
    shape = "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"
    header = f"{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, }}"
    _accepted_as_numpy_reads_it(npy_with_header(header, data))


def test_wrong_hints_are_errors_not_guesses() -> None:
    p = rx.RoutedExperts.from_array(np.ones((2, 3, 4), dtype=np.int64), start=5)
    with pytest.raises(
        rx.PayloadError, match=r"`start`: expected 6 \(as given\), got 5 in the compact payload"
    ):
        rx.decode(p.to_json(), start=6)
    with pytest.raises(rx.PayloadError, match="`top_k`: expected 2"):
        rx.decode(rx.encode(p, "vllm_npy"), top_k=2)
    with pytest.raises(rx.PayloadError, match="`dtype`: expected uint16"):
        rx.decode(rx.encode(p, "nemo"), dtype="uint16")
    # A sidecar without `start` (older producers) takes the hint.
    old = {k: v for k, v in p.to_dict().items() if k != "start"}
    assert rx.decode(old, start=9).start == 9
    assert rx.decode(old).start == 0


def test_decode_accepts_payloads_arrays_and_json_strings() -> None:
    p = rx.RoutedExperts.from_array(np.arange(6, dtype=np.int64).reshape(1, 2, 3), start=2)
    assert rx.decode(p) == p
    assert rx.decode(p.array, start=2) == p
    assert rx.decode(p.to_json().decode()) == p
    assert rx.decode(p.to_json()) == p


def _body(location: str, value: Any, index: int = 0, extra: Any = None) -> bytes:
    if location == "choices":
        doc: Any = {"choices": [{"index": index, "text": "x", "routed_experts": value}]}
    elif location == "message":
        message = {"role": "assistant", "content": "x", "routed_experts": value}
        doc = {"choices": [{"index": index, "message": message}]}
    elif location == "sglext":
        doc = {"choices": [{"index": index, "message": {"content": "x"}}], "sglext": {
            "routed_experts": value}}
    elif location == "meta_info":
        doc = {"text": "x", "meta_info": {"id": "r", "routed_experts": value, **(extra or {})}}
    else:
        doc = {"id": "x", "nvext": {"routed_experts": value}}
    return json.dumps(doc).encode()


# The formats each place's producers write there (format.md §3.2); compact is our own output,
# allowed everywhere. Any other pair is refused, naming the place and what is written there.
WRITTEN_AT = {
    "choices": {"compact", "vllm_npy", "lists"},
    "message": {"compact", "nemo", "lists"},
    "sglext": {"compact", "sglang", "lists"},
    "meta_info": {"compact", "sglang", "lists"},
    "nvext": {"compact", "sglang", "vllm_npy"},
}


def _filler_row(fmt: str, location: str) -> bool:
    """NeMo-RL's values (nrlre1, or nested lists at its place) end in a filler row."""
    return fmt == "nemo" or (fmt == "lists" and location == "message")


def _as_written(p: rx.RoutedExperts, fmt: str, location: str) -> Any:
    """A value as its producer writes it: NeMo-RL adds a filler last row (0..top_k-1)."""
    if _filler_row(fmt, location):
        filler = np.tile(np.arange(p.top_k), (1, p.num_layers, 1))
        p = rx.RoutedExperts.from_array(np.concatenate([p.array, filler]), dtype="int16")
    return rx.encode(p, fmt)


@pytest.mark.parametrize("location", sorted(WRITTEN_AT))
@pytest.mark.parametrize("fmt", ["compact", "vllm_npy", "nemo", "sglang", "lists"])
def test_bodies_carry_routing_where_each_format_is_written(location: str, fmt: str) -> None:
    truth = np.random.default_rng(1).integers(0, 128, size=(9, 3, 2))
    prefill = rx.RoutedExperts.from_array(truth[:5])
    decode = rx.RoutedExperts.from_array(truth, num_experts=128)
    hints = {"num_layers": 3, "top_k": 2} if fmt == "sglang" else {}
    pb = _body(location, _as_written(prefill, fmt, location))
    db = _body(location, _as_written(decode, fmt, location))
    if fmt not in WRITTEN_AT[location]:
        for call in (lambda: rx.from_response(db, **hints),
                     lambda: rx.merge_response(pb, db, **hints)):
            with pytest.raises(rx.PayloadError, match=f"read as {fmt} where producers write"):
                call()
        return
    got = rx.from_response(db, **hints)
    assert got is not None and np.array_equal(got.array, decode.array)
    merged = rx.merge_response(pb, db, **hints)
    assert rx.from_response(merged) == rx.RoutedExperts.from_array(truth)
    assert rx.detect_format(json.dumps(json.loads(merged))) == "compact"
    kept = rx.merge_response(pb, db, keep_format=True, **hints)
    again = rx.from_response(kept, **hints)
    assert again is not None and np.array_equal(again.array, truth)
    # keep_format keeps the decode value's format (NeMo-RL's filler row included).
    kept_value = _routing_at(json.loads(kept), location)
    text = kept_value if isinstance(kept_value, str) else json.dumps(kept_value)
    assert rx.detect_format(text) == fmt
    if _filler_row(fmt, location):
        assert rx.decode(kept_value).num_tokens == truth.shape[0] + 1


def _routing_at(doc: Any, location: str) -> Any:
    if location == "choices":
        return doc["choices"][0]["routed_experts"]
    if location == "message":
        return doc["choices"][0]["message"]["routed_experts"]
    return doc[location]["routed_experts"]


def test_sglang_meta_info_names_its_dtype_and_batches_are_lists() -> None:
    arr = np.arange(12, dtype=np.uint16).reshape(2, 3, 2) * 100
    flat = base64.b64encode(arr.tobytes()).decode()
    body = _body("meta_info", flat, extra={"routed_experts_dtype": "uint16"})
    p = rx.from_response(body, num_layers=3, top_k=2)
    assert p is not None and p.dtype == "uint16" and p.array.tolist() == arr.tolist()
    batch = json.dumps([json.loads(body), {"text": "y", "meta_info": {}}, json.loads(body)])
    assert rx.from_response(batch, choice=2, num_layers=3, top_k=2) == p
    with pytest.raises(rx.PayloadError, match="choice 1 carries no routing beside") as e:
        rx.from_response(batch, choice=1, num_layers=3, top_k=2)
    assert e.value.kind == "rows_lost"


def test_vllm_npy_delta_decode_needs_its_start() -> None:
    # vLLM's .npy carries no start: the router supplies the prompt start and the delta's start.
    truth = np.random.default_rng(2).integers(0, 128, size=(9, 3, 2))
    pb = _body("choices", rx.encode(rx.RoutedExperts.from_array(truth[2:5], start=2), "vllm_npy"))
    db = _body("choices", rx.encode(rx.RoutedExperts.from_array(truth[4:], start=4), "vllm_npy"))
    merged = rx.merge_response(pb, db, start=2, decode_start=4)
    out = rx.from_response(merged)
    assert out is not None and out.start == 2
    np.testing.assert_array_equal(out.array, truth[2:])


NOT_ROUTING = [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "a PNG image"),
    (b"\x1f\x8b\x08\x00\x00\x00", "gzip-compressed data"),
    (b"\x00\x01\x02\xff\xfe", "binary data of 5 bytes, starting 00 01 02 ff fe"),
    ("not routing at all!", 'plain text of 19 bytes, "not routing at all!"'),
    ("root:x:0:0:root:/root:/bin/bash\n", "plain text of 31 bytes"),
    ('data: {"choices":[]}\n\ndata: [DONE]\n\n', "server-sent event stream"),
    ("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{}", "HTTP response"),
    ("AAAAAAA", "7 base64 characters, not a whole number of 4-character groups"),
    (" \n", "only whitespace"),
]


@pytest.mark.parametrize(("value", "said"), NOT_ROUTING)
def test_what_is_not_routing_is_called_what_it_is(value: str | bytes, said: str) -> None:
    # Not guessed to be SGLang, with or without SGLang's hints.
    # Handed over whole, white space alone is empty input; in a body, it is named as text.
    whole = "empty input" if not value.strip() else "not routing in any known format"
    for hints in ({}, {"num_layers": 1, "top_k": 1, "dtype": "uint8"}):
        with pytest.raises(rx.PayloadError) as e:
            rx.decode(value, **hints)
        assert str(e.value).startswith(whole), str(e.value)
        assert whole == "empty input" or said in str(e.value), str(e.value)
    with pytest.raises(rx.PayloadError, match=whole):
        rx.detect_format(value)
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    body = json.dumps({"text": "x", "meta_info": {"routed_experts": text}})
    with pytest.raises(rx.PayloadError, match="meta_info.routed_experts: not routing"):
        rx.from_response(body, num_layers=1, top_k=1, dtype="uint8")


@settings(max_examples=300)
@given(data=st.binary(min_size=1, max_size=600))
def test_base64_of_any_bytes_is_read_as_sglang(data: bytes) -> None:
    text = base64.b64encode(data)
    expected = "vllm_npy" if text.startswith(b"k05VTVBZ") else "sglang"
    assert rx.detect_format(text) == expected


@settings(max_examples=300)
@given(text=st.text(max_size=200))
def test_sglang_is_chosen_only_for_text_that_reads_as_base64(text: str) -> None:
    try:
        fmt = rx.detect_format(text)
    except rx.PayloadError as e:
        said = ("not routing in any known format", "empty input", "a JSON string")
        assert str(e).startswith(said), str(e)
        return
    if fmt == "sglang":
        # A JSON string literal handed over whole is read inside its quotes.
        inner = json.loads(text) if text.strip().startswith('"') else text
        assert len(inner) % 4 == 0
        assert all(c.isascii() and (c.isalnum() or c in "+/=") for c in inner), text


def test_a_routing_string_with_a_broken_escape_names_the_string() -> None:
    # A lone surrogate escape: legal to scan past, not a JSON string (RFC 8259 §8.2).
    body = b'{"choices":[{"index":0,"routed_experts":"AQID\\ud800"}]}'
    with pytest.raises(rx.PayloadError, match="choice 0: routing string: invalid JSON string"):
        rx.from_response(body, num_layers=1, top_k=1)
