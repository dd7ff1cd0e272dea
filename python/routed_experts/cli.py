"""The `routed-experts` command: demo (default), inspect."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Sequence

import numpy as np

from routed_experts import RoutedExperts, RoutedExpertsError

# Model dimensions: (MoE layers, top_k, experts). Sources: the models' config.json.
MODELS: dict[str, tuple[int, int, int]] = {
    "qwen3-30b-a3b": (48, 8, 128),
    "qwen3-235b-a22b": (94, 8, 128),
    "deepseek-v3": (58, 8, 256),
    "kimi-k2": (60, 8, 384),
}


def synthetic_rollout(
    model: str, num_tokens: int, *, start: int = 0, seed: int = 0
) -> RoutedExperts:
    """A realistic routing record: per token and layer, `top_k` distinct expert ids."""
    layers, top_k, experts = MODELS[model]
    rng = np.random.default_rng(seed)
    ids = np.empty((num_tokens, layers, top_k), dtype=np.int64)
    chunk = 1024  # bound the temporary (chunk x layers x experts) score array
    for lo in range(0, num_tokens, chunk):
        scores = rng.random((min(chunk, num_tokens - lo), layers, experts), dtype=np.float32)
        ids[lo : lo + chunk] = np.argpartition(scores, top_k, axis=-1)[..., :top_k]
    return RoutedExperts.from_array(ids, start=start, num_experts=experts)


def _best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def cmd_demo(args: argparse.Namespace) -> int:
    p = synthetic_rollout(args.model, args.tokens)
    layers, top_k, experts = MODELS[args.model]
    print(
        f"rollout: {args.model} ({layers} MoE layers, top_k {top_k}, {experts} experts), "
        f"{p.num_tokens} tokens -> {p!r}, {p.nbytes / 1e6:.2f} MB decoded"
    )
    wire = p.to_json()
    back = RoutedExperts.from_json(wire)
    if back != p or not np.array_equal(back.array, p.array):
        print("FAILED: decode(encode(p)) != p", file=sys.stderr)
        return 1
    t_enc = _best_of(p.to_json)
    t_dec = _best_of(lambda: RoutedExperts.from_json(wire))
    mb = len(wire) / 1e6
    print(f"encode: {mb:.2f} MB sidecar in {t_enc * 1e3:.2f} ms ({mb / t_enc / 1e3:.2f} GB/s)")
    print(f"decode: {mb:.2f} MB sidecar in {t_dec * 1e3:.2f} ms ({mb / t_dec / 1e3:.2f} GB/s)")
    print("verified: decode(encode(rollout)) == rollout, array read-only and zero-copy")
    return 0


def _read_input(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    with open(path, "rb") as f:
        return f.read()


def cmd_inspect(args: argparse.Namespace) -> int:
    p = RoutedExperts.from_json(_read_input(args.file))
    print(f"format: compact sidecar")
    print(f"shape: {p.shape} (tokens, layers, top_k)")
    print(f"dtype: {p.dtype}")
    print(f"positions: [{p.start}, {p.stop})")
    print(f"size: {p.nbytes} bytes decoded")
    if p.num_tokens:
        arr = p.array
        print(f"values: min {int(arr.min())}, max {int(arr.max())}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="routed-experts", description="MoE routed-experts payload tools."
    )
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="encode, decode and verify a synthetic rollout (default)")
    demo.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    demo.add_argument("--tokens", type=int, default=4096)
    demo.set_defaults(func=cmd_demo)
    inspect = sub.add_parser("inspect", help="print a payload's shape, dtype, positions, size")
    inspect.add_argument("file", help="a file, or - for standard input")
    inspect.set_defaults(func=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["demo", *(argv or [])])
    try:
        return int(args.func(args))
    except (RoutedExpertsError, OSError) as e:
        print(f"routed-experts: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
