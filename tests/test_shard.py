"""`rx.shard`: one rank's share of a packed batch (format.md §6.1), against a numpy reference of
the documented rule on random packed batches; every rank's shares together hold every row of
every sample exactly once; bad arguments are `RoutedExpertsError`s naming the argument."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routed_experts as rx


def reference(
    batch: np.ndarray, cu: list[int], mask: np.ndarray | None, cp: int, r: int, split: str,
    tp: int, t: int, layers: tuple[int, int] | None,
) -> tuple[np.ndarray, list[int], np.ndarray | None]:
    """The rule as format.md §6.1 states it, written plainly."""
    idx: list[int] = []
    out_cu = [0]
    for s, e in zip(cu[:-1], cu[1:]):
        n = e - s
        if cp == 1:
            idx += list(range(s, e))
        elif split == "zigzag":
            c = n // (2 * cp)
            idx += list(range(s + r * c, s + (r + 1) * c))
            j = 2 * cp - 1 - r
            idx += list(range(s + j * c, s + (j + 1) * c))
        else:
            c = n // cp
            idx += list(range(s + r * c, s + (r + 1) * c))
        out_cu.append(out_cu[-1] + n // cp)
    part = len(idx) // tp
    idx = idx[t * part:(t + 1) * part]
    lo, hi = layers if layers else (0, batch.shape[1])
    rows = batch[idx][:, lo:hi]
    return rows, out_cu, (mask[idx] if mask is not None else None)


@st.composite
def packed(draw: Any) -> tuple[np.ndarray, list[int], np.ndarray, int, str, int]:
    cp = draw(st.sampled_from([1, 2, 4, 8]))
    tp = draw(st.sampled_from([1, 2, 4]))
    split = draw(st.sampled_from(["zigzag", "contiguous"]))
    unit = cp if split == "contiguous" or cp == 1 else 2 * cp
    lengths = draw(st.lists(st.integers(0, 4), min_size=1, max_size=5))
    lengths = [n * unit for n in lengths]
    # The rank's rows must split tp ways: pad the last sample until they do.
    while sum(lengths) // cp % tp:
        lengths[-1] += unit
    cu = [0, *np.cumsum(lengths).tolist()]
    pad = draw(st.integers(0, 3))  # rows after the last sample (pack's pad_to_multiple)
    layers, top_k = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([np.uint8, np.int16, np.int32, np.int64, np.uint16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    hi = min(np.iinfo(dtype).max, 70000)
    batch = rng.integers(0, hi, size=(cu[-1] + pad, layers, top_k)).astype(dtype)
    mask = rng.random(cu[-1] + pad) < 0.8
    return batch, cu, mask, cp, split, tp


@settings(max_examples=300, deadline=None)
@given(packed(), st.data())
def test_each_ranks_share_is_the_documented_rule_and_all_shares_cover_every_row_once(
    case: tuple[np.ndarray, list[int], np.ndarray, int, str, int], data: Any
) -> None:
    batch, cu, mask, cp, split, tp = case
    num_layers = batch.shape[1]
    lo = data.draw(st.integers(0, num_layers - 1))
    layers = data.draw(st.sampled_from([None, (lo, data.draw(st.integers(lo + 1, num_layers)))]))
    seen = np.zeros(cu[-1], dtype=np.int64)
    ids = np.arange(len(batch))  # which batch row each share's row came from
    for r in range(cp):
        for t in range(tp):
            got, got_cu, got_mask = rx.shard(batch, cu, mask, cp_size=cp, cp_rank=r,
                                             cp_split=split, tp_size=tp, tp_rank=t, layers=layers)
            want, want_cu, want_mask = reference(batch, cu, mask, cp, r, split, tp, t, layers)
            assert got.dtype == batch.dtype and got.flags.c_contiguous and got.flags.writeable
            np.testing.assert_array_equal(got, want)
            assert got_cu.dtype == np.int32 and got_cu.tolist() == want_cu
            assert got_mask is not None and want_mask is not None
            np.testing.assert_array_equal(got_mask, want_mask)
            # Which rows: shard the row numbers themselves (as a one-layer batch).
            taken, _, _ = rx.shard(ids.reshape(-1, 1, 1), cu, cp_size=cp, cp_rank=r,
                                   cp_split=split, tp_size=tp, tp_rank=t)
            np.add.at(seen, taken.ravel(), 1)
    assert (seen == 1).all()  # every row of every sample on exactly one rank, padding on none


def test_the_worked_example_of_the_docs() -> None:
    # Two samples of 8 and 4 rows, cp 2, zigzag: chunks of 2 and 1 rows.
    rows = np.arange(12).reshape(12, 1, 1)
    cu = [0, 8, 12]
    r0, cu0, _ = rx.shard(rows, cu, cp_size=2, cp_rank=0)
    r1, cu1, _ = rx.shard(rows, cu, cp_size=2, cp_rank=1)
    assert r0.ravel().tolist() == [0, 1, 6, 7, 8, 11] and cu0.tolist() == [0, 4, 6]
    assert r1.ravel().tolist() == [2, 3, 4, 5, 9, 10] and cu1.tolist() == [0, 4, 6]
    # Sequence parallelism then cuts rank 0's six rows in two: tp rank 1 takes 7, 8, 11.
    t1, cut, _ = rx.shard(rows, cu, cp_size=2, cp_rank=0, tp_size=2, tp_rank=1)
    assert t1.ravel().tolist() == [7, 8, 11] and cut.tolist() == [0, 4, 6]


def test_a_strided_batch_gives_the_same_share_as_its_contiguous_copy() -> None:
    wide = np.arange(24 * 4 * 6).reshape(24, 4, 6) % 1000
    view = wide[:, :, 1::2]  # top_k 3, every other column: not one contiguous slice
    assert not view.flags.c_contiguous
    cu = [0, 16, 24]
    for layers in (None, (1, 3)):
        got, got_cu, _ = rx.shard(view, cu, cp_size=2, cp_rank=1, layers=layers)
        want, want_cu, _ = rx.shard(np.ascontiguousarray(view), cu, cp_size=2, cp_rank=1,
                                    layers=layers)
        np.testing.assert_array_equal(got, want)
        assert got_cu.tolist() == want_cu.tolist()


def test_a_read_only_batch_and_a_packed_pair_shard_without_complaint() -> None:
    a = rx.RoutedExperts.from_array(np.arange(16 * 3 * 2).reshape(16, 3, 2) % 200)
    b = rx.RoutedExperts.from_array(np.arange(8 * 3 * 2).reshape(8, 3, 2) % 200)
    batch, cu = rx.pack([a, b])
    batch.flags.writeable = False  # as Ray's object store maps it
    share, share_cu, mask = rx.shard(batch, cu, cp_size=4, cp_rank=3, layers=(1, 3))
    want, want_cu, _ = reference(batch, cu.tolist(), None, 4, 3, "zigzag", 1, 0, (1, 3))
    np.testing.assert_array_equal(share, want)
    assert share_cu.tolist() == want_cu and mask is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cp_size": 0}, "`cp_size`: expected a positive integer, got 0"),
        ({"cp_size": -2}, "`cp_size`: expected a non-negative integer, got -2"),
        ({"cp_size": 2**70}, "`cp_size`: expected an integer below 2**64"),
        ({"cp_size": 2, "cp_rank": 2}, "`cp_rank`: expected 0 to 1 (cp_size=2), got 2"),
        ({"tp_rank": -1}, "`tp_rank`: expected a non-negative integer, got -1"),
        ({"tp_size": 1.5}, "`tp_size`: expected an integer, got a float"),
        ({"cp_split": "ring"}, "`cp_split`: expected \"zigzag\" or \"contiguous\""),
        ({"layers": (2, 2)}, "`layers`: expected (start, stop) with 0 <= start < stop <= 3"),
        ({"layers": (-1, 2)}, "`layers`: expected a non-negative integer, got -1"),
        ({"cp_size": 4}, "sample 0 has 12 rows, not a multiple of 2 x cp_size = 8"),
        ({"tp_size": 5}, "not a multiple of tp_size=5"),
    ],
)
def test_bad_arguments_are_routed_experts_errors_naming_them(
    kwargs: dict[str, Any], message: str
) -> None:
    batch = np.zeros((20, 3, 2), dtype=np.uint8)
    with pytest.raises(rx.RoutedExpertsError) as e:
        rx.shard(batch, [0, 12, 16], **kwargs)
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("batch", "cu", "mask", "message"),
    [
        (np.zeros((4, 2), np.uint8), [0, 4], None, "`batch`: expected 3 dimensions"),
        (np.zeros((4, 2, 1), np.float32), [0, 4], None, "`batch`: expected an integer array"),
        (np.zeros((4, 2, 1), np.uint8), [0, 5], None, "`cu_seqlens`: expected entries up to"),
        (np.zeros((4, 2, 1), np.uint8), [1, 4], None, "`cu_seqlens`: expected a first entry of 0"),
        (np.zeros((4, 2, 1), np.uint8), [0, -4], None, "`cu_seqlens`: expected non-negative"),
        (np.zeros((4, 2, 1), np.uint8), [[0, 4]], None, "`cu_seqlens`: expected a 1-d integer"),
        (np.zeros((4, 2, 1), np.uint8), [0, 4], np.ones(3, bool), "`mask`: expected 4 entries"),
        (np.zeros((4, 2, 1), np.uint8), [0, 4], np.ones(4, np.int8), "`mask`: expected a 1-d bool"),
    ],
)
def test_bad_inputs_are_routed_experts_errors_naming_them(
    batch: np.ndarray, cu: Any, mask: Any, message: str
) -> None:
    with pytest.raises(rx.RoutedExpertsError) as e:
        rx.shard(batch, cu, mask)
    assert message in str(e.value), str(e.value)
