"""Trainer handoff (format.md §6, §7): torch, packing, transport tuple, pickling, validation."""

from __future__ import annotations

import pickle
import sys
import types
from typing import Any

import numpy as np
import pytest

import routed_experts as rx


def sample(values: Any, start: int = 0, dtype: str | None = None) -> rx.RoutedExperts:
    return rx.RoutedExperts.from_array(np.asarray(values, dtype=np.int64), start=start, dtype=dtype)


class FakeTorch(types.ModuleType):
    """Just enough of torch for `to_torch`'s plumbing where real torch is not installed."""

    int32 = "torch.int32"
    int64 = "torch.int64"

    def __init__(self) -> None:
        super().__init__("torch")

    @staticmethod
    def from_numpy(arr: np.ndarray) -> np.ndarray:
        return arr


def test_to_torch_is_writable_int32_and_independent(monkeypatch: pytest.MonkeyPatch) -> None:
    real = pytest.importorskip("torch") if "torch" in sys.modules else None
    if real is None:
        monkeypatch.setitem(sys.modules, "torch", FakeTorch())
    import torch

    p = sample([[[1, 2]], [[3, 4]]])
    t = p.to_torch()
    assert str(t.dtype) in ("torch.int32", "int32")
    t[0, 0, 0] = 99  # writable
    assert p.array[0, 0, 0] == 1  # independent of the payload
    assert str(p.to_torch(torch.int64).dtype) in ("torch.int64", "int64")


def test_to_torch_gives_an_index_dtype_for_uint16_and_refuses_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Kimi K2's 384 experts need uint16; torch has no max/arange for uint16 tensors, and reads
    # uint8 index tensors as masks: to_torch gives int32 (or int64), nothing else.
    real = pytest.importorskip("torch") if "torch" in sys.modules else None
    if real is None:
        monkeypatch.setitem(sys.modules, "torch", FakeTorch())
    p = sample([[[383, 7]], [[0, 300]]], dtype="uint16")
    t = p.to_torch()
    assert str(t.dtype) in ("torch.int32", "int32")
    assert t.tolist() == [[[383, 7]], [[0, 300]]]
    for bad in ("uint16", "uint8", "int16", "torch.uint16"):
        want = f"`dtype`: expected torch.int32 or torch.int64 .*, got {bad.split('.')[-1]}$"
        with pytest.raises(rx.PayloadError, match=want):
            p.to_torch(bad)


def test_to_torch_without_torch_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail
    with pytest.raises(ImportError, match="needs PyTorch: pip install torch$"):
        sample([[[1]]]).to_torch()


def test_pack_promotes_mixed_dtypes_and_returns_cu_seqlens() -> None:
    a = sample([[[1, 2]], [[3, 4]]], dtype="uint8")
    b = sample([[[300, 5]]], dtype="uint16")
    packed, cu = rx.pack([a, b])
    assert packed.dtype == np.int32 and packed.flags.writeable
    assert packed.tolist() == [[[1, 2]], [[3, 4]], [[300, 5]]]
    assert cu.dtype == np.int32 and cu.tolist() == [0, 2, 3]
    smallest, _ = rx.pack([a, b], dtype=None)
    assert smallest.dtype == np.uint16
    padded, cu = rx.pack([a, b], pad_to_multiple=4)
    assert padded.shape == (4, 1, 2) and padded[3].tolist() == [[0, 0]] and cu.tolist() == [0, 2, 3]
    with pytest.raises(rx.PayloadError, match="fit uint8"):
        rx.pack([a, b], dtype="uint8")
    with pytest.raises(rx.MergeError, match="sample 1"):
        rx.pack([a, sample([[[1], [2]]])])
    with pytest.raises(rx.PayloadError, match="at least one sample"):
        rx.pack([])


