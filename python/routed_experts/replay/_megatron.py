"""Router replay into a Megatron-core model (megatron-core 0.19: `RouterReplay`, enabled by
`moe_enable_routing_replay`; `GPTModel` and `HybridModel`). One step: payloads in, replay set
on this rank's routers, forward and backward, cleared (format.md §6.2).

    packed, cu, mask = rx.pack(payloads, mask=True)
    with rx.replay.megatron(model, packed, cu, mask) as replay:
        loss = forward(model, batch)
        replay.backward()          # before backward, when activation recompute is on
        loss.backward()

The routers are found by walking `model` (never Megatron's process-wide list, which every model
built with replay adds to: an actor and a reference model share it). Each router is fed from
the payload layer of its global decoder layer (`router.layer_number`, which counts pipeline and
virtual stages), with this rank's tokens in the order the router sees them.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from .._core import ConfigError, shard
from ._context import ReplayContext
from ._rows import RouterRows, cp_sp_positions, moe_pattern, payload_layer

Layout = Literal["thd", "bshd", "rank"]
CpSplit = Literal["zigzag", "contiguous"]


def _megatron() -> tuple[Any, Any]:
    try:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplayAction
    except ImportError as e:  # pragma: no cover - the trainer environment has it
        raise ImportError(
            "rx.replay.megatron needs megatron-core: pip install megatron-core"
        ) from e
    return TopKRouter, RouterReplayAction


def routers(model: Any) -> list[tuple[Any, int, bool]]:
    """The model's top-k routers in build order: (router, Megatron's `layer_number` of it: its
    1-based global decoder layer, whether it is a multi-token-prediction layer's). Errors and
    `.replayed` name layers 0-based (`layer_number - 1`), as the payload counts them."""
    top_k_router, _ = _megatron()
    found = []
    for module in model.modules():
        router = getattr(getattr(module, "mlp", None), "router", None)
        if isinstance(router, top_k_router):
            mtp = bool(getattr(module, "is_mtp_layer", False))
            found.append((router, int(router.layer_number), mtp))
    return found


# Megatron's routing types that choose experts without consulting RouterReplay
# (TopKRouter.routing): replay would be silently ignored.
_UNREPLAYED = {
    "sinkhorn": "Sinkhorn balancing chooses the experts itself",
    "quantile_balancing": "quantile balancing chooses the experts itself",
}


def _refuse_unreplayed(config: Any) -> None:
    if getattr(config, "moe_router_fusion", False):
        raise ConfigError(
            "`model`: moe_router_fusion=True takes TransformerEngine's fused top-k, which "
            "returns before replay is consulted (replay would be ignored): turn it off"
        )
    kind = getattr(config, "moe_router_load_balancing_type", None)
    if kind in _UNREPLAYED:
        raise ConfigError(
            f"`model`: moe_router_load_balancing_type={kind!r}: {_UNREPLAYED[kind]} and never "
            "consults RouterReplay (replay would be ignored in every layer); use a top-k "
            "routing type (\"aux_loss\", \"seq_aux_loss\", \"global_aux_loss\" or \"none\")"
        )


def model_pattern(model: Any, config: Any) -> list[bool]:
    """Which of the model's decoder layers (0-based, global) have a router. A `HybridModel`
    (megatron-core 0.19's successor to `GPTModel`) says it in its `hybrid_layer_pattern`, one
    symbol a layer (`E`: MoE; `|` marks pipeline stages, `/` starts the multi-token-prediction
    layers, which engines do not record); a `GPTModel` in `moe_layer_freq`."""
    for module in model.modules():
        pattern = getattr(module, "hybrid_layer_pattern", None)
        if isinstance(pattern, str) and pattern:
            return [symbol == "E" for symbol in pattern.split("/")[0].replace("|", "")]
    if getattr(config, "is_hybrid_model", False):
        raise ConfigError(
            "`model`: config.is_hybrid_model is set, but no module holds a hybrid_layer_pattern "
            "(which layers are MoE cannot be told)"
        )
    return moe_pattern(config.num_layers, config.moe_layer_freq)


def _rank(config: Any) -> dict[str, int]:
    """This rank's context- and sequence-parallel place, from Megatron's parallel state."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {"cp_size": 1, "cp_rank": 0, "tp_size": 1, "tp_rank": 0}
    sp = bool(getattr(config, "sequence_parallel", False))
    return {
        "cp_size": ps.get_context_parallel_world_size(),
        "cp_rank": ps.get_context_parallel_rank(),
        "tp_size": ps.get_tensor_model_parallel_world_size() if sp else 1,
        "tp_rank": ps.get_tensor_model_parallel_rank() if sp else 0,
    }


def local_rows(
    routing: Any,
    cu_seqlens: Any = None,
    mask: Any = None,
    *,
    layout: Layout = "thd",
    cp_split: CpSplit = "zigzag",
    cp_size: int = 1,
    cp_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> tuple[np.ndarray, np.ndarray | None]:
    """This rank's rows `[tokens, layers, top_k]` in the order its routers flatten them, and
    which hold routing. "thd": `routing` packed `[T, L, K]` with `cu_seqlens` (`rx.pack`), cut as
    TransformerEngine cuts packed sequences (`rx.shard`); "bshd": `[B, S, L, K]`, the sequence
    cut the same way, then flattened sequence-first (a router's `[S, B, H]` input); "rank":
    `[T, L, K]` that is already this rank's share (`rx.shard` run where the batch is), taken as
    it is."""
    if layout == "rank":
        rows = np.asarray(routing)
        if rows.ndim != 3:
            raise ConfigError(f"`routing`: a rank's share is [T, L, K], got shape {rows.shape}")
        local_mask = None if mask is None else np.asarray(mask, dtype=bool)
        if local_mask is not None and local_mask.shape != (rows.shape[0],):
            raise ConfigError(
                f"`mask`: expected shape {(rows.shape[0],)}, got {local_mask.shape}"
            )
        return rows, local_mask
    if layout == "thd":
        if cu_seqlens is None:
            raise ConfigError("`cu_seqlens`: a packed (thd) batch needs it (rx.pack returns it)")
        rows, _, local_mask = shard(
            routing, cu_seqlens, mask, cp_size=cp_size, cp_rank=cp_rank, cp_split=cp_split,
            tp_size=tp_size, tp_rank=tp_rank,
        )
        return rows, local_mask
    if layout != "bshd":
        raise ConfigError(f'`layout`: expected "thd", "bshd" or "rank", got {layout!r}')
    batch = np.asarray(routing)
    if batch.ndim != 4:
        raise ConfigError(f"`routing`: a bshd batch is [B, S, L, K], got shape {batch.shape}")
    b, s, layers, top_k = batch.shape
    positions = cp_sp_positions(s, cp_size, cp_rank, cp_split, tp_size, tp_rank)
    rows = batch[:, positions].transpose(1, 0, 2, 3).reshape(-1, layers, top_k)
    if mask is None:
        return rows, None
    m = np.asarray(mask, dtype=bool)
    if m.shape != (b, s):
        raise ConfigError(f"`mask`: expected shape {(b, s)}, got {m.shape}")
    return rows, m[:, positions].T.reshape(-1)


def _origin(
    routing: Any, cu_seqlens: Any, layout: Layout, cp_split: Any, place: dict[str, int]
) -> np.ndarray | None:
    """Each local row's (sample, position), cut and ordered as the rows are, for errors."""
    if layout == "rank":
        return None  # a rank's share: its samples are not known here
    if layout == "bshd":
        b, s = np.asarray(routing).shape[:2]
        grid = np.stack(np.meshgrid(np.arange(b), np.arange(s), indexing="ij"), axis=-1)
        rows, _ = local_rows(grid[:, :, None, :], layout="bshd", cp_split=cp_split, **place)
        return rows[:, 0, :]
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    total = int(cu[-1])
    if cu[0] != 0 or total != np.asarray(routing).shape[0]:
        return None
    sample = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    position = np.arange(total) - cu[:-1][sample]
    pairs = np.stack([sample, position], axis=1)[:, None, :]
    rows, _ = local_rows(pairs, cu_seqlens, layout="thd", cp_split=cp_split, **place)
    return np.ascontiguousarray(rows[:, 0, :])


class MegatronReplay(ReplayContext):
    """Replay `routing` on `model`'s routers for one step, set while the context is open (see
    the module's doc). `layout`: how `routing` is laid out (`local_rows`); `rank`: this rank's
    `cp_size`, `cp_rank`, `tp_size`, `tp_rank` (default: Megatron's parallel state); `dtype`:
    the ids' (torch.int64 or torch.int32); `device`: where they are made (default: the
    routers'). `.replayed[layer]`: the rows replayed, by 0-based decoder layer; `stats()`: what
    replay changed in the forwards run so far (`ReplayStats`: the router flip rate, per
    layer)."""

    def __init__(
        self,
        model: Any,
        routing: Any,
        cu_seqlens: Any = None,
        mask: Any = None,
        *,
        layout: Layout = "thd",
        cp_split: CpSplit = "zigzag",
        rank: dict[str, int] | None = None,
        dtype: Any = None,
        device: Any = None,
        pin_memory: bool = True,
    ) -> None:
        import torch

        _, self._action = _megatron()
        found = routers(model)
        if not found:
            raise ConfigError("`model`: it has no top-k routers (is it a Megatron MoE model?)")
        config = found[0][0].config
        _refuse_unreplayed(config)
        dtype = torch.int64 if dtype is None else dtype
        if dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"`dtype`: expected torch.int64 or torch.int32, got {dtype}")
        pattern = model_pattern(model, config)
        place = _rank(config) if rank is None else rank
        rows, valid = local_rows(
            routing, cu_seqlens, mask, layout=layout, cp_split=cp_split, **place
        )
        self.rows = rows.shape[0]
        self._layout = layout
        replaying: list[tuple[Any, int]] = []
        for router, number, is_mtp in found:
            if router.router_replay is None:
                raise ConfigError(
                    f"router of decoder layer {number - 1}: the model was built without "
                    "moe_enable_routing_replay=True (its routers have no RouterReplay)"
                )
            if is_mtp:
                continue  # engines record decoder layers only: MTP layers route natively
            top_k = router.config.moe_router_topk
            if rows.shape[2] != top_k:
                raise ConfigError(
                    f"router of decoder layer {number - 1}: top_k {top_k}, but the payload has "
                    f"{rows.shape[2]}"
                )
            replaying.append((router, number - 1))
        target = torch.device(
            next(replaying[0][0].parameters()).device if device is None and replaying
            else device or "cpu"
        )  # fmt: skip
        described = RouterRows(
            rows=rows,
            layers=[payload_layer(layer, rows.shape[1], pattern) for _, layer in replaying],
            valid=valid,
            num_experts=config.num_moe_experts,
            places=[f"router of decoder layer {layer}" for _, layer in replaying],
            pattern=pattern,
            name_rows=lambda: _origin(routing, cu_seqlens, layout, cp_split, place),
        )
        super().__init__(replaying, described, device=target, dtype=dtype, pin_memory=pin_memory)
        self._saved: list[tuple[Any, Any]] = []

    def _arm(self) -> None:
        for t in self._targets:
            replay = t.router.router_replay
            replay.clear_indices()
            replay.set_target_indices(t.ids)
            replay.set_router_replay_action(self._action.REPLAY_FORWARD)
            self._saved.append((replay, replay.__dict__.get("get_replay_topk")))
            replay.get_replay_topk = self._counted(replay, t.ordered, t.layer)
            self._hook(t.router.register_forward_pre_hook(
                self._check(t.ids.shape[0], t.layer, self._layout)))

    def _counted(self, replay: Any, ordered: Any, layer: int) -> Any:
        # RouterReplay's own get_replay_topk, and the router's own pick beside it from the same
        # scores (the top-k function Megatron passes in): the flip counted on the device.
        import torch

        original = replay.get_replay_topk  # another wrapper of the instance's, if any
        counter, actions = self._counter, (self._action.REPLAY_FORWARD,
                                           self._action.REPLAY_BACKWARD)  # fmt: skip

        def get_replay_topk(scores: Any, topk: int, num_groups: Any = None,
                            group_topk: Any = None, default_compute_topk: Any = None) -> Any:
            out = original(scores, topk, num_groups, group_topk, default_compute_topk)
            if replay.router_replay_action in actions and default_compute_topk is not None:
                with torch.no_grad():
                    _, native = default_compute_topk(scores.detach(), topk,
                                                     num_groups=num_groups, group_topk=group_topk)
                counter.add(layer, native, ordered.to(native.device))
            return out

        return get_replay_topk

    @staticmethod
    def _check(rows: int, layer: int, layout: str) -> Any:
        # Megatron does not check a replay's length (a short one leaves tokens unrouted), nor
        # that a packed batch's ids meet a packed forward.
        def hook(_router: Any, args: tuple[Any, ...]) -> None:
            hidden = args[0]
            if layout == "thd" and hidden.dim() == 3 and hidden.shape[1] != 1:
                raise ConfigError(
                    f"router of decoder layer {layer}: layout=\"thd\" replays a packed batch "
                    f"(the router's input [T, 1, H]), but this forward's is [S={hidden.shape[0]},"
                    f" B={hidden.shape[1]}, H]: each token would get another token's ids. Run "
                    "the packed forward (packed_seq_params), or replay [B, S, layers, top_k] "
                    "routing with layout=\"bshd\""
                )
            tokens = hidden.numel() // hidden.shape[-1]
            if tokens != rows:
                raise ConfigError(
                    f"router of decoder layer {layer}: it routes {tokens} tokens on this rank, "
                    f"but the replay holds {rows} rows (layout, packing or parallel split differ)"
                )

        return hook

    def backward(self) -> None:
        """Replay the same ids in the forward that activation recompute runs during backward."""
        for t in self._targets:
            t.router.router_replay.set_router_replay_action(self._action.REPLAY_BACKWARD)

    def _disarm(self) -> None:
        for replay, before in self._saved:
            if before is None:
                replay.__dict__.pop("get_replay_topk", None)
            else:
                replay.get_replay_topk = before
        self._saved = []
        for t in self._targets:
            t.router.router_replay.clear_indices()
            t.router.router_replay.clear_router_replay_action()


# `rx.replay.megatron(...)`: the context itself, so its signature is the one typed above.
megatron = MegatronReplay
