"""`routed-experts bench-proxy`: a bounded loopback load and fault benchmark of the P/D proxy,
side by side with a plain pass-through relay (FastAPI + httpx, as vLLM's example disaggregated
proxy is: it forwards the decode reply without merging) on the same stand-in engines.

Every process is local: stand-in engines (a few lines of uvloop + httptools serving prebuilt
vLLM-shaped bodies, so they cost little CPU), the proxy under test, and this process as the load
generator. The proxy's CPU time is read from /proc (Linux) before and after each round. Every
request is bounded (count and time), and every 200 the proxy returns is checked byte for byte
against the merge it must produce: a 200 with wrong or missing routing is counted, not hidden.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Union, cast

import routed_experts as rx
from routed_experts.stand_in_engine import VllmAnswers
from rx_bench import load_client

# What a 200 must carry: exactly these bytes, or what the check accepts; None: anything.
Expect = Union[bytes, Callable[[Union[bytes, bytearray]], bool], None]
_VLLM_ROUTER_HINT = ("pip install vllm-router (tests/requirements.txt; make test installs it) adds "
                     "it as a column")

GENERATED = 512  # tokens each request generates (the last one has no row)
# The bodies' shapes: "sidecar", the compact sidecar, decode sending the whole sequence with
# zeroed prompt rows; "vllm", as vLLM 0.32 sends them in P/D (`.npy` text, prefill rows [0, P),
# decode rows [P - 1, P + G - 1) when asked from P - 1, the start the proxy asks).
BODY_SHAPES = ("sidecar", "vllm")


# --- the bodies the stand-in engines serve ------------------------------------------------------


@dataclass
class Bodies:
    """One request's prebuilt traffic: a vLLM-shaped prefill body (rows [0, P)), a decode body
    (`shape` "sidecar": the full sequence with zeroed prompt rows, as a decode server that did
    not compute the prompt sends; "vllm": vLLM 0.32's `.npy` rows from P - 1), its stream form
    (the routing on the last event), the client's request, and the merge the proxy must
    return. `decode_start`: the start decode must be asked for (None: any)."""

    request: bytes
    prefill: bytes
    decode: bytes
    stream: bytes
    merged: bytes
    merged_stream: bytes
    decode_start: int | None = None
    # Decode's answer asked from 0 by an engine that zeroes the rows it did not compute (vLLM
    # before 0.32): every row [0, P + G - 1), so a router relaying it sends the client the
    # bytes the proxy's merge sends (the fair race's decode for vllm-router).
    decode_full: bytes = b""
    stream_full: bytes = b""

    @classmethod
    def make(
        cls, tokens: int, layers: int, top_k: int, shape: str = "sidecar",
        generated: int | None = None, keep_format: bool = False,
    ) -> Bodies:
        """`generated`: tokens decode generates (default GENERATED, at most tokens - 1); the
        prompt is the rest. The bodies are the stand-in engine's answers (`VllmAnswers`, the
        one every test engine serves), so the bench's engines send what the tests' do.
        `keep_format`: the merge the proxy returns with `routing_format` "engine" (the engines'
        own format) instead of a compact sidecar."""
        if shape not in BODY_SHAPES:
            raise ValueError(f"bench-proxy: bodies must be one of {BODY_SHAPES}, not {shape!r}")
        generated = min(generated or GENERATED, tokens - 1)
        prompt = tokens - generated + 1  # rows: prompt + generated - 1 = tokens
        model, fmt = (layers, top_k, 128), ("vllm_npy" if shape == "vllm" else "compact")
        path, asked = "/v1/completions", {"model": "moe", "prompt": list(range(prompt)),
                                          "max_tokens": generated}
        # Prefill: rows [0, P). Decode: "vllm" asked from P - 1, as the proxy asks (vLLM 0.32
        # answers those rows); "sidecar" asked from 0 by an engine that answers rows it did not
        # compute zeroed. Both stream the routing on the finishing event.
        prefill = VllmAnswers("prefill", model, routing_format=fmt, engine_id="bench-prefill")
        decode = VllmAnswers("decode", model, routing_format=fmt, stream_routing=True,
                             uncomputed_rows="error" if shape == "vllm" else "zeros")
        kv = {"do_remote_decode": True}
        prefill_doc = _answered(prefill, path, {**asked, "max_tokens": 1, "kv_transfer_params": kv})
        decode_start = prompt - 1 if shape == "vllm" else None
        asked_decode = {**asked, "kv_transfer_params": prefill_doc["kv_transfer_params"],
                        "routed_experts_prompt_start": decode_start or 0}
        decode_doc = _answered(decode, path, asked_decode)
        events = [b"data: " + json.dumps(e).encode()
                  for e in _answered(decode, path, {**asked_decode, "stream": True})]
        request = json.dumps(asked).encode()
        prefill_body = json.dumps(prefill_doc).encode()
        decode_body = json.dumps(decode_doc).encode()
        stream = b"\n\n".join([*events, b"data: [DONE]"]) + b"\n\n"
        merged = rx.merge_response(prefill_body, decode_body, decode_start=decode_start,
                                   keep_format=keep_format)
        last = events[-1][6:]  # the finishing event, with the routing
        merged_stream = stream.replace(last, rx.merge_response(
            prefill_body, last, decode_start=decode_start, keep_format=keep_format))
        decode_full, stream_full = decode_body, stream
        if decode_start is not None:
            zeros = VllmAnswers("decode", model, routing_format=fmt, stream_routing=True,
                                uncomputed_rows="zeros")
            from_zero = {**asked_decode, "routed_experts_prompt_start": 0}
            decode_full = json.dumps(_answered(zeros, path, from_zero)).encode()
            stream_full = b"\n\n".join([
                *(b"data: " + json.dumps(e).encode()
                  for e in _answered(zeros, path, {**from_zero, "stream": True})),
                b"data: [DONE]",
            ]) + b"\n\n"
        return cls(request, prefill_body, decode_body, stream, merged, merged_stream, decode_start,
                   decode_full, stream_full)

    def without_routing(self) -> bytes:
        doc = json.loads(self.decode)
        del doc["choices"][0]["routed_experts"]
        return json.dumps(doc).encode()

    def unrouted(self) -> tuple[bytes, bytes, bytes]:
        """The no-merge floor's traffic: the bytes the proxy moves for a merge, in and out,
        with nothing to merge. Decode sends its whole answer (`decode_full`, plain and
        streamed), the routing key renamed to one of the same length no reader takes as
        routing, and the proxy relays it as it came. Prefill's routing is renamed the same way
        where decode's answer is as long as the merge's already (sidecar bodies: the proxy
        reads both halves whole), and left out where decode's own rows are few (vLLM's: the
        proxy reads prefill's rows and a short decode, so the floor reads a short prefill and
        decode's whole rows)."""
        rename = (b'"routed_experts"', b'"filler_payload"')
        if self.decode_start is None:
            prefill = self.prefill.replace(*rename)
        else:
            doc = json.loads(self.prefill)
            del doc["choices"][0]["routed_experts"]
            prefill = json.dumps(doc).encode()
        return prefill, self.decode_full.replace(*rename), self.stream_full.replace(*rename)


