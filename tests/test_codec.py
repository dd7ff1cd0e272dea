"""The compact sidecar codec (format.md §2, §3.1, §6, §8): behaviour beyond the golden vectors."""

from __future__ import annotations

import json
import pickle
import re
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import routed_experts as rx
from conftest import DTYPES, sidecar_doc, sidecar_reference


def test_spec_worked_example() -> None:
    prefill = b'{"data":"CgsUFR4f","shape":[3,1,2],"start":0,"dtype":"uint8"}'
    p = rx.RoutedExperts.from_json(prefill)
    assert p.to_json() == prefill
    assert p.array.tolist() == [[[10, 11]], [[20, 21]], [[30, 31]]]
    assert (p.start, p.stop, len(p), p.num_layers, p.top_k) == (0, 3, 3, 1, 2)
    delta = rx.RoutedExperts.from_json(
        '{"data":"Hh8oKQ==","shape":[2,1,2],"start":2,"dtype":"uint8"}'
    )
    assert (delta.start, delta.stop) == (2, 4)
    wide = rx.RoutedExperts.from_array(np.array([[[300, 7]]]))
    assert wide.dtype == "uint16"
    assert json.loads(wide.to_json())["data"] == "LAEHAA=="


# -- round trips --------------------------------------------------------------------------


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.tuples(st.integers(0, 9), st.integers(0, 5), st.integers(0, 4)))
    return draw(hnp.arrays(np.dtype(dtype), shape))


@settings(max_examples=300, deadline=None)
@given(arr=arrays(), start=st.integers(0, 2**40))
def test_round_trip_every_dtype_and_shape(arr: np.ndarray, start: int) -> None:
    p = rx.RoutedExperts.from_array(arr, start=start, dtype=arr.dtype)
    assert (p.shape, p.dtype, p.start) == (arr.shape, str(arr.dtype), start)
    for wire in (p.to_json(), p.to_json().decode(), p.to_dict(), json.loads(p.to_json())):
        back = rx.RoutedExperts.from_json(wire)
        assert back == p and back.dtype == p.dtype
        np.testing.assert_array_equal(back.array, arr)
    # The wire bytes are what Python's own base64 of the raw little-endian array gives.
    assert json.loads(p.to_json()) == sidecar_doc(arr, start)
    assert pickle.loads(pickle.dumps(p, protocol=5)) == p


@settings(max_examples=200, deadline=None)
@given(
    arr=hnp.arrays(
        np.int64,
        st.tuples(st.integers(0, 6), st.integers(1, 4), st.integers(1, 4)),
        elements=st.integers(-(2**31), 2**31 - 1),
    )
)
def test_compact_dtype_is_smallest_that_holds_values(arr: np.ndarray) -> None:
    p = rx.RoutedExperts.from_array(arr)
    np.testing.assert_array_equal(p.array, arr)  # never truncated
    lo, hi = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
    if lo >= 0:
        expect = "uint8" if hi <= 255 else "uint16" if hi <= 65535 else "int32"
    else:
        expect = "int16" if lo >= -(2**15) and hi < 2**15 else "int32"
    assert p.dtype == expect


def test_num_experts_fixes_the_dtype_for_a_model() -> None:
    small = np.zeros((2, 3, 8), dtype=np.int64)
    assert rx.RoutedExperts.from_array(small, num_experts=256).dtype == "uint8"
    assert rx.RoutedExperts.from_array(small, num_experts=384).dtype == "uint16"
    assert rx.RoutedExperts.from_array(small, dtype=np.int32).dtype == "int32"


@pytest.mark.parametrize(
    ("values", "kwargs", "needle"),
    [
        ([[[300]]], {"num_experts": 256}, "300 at position 7, layer 0"),
        ([[[1], [70000]]], {"dtype": "uint16"}, "70000 at position 7, layer 1"),
        ([[[-1]]], {"dtype": "uint8"}, "-1 at position 7"),
    ],
)
def test_value_that_does_not_fit_is_an_error_never_a_wrap(
    values: list[Any], kwargs: dict[str, Any], needle: str
) -> None:
    with pytest.raises(rx.PayloadError, match=needle):
        rx.RoutedExperts.from_array(np.array(values), start=7, **kwargs)


