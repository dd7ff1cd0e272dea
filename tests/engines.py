"""Stand-in inference engines for the proxy tests: small ASGI servers with vLLM's routing
semantics in disaggregated serving. Prefill (`do_remote_decode`) returns rows [S, P); decode
returns the full sequence with zeroed prompt rows [S, P+G-1), or a delta from P-1."""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import routed_experts as rx

LAYERS, TOP_K, EXPERTS = 4, 2, 128
KV_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-engine-1",
    "remote_block_ids": [3, 5, 8],
    "remote_host": "127.0.0.1",
    "remote_port": 14579,
}


def prompt_tokens(body: dict[str, Any]) -> list[int]:
    if "messages" in body:
        text = "".join(m.get("content", "") for m in body["messages"])
        return [ord(c) % 50 for c in text]
    prompt = body["prompt"]
    return list(prompt) if isinstance(prompt, list) else [ord(c) % 50 for c in prompt]


def truth(tokens: list[int], generated: int) -> np.ndarray:
    """The routing a monolithic engine would record for this request: rows [0, P + G - 1)."""
    seed = sum(t * 31**i for i, t in enumerate(tokens)) % 2**32
    rng = np.random.default_rng(seed)
    return rng.integers(1, EXPERTS, size=(len(tokens) + generated - 1, LAYERS, TOP_K))


def max_tokens(body: dict[str, Any]) -> int:
    return int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)


