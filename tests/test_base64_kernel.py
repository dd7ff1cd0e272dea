"""The base64 kernels (simdutf to decode and encode, base64-simd to check) against the standard
library on random and mutated texts. Accepted means what `base64.b64decode(validate=True)`
accepts and that re-encodes to the same text (padding required, no white space, zero padding
bits: format.md §3.1); everything else is a PayloadError, on the decoding and the splicing paths."""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import random

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import routed_experts as rx

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def python_accepts(text: str) -> bytes | None:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if base64.b64encode(raw).decode() == text else None


def sidecar(text: str, n: int) -> dict[str, object]:
    return {"data": text, "shape": [n, 1, 1], "start": 0, "dtype": "uint8"}


def declared_len(text: str) -> int:
    """The byte count the text's length and padding claim (what the shape must say)."""
    if len(text) % 4:
        return 0
    return len(text) // 4 * 3 - len(text[-2:]) + len(text[-2:].rstrip("="))


def check_against_python(text: str) -> None:
    want = python_accepts(text)
    n = len(want) if want is not None else declared_len(text)
    # The decoding path.
    if want is None:
        with pytest.raises(rx.PayloadError):
            rx.RoutedExperts.from_json(sidecar(text, n))
    else:
        assert rx.RoutedExperts.from_json(sidecar(text, n)).array.tobytes() == want
    # The splicing path checks both halves' text without decoding it: the same verdict.
    if n == 0:
        return
    body = lambda s: json.dumps({"choices": [{"index": 0, "routed_experts": s}]})  # noqa: E731
    prefill = body(sidecar(base64.b64encode(b"\x01").decode(), 1))
    decode = body(sidecar(text, n))
    if want is None:
        with pytest.raises(rx.PayloadError):
            rx.merge_response(prefill, decode)
    else:
        merged = rx.from_response(rx.merge_response(prefill, decode))
        assert merged is not None and merged.array.tobytes() == b"\x01" + want[1:]


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_every_valid_text_decodes_and_encodes_as_python_does(raw: bytes) -> None:
    text = base64.b64encode(raw).decode()
    check_against_python(text)
    p = rx.RoutedExperts.from_json(sidecar(text, len(raw)))
    assert p.to_dict()["data"] == text
    assert json.loads(p.to_json())["data"] == text


mutations = st.sampled_from(["replace", "insert", "delete", "whitespace", "pad_bits", "pad"])


@settings(max_examples=3000, deadline=None)
@given(
    raw=st.binary(min_size=1, max_size=120),
    how=mutations,
    at=st.integers(0, 10_000),
    char=st.characters(codec="latin-1"),
)
def test_mutated_texts_get_the_same_verdict_as_python(
    raw: bytes, how: str, at: int, char: str
) -> None:
    text = base64.b64encode(raw).decode()
    i = at % len(text)
    if how == "replace":
        text = text[:i] + char + text[i + 1 :]
    elif how == "insert":
        text = text[:i] + char + text[i:]
    elif how == "delete":
        text = text[:i] + text[i + 1 :]
    elif how == "whitespace":
        text = text[:i] + " \t\n\r"[at % 4] + text[i:]
    elif how == "pad_bits":  # flip low bits of the last data character: non-canonical padding
        body = text.rstrip("=")
        last = ALPHABET[(ALPHABET.index(body[-1]) + 1 + at % 3) % 64]
        text = body[:-1] + last + text[len(body) :]
    else:  # padding added, removed or moved
        text = [text.rstrip("="), text + "=", "=" + text, text.replace("=", "") + "=="][at % 4]
    check_against_python(text)


