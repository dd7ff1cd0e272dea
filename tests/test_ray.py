"""Payloads and trajectories through Ray's object store, with Ray itself (format.md §6: pickling
round-trips; protocol 5 passes the buffer out of band). Skipped only where Ray cannot install."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import routed_experts as rx

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Ray's own import-time deprecations are not ours to fix
    ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        # Older Ray releases (the last for Python 3.9) leave a helper process to be reaped by
        # the garbage collector, which warns about it; that is Ray's, not ours.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            ray.shutdown()
            gc.collect()


def rollout(tokens: int, seed: int = 0) -> rx.RoutedExperts:
    rng = np.random.default_rng(seed)
    return rx.RoutedExperts.from_array(rng.integers(0, 128, size=(tokens, 94, 8), dtype=np.uint8))


def test_a_payload_reaches_a_task_and_comes_back_equal(cluster: Any) -> None:
    p = rx.RoutedExperts.from_array(np.arange(600).reshape(25, 6, 4), start=17)  # uint16

    @cluster.remote
    def describe(q: rx.RoutedExperts) -> tuple[int, int, str, int]:
        return q.start, q.num_tokens, str(q.dtype), int(q.array.sum())

    assert cluster.get(describe.remote(p)) == (17, 25, "uint16", int(p.array.sum()))

    @cluster.remote
    def echo(q: rx.RoutedExperts) -> rx.RoutedExperts:
        return q

    back = cluster.get(echo.remote(cluster.put(p)))
    assert back == p and back.dtype == np.uint16 and not back.array.flags.writeable


def test_a_trajectory_built_in_a_task_returns_its_payload(cluster: Any) -> None:
    whole = rollout(300, seed=3)
    turns = [whole.slice(0, 100), whole.slice(99, 220), whole.slice(219, 300)]

    @cluster.remote
    def stitch(parts: list[rx.RoutedExperts]) -> rx.Trajectory:
        t = rx.Trajectory()
        for part in parts:
            t.append(part)
        return t

    t = cluster.get(stitch.remote(turns))
    assert isinstance(t, rx.Trajectory) and t.payload == whole
    t.append(rollout(1, seed=9).slice(0, 1), overlap="keep")  # still a working trajectory
    assert len(t) == 300


def test_get_views_the_object_store_without_a_copy(cluster: Any) -> None:
    # 32k tokens x 94 layers x top_k 8 = 24.6 MB. Out-of-band pickling hands the payload the
    # object store's (immutable, aligned) buffer, which it views: two gets of one object see
    # the same memory, and writing to the result is refused. (What that saves is measured in
    # BENCHMARKS.md, not asserted here.)
    p = rollout(32768)
    ref = cluster.put(p)
    a, b = cluster.get(ref), cluster.get(ref)
    assert a == p and b == p
    assert a.array.ctypes.data == b.array.ctypes.data
    assert a.array.ctypes.data != p.array.ctypes.data
    with pytest.raises(ValueError):
        a.array[0, 0, 0] = 1
    # A trajectory that grows from such a payload copies it first; the stored object is untouched.
    t = rx.Trajectory()
    t.append(a)
    t.append(rollout(2, seed=5).slice(0, 2), overlap="replace")
    assert cluster.get(ref) == p