@dataclass
class Engine:
    mode: str = "full"  # decode form: "full" (zeroed prompt rows) or "delta" (from P-1)
    fmt: str = "compact"  # "compact" sidecar or "vllm_npy"
    # "500", "400", "gap"; decode faults: "no_done" (stream cut short), "json_reply" (JSON to a
    # stream request), "sse_reply" (a stream to a plain one), "no_routing", "escaped_key";
    # prefill fault: "array" (a JSON array body); either side: "zero_routes",
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

    def routing(self, arr: np.ndarray, start: int) -> Any:
        if self.fail == "zero_routes":  # a broken kernel: right shape, every id 0
            arr = np.zeros_like(arr)
        elif self.fail == "duplicate_routes":  # every top_k holds its first expert twice
            arr = arr.copy()
            arr[..., 1] = arr[..., 0]
        p = rx.RoutedExperts.from_array(arr, start=start, num_experts=EXPERTS)
        return rx.encode(p, self.fmt)

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
        chat = request.url.path.endswith("chat/completions")
        tokens = prompt_tokens(body)
        P, S = len(tokens), int(body.get("routed_experts_prompt_start", 0))
        kv = body.get("kv_transfer_params") or {}
        if self.fmt == "vllm_021":
            return self.split_body(tokens, body, chat, kv)
        if kv.get("do_remote_decode"):  # prefill: one token, rows [S, P)
            rows = truth(tokens, 1)[S:P]
            choice = {
                "index": 0,
                "finish_reason": "length",
                "routed_experts": self.routing(rows, S),
            }
            choice.update(
                {"message": {"role": "assistant", "content": "x"}} if chat else {"text": "x"}
            )
            doc = {"id": "p", "choices": [choice], "kv_transfer_params": KV_PARAMS}
            if self.fail == "no_kv":  # vLLM's connectors send none unless it ended by length
                del doc["kv_transfer_params"]
            if self.fail == "dup_kv":  # two kv_transfer_params: which one decode gets is a guess
                text = json.dumps(doc)[:-1] + ', "kv_transfer_params": {}}'
                return Response(text, media_type="application/json")
            return JSONResponse(doc)
        if kv != KV_PARAMS:
            return JSONResponse({"error": "decode needs the prefill's kv_transfer_params"}, 400)
        G = max_tokens(body)
        full = truth(tokens, G)
        if self.mode == "delta" or self.fail == "gap":
            start = P - 1 if self.mode == "delta" else P + 1
            routing = self.routing(full[start:], start)
        else:
            rows = full[S:].copy()
            rows[: P - S] = 0  # decode never computed the prompt: its rows are invalid
            routing = self.routing(rows, S)
        text = " tok" * G
        stream = bool(body.get("stream"))
        if self.fail == "json_reply":
            stream = False
        elif self.fail == "sse_reply":
            stream = True
        if self.fail in ("slow_stream", "flood_stream"):
            rid = request.headers.get("x-request-id", "")
            events = self.endless(rid, flood=self.fail == "flood_stream")
            return StreamingResponse(events, media_type="text/event-stream")
        if stream:
            return StreamingResponse(self.sse(routing, G, chat), media_type="text/event-stream")
        choice = {
            "index": 0,
            "finish_reason": "length",
            "routed_experts": routing,
            "logprobs": {"content": [{"token": "a", "logprob": -0.12345678901234568}]},
        }
        if self.fail == "no_routing":
            del choice["routed_experts"]
        choice.update(
            {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        )
        doc = {
            "id": "d",
            "object": "text_completion",
            "choices": [choice],
            "usage": {"prompt_tokens": P, "completion_tokens": G},
        }
        if self.pad:
            doc["pad"] = "x" * self.pad
        return JSONResponse(doc)

    def split_body(self, tokens: list[int], body: dict[str, Any], chat: bool,
                   kv: dict[str, Any]) -> Response:
        """vLLM 0.21.0: the prompt's rows at the top (nested lists), each choice's generated
        rows in the choice; a prefill (one token generated) has no generated row."""
        P = len(tokens)
        G = 1 if kv.get("do_remote_decode") else max_tokens(body)
        full = truth(tokens, G)
        prompt_rows = full[:P].copy()
        if not kv.get("do_remote_decode"):
            prompt_rows[:] = 0  # decode loaded the prompt's KV cache and ran none of it
        generated = full[P:].tolist() or None
        message = {"message": {"role": "assistant", "content": "x"}} if chat else {"text": "x"}
        doc = {"id": "s", "object": "text_completion", "created": 1,
               "prompt_routed_experts": prompt_rows.tolist(), "model": "moe",
               "choices": [{"index": 0, **message, "finish_reason": "length",
                            "routed_experts": generated}],
               "usage": {"prompt_tokens": P, "completion_tokens": G, "total_tokens": P + G},
               "kv_transfer_params": KV_PARAMS if kv.get("do_remote_decode") else None}
        return JSONResponse(doc)

    async def generate(self, request: Request) -> Response:
        """vLLM's `/inference/v1/generate` (0.25+ shape): token ids in, the routing of each choice
        as one value; streamed, it comes once, on the finishing event, then a usage-only event."""
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        tokens = list(body["token_ids"])
        sampling = body.get("sampling_params") or {}
        P, S = len(tokens), int(sampling.get("routed_experts_prompt_start", 0))
        G = int(sampling.get("max_tokens") or 16)
        kv = body.get("kv_transfer_params") or {}
        doc: dict[str, Any] = {"request_id": "generate-tokens-1", "model": "moe", "created": 1}
        if kv.get("do_remote_decode"):  # prefill: one token, rows [S, P)
            choice = {"index": 0, "logprobs": None, "finish_reason": "length", "token_ids": [7],
                      "routed_experts": self.routing(truth(tokens, 1)[S:P], S)}
            usage = {"prompt_tokens": P, "total_tokens": P + 1, "completion_tokens": 1}
            doc |= {"choices": [choice], "usage": usage, "prompt_logprobs": None,
                    "kv_transfer_params": KV_PARAMS}
            return JSONResponse(doc)
        if kv != KV_PARAMS:
            return JSONResponse({"error": "decode needs the prefill's kv_transfer_params"}, 400)
        rows = truth(tokens, G)[S:].copy()
        rows[: P - S] = 0  # decode never computed the prompt
        routing = self.routing(rows, S)
        usage = {"prompt_tokens": P, "total_tokens": P + G, "completion_tokens": G}
        if body.get("stream"):
            return StreamingResponse(self.generate_events(doc, routing, G, usage),
                                     media_type="text/event-stream")
        choice = {"index": 0, "logprobs": None, "finish_reason": "length",
                  "token_ids": list(range(G)), "routed_experts": routing}
        doc |= {"choices": [choice], "usage": usage, "prompt_logprobs": None,
                "kv_transfer_params": None}
        return JSONResponse(doc)

    async def generate_events(self, doc: dict[str, Any], routing: Any, generated: int,
                              usage: dict[str, int]):  # type: ignore[no-untyped-def]
        for i in range(generated):
            last = i == generated - 1
            choice = {"index": 0, "logprobs": None, "finish_reason": "length" if last else None,
                      "token_ids": [i], "routed_experts": routing if last else None}
            yield f"data: {json.dumps(doc | {'choices': [choice], 'usage': None})}\n\n".encode()
        yield f"data: {json.dumps(doc | {'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def sse(self, routing: Any, generated: int, chat: bool):  # type: ignore[no-untyped-def]
        for i in range(generated):
            delta = {"delta": {"content": " tok"}} if chat else {"text": " tok"}
            chunk: dict[str, Any] = {"id": "d", "choices": [{"index": 0, **delta}]}
            if i == generated - 1:  # the routing comes with the last chunk
                if self.fail != "no_routing":
                    chunk["choices"][0]["routed_experts"] = routing
                chunk["choices"][0]["finish_reason"] = "length"
            line = json.dumps(chunk)
            if self.fail == "escaped_key":
                line = line.replace('"routed_experts"', '"routed\\u005fexperts"')
            event = f"data: {line}\n\n".encode()
            if self.fail == "dribble" and "routed_experts" in line:
                for at in range(0, len(event), 256):  # the long event in small pieces
                    yield event[at : at + 256]
                    await asyncio.sleep(0.002)
                continue
            yield event
        if self.fail == "dup_routing":  # the routing event again
            yield f"data: {line}\n\n".encode()
        if self.fail == "cut_line":  # the stream ends inside a line
            yield b'data: {"choices": [{"index": 0, "te'
            return
        if self.pad:
            yield b": " + b"x" * self.pad + b"\n\n"
        if self.fail != "no_done":
            yield b"data: [DONE]\n\n"

    async def endless(self, request_id: str, flood: bool = False):  # type: ignore[no-untyped-def]
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
        routes = [
            Route(p, self.handle, methods=["POST"])
            for p in ("/v1/completions", "/v1/chat/completions")
        ]
        routes.append(Route("/inference/v1/generate", self.generate, methods=["POST"]))
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
