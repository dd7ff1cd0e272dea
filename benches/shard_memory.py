"""A rank's peak memory for its share of a packed batch (`rx.shard`), beside the whole batch.

Run: python benches/shard_memory.py [tokens] [cp]. Each measurement runs in a fresh process:
the batch is built, the peak resident size reset (/proc/self/clear_refs), the share taken, and
the peak growth read back, so what is reported is what taking the share cost, not the batch."""

from __future__ import annotations

import subprocess
import sys
import time


def _child(tokens: int, cp: int, how: str) -> None:
    import numpy as np

    import routed_experts as rx

    rng = np.random.default_rng(0)
    samples = 8
    n = tokens // samples // (2 * cp) * (2 * cp)
    batch = rng.integers(0, 256, size=(n * samples, 94, 8), dtype=np.int32)
    cu = np.arange(samples + 1, dtype=np.int32) * n
    batch.flags.writeable = False

    def rss_kb(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before = rss_kb("VmRSS")
    began = time.perf_counter()
    if how == "shard":
        share, _, _ = rx.shard(batch, cu, cp_size=cp, cp_rank=0)
    else:  # what a user writes with numpy: index arrays, then one fancy-indexing copy
        c = n // (2 * cp)
        idx = np.concatenate([np.r_[s:s + c, s + (2 * cp - 1) * c:s + 2 * cp * c]
                              for s in range(0, n * samples, n)])
        share = batch[idx]
    seconds = time.perf_counter() - began
    peak = rss_kb("VmHWM") - before
    print(f"{batch.nbytes / 2**20:.1f} {share.nbytes / 2**20:.1f} {peak / 1024:.1f} "
          f"{seconds * 1e3:.2f}")


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    cp = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    print(f"{tokens} x 94 x 8 int32 batch, 8 samples, cp {cp}, rank 0 (zigzag)")
    print("| how | batch MiB | share MiB | peak growth MiB | ms |")
    print("|---|---|---|---|---|")
    for how in ("shard", "numpy"):
        out = subprocess.run([sys.executable, __file__, "--child", str(tokens), str(cp), how],
                             capture_output=True, text=True, check=True).stdout.split()
        print(f"| {how} | {out[0]} | {out[1]} | {out[2]} | {out[3]} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        main()
