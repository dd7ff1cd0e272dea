"""Realistic routing records of real model sizes, for the demo, benchmarks and tests."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from routed_experts._core import RoutedExperts

# Model dimensions: (MoE layers, top_k, experts). Sources: the models' config.json.
MODELS: dict[str, tuple[int, int, int]] = {
    "qwen3-30b-a3b": (48, 8, 128),
    "qwen3-235b-a22b": (94, 8, 128),
    "deepseek-v3": (58, 8, 256),
    "kimi-k2": (60, 8, 384),
}


def synthetic_rollout(
    model: str, num_tokens: int, *, start: int = 0, seed: int = 0
) -> RoutedExperts:
    """Per token and layer, `top_k` distinct expert ids, in the model's dtype (`num_experts`)."""
    layers, top_k, experts = MODELS[model]
    rng = np.random.default_rng(seed)
    ids = np.empty((num_tokens, layers, top_k), dtype=np.int64)
    chunk = 1024  # bound the temporary (chunk x layers x experts) score array
    for lo in range(0, num_tokens, chunk):
        scores = rng.random((min(chunk, num_tokens - lo), layers, experts), dtype=np.float32)
        ids[lo : lo + chunk] = np.argpartition(scores, top_k, axis=-1)[..., :top_k]
    return RoutedExperts.from_array(ids, start=start, num_experts=experts)


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of `repeat` timed runs after one warm-up run: the least disturbed by the
    rest of the machine."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
