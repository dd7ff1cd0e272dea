"""The R3 loop measured (make bench-r3; BENCHMARKS.md's table and plot): for each dtype the
real vLLM serves in (float32, bfloat16) and each tiny model (as served; tie-prone, its routers'
weights x0.05), a P/D pair behind the proxy answers greedy completions, and the routing goes
through the library into the same model in transformers, replayed with `rx.replay.hf`
(tests/real/harness/r3_loop.py). Printed and plotted: the share of routers whose trainer-side
top-k equals the engine's, natively and under replay, and the sampled tokens' |Δ logprob| to
the engine's own, natively and under replay.

    python benches/r3_loop.py ENGINE_PYTHON RELEASE [--requests 20] [--tokens 48]
        [--json r3.json] [--plot BENCHMARKS-r3.png]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

HARNESS = Path(__file__).resolve().parents[1] / "tests" / "real" / "harness"
sys.path.insert(0, str(HARNESS))

from pd_stack import Stack  # noqa: E402

MODELS = {"as served": [], "tie-prone (gates x0.05)": ["--gate-scale", "0.05"]}
DTYPES = ["float32", "bfloat16"]


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['dtype']}" for r in rows]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    w = 0.38
    a.bar([i - w / 2 for i in x], [100 * (1 - r["native_agreement"]) for r in rows], w,
          label="native")
    a.bar([i + w / 2 for i in x], [100 * (1 - r["replay_agreement"]) for r in rows], w,
          label="replay")
    a.set_title("routers whose top-k differs from the engine's (%)")
    b.bar([i - w / 2 for i in x], [r["native_logprob_gap"]["mean"] for r in rows], w,
          label="native")
    b.bar([i + w / 2 for i in x], [r["replay_logprob_gap"]["mean"] for r in rows], w,
          label="replay")
    b.set_title("mean |Δ logprob| of sampled tokens vs the engine")
    for ax in (a, b):
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.legend()
    fig.suptitle("R3 loop: real vLLM (P/D, behind the proxy) -> rx -> transformers")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("python", type=Path)
    ap.add_argument("release")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json", type=Path, default=Path("r3.json"))
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    print(f"R3 loop: vLLM {args.release} (CPU build), {platform.processor() or platform.machine()}"
          f"; {args.requests} greedy requests of {args.tokens} tokens per case")
    print(f"{'model':24} {'dtype':9} {'routers':>8} {'native':>8} {'replay':>8} {'flip':>7} "
          f"{'|Δlp| native':>13} {'|Δlp| replay':>13}")
    for model, model_args in MODELS.items():
        for dtype in DTYPES:
            with tempfile.TemporaryDirectory(prefix="rx-r3-bench-") as tmp:
                stack = Stack(args.python, args.release, Path(tmp), model_args=model_args,
                              serve_args=["--dtype", dtype])  # fmt: skip
                try:
                    stack.start()
                    f = stack.r3_loop(dtype, args.requests, args.tokens, tag="bench")
                finally:
                    stack.stop()
            f["model"] = model
            rows.append(f)
            n, r = f["native_logprob_gap"], f["replay_logprob_gap"]
            print(f"{model:24} {dtype:9} {f['routers']:>8} {f['native_agreement']:8.2%} "
                  f"{f['replay_agreement']:8.2%} {f['flip_rate']:7.2%} "
                  f"{n['mean']:.4f}/{n['max']:.3f} {r['mean']:.4f}/{r['max']:.3f}", flush=True)
    args.json.write_text(json.dumps(rows, indent=1))
    if args.plot is not None:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