def test_from_array_rejects_non_integer_and_wrong_rank() -> None:
    with pytest.raises(rx.PayloadError, match="an integer array, got dtype float64"):
        rx.RoutedExperts.from_array(np.zeros((1, 1, 1)))
    with pytest.raises(rx.PayloadError, match="3 dimensions"):
        rx.RoutedExperts.from_array(np.zeros((2, 2), dtype=np.uint8))
    with pytest.raises(rx.PayloadError, match="fit int64"):
        rx.RoutedExperts.from_array(np.array([[[2**63]]], dtype=np.uint64))
    assert rx.RoutedExperts.from_array([[[1, 2]]]).array.tolist() == [[[1, 2]]]


def test_non_contiguous_input_is_read_correctly() -> None:
    arr = np.arange(2 * 3 * 4, dtype=np.int32).reshape(2, 3, 4)[:, ::2, ::-1]
    p = rx.RoutedExperts.from_array(arr)
    np.testing.assert_array_equal(p.array, arr)


# -- zero copy, read-only, slicing, astype -----------------------------------------------


def test_array_is_a_read_only_view_of_the_payload_buffer() -> None:
    p = rx.RoutedExperts.from_array(np.arange(24, dtype=np.uint8).reshape(2, 3, 4))
    a, b = p.array, p.array
    assert not a.flags.writeable and not a.flags.owndata
    assert a.flags.c_contiguous and a.flags.aligned
    # Both views point at the same Rust-owned buffer, which the payload object keeps alive.
    assert a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    assert a.base is p
    with pytest.raises(ValueError):
        a[0, 0, 0] = 1
    with pytest.raises(ValueError):
        a.setflags(write=True)
    del p
    assert a.sum() == sum(range(24))  # the view keeps the buffer alive


def test_to_numpy_writable_copies_and_converts() -> None:
    p = rx.RoutedExperts.from_array(np.arange(6, dtype=np.uint8).reshape(1, 2, 3))
    w = p.to_numpy("int32", writable=True)
    assert w.dtype == np.int32 and w.flags.writeable
    w[...] = 99
    assert p.array.tolist() == [[[0, 1, 2], [3, 4, 5]]]
    with pytest.raises(rx.PayloadError, match="fit uint8"):
        rx.RoutedExperts.from_array(np.array([[[300]]])).to_numpy("uint8")


def test_slice_by_absolute_positions() -> None:
    arr = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2)
    p = rx.RoutedExperts.from_array(arr, start=10)
    s = p.slice(11, 13)
    assert (s.start, s.stop) == (11, 13)
    np.testing.assert_array_equal(s.array, arr[1:3])
    assert len(p.slice(12, 12)) == 0
    for bad in [(9, 12), (12, 16), (13, 12)]:
        with pytest.raises(rx.PayloadError, match=r"not inside the payload's positions \[10, 15\)"):
            p.slice(*bad)


def test_astype_and_equality_across_dtypes() -> None:
    p = rx.RoutedExperts.from_array(np.array([[[1, 2]]]), start=3)
    w = p.astype("uint16")
    assert w.dtype == "uint16" and w == p
    assert p != rx.RoutedExperts.from_array(np.array([[[1, 2]]]), start=4)
    assert p != rx.RoutedExperts.from_array(np.array([[[1, 3]]]), start=3)
    assert (p == "x") is False
    with pytest.raises(TypeError):
        hash(p)
    assert repr(p) == "RoutedExperts(start=3, stop=4, shape=(1, 1, 2), dtype='uint8')"


# -- malformed input --------------------------------------------------------------------


