"""Router replay in the trainer's model: the last hop (format.md §6.2). Payloads in, replay set on
this rank's routers, forward and backward, cleared.

- `rx.replay.megatron(model, packed, cu_seqlens, mask)`: Megatron-core's `RouterReplay`.
- `rx.replay.hf(model, routing, mask)`: Hugging Face transformers MoE models (Qwen3-MoE, OLMoE,
  Mixtral, DeepSeek-V3).
- `rx.replay.torchtitan(model, routing, mask)`: torchtitan's MoE models (its
  `TokenChoiceTopKRouter`: Qwen3, DeepSeek-V3, GPT-OSS, Kimi), as torchforge trains them.

Each maps payload layers to the model's routers by walking the model, refuses a payload that
does not fit it (layer counts, a dense layer carrying routing, a MoE layer all zero, ids out of
range, negative or repeated in a row) or a model whose routing would ignore replay, and give
rows without routing ids spread over the experts, with a mask (`.replayed`, by 0-based decoder
layer) of the rows that were replayed. The ids are made where the model is (`device=`: on a
GPU, the decoded rows copied once and checked there). `stats()` counts, while the context is
open, how often each router's own pick differs from the engine's (the router flip rate).

The frameworks' modules are private (`_megatron`, `_hf`, `_torchtitan`): `rx.replay.megatron`,
`rx.replay.hf` and `rx.replay.torchtitan` are their contexts, each a `ReplayContext`
(docs/architecture.md, "Adding a trainer framework").
"""

from __future__ import annotations

from ._context import ReplayContext
from ._hf import HfReplay, hf
from ._hf import gates as hf_gates
from ._megatron import MegatronReplay, local_rows, megatron
from ._megatron import routers as megatron_routers
from ._rows import (
    RouterRows,
    check_layers,
    cp_sp_positions,
    fill_ids,
    moe_pattern,
    payload_layer,
    replay_ids,
)
from ._stats import LayerStats, ReplayStats
from ._torchtitan import TorchtitanReplay, torchtitan
from ._torchtitan import routers as torchtitan_routers

__all__ = [
    "HfReplay",
    "LayerStats",
    "MegatronReplay",
    "ReplayContext",
    "ReplayStats",
    "RouterRows",
    "TorchtitanReplay",
    "check_layers",
    "cp_sp_positions",
    "fill_ids",
    "hf",
    "hf_gates",
    "local_rows",
    "megatron",
    "megatron_routers",
    "moe_pattern",
    "payload_layer",
    "replay_ids",
    "torchtitan",
    "torchtitan_routers",
]
