"""A 32k-token Qwen3-235B answer read as it arrives, in the socket's 64 KB chunks: the
library's `BodyReader` (decoded while fed), beside joining the chunks and reading the whole body
(`rx.from_response`, or the glue's `orjson` + `pybase64`), and beside two floors: appending the
chunks to one buffer (the copy every HTTP client makes of a body it hands over whole), and one
copy of the joined body."""

from __future__ import annotations

import numpy as np
import pytest

import routed_experts as rx
from rx_bench import baselines
from rx_bench.codec import body

GROUP = "read as it arrives qwen3-235b 32k, 64 KB chunks"
CHUNK = 64 * 1024


@pytest.fixture(scope="module")
def chunks(qwen235_32k: rx.RoutedExperts) -> list[bytes]:
    """The answer (one choice, its routing a compact sidecar: 33 MB) as the socket gives it."""
    text = body(qwen235_32k.to_dict())
    return [text[i : i + CHUNK] for i in range(0, len(text), CHUNK)]


def read_as_fed(chunks: list[bytes]) -> tuple[rx.RoutedExperts, ...]:
    """The one choice's rows: its sample's parts (the prompt's, then its own) are views of
    the reader's bytes, joined here only to be checked (outside the timing)."""
    reader = rx.BodyReader()
    for c in chunks:
        reader.feed(c)
    (sample,) = reader.group()
    return sample


def read_joined(chunks: list[bytes]) -> rx.RoutedExperts:
    return rx.from_response(b"".join(chunks))


def read_joined_python(chunks: list[bytes]) -> np.ndarray:
    """The glue: the body joined, parsed with orjson, its `data` decoded with pybase64."""
    return baselines.from_response(b"".join(chunks), fast=True)


def append_chunks(chunks: list[bytes]) -> bytearray:
    whole = bytearray()
    for c in chunks:
        whole += c
    return whole


@pytest.mark.benchmark(group=GROUP)
def test_body_reader_feed_then_group(
    benchmark, chunks: list[bytes], qwen235_32k: rx.RoutedExperts
) -> None:
    sample = benchmark(read_as_fed, chunks)
    np.testing.assert_array_equal(np.concatenate([p.array for p in sample]), qwen235_32k.array)


@pytest.mark.benchmark(group=GROUP)
def test_join_then_from_response(
    benchmark, chunks: list[bytes], qwen235_32k: rx.RoutedExperts
) -> None:
    assert benchmark(read_joined, chunks) == qwen235_32k


@pytest.mark.benchmark(group=GROUP)
def test_join_then_orjson_pybase64(
    benchmark, chunks: list[bytes], qwen235_32k: rx.RoutedExperts
) -> None:
    np.testing.assert_array_equal(benchmark(read_joined_python, chunks), qwen235_32k.array)


@pytest.mark.benchmark(group=GROUP)
def test_append_chunks_memcpy(benchmark, chunks: list[bytes]) -> None:
    assert len(benchmark(append_chunks, chunks)) == sum(map(len, chunks))


@pytest.mark.benchmark(group=GROUP)
def test_memcpy_of_body(benchmark, chunks: list[bytes]) -> None:
    """The floor: one copy of the whole body's bytes, already joined."""
    whole = b"".join(chunks)
    assert len(benchmark(baselines.memcpy, whole)) == len(whole)