GOOD = sidecar_doc(np.arange(2 * 3 * 4, dtype=np.uint16).reshape(2, 3, 4), start=5)


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"shape": [2, 3]}, "`shape`: expected three non-negative integers"),
        ({"shape": [2, 3, -4]}, "`shape`"),
        ({"shape": [2.0, 3, 4]}, "`shape`"),
        ({"shape": "2,3,4"}, "`shape`"),
        ({"shape": [2, 3, 5]}, "`data`: expected 60 bytes for shape [2, 3, 5] of uint16, got 48"),
        ({"start": -1}, "`start`: expected a non-negative integer, got -1"),
        ({"start": "5"}, "`start`: expected a non-negative integer, got a string"),
        ({"dtype": "float32"}, "`dtype`: expected one of uint8"),
        ({"dtype": 16}, "`dtype`: expected a dtype name, got 16"),
        ({"data": 12}, "`data`: expected a base64 string, got a number"),
        ({"data": None}, "`data`: expected a base64 string, got null"),
        ({"data": GOOD["data"][:-1]}, "multiple of 4"),
        ({"data": "*" + GOOD["data"][1:]}, "'*' at offset 0"),
    ],
)
def test_malformed_fields_name_field_expected_and_actual(
    patch: dict[str, Any], needle: str
) -> None:
    bad = {**GOOD, **patch}
    for value in (bad, json.dumps(bad), json.dumps(bad).encode()):
        with pytest.raises(rx.PayloadError) as info:
            rx.RoutedExperts.from_json(value)
        assert needle in str(info.value), str(info.value)


def test_wrong_input_type() -> None:
    # Parsed JSON of the wrong kind and a non-JSON object are both refused in our family, naming
    # the argument (format.md §8).
    with pytest.raises(rx.PayloadError, match="`value`: expected a JSON object, got a number"):
        rx.RoutedExperts.from_json(12)  # type: ignore[arg-type]
    with pytest.raises(rx.PayloadError, match="`value`: .*bytes, str or a dict, got an object"):
        rx.RoutedExperts.from_json(object())  # type: ignore[arg-type]


def test_errors_form_one_family() -> None:
    assert issubclass(rx.PayloadError, rx.RoutedExpertsError)
    assert issubclass(rx.MergeError, rx.RoutedExpertsError)
    assert issubclass(rx.RoutedExpertsError, ValueError)
    assert rx.PayloadError.__module__ == "routed_experts"


def test_huge_declared_shape_is_rejected_without_allocating() -> None:
    # 2**62 bytes could never be allocated: the shape alone is over the limit (format.md §8).
    huge = {"data": "AAAA", "shape": [2**40, 2**20, 2**2], "start": 0, "dtype": "uint8"}
    with pytest.raises(rx.PayloadError, match=r"\[1099511627776, 1048576, 4\] of uint8 declares"):
        rx.RoutedExperts.from_json(huge)
    # Within the limit, the mismatch is found from the text length alone.
    with pytest.raises(rx.PayloadError, match="got 3 bytes"):
        rx.RoutedExperts.from_json({**huge, "shape": [2**10, 2**10, 4]})
    overflow = {**huge, "shape": [2**63, 2**63, 4]}
    with pytest.raises(rx.PayloadError, match="overflows"):
        rx.RoutedExperts.from_json(overflow)


def test_size_limit_is_settable() -> None:
    arr = np.zeros((10, 4, 8), dtype=np.uint8)
    wire = rx.RoutedExperts.from_array(arr).to_json()
    with pytest.raises(rx.PayloadError, match="exceeds the limit of 100 bytes"):
        rx.RoutedExperts.from_json(wire, max_bytes=100)
    old = rx.get_max_bytes()
    assert old == 1 << 30
    try:
        rx.set_max_bytes(319)
        with pytest.raises(rx.PayloadError, match="declares 320 bytes .* limit of 319"):
            rx.RoutedExperts.from_json(wire)
        assert len(rx.RoutedExperts.from_json(wire, max_bytes=320)) == 10
    finally:
        rx.set_max_bytes(old)


def test_escaped_slash_in_data_decodes() -> None:
    arr = np.array([[[0xFF, 0xF0, 0x3F]]], dtype=np.uint8)  # base64 "//A/"
    escaped = '{"data":"\\/\\/A\\/","shape":[1,1,3]}'
    np.testing.assert_array_equal(rx.RoutedExperts.from_json(escaped).array, arr)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_raise_payload_error(blob: bytes) -> None:
    try:
        p = rx.RoutedExperts.from_json(blob)
    except rx.PayloadError:
        return
    _same_as_the_reference(p, blob)


