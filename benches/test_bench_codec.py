"""Decode and encode of a 32k-token Qwen3-235B sidecar, side by side with the alternatives."""

from __future__ import annotations

import numpy as np
import orjson
import pybase64
import pytest

import routed_experts as rx
from conftest import stdlib_decode, stdlib_encode


def orjson_decode(wire: bytes) -> np.ndarray:
    d = orjson.loads(wire)
    raw = pybase64.b64decode(d["data"], validate=True)
    return np.frombuffer(raw, dtype=d.get("dtype", "uint8")).reshape(d["shape"])


def orjson_encode(arr: np.ndarray, start: int) -> bytes:
    return orjson.dumps(
        {
            "data": pybase64.b64encode(arr.tobytes()).decode(),
            "shape": list(arr.shape),
            "start": start,
            "dtype": str(arr.dtype),
        }
    )


@pytest.mark.benchmark(group="decode qwen3-235b 32k")
def test_decode_routed_experts(benchmark, qwen235_32k: rx.RoutedExperts) -> None:
    wire = qwen235_32k.to_json()
    p = benchmark(rx.RoutedExperts.from_json, wire)
    assert p == qwen235_32k


@pytest.mark.benchmark(group="decode qwen3-235b 32k")
def test_decode_orjson_pybase64_numpy(benchmark, qwen235_32k: rx.RoutedExperts) -> None:
    wire = qwen235_32k.to_json()
    np.testing.assert_array_equal(benchmark(orjson_decode, wire), qwen235_32k.array)


@pytest.mark.benchmark(group="decode qwen3-235b 32k")
def test_decode_stdlib_json_base64_numpy(benchmark, qwen235_32k: rx.RoutedExperts) -> None:
    wire = qwen235_32k.to_json()
    np.testing.assert_array_equal(benchmark(stdlib_decode, wire), qwen235_32k.array)


@pytest.mark.benchmark(group="decode qwen3-235b 32k")
def test_decode_memcpy_of_sidecar(benchmark, qwen235_32k: rx.RoutedExperts) -> None:
    wire = np.frombuffer(qwen235_32k.to_json(), dtype=np.uint8)
    benchmark(np.copy, wire)


@pytest.mark.benchmark(group="encode qwen3-235b 32k")
def test_encode_routed_experts(benchmark, qwen235_32k: rx.RoutedExperts) -> None:
    assert benchmark(qwen235_32k.to_json) == qwen235_32k.to_json()


@pytest.mark.benchmark(group="encode qwen3-235b 32k")
def test_encode_orjson_pybase64(benchmark, qwen235_32k: rx.RoutedExperts) -> None:
    out = benchmark(orjson_encode, qwen235_32k.array, qwen235_32k.start)
    assert out == qwen235_32k.to_json()


@pytest.mark.benchmark(group="encode qwen3-235b 32k")
def test_encode_stdlib_json_base64(benchmark, qwen235_32k: rx.RoutedExperts) -> None:
    out = benchmark(stdlib_encode, qwen235_32k.array, qwen235_32k.start)
    assert out == qwen235_32k.to_json()
