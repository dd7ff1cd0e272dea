"""The proxy tests' engines: the stand-in engine's answers (routed_experts.stand_in_engine,
held to the bodies a real vLLM 0.32 sent) served by uvicorn behind fault injection, so a test
can make an engine crash, hang, cut a stream short or send broken routing, and see what it
was asked. Prefill (`do_remote_decode`) returns rows [S, P); decode returns rows from the start
it is asked (the proxy asks `P - 1`)."""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from routed_experts.stand_in_engine import PATHS, VllmAnswers, prompt_tokens, routing_of

__all__ = ["KV_PARAMS", "Engine", "Server", "closed_port_url", "max_tokens", "prompt_tokens",
           "truth"]

LAYERS, TOP_K, EXPERTS = 4, 2, 128
# What every test engine's prefill returns, so a test can tell it reached decode unchanged.
KV_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-engine-1",
    "remote_block_ids": [3, 5, 8],
    "remote_host": "127.0.0.1",
    "remote_port": 14579,
}


def truth(tokens: list[int], generated: int) -> np.ndarray:
    """The routing a monolithic engine would record for this request: rows [0, P + G - 1)."""
    return routing_of(tokens, generated, (LAYERS, TOP_K, EXPERTS))


def max_tokens(body: dict[str, Any]) -> int:
    return int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)


class _Answers(VllmAnswers):
    """The stand-in's answers, with the faults that change what routing an engine sends."""

    def __init__(self, engine: Engine, role: str, **settings: Any) -> None:
        super().__init__(role, (LAYERS, TOP_K, EXPERTS), **settings)
        self.engine = engine

    def routed_rows(
        self, tokens: list[int], generated: int, start: int, choice: int = 0
    ) -> tuple[np.ndarray, int]:
        fail = self.engine.fail
        if fail == "gap" and self.role == "decode":  # rows from P + 1: two positions missing
            start = len(tokens) + 1
        rows, start = super().routed_rows(tokens, generated, start, choice)
        if fail == "zero_routes":  # a broken kernel: right shape, every id 0
            rows = np.zeros_like(rows)
        elif fail == "duplicate_routes":  # every top_k holds its first expert twice
            rows = rows.copy()
            rows[..., 1] = rows[..., 0]
        return rows, start

    def kv_transfer_params(self, tokens: list[int]) -> dict[str, Any]:
        return dict(KV_PARAMS)


