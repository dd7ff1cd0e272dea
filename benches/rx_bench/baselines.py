"""What a user would write instead of this library, for side-by-side benchmarks.

`stdlib_*` need only the standard library and numpy; `fast_*` use orjson and pybase64 (the
`bench` extra), the fastest pure-Python-ecosystem route.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Callable

import numpy as np


def _loads_b64(
    fast: bool,
) -> tuple[Callable[[Any], Any], Callable[[Any], bytes], Callable[[bytes], bytes]]:
    if fast:
        import orjson
        import pybase64

        return orjson.loads, lambda s: pybase64.b64decode(s, validate=True), pybase64.b64encode
    return json.loads, base64.b64decode, base64.b64encode


def _array(routing: dict[str, Any], b64decode: Callable[[Any], bytes]) -> np.ndarray:
    raw = b64decode(routing["data"])
    return np.frombuffer(raw, dtype=routing.get("dtype", "uint8")).reshape(routing["shape"])


def decode_sidecar(wire: bytes, fast: bool = True) -> np.ndarray:
    loads, b64decode, _ = _loads_b64(fast)
    return _array(loads(wire), b64decode)


def _sidecar(arr: np.ndarray, start: int, b64encode: Callable[[bytes], bytes]) -> dict[str, Any]:
    return {
        "data": b64encode(arr.tobytes()).decode(),
        "shape": list(arr.shape),
        "start": start,
        "dtype": str(arr.dtype),
    }


def _dumps(doc: Any, fast: bool) -> bytes:
    if fast:
        import orjson

        return bytes(orjson.dumps(doc))
    return json.dumps(doc, separators=(",", ":")).encode()


def encode_sidecar(arr: np.ndarray, start: int, fast: bool = True) -> bytes:
    _, _, b64encode = _loads_b64(fast)
    return _dumps(_sidecar(arr, start, b64encode), fast)


def from_response(body: bytes, fast: bool = True) -> np.ndarray:
    loads, b64decode, _ = _loads_b64(fast)
    return _array(loads(body)["choices"][0]["routed_experts"], b64decode)


def merge_response(prefill_body: bytes, decode_body: bytes, fast: bool = True) -> bytes:
    """A router's merge written carefully (by absolute offsets, not prefill.seq_len)."""
    loads, b64decode, b64encode = _loads_b64(fast)
    pre, dec = loads(prefill_body), loads(decode_body)
    p_route = pre["choices"][0]["routed_experts"]
    for choice in dec["choices"]:
        d_route = choice.get("routed_experts")
        if d_route is None:
            continue
        p, d = _array(p_route, b64decode), _array(d_route, b64decode)
        p_start, d_start = p_route.get("start", 0), d_route.get("start", 0)
        skip = max(p_start + len(p) - d_start, 0)
        merged = np.concatenate([p, d[skip:].astype(np.result_type(p, d))])
        choice["routed_experts"] = _sidecar(merged, p_start, b64encode)
    return _dumps(dec, fast)


def memcpy(data: bytes) -> bytearray:
    """The floor: one copy of the same bytes."""
    return bytearray(data)


def copy_into(dst: bytearray | memoryview, data: bytes) -> None:
    """One copy of `data` into memory already mapped: the floor for a computation that reads
    its inputs and allocates little (`memcpy` above also pays for faulting in new pages)."""
    memoryview(dst)[:] = data


def agreement(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Replay statistics as a user writes them in numpy: sort each top-k row, compare. (Less
    than `rx.agreement` computes: no overlap, which needs a per-router intersection.)"""
    same = (np.sort(a, axis=-1) == np.sort(b, axis=-1)).all(axis=-1)  # (tokens, layers)
    differing = (~same).sum(axis=1)
    return {
        "exact_match": float(same.mean()),
        "exact_match_per_layer": same.mean(axis=0),
        "tokens_with_difference": float((differing > 0).mean()),
        "differing_per_token": float(differing.mean()),
    }


def expert_load(a: np.ndarray, num_experts: int) -> np.ndarray:
    """The (layers, num_experts) count table as a user writes it: np.bincount per layer."""
    return np.stack(
        [np.bincount(a[:, layer].ravel(), minlength=num_experts) for layer in range(a.shape[1])]
    )
