"""Plot throughput against payload size from `python -m rx_bench bench --json` output
(`make bench-table`).

Usage: python benches/plot.py bench.json BENCHMARKS-throughput.png  (needs matplotlib)
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    rows = json.load(open(src))["rows"]
    ops = ["decode sidecar", "from_response", "merge_response (splice)", "encode (to_json)"]
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 3.8), sharey=True)
    for ax, op in zip(axes, ops):
        mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["nbytes"])
        x = [r["nbytes"] / 1e6 for r in mine]
        for key, label in (
            ("ours", "routed_experts"),
            ("fast", "orjson+pybase64+numpy"),
            ("stdlib", "json+base64+numpy"),
            ("memcpy", "memcpy"),
        ):
            y = [r["nbytes"] / r[key] / 1e9 if r[key] else None for r in mine]
            ax.plot(x, y, marker="o", label=label)
        ax.set_xscale("log")
        ax.set_title(op)
        ax.set_xlabel("payload MB")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s of JSON")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
