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
    hybrid_model,
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
            assert replay.replayed[n - 1].all()  # 0-based decoder layers, as the payload's
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
            got = replay.replayed[n - 1].reshape(SEQ, BATCH)
            assert got[:-1].all() and not got[-1].any()


def test_what_does_not_fit_is_refused(model: Any) -> None:
    ids, _ = record(model)
    routing = bshd(as_payloads(ids, BATCH))
    with pytest.raises(rx.ConfigError, match="the payload has 2 layers, but the model has 4"):
        rx.replay.megatron(model, routing[:, :, :2], layout="bshd")
    bad = routing.copy()
    bad[0, 3, 2] = [EXPERTS + 1, 0]  # past the model's experts
    with pytest.raises(rx.PayloadError, match="^router of decoder layer 2, sample 0, position 3: "
                       "expert ids must be in \\[0, 8\\), got \\[9, 0\\]$"):
        rx.replay.megatron(model, bad, layout="bshd")
    bad = routing.copy()
    bad[1, 0, 1] = [3, 3]
    with pytest.raises(rx.PayloadError, match="^router of decoder layer 1, sample 1, position 0: "
                       "a row's expert ids must be distinct"):
        rx.replay.megatron(model, bad, layout="bshd")
    bad = routing.copy()
    bad[:, :, 0] = [1, 2]  # the dense layer carrying routing
    with pytest.raises(rx.PayloadError, match="decoder layer 0 is dense"):
        rx.replay.megatron(model, bad, layout="bshd")
    # A replay whose length is not the router's token count (Megatron itself would leave the
    # other tokens unrouted): refused when the router runs.
    with rx.replay.megatron(model, routing[:1], layout="bshd"):
        with pytest.raises(rx.ConfigError, match="^router of decoder layer 1: it routes 32 tokens "
                           "on this rank, but the replay holds 16 rows"), torch.no_grad():
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


@pytest.mark.parametrize("kind", ["sinkhorn", "quantile_balancing"])
def test_a_routing_type_that_never_consults_replay_is_refused(model: Any, kind: str) -> None:
    # Issue 54, item 1: these paths choose experts themselves; replay was accepted and ignored.
    routing = bshd(as_payloads(record(model)[0], BATCH))
    config = rx.replay.megatron_routers(model)[0][0].config
    saved = config.moe_router_load_balancing_type
    config.moe_router_load_balancing_type = kind
    try:
        with pytest.raises(rx.ConfigError, match=f"moe_router_load_balancing_type='{kind}'.*"
                           "never consults RouterReplay"):
            rx.replay.megatron(model, routing, layout="bshd")
    finally:
        config.moe_router_load_balancing_type = saved


def test_a_packed_payload_meeting_a_batch_forward_is_refused(model: Any) -> None:
    # Issue 54, item 2: two packed samples replayed (layout "thd", the default) into a [B=2, S]
    # forward: as many rows as tokens, so nothing objected, and every token took another's ids.
    ids, _ = record(model)
    packed, cu = rx.pack(as_payloads(ids, BATCH), dtype="int32")
    with rx.replay.megatron(model, packed, cu):
        with pytest.raises(rx.ConfigError, match="layout=\"thd\" replays a packed batch .* "
                           "\\[S=16, B=2, H\\]"), torch.no_grad():
            forward(model)


def test_a_packed_payloads_bad_row_is_named_by_sample_and_position(model: Any) -> None:
    ids, _ = record(model)
    payloads = as_payloads(ids, BATCH)
    packed, cu = rx.pack(payloads, dtype="int32")
    packed[SEQ + 5, 3] = [7, 7]  # sample 1, position 5, decoder layer 3
    with pytest.raises(rx.PayloadError, match="^router of decoder layer 3, sample 1, position 5: "
                       "a row's expert ids must be distinct"):
        rx.replay.megatron(model, packed, cu)


def own_picks(model: Any) -> tuple[dict[int, list[Any]], list[Any]]:
    """Each router's own top-k in the next forwards, from its input and weight, computed here
    (this config: top-k of the logits, softmax after): the independent count's side."""
    picks: dict[int, list[Any]] = {}
    hooks = []
    for router, n, _ in rx.replay.megatron_routers(model):
        def keep(m: Any, a: Any, n: int = n) -> None:
            h = a[0].detach().reshape(-1, a[0].shape[-1])
            logits = torch.nn.functional.linear(h, m.weight.detach())
            picks.setdefault(n - 1, []).append(logits.topk(TOP_K, dim=-1).indices)
        hooks.append(router.register_forward_pre_hook(keep))
    return picks, hooks


