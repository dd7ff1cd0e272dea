"""The multi-turn benchmark of the proxy's routing policies (`routed-experts bench-proxy --only
sessions`): stand-in prefill engines that model a prefix cache (`routed-experts engine
--cache-blocks`, compute time for the prompt tokens a server has not cached, one prompt at a
time), sessions whose prompt grows every turn (each turn resends the last one and adds to it),
and, for each policy in one run on fresh engines, the prefix-cache hit rate (against the ideal:
every turn after a session's first finds the previous turn's prompt) and requests/s, beside
vllm-router's cache_aware policy on the same stand-ins."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import routed_experts as rx
from routed_experts.stand_in_engine import BLOCK, routing_of

from .proxy import Child, Round, RouterChild, _server, children, vllm_router

MODEL = "qwen3-30b-a3b"
GENERATED = 8  # tokens each turn generates


@dataclass
class Workload:
    """`sessions` sessions of `turns` turns: a first prompt of `first` tokens, `growth` more
    each turn; `servers` prefill servers of `cache_blocks` blocks each, `us_per_token` of
    compute per token missed."""

    sessions: int = 64
    turns: int = 8
    first: int = 512
    growth: int = 256
    servers: int = 4
    cache_blocks: int = 3072
    us_per_token: float = 200.0  # 5k tokens/s a prefill server: a large MoE's prefill
    decode_ms: float = 10.0

    def prompts(self) -> list[list[str]]:
        """Each session's prompts, turn by turn: ASCII text (a token is a byte), unique to the
        session from its first token."""
        rng = np.random.default_rng(11)
        letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8)
        out = []
        for s in range(self.sessions):
            text = f"session {s}: "
            turns = []
            for t in range(self.turns):
                size = (self.first if t == 0 else self.growth) - (len(text) if t == 0 else 0)
                text += rng.choice(letters, size).tobytes().decode()
                turns.append(text)
            out.append(turns)
        return out

    def ideal_cached(self, prompts: list[list[str]]) -> int:
        """Cached tokens if every turn after the first met the previous turn's blocks."""
        return sum(
            len(turns[t - 1]) // BLOCK * BLOCK for turns in prompts for t in range(1, len(turns))
        )


def _digest(rows: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(rows, dtype=np.uint8).tobytes()).hexdigest()


class EngineChild:
    """`routed-experts engine` in a process of its own; up once it prints its URL."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "routed_experts", "engine", "--port", "0", *args],
            stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if " on http://" not in line:
            self.stop()
            raise RuntimeError(f"engine {args} did not start")
        self.url = line.rsplit(" on ", 1)[1].strip()

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(self.url + "/stats", timeout=10) as f:  # noqa: S310
            return dict(json.loads(f.read()))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@contextlib.contextmanager
def _engines(w: Workload) -> Iterator[tuple[list[EngineChild], EngineChild]]:
    started: list[EngineChild] = []
    try:
        for _ in range(w.servers):
            started.append(EngineChild([
                "--role", "prefill", "--model", MODEL, "--cache-blocks", str(w.cache_blocks),
                "--prefill-us-per-token", str(w.us_per_token),
            ]))
        started.append(EngineChild(
            # vllm-router asks decode for rows from 0 (a real vLLM 0.32 decode engine dies of
            # it); this benchmark measures prefix-cache hits, so decode answers with the
            # prompt's rows zeroed, as vLLM before 0.32 did.
            ["--role", "decode", "--model", MODEL, "--decode-ms", str(w.decode_ms),
             "--uncomputed-rows", "zeros"]
        ))
        yield started[:-1], started[-1]
    finally:
        for e in started:
            e.stop()


async def _sessions(
    url: str, prompts: list[list[str]], expect: list[list[str]], timeout: float
) -> Round:
    """Every session at once, each turn after the one before; a 200 must carry routing whose
    digest is `expect`'s."""
    import aiohttp

    r = Round("sessions", sum(len(t) for t in prompts))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as client:

        async def session(s: int) -> None:
            for t, text in enumerate(prompts[s]):
                body = {"model": MODEL, "prompt": text, "max_tokens": GENERATED,
                        "session_id": f"session-{s}"}
                began = time.perf_counter()
                try:
                    async with client.post(url + "/v1/completions", json=body) as resp:
                        content, status = await resp.read(), resp.status
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    status, content = 0, b""
                r.latencies.append(time.perf_counter() - began)
                r.statuses[status] = r.statuses.get(status, 0) + 1
                if status == 200:
                    got = rx.from_response(content)
                    if got is None or _digest(got.to_numpy()) != expect[s][t]:
                        r.wrong_200 += 1

        began = time.perf_counter()
        await asyncio.gather(*(session(s) for s in range(len(prompts))))
        r.seconds = time.perf_counter() - began
    return r


