"""Router replay into a torchtitan MoE model (torchtitan 0.3: `TokenChoiceTopKRouter`, the
router of its Qwen3, DeepSeek-V3, GPT-OSS and Kimi MoE blocks). Each router's forward is wrapped
by a forward hook while the context is open: it returns the replayed expert ids, with scores
taken from its own live scores at those ids and normalised and scaled by its own settings
(`route_norm`, `route_scale`), so gradients reach the gate (format.md §6.2).

    with rx.replay.torchtitan(model, routing):   # routing: [B, S, layers, top_k], tokens [B, S]
        loss = loss_fn(model(tokens, positions, masks), labels)
        loss.backward()

Decoder layers are the keys of `model.layers` (torchtitan keeps a layer's global index as its
key, in a pipeline stage too), and which layers are MoE comes from the model's config. The
expert bias of auxiliary-loss-free balancing only chooses experts, so replay leaves it aside,
as torchtitan's own weights do. A router whose output is a DTensor (tensor, sequence or
expert parallelism shards its tokens) is refused by name: its local tokens are not known here.
"""

from __future__ import annotations

from typing import Any

from .._core import ConfigError
from ._context import ReplayContext, Target
from ._rows import batch_first


def _router_type() -> Any:
    try:
        from torchtitan.models.common.moe import TokenChoiceTopKRouter
    except ImportError as e:  # pragma: no cover - the trainer environment has it
        raise ImportError("rx.replay.torchtitan needs torchtitan: pip install torchtitan") from e
    return TokenChoiceTopKRouter


def routers(model: Any) -> list[tuple[Any, int]]:
    """The model's top-k routers in layer order: (router, its 0-based global decoder layer),
    read from the `layers.<key>.` of its module path."""
    router_type = _router_type()
    found = []
    for name, module in model.named_modules():
        if isinstance(module, router_type):
            parts = name.split(".")
            if "layers" not in parts or parts.index("layers") + 1 >= len(parts):
                raise ConfigError(f"`model`: router {name!r} is not inside a decoder layer")
            key = parts[parts.index("layers") + 1]
            if not key.isdigit():
                raise ConfigError(f"`model`: router {name!r}: decoder layer {key!r} is no index")
            found.append((module, int(key)))
    return sorted(found, key=lambda r: r[1])


def model_pattern(model: Any, found: list[tuple[Any, int]]) -> list[bool]:
    """Which decoder layers have a router: the config's `layers` (each with its `moe` or
    none), which lists the whole model even in a pipeline stage; else the layers present."""
    layers = getattr(getattr(model, "config", None), "layers", None)
    if isinstance(layers, (list, tuple)) and layers:
        return [getattr(layer, "moe", None) is not None for layer in layers]
    keys = [int(k) for k in getattr(model, "layers", {}).keys() if str(k).isdigit()]
    with_router = {layer for _, layer in found}
    return [i in with_router for i in range(max(keys, default=-1) + 1)]


class TorchtitanReplay(ReplayContext):
    """Replay `routing` (`[B, S, layers, top_k]`, with its `[B, S]` mask) on a torchtitan
    model's routers while the context is open (see the module's doc); `device` and
    `pin_memory`, `.replayed` and `stats()` as for every `ReplayContext` (`rx.replay.hf`'s
    doc says them)."""

    def __init__(
        self, model: Any, routing: Any, mask: Any = None, *, device: Any = None,
        pin_memory: bool = True,
    ) -> None:  # fmt: skip
        import torch

        found = routers(model)
        if not found:
            raise ConfigError("`model`: it has no TokenChoiceTopKRouter (is it a torchtitan MoE?)")
        # A router in a layer the config does not call MoE is refused by `payload_layer`.
        pattern = model_pattern(model, found)
        described = batch_first(routing, mask, [
            (f"router of decoder layer {i}", i, r.top_k, r.num_experts) for r, i in found
        ], pattern)  # fmt: skip
        target = torch.device(next(found[0][0].parameters()).device if device is None else device)
        super().__init__(found, described, device=target, dtype=torch.int64,
                         pin_memory=pin_memory)  # fmt: skip

    def _forward_hook(self, target: Target) -> Any:
        ids, ordered, layer, counter = target.ids, target.ordered, target.layer, self._counter

        def hook(router: Any, _args: Any, output: Any) -> Any:
            scores, picked, all_scores = output  # [B, L, K], [B, L, K], [B, L, E]
            if type(picked).__name__ == "DTensor":
                raise ConfigError(
                    f"router of decoder layer {layer}: its output is a DTensor (tensor, "
                    "sequence or expert parallelism shards its tokens): rx.replay.torchtitan "
                    "replays a router that sees its tokens as local tensors"
                )
            tokens = picked.shape[0] * picked.shape[1]
            if tokens != ids.shape[0]:
                raise ConfigError(
                    f"router of decoder layer {layer}: it routes {tokens} tokens, but the "
                    f"replay holds {ids.shape[0]} rows ([B, S] of the routing must be the input's)"
                )
            forced = ids if ids.device == picked.device else ids.to(picked.device)
            forced = forced.reshape(picked.shape)
            counter.add(layer, picked.detach().reshape(tokens, -1), ordered.to(picked.device))
            # torchtitan's own rule: the live scores at the ids, normalised, then scaled.
            weights = all_scores.gather(dim=-1, index=forced)
            if router.route_norm:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = weights * router.route_scale
            return weights.to(scores.dtype), forced, all_scores

        return hook


# `rx.replay.torchtitan(...)`: the context itself, so its signature is the one typed above.
torchtitan = TorchtitanReplay
