"""`rx.pack_shard`: one rank's share written without the batch (format.md §6.1) is exactly what
`rx.shard` takes from `rx.pack`'s batch, for any samples (a group's shared parts, missing rows,
deltas), padding and rank, into a new array or into a reused `out` buffer whatever it held;
a buffer that cannot take the share is refused naming `out`."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routed_experts as rx


@st.composite
def group(draw: Any) -> tuple[list[Any], int, int]:
    """A group's samples: each a tuple of the prompt's rows and the choice's own, some with a
    row vLLM marks missing (-1), and one plain payload."""
    layers, top_k = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def rows(n: int, start: int) -> rx.RoutedExperts:
        a = rng.integers(0, 200, size=(n, layers, top_k))
        if n and draw(st.booleans()):
            a[rng.integers(0, n)] = -1
        return rx.RoutedExperts.from_array(a, start=start)

    start, prompt = draw(st.integers(0, 3)), draw(st.integers(0, 9))
    shared = rows(prompt, start)
    samples: list[Any] = [
        (shared, rows(draw(st.integers(0, 5)), start + prompt))
        for _ in range(draw(st.integers(1, 4)))
    ]
    samples.append(rows(draw(st.integers(1, 6)), draw(st.integers(0, 2))))
    return samples, layers, top_k


@settings(max_examples=200, deadline=None)
@given(group(), st.data())
def test_a_ranks_share_is_what_shard_takes_from_the_packed_batch(
    case: tuple[list[Any], int, int], data: Any
) -> None:
    samples, layers, _ = case
    cp = data.draw(st.sampled_from([1, 2, 3]))
    tp = data.draw(st.sampled_from([1, 2]))
    split = data.draw(st.sampled_from(["zigzag", "contiguous"]))
    dtype = data.draw(st.sampled_from(["int32", "int64", "uint8", "uint16"]))
    lo = data.draw(st.integers(0, layers - 1))
    kept = data.draw(st.sampled_from([None, (lo, data.draw(st.integers(lo + 1, layers)))]))
    # Each sample a multiple of 2 x cp x tp rows: every rank's rows split evenly.
    pack_kw: dict[str, Any] = {"pad_each_to_multiple": 2 * cp * tp,
                               "pad_to_multiple": data.draw(st.integers(1, 5)), "dtype": dtype}
    batch, cu, mask = rx.pack(samples, mask=True, **pack_kw)
    for r in range(cp):
        for t in range(tp):
            rank: dict[str, Any] = {"cp_size": cp, "cp_rank": r, "cp_split": split,
                                    "tp_size": tp, "tp_rank": t, "layers": kept}
            want = rx.shard(batch, cu, mask, **rank)
            got = rx.pack_shard(samples, mask=True, **pack_kw, **rank)
            assert got[0].dtype == want[0].dtype
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
            np.testing.assert_array_equal(got[2], want[2])
            # A reused buffer, larger than the share and full of the last step's values.
            out = np.full(want[0].size + 17, 99, dtype=dtype)
            into = rx.pack_shard(samples, mask=True, out=out, **pack_kw, **rank)
            np.testing.assert_array_equal(into[0], want[0])
            assert np.shares_memory(into[0], out)
            assert (out[want[0].size:] == 99).all()  # nothing past the share is touched
            assert rx.pack_shard(samples, **pack_kw, **rank)[2] is None


def test_the_whole_batch_is_the_share_of_the_only_rank() -> None:
    p = rx.RoutedExperts.from_array(np.arange(24).reshape(6, 2, 2) % 9, start=2)
    batch, cu = rx.pack([p, (p,)])
    got, got_cu, mask = rx.pack_shard([p, (p,)])
    np.testing.assert_array_equal(got, batch)
    np.testing.assert_array_equal(got_cu, cu)
    assert mask is None


def test_a_missing_row_is_zeros_in_an_unsigned_batch_as_in_a_signed_one() -> None:
    a = np.array([[[1, 2]], [[-1, -1]], [[3, 4]]])
    for dtype in ("uint8", "int32"):
        batch, _, mask = rx.pack([a], dtype=dtype, mask=True)
        assert batch.ravel().tolist() == [1, 2, 0, 0, 3, 4]
        assert mask.tolist() == [True, False, True]


P = rx.RoutedExperts.from_array(np.arange(12).reshape(6, 1, 2) % 7)


@pytest.mark.parametrize(("out", "said"), [
    ([0] * 12, "expected a numpy array (of a pinned tensor: its .numpy())"),
    (np.zeros(12, np.int64), "expected an array of int32 (the pack's dtype), got dtype int64"),
    (np.zeros(24, np.int32)[::2], "expected a C-contiguous array, got a strided view"),
    (np.zeros(11, np.int32), "expected at least 12 values (the share's 6 x 1 x 2), got 11 values"),
])
def test_a_buffer_that_cannot_take_the_share_is_refused_naming_out(out: Any, said: str) -> None:
    with pytest.raises(rx.RoutedExpertsError, match="`out`") as e:
        rx.pack_shard([P], out=out)
    assert said in str(e.value)


def test_a_read_only_buffer_is_refused_and_left_as_it_was() -> None:
    out = np.full(12, 5, np.int32)
    out.flags.writeable = False
    with pytest.raises(rx.RoutedExpertsError, match="expected a writable array"):
        rx.pack_shard([P], out=out)
    assert (out == 5).all()
