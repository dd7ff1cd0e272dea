"""Hostile input (format.md §8): every entry point ends bad input in a RoutedExpertsError,
never a crash, a panic, a hang, a runaway allocation or a silently ambiguous answer."""

from __future__ import annotations

import base64
import copy
import io
import json
import pickle
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routed_experts as rx
from routed_experts.proxy import StreamMerger

SIDE = {"data": "CgsUFR4f", "shape": [3, 1, 2], "start": 0, "dtype": "uint8"}

# Each reported example of hostile input, run in a process of its own: a segfault or an abort
# there cannot take the test run down, and its peak memory is its own.
EXAMPLES = {
    "zero_dim_view": "rx.RoutedExperts.from_json(b'{\"data\":\"\",\"shape\":"
    "[4611686018427387904,0,1],\"dtype\":\"uint16\"}').array",
    "zero_dim_pickle": "import pickle; pickle.dumps(rx.RoutedExperts.from_json("
    "b'{\"data\":\"\",\"shape\":[4611686018427387904,0,1],\"dtype\":\"uint16\"}'), 5)",
    "zero_dim_2_63": "rx.RoutedExperts.from_json("
    "b'{\"data\":\"\",\"shape\":[9223372036854775808,0,1]}').to_numpy()",
    "transport_2_63": "rx.RoutedExperts.from_transport((b'', [2**63, 0, 8], 'uint8')).array",
    "encode_lists": "rx.encode(rx.RoutedExperts.from_json("
    "b'{\"data\":\"\",\"shape\":[100000000,0,8]}'), 'lists')",
    "pack_pad": "rx.pack([rx.RoutedExperts.from_json(b'{\"data\":\"AQ==\",\"shape\":[1,1,1]}')],"
    " pad_to_multiple=2**40)",
    "to_training": "t = rx.Trajectory(); t.append(rx.RoutedExperts.from_json("
    "b'{\"data\":\"AQ==\",\"shape\":[1,1,1]}'));"
    " t.to_training(2**40, pad='zero', max_missing=2**41)",
    "lone_surrogate": "rx.RoutedExperts.from_json('{\"data\":\"\\ud800\"}')",
    "npy_bad_shape": "import base64; rx.decode(base64.b64encode(b\"\\x93NUMPY\\x01\\x00\\x46\\x00"
    "{'descr': '<u2', 'fortran_order': False, 'shape': (1,,3,2), }\\n\").decode())",
    "duplicate_routing": "rx.from_response(b'{\"choices\":[{\"index\":0,\"routed_experts\":null,"
    "\"routed_experts\":{\"data\":\"AQ==\",\"shape\":[1,1,1]}}]}')",
    "invalid_utf8": "rx.from_response(b'{\"id\":\"\\xff\",\"choices\":[]}')",
}

