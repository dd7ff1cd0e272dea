"""rx.replay.hf against real transformers 5.x models (make test-trainer): each family's gate
replays its own recorded ids bit for bit (so the weight rule is that family's), forced ids
reach the experts with gradients flowing to the gate, and what does not fit is refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import routed_experts as rx

torch.set_num_threads(1)
EXPERTS, TOP_K, LAYERS, BATCH, SEQ, VOCAB = 8, 2, 3, 2, 6, 64
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def tiny(family: str) -> Any:
    torch.manual_seed(0)
    if family == "qwen3_moe":  # layer 0 dense (mlp_only_layers)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **COMMON, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=16,
            norm_topk_prob=True, mlp_only_layers=[0], head_dim=8))
    elif family == "olmoe":
        model = OlmoeForCausalLM(OlmoeConfig(
            **COMMON, num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=False))
    elif family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(
            **COMMON, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, head_dim=8))
    else:  # deepseek_v3: layer 0 dense (first_k_dense_replace), grouped top-k, scaled weights
        model = DeepseekV3ForCausalLM(DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4}, n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K, n_group=2, topk_group=1, moe_intermediate_size=16,
            first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5,
            norm_topk_prob=True))
    for gate in rx.replay.hf_gates(model):
        if gate is not None:  # some families start their gates at zero: route for real
            torch.nn.init.normal_(gate.weight, std=0.5)
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.normal_(0, 0.1)
    model.train()
    return model


FAMILIES = ["qwen3_moe", "olmoe", "mixtral", "deepseek_v3"]
INPUT = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def capture(model: Any) -> tuple[dict[int, Any], list[Any]]:
    """The ids each gate hands its experts in the next forward (after any replay hook)."""
    seen: dict[int, Any] = {}
    hooks = []
    for i, gate in enumerate(rx.replay.hf_gates(model)):
        if gate is not None:
            def keep(_g: Any, _a: Any, out: Any, i: int = i) -> None:
                seen[i] = out[2].detach().clone()
            hooks.append(gate.register_forward_hook(keep))
    return seen, hooks


def payload(model: Any, ids: dict[int, Any]) -> np.ndarray:
    """[B, S, every hidden layer, top_k], dense layers zero, as vLLM and SGLang send it."""
    out = np.zeros((BATCH, SEQ, LAYERS, TOP_K), dtype=np.int64)
    for i, t in ids.items():
        out[:, :, i] = t.reshape(BATCH, SEQ, TOP_K).numpy()  # transformers: batch-first
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_replays_its_own_routing_bit_for_bit(family: str) -> None:
    model = tiny(family)
    seen, hooks = capture(model)
    with torch.no_grad():
        want = model(INPUT).logits
    for h in hooks:
        h.remove()
    assert seen, "no gate ran"
    with rx.replay.hf(model, payload(model, seen)) as replay, torch.no_grad():
        got = model(INPUT).logits
    assert torch.equal(got, want)  # the same ids and the family's own weights
    assert all(m.all() for m in replay.replayed.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_forced_ids_reach_the_experts_and_train_the_gate(family: str) -> None:
    model = tiny(family)
    seen, hooks = capture(model)
    with torch.no_grad():
        natural = model(INPUT).logits
    for h in hooks:
        h.remove()
    forced = {i: torch.tensor([[e for e in range(EXPERTS) if e not in set(r)][:TOP_K]
                               for r in t.tolist()]) for i, t in seen.items()}
    model.zero_grad()
    with rx.replay.hf(model, payload(model, forced)):
        used, hooks = capture(model)  # registered after the replay hook: sees what it returns
        logits = model(INPUT).logits
        logits.sum().backward()
    for h in hooks:
        h.remove()
    assert not torch.equal(logits.detach(), natural)
    for i, gate in enumerate(rx.replay.hf_gates(model)):
        if gate is not None:
            assert torch.equal(used[i], forced[i]), i
            assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0, i
    # Out of the context the gates route on their own again.
    seen_after, hooks = capture(model)
    with torch.no_grad():
        model(INPUT)
    for h in hooks:
        h.remove()
    assert all(torch.equal(seen_after[i], seen[i]) for i in seen)


def test_what_does_not_fit_is_refused() -> None:
    model = tiny("qwen3_moe")
    routing = np.zeros((BATCH, SEQ, LAYERS, TOP_K), dtype=np.int64)
    routing[:, :, 1:] = [0, 1]
    with pytest.raises(rx.ConfigError, match="the payload has 4 layers, but the model has 3"):
        rx.replay.hf(model, np.zeros((BATCH, SEQ, 4, TOP_K), dtype=np.int64))
    wide = np.zeros((BATCH, SEQ, LAYERS, 3), dtype=np.int64)
    wide[:, :, 1:] = [0, 1, 2]
    with pytest.raises(rx.ConfigError, match="top_k 2, but the payload has 3"):
        rx.replay.hf(model, wide)
    bad = routing.copy()
    bad[:, :, 0] = [1, 2]
    with pytest.raises(rx.PayloadError, match="decoder layer 0 is dense"):
        rx.replay.hf(model, bad)
    with rx.replay.hf(model, routing[:1]):  # one sample's routing, two samples in
        with pytest.raises(rx.ConfigError, match="routes 12 tokens, but the replay holds 6"):
            with torch.no_grad():
                model(INPUT)
