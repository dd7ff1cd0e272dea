"""rx.replay.megatron across ranks (gloo, several CPU processes, tests/trainer/ranks_worker.py):
with context parallelism, tensor parallelism with sequence parallelism, and pipeline stages,
each rank's routers get exactly its tokens of its layers, read from Megatron's own parallel
state, and the union over ranks is the batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ranks_worker import BATCH, SEQ, batch
from trainer_models import PATTERN

from routed_experts.replay import cp_sp_positions

WORKER = Path(__file__).with_name("ranks_worker.py")


def run(tp: int, cp: int, pp: int) -> list[dict[str, Any]]:
    world = tp * cp * pp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The library as this process imports it (the clone's python/), and quiet libraries.
    import routed_experts

    lib = str(Path(routed_experts.__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": lib}
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(port), str(tp),
                          str(cp), str(pp)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=WORKER.parent)
        for r in range(world)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


# Context and sequence parallelism together (4 ranks: each cut, then the other), and pipeline
# stages; either cut alone is a case of the first (and of test_replay_rows' properties).
@pytest.mark.parametrize(("tp", "cp", "pp"), [(2, 2, 1), (1, 1, 2)], ids=["tp2-sp-cp2", "pp2"])
def test_each_rank_gets_its_tokens_of_its_layers_and_the_ranks_cover_the_batch(
    tp: int, cp: int, pp: int
) -> None:
    ranks = run(tp, cp, pp)
    full = batch()
    covered: dict[int, list[int]] = {}
    for r in ranks:
        place, given = r["place"], r["given"]
        positions = cp_sp_positions(SEQ, cp, place["cp_rank"], "zigzag", tp, place["tp_rank"])
        per_stage = len(PATTERN) // pp
        stage = range(place["pp_rank"] * per_stage, (place["pp_rank"] + 1) * per_stage)
        want_layers = [i + 1 for i in stage if PATTERN[i]]
        assert sorted(int(n) for n in given) == want_layers, place
        for number, ids in given.items():
            layer = int(number) - 1  # a payload of every layer: decoder layer i from layer i
            # Sequence-first, as the router flattens its [S, B, H] input.
            want = full[:, positions, layer].transpose(1, 0, 2).reshape(-1, full.shape[-1])
            np.testing.assert_array_equal(np.array(ids), want, err_msg=f"{place} layer {number}")
            covered.setdefault(layer, []).extend(positions.tolist())
    # Every position of every MoE layer on exactly one rank (of the layer's pipeline stage).
    assert sorted(covered) == [i for i, moe in enumerate(PATTERN) if moe]
    for layer, positions in covered.items():
        assert sorted(positions) == list(range(SEQ)), layer
    assert full.shape[0] == BATCH
