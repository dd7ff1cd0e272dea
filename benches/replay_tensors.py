"""The trainer's replay tensors from a rank's routing rows, side by side (make bench-replay, in
the trainer tests' environment: torch is needed for the glue):

- rx: `rx.replay.replay_ids`, what `rx.replay.megatron` and `rx.replay.hf` call: every router's
  `[tokens, top_k]` int64 ids in one pass over the rows (Rust, GIL released, split among the
  cores), checked (ids below num_experts, none twice in a row), rows without routing filled
  with distinct ids; each router's part is handed to torch without a copy.
- glue: what RL frameworks write today (written for this benchmark after verl's and SkyRL's
  router-replay utilities): the batch to an int64 tensor, permuted to `[layers, tokens, top_k]`
  and made contiguous, one view per router; no check at all.
- memcpy: writing the same int64 bytes once (numpy fill of a new array), the floor.

    python benches/replay_tensors.py [--repeat 5] [--device cuda]

Prints one line per size: the best of `--repeat` runs of each, in ms, and the ratios.

`--device D` times instead the whole way from the engine's `.npy` text to every router's ids
on device D (issue 54's goal: within 2x of decode + the pinned copy, 20x faster than before):

- rx: `rx.decode`, then `rx.replay`'s device path (`_device.ids_on`): the narrow rows pinned
  and copied once, checked and widened to int64 on the device;
- before: `rx.decode`, the int64 ids made on the host (`replay_ids`), copied from pageable
  memory (what `rx.replay.megatron(device=...)` did before);
- floor: `rx.decode` and the pinned copy of the narrow rows alone.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from routed_experts.replay import replay_ids

# (name, layers in the payload, top_k, experts, payload dtype): DEVELOPERS.md's sizes.
MODELS = [
    ("Qwen3-30B-A3B", 48, 8, 128, np.uint8),
    ("Qwen3-235B-A22B", 94, 8, 128, np.uint8),
    ("DeepSeek-V3", 58, 8, 256, np.uint8),
    ("Kimi-K2", 60, 8, 384, np.uint16),
]


def rows(tokens: int, layers: int, top_k: int, experts: int, dtype: type) -> np.ndarray:
    """Distinct ids per row, as routers pick them (a random top_k of the experts)."""
    rng = np.random.default_rng(0)
    out = np.empty((tokens, layers, top_k), dtype=dtype)
    for start in range(0, tokens, 4096):  # in slices: the argsort's floats stay small
        n = min(4096, tokens - start)
        out[start : start + n] = np.argsort(rng.random((n, layers, experts)), axis=2)[..., :top_k]
    return out


def sizes(token_counts: list[int]) -> Iterator[tuple[str, int, np.ndarray, int]]:
    """(model, tokens, the rank's rows, experts) of every size measured: each model at each
    token count, but a size past 1 GiB of int64 ids only for Qwen3-30B-A3B (the larger models
    at 128k are left out)."""
    for name, layers, top_k, experts, dtype in MODELS:
        for tokens in token_counts:
            if tokens * layers * top_k * 8 > 2**30 and name != "Qwen3-30B-A3B":
                continue
            yield name, tokens, rows(tokens, layers, top_k, experts, dtype), experts


def best(f: Callable[[], object], repeat: int) -> float:
    f()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def measure(batch: np.ndarray, experts: int, repeat: int) -> tuple[float, float, float]:
    """Best ms of rx, the glue and the memcpy, for `batch` ([tokens, layers, top_k])."""
    tokens, layers, top_k = batch.shape
    mask = np.ones(tokens, dtype=bool)
    mask[-1] = False  # the last token: engines send no row for it
    names = [f"router {i}" for i in range(layers)]

    def rx_ids() -> object:
        ids, _ = replay_ids(batch, range(layers), mask, experts, names)
        return [torch.from_numpy(ids[i]) for i in range(layers)]

    def glue() -> object:
        t = torch.from_numpy(batch.astype(np.int32)).to(torch.int64)
        t = t.permute(1, 0, 2).contiguous()
        return [t[i] for i in range(layers)]

    def memcpy() -> object:
        out = np.empty((layers, tokens, top_k), dtype=np.int64)
        out.fill(1)
        return out

    r, g, m = (best(f, repeat) for f in (rx_ids, glue, memcpy))
    return r, g, m


def measure_device(
    batch: np.ndarray, experts: int, repeat: int, device: torch.device
) -> tuple[float, float, float]:
    """Best ms from text to every router's ids on `device`: rx, before, floor."""
    import routed_experts as rx
    from routed_experts.replay import _device
    from routed_experts.replay._rows import RouterRows

    tokens, layers, top_k = batch.shape
    text = rx.encode(rx.RoutedExperts.from_array(batch, num_experts=experts), "vllm_npy")
    mask = np.ones(tokens, dtype=bool)
    mask[-1] = False
    names = [f"router {i}" for i in range(layers)]

    def done(x: object) -> object:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return x

    def rx_path() -> object:
        rows_ = rx.decode(text, start=0).to_numpy()
        described = RouterRows(rows_, range(layers), mask, experts, names)
        return done(_device.ids_on(described, device=device))

    def before() -> object:
        rows_ = rx.decode(text, start=0).to_numpy()
        ids, _ = replay_ids(rows_, range(layers), mask, experts, names)
        return done(torch.from_numpy(ids).to(device))

    def floor() -> object:
        host = torch.from_numpy(rx.decode(text, start=0).to_numpy())
        if device.type == "cuda":
            host = host.pin_memory()
        return done(host.to(device, non_blocking=True))

    return best(rx_path, repeat), best(before, repeat), best(floor, repeat)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--device", default=None, help="time text -> ids on this torch device")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.device is not None:
        device = torch.device(args.device)
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU"
        print(f"replay ids on {device} ({gpu}): {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores, torch {torch.__version__}")
        print(f"{'model':16} {'tokens':>7} {'rx ms':>8} {'before ms':>9} {'floor ms':>8} "
              f"{'before/rx':>9} {'rx/floor':>8}")
        for name, tokens, batch, experts in sizes(args.tokens):
            r, b, f = measure_device(batch, experts, args.repeat, device)
            print(f"{name:16} {tokens:>7} {r:8.2f} {b:9.2f} {f:8.2f} {b / r:8.1f}x "
                  f"{r / f:7.2f}x", flush=True)
        return
    print(f"replay tensors: {platform.processor() or platform.machine()}, {os.cpu_count()} "
          f"cores, torch {torch.__version__} ({torch.get_num_threads()} threads)")
    print(f"{'model':16} {'tokens':>7} {'rx ms':>8} {'glue ms':>8} {'memcpy ms':>9} "
          f"{'glue/rx':>8} {'rx/memcpy':>9}")
    for name, tokens, batch, experts in sizes(args.tokens):
        r, g, m = measure(batch, experts, args.repeat)
        print(f"{name:16} {tokens:>7} {r:8.1f} {g:8.1f} {m:9.1f} {g / r:7.2f}x "
              f"{r / m:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