def test_transport_tuple_round_trip() -> None:
    p = sample(np.arange(2 * 3 * 4).reshape(2, 3, 4) * 20, start=7)
    data, shape, dtype = p.to_transport()
    assert (shape, dtype) == ([2, 3, 4], "uint16") and data == p.array.tobytes()
    back = rx.RoutedExperts.from_transport((data, shape, dtype), start=7)
    assert back == p and back.dtype == "uint16"
    # memoryviews and numpy buffers are accepted too.
    assert rx.RoutedExperts.from_transport((memoryview(data), shape, dtype), start=7) == p
    assert rx.RoutedExperts.from_transport((p.array, shape, dtype), start=7) == p
    with pytest.raises(rx.PayloadError, match="`data`: expected 48 bytes"):
        rx.RoutedExperts.from_transport((data[:-1], shape, dtype))
    with pytest.raises(rx.PayloadError, match="`value`: expected a tuple"):
        rx.RoutedExperts.from_transport(("x",))  # type: ignore[arg-type]


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_pickle_round_trips(protocol: int) -> None:
    p = sample(np.arange(60).reshape(5, 3, 4) * 7, start=11)
    back = pickle.loads(pickle.dumps(p, protocol=protocol))
    assert back == p and back.dtype == p.dtype and back.start == 11


def test_pickle_protocol_5_passes_the_buffer_out_of_band() -> None:
    p = sample(np.arange(4096).reshape(64, 8, 8) % 256, start=3)
    buffers: list[pickle.PickleBuffer] = []
    blob = pickle.dumps(p, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and buffers[0].raw().nbytes == p.nbytes
    assert len(blob) < 500  # the rows are not in the pickle stream
    assert pickle.loads(blob, buffers=buffers) == p


def test_validate_names_the_first_offending_position_and_layer() -> None:
    good = sample([[[1, 2], [3, 4]], [[5, 6], [7, 0]]], start=10)
    good.validate(num_experts=8)
    assert good.validation_report(num_experts=8)["ok"] is True
    with pytest.raises(rx.PayloadError, match=r"ids in 0\.\.7, got 7 at position 11, layer 1"):
        good.validate(num_experts=7)
    dup = sample([[[1, 2], [3, 3]]], start=4)
    with pytest.raises(rx.PayloadError, match="expert 3 twice at position 4, layer 1"):
        dup.validate()
    dup.validate(duplicates=False)
    zero = sample([[[1, 2]], [[0, 0]]], start=0)
    with pytest.raises(rx.PayloadError, match="all-zero row at position 1"):
        zero.validate(duplicates=False)
    negative = sample([[[-1, 2]]])
    with pytest.raises(rx.PayloadError, match="non-negative ids, got -1 at position 0, layer 0"):
        negative.validate()
    # A zero row is counted as one, its layers not as duplicates.
    report = zero.validation_report()
    assert report == {
        "ok": False,
        "out_of_range": 0,
        "first_out_of_range": None,
        "duplicates": 0,
        "first_duplicate": None,
        "zero_rows": 1,
        "first_zero_row": 1,
        "missing_rows": 0,
        "first_missing_row": None,
    }
    # A layer zero throughout is a dense layer (vLLM 0.22+ and SGLang count them): no router,
    # so neither a duplicate nor, beside routed layers, a zero row.
    dense = sample([[[0, 0], [3, 5]], [[0, 0], [6, 1]]])
    dense.validate()
    assert dense.validation_report()["ok"] is True


def test_to_torch_with_real_torch_indexes_embeddings_and_owns_its_memory() -> None:
    """Against PyTorch itself (skipped without it: PyPI's torch brings several GB of CUDA
    packages, so CI does not install it; `pip install torch` and `make test` run it)."""
    torch = pytest.importorskip("torch")
    p = sample([[[383, 7]], [[0, 300]]], dtype="uint16")  # Kimi K2's ids need uint16
    t = p.to_torch()
    assert t.dtype == torch.int32 and t.is_contiguous() and tuple(t.shape) == (2, 1, 2)
    assert t.tolist() == [[[383, 7]], [[0, 300]]]
    # What a trainer does with it: index an expert table (torch reads int tensors as indices).
    table = torch.arange(384 * 3).reshape(384, 3)
    assert table[t].shape == (2, 1, 2, 3) and int(table[t][0, 0, 0, 0]) == 383 * 3
    t[0, 0, 0] = 1  # its own memory: the payload is unchanged
    assert p.to_numpy().tolist() == [[[383, 7]], [[0, 300]]]
    assert p.to_torch(torch.int64).dtype == torch.int64
    with pytest.raises(rx.PayloadError, match="`dtype`: expected torch.int32 or torch.int64 .*, "
                       "got uint8$"):
        p.to_torch(torch.uint8)
