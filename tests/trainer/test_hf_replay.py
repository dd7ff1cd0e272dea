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
    bad = routing.copy()
    bad[1, 4, 2] = [5, 5]
    with pytest.raises(rx.PayloadError, match="^gate of decoder layer 2, sample 1, position 4: a "
                       "row's expert ids must be distinct"):
        rx.replay.hf(model, bad)
    with rx.replay.hf(model, routing[:1]):  # one sample's routing, two samples in
        with pytest.raises(rx.ConfigError, match="routes 12 tokens, but the replay holds 6"):
            with torch.no_grad():
                model(INPUT)


def unsupported(kind: str) -> Any:
    """A tiny model of an MoE family rx.replay.hf has no weight rule for."""
    from transformers import (
        GptOssConfig,
        GptOssForCausalLM,
        GraniteMoeConfig,
        GraniteMoeForCausalLM,
        PhimoeConfig,
        PhimoeForCausalLM,
    )

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=TOP_K)
    if kind == "gpt_oss":
        return GptOssForCausalLM(GptOssConfig(**small, num_local_experts=EXPERTS, head_dim=8))
    if kind == "granitemoe":
        return GraniteMoeForCausalLM(GraniteMoeConfig(**small, num_local_experts=EXPERTS))
    return PhimoeForCausalLM(PhimoeConfig(**small, num_local_experts=EXPERTS))


@pytest.mark.parametrize("kind", ["gpt_oss", "granitemoe", "phimoe"])
def test_an_moe_family_without_a_weight_rule_is_named_and_refused(kind: str) -> None:
    # Issue 54, item 6: these were refused as "no top-k gates (is it an MoE model?)".
    with pytest.raises(rx.ConfigError, match=f"^`model`: '{kind}' is a mixture-of-experts model "
                       "rx.replay.hf does not support: decoder layer 0's router .*TopKRouter"):
        rx.replay.hf(unsupported(kind), np.zeros((1, 2, 2, TOP_K), dtype=np.int64))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_flip_rate_counts_each_gates_own_pick_against_the_replayed_ids(family: str) -> None:
    model = tiny(family)
    seen, hooks = capture(model)
    with torch.no_grad():
        model(INPUT)
    for h in hooks:
        h.remove()
    # Every other row forced onto experts the gate did not pick, the rest its own; the last
    # position of sample 1 masked off.
    mixed = {i: torch.where((torch.arange(t.shape[0]) % 2 == 0)[:, None],
                            torch.tensor([[e for e in range(EXPERTS) if e not in set(r)][:TOP_K]
                                          for r in t.tolist()]), t)
             for i, t in seen.items()}  # fmt: skip
    mask = np.ones((BATCH, SEQ), dtype=bool)
    mask[1, -1] = False
    own, hooks = capture(model)  # registered first: sees each gate's own pick, before replay's
    with rx.replay.hf(model, payload(model, mixed), mask) as replay, torch.no_grad():
        model(INPUT)
        stats = replay.stats()
    for h in hooks:
        h.remove()
    valid = torch.from_numpy(mask.reshape(-1))
    for i, t in mixed.items():
        want = int(((own[i].sort(-1).values != t.sort(-1).values).any(-1) & valid).sum())
        got = stats.layers[i]
        assert (got.flipped, got.replayed, got.filled, got.rows) == (want, 11, 1, 12), i
    assert stats.forwards == 1 and stats.flipped > 0


def test_ids_are_moved_once_and_the_device_path_matches_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from routed_experts.replay import _device

    model = tiny("deepseek_v3")
    seen, hooks = capture(model)
    with torch.no_grad():
        want = model(INPUT).logits
    for h in hooks:
        h.remove()
    routing = payload(model, seen).astype(np.uint8)
    host = rx.replay.hf(model, routing)
    monkeypatch.setattr(_device, "wanted", lambda device, rows: _device.supported(rows))
    with rx.replay.hf(model, routing) as replay, torch.no_grad():
        got = model(INPUT).logits
    assert torch.equal(got, want)
    for (_, a, _, _), (_, b, _, _) in zip(host._targets, replay._targets):
        assert torch.equal(a, b)
    # The ids a gate hands its experts are the tensor made on entry: no copy at a gate call.
    handed: dict[int, Any] = {}
    with replay:
        for i, gate in enumerate(rx.replay.hf_gates(model)):
            if gate is not None:
                gate.register_forward_hook(lambda _g, _a, out, i=i: handed.__setitem__(i, out[2]))
        with torch.no_grad():
            model(INPUT)
    for _gate, ids, _, i in replay._targets:
        assert handed[i].data_ptr() == ids.data_ptr(), i
