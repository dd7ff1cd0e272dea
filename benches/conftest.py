"""pytest-benchmark fixtures: realistic payloads and what a user would write instead."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

import routed_experts as rx
from routed_experts.cli import synthetic_rollout


@pytest.fixture(scope="session")
def qwen235_32k() -> rx.RoutedExperts:
    """Qwen3-235B-A22B (94 layers, top_k 8), 32k tokens, uint8: 24.6 MB decoded, 33 MB base64."""
    return synthetic_rollout("qwen3-235b-a22b", 32 * 1024)


def stdlib_decode(wire: bytes) -> np.ndarray:
    d = json.loads(wire)
    raw = base64.b64decode(d["data"])
    return np.frombuffer(raw, dtype=d.get("dtype", "uint8")).reshape(d["shape"])


def stdlib_encode(arr: np.ndarray, start: int) -> bytes:
    body = {
        "data": base64.b64encode(arr.tobytes()).decode(),
        "shape": list(arr.shape),
        "start": start,
        "dtype": str(arr.dtype),
    }
    return json.dumps(body, separators=(",", ":")).encode()
