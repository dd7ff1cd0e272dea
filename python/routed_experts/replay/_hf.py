"""Router replay into a Hugging Face transformers (5.x) MoE model: each MoE block's gate is made
to return the replayed expert ids, with weights recomputed by that model's own rule from its
live logits at those ids, so gradients reach the gate (format.md §6.2).

    with rx.replay.hf(model, routing):     # routing: [B, S, layers, top_k], as input_ids [B, S]
        loss = model(input_ids, labels=labels).loss
        loss.backward()

The gate's forward is wrapped by a forward hook for as long as the context is open (activation
recompute runs it again inside backward: keep backward inside the context). The auxiliary
load-balancing loss transformers computes from the logits keeps the gate's own top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._core import ConfigError
from ._context import ReplayContext, Target
from ._rows import batch_first


def _softmax_rule(gate: Any, logits: Any, ids: Any) -> Any:
    # Qwen3-MoE, OLMoE: softmax in float32, gathered, renormalised when norm_topk_prob, cast
    # back to the logits' dtype.
    import torch

    weights = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
    if gate.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def _mixtral_rule(gate: Any, logits: Any, ids: Any) -> Any:
    # Mixtral: softmax in float32, gathered, always renormalised, left in float32.
    import torch

    weights = torch.softmax(logits.float(), dim=-1).gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True)


def _deepseek_v3_rule(gate: Any, logits: Any, ids: Any) -> Any:
    # DeepSeek-V3: the unbiased sigmoid scores gathered (the correction bias and group limit only
    # choose), renormalised when norm_topk_prob, times routed_scaling_factor.
    weights = logits.sigmoid().gather(1, ids)
    if gate.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * gate.routed_scaling_factor


# Each gate class transformers 5.x defines with a top-k router, and how it weighs its picks.
WEIGHT_RULES: dict[str, Callable[[Any, Any, Any], Any]] = {
    "Qwen3MoeTopKRouter": _softmax_rule,
    "OlmoeTopKRouter": _softmax_rule,
    "MixtralTopKRouter": _mixtral_rule,
    "DeepseekV3TopkRouter": _deepseek_v3_rule,
}


# Where transformers 5.x keeps a decoder layer's MoE block, and the block its router.
_BLOCKS = ("mlp", "block_sparse_moe")
_ROUTERS = ("gate", "router")
_FAMILIES = "Qwen3-MoE, OLMoE, Mixtral, DeepSeek-V3"


def _model_type(model: Any) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", type(model).__name__))


def gates(model: Any) -> list[Any]:
    """The top-k router of each decoder layer (None for a dense layer), in layer order. A top-k
    router of a family without a weight rule here (GPT-OSS, GraniteMoE, PhiMoE, ...) is a
    `ConfigError` naming it: replaying it by another family's rule would be silently wrong."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ConfigError("`model`: expected a transformers causal LM (model.model.layers)")
    out = []
    for i, layer in enumerate(layers):
        found = None
        for block in (getattr(layer, name, None) for name in _BLOCKS):
            for router in (getattr(block, name, None) for name in _ROUTERS):
                if router is not None and hasattr(router, "top_k"):
                    found = found or router
        if found is not None and type(found).__name__ not in WEIGHT_RULES:
            raise ConfigError(
                f"`model`: {_model_type(model)!r} is a mixture-of-experts model rx.replay.hf "
                f"does not support: decoder layer {i}'s router {type(found).__name__} has no "
                f"weight rule here (supported families: {_FAMILIES})"
            )
        out.append(found)
    return out


def _device_of(gate: Any) -> Any:
    return next(gate.parameters()).device


class HfReplay(ReplayContext):
    """Replay `routing` on a transformers MoE model's gates, set while the context is open
    (see the module's doc). `device`: where the ids are made and checked (default: the gates'
    own device; on a GPU the decoded rows are copied there once, from pinned memory unless
    `pin_memory=False`). `.replayed[layer]`: the rows replayed (0-based decoder layers);
    `stats()`: what replay changed in the forwards run so far (`ReplayStats`: the router flip
    rate, per layer)."""

    def __init__(
        self, model: Any, routing: Any, mask: Any = None, *, device: Any = None,
        pin_memory: bool = True,
    ) -> None:  # fmt: skip
        import torch

        found = gates(model)
        pattern = [g is not None for g in found]
        if not any(pattern):
            raise ConfigError(
                f"`model`: {_model_type(model)!r} has no top-k router in any decoder layer "
                f"(rx.replay.hf replays mixture-of-experts models: {_FAMILIES})"
            )
        routed = [(gate, i) for i, gate in enumerate(found) if gate is not None]
        described = batch_first(routing, mask, [
            (f"gate of decoder layer {i}", i, gate.top_k, gate.num_experts) for gate, i in routed
        ], pattern)  # fmt: skip
        target = torch.device(_device_of(routed[0][0]) if device is None else device)
        super().__init__(routed, described, device=target, dtype=torch.int64,
                         pin_memory=pin_memory)  # fmt: skip

    def _forward_hook(self, target: Target) -> Any:
        ids, ordered, layer, counter = target.ids, target.ordered, target.layer, self._counter

        def hook(gate: Any, _args: Any, output: Any) -> Any:
            logits, weights, picked = output
            if logits.shape[0] != ids.shape[0]:
                raise ConfigError(
                    f"gate of decoder layer {layer}: it routes {logits.shape[0]} tokens, but the "
                    f"replay holds {ids.shape[0]} rows ([B, S] of the routing must be the input's)"
                )
            forced = ids if ids.device == picked.device else ids.to(picked.device)
            counter.add(layer, picked.detach(), ordered.to(picked.device))
            rule = WEIGHT_RULES[type(gate).__name__]
            return logits, rule(gate, logits, forced).to(weights.dtype), forced

        return hook


# `rx.replay.hf(...)`: the context itself, so its signature is the one typed above.
hf = HfReplay
