"""Router replay in the trainer's model: the last hop (format.md §6.2). Payloads in, replay set on
this rank's routers, forward and backward, cleared.

- `rx.replay.megatron(model, packed, cu_seqlens, mask)`: Megatron-core's `RouterReplay`.
- `rx.replay.hf(model, routing, mask)`: Hugging Face transformers MoE models (Qwen3-MoE, OLMoE,
  Mixtral, DeepSeek-V3).

Both map payload layers to the model's routers by walking the model, refuse a payload that
does not fit it (layer counts, a dense layer carrying routing, a MoE layer all zero, ids out of
range or repeated in a row), and give rows without routing ids spread over the experts, with a
mask (`.replayed`) of the rows that were replayed.
"""

from __future__ import annotations

from ._rows import (
    check_layers,
    cp_sp_positions,
    fill_ids,
    moe_pattern,
    payload_layer,
    replay_ids,
)
from .hf import HfReplay, hf
from .hf import gates as hf_gates
from .megatron import MegatronReplay, local_rows, megatron
from .megatron import routers as megatron_routers

__all__ = [
    "HfReplay",
    "MegatronReplay",
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
]
