"""`rx.BodyReader` (format.md §4.1, read as it arrives): a response body fed a chunk at a time
reads as `group_from_response` reads it whole, the same samples or the same error, with each
long base64 `data` string held decoded, never as text and rows at once."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_group import decode_body, npy_body

import routed_experts as rx
from routed_experts.stand_in_engine import routing_of


def answer(prompt: int, generated: int, n: int, shared: bool, compact: bool = True) -> bytes:
    dims = (3, 2, 64)
    p_body = npy_body(routing_of(list(range(prompt)), 1, dims)[:prompt], prompt, 1)
    d_body = decode_body(prompt, generated, n, dims, compact)
    return rx.merge_response(p_body, d_body, decode_start=prompt - 1, shared_prompt=shared)


def read(body: bytes, cuts: list[int], **kw: Any) -> tuple[rx.BodyReader, Any]:
    """`body` fed in the chunks `cuts` make; the reader (before it is read) and its group or
    the exception it raised."""
    reader, at = rx.BodyReader(), 0
    for c in sorted(cuts) + [len(body)]:
        c = max(at, min(c, len(body)))
        reader.feed(memoryview(body)[at:c] if c % 2 else body[at:c])
        at = c
    held = (reader.text_bytes, reader.decoded_bytes)
    try:
        return held, reader.group(**kw)
    except rx.RoutedExpertsError as e:
        return held, e


def same(got: Any, body: bytes, **kw: Any) -> None:
    try:
        want: Any = rx.group_from_response(body, **kw)
    except rx.RoutedExpertsError as e:
        want = e
    if isinstance(want, Exception):
        assert type(got) is type(want) and str(got) == str(want)
        return
    assert not isinstance(got, Exception), got
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert (x.start, x.stop, x.dtype) == (y.start, y.stop, y.dtype)
            np.testing.assert_array_equal(x.array, y.array)
    assert all(s[0] is got[0][0] for s in got if len(s) == 2)


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.integers(1, 2000),
    generated=st.integers(1, 8),
    n=st.integers(1, 5),
    shared=st.booleans(),
    compact=st.booleans(),
    cuts=st.lists(st.integers(0, 10**6), max_size=8),
    pretty=st.booleans(),
)
def test_a_body_fed_in_any_chunks_reads_as_the_whole_body(
    prompt: int, generated: int, n: int, shared: bool, compact: bool, cuts: list[int],
    pretty: bool,
) -> None:
    body = answer(prompt, generated, n, shared, compact)
    if pretty:  # white space about every value, as json.dumps(indent=...) writes it
        body = json.dumps(json.loads(body), indent=1).encode()
    _, got = read(body, [c % (len(body) + 1) for c in cuts])
    same(got, body)


@settings(max_examples=80, deadline=None)
@given(
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(b'A+/="\\ {}[],:x\x01')),
                   min_size=1, max_size=3),  # fmt: skip
    cuts=st.lists(st.integers(0, 10**6), max_size=5),
)
def test_a_broken_body_fails_as_the_whole_body_fails(
    flips: list[tuple[int, int]], cuts: list[int]
) -> None:
    body = bytearray(answer(1500, 3, 3, shared=True))
    for at, c in flips:
        body[at % len(body)] = c
    _, got = read(bytes(body), [c % len(body) for c in cuts])
    same(got, bytes(body))


def test_a_shared_answer_is_held_as_its_rows() -> None:
    body = answer(3000, 800, 4, shared=True)
    (text, decoded), got = read(body, list(range(1000, len(body), 1000)))
    same(got, body)
    # The prompt's rows and each choice's own (uint8), each value's text past 4,096 characters.
    assert decoded == (3000 + 4 * 799) * 3 * 2
    assert text < 2000 and text + decoded < len(body) * 0.8
    # Its rows are views of what the reader decoded, not copies.
    assert not got[0][0].array.flags.owndata


def test_a_reader_reads_one_body_and_names_what_it_was_given() -> None:
    reader = rx.BodyReader()
    said = "`chunk`: expected a piece of the body: bytes, bytearray, memoryview or str, got an int"
    with pytest.raises(rx.PayloadError, match=said):
        reader.feed(5)  # type: ignore[arg-type]
    reader.feed(b'{"choices": [{"index": 0, "text": "x"}]}')
    assert reader.group() == []
    for again in (reader.group, lambda: reader.feed(b"{}"), lambda: reader.text_bytes):
        spent = "`BodyReader`: expected a reader not yet read .* got one whose group"
        with pytest.raises(rx.PayloadError, match=spent):
            again()
    with pytest.raises(rx.PayloadError, match="invalid JSON"):
        r = rx.BodyReader()
        r.feed(b'{"choices": [')
        r.group()

