"""`rx.pack` as the trainer's one path (format.md §6): payloads, trajectories and arrays in;
each sample at its positions in `num_tokens`, padded per sample and per batch; the batch, its
`cu_seqlens` and its mask against a numpy reference; no -1 in the index output."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routed_experts as rx


def reference(
    samples: list[tuple[np.ndarray, int]], num_tokens: list[int] | None, each: int | None,
    whole: int | None, dtype: Any,
) -> tuple[np.ndarray, list[int], np.ndarray]:
    """format.md §6 written plainly: (rows, start) samples -> batch, cu_seqlens, mask."""
    rows_out, mask_out, cu = [], [], [0]
    layers, top_k = samples[0][0].shape[1:]
    for i, (rows, start) in enumerate(samples):
        n = num_tokens[i] if num_tokens is not None else len(rows)
        offset = start if num_tokens is not None else 0
        length = -(-n // each) * each if each else n
        block = np.zeros((length, layers, top_k), dtype=np.int64)
        m = np.zeros(length, dtype=bool)
        block[offset:offset + len(rows)] = rows
        missing = (rows == -1).all(axis=(1, 2))
        block[offset:offset + len(rows)][missing] = 0
        m[offset:offset + len(rows)] = ~missing
        rows_out.append(block)
        mask_out.append(m)
        cu.append(cu[-1] + length)
    batch = np.concatenate(rows_out)
    mask = np.concatenate(mask_out)
    if whole:
        extra = -(-len(batch) // whole) * whole - len(batch)
        batch = np.concatenate([batch, np.zeros((extra, layers, top_k), np.int64)])
        mask = np.concatenate([mask, np.zeros(extra, bool)])
    return batch.astype(dtype), cu, mask


@st.composite
def batches(draw: Any) -> tuple[list[Any], list[tuple[np.ndarray, int]], list[int] | None]:
    layers, top_k = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    with_counts = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    samples, truth, counts = [], [], []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["uint8", "uint16", "int16", "int32", "array", "trajectory"]))
        rows = draw(st.integers(0 if kind != "trajectory" else 1, 6))
        start = draw(st.integers(0, 3)) if with_counts and kind not in ("array",) else 0
        hi = 255 if kind == "uint8" else 70000 if kind in ("int32", "array") else 30000
        values = rng.integers(0, hi, size=(rows, layers, top_k))
        signed = kind in ("int16", "int32", "array", "trajectory")
        if signed and rows:
            values[rng.random(rows) < 0.3] = -1  # rows marked missing
        dt = {"uint8": np.uint8, "uint16": np.uint16, "int16": np.int16}.get(kind, np.int32)
        arr = values.astype(dt)
        if kind == "array":
            samples.append(arr)
        elif kind == "trajectory":
            t = rx.Trajectory()
            t.append(rx.RoutedExperts.from_array(arr, start=start))
            samples.append(t)
        else:
            samples.append(rx.RoutedExperts.from_array(arr, start=start, dtype=dt))
        truth.append((values, start))
        # vLLM's last sampled token has no row: a sample's count is its stop, or one more.
        counts.append(start + rows + draw(st.integers(0, 2)))
    return samples, truth, counts if with_counts else None


@settings(max_examples=300, deadline=None)
@given(batches(), st.sampled_from([None, 1, 2, 4, 8]), st.sampled_from([None, 3, 16]),
       st.sampled_from(["int32", "int64"]))
def test_the_batch_cu_seqlens_and_mask_are_the_documented_rule(
    case: tuple[list[Any], list[tuple[np.ndarray, int]], list[int] | None],
    each: int | None, whole: int | None, dtype: str,
) -> None:
    samples, truth, counts = case
    batch, cu, mask = rx.pack(samples, dtype, whole, num_tokens=counts,
                              pad_each_to_multiple=each, mask=True)
    want, want_cu, want_mask = reference(truth, counts, each, whole, dtype)
    assert batch.dtype == np.dtype(dtype) and cu.dtype == np.int32 and mask.dtype == bool
    np.testing.assert_array_equal(batch, want)
    assert cu.tolist() == want_cu
    np.testing.assert_array_equal(mask, want_mask)
    assert (batch >= 0).all()  # no -1 in the index output, masked or not
    plain, plain_cu = rx.pack(samples, dtype, whole, num_tokens=counts, pad_each_to_multiple=each)
    np.testing.assert_array_equal(plain, batch)
    np.testing.assert_array_equal(plain_cu, cu)


def test_arrays_trajectories_and_payloads_pack_together_into_one_path_to_a_rank() -> None:
    a = np.arange(6 * 2 * 2).reshape(6, 2, 2) % 100  # a numpy array: rows from position 0
    t = rx.Trajectory()
    t.append(rx.RoutedExperts.from_array(a[:3]))
    t.append(rx.RoutedExperts.from_array(a[3:5], start=3))
    p = rx.RoutedExperts.from_array(a[:4])
    batch, cu, mask = rx.pack([a, t, p], num_tokens=[7, 6, 5], pad_each_to_multiple=4, mask=True)
    assert cu.tolist() == [0, 8, 16, 24]
    np.testing.assert_array_equal(batch[0:6], a)
    np.testing.assert_array_equal(batch[8:13], a[:5])
    assert mask.tolist() == [True] * 6 + [False] * 2 + [True] * 5 + [False] * 3 + [True] * 4 \
        + [False] * 4
    # ...and on to context parallelism: each sample is a multiple of 2 x cp_size = 4 rows.
    mine, my_cu, my_mask = rx.shard(batch, cu, mask, cp_size=2, cp_rank=1)
    assert my_cu.tolist() == [0, 4, 8, 12] and len(mine) == 12 and len(my_mask) == 12


def test_a_torch_tensor_is_a_sample_and_the_batch_is_an_index_dtype() -> None:
    torch = pytest.importorskip("torch")
    rows = torch.arange(8, dtype=torch.int64).reshape(4, 1, 2)
    batch, cu = rx.pack([rows, rows])
    assert batch.dtype == np.int32 and cu.tolist() == [0, 4, 8]
    assert torch.from_numpy(batch).dtype == torch.int32  # never the uint8 torch reads as a mask


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda p: rx.pack([]), rx.RoutedExpertsError, "`samples`: expected at least one sample"),
        (lambda p: rx.pack(p), rx.RoutedExpertsError, "`samples`: expected a list of samples"),
        (lambda p: rx.pack([p], num_tokens=[1, 2]), rx.RoutedExpertsError,
         "`num_tokens`: expected one count per sample (1), got 2"),
        (lambda p: rx.pack([p], num_tokens=[-1]), rx.RoutedExpertsError,
         "`num_tokens`: expected non-negative entries, got -1 at 0"),
        (lambda p: rx.pack([p], num_tokens=[2]), rx.PayloadError,
         "sample 0: routing covers positions 0..3, past its num_tokens of 2"),
        (lambda p: rx.pack([p], pad_each_to_multiple=0), rx.RoutedExpertsError,
         "`pad_each_to_multiple`: expected a positive integer, got 0"),
        (lambda p: rx.pack([p], pad_each_to_multiple=-4), rx.RoutedExpertsError,
         "`pad_each_to_multiple`: expected a non-negative integer, got -4"),
        (lambda p: rx.pack([p], pad_to_multiple="8"), rx.RoutedExpertsError,
         "`pad_to_multiple`: expected an integer, got a str"),
        (lambda p: rx.pack([rx.Trajectory()]), rx.RoutedExpertsError,
         "`samples`: expected trajectories with rows, got an empty trajectory at 0"),
        (lambda p: rx.pack([np.zeros((2, 2))]), rx.RoutedExpertsError, "sample 0: "),
        (lambda p: rx.pack([np.array([[[1, -1]]], np.int32)]), rx.PayloadError,
         "sample 0: position 0 has -1 in layer 0 beside real ids"),
    ],
)
def test_bad_samples_and_arguments_are_errors_naming_them(
    call: Any, error: type[Exception], message: str
) -> None:
    p = rx.RoutedExperts.from_array(np.ones((3, 1, 2), np.uint8))
    with pytest.raises(error) as e:
        call(p)
    assert message in str(e.value), str(e.value)


def test_to_training_gives_an_index_dtype_on_request_and_the_payloads_by_default() -> None:
    t = rx.Trajectory()
    t.append(rx.RoutedExperts.from_array(np.ones((3, 1, 2), np.uint8)))
    assert t.to_training(4, pad="zero").dtype == np.uint8  # as the golden vectors pin it
    out, mask = t.to_training(4, pad="zero", mask=True, dtype="int32")
    assert out.dtype == np.int32 and mask.tolist() == [True, True, True, False]
    with pytest.raises(rx.RoutedExpertsError):
        t.to_training(4, dtype="float32")


def test_expert_load_has_a_plain_dict_like_agreement() -> None:
    load = rx.expert_load(rx.RoutedExperts.from_array(np.array([[[0, 1]], [[0, 2]]])), 4)
    d = load.to_dict()
    assert d["counts"] == [[2, 1, 1, 0]] and d["rows"] == 2 and d["never_chosen"] == [3]
    assert set(d) >= {"imbalance", "cv", "never_chosen_per_layer", "missing_rows", "num_layers",
                      "num_experts"}


def test_python_dash_m_runs_the_command_line() -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "routed_experts", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "usage: routed-experts" in r.stdout


def test_from_transport_takes_prime_rls_struct_itself() -> None:
    from dataclasses import dataclass

    @dataclass
    class RoutedExperts:  # the shape of prime-rl's msgspec struct: data, shape, dtype
        data: bytes
        shape: list[int]
        dtype: str

    p = rx.RoutedExperts.from_array(np.arange(12).reshape(3, 2, 2) % 7, start=4)
    data, shape, dtype = p.to_transport()
    assert rx.RoutedExperts.from_transport(RoutedExperts(data, shape, dtype), start=4) == p
    with pytest.raises(rx.RoutedExpertsError, match="or an object with those attributes"):
        rx.RoutedExperts.from_transport(object())
