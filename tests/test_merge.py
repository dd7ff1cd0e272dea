"""Prefill/decode merge (format.md §4): properties over every decode form an engine sends."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routed_experts as rx


def payload(arr: np.ndarray, start: int, dtype: str = "uint8") -> rx.RoutedExperts:
    return rx.RoutedExperts.from_array(arr, start=start, dtype=dtype)


@st.composite
def rollouts(draw: st.DrawFn) -> dict[str, Any]:
    """A request of P prompt tokens generating G, with prompt start S (engine rows [S, P+G-1))."""
    prompt = draw(st.integers(1, 40))
    generated = draw(st.integers(1, 40))
    start = draw(st.integers(0, prompt - 1))
    layers, top_k = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(["uint8", "uint16"]))
    hi = 256 if dtype == "uint8" else 65536
    seed = draw(st.integers(0, 2**32 - 1))
    total = prompt + generated - 1
    truth = np.random.default_rng(seed).integers(0, hi, size=(total, layers, top_k))
    return {"P": prompt, "G": generated, "S": start, "truth": truth, "dtype": dtype}


def decode_forms(r: dict[str, Any]) -> dict[str, rx.RoutedExperts]:
    P, S, truth, dt = r["P"], r["S"], r["truth"], r["dtype"]
    zeroed = truth.copy()
    zeroed[:P] = 0  # decode's prompt rows are invalid (zeros)
    forms = {
        "full_zeroed_from_S": payload(zeroed[S:], S, dt),
        "delta_from_P": payload(truth[P:], P, dt),
        "from_0_prefill_from_S": payload(zeroed, 0, dt),
    }
    if P - 1 >= S:
        forms["delta_from_P_minus_1"] = payload(truth[P - 1 :], P - 1, dt)
    return forms


@settings(max_examples=300, deadline=None)
@given(r=rollouts())
def test_every_decode_form_merges_to_the_truth(r: dict[str, Any]) -> None:
    P, S, truth, dt = r["P"], r["S"], r["truth"], r["dtype"]
    prefill = payload(truth[S:P], S, dt)
    for name, decode in decode_forms(r).items():
        merged = rx.merge(prefill, decode)
        assert (merged.start, merged.stop) == (S, len(truth)), name
        np.testing.assert_array_equal(merged.array, truth[S:], err_msg=name)
        # Same answer through whole response bodies, spliced or decoded.
        pb, db = body(prefill), body(decode)
        for splice in (True, False):
            out = rx.from_response(rx.merge_response(pb, db, splice=splice))
            assert out == merged and out is not None and out.dtype == merged.dtype, (name, splice)


@settings(max_examples=200, deadline=None)
@given(r=rollouts(), data=st.data())
def test_gaps_always_raise(r: dict[str, Any], data: st.DataObject) -> None:
    P, S, truth, dt = r["P"], r["S"], r["truth"], r["dtype"]
    if len(truth) <= P:
        return  # one generated token: nothing after the prompt to leave a gap before
    prefill = payload(truth[S:P], S, dt)
    gap_start = data.draw(st.integers(P + 1, len(truth)))
    decode = payload(truth[gap_start:], gap_start, dt)
    with pytest.raises(rx.MergeError, match=f"rows \\[{P}, {gap_start}\\) are missing"):
        rx.merge(prefill, decode)
    with pytest.raises(rx.MergeError):
        rx.merge_response(body(prefill), body(decode))


def body(p: rx.RoutedExperts, index: int = 0) -> bytes:
    return json.dumps(
        {"id": "cmpl-1", "choices": [{"index": index, "text": "x", "routed_experts": p.to_dict()}]}
    ).encode()


def test_mixed_dtypes_promote_never_truncate() -> None:
    prefill = payload(np.array([[[1, 2]], [[3, 4]]]), 0, "uint8")
    decode = payload(np.array([[[300, 400]]]), 2, "uint16")
    merged = rx.merge(prefill, decode)
    assert merged.dtype == "uint16"
    assert merged.array.tolist() == [[[1, 2]], [[3, 4]], [[300, 400]]]
    assert (
        rx.merge(
            decode.slice(2, 3).astype("uint16"), payload(np.zeros((0, 1, 2), dtype=np.int64), 3)
        ).dtype
        == "uint16"
    )


@pytest.mark.parametrize(
    ("decode_start", "decode_rows", "layers", "needle"),
    [
        (5, 2, 1, r"gap: prefill covers positions \[0, 3\) but decode starts at 5"),
        (0, 2, 1, r"decode covers positions \[0, 2\), ending before prefill's end at 3"),
        (3, 2, 2, "prefill has 1 layers x top_k 2 but decode has 2 layers x top_k 2"),
    ],
)
def test_merge_errors_name_positions_and_shapes(
    decode_start: int, decode_rows: int, layers: int, needle: str
) -> None:
    prefill = payload(np.ones((3, 1, 2), dtype=np.int64), 0)
    decode = payload(np.ones((decode_rows, layers, 2), dtype=np.int64), decode_start)
    with pytest.raises(rx.MergeError, match=needle):
        rx.merge(prefill, decode)


def test_response_choices_match_by_index_and_unrouted_choices_stay() -> None:
    truth = np.arange(6 * 1 * 2, dtype=np.uint8).reshape(6, 1, 2)
    prefill = {
        "choices": [
            {"index": 1, "routed_experts": payload(truth[:4] + 100, 0).to_dict()},
            {"index": 0, "routed_experts": payload(truth[:4], 0).to_dict()},
        ]
    }
    decode = {
        "choices": [
            {"index": 0, "text": "a", "routed_experts": payload(truth[3:], 3).to_dict()},
            {"index": 1, "text": "b", "routed_experts": payload(truth[4:] + 100, 4).to_dict()},
            {"index": 2, "text": "c"},
        ]
    }
    merged = rx.merge_response(json.dumps(prefill), json.dumps(decode))
    assert rx.from_response(merged, 0).array.tolist() == truth.tolist()  # type: ignore[union-attr]
    assert rx.from_response(merged, 1).array.tolist() == (truth + 100).tolist()  # type: ignore[union-attr]
    # Decode's choice 2 had none: it stays as it was, and reading it says its rows are lost.
    assert json.loads(merged)["choices"][2] == {"index": 2, "text": "c"}
    with pytest.raises(rx.PayloadError, match="choice 2 carries no routing beside") as e:
        rx.from_response(merged, 2)
    assert e.value.kind == "rows_lost"


def test_two_prefill_choices_without_a_match_is_an_error() -> None:
    p = payload(np.ones((3, 1, 1), dtype=np.int64), 0).to_dict()
    prefill = {"choices": [{"index": 0, "routed_experts": p}, {"index": 1, "routed_experts": p}]}
    decode = {
        "choices": [
            {"index": 5, "routed_experts": payload(np.ones((1, 1, 1), dtype=np.int64), 3).to_dict()}
        ]
    }
    with pytest.raises(rx.MergeError, match="decode choice 5 carries routed_experts"):
        rx.merge_response(json.dumps(prefill), json.dumps(decode))


@pytest.mark.parametrize(
    ("body_text", "needle"),
    [
        (b"{", "response body: invalid JSON"),
        (b'{"choices": 3}', "response body"),
        (b'{"choices": [{"index": "0"}]}', "response body"),
        (
            b'{"choices": [{"routed_experts": {"data": "AA", "shape": [1,1,1]}}]}',
            "choice 0: `data`",
        ),
    ],
)
def test_malformed_bodies_raise_payload_error(body_text: bytes, needle: str) -> None:
    with pytest.raises(rx.PayloadError, match=needle):
        rx.from_response(body_text)


def test_invalid_base64_fails_the_same_way_on_both_paths() -> None:
    prefill = payload(np.ones((3, 1, 1), dtype=np.int64), 0).to_dict()  # 3 bytes: splice-eligible
    decode = payload(np.ones((6, 1, 1), dtype=np.int64), 0).to_dict()
    decode["data"] = "*" + decode["data"][1:]  # bad char in the skipped prompt rows
    pb = json.dumps({"choices": [{"routed_experts": prefill}]})
    db = json.dumps({"choices": [{"routed_experts": decode}]})
    for splice in (True, False):
        with pytest.raises(rx.PayloadError, match="decode"):
            rx.merge_response(pb, db, splice=splice)


@settings(max_examples=500, deadline=None)
@given(data=st.data())
def test_mutated_bodies_only_raise_library_errors(data: st.DataObject) -> None:
    p = payload(np.arange(12, dtype=np.int64).reshape(6, 1, 2), 0)
    good = body(p)
    wire = bytearray(good)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(wire) - 1))
        wire[i : i + 1] = data.draw(
            st.sampled_from(
                [b"", b"{", b"}", b"[", b"]", b'"', b"\\", b",", b":", b"0", b"n", b"\x00"]
            )
        )
    try:
        out = rx.merge_response(good, bytes(wire))
        got = rx.from_response(bytes(wire))
    except rx.RoutedExpertsError:
        return
    # What parses must agree with Python's own JSON parser on where the routing is.
    # strict=False: raw control characters inside strings are tolerated, as by the scanner.
    doc = json.loads(bytes(wire), strict=False)
    if got is None:
        # No routing left in decode: nothing merged, the decode body comes back as it was.
        assert out == bytes(wire)
    else:
        assert got == rx.RoutedExperts.from_json(doc["choices"][0]["routed_experts"])
        # What was merged is the two halves' merge.
        assert rx.from_response(out) == rx.merge(rx.from_response(good), got)


def test_trailing_garbage_and_deep_nesting_are_rejected() -> None:
    good = body(payload(np.ones((1, 1, 1), dtype=np.int64), 0))
    with pytest.raises(rx.PayloadError, match="the end of the document"):
        rx.from_response(good + b"x")
    deep = b'{"a":' + b"[" * 500 + b"]" * 500 + b"}"
    with pytest.raises(rx.PayloadError, match="nested deeper than 128"):
        rx.from_response(deep)


def _halves() -> tuple[str, str, str]:
    """A prefill body (rows [0, 3)), a decode body (rows [0, 5), prompt rows zeroed) and a
    decode body without routing."""
    pre = rx.RoutedExperts.from_array(np.arange(6).reshape(3, 1, 2), num_experts=128)
    rows = np.zeros((5, 1, 2), dtype=np.int64)
    rows[3:] = [[[7, 8]], [[9, 10]]]
    dec = rx.RoutedExperts.from_array(rows, num_experts=128)
    pb = json.dumps({"choices": [{"index": 0, "routed_experts": pre.to_dict()}]})
    db = json.dumps({"choices": [{"index": 0, "routed_experts": dec.to_dict()}]})
    none = json.dumps({"choices": [{"index": 0, "text": "x"}]})
    return pb, db, none


def test_require_routing_refuses_a_decode_body_without_routing_that_prefill_had() -> None:
    pb, _, none = _halves()
    # By default there is nothing to merge into: the decode body comes back as it was...
    assert rx.merge_response(pb, none) == none.encode()
    # ...and a router that must never pass on a body without routing says so.
    with pytest.raises(rx.MergeError, match="missing routing on the decode side: the prefill "
                       r"body carries routing \(at \$\.choices\[0\]\.routed_experts\)"):
        rx.merge_response(pb, none, require_routing=True)


def test_max_bytes_bounds_each_half_of_one_call() -> None:
    pb, db, _ = _halves()
    with pytest.raises(rx.PayloadError, match="choice 0: prefill: .* exceeds the limit of 5 bytes"):
        rx.merge_response(pb, db, max_bytes=5)
    merged = rx.from_response(rx.merge_response(pb, db, max_bytes=10))  # decode's 10 bytes fit
    assert merged is not None
    assert merged.to_numpy().ravel().tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10]


def npy_body(p: rx.RoutedExperts) -> bytes:
    """A vLLM-shaped body: the `.npy` text (which carries no start) at the choice."""
    value = rx.encode(p, "vllm_npy")
    return json.dumps({"id": "cmpl-1", "choices": [{"index": 0, "routed_experts": value}]}).encode()


@settings(deadline=None)  # the profile's examples: fewer under emulation (tests/conftest.py)
@given(r=rollouts(), decode_dtype=st.sampled_from(["uint8", "uint16"]))
def test_npy_halves_merge_to_the_canonical_sidecar_byte_for_byte(
    r: dict[str, Any], decode_dtype: str
) -> None:
    # Formats that carry no start: halves of one dtype are merged on their text (transcoded a
    # block at a time, or copied where kept as `.npy`), mixed ones are promoted and joined.
    # Either way the decode body comes back with its value replaced by exactly the canonical
    # sidecar of the merge.
    P, S, truth, dt = r["P"], r["S"], r["truth"], r["dtype"]
    if decode_dtype == "uint8" and dt == "uint16":
        decode_dtype = "uint16"  # decode's ids may need the wider dtype
    prefill = payload(truth[S:P], S, dt)
    for name, decode in decode_forms(r).items():
        decode = payload(decode.to_numpy(), decode.start, decode_dtype)
        merged = rx.merge(prefill, decode)
        pb, db = npy_body(prefill), npy_body(decode)
        out = rx.merge_response(pb, db, start=S, decode_start=decode.start)
        canonical = json.dumps(merged.to_dict(), separators=(",", ":"))
        old = json.dumps(json.loads(db)["choices"][0]["routed_experts"])
        assert out == db.replace(old.encode(), canonical.encode()), name
        # Kept as vLLM's `.npy` (the proxy's routing_format "engine"): exactly the `.npy` text
        # of the merge, whether its text was copied (one dtype) or decoded (promoted).
        kept = rx.merge_response(pb, db, start=S, decode_start=decode.start, keep_format=True)
        npy = json.dumps(rx.encode(merged, "vllm_npy"))
        assert kept == db.replace(old.encode(), npy.encode()), name
