"""Decode, encode and merge of a 32k-token Qwen3-235B payload, beside the alternatives."""

from __future__ import annotations

import numpy as np
import pytest

import routed_experts as rx
from rx_bench import baselines
from rx_bench.codec import body

DECODE = "decode qwen3-235b 32k"
ENCODE = "encode qwen3-235b 32k"
MERGE = "merge_response qwen3-235b 32k, prompt 3/4"


@pytest.mark.benchmark(group=DECODE)
def test_decode_routed_experts(benchmark, qwen235_32k: rx.RoutedExperts) -> None:
    wire = qwen235_32k.to_json()
    assert benchmark(rx.RoutedExperts.from_json, wire) == qwen235_32k


@pytest.mark.benchmark(group=DECODE)
@pytest.mark.parametrize("fast", [True, False], ids=["orjson_pybase64", "stdlib"])
def test_decode_python(benchmark, qwen235_32k: rx.RoutedExperts, fast: bool) -> None:
    wire = qwen235_32k.to_json()
    out = benchmark(baselines.decode_sidecar, wire, fast)
    np.testing.assert_array_equal(out, qwen235_32k.array)


@pytest.mark.benchmark(group=DECODE)
def test_decode_memcpy_of_sidecar(benchmark, qwen235_32k: rx.RoutedExperts) -> None:
    benchmark(baselines.memcpy, qwen235_32k.to_json())


@pytest.mark.benchmark(group=ENCODE)
def test_encode_routed_experts(benchmark, qwen235_32k: rx.RoutedExperts) -> None:
    assert benchmark(qwen235_32k.to_json) == qwen235_32k.to_json()


@pytest.mark.benchmark(group=ENCODE)
@pytest.mark.parametrize("fast", [True, False], ids=["orjson_pybase64", "stdlib"])
def test_encode_python(benchmark, qwen235_32k: rx.RoutedExperts, fast: bool) -> None:
    out = benchmark(baselines.encode_sidecar, qwen235_32k.array, 0, fast)
    assert out == qwen235_32k.to_json()


@pytest.fixture(scope="module")
def bodies(qwen235_32k: rx.RoutedExperts) -> tuple[bytes, bytes]:
    """Prefill rows [0, 3/4 n); decode's full sequence with the prompt rows zeroed."""
    prompt = qwen235_32k.num_tokens * 3 // 4
    zeroed = qwen235_32k.to_numpy(writable=True)
    zeroed[:prompt] = 0
    decode = rx.RoutedExperts.from_array(zeroed, dtype=qwen235_32k.dtype)
    return body(qwen235_32k.slice(0, prompt).to_dict()), body(decode.to_dict())


@pytest.mark.benchmark(group=MERGE)
@pytest.mark.parametrize("splice", [True, False], ids=["splice", "general"])
def test_merge_response_routed_experts(
    benchmark, bodies: tuple[bytes, bytes], qwen235_32k: rx.RoutedExperts, splice: bool
) -> None:
    out = benchmark(rx.merge_response, *bodies, splice=splice)
    assert rx.from_response(out) == qwen235_32k


@pytest.mark.benchmark(group=MERGE)
def test_merge_response_orjson_pybase64(
    benchmark, bodies: tuple[bytes, bytes], qwen235_32k: rx.RoutedExperts
) -> None:
    out = benchmark(baselines.merge_response, *bodies)
    assert rx.from_response(out) == qwen235_32k
