"""Router replay's framework-free part (format.md §6.2): layers mapped, rows ordered as a router
sees them, ids checked and completed. The frameworks themselves are tested in tests/trainer/
(`make test-trainer`, against real megatron-core and transformers)."""

from __future__ import annotations

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
    with pytest.raises(rx.PayloadError, match="router 3, row 1: expert ids must be below "
                       "num_experts 8, got \\[9, 1\\]"):
        fill_ids(np.array([[0, 1], [9, 1]]), None, 8, "router 3")
    with pytest.raises(rx.PayloadError, match="row 0: a row's expert ids must be distinct"):
        fill_ids(np.array([[4, 4]]), None, 8, "router 3")
    with pytest.raises(rx.PayloadError, match="`num_experts`: expected at least top_k \\(3\\)"):
        fill_ids(np.zeros((1, 3), dtype=np.int64), None, 2, "router 3")
    out, _ = fill_ids(np.array([[1, 0]]), None, 8, "r", np.int32)
    assert out.dtype == np.int32


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
