"""Router replay's framework-free part (format.md §6.2): layers mapped, rows ordered as a router
sees them, ids checked and completed. The frameworks themselves are tested in tests/trainer/
(`make test-trainer`, against real megatron-core and transformers)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routed_experts as rx
from routed_experts.replay import (
    check_layers,
    cp_sp_positions,
    fill_ids,
    local_rows,
    moe_pattern,
    payload_layer,
)


def test_the_moe_pattern_is_megatrons_moe_layer_freq() -> None:
    assert moe_pattern(4, 1) == [True] * 4
    assert moe_pattern(5, 2) == [True, False, True, False, True]
    assert moe_pattern(4, [0, 1, 1, 1]) == [False, True, True, True]
    with pytest.raises(rx.ConfigError, match="one entry per layer \\(4\\), got 3"):
        moe_pattern(4, [1, 1, 1])
    with pytest.raises(rx.ConfigError, match="an int >= 1, got 0"):
        moe_pattern(4, 0)


def test_a_payload_of_every_layer_or_of_moe_layers_only_feeds_each_router() -> None:
    pattern = [False, True, True, False, True]  # routers at layers 1, 2, 4
    assert [payload_layer(i, 5, pattern) for i in (1, 2, 4)] == [1, 2, 4]
    assert [payload_layer(i, 3, pattern) for i in (1, 2, 4)] == [0, 1, 2]
    with pytest.raises(rx.ConfigError, match="the payload has 4 layers, but the model has 5 "
                       "decoder layers of which 3 have routers"):
        payload_layer(1, 4, pattern)
    with pytest.raises(rx.ConfigError, match="decoder layer 0 has no router"):
        payload_layer(0, 5, pattern)


def test_a_payload_that_does_not_fit_the_model_is_refused_naming_the_layer() -> None:
    pattern = [False, True, True]
    rows = np.zeros((4, 3, 2), dtype=np.int32)
    rows[:, 1] = [0, 1]
    rows[:, 2] = [2, 3]
    check_layers(rows, pattern, None)  # the dense layer zero, both MoE layers routed
    check_layers(rows[:, 1:], pattern, None)  # MoE layers only: nothing dense to look at
    dense = rows.copy()
    dense[3, 0] = [5, 6]
    with pytest.raises(rx.PayloadError, match="payload layer 0: the model's decoder layer 0 is "
                       "dense, but the payload carries routing there"):
        check_layers(dense, pattern, None)
    # ...unless that row holds no routing (a padding row the mask leaves out).
    check_layers(dense, pattern, np.array([True, True, True, False]))
    # ...or it is -1 there: no routing, the same on a dense layer as on any other (issue 54,
    # item 4: -1 was counted as routing on a dense layer, and the payload refused).
    missing = rows.copy()
    missing[3] = -1
    check_layers(missing, pattern, None)
    missing[:, 2] = -1  # a MoE layer without a single row of routing is not "all zero"
    check_layers(missing, pattern, None)
    missing[0, 2] = 0
    with pytest.raises(rx.PayloadError, match="payload layer 2: .* rows there are all zero"):
        check_layers(missing, pattern, None)
    empty = rows.copy()
    empty[:, 2] = 0
    with pytest.raises(rx.PayloadError, match="payload layer 2: .* rows there are all zero"):
        check_layers(empty, pattern, None)


@st.composite
def id_rows(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    experts = draw(st.integers(1, 40))
    top_k = draw(st.integers(1, min(experts, 8)))
    tokens = draw(st.integers(0, 30))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids = np.array([rng.permutation(experts)[:top_k] for _ in range(tokens)]).reshape(
        tokens, top_k
    )
    valid = rng.random(tokens) < 0.7
    ids[rng.random(tokens) < 0.1] = -1  # a row an engine marks missing
    return ids.astype(np.int32), valid, experts


@settings(deadline=None)  # the profile's examples: fewer under emulation (tests/conftest.py)
@given(case=id_rows())
def test_rows_without_routing_get_distinct_ids_spread_over_the_experts(
    case: tuple[np.ndarray, np.ndarray, int],
) -> None:
    ids, valid, experts = case
    out, replayed = fill_ids(ids, valid, experts, "router 1")
    assert out.dtype == np.int64 and out.shape == ids.shape
    np.testing.assert_array_equal(replayed, valid & (ids >= 0).all(axis=1))
    np.testing.assert_array_equal(out[replayed], ids[replayed])
    assert ((out >= 0) & (out < experts)).all()
    # No row repeats an expert (zero padding would: slime #1052, SkyRL #1908).
    assert all(len(set(row)) == len(row) for row in out.tolist())
    # Filled rows walk the experts in turn: row r starts at expert (r * top_k) % experts.
    rows = np.flatnonzero(~replayed)
    np.testing.assert_array_equal(out[rows, 0], (rows * ids.shape[1]) % experts)


def test_recorded_ids_out_of_range_or_repeated_are_refused() -> None:
    with pytest.raises(rx.PayloadError, match="router 3, row 1: expert ids must be in "
                       "\\[0, 8\\), got \\[9, 1\\]"):
        fill_ids(np.array([[0, 1], [9, 1]]), None, 8, "router 3")
    with pytest.raises(rx.PayloadError, match="row 0: a row's expert ids must be distinct"):
        fill_ids(np.array([[4, 4]]), None, 8, "router 3")
    with pytest.raises(rx.PayloadError, match="`num_experts`: expected at least top_k \\(3\\)"):
        fill_ids(np.zeros((1, 3), dtype=np.int64), None, 2, "router 3")
    out, _ = fill_ids(np.array([[1, 0]]), None, 8, "r", np.int32)
    assert out.dtype == np.int32


def test_only_a_false_mask_or_minus_one_throughout_means_no_routing() -> None:
    # Issue 54, item 3: -5 was read as "no routing" and the row filled with spread ids.
    with pytest.raises(rx.PayloadError, match="^r, row 0: expert ids must be in \\[0, 8\\), got "
                       "\\[3, -5\\]$"):
        fill_ids(np.array([[3, -5], [4, -1]]), None, 8, "r")
    with pytest.raises(rx.PayloadError, match="^r, row 1: -1 \\(no routing\\) beside real ids"):
        fill_ids(np.array([[3, 5], [4, -1]]), None, 8, "r")
    out, replayed = fill_ids(np.array([[3, 5], [-1, -1]], dtype=np.int8), None, 8, "r")
    assert replayed.tolist() == [True, False] and out.tolist() == [[3, 5], [2, 3]]


def test_a_row_of_zeros_is_named_as_no_routing_by_sample_and_position() -> None:
    # Issue 54, item 6: vLLM's P + G - 1 rows packed to P + G without a mask end in a row of
    # zeros, which was refused as "expert ids must be distinct, got [0, 0]" at a flat row.
    rows = np.array([[1, 2], [3, 4], [0, 0]], dtype=np.uint8)[:, None, :]
    origin = np.array([[0, 5], [1, 0], [1, 1]])
    with pytest.raises(rx.PayloadError, match="^r, sample 1, position 1: no routing \\(ids all "
                       "zero.*mask=True.*got \\[0, 0\\]$"):
        rx.replay.replay_ids(rows, [0], None, 8, ["r"], origin=origin)


@st.composite
def hostile_rows(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray | None, int]:
    experts = draw(st.integers(1, 12))
    top_k = draw(st.integers(1, min(experts, 4)))
    tokens = draw(st.integers(0, 12))
    dtype = draw(st.sampled_from([np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16]))
    low = -3 if np.dtype(dtype).kind == "i" else 0
    cells = st.integers(low, experts + 1)
    ids = np.array(draw(st.lists(cells, min_size=tokens * top_k, max_size=tokens * top_k)),
                   dtype=np.int64).reshape(tokens, top_k)
    for r in draw(st.lists(st.integers(0, max(tokens - 1, 0)), max_size=3)):
        if tokens and low < 0:
            ids[r] = -1
    valid = draw(st.none() | st.lists(st.booleans(), min_size=tokens, max_size=tokens))
    return ids.astype(dtype), None if valid is None else np.array(valid, bool), experts


def expected_fill(ids: np.ndarray, valid: np.ndarray | None, experts: int) -> Any:
    """format.md §6.2 and §7 read row by row, in plain Python: the reference the Rust pass is held
    to (the first bad row's index, or the ids and the rows replayed)."""
    out, replayed = [], []
    top_k = ids.shape[1]
    for r, row in enumerate(ids.tolist()):
        routed = (valid is None or bool(valid[r])) and row != [-1] * top_k
        if routed and (any(v < 0 or v >= experts for v in row) or len(set(row)) < top_k):
            return r
        out.append(row if routed else [(r * top_k + j) % experts for j in range(top_k)])
        replayed.append(routed)
    return out, replayed


@settings(deadline=None)
@given(case=hostile_rows())
def test_every_row_is_replayed_filled_or_refused_as_the_contract_says(
    case: tuple[np.ndarray, np.ndarray | None, int],
) -> None:
    ids, valid, experts = case
    want = expected_fill(ids, valid, experts)
    if isinstance(want, int):
        with pytest.raises(rx.PayloadError, match=f"^r, row {want}: "):
            fill_ids(ids, valid, experts, "r")
        return
    out, replayed = fill_ids(ids, valid, experts, "r")
    assert out.reshape(-1, ids.shape[1]).tolist() == want[0] or ids.shape[0] == 0
    assert replayed.tolist() == want[1]


@settings(deadline=None)
@given(
    cp=st.integers(1, 4), tp=st.integers(1, 4), chunk=st.integers(1, 6),
    split=st.sampled_from(["zigzag", "contiguous"]),
)
def test_the_ranks_positions_cover_the_sequence_once_and_match_shard(
    cp: int, tp: int, chunk: int, split: str
) -> None:
    parts = 2 * cp if split == "zigzag" else cp
    per_rank = chunk * tp * (2 if split == "zigzag" else 1)
    seq = parts * per_rank // (2 if split == "zigzag" else 1)
    seen = []
    for c in range(cp):
        for t in range(tp):
            pos = cp_sp_positions(seq, cp, c, split, tp, t)  # type: ignore[arg-type]
            seen.extend(pos.tolist())
            # The same rows rx.shard gives the rank of a packed batch of this one sequence.
            rows = np.arange(seq, dtype=np.int32).reshape(seq, 1, 1)
            mine, _, _ = rx.shard(rows, np.array([0, seq], dtype=np.int32), cp_size=cp,
                                  cp_rank=c, cp_split=split,  # type: ignore[arg-type]
                                  tp_size=tp, tp_rank=t)
            np.testing.assert_array_equal(mine.ravel(), pos)
    assert sorted(seen) == list(range(seq))


def test_a_bshd_batch_is_flattened_sequence_first_as_a_router_sees_it() -> None:
    b, s = 2, 4
    batch = np.arange(b * s, dtype=np.int32).reshape(b, s, 1, 1)  # value = b * S + s
    rows, mask = local_rows(batch, layout="bshd")
    assert mask is None
    assert rows.ravel().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]  # row i = (s = i // B, b = i % B)
    m = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=bool)
    rows, mask = local_rows(batch, None, m, layout="bshd", cp_size=2, cp_rank=1)
    # zigzag over 4 positions in 4 chunks: rank 1 has positions 1 and 2.
    assert rows.ravel().tolist() == [1, 5, 2, 6]
    assert mask is not None and mask.tolist() == [True, True, True, False]
    with pytest.raises(rx.ConfigError, match="a packed \\(thd\\) batch needs it"):
        local_rows(batch.reshape(8, 1, 1))
    with pytest.raises(rx.ConfigError, match="does not split into 6 context-parallel chunks"):
        local_rows(batch, layout="bshd", cp_size=3)
    with pytest.raises(rx.ConfigError, match="a rank's share is \\[T, L, K\\]"):
        local_rows(batch, layout="rank")
    with pytest.raises(rx.ConfigError, match='`layout`: expected "thd", "bshd" or "rank"'):
        local_rows(batch, layout="sbhd")  # type: ignore[arg-type]