RUNNER = """
import resource, sys, time
import routed_experts as rx
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
try:
    exec(sys.argv[1])
    outcome = "no error"
except Exception as e:
    outcome = type(e).__name__ if isinstance(e, rx.RoutedExpertsError) else repr(e)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(outcome, grown // 1024, round(time.perf_counter() - t0, 3))
"""


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_reported_example_is_a_library_error_in_its_own_process(name: str) -> None:
    # The timeout guards against a hang only; the seconds the call took are printed, not
    # asserted (speed is for benchmarks). Memory is asserted: < 100 MB above the import.
    r = subprocess.run(
        [sys.executable, "-c", RUNNER, EXAMPLES[name]], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, f"{name}: exit {r.returncode}: {r.stderr[-2000:]}"
    outcome, grown_mb, _seconds = r.stdout.split()
    assert outcome in ("PayloadError", "MergeError"), f"{name}: {outcome}"
    assert int(grown_mb) < 100, f"{name}: grew {grown_mb} MB"


def test_zero_dimension_shapes_within_the_limit_work_everywhere() -> None:
    p = rx.RoutedExperts.from_json({"data": "", "shape": [1000, 0, 8], "dtype": "uint16"})
    assert p.array.shape == (1000, 0, 8) and not p.array.flags.writeable
    assert p.to_numpy(writable=True).shape == (1000, 0, 8)
    assert pickle.loads(pickle.dumps(p, 5)) == p
    assert pickle.loads(pickle.dumps(p, 2)) == p
    assert rx.RoutedExperts.from_transport(p.to_transport()) == p
    packed, cu = rx.pack([p, p], pad_to_multiple=7)
    assert packed.shape == (2002, 0, 8) and list(cu) == [0, 1000, 2000]
    assert rx.merge(p.slice(0, 10), p).shape == (1000, 0, 8)


def test_the_limit_bounds_declared_shapes_not_data() -> None:
    empty = {"data": "", "start": 0, "dtype": "uint8"}
    with pytest.raises(rx.PayloadError, match=r"\[4611686018427387904, 0, 1\] of uint8 declares"):
        rx.RoutedExperts.from_json({**empty, "shape": [2**62, 0, 1]})
    at_limit = rx.RoutedExperts.from_json({**empty, "shape": [2**20, 0, 1]}, max_bytes=2**20)
    assert len(at_limit) == 2**20
    with pytest.raises(rx.PayloadError, match="exceeds the limit of 1048575 bytes"):
        rx.RoutedExperts.from_json({**empty, "shape": [2**20, 0, 1]}, max_bytes=2**20 - 1)
    with pytest.raises(rx.PayloadError, match="overflow") as e:
        rx.RoutedExperts.from_json({**empty, "shape": [2**63, 2**63, 0]})
    # No limit holds it: the message does not send the reader to raise one.
    assert "the shape is wrong" in str(e.value) and "set_max_bytes" not in str(e.value)
    # The other formats that carry a shape are held to it too.
    with pytest.raises(rx.PayloadError, match="declares"):
        rx.decode(f"nrlre1:int8:{2**62}x0x1:")
    with pytest.raises(rx.PayloadError, match="declares"):  # SGLang's empty value, in its body
        rx.from_response('{"meta_info": {"routed_experts": ""}}', num_layers=2**40, top_k=2**20)
    buf = io.BytesIO()
    np.save(buf, np.zeros((0, 2**40, 2**20), dtype=np.uint8))
    with pytest.raises(rx.PayloadError, match="declares"):
        rx.decode(base64.b64encode(buf.getvalue()).decode())
    with pytest.raises(rx.PayloadError, match="declares"):
        rx.RoutedExperts.from_transport((b"", [2**40, 0, 2**30], "int32"))


def test_caller_sizes_are_held_to_the_limit() -> None:
    p = rx.RoutedExperts.from_json(SIDE)
    with pytest.raises(rx.PayloadError, match="pad_to_multiple=1099511627776"):
        rx.pack([p], pad_to_multiple=2**40)
    with pytest.raises(rx.PayloadError, match="overflow"):
        rx.pack([p], pad_to_multiple=2**64 - 1)
    too_large = r"`pad_to_multiple`: expected an integer below 2\*\*64"
    with pytest.raises(rx.PayloadError, match=too_large):
        rx.pack([p], pad_to_multiple=2**64)
    t = rx.Trajectory()
    t.append(p)
    for n in (2**40, 2**64 - 1):
        with pytest.raises(rx.PayloadError, match=f"num_tokens={n}"):
            t.to_training(n, pad="zero", max_missing=2**64 - 1)
    old = rx.get_max_bytes()
    try:
        rx.set_max_bytes(10)
        with pytest.raises(rx.PayloadError, match="grow past the size limit"):
            t.append(rx.RoutedExperts.from_array(np.ones((3, 1, 2), np.uint8), start=3))
        assert len(t) == 3  # nothing changed
        with pytest.raises(rx.PayloadError, match="lists"):
            rx.encode(p, "lists")
    finally:
        rx.set_max_bytes(old)


# --- strict, unambiguous JSON on every entry point that reads it -------------------------------

def _body(choice: str) -> bytes:
    return ('{"id":"x","choices":[' + choice + "]}").encode()


ROUTING = json.dumps(SIDE)
PREFILL = _body('{"index":0,"routed_experts":' + ROUTING + "}")


def _all_entry_points(body: bytes) -> list[Any]:
    """Call every reader of a response body on `body`; return what each raised."""
    raised = []
    for call in (
        lambda: rx.from_response(body),
        lambda: rx.merge_response(PREFILL, body),
        lambda: rx.merge_response(PREFILL, body, splice=False),
        lambda: rx.merge_response(body, PREFILL),
        lambda: StreamMerger(PREFILL).line(b"data: " + body),
    ):
        with pytest.raises(rx.PayloadError) as e:
            call()
        raised.append(e.value)
    return raised


@pytest.mark.parametrize(
    ("choice", "needle"),
    [
        ('{"index":0,"routed_experts":' + ROUTING + ',"routed_experts":null}', "duplicate key"),
        ('{"index":0,"routed_experts":' + ROUTING + ',"routed\\u005fexperts":null}', "duplicate"),
        ('{"index":0,"index":1,"routed_experts":' + ROUTING + "}", "duplicate key `index`"),
        (
            '{"index":0,"message":{"routed_experts":' + ROUTING + "},"
            '"routed_experts":' + ROUTING + "}",
            "two routing values for choice 0",
        ),
        ('{"index":0,"logprobs":{"routed_experts":' + ROUTING + "}}", "choices[0].logprobs"),
        ('{"index":0,"extra":[{"routed\\u005fexperts":1}]}', "choices[0].extra[0]"),
    ],
)
def test_ambiguous_or_misplaced_routing_is_refused_on_every_path(choice: str, needle: str) -> None:
    for e in _all_entry_points(_body(choice)):
        assert needle in str(e), str(e)


def test_duplicate_choices_and_misplaced_top_level_routing() -> None:
    twice = b'{"choices":[],"choices":[{"index":0,"routed_experts":' + ROUTING.encode() + b"}]}"
    assert all("duplicate key `choices`" in str(e) for e in _all_entry_points(twice))
    top = b'{"routed_experts":' + ROUTING.encode() + b',"choices":[]}'
    assert all("at $.routed_experts" in str(e) for e in _all_entry_points(top))


def test_escaped_keys_are_the_same_keys_everywhere() -> None:
    routing = ROUTING.replace('"data"', '"d\\u0061ta"')
    escaped = _body('{"index":0,"routed\\u005fexperts":' + routing + "}")
    assert rx.from_response(escaped) == rx.RoutedExperts.from_json(SIDE)
    decode = _body('{"index":0,"routed\\u005fexperts":' + json.dumps(
        {"data": "AAAAAAAAKCk=", "shape": [4, 1, 2], "start": 0}) + "}")
    merged = rx.from_response(rx.merge_response(PREFILL, decode))
    assert merged is not None and merged.array.ravel().tolist() == [10, 11, 20, 21, 30, 31, 40, 41]
    # The proxy's stream pre-filter lets the escaped spelling through to the merge.
    line = b"".join(StreamMerger(PREFILL).line(b"data: " + decode))
    assert rx.from_response(line[6:]) == merged


R = ROUTING.encode()


@pytest.mark.parametrize(
    "bad",
    [
        b"\xff",
        b"\xc3",  # a truncated sequence
        b"\xed\xa0\x80",  # an encoded surrogate
        b"a\x01b",  # a raw control character
        b"x" * 40000 + b"\xfe",  # past the scanner's first chunk
    ],
)
def test_invalid_utf8_and_raw_control_characters_are_refused(bad: bytes) -> None:
    body = b'{"id":"' + bad + b'","choices":[{"index":0,"routed_experts":' + R + b"}]}"
    if bad != b"\xed\xa0\x80":
        with pytest.raises(ValueError):
            json.loads(body)  # what every Python client would say
    # (json.loads decodes bytes with "surrogatepass", so it takes an encoded surrogate; that is
    # not UTF-8 all the same, and format.md §8 refuses it.)
    for e in _all_entry_points(body):
        assert "UTF-8" in str(e) or "control character" in str(e), str(e)
    sidecar = b'{"data":"CgsUFR4f","shape":[3,1,2],"note":"' + bad + b'"}'
    with pytest.raises(rx.PayloadError, match="UTF-8|control character"):
        rx.RoutedExperts.from_json(sidecar)


def test_valid_utf8_passes() -> None:
    body = _body('{"index":0,"text":"\u00e9\u4e2d\U0001f600","routed_experts":' + ROUTING + "}")
    assert rx.from_response(body) == rx.RoutedExperts.from_json(SIDE)


def test_sidecar_duplicate_keys_on_every_spelling() -> None:
    for text in (
        '{"data":"CgsUFR4f","shape":[3,1,2],"shape":[3,1,2]}',
        '{"data":"CgsUFR4f","d\\u0061ta":"CgsUFR4f","shape":[3,1,2]}',
        '{"data":"CgsUFR4f","shape":[3,1,2],"start":0,"st\\u0061rt":1}',
    ):
        for value in (text, text.encode()):
            with pytest.raises(rx.PayloadError, match="duplicate key"):
                rx.RoutedExperts.from_json(value)
            with pytest.raises(rx.PayloadError, match="duplicate key"):
                rx.decode(value)


def test_lone_surrogates_are_payload_errors_on_every_text_input() -> None:
    bad = '{"data":"\ud800"}'
    for call in (
        lambda: rx.RoutedExperts.from_json(bad),
        lambda: rx.RoutedExperts.from_json({"data": "\ud800", "shape": [1, 1, 1]}),
        lambda: rx.RoutedExperts.from_json({**SIDE, "dtype": "\ud800"}),
        lambda: rx.decode(bad),
        lambda: rx.detect_format("\ud800"),
        lambda: rx.from_response(bad),
        lambda: rx.merge_response(bad, bad),
        lambda: rx.decode([[["\ud800"]]]),
    ):
        with pytest.raises(rx.PayloadError):
            call()


def test_nested_lists_json_cannot_write_are_payload_errors() -> None:
    deep: Any = [1]
    for _ in range(100_000):
        deep = [deep]
    for value in ([[[object()]]], deep):
        with pytest.raises(rx.PayloadError, match="lists"):
            rx.decode(value)


# --- the .npy header: exactly what np.load accepts ----------------------------------------------

def _npy(header: str, data: bytes = b"\x01\x02\x03\x04\x05\x06") -> bytes:
    head = header.encode("latin1")
    return b"\x93NUMPY\x01\x00" + len(head).to_bytes(2, "little") + head + data


NPY_HEADERS = [
    "{'descr': '|u1', 'fortran_order': False, 'shape': (1, 3, 2), }",
    "{'descr': '|u1', 'fortran_order': False, 'shape': (1, 3, 2)}",
    '{"shape": (1,3,2,), "descr": "|u1", "fortran_order": False}',
    "  {'descr':'|u1','fortran_order':False,'shape':(1,3,2),}\n",
    "{'descr': '|u1', 'fortran_order': False, 'shape': (1,,3,2), }",
    "{'descr': '|u1', 'fortran_order': False, 'shape': (1, 3, 2,,), }",
    "{'descr': '|u1', 'fortran_order': False, 'shape': (,1, 3, 2), }",
    "{'descr': '|u1', 'fortran_order': False, 'shape': (01, 3, 2), }",
    "{'descr': '|u1', 'fortran_order': False, 'shape': (-1, 3, 2), }",
    "{'descr': '|u1', 'fortran_order': False, 'shape': (1.0, 3, 2), }",
    "{'descr': '|u1', 'fortran_order': False, 'shape': [1, 3, 2], }",
    "{'descr': '|u1', 'fortran_order': false, 'shape': (1, 3, 2), }",
    "{'descr': '|u1', 'fortran_order': False, 'shape': (1, 3, 2), 'x': 1}",
    "{'descr': '|u1', 'shape': (1, 3, 2), }",
    "{'descr': '|u1', 'fortran_order': False, 'shape': (1, 3, 2), }}",
    "{'descr': '|u1', 'fortran_order': False, 'shape': (1, 3, 2), } x",
    "{'descr': '|u1' 'fortran_order': False, 'shape': (1, 3, 2), }",
    "{'descr': '|u1', 'fortran_order': False, 'shape': (1 3, 2), }",
    "{'descr': '|u1', 'fortran_order': Falsey, 'shape': (1, 3, 2), }",
    "{'descr': '|u1, 'fortran_order': False, 'shape': (1, 3, 2), }",
    "{'descr': '|u1', 'fortran_order': False, 'shape': (6), }",
]


@pytest.mark.parametrize("header", NPY_HEADERS)
def test_npy_headers_are_read_exactly_as_np_load_reads_them(header: str) -> None:
    file = _npy(header)
    # np.load parses the header with ast.literal_eval, which strips leading spaces and tabs
    # from Python 3.10 on and refuses them before; the parser follows 3.10+ on every Python.
    reference = file if sys.version_info >= (3, 10) else _npy(header.lstrip(" \t"))
    try:
        want: Any = np.load(io.BytesIO(reference), allow_pickle=False)
    except Exception:
        want = None
    value = base64.b64encode(file).decode()
    if want is None or want.ndim != 3:
        with pytest.raises(rx.PayloadError, match="vllm_npy"):
            rx.decode(value)
    else:
        np.testing.assert_array_equal(rx.decode(value).array, want)


# --- threads ------------------------------------------------------------------------------------

def test_sixteen_threads_share_one_trajectory() -> None:
    rng = np.random.default_rng(7)
    truth = rx.RoutedExperts.from_array(rng.integers(0, 300, size=(512, 4, 2)))
    t = rx.Trajectory()
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        r = np.random.default_rng(seed)
        try:
            for _ in range(200):
                if r.random() < 0.5:
                    stop = int(r.integers(1, 513))
                    t.append(truth.slice(0, stop), overlap="check" if seed % 2 else "keep")
                else:
                    p, n = t.payload, len(t)
                    if p is not None:  # a consistent snapshot: a prefix of the truth
                        assert p == truth.slice(0, len(p)) and n >= 1
                        assert t.start == 0 and t.stop is not None and t.stop >= 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    t.append(truth)
    assert t.payload == truth


def test_trajectory_pickles_and_copies() -> None:
    t = rx.Trajectory()
    assert pickle.loads(pickle.dumps(t)).payload is None
    t.append(rx.RoutedExperts.from_json(SIDE))
    for proto in (2, 5):
        back = pickle.loads(pickle.dumps(t, proto))
        assert back.payload == t.payload and len(back) == 3
        back.truncate(1)
        assert len(t) == 3
    assert copy.copy(t).payload == t.payload


# --- properties of the binding layer ------------------------------------------------------------

dtypes = st.sampled_from(["uint8", "int8", "uint16", "int16", "uint32", "int32", "int64"])
dims = st.one_of(st.integers(0, 6), st.integers(0, 2**64 - 1))


@settings(max_examples=300, deadline=None)
@given(t=dims, layers=dims, k=dims, dtype=dtypes, start=st.integers(0, 2**64 - 1))
def test_any_declared_shape_is_a_payload_or_a_payload_error(
    t: int, layers: int, k: int, dtype: str, start: int
) -> None:
    itemsize = np.dtype(dtype).itemsize
    n = t * layers * k * itemsize
    data = bytes(n) if n <= 4096 else b""
    for make in (
        lambda: rx.RoutedExperts.from_json(
            {"data": base64.b64encode(data).decode(), "shape": [t, layers, k], "start": start,
             "dtype": dtype}),
        lambda: rx.RoutedExperts.from_transport((data, [t, layers, k], dtype), start=start),
    ):
        try:
            p = make()
        except rx.PayloadError:
            continue
        assert p.array.shape == (t, layers, k)
        assert pickle.loads(pickle.dumps(p, 5)) == p
        assert rx.RoutedExperts.from_transport(p.to_transport(), start=start) == p
        assert p.to_numpy(writable=True).shape == (t, layers, k)


# Small or far past the limit: sizes in between are legitimate and would only cost time.
small_or_huge = st.one_of(st.integers(1, 64), st.integers(2**31, 2**64 - 1))


@settings(max_examples=100, deadline=None)
@given(pad=small_or_huge, n=small_or_huge, missing=st.integers(0, 2**64 - 1))
def test_huge_caller_arguments_are_payload_errors_and_small_ones_are_honoured(
    pad: int, n: int, missing: int
) -> None:
    p = rx.RoutedExperts.from_json(SIDE)  # 3 rows
    if pad >= 2**31:  # billions of padding rows: refused before anything is allocated
        with pytest.raises(rx.PayloadError, match="pad_to_multiple"):
            rx.pack([p], pad_to_multiple=pad)
    else:
        packed, _ = rx.pack([p], pad_to_multiple=pad)
        assert len(packed) % pad == 0 and 3 <= len(packed) < 3 + pad
    t = rx.Trajectory()
    t.append(p)
    if n >= 2**31:
        with pytest.raises(rx.RoutedExpertsError, match="num_tokens|missing"):
            t.to_training(n, pad="zero", max_missing=missing)
    elif n - 3 > missing:
        with pytest.raises(rx.MergeError, match=f"more than max_missing={missing}"):
            t.to_training(n, pad="zero", max_missing=missing)
    else:
        assert len(t.to_training(n, pad="zero", max_missing=missing)) == n


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_pickle_arguments_never_crash(data: bytes) -> None:
    # What a tampered pickle could hand the constructor: any bytes for any shape.
    shape = tuple(data[:3]) if len(data) >= 3 else (0, 0, 0)
    try:
        p = rx._core._from_raw(data[3:], shape, 0, "uint8")  # type: ignore[attr-defined]
    except rx.PayloadError:
        return
    # Accepted only when the bytes are exactly the shape's: then they are its rows.
    assert p.shape == shape and p.to_numpy().tobytes() == data[3:]


def test_only_immutable_buffers_are_viewed_without_a_copy() -> None:
    p = rx.RoutedExperts.from_array(np.arange(24, dtype=np.uint8).reshape(2, 3, 4))
    raw = bytes(p.array.tobytes())
    viewed = rx.RoutedExperts.from_transport((raw, [2, 3, 4], "uint8"))
    assert viewed == p
    # Read-only to us, but its owner may still write: copied, so later writes change nothing.
    mutable = bytearray(raw)
    for data in (memoryview(mutable).toreadonly(), mutable, np.frombuffer(mutable, np.uint8)):
        q = rx.RoutedExperts.from_transport((data, [2, 3, 4], "uint8"))
        mutable[0] = 99
        assert q == p, type(data)
        mutable[0] = 0


def test_views_of_python_memory_are_released_safely_from_any_thread() -> None:
    # A payload unpickled from bytes views them; promoting a trajectory that holds it drops the
    # view with the GIL released, from several threads at once.
    base = rx.RoutedExperts.from_array(np.arange(4000, dtype=np.uint8).reshape(1000, 2, 2) % 200)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(100):
                t = rx.Trajectory()
                t.append(pickle.loads(pickle.dumps(base, 2)))
                t.append(rx.RoutedExperts.from_array(np.full((1, 2, 2), 300), start=1000))
                p = t.payload
                assert p is not None and p.slice(0, 1000) == base and p.dtype == np.uint16
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
