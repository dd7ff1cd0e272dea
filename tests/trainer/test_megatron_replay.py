"""rx.replay.megatron against real megatron-core 0.19.2 (make test-trainer): a forward's routing
recorded by Megatron, carried through the library (vLLM's wire format, decode, pack), replayed
bit for bit; forced routing; the refusals. CPU, gloo, world size 1."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from trainer_models import (
    EXPERTS,
    SEQ,
    TOP_K,
    megatron_forward,
    megatron_model,
    megatron_world,
)

import routed_experts as rx

BATCH = 2


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    with megatron_world():
        yield megatron_model()


def forward(model: Any, batch: int = BATCH) -> Any:
    return megatron_forward(model, batch)


def routing_maps(model: Any) -> tuple[dict[int, Any], list[Any]]:
    """Each router's routing map of the next forward, by layer number (and the hooks)."""
    maps: dict[int, Any] = {}
    hooks = []
    for router, number, _ in rx.replay.megatron_routers(model):
        def keep(_m: Any, _a: Any, out: Any, n: int = number) -> None:
            maps[n] = out[1].detach()
        hooks.append(router.register_forward_hook(keep))
    return maps, hooks


def record(model: Any, batch: int = BATCH) -> tuple[dict[int, Any], Any]:
    """Megatron's own RECORD: each router's ids [S * B, top_k], sequence-first."""
    routers = rx.replay.megatron_routers(model)
    for router, _, _ in routers:
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        loss = forward(model, batch)
    ids = {n: r.router_replay.get_recorded_indices().clone() for r, n, _ in routers}
    for router, _, _ in routers:
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()
    return ids, loss


def as_payloads(ids: dict[int, Any], batch: int, every_layer: bool = True) -> list[Any]:
    """One payload a sample, as an engine would send it: every hidden layer (dense zero) or the
    MoE layers only, carried over vLLM's wire format (.npy in base64) and decoded back."""
    out = []
    for b in range(batch):
        layers = [ids[n].reshape(SEQ, batch, TOP_K)[:, b].numpy() for n in sorted(ids)]
        if every_layer:
            layers.insert(0, np.zeros((SEQ, TOP_K), dtype=np.int64))
        rows = np.stack(layers, axis=1)
        text = rx.encode(rx.RoutedExperts.from_array(rows, num_experts=EXPERTS), "vllm_npy")
        out.append(rx.decode(text, start=0))
    return out


def bshd(payloads: list[Any]) -> np.ndarray:
    return np.stack([p.to_numpy() for p in payloads])


def test_recorded_routing_carried_through_the_library_replays_bit_for_bit(model: Any) -> None:
    ids, recorded_loss = record(model)
    for every_layer in (True, False):
        maps, hooks = routing_maps(model)
        with rx.replay.megatron(model, bshd(as_payloads(ids, BATCH, every_layer)),
                                layout="bshd") as replay:
            with torch.no_grad():
                loss = forward(model)
        for h in hooks:
            h.remove()
        assert torch.equal(loss, recorded_loss)
        for n, want in ids.items():
            expect = torch.zeros(SEQ * BATCH, EXPERTS, dtype=torch.bool).scatter(1, want, True)
            assert torch.equal(maps[n], expect), n
            assert replay.replayed[n].all()
    # Cleared on exit: the next forward routes natively.
    for router, _, _ in rx.replay.megatron_routers(model):
        assert router.router_replay.router_replay_action is None
        assert router.router_replay.target_topk_idx is None


def test_a_packed_sample_replays_through_pack_and_shard(model: Any) -> None:
    ids, recorded_loss = record(model, batch=1)
    packed, cu = rx.pack(as_payloads(ids, 1), dtype="int32")
    with rx.replay.megatron(model, packed, cu), torch.no_grad():
        loss = forward(model, batch=1)
    assert torch.equal(loss, recorded_loss)


def forced_ids(ids: dict[int, Any]) -> dict[int, Any]:
    """For every token, top_k experts the router did not pick."""
    out = {}
    for n, t in ids.items():
        rows = [[e for e in range(EXPERTS) if e not in set(r)][:TOP_K] for r in t.tolist()]
        out[n] = torch.tensor(rows)
    return out