def test_a_rank_given_only_its_share_replays_the_same_rows() -> None:
    # format.md §6.2: cut where the batch is (rx.shard), send the share, replay it as the rank's
    # (layout="rank"): the same rows, in the same order, as the rank cutting the whole batch.
    rng = np.random.default_rng(5)
    batch = rng.integers(0, 8, size=(24, 3, 2), dtype=np.int32)
    cu = np.array([0, 8, 24], dtype=np.int32)
    mask = rng.random(24) < 0.8
    place = {"cp_size": 2, "cp_rank": 1, "tp_size": 2, "tp_rank": 1}
    whole, whole_mask = local_rows(batch, cu, mask, **place)
    share, _, share_mask = rx.shard(batch, cu, mask, **place)  # type: ignore[arg-type]
    given, given_mask = local_rows(share, None, share_mask, layout="rank")
    np.testing.assert_array_equal(given, whole)
    assert given_mask is not None and whole_mask is not None
    np.testing.assert_array_equal(given_mask, whole_mask)


def test_the_framework_functions_are_not_shadowed_by_their_modules() -> None:
    # Issue 54, item 7: `import routed_experts.replay.megatron` gave the function (the module's
    # name was the function's); the modules are private now, and the names are the functions.
    import importlib

    assert callable(rx.replay.megatron) and callable(rx.replay.hf)
    for name in ("megatron", "hf"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"routed_experts.replay.{name}")
    assert importlib.import_module("routed_experts.replay._megatron").megatron is rx.replay.megatron
