"""The routing a model's own forward pass picks: the same tiny model in transformers, float32,
a hook on each MoE router, over a sequence's token ids. Runs in an engine environment.

    python truth.py MODEL_DIR < ids.json > truth.json

`ids.json` is a list of token-id lists; the answer is, for each, the rows of every hidden layer
(`[positions][layers][top_k]`, a dense layer's rows zero, as vLLM writes them) and the smallest
gap between the k-th and (k+1)-th router logit seen (a small gap would let float rounding
reorder the pick; the tiny model's gates are wide, so it never is).
"""

from __future__ import annotations

import json
import sys


def routing(model_dir: str, sequences: list[list[int]]) -> list[dict]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    k = config.num_experts_per_tok
    layers = config.num_hidden_layers
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "weight") or gate.weight.dim() != 2:
            continue  # a dense layer: no router
        if gate.weight.shape[0] != config.num_experts:
            continue  # a dense MLP's gate_proj is not a router

        def hook(_m, inputs, _out, i=i, gate=gate):  # noqa: ANN001
            h = inputs[0].reshape(-1, gate.weight.shape[1])
            captured[i] = torch.nn.functional.linear(h, gate.weight)

        hooks.append(gate.register_forward_hook(hook))
    out = []
    with torch.no_grad():
        for ids in sequences:
            captured.clear()
            model(torch.tensor([ids]))
            rows = torch.zeros((len(ids), layers, k), dtype=torch.int64)
            gap = float("inf")
            for i, logits in captured.items():
                top = torch.topk(logits, k + 1, dim=-1)
                rows[:, i, :] = top.indices[:, :k]
                gap = min(gap, float((top.values[:, k - 1] - top.values[:, k]).min()))
            out.append({"rows": rows.tolist(), "min_gap": gap, "moe_layers": sorted(captured)})
    for h in hooks:
        h.remove()
    return out


if __name__ == "__main__":
    json.dump(routing(sys.argv[1], json.load(sys.stdin)), sys.stdout)