@pytest.mark.parametrize("length", range(0, 13))
def test_every_length_mod_4(length: int) -> None:
    for text in ("A" * length, "QUJD" * (length // 4) + "=" * (length % 4)):
        check_against_python(text)


def test_errors_name_the_first_bad_character() -> None:
    with pytest.raises(rx.PayloadError, match=r"'\*' at offset 2"):
        rx.RoutedExperts.from_json(sidecar("ab*d", 3))
    with pytest.raises(rx.PayloadError, match=r"' ' at offset 4"):
        rx.RoutedExperts.from_json(sidecar("CgsU FR4f"[:8], 6))
    with pytest.raises(rx.PayloadError, match="non-zero padding bits"):
        rx.RoutedExperts.from_json(sidecar("QR==", 1))


@settings(max_examples=1500, deadline=None)
@given(
    data=st.data(),
    top_k=st.integers(1, 3),
    tokens=st.integers(1, 12),
    side=st.sampled_from(["prefill", "decode"]),
    char=st.sampled_from(list("=A/+Q*- \n") + ["\u00e9"]),
)
def test_splice_and_decoding_paths_agree_on_every_cut_and_mutation(
    data: st.DataObject, top_k: int, tokens: int, side: str, char: str
) -> None:
    # Every alignment of 3-byte groups against the cut: rows of 1..3 bytes, any prefill end,
    # any decode start at or before it; then one character of either text changed anywhere.
    rows = data.draw(st.binary(min_size=tokens * top_k, max_size=tokens * top_k))
    p_end = data.draw(st.integers(1, tokens))
    d_start = data.draw(st.integers(0, p_end))

    def side_text(lo: int, hi: int) -> str:
        return base64.b64encode(rows[lo * top_k : hi * top_k]).decode()

    texts = {"prefill": side_text(0, p_end), "decode": side_text(d_start, tokens)}
    if texts[side]:
        i = data.draw(st.integers(0, len(texts[side]) - 1))
        texts[side] = texts[side][:i] + char + texts[side][i + 1 :]

    def body(text: str, start: int, n: int) -> str:
        value = {"data": text, "shape": [n, 1, top_k], "start": start, "dtype": "uint8"}
        return json.dumps({"choices": [{"index": 0, "routed_experts": value}]})

    prefill = body(texts["prefill"], 0, p_end)
    decode = body(texts["decode"], d_start, tokens - d_start)
    results = []
    for splice in (True, False):
        try:
            results.append(rx.merge_response(prefill, decode, splice=splice))
        except rx.PayloadError as e:
            results.append(type(e))
    assert results[0] == results[1], (texts, results)


def test_padding_inside_a_straddling_group_is_an_error_not_a_panic() -> None:
    # Found by the property test above: decode's group that straddles the cut ends in '=' in
    # the middle of its text. It decodes on its own to fewer bytes; the splice must refuse it.
    def body(text: str, n: int) -> str:
        value = {"data": text, "shape": [n, 1, 1], "start": 0, "dtype": "uint8"}
        return json.dumps({"choices": [{"index": 0, "routed_experts": value}]})

    prefill, decode = body("AQI=", 2), body("AA==BA==", 4)
    for splice in (True, False):
        with pytest.raises(rx.PayloadError, match="'=' at offset 2"):
            rx.merge_response(prefill, decode, splice=splice)


@pytest.mark.parametrize("at", [16380, 16382, 16384, 32764])
def test_padding_at_a_check_chunk_boundary_is_refused(at: int) -> None:
    # The splice checks copied text 16 KiB at a time: '=' ending a chunk in the middle of the
    # text must not pass as that chunk's padding.
    n = 30000  # 40000 characters: several chunks
    text = base64.b64encode(bytes(range(256)) * (n // 256) + bytes(n % 256)).decode()
    bad = text[: at - 2] + "==" + text[at:]

    def body(t: str, rows: int, start: int = 0) -> str:
        value = {"data": t, "shape": [rows, 1, 1], "start": start, "dtype": "uint8"}
        return json.dumps({"choices": [{"index": 0, "routed_experts": value}]})

    tail = base64.b64encode(b"\x05\x06\x07").decode()
    for prefill, decode in ((body(bad, n), body(tail, 3, n)), (body(tail, 3), body(bad, n, 3))):
        for splice in (True, False):
            with pytest.raises(rx.PayloadError, match="'=' at offset"):
                rx.merge_response(prefill, decode, splice=splice)


# A text long enough for every step of the reading decoder (format.md §3.1, read in one pass):
# 64 KiB chunks, the first 32 on the calling thread, the rest dealt out to threads once over
# 4 MiB each. Flaws land anywhere, often at the edges of chunks and of the threads' shares.
BIG_IDS = (11 << 20) // 4 * 3
CHUNK = 64 * 1024
_big_text: list[str] = []
# Each example reads 11 MB several ways; under qemu (the aarch64 wheel's check) fewer of them.
EMULATED = bool(os.environ.get("ROUTED_EXPERTS_EMULATED"))


def big_text() -> str:
    if not _big_text:
        rng = random.Random(29)
        _big_text.append(base64.b64encode(rng.randbytes(BIG_IDS)).decode())
    return _big_text[0]


EDGES = sorted(
    {k * CHUNK + d for k in (1, 2, 31, 32, 33, 34, 80, 96, 128, 175) for d in (-2, -1, 0, 1)}
)
FLAWS = ['"', "\\\\", "\\/", "=", " ", "    ", "\n", "é", "*", "A", "A==="]


@given(
    at=st.one_of(st.sampled_from(EDGES), st.integers(0, (11 << 20) - 1)),
    flaw=st.sampled_from(FLAWS + [""]),
    replace=st.sampled_from(["none", "one", "as many"]),
    in_body=st.booleans(),
)
@example(at=1000, flaw="    ", replace="as many", in_body=False)
@example(at=40 * CHUNK + 100, flaw="    ", replace="as many", in_body=False)
@example(at=150 * CHUNK + 8, flaw="    ", replace="as many", in_body=True)
@example(at=(11 << 20) - 40, flaw="    ", replace="as many", in_body=False)
@example(at=100 * CHUNK - 4, flaw="A===", replace="as many", in_body=False)
@settings(max_examples=12 if EMULATED else 60, deadline=None)
def test_a_long_text_reads_as_python_reads_it_with_flaws_anywhere(
    at: int, flaw: str, replace: str, in_body: bool
) -> None:
    """The flaw is inserted, replaces one character, or replaces as many as it has (which keeps
    the length the shape's: white space the decoder would skip must still be refused)."""
    text = big_text()
    at = min(at, len(text))
    replaced = {"none": 0, "one": 1, "as many": len(flaw)}[replace]
    text = text[:at] + flaw + text[at + replaced:]
    doc = ('{"data":"' + text + f'","shape":[{BIG_IDS},1,1],"dtype":"uint8"}}').encode()
    wire = b'{"choices":[{"index":0,"routed_experts":' + doc + b"}]}" if in_body else doc

    def read() -> np.ndarray:
        if in_body:
            p = rx.from_response(wire)
            assert p is not None
            return p.array
        return rx.RoutedExperts.from_json(wire).array

    try:
        parsed = json.loads(doc)
    except ValueError:
        with pytest.raises(rx.PayloadError):
            read()
        return
    raw = python_accepts(parsed["data"])
    if raw is not None and len(raw) == BIG_IDS:
        assert np.array_equal(read().reshape(-1), np.frombuffer(raw, np.uint8))
        return
    # Refused, with the message of the path that checks everything before decoding (a dict).
    with pytest.raises(rx.PayloadError) as fused:
        read()
    with pytest.raises(rx.PayloadError) as apart:
        rx.RoutedExperts.from_json(parsed)
    assert str(apart.value) in str(fused.value)


_big_npy: list[str] = []


def big_npy() -> str:
    """vLLM 0.22+'s routing as it writes it (`np.save`, base64), long enough for every step of
    the direct read: the header from the first groups, the rest decoded by two threads."""
    if not _big_npy:
        rng = np.random.default_rng(29)
        buf = io.BytesIO()
        np.save(buf, rng.integers(0, 128, (11_000, 94, 8), dtype=np.uint8))
        _big_npy.append(base64.b64encode(buf.getvalue()).decode())
    return _big_npy[0]


@example(at=10, flaw="*", replace="one")
@example(at=170, flaw="    ", replace="as many")  # just past the header's groups
@example(at=6_000_000, flaw="    ", replace="as many")
@example(at=6_000_000, flaw="A===", replace="as many")
@given(
    # Past the header's 171 characters (128 bytes): a flaw there is numpy's header parser
    # against this library's (test_formats.py), not the data path this test is about.
    at=st.integers(172, 11_100_000),
    flaw=st.sampled_from(FLAWS + [""]),
    replace=st.sampled_from(["none", "one", "as many"]),
)
@settings(max_examples=8 if EMULATED else 40, deadline=None)
def test_a_long_npy_text_reads_as_numpy_reads_it_with_flaws_anywhere(
    at: int, flaw: str, replace: str
) -> None:
    text = big_npy()
    at = min(at, len(text))
    replaced = {"none": 0, "one": 1, "as many": len(flaw)}[replace]
    text = text[:at] + flaw + text[at + replaced:]
    raw = python_accepts(text)
    try:
        want = None if raw is None else np.load(io.BytesIO(raw))
    except Exception:  # numpy's refusals vary by version (ValueError, tokenize's TokenError)
        want = None
    if want is not None and want.dtype == np.uint8 and want.ndim == 3:
        np.testing.assert_array_equal(rx.decode(text).array, want)
    else:
        with pytest.raises(rx.PayloadError):
            rx.decode(text)
