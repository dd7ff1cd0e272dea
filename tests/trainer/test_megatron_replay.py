"""rx.replay.megatron against real megatron-core 0.19.2 (make test-trainer): a forward's routing
recorded by Megatron, carried through the library (vLLM's wire format, decode, pack), replayed
bit for bit; forced routing; the refusals. CPU, gloo, world size 1."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import routed_experts as rx

torch.set_num_threads(1)
# megatron-core places buffers on torch.cuda.current_device(); this machine has no GPU.
torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.tensor_parallel.random import initialize_rng_tracker  # noqa: E402
from megatron.core.transformer.moe.router_replay import (  # noqa: E402
    RouterReplay,
    RouterReplayAction,
)
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

EXPERTS, TOP_K, LAYERS, SEQ, BATCH, VOCAB = 8, 2, 4, 16, 2, 128
PATTERN = [0, 1, 1, 1]  # decoder layer 1 (0 here) dense, the others MoE


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1,
                                             create_gloo_process_groups=False)
    # The CUDA RNG tracker needs a driver; the inference tracker's fork() does nothing (no
    # dropout here).
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_moe_experts=EXPERTS, moe_ffn_hidden_size=32, moe_router_topk=TOP_K,
        moe_layer_freq=PATTERN, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        moe_enable_routing_replay=True, use_cpu_initialization=True,
        params_dtype=torch.float32, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, transformer_impl="local",
    )
    RouterReplay.clear_global_router_replay_instances()
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
    )
    gpt.train()
    yield gpt
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    os.environ.pop("MASTER_PORT", None)


def forward(model: Any, batch: int = BATCH) -> Any:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    positions = torch.arange(SEQ).unsqueeze(0).expand(batch, -1)
    labels = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    # An explicit causal mask: without one, local attention builds it on "cuda".
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool()
    return model(tokens, positions, attention_mask=mask, labels=labels)


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
        # The weights come from the router's live scores at the replayed ids: gradients flow.
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