def test_the_flip_rate_counts_each_routers_own_pick_against_the_replayed_ids(model: Any) -> None:
    ids, _ = record(model)
    forced = forced_ids(ids)
    # Every third row forced onto experts the router did not pick, the rest its own.
    mixed = {n: torch.where((torch.arange(t.shape[0]) % 3 == 0)[:, None], forced[n], t)
             for n, t in ids.items()}  # fmt: skip
    mask = np.ones((BATCH, SEQ), dtype=bool)
    mask[1, -2:] = False
    picks, hooks = own_picks(model)
    with rx.replay.megatron(model, bshd(as_payloads(mixed, BATCH)), None, mask,
                            layout="bshd") as replay:  # fmt: skip
        with torch.no_grad():
            forward(model)
            forward(model)
        stats = replay.stats()
    for h in hooks:
        h.remove()
    valid = torch.from_numpy(mask.T.reshape(-1))  # sequence-first, as the router's rows
    flipped_total = replayed_total = 0
    for n, t in mixed.items():
        want = sum(int(((p.sort(-1).values != t.sort(-1).values).any(-1) & valid).sum())
                   for p in picks[n - 1])  # fmt: skip
        got = stats.layers[n - 1]
        assert (got.flipped, got.replayed, got.filled, got.rows) == (want, 2 * 30, 2 * 2, 2 * 32)
        assert got.flip_rate == want / 60
        flipped_total, replayed_total = flipped_total + want, replayed_total + 60
    assert stats.forwards == 2 and stats.flipped == flipped_total > 0
    assert stats.flip_rate == flipped_total / replayed_total
    assert stats.as_dict()["replay/flip_rate/layer_1"] == stats.layers[1].flip_rate
    replay.reset_stats()
    assert replay.stats().flipped == 0 and replay.stats().forwards == 0
    # The model's own routing replayed: no router flips. A framework's own wrapper of
    # get_replay_topk is called through and put back on exit.
    first = rx.replay.megatron_routers(model)[0][0].router_replay
    calls = []
    theirs = first.get_replay_topk

    def wrapper(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return theirs(*a, **k)

    first.get_replay_topk = wrapper
    with rx.replay.megatron(model, bshd(as_payloads(ids, BATCH)), layout="bshd") as replay:
        with torch.no_grad():
            forward(model)
        assert replay.stats().flipped == 0 and replay.stats().replayed == 3 * 32
    assert calls == [1] and first.get_replay_topk is wrapper
    del first.get_replay_topk
    assert all("get_replay_topk" not in r.router_replay.__dict__
               for r, _, _ in rx.replay.megatron_routers(model))


def test_the_device_path_makes_the_same_ids_on_cpu_tensors(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The path a GPU takes (rows copied narrow, checked and widened by torch), forced here.
    from routed_experts.replay import _device

    ids, recorded_loss = record(model)
    routing = bshd(as_payloads(ids, BATCH)).astype(np.uint8)
    host = rx.replay.megatron(model, routing, layout="bshd")
    monkeypatch.setattr(_device, "wanted", lambda device, rows: _device.supported(rows))
    with rx.replay.megatron(model, routing, layout="bshd", dtype=torch.int32) as replay:
        with torch.no_grad():
            loss = forward(model)
    assert torch.equal(loss, recorded_loss)
    for (_, a, _, la), (_, b, _, lb) in zip(host._targets, replay._targets):
        assert la == lb and torch.equal(a.to(torch.int32), b) and b.dtype == torch.int32
    bad = routing.copy()
    bad[0, 3, 2] = [EXPERTS + 1, 0]
    with pytest.raises(rx.PayloadError, match="^router of decoder layer 2, sample 0, position 3: "
                       "expert ids must be in \\[0, 8\\), got \\[9, 0\\]$"):
        rx.replay.megatron(model, bad, layout="bshd")


def test_a_hybrid_model_replays_by_its_layer_pattern(model: Any) -> None:
    # megatron-core 0.19 deprecates GPTModel for HybridModel, whose MoE layers are the 'E' of
    # its layer pattern (moe_layer_freq is not read): "-E-E" has routers at decoder layers 1, 3.
    hybrid = hybrid_model("-E-E")
    assert [n for _, n, _ in rx.replay.megatron_routers(hybrid)] == [2, 4]
    ids, recorded_loss = record(hybrid)
    layers = [np.zeros((SEQ, BATCH, TOP_K), dtype=np.int64) for _ in range(4)]
    layers[1], layers[3] = (ids[n].reshape(SEQ, BATCH, TOP_K).numpy() for n in (2, 4))
    every = np.stack(layers, axis=2).transpose(1, 0, 2, 3)  # [B, S, 4 layers, top_k]
    for routing in (every, every[:, :, [1, 3]]):  # every hidden layer, or the MoE layers only
        with rx.replay.megatron(hybrid, routing, layout="bshd") as replay:
            with torch.no_grad():
                loss = forward(hybrid)
        assert torch.equal(loss, recorded_loss)
        assert sorted(replay.replayed) == [1, 3] and replay.stats().flipped == 0
    wrong = every.copy()
    wrong[:, :, 2] = [1, 2]  # an MLP layer carrying routing
    with pytest.raises(rx.PayloadError, match="decoder layer 2 is dense"):
        rx.replay.megatron(hybrid, wrong, layout="bshd")

