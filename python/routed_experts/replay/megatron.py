"""Router replay into a Megatron-core model (megatron-core 0.19: `RouterReplay`, enabled by
`moe_enable_routing_replay`). One step: payloads in, replay set on this rank's routers, forward
and backward, cleared (format.md §6.2).

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
from ._rows import check_layers, cp_sp_positions, moe_pattern, payload_layer, replay_ids

Layout = Literal["thd", "bshd", "rank"]


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
    """The model's top-k routers in build order: (router, its 1-based global decoder layer
    number, whether it is a multi-token-prediction layer's)."""
    top_k_router, _ = _megatron()
    found = []
    for module in model.modules():
        router = getattr(getattr(module, "mlp", None), "router", None)
        if isinstance(router, top_k_router):
            mtp = bool(getattr(module, "is_mtp_layer", False))
            found.append((router, int(router.layer_number), mtp))
    return found


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
    cp_split: Literal["zigzag", "contiguous"] = "zigzag",
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


class MegatronReplay:
    """Replay set on `model`'s routers while the context is open (see the module's doc)."""

    def __init__(
        self,
        model: Any,
        routing: Any,
        cu_seqlens: Any = None,
        mask: Any = None,
        *,
        layout: Layout = "thd",
        cp_split: Literal["zigzag", "contiguous"] = "zigzag",
        rank: dict[str, int] | None = None,
        dtype: Any = None,
        device: Any = None,
        pin_memory: bool = False,
    ) -> None:
        import torch

        _, self._action = _megatron()
        found = routers(model)
        if not found:
            raise ConfigError("`model`: it has no top-k routers (is it a Megatron MoE model?)")
        config = found[0][0].config
        if getattr(config, "moe_router_fusion", False):
            raise ConfigError(
                "`model`: moe_router_fusion=True takes TransformerEngine's fused top-k, which "
                "returns before replay is consulted (replay would be ignored): turn it off"
            )
        dtype = torch.int64 if dtype is None else dtype
        if dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"`dtype`: expected torch.int64 or torch.int32, got {dtype}")
        pattern = moe_pattern(config.num_layers, config.moe_layer_freq)
        place = _rank(config) if rank is None else rank
        rows, valid = local_rows(
            routing, cu_seqlens, mask, layout=layout, cp_split=cp_split, **place
        )
        check_layers(rows, pattern, valid)
        self.rows = rows.shape[0]
        self.replayed: dict[int, Any] = {}
        self._targets: list[tuple[Any, Any, int]] = []
        np_dtype = np.int64 if dtype == torch.int64 else np.int32
        replaying: list[tuple[Any, int]] = []
        for router, number, is_mtp in found:
            if router.router_replay is None:
                raise ConfigError(
                    f"router of layer {number}: the model was built without "
                    "moe_enable_routing_replay=True (its routers have no RouterReplay)"
                )
            if is_mtp:
                continue  # engines record decoder layers only: MTP layers route natively
            top_k = router.config.moe_router_topk
            if rows.shape[2] != top_k:
                raise ConfigError(
                    f"router of decoder layer {number}: top_k {top_k}, but the payload has "
                    f"{rows.shape[2]}"
                )
            replaying.append((router, number))
        ids, replayed = replay_ids(
            rows,
            [payload_layer(number - 1, rows.shape[1], pattern) for _, number in replaying],
            valid,
            config.num_moe_experts,
            [f"router of decoder layer {number}" for _, number in replaying],
            np_dtype,
        )
        for i, (router, number) in enumerate(replaying):
            target = torch.from_numpy(ids[i])  # the router's contiguous part: no copy
            if pin_memory:
                target = target.pin_memory()
            if device is not None:
                target = target.to(device, non_blocking=pin_memory)
            self.replayed[number] = torch.from_numpy(replayed[i])
            self._targets.append((router, target, number))
        self._hooks: list[Any] = []

    def __enter__(self) -> MegatronReplay:
        for router, target, number in self._targets:
            router.router_replay.clear_indices()
            router.router_replay.set_target_indices(target)
            router.router_replay.set_router_replay_action(self._action.REPLAY_FORWARD)
            check = self._check(target.shape[0], number)
            self._hooks.append(router.register_forward_pre_hook(check))
        return self

    @staticmethod
    def _check(rows: int, number: int) -> Any:
        # Megatron does not check a replay tensor's length: a short one leaves tokens unrouted.
        def hook(_router: Any, args: tuple[Any, ...]) -> None:
            hidden = args[0]
            tokens = hidden.numel() // hidden.shape[-1]
            if tokens != rows:
                raise ConfigError(
                    f"router of decoder layer {number}: it routes {tokens} tokens on this rank, "
                    f"but the replay holds {rows} rows (layout, packing or parallel split differ)"
                )

        return hook

    def backward(self) -> None:
        """Replay the same ids in the forward that activation recompute runs during backward."""
        for router, _, _ in self._targets:
            router.router_replay.set_router_replay_action(self._action.REPLAY_BACKWARD)

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for router, _, _ in self._targets:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


def megatron(model: Any, routing: Any, cu_seqlens: Any = None, mask: Any = None, **kwargs: Any
             ) -> MegatronReplay:
    """Replay `routing` on `model`'s routers for one step: see `MegatronReplay`."""
    return MegatronReplay(model, routing, cu_seqlens, mask, **kwargs)
