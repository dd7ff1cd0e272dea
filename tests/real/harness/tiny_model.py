"""A tiny Qwen3-MoE model made here, from a seed: random float32 weights in the checkpoint
layout Qwen3-MoE checkpoints use (one tensor per expert), and a byte-level BPE tokenizer
trained on generated text, with a chat template. No hub is reached: the model is made, not
fetched. Runs in an engine environment (torch, safetensors, tokenizers).

    python tiny_model.py DIR [--experts 8] [--dense-layers 2|none|0,3] [--gate-scale 0.05]

`--dense-layers none` makes every layer a MoE layer (SGLang's qwen3_moe ignores
`mlp_only_layers` and would run a dense layer as a MoE one); the default is layer 2 dense.
`--gate-scale` narrows the routers' weights (the same draws, scaled): logits closer together,
so two libraries' bfloat16 rounding picks different experts more often (the R3 loop's
tie-prone model, tests/real/test_live_vllm_r3.py); the default 1 keeps the gates wide.

The same seed gives the same files, so a recording can be made again and compared.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HIDDEN = 128
LAYERS = 4
DENSE_LAYERS = [2]  # a layer with no router: engines write its rows as zeros
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
INTERMEDIATE, MOE_INTERMEDIATE = 256, 64
TOP_K = 2
VOCAB = 512
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "expert router token layer prompt decode prefill merge rollout trainer replay batch "
    "sequence position routing model engine server stream chunk cache block weight gate "
    "the a of to and in is it that for on with as was at by an be this from or"
).split()


def config(experts: int, dense: list[int] | None = None) -> dict:
    dense = DENSE_LAYERS if dense is None else dense
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_experts": experts,
        "num_experts_per_tok": TOP_K,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 0,
    }


def weights(
    experts: int, seed: int, dense: list[int] | None = None, gate_scale: float = 1.0
) -> dict:
    import torch

    dense = DENSE_LAYERS if dense is None else dense
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    t: dict = {
        "model.embed_tokens.weight": normal(VOCAB, HIDDEN, std=1.0),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": normal(VOCAB, HIDDEN, std=0.2),
    }
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        t[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        t[p + "self_attn.q_proj.weight"] = normal(HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * HEAD_DIM)
        t[p + "self_attn.q_norm.weight"] = torch.ones(HEAD_DIM)
        t[p + "self_attn.k_norm.weight"] = torch.ones(HEAD_DIM)
        if layer in dense:
            t[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
            t[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
            t[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
            continue
        # A wide gate: logits far apart, so the top-k is the same in any float32 order.
        t[p + "mlp.gate.weight"] = normal(experts, HIDDEN, std=0.5) * gate_scale
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"] = normal(MOE_INTERMEDIATE, HIDDEN)
            t[q + "up_proj.weight"] = normal(MOE_INTERMEDIATE, HIDDEN)
            t[q + "down_proj.weight"] = normal(HIDDEN, MOE_INTERMEDIATE)
    return t


def corpus(seed: int, lines: int = 2000) -> list[str]:
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(4, 16))) for _ in range(lines)]


def tokenizer(out: Path, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": 4096,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=1,
        )
    )


def make(
    out: Path, experts: int = 8, seed: int = 0, dense: list[int] | None = None,
    gate_scale: float = 1.0,
) -> Path:
    """Write the model into `out` (kept if it is already there, from the same arguments).
    `dense`: the layers with no router (default `DENSE_LAYERS`; `[]` for none); `gate_scale`:
    the routers' weights scaled (1: as drawn)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    stamp = out / "made.json"
    made: dict = {"experts": experts, "seed": seed, "layers": LAYERS, "top_k": TOP_K}
    if dense is not None and list(dense) != DENSE_LAYERS:
        made["dense_layers"] = list(dense)  # the default's stamp stays as it was
    if gate_scale != 1.0:
        made["gate_scale"] = gate_scale
    if stamp.exists() and json.loads(stamp.read_text()) == made:
        return out
    (out / "config.json").write_text(json.dumps(config(experts, dense), indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 0, "do_sample": False})
    )
    save_file(
        weights(experts, seed, dense, gate_scale), str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    tokenizer(out, seed)
    stamp.write_text(json.dumps(made))
    return out


if __name__ == "__main__":
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("out", type=Path)
    a.add_argument("--experts", type=int, default=8)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument(
        "--dense-layers",
        default=None,
        help="comma-separated layers with no router, or 'none' (default: "
        + ",".join(map(str, DENSE_LAYERS))
        + ")",
    )
    a.add_argument("--gate-scale", type=float, default=1.0,
                   help="scale the routers' weights (default 1; 0.05: the tie-prone model)")
    args = a.parse_args()
    dense = None
    if args.dense_layers is not None:
        text = args.dense_layers.strip().lower()
        dense = [] if text in ("none", "") else [int(x) for x in text.split(",")]
    print(make(args.out, args.experts, args.seed, dense, args.gate_scale))
