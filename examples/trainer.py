"""A trainer's hop: the rollouts' routing in, one packed batch out, and each parallel rank's share
of it (docs/usage.md, format.md §6 and §6.1).

Run it: .venv/bin/python examples/trainer.py, after `make run` (needs only numpy and
routed_experts; no torch).
"""

import numpy as np

import routed_experts as rx

LAYERS, TOP_K, EXPERTS = 4, 2, 128
CP, TP = 2, 2  # context-parallel and tensor-parallel (sequence-parallel) sizes
rng = np.random.default_rng(0)

# Three samples as the orchestrator hands them over: a payload each (here from arrays; in
# practice rx.RoutedExperts.from_json(wire) or an rx.Trajectory). vLLM sends no row for a
# sample's last sampled token, so each has one row fewer than its tokens.
num_tokens = [17, 12, 23]
samples = [  # top_k distinct experts per token and layer, as a router picks them
    rx.RoutedExperts.from_array(rng.random((n - 1, LAYERS, EXPERTS)).argsort(-1)[..., :TOP_K])
    for n in num_tokens
]
for s in samples:
    s.validate(num_experts=EXPERTS)  # ids in range, no expert twice in a top_k, no zero rows

# One int32 batch: each sample's rows at their positions in a sample of its token count, padded
# to a multiple of 2 x CP rows (what context parallelism cuts), with a mask of the rows that
# carry routing (False for padding and the missing last rows; those rows are zeros, never -1).
batch, cu_seqlens, mask = rx.pack(samples, num_tokens=num_tokens,
                                  pad_each_to_multiple=2 * CP, mask=True)
print(f"batch {batch.shape} {batch.dtype}, cu_seqlens {cu_seqlens.tolist()}, "
      f"{int(mask.sum())} of {len(mask)} rows with routing")

# Each rank takes only its part: context parallelism's rows of each sample (TransformerEngine's
# zigzag: chunks r and 2*CP-1-r of 2*CP), then sequence parallelism's part of those for its
# tensor-parallel rank (its cu_seqlens stay the CP rank's: attention sees the sequence the group
# gathers), then its pipeline stage's layers (here the first stage: layers 0-1). It copies only
# the rank's rows, so no rank need hold the whole batch.
rows_seen = 0
for cp_rank in range(CP):
    for tp_rank in range(TP):
        mine, my_cu, my_mask = rx.shard(batch, cu_seqlens, mask, cp_size=CP, cp_rank=cp_rank,
                                        tp_size=TP, tp_rank=tp_rank, layers=(0, 2))
        rows_seen += len(mine)
        print(f"cp rank {cp_rank}, tp rank {tp_rank}: {mine.shape}, cu_seqlens "
              f"{my_cu.tolist()}, {int(my_mask.sum())} rows with routing")
assert rows_seen == len(batch)  # the ranks' shares cover the batch, each row once

# Into the model's routers (needs torch and the model, so not run here; docs/usage.md):
#   with rx.replay.megatron(model, batch, cu_seqlens, mask) as replay:   # Megatron-core
#       loss = forward(model); replay.backward(); loss.sum().backward()
#   with rx.replay.hf(model, routing, mask):                             # transformers MoE
#       model(input_ids, labels=input_ids).loss.backward()
# Each router replays its own layer of the batch, this rank's tokens cut as rx.shard cuts them.

# Did replay hold? The trainer's own routing of the same tokens against the rollout's: here a
# recompute that picks other experts in layer 0 of every 10th token.
rollout = samples[0]
recompute = rollout.to_numpy(writable=True)
recompute[::10, 0] = (recompute[::10, 0] + 1) % EXPERTS
a = rx.agreement(rollout, recompute)
print(f"agreement: exact match {a.exact_match:.3f}, overlap {a.overlap:.3f}, "
      f"tokens with a difference {a.tokens_with_difference:.3f}")
load = rx.expert_load(samples, EXPERTS)
print(f"expert load: imbalance per layer {np.round(load.imbalance, 2).tolist()}")
