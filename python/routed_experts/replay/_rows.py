"""What every trainer's router replay needs, whatever the framework: which payload layer feeds
which router, the tokens in the order a router sees them, and each router's ids checked and
completed (format.md §6.2). numpy only: the frameworks' own modules wrap these."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import numpy as np

from .._core import ConfigError, PayloadError, _replay_ids

MoeLayerFreq = Union[int, Sequence[int]]


def moe_pattern(num_layers: int, moe_layer_freq: MoeLayerFreq = 1) -> list[bool]:
    """Which of a model's `num_layers` decoder layers (0-based) have a router: Megatron's
    `moe_layer_freq`, an int N (layer i is MoE when i % N == 0) or one 0/1 per layer."""
    if isinstance(moe_layer_freq, int):
        if moe_layer_freq < 1:
            raise ConfigError(f"`moe_layer_freq`: expected an int >= 1, got {moe_layer_freq}")
        return [i % moe_layer_freq == 0 for i in range(num_layers)]
    pattern = [bool(x) for x in moe_layer_freq]
    if len(pattern) != num_layers:
        raise ConfigError(
            f"`moe_layer_freq`: expected one entry per layer ({num_layers}), got {len(pattern)}"
        )
    return pattern


def payload_layer(layer: int, payload_layers: int, pattern: Sequence[bool]) -> int:
    """The payload layer that feeds the router of decoder layer `layer` (0-based, global). A
    payload holds every hidden layer (vLLM, SGLang: dense layers zero) or the MoE layers only
    (NeMo-RL, vLLM 0.21); which one is told by its count, never guessed."""
    if not 0 <= layer < len(pattern) or not pattern[layer]:
        raise ConfigError(f"decoder layer {layer} has no router in this model's MoE pattern")
    moe = [i for i, is_moe in enumerate(pattern) if is_moe]
    if payload_layers == len(pattern):
        return layer
    if payload_layers == len(moe):
        return moe.index(layer)
    raise ConfigError(
        f"the payload has {payload_layers} layers, but the model has {len(pattern)} decoder "
        f"layers of which {len(moe)} have routers: a payload holds one or the other"
    )


def layer_marks(rows: np.ndarray, valid: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Per payload layer of `rows` (`[tokens, layers, top_k]`), over the rows `valid` keeps:
    whether any row carries routing there (an id other than 0 and -1), and whether any row is
    there at all (an id other than -1: -1 throughout is a row without routing, format.md §7)."""
    seen = rows if valid is None else rows[valid]
    if seen.dtype.kind == "u":  # no -1 in an unsigned dtype (255 is an expert in uint8)
        return (seen != 0).any(axis=(0, 2)), np.full(rows.shape[1], seen.shape[0] > 0)
    return ((seen != 0) & (seen != -1)).any(axis=(0, 2)), (seen != -1).any(axis=(0, 2))


def check_layers(rows: np.ndarray, pattern: Sequence[bool], valid: np.ndarray | None) -> None:
    """Refuse a payload of every hidden layer whose dense layers carry routing, or whose MoE
    layers have none (all zero: an all-zero row has top_k copies of expert 0, which no top-k
    router picks when top_k >= 2). `rows`: [tokens, layers, top_k]; -1 is no routing anywhere."""
    if rows.shape[1] != len(pattern):
        return  # MoE layers only: no dense layer to look at
    carries, present = layer_marks(rows, valid)
    refuse_layers(carries.tolist(), present.tolist(), pattern, rows.shape[2])


def refuse_layers(
    carries: Sequence[bool], present: Sequence[bool], pattern: Sequence[bool], top_k: int
) -> None:
    """`check_layers`' verdict from `layer_marks` (which a device computes where the rows are)."""
    for layer, is_moe in enumerate(pattern):
        if not is_moe and carries[layer]:
            raise PayloadError(
                f"payload layer {layer}: the model's decoder layer {layer} is dense, but the "
                "payload carries routing there (is the payload from another model?)"
            )
        if is_moe and present[layer] and not carries[layer] and top_k >= 2:
            raise PayloadError(
                f"payload layer {layer}: the model's decoder layer {layer} has a router, but "
                "the payload's rows there are all zero (a layer the engine did not record, "
                "such as another pipeline stage's)"
            )


