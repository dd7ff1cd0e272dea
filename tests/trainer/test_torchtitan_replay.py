"""rx.replay.torchtitan against real torchtitan (make test-trainer): a Qwen3 MoE model built
from torchtitan's own config replays its own recorded ids bit for bit (so the weight rule is
torchtitan's), forced ids reach the experts with gradients flowing to the gate, and what does
not fit is refused by name."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torchtitan.models import qwen3
from torchtitan.models.common.moe import RoutedExperts

import routed_experts as rx

BATCH, SEQ = 2, 8
TOKENS = torch.randint(0, 2048, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
POSITIONS = torch.arange(SEQ).repeat(BATCH, 1)


def build(pattern: str) -> Any:
    """torchtitan's Qwen3 debug model (dim 256, 64 experts, top 8, softmax, route_norm) with
    one decoder layer per letter of `pattern`: "d" dense (the dense debug model's block), "m"
    MoE (the MoE debug model's), seeded and initialised by torchtitan."""
    dense = qwen3.qwen3_configs["debugmodel"]("flex")
    config = qwen3.qwen3_configs["debugmodel_moe"]("flex")
    config.layers = [(dense if kind == "d" else config).layers[i] for i, kind in enumerate(pattern)]
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model


def forward(model: Any) -> Any:
    return model(TOKENS, POSITIONS, model.get_attention_masks(POSITIONS))


def capture(model: Any) -> tuple[dict[int, Any], dict[int, Any], list[Any]]:
    """Each router's ids as it returns them, and the ids its experts are handed, in the next
    forward (after any replay hook)."""
    routed: dict[int, Any] = {}
    handed: dict[int, Any] = {}
    hooks = []
    for router, layer in rx.replay.torchtitan_routers(model):
        def keep(_r: Any, _a: Any, out: Any, layer: int = layer) -> None:
            routed[layer] = out[1].detach().clone()
        hooks.append(router.register_forward_hook(keep))
    for name, module in model.named_modules():
        if isinstance(module, RoutedExperts):
            layer = int(name.split(".")[1])

            def take(_m: Any, args: Any, layer: int = layer) -> None:
                handed[layer] = args[2].detach().clone()
            hooks.append(module.register_forward_pre_hook(take))
    return routed, handed, hooks


def payload(ids: dict[int, Any], layers: int) -> np.ndarray:
    """[B, S, every hidden layer, top_k], dense layers zero, as vLLM and SGLang send it."""
    out = np.zeros((BATCH, SEQ, layers, 8), dtype=np.int64)
    for layer, t in ids.items():
        out[:, :, layer] = t.numpy()
    return out


def test_the_model_replays_its_own_routing_bit_for_bit() -> None:
    model = build("dmm")
    routed, _, hooks = capture(model)
    with torch.no_grad():
        want = forward(model)
    for h in hooks:
        h.remove()
    assert sorted(routed) == [1, 2]
    with rx.replay.torchtitan(model, payload(routed, 3)) as replay, torch.no_grad():
        got = forward(model)
    assert torch.equal(got, want)  # the same ids and torchtitan's own weights
    assert sorted(replay.replayed) == [1, 2]
    assert all(m.all() for m in replay.replayed.values())
    stats = replay.stats()
    assert stats.flipped == 0 and stats.replayed == 2 * BATCH * SEQ


def test_forced_ids_reach_the_experts_and_train_the_gate() -> None:
    # One MoE layer, attention frozen (torch's FlexAttention has no backward on a CPU): the
    # loss reaches the gate only through the replayed ids' scores.
    model = build("m")
    for name, p in model.named_parameters():
        p.requires_grad_(".moe." in name)
    routed, handed, hooks = capture(model)
    with torch.no_grad():
        forward(model)
    own = routed[0]
    forced = (own + 1) % 64  # every row's ids moved: distinct, in range, all different
    routed.clear()
    with rx.replay.torchtitan(model, payload({0: forced}, 1)) as replay:
        forward(model).float().pow(2).mean().backward()
    assert torch.equal(handed[0], forced)  # what the experts were given
    assert torch.equal(routed[0], own)  # the router's own pick (seen before replay's hook)
    gate = model.layers["0"].moe.router.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0
    assert replay.stats().flip_rate == 1.0
    # The hook is gone on exit: the experts get the router's own pick again.
    with torch.no_grad():
        forward(model)
    for h in hooks:
        h.remove()
    assert torch.equal(handed[0], own)


def test_a_mask_fills_rows_without_routing_and_a_bad_row_is_named_by_sample() -> None:
    model = build("m")
    routed, handed, hooks = capture(model)
    with torch.no_grad():
        forward(model)
    ids = payload(routed, 1)
    mask = np.ones((BATCH, SEQ), dtype=bool)
    mask[1, 3:] = False
    ids[1, 3:] = 0  # rows the engine did not route (past its answer)
    with rx.replay.torchtitan(model, ids, mask) as replay, torch.no_grad():
        forward(model)
    assert replay.replayed[0].reshape(BATCH, SEQ).tolist() == mask.tolist()
    assert len(set(handed[0][1, 4].tolist())) == 8  # a filled row: distinct spread ids
    for h in hooks:
        h.remove()
    ids[0, 2, 0, :2] = 7
    with pytest.raises(rx.PayloadError, match="router of decoder layer 0, sample 0, position 2"):
        rx.replay.torchtitan(model, ids, mask)


def test_what_does_not_fit_is_refused() -> None:
    model = build("dm")
    good = np.tile(np.arange(8), (BATCH, SEQ, 2, 1))
    good[:, :, 0] = 0
    with pytest.raises(rx.ConfigError, match="router of decoder layer 1: top_k 8, but the "
                       "payload has 4"):
        rx.replay.torchtitan(model, good[..., :4])
    with pytest.raises(rx.ConfigError, match="the payload has 3 layers"):
        rx.replay.torchtitan(model, np.zeros((BATCH, SEQ, 3, 8), dtype=np.int64))
    with pytest.raises(rx.ConfigError, match=r"expected \[B, S, layers, top_k\]"):
        rx.replay.torchtitan(model, good[0])
    with pytest.raises(rx.PayloadError, match="decoder layer 0 is dense"):
        rx.replay.torchtitan(model, np.tile(np.arange(8), (BATCH, SEQ, 2, 1)))
    short = good[:, : SEQ - 1]
    with rx.replay.torchtitan(model, short), torch.no_grad():
        with pytest.raises(rx.ConfigError, match=f"routes {BATCH * SEQ} tokens, but the "
                           f"replay holds {BATCH * (SEQ - 1)} rows"):
            forward(model)
    with pytest.raises(rx.ConfigError, match="no TokenChoiceTopKRouter"):
        rx.replay.torchtitan(build("d"), good)


def test_the_device_path_makes_the_host_paths_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU the narrow rows are copied once and checked there (`_device.ids_on`); here the
    # same code runs on CPU tensors and must make the host path's ids, the mask's fill included.
    from routed_experts.replay import _device

    model = build("dm")
    routed, _, hooks = capture(model)
    with torch.no_grad():
        forward(model)
    for h in hooks:
        h.remove()
    routing = payload(routed, 2).astype(np.uint8)
    mask = np.ones((BATCH, SEQ), dtype=bool)
    mask[0, -2:] = False
    host = rx.replay.torchtitan(model, routing, mask)
    monkeypatch.setattr(_device, "wanted", lambda device, rows: _device.supported(rows))
    device = rx.replay.torchtitan(model, routing, mask)
    for a, b in zip(host._targets, device._targets):
        assert torch.equal(a.ids, b.ids) and a.layer == b.layer
    assert all(torch.equal(host.replayed[k], device.replayed[k]) for k in host.replayed)
