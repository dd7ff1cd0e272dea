"""The benchmarks' command, run from a clone (the harness is not in the installed package):
`PYTHONPATH=benches python -m rx_bench bench ...` (the codec's side-by-side table, `make
bench-table`) and `... bench-proxy ...` (the proxy's race beside vllm-router, `make
bench-proxy`). The flags are declared here as the package's own commands declare theirs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from routed_experts._synthetic import MODELS
from routed_experts.cli import Arg, Command, _count, _Parser, _seconds, _size, arg


def cmd_bench(args: argparse.Namespace) -> int:
    from rx_bench.codec import run, run_quality

    if args.quality:
        run_quality(args.model, args.tokens, args.repeat, sys.stdout)
        return 0
    try:
        import orjson  # noqa: F401
        import pybase64  # noqa: F401
    except ImportError:
        print(
            "rx_bench bench: the orjson+pybase64 column needs orjson and pybase64 "
            "(tests/requirements.txt; make test installs them); it shows n/a without it",
            file=sys.stderr,
        )

    run(args.model, args.tokens, args.repeat, sys.stdout, json_out=args.json)
    return 0


def cmd_bench_proxy(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401  (the pass-through baseline, run in a child process)

        from rx_bench.proxy_command import run_bench
    except ImportError as e:
        print(f"rx_bench bench-proxy needs fastapi, httpx, uvicorn, uvloop and httptools "
              f"(tests/requirements.txt; make test installs them): {e}", file=sys.stderr)
        return 2
    return run_bench(args)


COMMANDS: list[Command] = [
    Command(
        "bench",
        "side-by-side timings against the Python alternatives",
        cmd_bench,
        [
            arg(
                "--model",
                nargs="+",
                choices=sorted(MODELS),
                default=["qwen3-235b-a22b"],
                help="model geometries to measure",
            ),
            arg(
                "--tokens",
                nargs="+",
                type=_count(1),
                default=[32768],
                help="rollout lengths to measure",
            ),
            arg("--repeat", type=_count(1), default=7, help="runs per measurement (best is kept)"),
            arg("--json", help="also write the measurements to this JSON file"),
            arg(
                "--quality",
                action="store_true",
                help="measure agreement and expert_load beside numpy instead of the codec",
            ),
        ],
    ),
    Command(
        "bench-proxy",
        "bounded loopback load and fault benchmark of the proxy beside a pass-through relay",
        cmd_bench_proxy,
        [
            arg("--requests", type=_count(1), default=500, help="requests per load round"),
            arg(
                "--concurrency",
                type=_count(1),
                default=32,
                help="requests in flight in a load round",
            ),
            arg(
                "--memory-concurrency",
                type=_count(1),
                default=64,
                help="in flight in the memory rounds",
            ),
            arg("--tokens", type=_count(2), default=8192, help="rows of routing per response"),
            arg("--layers", type=_count(1), default=48, help="MoE layers"),
            arg("--top-k", type=_count(1), default=8, help="experts per token"),
            arg(
                "--bodies",
                choices=["sidecar", "vllm"],
                default="sidecar",
                help="the bodies' shape in the load, stream, memory and fault parts: compact "
                     "sidecars (decode sends zeroed prompt rows), or vLLM 0.32's P/D bodies (.npy "
                     "text; decode's rows from P - 1, the start the proxy must ask)",
            ),
            arg(
                "--routing-format",
                choices=["engine", "compact"],
                default="engine",
                help="the proxy's routing_format in the load, stream, memory and fault parts "
                     "(engine, the proxy's default: the merged routing in the engines' own "
                     "format, vLLM's .npy text for --bodies vllm; compact: a compact sidecar)",
            ),
            arg(
                "--only",
                nargs="+",
                choices=[
                    "load", "stream", "memory", "faults", "lockup", "slow", "split", "sessions",
                ],
                help="run only these parts (default: load, stream, memory, faults; lockup, slow "
                     "and split, the long-context reliability rounds, and sessions, the multi-turn "
                     "policies, run apart at their own sizes)",
            ),
            arg("--sessions", type=_count(1), default=64, help="sessions in the sessions part"),
            arg(
                "--turns",
                type=_count(1),
                default=8,
                help="turns of each session in the sessions part",
            ),
            arg(
                "--memory-budget",
                type=_size(0),
                default="128MiB",
                help="the proxy's --max-buffered-bytes in the memory rounds (what keeps 64 "
                     "requests of 8192 x 48 x 8 under 300 MB; 0 keeps ProxyConfig's)",
            ),
            arg(
                "--idle-wait",
                type=_seconds,
                default=60.0,
                help="seconds to wait after the memory rounds for the proxy to give memory back",
            ),
            arg("--json", help="also write the results to this JSON file"),
            arg(
                "--max-cpu-ratio",
                type=float,
                help="exit 1 when the proxy's CPU per request passes this many times vllm-router's "
                     "in the same run (load and stream parts; CI's regression check)",
            ),
        ],
    ),
]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rx_bench", description="routed_experts' benchmarks (from a clone).")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        for a in command.args:
            if isinstance(a, Arg):
                p.add_argument(*a.flags, **a.options)
        p.set_defaults(func=command.func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