def replay_ids(
    rows: np.ndarray,
    layers: Sequence[int],
    valid: np.ndarray | None,
    num_experts: int,
    places: Sequence[str],
    dtype: Any = np.int64,
    origin: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Each router's `[tokens, top_k]` replay ids in an index dtype (int64 or int32), stacked
    `[routers, tokens, top_k]` (each router's part contiguous: torch takes it without a copy),
    and `[routers, tokens]`: which rows were replayed. Router i reads layer `layers[i]` of
    `rows` (`[tokens, layers, top_k]`). Rows without routing (not `valid`, or -1 throughout) get
    ids spread over the experts: row r takes experts (r * top_k + j) % num_experts, distinct
    within the row when top_k <= num_experts (never the duplicates zero padding makes). Recorded
    rows must hold distinct ids in [0, num_experts) (any other negative id, or -1 beside real
    ids, is corrupt); `places[i]` names router i in errors, `origin` (`[tokens, 2]`: sample and
    position; a negative sample names it `row {position}`) the row. One pass in Rust, the GIL
    released."""
    batch = np.ascontiguousarray(rows)
    if batch.dtype.kind not in "iu":
        raise PayloadError(f"`rows`: expected an integer array, got dtype {batch.dtype}")
    mask = None if valid is None else np.ascontiguousarray(valid, dtype=bool)
    name = np.dtype(dtype).name
    names = None if origin is None else np.ascontiguousarray(origin, dtype=np.int64)
    return _replay_ids(batch, list(layers), mask, num_experts, list(places), name, names)


def fill_ids(
    ids: np.ndarray,
    valid: np.ndarray | None,
    num_experts: int,
    where: str,
    dtype: Any = np.int64,
) -> tuple[np.ndarray, np.ndarray]:
    """`replay_ids` of one router whose rows are `ids` (`[tokens, top_k]`)."""
    out, replayed = replay_ids(np.asarray(ids)[:, None, :], [0], valid, num_experts, [where],
                               dtype)
    return out[0], replayed[0]


def cp_sp_positions(
    seq_len: int,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_split: Literal["zigzag", "contiguous"] = "zigzag",
    tp_size: int = 1,
    tp_rank: int = 0,
) -> np.ndarray:
    """The sequence positions a rank's router sees of one `[seq_len]` sequence (BSHD layout):
    context parallelism's chunks (zigzag: chunks r and 2 x cp_size - 1 - r of 2 x cp_size;
    contiguous: chunk r of cp_size), then sequence parallelism's contiguous 1/tp_size of them."""
    if cp_split not in ("zigzag", "contiguous"):
        raise ConfigError(f'`cp_split`: expected "zigzag" or "contiguous", got {cp_split!r}')
    if not (0 <= cp_rank < cp_size and 0 <= tp_rank < tp_size):
        raise ConfigError(
            f"rank out of range: cp_rank {cp_rank} of {cp_size}, tp_rank {tp_rank} of {tp_size}"
        )
    parts = 2 * cp_size if cp_split == "zigzag" else cp_size
    if seq_len % parts:
        raise ConfigError(
            f"sequence length {seq_len} does not split into {parts} context-parallel chunks"
        )
    chunk = seq_len // parts
    chunks = [cp_rank, parts - 1 - cp_rank] if cp_split == "zigzag" else [cp_rank]
    local = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks])
    if local.size % tp_size:
        raise ConfigError(
            f"this rank's {local.size} positions do not split among {tp_size} tensor-parallel "
            "ranks"
        )
    share = local.size // tp_size
    return local[tp_rank * share : (tp_rank + 1) * share]


def _no_names() -> np.ndarray | None:
    return None


@dataclass(frozen=True)
class RouterRows:
    """The rows a model's routers replay, and how to read and check them."""

    rows: np.ndarray
    """`[tokens, payload layers, top_k]`: this rank's, in the order its routers see tokens."""
    layers: Sequence[int]
    """The payload layer each router reads (`payload_layer`), in the routers' order."""
    valid: np.ndarray | None
    """`[tokens]` bool: the rows that hold routing (None: all)."""
    num_experts: int
    """Every router's expert count: ids must lie in [0, num_experts)."""
    places: Sequence[str]
    """Each router's name in errors (`"router of decoder layer 3"`)."""
    pattern: Sequence[bool] | None = None
    """Which of the model's decoder layers have a router: a payload of every hidden layer is
    checked against it (`check_layers`). None: not checked."""
    name_rows: Callable[[], np.ndarray | None] = _no_names
    """Each row's (sample, position), `[tokens, 2]`, for the error that names a bad row: called
    only when one is refused (a rank's cut of its batch is not made for every step)."""


def batch_first(
    routing: Any, mask: Any, routers: Sequence[tuple[str, int, int, int]], pattern: Sequence[bool]
) -> RouterRows:
    """The rows of routers that flatten tokens batch-first (transformers, torchtitan), from a
    `[B, S, layers, top_k]` batch (the model's input `[B, S]`) and its `[B, S]` mask (None:
    every row). `routers`: each one's (name in errors, 0-based decoder layer, top_k, expert
    count), all held to the payload's top_k and to one expert count (a `ConfigError` naming the
    first that differs); `pattern`: which decoder layers have a router."""
    batch = np.asarray(routing)
    if batch.ndim != 4:
        raise ConfigError(f"`routing`: expected [B, S, layers, top_k], got shape {batch.shape}")
    b, s, layers, top_k = batch.shape
    valid = None
    if mask is not None:
        m = np.asarray(mask, dtype=bool)
        if m.shape != (b, s):
            raise ConfigError(f"`mask`: expected shape {(b, s)}, got {m.shape}")
        valid = m.reshape(-1)
    for name, _, k, _ in routers:
        if k != top_k:
            raise ConfigError(f"{name}: top_k {k}, but the payload has {top_k}")
    experts = sorted({e for _, _, _, e in routers})
    if len(experts) != 1:
        raise ConfigError(f"`model`: its routers have different expert counts {experts}")

    def name_rows() -> np.ndarray:
        return np.stack([np.repeat(np.arange(b), s), np.tile(np.arange(s), b)], axis=1)

    return RouterRows(
        rows=batch.reshape(b * s, layers, top_k),
        layers=[payload_layer(layer, layers, pattern) for _, layer, _, _ in routers],
        valid=valid,
        num_experts=experts[0],
        places=[name for name, _, _, _ in routers],
        pattern=pattern,
        name_rows=name_rows,
    )
