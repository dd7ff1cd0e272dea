"""One rank of a multi-process Megatron run (gloo, CPU), for test_megatron_ranks.py: builds this
rank's part of the tiny GPT (its pipeline stage, its tensor-parallel shard), sets replay from a
batch every rank holds, and prints what each of its routers was given, as JSON.

    python ranks_worker.py RANK WORLD PORT TP CP PP
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from trainer_models import EXPERTS, LAYERS, PATTERN, TOP_K, megatron_config, megatron_model

import routed_experts as rx

BATCH, SEQ = 2, 16


def batch() -> np.ndarray:
    """[B, S, every layer, top_k]: row (b, s) of a MoE layer holds two distinct ids that say
    where it came from; dense layers zero."""
    out = np.zeros((BATCH, SEQ, LAYERS, TOP_K), dtype=np.int64)
    for layer, moe in enumerate(PATTERN):
        if moe:
            code = (np.arange(BATCH)[:, None] * SEQ + np.arange(SEQ)[None, :] + layer) % EXPERTS
            out[:, :, layer, 0] = code
            out[:, :, layer, 1] = (code + 1) % EXPERTS
    return out


def main() -> None:
    rank, world, port, tp, cp, pp = (int(x) for x in sys.argv[1:7])
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    ps.initialize_model_parallel(tp, pp, context_parallel_size=cp,
                                 create_gloo_process_groups=False)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    config = megatron_config(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
    )
    model = megatron_model(
        config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()
    )
    # Context parallel attention and sequence parallel norms are TransformerEngine's (no GPU
    # here): the model is built without them and told afterwards, as a TE build would be. The
    # routers, and what replay reads (the parallel state, `sequence_parallel`), are the same.
    config.sequence_parallel = tp > 1
    config.context_parallel_size = cp
    given = {}
    with rx.replay.megatron(model, batch(), layout="bshd"):
        for router, number, _ in rx.replay.megatron_routers(model):
            given[number] = router.router_replay.target_topk_idx.tolist()
    place = {
        "cp_rank": ps.get_context_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
    }
    print(json.dumps({"place": place, "given": given}), flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