def test_forced_routing_uses_the_replayed_experts_and_trains_the_router(model: Any) -> None:
    ids, recorded_loss = record(model)
    forced = forced_ids(ids)
    maps, hooks = routing_maps(model)
    inputs: dict[int, Any] = {}
    probs: dict[int, Any] = {}
    for router, n, _ in rx.replay.megatron_routers(model):
        hooks.append(router.register_forward_pre_hook(
            lambda _m, a, n=n: inputs.__setitem__(n, a[0].detach())))
        hooks.append(router.register_forward_hook(
            lambda _m, _a, out, n=n: probs.__setitem__(n, out[0].detach())))
    model.zero_grad()
    with rx.replay.megatron(model, bshd(as_payloads(forced, BATCH)), layout="bshd"):
        loss = forward(model)
        loss.mean().backward()
    for h in hooks:
        h.remove()
    assert not torch.equal(loss.detach(), recorded_loss)
    for router, n, _ in rx.replay.megatron_routers(model):
        expect = torch.zeros(SEQ * BATCH, EXPERTS, dtype=torch.bool).scatter(1, forced[n], True)
        assert torch.equal(maps[n], expect), n
        # The weights follow the router's rule at the replayed ids (softmax after top-k, this
        # config's: a softmax over the router's live logits at those ids)...
        logits = torch.nn.functional.linear(inputs[n].reshape(-1, inputs[n].shape[-1]),
                                            router.weight.detach())
        want = torch.softmax(logits.gather(1, forced[n]), dim=-1)
        torch.testing.assert_close(probs[n].gather(1, forced[n]), want)
        # ...so gradients reach the router.
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_rows_without_routing_are_filled_and_masked(model: Any) -> None:
    ids, _ = record(model)
    routing = bshd(as_payloads(ids, BATCH))
    mask = np.ones((BATCH, SEQ), dtype=bool)
    mask[:, -1] = False  # the last token of each sample: engines send no row for it
    routing[:, -1] = 0
    with rx.replay.megatron(model, routing, None, mask, layout="bshd") as replay:
        with torch.no_grad():
            forward(model)
        for n in ids:
            got = replay.replayed[n].reshape(SEQ, BATCH)
            assert got[:-1].all() and not got[-1].any()


def test_what_does_not_fit_is_refused(model: Any) -> None:
    ids, _ = record(model)
    routing = bshd(as_payloads(ids, BATCH))
    with pytest.raises(rx.ConfigError, match="the payload has 2 layers, but the model has 4"):
        rx.replay.megatron(model, routing[:, :, :2], layout="bshd")
    bad = routing.copy()
    bad[0, 3, 2] = [EXPERTS + 1, 0]  # past the model's experts
    with pytest.raises(rx.PayloadError, match="expert ids must be below num_experts 8"):
        rx.replay.megatron(model, bad, layout="bshd")
    bad = routing.copy()
    bad[1, 0, 1] = [3, 3]
    with pytest.raises(rx.PayloadError, match="a row's expert ids must be distinct"):
        rx.replay.megatron(model, bad, layout="bshd")
    bad = routing.copy()
    bad[:, :, 0] = [1, 2]  # the dense layer carrying routing
    with pytest.raises(rx.PayloadError, match="decoder layer 0 is dense"):
        rx.replay.megatron(model, bad, layout="bshd")
    # A replay whose length is not the router's token count (Megatron itself would leave the
    # other tokens unrouted): refused when the router runs.
    with rx.replay.megatron(model, routing[:1], layout="bshd"):
        with pytest.raises(rx.ConfigError, match="routes 32 tokens on this rank, but the "
                           "replay holds 16 rows"), torch.no_grad():
            forward(model)
    config = rx.replay.megatron_routers(model)[0][0].config
    config.moe_router_fusion = True
    try:
        with pytest.raises(rx.ConfigError, match="moe_router_fusion=True .* \\(replay would "
                           "be ignored\\)"):
            rx.replay.megatron(model, routing, layout="bshd")
    finally:
        config.moe_router_fusion = False


def test_activation_recompute_replays_the_same_ids_inside_backward(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import megatron.core.tensor_parallel.random as mrandom

    # Recompute saves and restores the CUDA RNG state; there is none on a CPU.
    monkeypatch.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    monkeypatch.setattr(mrandom, "_set_cuda_rng_state", lambda *a, **k: None)
    ids, _ = record(model)
    routing = bshd(as_payloads(forced_ids(ids), BATCH))
    params = [p for p in model.parameters() if p.requires_grad]

    def step(recompute: bool) -> list[Any]:
        config = model.config
        monkeypatch.setattr(config, "recompute_granularity", "full" if recompute else None)
        monkeypatch.setattr(config, "recompute_method", "uniform" if recompute else None)
        monkeypatch.setattr(config, "recompute_num_layers", 1 if recompute else None)
        model.zero_grad()
        with rx.replay.megatron(model, routing, layout="bshd") as replay:
            loss = forward(model)
            replay.backward()
            loss.sum().backward()
            if recompute:  # each router's recomputed forward took its ids from the queue
                for router, _, _ in rx.replay.megatron_routers(model):
                    assert router.router_replay.replay_backward_list == []
        return [p.grad.clone() for p in params]

    plain, recomputed = step(False), step(True)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, recomputed))
