"""`routed-experts bench-proxy`, the command: the parts the flags ask for (`proxy.py`'s load,
stream, memory and fault rounds; `reliability.py`'s long-context rounds; `sessions.py`'s
multi-turn rounds), their tables printed, and the exit status of a bound (`--max-cpu-ratio`)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from .proxy import (
    _VLLM_ROUTER_HINT,
    Bodies,
    bench_faults,
    bench_load,
    bench_memory,
)


def run_bench(args: argparse.Namespace) -> int:
    parts = args.only or ["load", "stream", "memory", "faults"]
    if "sessions" in parts:  # its own engines and sizes
        if len(parts) > 1:
            raise SystemExit("bench-proxy: run sessions apart from the other parts")
        from .sessions import run_sessions

        sessions = run_sessions(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(sessions, f, indent=1)
        return 1 if any(f["wrong_200"] for f in sessions["fronts"].values()) else 0
    reliability = [p for p in parts if p in RELIABILITY_PARTS]
    if reliability and len(reliability) == len(parts):  # at their own sizes (reliability.py)
        from .reliability import run_reliability

        rounds = run_reliability(args, reliability)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rounds, f, indent=1)
        return 0 if _reliable(rounds) else 1
    if reliability:
        raise SystemExit("bench-proxy: run lockup, slow and split apart from the other parts")
    keep_format = args.routing_format == "engine"
    bodies = Bodies.make(args.tokens, args.layers, args.top_k, args.bodies, keep_format=keep_format)
    results: dict[str, Any] = {
        "shape": [args.tokens, args.layers, args.top_k],
        "bodies": args.bodies,
        "routing_format": args.routing_format,
        "request_bytes": len(bodies.request),
        "prefill_bytes": len(bodies.prefill),
        "decode_bytes": len(bodies.decode),
        "merged_bytes": len(bodies.merged),
        "requests": args.requests,
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
    }
    print(
        f"bench-proxy: {args.tokens} x {args.layers} x {args.top_k}, {args.bodies} bodies "
        f"(the proxy answers {args.routing_format}); "
        "prefill body "
        f"{len(bodies.prefill) / 1e6:.1f} MB, decode {len(bodies.decode) / 1e6:.1f} MB, merged "
        f"{len(bodies.merged) / 1e6:.1f} MB; {args.requests} requests, {args.concurrency} in "
        "flight",
        flush=True,
    )
    if "load" in parts:
        results["load"] = bench_load(args, bodies, stream=False)
        _print_load("plain", results["load"])
    if "stream" in parts:
        results["stream"] = bench_load(args, bodies, stream=True)
        _print_load("stream", results["stream"])
    if "memory" in parts:
        results["memory"] = bench_memory(args, bodies)
        _print_memory(results["memory"], args.memory_concurrency)
    if "faults" in parts:
        results["faults"] = bench_faults(args, bodies)
        _print_faults(results["faults"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    wrong = sum(
        r.get("wrong_200", 0)
        for part in ("load", "stream")
        for r in [results.get(part, {}).get("proxy", {})]
    ) + sum(r["wrong_200"] for r in results.get("faults", {}).values())
    if wrong:
        print(f"bench-proxy: {wrong} responses were 200 with wrong routing", flush=True)
        return 1
    return 0 if _within_cpu_ratio(results, getattr(args, "max_cpu_ratio", None)) else 1


def _within_cpu_ratio(results: dict[str, Any], bound: float | None) -> bool:
    """With a bound: the proxy's CPU per request, over vllm-router's in the same run, is at
    most `bound` in every load part that ran (a regression a benchmark could catch is caught
    here, not in a timed test). vllm-router must have run."""
    if bound is None:
        return True
    ok = True
    for part in ("load", "stream"):
        if part not in results:
            continue
        ratio = results[part].get("vs_vllm_router", {}).get("cpu_per_request")
        if ratio is None:
            print(f"bench-proxy: {part}: no vllm-router figure to hold the proxy to", flush=True)
            ok = False
            continue
        verdict = "within" if ratio <= bound else "OVER"
        print(f"bench-proxy: {part}: CPU per request {ratio}x vllm-router's, {verdict} the "
              f"bound of {bound}x", flush=True)
        ok &= ratio <= bound
    return ok


RELIABILITY_PARTS = ("lockup", "slow", "split")


def _reliable(results: dict[str, Any]) -> bool:
    """No wrong 200, no stream left hanging, the budget empty after, memory within its bound."""
    ok = True
    for r in results.get("lockup", []):
        s = r["proxy"]
        ok &= "wrong" not in s["outcomes"] and "0" not in s["outcomes"]
        ok &= s["after"] == {"buffered_bytes": 0, "in_flight": 0} and s["after_ok"]
        ok &= s["within_bound"] and s["small_not_ok"] == 0
    for s in results.get("slow", {}).values():
        if isinstance(s, dict) and "within_bound" in s:
            ok &= s["within_bound"] and s["after"]["buffered_bytes"] == 0
    if not ok:
        print("bench-proxy: a reliability check failed (see above)", flush=True)
    return bool(ok)


def _print_load(title: str, r: dict[str, Any]) -> None:
    pinned = "each front on a core of its own" if r.get("pinned") else "nothing pinned"
    print(f"\n{title} ({pinned}; the proxy and vllm-router send {r['bytes_out']['proxy']} and "
          f"{r['bytes_out']['vllm-router']} bytes a reply): requests/s, the front's CPU per "
          "request (the load client's), its core kept busy, latency p50/p99, statuses")
    if "vllm-router" not in r:
        print(f"  (vllm-router not installed: {_VLLM_ROUTER_HINT})")
    for kind in ("passthrough", "vllm-router", "proxy", "floor"):
        if kind not in r:
            continue
        s = r[kind]
        print(
            f"  {kind:12} {s['requests_per_s']:7.1f} req/s  {s['cpu_ms_per_request']:6.2f} ms CPU"
            f" ({s['client_cpu_ms_per_request']:.2f})  busy {s['busy']:.2f}"
            f"  p50 {s['p50_ms']:7.1f} ms  p99 {s['p99_ms']:7.1f} ms  {s['statuses']}"
            f"  wrong 200s: {s['wrong_200']}"
        )
    print(f"  proxy / pass-through requests/s: {r['ratio_requests_per_s']}x; proxy / no-merge "
          f"floor CPU per request: {r['vs_floor']}x", flush=True)
    if "vs_vllm_router" in r:
        v = r["vs_vllm_router"]
        print(
            f"  proxy / vllm-router: CPU per request {v['cpu_per_request']}x, requests/s "
            f"{v['requests_per_s']}x, p99 {v['p99']}x",
            flush=True,
        )


def _print_memory(r: dict[str, Any], concurrency: int) -> None:
    budget = r["max_buffered_bytes"]
    budget = f"{budget / 2**20:g} MiB" if isinstance(budget, int) else budget
    print(f"\nmemory at {concurrency} in flight, --max-buffered-bytes {budget} "
          f"(idle RSS {r['idle_rss_mb']} MB)")
    for s in r["rounds"]:
        print(
            f"  {s['name']}: RSS {s['rss_mb']} MB, peak {s['peak_rss_mb']} MB, "
            f"{s['requests_per_s']} req/s, {s['statuses']}"
        )
    idle = r["after_idle"]
    print(f"  idle: RSS {idle['rss_mb']} MB after {idle['after_s']} s")


def _print_faults(r: dict[str, Any]) -> None:
    print("\nfaults: statuses, success on the healthy servers, ejected, 200s with wrong routing")
    for name, s in r.items():
        healthy = s.get("ok_of_healthy_pct", "-")
        print(
            f"  {name:22} {s['statuses']}  ok {s['ok']}/{s['requests']}  ok of healthy "
            f"{healthy}%  ejected {s['ejected'] or '-'} (/health {s['health_status']})  "
            f"wrong 200s: {s['wrong_200']}",
            flush=True,
        )
