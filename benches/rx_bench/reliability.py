"""`routed-experts bench-proxy --only lockup slow split`: the proxy under long-context load,
beside vllm-router on the same stand-in engines (loopback only, every round bounded).

- lockup: more concurrent streams of large routing events than the body budget holds, clients
  reading at full speed; each stream must end merged or with a clean error within its deadline,
  small requests sent meanwhile must be served, and afterwards the budget must read 0.
- slow: clients reading 16 KiB/s from large replies, plain and streamed; the proxy's resident
  memory must stay within the bound docs/proxy.md states (idle + budget + a constant a connection).
- split: a stream whose routing event comes one byte per HTTP chunk; the memory it costs beside
  the same event in one piece.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .proxy import (
    SMALL_MARK,
    Bodies,
    Child,
    RouterChild,
    _get,
    children,
    engine_spec,
    vllm_router,
)
from .proxy import _server as server_spec

# Memory a client connection may cost beyond the bodies the budget counts: hyper's read and
# write buffers on both the client's and the upstream's connection (each at most ~400 KiB).
PER_CONNECTION_MB = 2.0


@contextmanager
def _running(kind: str, prefill: Child, decode: Child, **settings: Any) -> Iterator[Child]:
    if kind == "vllm-router":
        router = RouterChild([prefill], [decode])
        try:
            yield router
        finally:
            router.stop()
    else:
        with children(server_spec("proxy", [prefill], [decode], **settings)) as (proxy,):
            yield proxy


class _Peak:
    """The child's resident memory, sampled every 50 ms on a thread (its VmHWM counts the
    whole life of the process; this counts one round)."""

    def __init__(self, child: Child) -> None:
        self.child, self.peak_mb, self._stop = child, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_mb = max(self.peak_mb, self.child.memory_mb()[0])
            except (OSError, KeyError):
                return
            time.sleep(0.05)

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _health(url: str) -> dict[str, Any]:
    return dict(_get(url + "/health")[1])


def _outcome(status: int, content: bytes, expect: bytes) -> str:
    """What a stream's client got: merged (exactly the expected bytes), an error event, a
    status, or wrong (a 200 that is neither: never acceptable)."""
    if status != 200:
        return str(status)
    if content == expect:
        return "merged"
    events = [e for e in content.split(b"\n\n") if e.startswith(b"data: ")]
    if events and b'"error"' in events[-1] and events[-1] != b"data: [DONE]":
        return "error event"
    return "wrong"


async def _post(session: Any, url: str, body: bytes) -> tuple[int, bytes]:
    import aiohttp

    try:
        async with session.post(
            url + "/v1/completions", data=body, headers={"content-type": "application/json"}
        ) as resp:
            return resp.status, await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return 0, b""  # no answer within the client's timeout


def _probe_main(url: str, small: bytes, small_expect: bytes | None, stop: Any, out: Any) -> None:
    """A small request every 0.1 s until `stop` is set, from a process of its own (so its
    timing is the server's, not that of a client loop busy reading large streams)."""
    import urllib.error
    import urllib.request

    ms: list[float] = []
    bad = 0
    while not ms or not stop.is_set():  # one at least, however short the load
        req = urllib.request.Request(url + "/v1/completions", data=small,
                                     headers={"content-type": "application/json"})
        began = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=60) as f:  # noqa: S310 (loopback)
                status, content = f.status, f.read()
        except urllib.error.HTTPError as e:
            status, content = e.code, e.read()
        except OSError:
            status, content = 0, b""
        ms.append((time.perf_counter() - began) * 1e3)
        bad += status != 200 or (small_expect is not None and content != small_expect)
        stop.wait(0.1)
    out.put((ms, bad))