def _same_as_the_reference(p: rx.RoutedExperts, text: bytes) -> None:
    """What the library accepted reads the same by hand (conftest.sidecar_reference)."""
    rows, start = sidecar_reference(text)
    assert p.start == start and p.dtype == rows.dtype.name
    np.testing.assert_array_equal(p.to_numpy(), rows)


@settings(max_examples=500, deadline=None)
@given(data=st.data())
def test_mutated_sidecars_only_raise_payload_error(data: st.DataObject) -> None:
    wire = bytearray(json.dumps(GOOD).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(wire) - 1))
        op = data.draw(st.sampled_from(["flip", "delete", "insert"]))
        if op == "flip":
            wire[i] = data.draw(st.integers(0, 255))
        elif op == "delete":
            del wire[i]
        else:
            wire.insert(i, data.draw(st.sampled_from(b'{}[]",:-0123456789eE.\\ ')))
    try:
        p = rx.RoutedExperts.from_json(bytes(wire))
    except rx.PayloadError:
        return
    # Whatever still decodes reads the same by hand.
    _same_as_the_reference(p, bytes(wire))


# -- threads ------------------------------------------------------------------------------


def test_threads_decode_at_once_correctly() -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, size=(512, 48, 8), dtype=np.uint8) for _ in range(8)]
    wires = [rx.RoutedExperts.from_array(a, start=i).to_json() for i, a in enumerate(arrays)]
    failures: list[str] = []
    barrier = threading.Barrier(4)

    def work(k: int) -> None:
        barrier.wait()
        for _ in range(20):
            for i in range(k, len(wires), 4):
                p = rx.RoutedExperts.from_json(wires[i])
                if p.start != i or not np.array_equal(p.array, arrays[i]):
                    failures.append(f"thread {k} payload {i}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b'{"data":"AA\\q==","shape":[1,1,1],"start":0,"dtype":"uint8"}',
         "sidecar: invalid JSON at byte 12: expected a valid escape, got 'q'"),
        (b'{"data":"AQ==","shape":[1,1,1],"start":tru,"dtype":"uint8"}',
         "sidecar: invalid JSON at byte 39: expected true, got 't'"),
        (b'{"data":"AQ==","shape":[1,1,1],"start":0,"dtype":"uint8","x":[1,}',
         "sidecar: invalid JSON at byte 64: expected a value, got '}'"),
    ],
)
def test_invalid_json_in_a_sidecar_names_the_byte_and_what_was_expected(
    text: bytes, message: str
) -> None:
    for read in (rx.decode, rx.RoutedExperts.from_json):
        with pytest.raises(rx.PayloadError, match=re.escape(message)):
            read(text)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_slice_and_astype_are_numpys_slice_and_checked_cast(data: st.DataObject) -> None:
    dtype = np.dtype(data.draw(st.sampled_from(DTYPES)))
    shape = data.draw(st.tuples(st.integers(0, 8), st.integers(1, 3), st.integers(1, 3)))
    arr = data.draw(hnp.arrays(dtype, shape))
    start = data.draw(st.integers(0, 1000))
    p = rx.RoutedExperts.from_array(arr, start=start, dtype=dtype)
    a = data.draw(st.integers(max(start - 2, 0), start + shape[0] + 2))
    b = data.draw(st.integers(max(start - 2, 0), start + shape[0] + 2))
    if start <= a <= b <= start + shape[0]:
        s = p.slice(a, b)
        assert (s.start, s.stop, s.dtype) == (a, b, dtype.name)
        np.testing.assert_array_equal(s.to_numpy(), arr[a - start : b - start])
    else:
        with pytest.raises(rx.PayloadError, match=f"slice \\[{a}, {b}\\) is not inside"):
            p.slice(a, b)
    target = np.dtype(data.draw(st.sampled_from(DTYPES)))
    info = np.iinfo(target)
    if arr.size == 0 or (int(arr.min()) >= info.min and int(arr.max()) <= info.max):
        cast = p.astype(target.name)
        assert cast.dtype == target.name and cast.start == start
        np.testing.assert_array_equal(cast.to_numpy(), arr.astype(target))
    else:  # a value the target cannot hold: refused, never wrapped
        with pytest.raises(rx.PayloadError, match=f"expected values that fit {target.name}"):
            p.astype(target.name)
