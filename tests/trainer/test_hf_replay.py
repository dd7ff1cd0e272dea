"""rx.replay.hf against real transformers 5.x models (make test-trainer): each family's gate
replays its own recorded ids bit for bit (so the weight rule is that family's), forced ids
reach the experts with gradients flowing to the gate, and what does not fit is refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from trainer_models import EXPERTS, FAMILIES, HF_LAYERS, HF_VOCAB, TOP_K, hf_model

import routed_experts as rx

BATCH, SEQ = 2, 6
LAYERS, VOCAB = HF_LAYERS, HF_VOCAB
tiny = hf_model
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
