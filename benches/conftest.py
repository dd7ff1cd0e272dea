"""pytest-benchmark fixtures: realistic payloads (alternatives: routed_experts.baselines)."""

from __future__ import annotations

import pytest

import routed_experts as rx
from routed_experts._synthetic import synthetic_rollout


@pytest.fixture(scope="session")
def qwen235_32k() -> rx.RoutedExperts:
    """Qwen3-235B-A22B (94 layers, top_k 8), 32k tokens, uint8: 24.6 MB decoded, 33 MB base64."""
    return synthetic_rollout("qwen3-235b-a22b", 32 * 1024)