# --- stand-in engines (run as child processes) --------------------------------------------------


class Engine:
    """Serves prebuilt bodies. `fault`: None, "hang" (reads requests, never answers),
    "no_routing", "status500", "truncated" (closes half way through a body), "byte_split" (a
    stream's routing event one byte per HTTP chunk); the fair race's variants: "full_rows"
    (decode answers every row, `Bodies.decode_full`, whatever start it is asked) and
    "unrouted" (`Bodies.unrouted`: the no-merge floor). A request whose client marked it
    `"user": "small"` is answered with the bodies of an 8-token request."""

    def __init__(self, role: str, bodies: Bodies, fault: str | None, shape: str = "sidecar"):
        if fault == "unrouted":
            prefill, decode, stream = bodies.unrouted()
            bodies = Bodies(bodies.request, prefill, decode, stream, b"", b"")
        elif fault == "full_rows":
            bodies = Bodies(bodies.request, bodies.prefill, bodies.decode_full,
                            bodies.stream_full, b"", b"")
        self.role, self.bodies, self.fault, self.shape = role, bodies, fault, shape
        self.requests = 0
        self.disconnects = 0
        self._small: Bodies | None = None

    def small(self) -> Bodies:
        if self._small is None:
            prefill = rx.from_response(self.bodies.prefill)
            assert prefill is not None
            shape = prefill.shape
            self._small = Bodies.make(8, shape[1], shape[2], self.shape)
        return self._small

    def reply(self, url: bytes, body: bytes) -> list[bytes] | None:
        if url == b"/stats":
            stats = {"requests": self.requests, "disconnects": self.disconnects}
            return _http(200, json.dumps(stats).encode())
        if url == b"/health":  # routers probe it before they serve (vllm-router does)
            return _http(200, b"{}") if self.fault != "hang" else None
        if url == b"/metrics":  # vllm-router looks for data-parallel ranks there
            return _http(404, b"{}")
        self.requests += 1
        bodies = self.bodies
        if SMALL_MARK in body.replace(b'": ', b'":'):  # the proxy may write it without spaces
            bodies = self.small()
        if self.fault == "hang":
            return None
        if self.fault == "status500":
            return _http(500, b'{"error":"engine failed"}')
        if self.role == "prefill":
            if b'"do_remote_decode":true' not in body:
                return _http(400, b'{"error":"not a prefill request"}')
            return _http(200, bodies.prefill)
        if b'"bench-prefill"' not in body:  # decode needs prefill's kv_transfer_params
            return _http(400, b'{"error":"no kv_transfer_params from prefill"}')
        if bodies.decode_start is not None and b'"routed_experts_prompt_start"' in body:
            # vLLM 0.32's decode dies when asked for rows it did not compute: a router that
            # asks for routing must ask from where decode's rows begin. (vllm-router asks no
            # start; it is answered the same body, where the real release would die, so its
            # row measures its relay alone.)
            asked = b'"routed_experts_prompt_start":%d' % bodies.decode_start
            if asked not in body.replace(b'": ', b'":'):
                return _http(400, b'{"error":"decode asked from another start"}')
        if b'"stream":true' in body:
            if self.fault == "byte_split":
                return _byte_split(bodies.stream)
            return _http(200, bodies.stream, b"text/event-stream")
        if self.fault == "no_routing":
            return _http(200, self.bodies.without_routing())
        if self.fault == "truncated":
            head, data = _http(200, self.bodies.decode)
            return [head, data[: len(data) // 2], b""]  # b"": close the connection
        return _http(200, bodies.decode)


def _answered(answers: VllmAnswers, path: str, body: dict[str, Any]) -> Any:
    status, reply = answers.reply(path, body)
    if status != 200:
        raise RuntimeError(f"bench-proxy: the stand-in answered {status}: {reply}")
    return reply


# A client's request marked this way is answered with small bodies (`Engine`).
SMALL_MARK = b'"user":"small"'


def _byte_split(stream: bytes) -> list[bytes]:
    """The stream chunked: the routing event one byte per chunk, every other event whole."""
    head = (b"HTTP/1.1 200 X\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    parts = [head]
    for event in stream.split(b"\n\n")[:-1]:
        event += b"\n\n"
        if b'"routed_experts"' in event:
            parts.append(b"".join(b"1\r\n%c\r\n" % c for c in event))
        else:
            parts.append(b"%x\r\n%s\r\n" % (len(event), event))
    parts.append(b"0\r\n\r\n")
    return parts


def _http(status: int, body: bytes, content_type: bytes = b"application/json") -> list[bytes]:
    head = b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (
        status,
        content_type,
        len(body),
    )
    return [head, body]


def _engine_main(
    role: str, fault: str | None, tokens: int, layers: int, top_k: int, shape: str,
    generated: int | None = None,
) -> None:
    import httptools
    import uvloop

    engine = Engine(role, Bodies.make(tokens, layers, top_k, shape, generated), fault, shape)

    class Connection(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
            self.parser = httptools.HttpRequestParser(self)
            self.url, self.body = b"", []  # type: tuple[bytes, list[bytes]]

        def on_url(self, url: bytes) -> None:
            self.url += url

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            parts = engine.reply(self.url, b"".join(self.body))
            self.url, self.body = b"", []
            for part in parts or []:
                if not part:
                    self.transport.close()
                    return
                self.transport.write(part)

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            engine.disconnects += 1

    async def main() -> None:
        sock = _bound_socket()
        server = await asyncio.get_running_loop().create_server(Connection, sock=sock)
        print(f"PORT {sock.getsockname()[1]}", flush=True)
        await server.serve_forever()

    uvloop.run(main())


def _serve_main(kind: str, prefill: list[str], decode: list[str], settings: dict[str, Any]) -> None:
    if kind == "proxy":  # the Rust data plane, as `routed-experts proxy` runs it
        from routed_experts.proxy import ProxyConfig, ProxyServer

        if os.environ.get("BENCH_DEBUG"):  # the proxy's log lines, one a request
            from routed_experts.proxy.server import configure_logging

            configure_logging("info")
        # The bench's stand-in engines stream routing on every endpoint (as vLLM's generate
        # does), and vllm-router relays streams: the proxy relays them too.
        settings = {"stream_routing": "relay", **settings}
        server = ProxyServer(prefill, decode, ProxyConfig(**settings))
        print(f"PORT {server.port}", flush=True)
        server.serve(signals=True)
        return
    import uvicorn

    from .passthrough import passthrough_app

    sock = _bound_socket()
    config = uvicorn.Config(passthrough_app(prefill, decode), access_log=False, log_level="warning")
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])


def _bound_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


# --- processes ----------------------------------------------------------------------------------


class Child:
    """A child process that prints `PORT n` once it listens."""

    def __init__(self, args: list[str]) -> None:
        # The harness is not installed: the child finds it where this module is.
        path = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rx_bench.proxy", *args],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)},
            stdout=subprocess.PIPE,
            stderr=None if os.environ.get("BENCH_DEBUG") else subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"child {args} did not start")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def memory_mb(self) -> tuple[float, float]:
        """(VmRSS, VmHWM) in MB."""
        values = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS", "VmHWM")):
                    values[line.split(":")[0]] = int(line.split()[1]) / 1024
        return values["VmRSS"], values["VmHWM"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class RouterChild(Child):
    """vllm-router (the Rust router P/D operators run, from PyPI) in front of the engines, as
    its README starts it; up once its port accepts connections."""

    def __init__(self, prefill: Sequence[Any], decode: Sequence[Any], policy: str = "round_robin",
                 prefill_policy: str | None = None) -> None:
        exe = vllm_router()
        assert exe is not None
        port, metrics_port = _free_ports(2)
        cmd = [exe, "--vllm-pd-disaggregation", "--policy", policy, "--host", "127.0.0.1",
               "--port", str(port), "--prometheus-port", str(metrics_port), "--log-level", "error"]
        if prefill_policy:
            cmd += ["--prefill-policy", prefill_policy]
        for c in prefill:
            cmd += ["--prefill", c.url]
        for c in decode:
            cmd += ["--decode", c.url]
        debug = os.environ.get("BENCH_DEBUG")
        self.proc = subprocess.Popen(
            cmd, stdout=None if debug else subprocess.DEVNULL,
            stderr=None if debug else subprocess.DEVNULL, text=True,
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"vllm-router did not start: {cmd}")


def vllm_router() -> str | None:
    """The vllm-router command beside this Python (tests/requirements.txt installs it), or on
    PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


def _free_ports(n: int) -> list[int]:
    """`n` distinct free ports: each socket stays bound until all are chosen (one closed first
    can be handed out again by the next bind, and vllm-router then fails to start when its
    metrics port is its serving port)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


@contextlib.contextmanager
def children(*specs: list[str]) -> Iterator[list[Child]]:
    started: list[Child] = []
    try:
        for spec in specs:
            started.append(Child(spec))
        yield started
    finally:
        for c in started:
            c.stop()


def _engine(role: str, args: argparse.Namespace, fault: str | None = None) -> list[str]:
    return engine_spec(role, args.tokens, args.layers, args.top_k, fault, args.bodies)


def engine_spec(
    role: str, tokens: int, layers: int, top_k: int, fault: str | None = None,
    shape: str = "sidecar", generated: int | None = None,
) -> list[str]:
    """The child spec of a stand-in engine serving bodies of this size and `shape` (and
    `generated` tokens, as `Bodies.make` takes them)."""
    spec = ["engine", role, str(tokens), str(layers), str(top_k), shape, str(generated or 0)]
    return spec + ([fault] if fault else [])


def _proxy_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The proxy's settings the command's flags give (the format it answers routing in)."""
    return {"routing_format": getattr(args, "routing_format", "compact")}


def _server(kind: str, prefill: Sequence[Any], decode: Sequence[Any], **settings: Any) -> list[str]:
    """The child spec of a front (`kind`) before servers that have a `.url`."""
    return [
        "serve",
        kind,
        ",".join(c.url for c in prefill),
        ",".join(c.url for c in decode),
        json.dumps(settings),
    ]


# --- load ---------------------------------------------------------------------------------------


@dataclass
class Round:
    name: str
    requests: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    client_cpu_seconds: float = 0.0  # the load generator's own (this process)
    statuses: dict[int, int] = field(default_factory=dict)
    wrong_200: int = 0  # a 200 whose body is not the expected merge
    latencies: list[float] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return self.statuses.get(200, 0) - self.wrong_200

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies) or [0.0]
        return {
            "name": self.name,
            "requests": self.requests,
            "ok": self.ok,
            "wrong_200": self.wrong_200,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "requests_per_s": round(self.requests / self.seconds, 1) if self.seconds else 0.0,
            "cpu_ms_per_request": round(self.cpu_seconds / max(self.requests, 1) * 1e3, 2),
            "client_cpu_ms_per_request": round(
                self.client_cpu_seconds / max(self.requests, 1) * 1e3, 2
            ),
            "p50_ms": round(lat[len(lat) // 2] * 1e3, 1),
            "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, 1),
        }


async def _load(
    url: str,
    body: bytes,
    expect: Expect,
    requests: int,
    concurrency: int,
    timeout: float,
    name: str,
) -> Round:
    """`requests` POSTs, `concurrency` at a time (a keep-alive connection each), each bounded by
    `timeout` seconds; a 200 must carry exactly `expect` (when given)."""
    host, port = url.rsplit("//", 1)[-1].rsplit(":", 1)
    r = Round(name, requests)
    todo = iter(range(requests))

    async def worker() -> None:
        conn = load_client.Connection(host, int(port))
        try:
            for i in todo:
                began = time.perf_counter()
                headers = {"content-type": "application/json", "x-request-id": f"b{i}"}
                try:
                    status, content = await conn.post("/v1/completions", body, headers, timeout)
                except (OSError, load_client.HttpError, asyncio.TimeoutError):
                    status, content = 0, bytearray()  # no answer in time: status 0
                r.latencies.append(time.perf_counter() - began)
                r.statuses[status] = r.statuses.get(status, 0) + 1
                if status == 200 and not _as_expected(expect, content):
                    r.wrong_200 += 1
        finally:
            conn.close()

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    r.seconds = time.perf_counter() - began
    return r


def _as_expected(expect: Expect, content: bytearray | memoryview) -> bool:
    if expect is None:
        return True
    if isinstance(expect, bytes):
        if isinstance(content, memoryview):
            # A chunked answer: a view from the start of the connection's buffer. Views compare
            # element by element (about 3 ns a byte); the buffer's own prefix test is a memcmp.
            buffer = content.obj
            assert isinstance(buffer, bytearray) and content.contiguous
            return len(content) == len(expect) and buffer.startswith(expect)
        return content == expect
    return expect(content if isinstance(content, bytearray) else bytes(content))


def _measure(
    target: Child,
    body: bytes,
    expect: Expect,
    requests: int,
    concurrency: int,
    name: str,
    timeout: float = 60.0,
) -> Round:
    cpu, own = target.cpu_seconds(), time.process_time()
    r: Round = load_client.run(
        _load(target.url, body, expect, requests, concurrency, timeout, name)
    )
    r.cpu_seconds = target.cpu_seconds() - cpu
    r.client_cpu_seconds = time.process_time() - own
    return r


def _get(url: str) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as f:  # noqa: S310 (loopback only)
            return f.status, json.loads(f.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# --- the parts ----------------------------------------------------------------------------------


def bench_load(args: argparse.Namespace, bodies: Bodies, stream: bool) -> dict[str, Any]:
    """The fair race: the proxy, vllm-router (when installed), the no-merge floor and the
    pass-through relay, one after the other, each front answering the client the same bytes
    (vllm-router's decode answers every row, `Bodies.decode_full`; the floor's engines send
    the same bytes with nothing to merge, `Bodies.unrouted`), the front under test on a core
    of its own and the client and engines on the others (`pin_cores`)."""
    body = bodies.request
    if stream:
        body = body[:-1] + b',"stream":true}'
    full_routing = rx.from_response(bodies.decode_full, start=None if bodies.decode_start is
                                    None else 0)
    kinds = ["passthrough", "vllm-router", "proxy", "floor"]
    if not vllm_router():
        kinds.remove("vllm-router")
    results: dict[str, Any] = {}
    unrouted = bodies.unrouted()
    specs = [_engine("prefill", args), _engine("decode", args),
             _engine("decode", args, "full_rows"),
             _engine("prefill", args, "unrouted"), _engine("decode", args, "unrouted")]
    with children(*specs) as (p, d, d_full, p_floor, d_floor):
        cores = pin_cores([p, d, d_full, p_floor, d_floor])
        for kind in kinds:
            expect: Expect
            if kind == "proxy":
                expect = bodies.merged_stream if stream else bodies.merged
            elif kind == "passthrough":
                expect = bodies.stream if stream else bodies.decode
            elif kind == "floor":  # decode's answer relayed as it came: nothing to merge
                expect = unrouted[2] if stream else unrouted[1]
            elif stream:  # vllm-router relays the stream as it came
                expect = bodies.stream_full
            else:
                # vllm-router rewrites the JSON (it adds usage.total_tokens) and relays the
                # decode server's routing, zeroed prompt rows included: that is what is checked.
                def expect(content: bytes | bytearray) -> bool:
                    got = rx.from_response(content, start=full_routing.start if full_routing
                                           else None)
                    return got == full_routing
            with contextlib.ExitStack() as stack:
                if kind == "vllm-router":
                    server: Child = RouterChild([p], [d_full])
                    stack.callback(server.stop)
                else:
                    settings = _proxy_settings(args) if kind in ("proxy", "floor") else {}
                    front = "proxy" if kind == "floor" else kind
                    ups = ([p_floor], [d_floor]) if kind == "floor" else ([p], [d])
                    (server,) = stack.enter_context(children(_server(front, *ups, **settings)))
                if cores:
                    _set_affinity(server.proc.pid, cores[0])
                # Steady state: one round at full concurrency first, so the heap has grown to
                # what this load needs (a proxy runs for days; its first minute is not the case).
                _measure(server, body, None, args.concurrency * 2, args.concurrency, "warm-up")
                r = _measure(server, body, expect, args.requests, args.concurrency, kind)
                results[kind] = r.summary()
                # How much of its core the front kept busy: near 1, it is the bottleneck.
                results[kind]["busy"] = round(r.cpu_seconds / max(r.seconds, 1e-9), 2)
        if cores:
            os.sched_setaffinity(0, cores[0] | cores[1])
    results["pinned"] = bool(cores)
    results["bytes_out"] = {"proxy": len(bodies.merged_stream if stream else bodies.merged),
                            "vllm-router": len(bodies.stream_full if stream
                                               else bodies.decode_full)}
    proxy = results["proxy"]
    results["ratio_requests_per_s"] = round(
        proxy["requests_per_s"] / max(results["passthrough"]["requests_per_s"], 1e-9), 2
    )
    results["vs_floor"] = round(
        proxy["cpu_ms_per_request"] / max(results["floor"]["cpu_ms_per_request"], 1e-9), 2
    )
    if "vllm-router" in results:
        router = results["vllm-router"]
        results["vs_vllm_router"] = {
            "cpu_per_request": round(
                proxy["cpu_ms_per_request"] / max(router["cpu_ms_per_request"], 1e-9), 2
            ),
            "requests_per_s": round(
                proxy["requests_per_s"] / max(router["requests_per_s"], 1e-9), 2
            ),
            "p99": round(proxy["p99_ms"] / max(router["p99_ms"], 1e-9), 2),
        }
    return results


def pin_cores(others: Sequence[Child]) -> tuple[set[int], set[int]] | None:
    """With two cores or more: (the front's core, the rest). The engines in `others` and this
    process (the client) are moved to the rest, so the front under test has a core of its own
    (`_set_affinity` puts it there). None with one core: nothing is pinned."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None
    front, rest = {allowed[0]}, set(allowed[1:])
    for c in others:
        _set_affinity(c.proc.pid, rest)
    os.sched_setaffinity(0, rest)
    return front, rest


def _set_affinity(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (threads it starts later inherit it)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task), cpus)


def bench_memory(args: argparse.Namespace, bodies: Bodies) -> dict[str, Any]:
    """Repeated rounds at `memory_concurrency` in flight: resident memory after each round, and
    the peak."""
    rounds = []
    with children(_engine("prefill", args), _engine("decode", args)) as (p, d):
        settings = _proxy_settings(args)
        if args.memory_budget:
            settings["max_buffered_bytes"] = args.memory_budget
        with children(_server("proxy", [p], [d], **settings)) as (proxy,):
            base = proxy.memory_mb()[0]
            for i in range(3):
                r = _measure(
                    proxy,
                    bodies.request,
                    bodies.merged,
                    args.memory_concurrency * 4,
                    args.memory_concurrency,
                    f"round {i + 1}",
                )
                rss, hwm = proxy.memory_mb()
                rounds.append({**r.summary(), "rss_mb": round(rss), "peak_rss_mb": round(hwm)})
            # Then idle: how soon the memory of the burst is given back (polled each second,
            # for up to --idle-wait seconds, ending once it is within 64 MB of the idle RSS).
            began = time.monotonic()
            idle = {"rss_mb": round(proxy.memory_mb()[0]), "after_s": 0.0}
            while time.monotonic() - began < args.idle_wait:
                time.sleep(1.0)
                rss = proxy.memory_mb()[0]
                idle = {"rss_mb": round(rss), "after_s": round(time.monotonic() - began, 1)}
                if rss < base + 64:
                    break
    return {
        "idle_rss_mb": round(base),
        "max_buffered_bytes": args.memory_budget or "default",
        "rounds": rounds,
        "after_idle": idle,
    }


FAULTS: dict[str, tuple[list[str | None], list[str | None], dict[str, Any]]] = {
    # name: (prefill engine faults, decode engine faults, proxy settings)
    "one decode hung": ([None], [None, "hang"], {"read_timeout": 2.0, "eject_seconds": 5.0}),
    "one decode 500s": ([None], [None, "status500"], {}),
    "decode drops routing": ([None], ["no_routing"], {}),
    "decode cut mid-body": ([None], ["truncated"], {}),
    "one prefill down": (["down", None], [None], {}),
}


def bench_faults(args: argparse.Namespace, bodies: Bodies) -> dict[str, Any]:
    """Each fault against the proxy: how many requests succeed, how many to the healthy
    servers succeed, and (always 0) how many 200s carry wrong or missing routing."""
    out = {}
    requests = max(args.requests // 2, 50)
    for name, (prefill_faults, decode_faults, settings) in FAULTS.items():
        specs = [_engine("prefill", args, f) for f in prefill_faults if f != "down"]
        specs += [_engine("decode", args, f) for f in decode_faults]
        with children(*specs) as engines:
            prefill = engines[: len(specs) - len(decode_faults)]
            decode = engines[len(prefill) :]
            prefill_urls = [c.url for c in prefill]
            if "down" in prefill_faults:
                prefill_urls.insert(0, f"http://127.0.0.1:{_closed_port()}")
            server_spec = [
                "serve",
                "proxy",
                ",".join(prefill_urls),
                ",".join(c.url for c in decode),
                json.dumps({**settings, **_proxy_settings(args)}),
            ]
            with children(server_spec) as (proxy,):
                r = _measure(proxy, bodies.request, bodies.merged, requests, args.concurrency, name)
                health_status, health = _get(proxy.url + "/health")
            healthy = [c for c, f in zip(decode, decode_faults) if f is None]
            to_healthy = sum(_get(c.url + "/stats")[1]["requests"] for c in healthy)
        summary = r.summary()
        summary["decode_requests_to_healthy"] = to_healthy
        if to_healthy:
            summary["ok_of_healthy_pct"] = round(100 * min(r.ok, to_healthy) / to_healthy, 1)
        summary["ejected"] = [
            f"{side}[{i}]"
            for side in ("prefill", "decode")
            for i, u in enumerate(health[side])
            if not u["healthy"]
        ]
        summary["health_status"] = health_status
        out[name] = summary
    return out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_main(argv: list[str]) -> None:
    if argv[0] == "engine":
        role, tokens, layers, top_k = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        fault = argv[7] if len(argv) > 7 else None
        _engine_main(role, fault, tokens, layers, top_k, argv[5], int(argv[6]) or None)
    elif argv[0] == "serve":
        kind, prefill, decode, settings = argv[1], argv[2], argv[3], json.loads(argv[4])
        _serve_main(kind, prefill.split(","), decode.split(","), settings)
    else:
        raise SystemExit(f"unknown child {argv[0]!r}")


if __name__ == "__main__":
    _child_main(sys.argv[1:])