@dataclass
class Engine:
    # Decode's rows asked of it before the positions it computed: "full" answers them zeroed
    # (vLLM before 0.32), "delta" computed them (asked from P - 1, as the proxy asks, vLLM 0.32
    # has every row; asked from before, it answers 500 where vLLM 0.32 dies).
    mode: str = "full"
    fmt: str = "compact"  # "compact" sidecar, "vllm_npy", or "vllm_021" (§3.4's split bodies)
    release: str = "0.32"  # or "0.27": completions and chat ignore the start (rows from 0)
    # "500", "400", "gap"; decode faults: "no_done" (stream cut short), "json_reply" (JSON to a
    # stream request), "sse_reply" (a stream to a plain one), "escaped_key";
    # prefill fault: "array" (a JSON array body); either side: "no_routing", "zero_routes",
    # "duplicate_routes" (what a broken engine sends: every id 0, an expert twice in a top_k);
    # "no_kv" (a prefill reply without kv_transfer_params), "dup_routing" (the routing event
    # twice), "cut_line" (a stream that ends inside a line), "dribble" (the routing event in
    # 256-byte pieces); "hang" (never answers; records
    # the client's disconnect), "slow" (answers after `delay` seconds), "held" (answers once
    # `released` is set: a request kept under way for as long as a test needs), "slow_stream"
    # (a stream that never ends, one event per 20 ms; records when the client goes),
    # "flood_stream" (the same, 64 KB comments as fast as they are read)
    fail: str | None = None
    delay: float = 1.0
    pad: int = 0  # decode: bytes of filler after the routing (a "pad" key; a stream comment)
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    disconnected: list[str] = field(default_factory=list)  # request ids whose client left
    health_checks: int = 0
    released: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        # Routing on completions streams too: the proxy's stream merge is tested on every path
        # (vLLM 0.32's own streams, without it, are tests/test_stand_in_engine.py's).
        settings = {
            "uncomputed_rows": "zeros" if self.mode == "full" else "error",
            "routing_format": "compact" if self.fmt == "compact" else "vllm_npy",
            "release": "0.21" if self.fmt == "vllm_021" else self.release,
            "stream_routing": True,
        }
        self.answers = {role: _Answers(self, role, **settings) for role in ("prefill", "decode")}

    async def handle(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.fail == "hang":
            while not await request.is_disconnected():
                await asyncio.sleep(0.02)
            self.disconnected.append(request.headers.get("x-request-id", ""))
            return Response(status_code=499)
        if self.fail == "slow":
            await asyncio.sleep(self.delay)
        while self.fail == "held" and not self.released.is_set():
            await asyncio.sleep(0.01)
        if self.fail == "array":
            return JSONResponse([1, 2])
        if self.fail == "500":
            return JSONResponse({"error": "engine crashed"}, 500)
        if self.fail == "400":
            return JSONResponse({"error": "bad request"}, 400)
        kv = body.get("kv_transfer_params") or {}
        role = "prefill" if kv.get("do_remote_decode") else "decode"
        if role == "decode" and self.fail in ("slow_stream", "flood_stream"):
            rid = request.headers.get("x-request-id", "")
            events = self.endless(rid, flood=self.fail == "flood_stream")
            return StreamingResponse(events, media_type="text/event-stream")
        asked = body
        if self.fail == "json_reply":
            asked = {**body, "stream": False}
        elif self.fail == "sse_reply":
            asked = {**body, "stream": True}
        status, reply = self.answers[role].reply(request.url.path, asked)
        if isinstance(reply, list):
            return StreamingResponse(self.sse(reply), media_type="text/event-stream")
        if status != 200:
            return JSONResponse(reply, status)
        if role == "prefill" and self.fail == "no_kv":  # vLLM's connectors send none unless
            del reply["kv_transfer_params"]  # the request ended by length
        if role == "prefill" and self.fail == "dup_kv":  # two: which one decode gets is a guess
            text = json.dumps(reply)[:-1] + ', "kv_transfer_params": {}}'
            return Response(text, media_type="application/json")
        if self.fail == "no_routing":  # a server started without routing
            for c in reply["choices"]:
                c.pop("routed_experts", None)
        if role == "decode" and self.pad:
            reply["pad"] = "x" * self.pad
        return JSONResponse(reply)

    async def sse(self, docs: list[dict[str, Any]]) -> AsyncIterator[bytes]:
        """A stream's events as the stand-in wrote them, with the stream faults."""
        routed = b""
        for doc in docs:
            choices = doc.get("choices") or []
            carries = any(c.get("routed_experts") is not None for c in choices)
            if self.fail == "no_routing":
                for c in choices:
                    c.pop("routed_experts", None)
            text = json.dumps(doc)
            if self.fail == "escaped_key":
                text = text.replace('"routed_experts"', '"routed\\u005fexperts"')
            line = f"data: {text}\n\n".encode()
            if carries:
                routed = line
            if self.fail == "dribble" and carries:
                for at in range(0, len(line), 256):  # the long event in small pieces
                    yield line[at : at + 256]
                    await asyncio.sleep(0.002)
                continue
            yield line
        if self.fail == "dup_routing":  # the routing event again
            yield routed
        if self.fail == "cut_line":  # the stream ends inside a line
            yield b'data: {"choices": [{"index": 0, "te'
            return
        if self.pad:
            yield b": " + b"x" * self.pad + b"\n\n"
        if self.fail != "no_done":
            yield b"data: [DONE]\n\n"

    async def endless(self, request_id: str, flood: bool = False) -> AsyncIterator[bytes]:
        event = b'data: {"choices":[{"index":0,"text":" tok"}]}\n\n'
        if flood:  # as fast as it is taken, 64 KB at a time
            event = b": " + b"x" * 65536 + b"\n\n"
        try:
            while True:
                yield event
                await asyncio.sleep(0 if flood else 0.02)
        finally:  # the client went: the server stops generating
            self.disconnected.append(request_id)

    async def models(self, request: Request) -> Response:
        self.headers.append(dict(request.headers))
        if self.fail == "hang":
            while not await request.is_disconnected():
                await asyncio.sleep(0.02)
            return Response(status_code=499)
        return JSONResponse({"object": "list", "data": [{"id": "moe", "object": "model"}]})

    async def health(self, request: Request) -> Response:
        """vLLM's `GET /health`: 200 unless the engine is failing ("500") or hung."""
        self.health_checks += 1
        broken = self.fail in ("500", "hang")
        return JSONResponse({}, 503 if broken else 200)

    def app(self) -> Starlette:
        routes = [Route(p, self.handle, methods=["POST"]) for p in PATHS]
        routes.append(Route("/v1/models", self.models, methods=["GET"]))
        routes.append(Route("/health", self.health, methods=["GET"]))
        return Starlette(routes=routes)


# How a proxy app handed to `Server` is served: "rust" (the server itself, as `routed-experts
# proxy` runs it; the default) or "asgi" (the ASGI app under uvicorn, relaying to it).
DATA_PLANE = os.environ.get("RX_PROXY_DATA_PLANE", "rust")

# Ports closed_port_url() holds for the whole run, closed when it ends.
_HELD: list[socket.socket] = []
atexit.register(lambda: [s.close() for s in _HELD])


def closed_port_url() -> str:
    """A loopback address that refuses connections for the rest of the run: a port bound and
    never listened on, and held, so no other test or server can take it meanwhile (a port
    bound and released could be anyone's a moment later)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _HELD.append(s)
    return f"http://127.0.0.1:{s.getsockname()[1]}"


class Server:
    """An ASGI app served by uvicorn on a loopback port in a background thread. The socket is
    bound here and handed to uvicorn, so no other process can take the port in between. A
    proxy app (`create_app`) is served as DATA_PLANE says, with its settings."""

    def __init__(self, app: Any) -> None:
        from routed_experts.proxy import PDProxy, ProxyServer

        self.rust: ProxyServer | None = None
        if isinstance(app, PDProxy) and DATA_PLANE == "rust":
            self.rust = ProxyServer(app.prefill_urls, app.decode_urls, app.config)
            self.port = self.rust.port
            return
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = int(self.socket.getsockname()[1])
        config = uvicorn.Config(app, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        if self.rust is not None:
            self.rust.__enter__()
            return self
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start within 10 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.rust is not None:
            self.rust.__exit__(None, None, None)
            return
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()
