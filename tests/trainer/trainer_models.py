"""The tiny models the trainer tests replay into: a Megatron-core GPT with MoE layers (CPU, gloo,
world size 1) and one transformers 5.x model per MoE family, each seeded."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import torch

torch.set_num_threads(1)
# megatron-core places buffers on torch.cuda.current_device(); these machines have no GPU.
torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.tensor_parallel.random import initialize_rng_tracker  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplay  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from transformers import (  # noqa: E402
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import routed_experts as rx  # noqa: E402

# Megatron: 4 decoder layers, the first dense (moe_layer_freq), 8 experts, top_k 2.
EXPERTS, TOP_K, LAYERS, SEQ, VOCAB = 8, 2, 4, 16, 128
PATTERN = [0, 1, 1, 1]


@contextlib.contextmanager
def megatron_world() -> Iterator[None]:
    """One process, gloo, every parallel size 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1,
                                             create_gloo_process_groups=False)
    # The CUDA RNG tracker needs a driver; the inference tracker's fork() does nothing (no
    # dropout here).
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def megatron_config(**parallel: Any) -> Any:
    """The tiny GPT's config (`parallel`: Megatron's parallel sizes, as a rank builds it)."""
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_moe_experts=EXPERTS, moe_ffn_hidden_size=32, moe_router_topk=TOP_K,
        moe_layer_freq=PATTERN, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        moe_enable_routing_replay=True, use_cpu_initialization=True,
        params_dtype=torch.float32, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, transformer_impl="local", **parallel,
    )


def megatron_model(config: Any = None, **stage: Any) -> Any:
    """A seeded GPT with router replay on (inside `megatron_world`, or a rank's own world;
    `stage`: `pre_process` and `post_process` for a pipeline stage)."""
    torch.manual_seed(1234)
    config = megatron_config() if config is None else config
    RouterReplay.clear_global_router_replay_instances()
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=VOCAB, max_sequence_length=4 * SEQ, position_embedding_type="rope", **stage,
    )
    gpt.train()
    return gpt


def hybrid_model(pattern: str = "-E-E") -> Any:
    """A seeded HybridModel of MLP ('-') and MoE ('E') layers with router replay on (inside
    `megatron_world`). megatron-core's own hybrid specs are TransformerEngine's; this one is
    built of its local modules (no attention: local attention needs a GPU)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayerSubmodules,
    )

    norm = LocalSpecProvider().layer_norm()
    dense = ModuleSpec(module=MLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))  # fmt: skip
    layer = TransformerLayerSubmodules
    stack = HybridStackSubmodules(
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=layer(
            pre_mlp_layernorm=norm, mlp=get_moe_module_spec(use_te=False, num_experts=EXPERTS,
                                                            moe_grouped_gemm=False),
            mlp_bda=get_bias_dropout_add)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=layer(
            pre_mlp_layernorm=norm, mlp=dense, mlp_bda=get_bias_dropout_add)),
    )  # fmt: skip
    config = TransformerConfig(
        num_layers=len(pattern), hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_moe_experts=EXPERTS, moe_ffn_hidden_size=32, moe_router_topk=TOP_K,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        moe_enable_routing_replay=True, use_cpu_initialization=True, params_dtype=torch.float32,
        add_bias_linear=False, hidden_dropout=0.0, gradient_accumulation_fusion=False,
        is_hybrid_model=True,
    )  # fmt: skip
    torch.manual_seed(1234)
    RouterReplay.clear_global_router_replay_instances()
    model = HybridModel(
        config, ModuleSpec(module=HybridStack, params={"post_layer_norm": False},
                           submodules=stack),
        vocab_size=VOCAB, max_sequence_length=4 * SEQ, hybrid_layer_pattern=pattern,
        position_embedding_type="none",
    )  # fmt: skip
    model.train()
    return model


def megatron_forward(model: Any, batch: int, seq: int = SEQ) -> Any:
    """The per-token loss of a seeded batch `[batch, seq]`."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=g)
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=g)
    # An explicit causal mask: without one, local attention builds it on "cuda".
    mask = torch.triu(torch.ones(1, 1, seq, seq), diagonal=1).bool()
    return model(tokens, positions, attention_mask=mask, labels=labels)


# transformers: 3 decoder layers, 8 experts, top_k 2.
HF_LAYERS, HF_VOCAB = 3, 64
FAMILIES = ["qwen3_moe", "olmoe", "mixtral", "deepseek_v3"]
COMMON = dict(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64,
              num_hidden_layers=HF_LAYERS, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)


def hf_model(family: str) -> Any:
    """A seeded model of `family`, its gates routing for real (some start at zero)."""
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
        if gate is not None:
            torch.nn.init.normal_(gate.weight, std=0.5)
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.normal_(0, 0.1)
    model.train()
    return model