async def _lockup_load(
    url: str, big: bytes, expect: bytes, small: bytes, small_expect: bytes | None,
    streams: int, timeout: float,
) -> dict[str, Any]:
    import multiprocessing

    import aiohttp

    outcomes: dict[str, int] = {}
    seconds: list[float] = []
    spawn = multiprocessing.get_context("spawn")
    stop, results = spawn.Event(), spawn.Queue()
    prober = spawn.Process(target=_probe_main, args=(url, small, small_expect, stop, results))
    prober.start()
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=timeout),
    ) as session:

        async def stream() -> None:
            began = time.perf_counter()
            status, content = await _post(session, url, big)
            seconds.append(time.perf_counter() - began)
            o = _outcome(status, content, expect)
            outcomes[o] = outcomes.get(o, 0) + 1

        began = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(streams)))
        wall = time.perf_counter() - began
    stop.set()
    small_ms, small_bad = results.get(timeout=120)
    prober.join()
    small_ms.sort()
    return {
        "outcomes": outcomes,
        "wall_s": round(wall, 1),
        "slowest_s": round(max(seconds), 1),
        "small_requests": len(small_ms),
        "small_not_ok": small_bad,
        "small_p50_ms": round(small_ms[len(small_ms) // 2], 1) if small_ms else None,
        "small_max_ms": round(small_ms[-1], 1) if small_ms else None,
    }


def bench_lockup(
    streams: int, tokens: int, budget: int | None, layers: int = 94, top_k: int = 8,
    timeout: float = 120.0, kinds: tuple[str, ...] = ("vllm-router", "proxy"),
    shape: str = "sidecar", generated: int | None = None, routing_format: str = "compact",
) -> dict[str, Any]:
    """`streams` concurrent streamed requests of rollouts of `tokens` rows, against the proxy
    (budget `budget`, None for its default; answering `routing_format`) and vllm-router on the
    same engines. Bodies of `shape` "sidecar": decode's event holds every row (data first:
    merged whole); "vllm": vLLM's `.npy`, decode's event the `generated` rows (merged as it
    passes when long, also as `.npy` text with `routing_format` "engine")."""
    keep = routing_format == "engine"
    bodies = Bodies.make(tokens, layers, top_k, shape, generated, keep_format=keep)
    small_bodies = Bodies.make(8, layers, top_k, shape, keep_format=keep)
    big = bodies.request[:-1] + b',"stream":true}'
    small = small_bodies.request[:-1] + b"," + SMALL_MARK + b"}"
    event = max(len(e) for e in bodies.stream.split(b"\n\n"))
    out: dict[str, Any] = {
        "streams": streams, "shape": [tokens, layers, top_k], "bodies": shape,
        "event_mib": round(event / 2**20, 1),
        "budget_mib": round(budget / 2**20) if budget else "default",
        "routing_format": routing_format,
    }
    settings: dict[str, Any] = {"routing_format": routing_format}
    if budget:
        settings["max_buffered_bytes"] = budget
    with children(
        engine_spec("prefill", tokens, layers, top_k, None, shape, generated),
        engine_spec("decode", tokens, layers, top_k, None, shape, generated),
    ) as (p, d):
        for kind in kinds:
            if kind == "vllm-router" and not vllm_router():
                continue
            with _running(kind, p, d, max_in_flight=4 * streams, **settings) as server:
                idle = server.memory_mb()[0]
                expect = bodies.merged_stream if kind == "proxy" else bodies.stream
                small_expect = small_bodies.merged if kind == "proxy" else None
                with _Peak(server) as peak:
                    r = asyncio.run(_lockup_load(
                        server.url, big, expect, small, small_expect, streams, timeout))
                r["idle_rss_mb"], r["peak_rss_mb"] = round(idle), round(peak.peak_mb)
                if kind == "proxy":  # after the load: nothing held, and it serves again
                    h = _health(server.url)
                    r["after"] = {"buffered_bytes": h["buffered_bytes"],
                                  "in_flight": h["in_flight"]}
                    bound = idle + h["buffered_limit"] / 2**20 + PER_CONNECTION_MB * (streams + 1)
                    r["bound_mb"], r["within_bound"] = round(bound), peak.peak_mb <= bound
                again = asyncio.run(_lockup_load(
                    server.url, big, expect, small, small_expect, 1, timeout))
                r["after_ok"] = again["outcomes"] == {"merged": 1} and not again["small_not_ok"]
                out[kind] = r
    return out


async def _slow_reader(
    host: str, port: int, request: bytes, rate: int, seconds: float, rcvbuf: int | None
) -> int:
    """A client that sends `request` and reads `rate` bytes a second for `seconds` (with a
    receive buffer of `rcvbuf` bytes, when given, instead of the system's)."""
    import socket

    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    reader, writer = await asyncio.open_connection(sock=sock)
    got = 0
    try:
        writer.write(request)
        await writer.drain()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            left = max(end - time.monotonic(), 0.01)
            chunk = await asyncio.wait_for(reader.read(rate), timeout=left)
            if not chunk:
                break
            got += len(chunk)
            await asyncio.sleep(1.0)
    except (asyncio.TimeoutError, OSError):
        pass
    finally:
        writer.close()
    return got


async def _slow_load(
    host: str, port: int, request: bytes, rate: int, seconds: float, rcvbuf: int | None,
    clients: int,
) -> list[int]:
    return await asyncio.gather(*(
        _slow_reader(host, port, request, rate, seconds, rcvbuf) for _ in range(clients)))


def bench_slow(
    clients: int, tokens: int, budget: int, rate: int = 16 * 1024, seconds: float = 20.0,
    layers: int = 94, top_k: int = 8, rcvbuf: int | None = None,
) -> dict[str, Any]:
    """`clients` reading `rate` bytes a second from replies of `tokens` rows, plain and
    streamed, for `seconds`: the proxy's peak resident memory against its stated bound."""
    bodies = Bodies.make(tokens, layers, top_k)
    out: dict[str, Any] = {
        "clients": clients, "shape": [tokens, layers, top_k],
        "reply_mib": round(len(bodies.decode) / 2**20, 1), "budget_mib": round(budget / 2**20),
        "rate_kib_s": rate // 1024,
    }
    with children(
        engine_spec("prefill", tokens, layers, top_k), engine_spec("decode", tokens, layers, top_k)
    ) as (p, d):
        for stream in (False, True):
            body = bodies.request[:-1] + (b',"stream":true}' if stream else b"}")
            with _running("proxy", p, d, max_buffered_bytes=budget) as proxy:
                host, port = proxy.url.rsplit("/", 1)[1].split(":")
                request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                           b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                idle = proxy.memory_mb()[0]
                held = [0]

                def watch(stop: threading.Event, held: list[int] = held) -> None:
                    while not stop.is_set():
                        held[0] = max(held[0], _health(proxy.url)["buffered_bytes"])
                        time.sleep(0.2)

                stop = threading.Event()
                watcher = threading.Thread(target=watch, args=(stop,), daemon=True)
                with _Peak(proxy) as peak:
                    watcher.start()

                    asyncio.run(_slow_load(host, int(port), request, rate, seconds, rcvbuf,
                                           clients))
                    stop.set()
                    watcher.join()
                bound = idle + budget / 2**20 + PER_CONNECTION_MB * clients
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    h = _health(proxy.url)
                    if h["buffered_bytes"] == 0 and h["in_flight"] == 0:
                        break
                    time.sleep(0.2)
                time.sleep(3)  # the memory of the burst is given back within a few seconds
                out["stream" if stream else "plain"] = {
                    "idle_rss_mb": round(idle), "peak_rss_mb": round(peak.peak_mb),
                    "bound_mb": round(bound), "within_bound": peak.peak_mb <= bound,
                    "peak_buffered_mib": round(held[0] / 2**20, 1),
                    "after": {"buffered_bytes": h["buffered_bytes"], "in_flight": h["in_flight"],
                              "rss_mb": round(proxy.memory_mb()[0])},
                }
    return out


def bench_split(tokens: int, layers: int = 94, top_k: int = 8) -> dict[str, Any]:
    """One stream whose routing event comes in one piece, then one whose event comes a byte
    per HTTP chunk, each through a fresh proxy: the resident memory each adds."""
    bodies = Bodies.make(tokens, layers, top_k)
    body = bodies.request[:-1] + b',"stream":true}'
    event = max(len(e) for e in bodies.stream.split(b"\n\n"))
    out: dict[str, Any] = {"shape": [tokens, layers, top_k], "event_mib": round(event / 2**20, 2),
                           "prefill_body_mib": round(len(bodies.prefill) / 2**20, 2)}
    for fault in (None, "byte_split"):
        with children(
            engine_spec("prefill", tokens, layers, top_k),
            engine_spec("decode", tokens, layers, top_k, fault),
        ) as (p, d), _running("proxy", p, d) as proxy:
            idle = proxy.memory_mb()[0]
            began = time.perf_counter()
            with _Peak(proxy) as peak:
                r = asyncio.run(_lockup_load(proxy.url, body, bodies.merged_stream, body,
                                             bodies.merged_stream, 1, 300.0))
            out["byte_split" if fault else "one_piece"] = {
                "outcomes": r["outcomes"], "seconds": round(time.perf_counter() - began, 1),
                "added_rss_mib": round(max(peak.peak_mb, proxy.memory_mb()[1]) - idle, 1),
            }
    one, split = out["one_piece"]["added_rss_mib"], out["byte_split"]["added_rss_mib"]
    out["split_minus_one_piece_mib"] = round(split - one, 1)
    out["split_extra_per_event_byte"] = round((split - one) / out["event_mib"], 2)
    return out


def run_reliability(args: argparse.Namespace, parts: list[str]) -> dict[str, Any]:
    """The parts asked for, at the sizes the audit used (a 64k-token Qwen3-235B stream)."""
    results: dict[str, Any] = {}
    if "lockup" in parts:
        results["lockup"] = [
            bench_lockup(32, 65536, None),  # 32 x 64 MiB events at the default budget
            # The same as vLLM sends it: .npy, a 1024-token prompt, decode's event the rest.
            bench_lockup(32, 65536, None, shape="vllm", generated=65536 - 1024),
            # The same, answered in vLLM's own format (`.npy` text, merged as it passes).
            bench_lockup(32, 65536, None, shape="vllm", generated=65536 - 1024,
                         routing_format="engine", kinds=("proxy",)),
            bench_lockup(24, 16384, 128 << 20),  # 24 x 16 MiB at a 128 MiB budget
        ]
        for r in results["lockup"]:
            _print_lockup(r)
    if "slow" in parts:
        results["slow"] = bench_slow(24, 16384, 128 << 20)
        _print_slow(results["slow"])
    if "split" in parts:
        results["split"] = bench_split(4096)
        _print_split(results["split"])
    return results


def _print_lockup(r: dict[str, Any]) -> None:
    print(f"\nlockup: {r['streams']} streams of {r['event_mib']} MiB routing events "
          f"({r['bodies']}, the proxy answering {r['routing_format']}), budget "
          f"{r['budget_mib']} MiB: outcomes, wall, small requests meanwhile, RSS", flush=True)
    for kind in ("vllm-router", "proxy"):
        if kind not in r:
            continue
        s = r[kind]
        after = s.get("after", "")
        print(f"  {kind:12} {s['outcomes']}  wall {s['wall_s']} s (slowest {s['slowest_s']} s)  "
              f"small: {s['small_requests']} sent, {s['small_not_ok']} not ok, p50 "
              f"{s['small_p50_ms']} ms, max {s['small_max_ms']} ms  RSS {s['idle_rss_mb']} -> "
              f"{s['peak_rss_mb']} MB{_bound(s)}  after: {after} served again: {s['after_ok']}",
              flush=True)


def _bound(s: dict[str, Any]) -> str:
    if "bound_mb" not in s:
        return ""
    return f" (bound {s['bound_mb']} MB: {'within' if s['within_bound'] else 'PAST IT'})"


def _print_slow(r: dict[str, Any]) -> None:
    print(f"\nslow readers: {r['clients']} clients at {r['rate_kib_s']} KiB/s from "
          f"{r['reply_mib']} MiB replies, budget {r['budget_mib']} MiB", flush=True)
    for kind in ("plain", "stream"):
        s = r[kind]
        print(f"  {kind:7} RSS {s['idle_rss_mb']} -> peak {s['peak_rss_mb']} MB (bound "
              f"{s['bound_mb']} MB: {'within' if s['within_bound'] else 'PAST IT'}), budget "
              f"peak {s['peak_buffered_mib']} MiB; after: {s['after']}", flush=True)


def _print_split(r: dict[str, Any]) -> None:
    print(f"\nsplit: a {r['event_mib']} MiB routing event (prefill body "
          f"{r['prefill_body_mib']} MiB), in one piece and a byte per HTTP chunk", flush=True)
    for kind in ("one_piece", "byte_split"):
        s = r[kind]
        print(f"  {kind:10} {s['outcomes']}  {s['seconds']} s  RSS +{s['added_rss_mib']} MiB",
              flush=True)
    print(f"  the split costs {r['split_minus_one_piece_mib']} MiB more "
          f"({r['split_extra_per_event_byte']}x the event)", flush=True)
