"""Stitching a 64-turn, 32k-token Qwen3-235B trajectory, beside numpy concatenate per turn."""

from __future__ import annotations

import numpy as np
import pytest

import routed_experts as rx

TURNS = 64


@pytest.fixture(scope="module")
def turns(qwen235_32k: rx.RoutedExperts) -> list[rx.RoutedExperts]:
    """Engine deltas: turn i covers [S, stop) with S = previous stop - 1 (one row overlap)."""
    n = qwen235_32k.num_tokens
    cuts = np.linspace(0, n, TURNS + 1, dtype=int)
    out = []
    for i in range(TURNS):
        s = max(int(cuts[i]) - 1, 0)
        out.append(qwen235_32k.slice(s, int(cuts[i + 1])))
    return out


def stitch_routed_experts(turns: list[rx.RoutedExperts]) -> rx.RoutedExperts:
    t = rx.Trajectory()
    for p in turns:
        t.append(p)
    return t.payload  # type: ignore[return-value]


def stitch_numpy_concatenate(turns: list[rx.RoutedExperts]) -> np.ndarray:
    """What orchestrators write today: concatenate the new rows onto the whole each turn."""
    held = turns[0].array
    stop = turns[0].stop
    for p in turns[1:]:
        held = np.concatenate([held, p.array[stop - p.start :]])
        stop = p.stop
    return held


@pytest.mark.benchmark(group="stitch 64 turns qwen3-235b 32k")
def test_stitch_trajectory(
    benchmark, turns: list[rx.RoutedExperts], qwen235_32k: rx.RoutedExperts
) -> None:
    assert benchmark(stitch_routed_experts, turns) == qwen235_32k


@pytest.mark.benchmark(group="stitch 64 turns qwen3-235b 32k")
def test_stitch_numpy_concatenate_per_turn(
    benchmark, turns: list[rx.RoutedExperts], qwen235_32k: rx.RoutedExperts
) -> None:
    np.testing.assert_array_equal(benchmark(stitch_numpy_concatenate, turns), qwen235_32k.array)
