"""The replay ids a GPU makes (`rx.replay._device.ids_on`: rows copied narrow, checked and
widened by torch) held to the host's Rust pass (`rx.replay.replay_ids`) on CPU tensors: the same
ids, the same rows replayed, the same first bad row refused with the same words, for rows of
every dtype an engine sends, hostile ones included (make test-trainer)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import routed_experts as rx
from routed_experts.replay import _device, replay_ids
from routed_experts.replay._rows import RouterRows


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    experts = draw(st.integers(1, 12))
    top_k = draw(st.integers(1, min(experts, 4)))
    tokens = draw(st.integers(0, 10))
    width = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(["int8", "int16", "int32", "int64", "uint8", "uint16"]))
    low = -3 if dtype.startswith("int") else 0
    high = {"uint16": 70000, "int64": 2**40}.get(dtype, experts + 1)
    cell = st.integers(low, experts + 1) | st.integers(low, min(high, np.iinfo(dtype).max))
    n = tokens * width * top_k
    rows = np.array(draw(st.lists(cell, min_size=n, max_size=n)), dtype=np.int64)
    rows = rows.reshape(tokens, width, top_k)
    for r in draw(st.lists(st.integers(0, max(tokens - 1, 0)), max_size=3)):
        if tokens and low < 0:
            rows[r, draw(st.integers(0, width - 1))] = -1
    if draw(st.booleans()):  # mostly valid rows, so the fill and copy are reached too
        for r in range(tokens):
            for w in range(width):
                rows[r, w] = np.random.default_rng(r * 7 + w).permutation(experts)[:top_k]
    layers = draw(st.lists(st.integers(0, width - 1), min_size=1, max_size=3))
    valid = draw(st.none() | st.lists(st.booleans(), min_size=tokens, max_size=tokens))
    return {
        "rows": rows.astype(dtype), "layers": layers, "experts": experts,
        "valid": None if valid is None else np.array(valid, dtype=bool),
        "origin": draw(st.none() | st.just(np.stack([np.arange(tokens) // 3,
                                                     np.arange(tokens) % 3], axis=1))),
        "index": draw(st.sampled_from([torch.int64, torch.int32])),
    }  # fmt: skip


@settings(deadline=None, max_examples=300)
@given(case=cases())
def test_the_device_path_makes_and_refuses_what_the_host_does(case: dict[str, Any]) -> None:
    rows, layers, experts, valid = case["rows"], case["layers"], case["experts"], case["valid"]
    places = [f"router {i}" for i in range(len(layers))]
    np_index = np.int64 if case["index"] == torch.int64 else np.int32
    described = RouterRows(rows, layers, valid, experts, places,
                           name_rows=lambda: case["origin"])  # fmt: skip
    try:
        want = replay_ids(rows, layers, valid, experts, places, np_index, origin=case["origin"])
    except rx.PayloadError as e:
        with pytest.raises(rx.PayloadError) as got:
            _device.ids_on(described, device="cpu", dtype=case["index"])
        assert str(got.value) == str(e)
        return
    ids, replayed = _device.ids_on(described, device="cpu", dtype=case["index"])
    assert ids.dtype == case["index"] and ids.is_contiguous()
    np.testing.assert_array_equal(ids.numpy(), want[0])
    np.testing.assert_array_equal(replayed.numpy(), want[1])


def test_the_layer_checks_run_where_the_rows_are() -> None:
    pattern = [False, True, True]
    rows = np.zeros((4, 3, 2), dtype=np.int16)
    rows[:, 1:] = [0, 1]
    rows[3] = -1  # no routing: on a dense layer as anywhere else
    _device.ids_on(RouterRows(rows, [1, 2], None, 8, ["a", "b"], pattern), device="cpu")
    rows[2, 0] = [1, 2]
    with pytest.raises(rx.PayloadError, match="decoder layer 0 is dense"):
        _device.ids_on(RouterRows(rows, [1, 2], None, 8, ["a", "b"], pattern), device="cpu")
    rows[2, 0] = 0
    rows[:3, 2] = 0
    with pytest.raises(rx.PayloadError, match="payload layer 2: .* all zero"):
        _device.ids_on(RouterRows(rows, [1, 2], None, 8, ["a", "b"], pattern), device="cpu")


def test_a_ranks_share_is_written_into_a_host_tensor_reused_from_step_to_step() -> None:
    # A trainer's staging buffer (pinned where there is a GPU): its `.numpy()` is `out`, and the
    # tensor holds the share afterwards with nothing copied in between.
    pin = torch.cuda.is_available()
    buf = torch.full((4096,), 7, dtype=torch.int32, pin_memory=pin)
    rng = np.random.default_rng(3)
    for step in range(3):
        prompt = rx.RoutedExperts.from_array(rng.integers(0, 64, size=(10 + step, 3, 2)))
        own = [rx.RoutedExperts.from_array(rng.integers(0, 64, size=(4, 3, 2)), start=10 + step)
               for _ in range(3)]  # fmt: skip
        samples = [(prompt, o) for o in own]
        rank: dict[str, Any] = {"cp_size": 2, "cp_rank": step % 2, "layers": (1, 3)}
        want, _, _ = rx.shard(*rx.pack(samples, pad_each_to_multiple=4, mask=True), **rank)
        got, _, _ = rx.pack_shard(samples, pad_each_to_multiple=4, out=buf.numpy(), **rank)
        np.testing.assert_array_equal(got, want)
        torch.testing.assert_close(buf[: want.size].view(want.shape), torch.from_numpy(want))
        assert buf.is_pinned() == pin


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs a GPU")
def test_rows_already_in_pinned_memory_are_copied_from_there(monkeypatch: Any) -> None:
    # pack_shard's `out` in a pinned tensor: the device path copies the rows from it, with no
    # second staging copy (pin_memory refused here), and makes the host's ids.
    buf = torch.zeros(6 * 2 * 2, dtype=torch.uint8, pin_memory=True)
    rows = buf.numpy().reshape(6, 2, 2)
    rows[:] = np.arange(24).reshape(6, 2, 2) % 8
    want = replay_ids(rows, [0, 1], None, 8, ["a", "b"], np.int64)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("rows already pinned were staged again")

    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    ids, replayed = _device.ids_on(RouterRows(rows, [0, 1], None, 8, ["a", "b"]), device="cuda")
    np.testing.assert_array_equal(ids.cpu().numpy(), want[0])
    np.testing.assert_array_equal(replayed.cpu().numpy(), want[1])


@pytest.mark.parametrize("on_device", [False, True])
def test_rows_are_named_only_when_one_is_refused(on_device: bool) -> None:
    # A rank's cut of its batch into (sample, position) is made for the error alone: a step
    # whose rows all pass never makes it, on the host's path or the device's.
    rows = np.array([[1, 2], [3, 4], [5, 6]], dtype=np.uint8)[:, None, :]
    asked: list[int] = []

    def name_rows() -> np.ndarray:
        asked.append(1)
        return np.array([[0, 5], [1, 0], [1, 1]])

    def run(r: np.ndarray) -> Any:
        described = RouterRows(r, [0], None, 8, ["r"], name_rows=name_rows)
        if on_device:
            return _device.ids_on(described, device="cpu")
        return _device.router_tensors(described, device=torch.device("cpu"), dtype=torch.int64,
                                      pin_memory=False)  # fmt: skip

    run(rows)
    assert asked == []
    rows[2] = [7, 7]
    with pytest.raises(rx.PayloadError, match="^r, sample 1, position 1: .*distinct"):
        run(rows)
    assert asked
