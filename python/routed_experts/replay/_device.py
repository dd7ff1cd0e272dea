"""Replay ids made where the model is (format.md §6.2): the decoded rows, in their narrow dtype
(uint8, uint16, ...), copied to the device once (from pinned memory when it is a GPU), then
checked and widened to the index dtype there. The host sees only two small answers: which
layers carry routing, and whether any row is bad. For a bad row, the first one's ids are
checked again on the host by the Rust pass (`replay_ids`), which writes the error: both paths
refuse the same rows with the same words (tests/trainer holds them to each other).

Runs on any torch device, CPU included, so the tests here run the code a GPU runs.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from .._core import RoutedExpertsError
from ._rows import RouterRows, check_layers, refuse_layers, replay_ids

# The dtypes torch copies as they are; uint16 travels as int16 bits and is widened on the
# device. uint32 and uint64 (no engine sends them) stay on the host path.
_NARROW = {"uint8", "int8", "int16", "int32", "int64", "uint16"}


def supported(rows: np.ndarray) -> bool:
    """Whether `ids_on` takes rows of this dtype (else the host path makes the ids)."""
    return rows.dtype.name in _NARROW


def wanted(device: Any, rows: np.ndarray) -> bool:
    """Whether a replay whose model is on `device` makes its ids there: off the CPU (where the
    Rust pass, one pass on every core, is the faster), for the dtypes `ids_on` takes."""
    return bool(device.type != "cpu" and supported(rows))


def router_tensors(
    r: RouterRows, *, device: Any, dtype: Any, pin_memory: bool
) -> tuple[Any, Any]:
    """What every replay context hands its routers: every router's ids (`[routers, tokens,
    top_k]`, each router's part contiguous) and the rows replayed (`[routers, tokens]`), as
    torch tensors on `device`, the layers checked against `r.pattern`. Made there where `wanted`
    says (`ids_on`); else by the host's Rust pass (`replay_ids`, each router's part handed to
    torch without a copy), moved to `device` when it is not the CPU."""
    import torch

    if wanted(device, r.rows):
        return ids_on(r, device=device, dtype=dtype, pin_memory=pin_memory)
    if r.pattern is not None:
        check_layers(r.rows, r.pattern, r.valid)
    np_dtype = np.int32 if dtype == torch.int32 else np.int64
    try:
        host_ids, host_replayed = replay_ids(r.rows, r.layers, r.valid, r.num_experts, r.places,
                                             np_dtype)  # fmt: skip
    except RoutedExpertsError:
        # Again with the rows named (made only now): the same error, saying which sample.
        replay_ids(r.rows, r.layers, r.valid, r.num_experts, r.places, np_dtype,
                   origin=r.name_rows())  # fmt: skip
        raise
    ids, replayed = torch.from_numpy(host_ids), torch.from_numpy(host_replayed)
    if device.type != "cpu":  # rows of a dtype the device path does not take
        ids, replayed = ids.to(device), replayed.to(device)
    return ids, replayed


def ids_on(
    r: RouterRows, *, device: Any, dtype: Any = None, pin_memory: bool = True
) -> tuple[Any, Any]:
    """`replay_ids` on `device`: each router's `[tokens, top_k]` ids (one `[routers, tokens,
    top_k]` tensor, each router's part contiguous) and `[routers, tokens]` bool, the rows
    replayed, both on `device`. With `r.pattern` (the model's MoE layers), `check_layers` runs
    there too. `pin_memory`: stage the copy in page-locked memory (a GPU only; rows already
    there are copied as they are)."""
    import torch

    dtype = torch.int64 if dtype is None else dtype
    device = torch.device(device)
    batch = np.ascontiguousarray(r.rows)
    layers, valid, num_experts = r.layers, r.valid, r.num_experts
    if not supported(batch):
        raise ValueError(f"ids_on: rows of dtype {batch.dtype} stay on the host path")
    # The arguments (layers, num_experts against top_k and the index dtype, the mask's length)
    # checked once by the host's own pass, over no rows unless the mask's length is wrong: the
    # same errors as the host path.
    np_dtype = np.int64 if dtype == torch.int64 else np.int32
    if valid is not None and len(valid) != batch.shape[0]:
        replay_ids(batch, layers, valid, num_experts, r.places, np_dtype)  # raises: the mask
    replay_ids(batch[:0], layers, None, num_experts, r.places, np_dtype)
    wide_from_u16 = batch.dtype == np.uint16
    with warnings.catch_warnings():  # a decoded payload's rows are read-only; never written
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        host = torch.from_numpy(batch.view(np.int16) if wide_from_u16 else batch)
    # Rows already in page-locked memory (`pack_shard`'s `out` in a pinned tensor, reused from
    # step to step) are copied from where they are: pinning them again is a second host copy.
    # They may be rewritten once this returns: the `.cpu()` below waits for the copy.
    if pin_memory and device.type == "cuda" and not host.is_pinned():
        host = host.pin_memory()
    narrow = host.to(device, non_blocking=True)
    if wide_from_u16:
        narrow = narrow.to(torch.int32) & 0xFFFF
    tokens, width, top_k = batch.shape
    signed = batch.dtype.kind == "i"
    keep = None
    if valid is not None:
        keep = torch.from_numpy(np.ascontiguousarray(valid, dtype=bool)).to(device)
    answers = []
    pattern = r.pattern
    if pattern is not None and width == len(pattern):
        seen = narrow if keep is None else narrow[keep]
        if signed:
            answers.append(((seen != 0) & (seen != -1)).any(dim=2).any(dim=0))
            answers.append((seen != -1).any(dim=2).any(dim=0))
        else:
            answers.append((seen != 0).any(dim=2).any(dim=0))
            answers.append(torch.full((width,), seen.shape[0] > 0, device=device))
    picked = torch.as_tensor(list(layers), dtype=torch.int64, device=device)
    # [routers, tokens, top_k] in the index dtype: the one widening pass (checked in int64 where
    # the rows are int64, so an id past int32 is refused, never wrapped).
    checked_as = torch.int64 if batch.dtype == np.int64 else dtype
    ids = narrow.index_select(1, picked).to(checked_as).transpose(0, 1)
    routed = torch.ones(ids.shape[:2], dtype=torch.bool, device=device)
    if signed:
        routed &= ~(ids == -1).all(dim=2)
    if keep is not None:
        routed &= keep
    out_of_range = ((ids < 0) | (ids >= num_experts)).any(dim=2)
    ordered = ids.sort(dim=2).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(dim=2)
    bad = routed & (out_of_range | repeated)
    answers.append(bad.any().reshape(1))
    marks = torch.cat(answers).cpu()  # the one wait for the device
    if pattern is not None and width == len(pattern):
        refuse_layers(marks[:width].tolist(), marks[width : 2 * width].tolist(), pattern, top_k)
    if bool(marks[-1]):
        _refuse_first(bad, batch, r)
    spread = torch.arange(tokens * top_k, device=device, dtype=torch.int64).reshape(tokens, top_k)
    spread = (spread % num_experts).to(dtype)
    out = torch.where(routed.unsqueeze(2), ids.to(dtype), spread).contiguous()
    return out, routed


def _refuse_first(bad: Any, batch: np.ndarray, r: RouterRows) -> None:
    """Raise the host's error for the first bad row (rows in order, then routers)."""
    routers = bad.shape[0]
    first = int(bad.transpose(0, 1).reshape(-1).nonzero()[0])
    row, router = divmod(first, routers)
    origin = r.name_rows()
    named = np.array([[-1, row]]) if origin is None else np.asarray(origin)[row : row + 1]
    one_valid = None if r.valid is None else np.asarray(r.valid, dtype=bool)[row : row + 1]
    replay_ids(batch[row : row + 1], [r.layers[router]], one_valid, r.num_experts,
               [r.places[router]], origin=named)  # fmt: skip
    raise RuntimeError(  # pragma: no cover - the two checks are held to each other in tests
        f"routed_experts: the device check refused {r.places[router]}, row {row}, and the host "
        "check passed it; please report this"
    )
