"""Multi-turn stitching (format.md §5): any turn split stitches back to the truth."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routed_experts as rx


@st.composite
def turn_splits(draw: st.DrawFn) -> tuple[np.ndarray, list[int]]:
    """A truth array and the total sequence length after each turn (strictly increasing)."""
    layers, top_k = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    cuts = sorted(set(draw(st.lists(st.integers(2, 80), min_size=1, max_size=8))))
    seed = draw(st.integers(0, 2**32 - 1))
    truth = np.random.default_rng(seed).integers(0, 256, size=(cuts[-1], layers, top_k))
    return truth, cuts


def engine_turns(truth: np.ndarray, cuts: list[int]) -> list[rx.RoutedExperts]:
    """What an engine returns each turn: rows [S, total - 1) with S = max(previous_total - 1, 0),
    each in its own compact dtype (uint8 or uint16 by its values)."""
    turns, previous = [], 0
    for total in cuts:
        s = max(previous - 1, 0)
        turns.append(rx.RoutedExperts.from_array(truth[s : total - 1], start=s))
        previous = total
    return turns


@settings(max_examples=300, deadline=None)
@given(split=turn_splits())
def test_any_turn_split_stitches_back_to_the_truth(split: tuple[np.ndarray, list[int]]) -> None:
    truth, cuts = split
    t = rx.Trajectory()
    for p in engine_turns(truth, cuts):
        t.append(p)
    assert (t.start, t.stop) == (0, cuts[-1] - 1)
    np.testing.assert_array_equal(t.payload.array, truth[: cuts[-1] - 1])  # type: ignore[union-attr]
    # The last sampled token has no row: to_training pads exactly that one.
    out = t.to_training(cuts[-1])
    np.testing.assert_array_equal(out[:-1], truth[: cuts[-1] - 1])
    np.testing.assert_array_equal(out[-1], truth[cuts[-1] - 2])


@settings(max_examples=200, deadline=None)
@given(split=turn_splits())
def test_full_sequences_from_zero_equal_deltas_with_keep(
    split: tuple[np.ndarray, list[int]],
) -> None:
    truth, cuts = split
    deltas, fulls = rx.Trajectory(), rx.Trajectory()
    for p in engine_turns(truth, cuts):
        deltas.append(p)
    previous = 0
    for total in cuts:
        # A server that ignored the requested start sends every turn from 0; its rows for the
        # earlier turns were recomputed (re-prefill) and differ. "keep" holds the original ones.
        full = truth[: total - 1].copy()
        full[: max(previous - 1, 0)] += 1
        fulls.append(rx.RoutedExperts.from_array(full), overlap="keep")
        previous = total
    assert fulls.payload == deltas.payload
    np.testing.assert_array_equal(fulls.payload.array, truth[: cuts[-1] - 1])  # type: ignore[union-attr]


@settings(max_examples=200, deadline=None)
@given(split=turn_splits(), data=st.data())
def test_mixed_dtypes_never_truncate(
    split: tuple[np.ndarray, list[int]], data: st.DataObject
) -> None:
    truth, cuts = split
    # Ids above 255 in some turns only: those turns arrive as uint16, the others as uint8.
    wide_rows = data.draw(st.lists(st.integers(0, len(truth) - 1), max_size=3))
    truth = truth.astype(np.int64)
    truth[wide_rows] += 300
    t = rx.Trajectory()
    turns = engine_turns(truth, cuts)
    for p in turns:
        t.append(p)
    held = t.payload
    assert held is not None
    np.testing.assert_array_equal(held.array, truth[: cuts[-1] - 1])
    assert held.dtype == ("uint16" if any(p.dtype == "uint16" for p in turns) else "uint8")


def test_policies_and_errors() -> None:
    base = np.arange(6, dtype=np.int64).reshape(6, 1, 1)
    t = rx.Trajectory()
    assert (t.start, t.stop, len(t), t.payload) == (None, None, 0, None)
    t.append(rx.RoutedExperts.from_array(base[:4], start=0))
    t.append(rx.RoutedExperts.from_array(base[2:5] + 10, start=2), overlap="replace")
    assert t.payload.array.ravel().tolist() == [0, 1, 12, 13, 14]  # type: ignore[union-attr]
    with pytest.raises(
        rx.MergeError, match="position 1, layer 0 holds 1 but the new payload has 2"
    ):
        t.append(rx.RoutedExperts.from_array(base[1:3] + 1, start=1), overlap="check")
    with pytest.raises(rx.MergeError, match="before the trajectory's start"):
        u = rx.Trajectory()
        u.append(rx.RoutedExperts.from_array(base[2:], start=2))
        u.append(rx.RoutedExperts.from_array(base[:1], start=1))
    with pytest.raises(rx.MergeError, match=r"rows \[5, 6\) are missing"):
        t.append(rx.RoutedExperts.from_array(base[:1], start=6))
    with pytest.raises(rx.MergeError, match="layers"):
        t.append(rx.RoutedExperts.from_array(np.zeros((1, 2, 1), dtype=np.int64), start=5))
    with pytest.raises(rx.PayloadError, match="`overlap`"):
        t.append(rx.RoutedExperts.from_array(base[:1], start=5), overlap="merge")
    with pytest.raises(rx.PayloadError, match="`pad`"):
        t.to_training(6, pad="edge")


def test_truncate_and_copy_branch_independently() -> None:
    base = np.arange(8, dtype=np.int64).reshape(8, 1, 1)
    t = rx.Trajectory()
    t.append(rx.RoutedExperts.from_array(base[:6]))
    branch = t.copy()
    branch.truncate(3)
    branch.append(rx.RoutedExperts.from_array(base[3:5] + 50, start=3))
    assert t.payload.array.ravel().tolist() == [0, 1, 2, 3, 4, 5]  # type: ignore[union-attr]
    assert branch.payload.array.ravel().tolist() == [0, 1, 2, 53, 54]  # type: ignore[union-attr]
    assert len(copy.copy(t)) == 6
    with pytest.raises(rx.MergeError, match=r"outside the trajectory's positions \[0, 6\]"):
        t.truncate(7)


def test_to_training_requires_start_zero_and_bounds_padding() -> None:
    t = rx.Trajectory()
    t.append(rx.RoutedExperts.from_array(np.ones((3, 1, 1), dtype=np.int64), start=2))
    with pytest.raises(rx.MergeError, match="starts at position 2"):
        t.to_training(5)
    u = rx.Trajectory()
    u.append(rx.RoutedExperts.from_array(np.arange(3, dtype=np.int64).reshape(3, 1, 1)))
    assert u.to_training(5, pad="zero", max_missing=2).ravel().tolist() == [0, 1, 2, 0, 0]
    with pytest.raises(rx.MergeError, match="2 missing, more than max_missing=1"):
        u.to_training(5)
    with pytest.raises(rx.MergeError, match="empty"):
        rx.Trajectory().to_training(1)


def test_a_hundred_one_row_turns_stitch_to_every_row_in_order() -> None:
    # That appending is amortised (no recopy of all rows per turn) is the benchmark's to
    # show; this checks what a hundred appends build.
    t = rx.Trajectory()
    rows = np.arange(100 * 2 * 2, dtype=np.int64).reshape(100, 2, 2) % 251
    for i in range(100):
        t.append(rx.RoutedExperts.from_array(rows[i : i + 1], start=i, dtype="uint8"))
    np.testing.assert_array_equal(t.payload.array, rows)  # type: ignore[union-attr]


def test_what_an_empty_trajectory_cannot_do_is_named() -> None:
    with pytest.raises(rx.MergeError, match="cannot truncate an empty trajectory"):
        rx.Trajectory().truncate(1)
    no_rows = rx.Trajectory()
    no_rows.append(rx.RoutedExperts.from_array(np.zeros((0, 1, 2), dtype=np.int64)))
    with pytest.raises(rx.MergeError, match="cannot repeat the last row of a trajectory with "
                       "no rows"):
        no_rows.to_training(2, pad="repeat", max_missing=5)
    assert no_rows.to_training(2, pad="zero", max_missing=5).tolist() == [[[0, 0]], [[0, 0]]]


class TrajectoryModel:
    """format.md §5 in plain Python: rows by absolute position, the append rules and policies,
    the dtype promoted. A reference for the property below."""

    def __init__(self) -> None:
        self.start: int | None = None
        self.rows: list[np.ndarray] = []
        self.dtype: np.dtype[Any] | None = None

    @property
    def stop(self) -> int | None:
        return None if self.start is None else self.start + len(self.rows)

    def append(self, rows: np.ndarray, start: int, overlap: str) -> str | None:
        """Apply an append; the error it must raise (a word of its message), else None."""
        if self.start is None:
            self.start, self.rows, self.dtype = start, list(rows), rows.dtype
            return None
        assert self.stop is not None
        if start < self.start or start > self.stop:
            return "gap" if start > self.stop else "before"
        overlap_rows = min(self.stop - start, len(rows))
        at = start - self.start
        if overlap == "check":
            for i in range(overlap_rows):
                if not np.array_equal(self.rows[at + i], rows[i]):
                    return "differ"
        if overlap == "replace":
            for i in range(overlap_rows):
                self.rows[at + i] = rows[i]
        self.rows.extend(rows[overlap_rows:])
        self.dtype = np.promote_types(self.dtype, rows.dtype)
        return None


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_appends_match_the_reference_model_under_every_overlap_policy(data: st.DataObject) -> None:
    t, model = rx.Trajectory(), TrajectoryModel()
    pool = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).integers(
        0, 300, size=(40, 2, 2)
    )
    for _ in range(data.draw(st.integers(1, 8))):
        if model.start is None:
            start = data.draw(st.integers(0, 5))
        else:
            assert model.stop is not None
            start = data.draw(st.integers(max(model.start - 2, 0), model.stop + 2))
        n = data.draw(st.integers(1, 6))
        # Rows a server would send: mostly the truth at those positions, sometimes not.
        rows = pool[start : start + n].copy() if start + n <= len(pool) else pool[:n].copy()
        if data.draw(st.booleans()):
            rows[0, 0, 0] = (rows[0, 0, 0] + 1) % 300
        dtype = "uint16" if rows.max(initial=0) > 255 or data.draw(st.booleans()) else "uint8"
        rows = rows.astype(dtype)
        overlap = data.draw(st.sampled_from(["keep", "replace", "check"]))
        expect_error = model.append(rows, start, overlap)
        payload = rx.RoutedExperts.from_array(rows, start=start, dtype=dtype)
        if expect_error is None:
            t.append(payload, overlap=overlap)
        else:
            with pytest.raises(rx.MergeError):
                t.append(payload, overlap=overlap)
        # A failed append changes nothing: the model did not change either.
        assert (t.start, t.stop) == (model.start, model.stop)
        assert t.payload is not None
        np.testing.assert_array_equal(t.payload.to_numpy(), np.array(model.rows))
        assert t.dtype == model.dtype


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_to_training_is_the_rows_cut_or_padded_as_numpy_would(data: st.DataObject) -> None:
    have = data.draw(st.integers(0, 8))
    rows = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).integers(
        0, 300, size=(have, 2, 3)
    )
    t = rx.Trajectory()
    t.append(rx.RoutedExperts.from_array(rows))
    n = data.draw(st.integers(1, 12))
    pad = data.draw(st.sampled_from(["repeat", "zero"]))
    max_missing = data.draw(st.integers(0, 4))
    missing = max(n - have, 0)
    if missing > max_missing:
        with pytest.raises(rx.MergeError, match=f"{missing} missing, more than max_missing"):
            t.to_training(n, pad=pad, max_missing=max_missing)
        return
    if missing and pad == "repeat" and have == 0:
        with pytest.raises(rx.MergeError, match="cannot repeat the last row"):
            t.to_training(n, pad=pad, max_missing=max_missing)
        return
    filler = rows[-1:] if pad == "repeat" else np.zeros((1, 2, 3), dtype=rows.dtype)
    want = np.concatenate([rows[:n], np.repeat(filler, missing, axis=0)])
    got, mask = t.to_training(n, pad=pad, max_missing=max_missing, mask=True)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(mask, np.arange(n) < have)  # padded rows are masked out
