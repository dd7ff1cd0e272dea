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

    short = {"float32": "fp32", "bfloat16": "bf16"}
    names = {"as served": "served", "tie-prone (gates x0.05)": "tie-prone"}
    labels = [f"{names.get(r['model'], r['model'])}\n{short.get(r['dtype'], r['dtype'])}"
              for r in rows]  # fmt: skip
    x = list(range(len(rows)))
    w = 0.38
    panels = [
        ("routers whose top-k differs\nfrom the engine's (%)",
         lambda r, k: 100 * (1 - r[f"{k}_agreement"])),
        ("mean |Δ logprob| of sampled\ntokens vs the engine's",
         lambda r, k: r[f"{k}_logprob_gap"]["mean"]),
        ("max |Δ logprob| of sampled\ntokens vs the engine's",
         lambda r, k: r[f"{k}_logprob_gap"]["max"]),
    ]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 4))
    for ax, (title, value) in zip(axes, panels):
        for shift, kind in ((-w / 2, "native"), (w / 2, "replay")):
            ax.bar([i + shift for i in x], [value(r, kind) for r in rows], w, label=kind)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(x, labels, fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle("R3 loop: real vLLM (P/D behind the proxy) -> rx -> transformers "
                 "(served: as made; tie-prone: routers x0.05)", fontsize=10)  # fmt: skip
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
    ap.add_argument("--replot", action="store_true", help="only plot --json's figures again")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(args.json.read_text()), args.plot or Path("BENCHMARKS-r3.png"))
        return
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