def _sessions_moved(url: str) -> int:
    """Prefill picks the proxy counted as `session_moved` (a session sent off its server)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as f:  # noqa: S310 (loopback)
        text = f.read().decode()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("routed_experts_proxy_upstream_picks_total{")
        and 'choice="session_moved",side="prefill"' in line
    )


def run_sessions(args: argparse.Namespace, w: Workload | None = None) -> dict[str, Any]:
    """Each front in turn on fresh engines: the proxy with each prefill policy, then vllm-router
    (round robin and cache_aware, when installed)."""
    w = w or Workload(sessions=args.sessions, turns=args.turns)
    prompts = w.prompts()
    truth, decode_only = [], []
    for turns in prompts:
        rows = [routing_of(list(text.encode()), GENERATED, MODEL) for text in turns]
        truth.append([_digest(a) for a in rows])
        zeroed = []
        for text, a in zip(turns, rows):
            a[: len(text)] = 0  # what vllm-router relays: decode's rows, the prompt's zeroed
            zeroed.append(_digest(a))
        decode_only.append(zeroed)
    total = sum(len(t) for turns in prompts for t in turns)
    ideal = w.ideal_cached(prompts)
    fronts: list[tuple[str, dict[str, Any]]] = [
        (f"proxy {p}", {"prefill_policy": p}) for p in ("round_robin", "least_load", "session")
    ]
    if vllm_router():  # consistent_hash keys on the body's session_id, as ours does
        fronts += [(f"vllm-router {p}", {"router": p})
                   for p in ("round_robin", "cache_aware", "consistent_hash")]
    results: dict[str, Any] = {
        "workload": {**w.__dict__, "model": MODEL, "prompt_tokens": total,
                     "ideal_cached_tokens": ideal, "cpus": os.cpu_count()},
        "fronts": {},
    }
    print(
        f"sessions: {w.sessions} sessions x {w.turns} turns ({w.first} tokens, +{w.growth} a "
        f"turn), {w.servers} prefill servers of {w.cache_blocks} blocks, {w.us_per_token} us a "
        f"token missed; ideal hit rate {ideal / total:.1%}",
        flush=True,
    )
    for name, how in fronts:
        with _engines(w) as (prefills, decode), contextlib.ExitStack() as stack:
            front: Any
            if "router" in how:
                front = RouterChild(prefills, [decode], policy="round_robin",
                                    prefill_policy=how["router"])
                stack.callback(front.stop)
                expect = decode_only
            else:
                spec = _server("proxy", prefills, [decode], **how)
                (front,) = stack.enter_context(children(spec))
                expect = truth
            assert isinstance(front, Child)
            r = asyncio.run(_sessions(front.url, prompts, expect, timeout=300))
            stats = [e.stats() for e in prefills]
            moved = _sessions_moved(front.url) if "router" not in how else None
            cached = sum(s["cached_tokens"] for s in stats)
            summary = r.summary()
            summary.update(
                hit_rate=round(cached / total, 4),
                of_ideal=round(cached / ideal, 4) if ideal else 0.0,
                per_server=[s["requests"] for s in stats],
                sessions_moved=moved,
            )
            results["fronts"][name] = summary
            print(
                f"  {name:26} {summary['requests_per_s']:7.1f} req/s  hit rate "
                f"{summary['hit_rate']:.1%} ({summary['of_ideal']:.1%} of ideal)  p50 "
                f"{summary['p50_ms']} ms  p99 {summary['p99_ms']} ms  per server "
                f"{summary['per_server']}  moved {moved if moved is not None else '-'}  "
                f"statuses {summary['statuses']}  wrong 200s {summary['wrong_200']}",
                flush=True,
            )
    fronts_done = results["fronts"]
    rr = fronts_done["proxy round_robin"]["requests_per_s"]
    results["session_vs_round_robin"] = round(
        fronts_done["proxy session"]["requests_per_s"] / max(rr, 1e-9), 2
    )
    return results
