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

import numpy as np

from .._core import ConfigError
from ._rows import check_layers, payload_layer, replay_ids


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


def gates(model: Any) -> list[Any]:
    """The gate of each decoder layer (None for a dense layer), in layer order."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ConfigError("`model`: expected a transformers causal LM (model.model.layers)")
    out = []
    for i, layer in enumerate(layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k") and type(gate).__name__ not in WEIGHT_RULES:
            raise ConfigError(
                f"decoder layer {i}: no weight rule for the gate {type(gate).__name__} (known: "
                f"{', '.join(sorted(WEIGHT_RULES))})"
            )
        out.append(gate if gate is not None and hasattr(gate, "top_k") else None)
    return out


class HfReplay:
    """Replay set on `model`'s gates while the context is open (see the module's doc)."""

    def __init__(self, model: Any, routing: Any, mask: Any = None) -> None:
        import torch

        found = gates(model)
        pattern = [g is not None for g in found]
        if not any(pattern):
            raise ConfigError("`model`: it has no top-k gates (is it an MoE model?)")
        batch = np.asarray(routing)
        if batch.ndim != 4:
            raise ConfigError(f"`routing`: expected [B, S, layers, top_k], got shape {batch.shape}")
        b, s, layers, top_k = batch.shape
        rows = batch.reshape(b * s, layers, top_k)  # transformers flattens batch-first
        valid = None
        if mask is not None:
            m = np.asarray(mask, dtype=bool)
            if m.shape != (b, s):
                raise ConfigError(f"`mask`: expected shape {(b, s)}, got {m.shape}")
            valid = m.reshape(-1)
        check_layers(rows, pattern, valid)
        self.replayed: dict[int, Any] = {}
        self._targets: list[tuple[Any, Any, int]] = []
        routed = [(i, gate) for i, gate in enumerate(found) if gate is not None]
        for i, gate in routed:
            if top_k != gate.top_k:
                raise ConfigError(
                    f"gate of decoder layer {i}: top_k {gate.top_k}, but the payload has {top_k}"
                )
        experts = sorted({gate.num_experts for _, gate in routed})
        if len(experts) != 1:
            raise ConfigError(f"`model`: its gates have different expert counts {experts}")
        ids, replayed = replay_ids(
            rows,
            [payload_layer(i, layers, pattern) for i, _ in routed],
            valid,
            experts[0],
            [f"gate of decoder layer {i}" for i, _ in routed],
        )
        for k, (i, gate) in enumerate(routed):
            self.replayed[i] = torch.from_numpy(replayed[k])
            self._targets.append((gate, torch.from_numpy(ids[k]), i))
        self._hooks: list[Any] = []

    def __enter__(self) -> HfReplay:
        for gate, ids, i in self._targets:
            self._hooks.append(gate.register_forward_hook(self._replay(ids, i)))
        return self

    @staticmethod
    def _replay(ids: Any, layer: int) -> Any:
        def hook(gate: Any, _args: Any, output: Any) -> Any:
            logits, weights, picked = output
            if logits.shape[0] != ids.shape[0]:
                raise ConfigError(
                    f"gate of decoder layer {layer}: it routes {logits.shape[0]} tokens, but the "
                    f"replay holds {ids.shape[0]} rows ([B, S] of the routing must be the input's)"
                )
            forced = ids.to(picked.device)
            rule = WEIGHT_RULES[type(gate).__name__]
            return logits, rule(gate, logits, forced).to(weights.dtype), forced

        return hook

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def hf(model: Any, routing: Any, mask: Any = None) -> HfReplay:
    """Replay `routing` on a transformers MoE model's gates: see `HfReplay`."""
    return HfReplay(model, routing, mask)
