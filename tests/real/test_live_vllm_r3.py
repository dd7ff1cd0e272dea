"""The R3 loop closed, live (`make test-engines`, which CI runs): a real vLLM serves the tiny
MoE model in bfloat16, in prefill/decode behind the proxy; the merged routing goes through the
library into the same model in transformers, bfloat16, replayed with `rx.replay.hf`
(tests/real/harness/r3_loop.py, in the engine's environment).

The model is the tie-prone variant (its routers' weights scaled by 0.05: logits close
together), so the engine's bfloat16 kernels and transformers' round some picks apart: the
trainer routing on its own disagrees with the engine on some routers, and the test fails if
replay does nothing. Asserted: replay hands every router the engine routed exactly the
engine's ids; native routing agrees on fewer; the sampled tokens' log-prob gap to the engine's
own is smaller with replay; `replay.stats()` counted flips.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parent / "harness"
sys.path.insert(0, str(HARNESS))

from pd_stack import Stack  # noqa: E402

PYTHON = Path(os.environ["RX_VLLM_PYTHON"])
RELEASE = os.environ["RX_VLLM_RELEASE"]
TIE_PRONE = ["--gate-scale", "0.05"]
BF16 = ["--dtype", "bfloat16"]
# vLLM's CPU kernels run bfloat16 with AVX-512 BF16 (engine.py): a CPU without it cannot serve
# this model as asked (CI's machines have it).
HAS_BF16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()


@pytest.fixture(scope="module")
def bf16_stack() -> Iterator[tuple[Stack, Path]]:
    if not HAS_BF16:
        pytest.skip("this CPU has no AVX-512 BF16: vLLM's CPU build cannot serve bfloat16 here")
    with tempfile.TemporaryDirectory(prefix="rx-r3-") as tmp:
        s = Stack(PYTHON, RELEASE, Path(tmp), model_args=TIE_PRONE, serve_args=BF16)
        try:
            s.start()
            yield s, Path(tmp)
        finally:
            s.stop()


def test_replay_closes_the_loop_in_bfloat16(bf16_stack: tuple[Stack, Path]) -> None:
    stack, _ = bf16_stack
    # 24 sequences of 48 sampled tokens: some 40 routers flip (16 sequences flipped 23 to 39
    # of about 7,000 here), enough that the log-prob gaps differ by more than one flip's luck.
    f = stack.r3_loop("bfloat16", count=24, tokens=48)
    print(f"\nR3 loop, bfloat16, tie-prone model: {json.dumps(f)}")
    # Every router the engine routed is handed exactly the engine's ids...
    assert f["replay_agree"] == f["routers"] > 0, f
    # ...where the trainer on its own routes some differently (so this fails if replay does
    # nothing), and the flip counter saw them.
    assert f["native_agree"] < f["routers"], f
    assert f["flipped"] > 0 and f["filled"] == 3 * len(f["sequences"]), f
    # The log-probs of the sampled tokens come closer to the engine's own.
    assert f["replay_logprob_gap"]["mean"] < f["native_logprob_gap"]["mean"], f
    assert stack.prefill.alive() and stack.decode.alive(), stack.logs()
