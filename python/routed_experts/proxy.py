"""A prefill/decode (P/D) proxy that merges routed experts: vLLM's disaggregated-serving protocol
in front of prefill and decode servers, with every response's routing merged by absolute position.

Starlette (the ASGI app), httpx (async upstream client, streaming) and uvicorn (the server of
`routed-experts proxy`) come with the `proxy` extra: small, widely used, and the same stack vLLM's
own example proxies use.

Use it as a command, or mount `create_app(...)` in your own ASGI app, or call the pieces
(`prefill_request`, `decode_request`, `StreamMerger`) from your own router.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import routed_experts as rx

log = logging.getLogger("routed_experts.proxy")

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")

# What vLLM's disaggregated prefill expects: compute the prompt, keep the KV cache for a remote
# decode, return the parameters the decode server needs to fetch it.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_request(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The request for the prefill server: one token, no streaming, KV cache kept for decode.
    `routed_experts_prompt_start` and every other client field go through unchanged."""
    req = dict(body)
    req["max_tokens"] = 1
    if chat or "max_completion_tokens" in body:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    req.pop("stream_options", None)
    req["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return req


def decode_request(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The request for the decode server: the client's, plus the prefill's kv_transfer_params."""
    req = dict(body)
    params = prefill_response.get("kv_transfer_params")
    if params is not None:
        req["kv_transfer_params"] = params
    return req


class StreamMerger:
    """Merges the routing of server-sent events from a decode server with the prefill routing.

    Feed it the decode stream's lines; events whose choices carry `routed_experts` come back
    merged (RoutedExpertsError when they cannot be), every other line as it was.
    """

    def __init__(self, prefill_body: bytes, start: int | None = None) -> None:
        self.prefill_body, self.start = prefill_body, start

    def line(self, line: bytes) -> bytes:
        # The pre-filter only skips events that cannot hold routing: a key spelled with escapes
        # ("routed\u005fexperts") is the same key, so any line with a \u escape is merged too.
        if not line.startswith(b"data:") or (
            b'"routed_experts"' not in line and b"\\u" not in line
        ):
            return line
        payload = line[5:].lstrip()
        return b"data: " + rx.merge_response(self.prefill_body, payload, start=self.start)


class UpstreamError(Exception):
    """An upstream server failed; `side` says which ("prefill", "decode", "merge")."""

    def __init__(self, side: str, status: int, message: str) -> None:
        super().__init__(message)
        self.side, self.status, self.message = side, status, message


def error_body(status: int, side: str, message: str) -> dict[str, Any]:
    """The JSON error every failure gives the client, as a response or as a final stream event."""
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    return {"error": {"message": message, "type": kind, "side": side, "code": status}}


def error_response(status: int, side: str, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, side, message), status)


def error_event(status: int, side: str, message: str) -> bytes:
    return b"data: " + json.dumps(error_body(status, side, message)).encode() + b"\n\n"


class PDProxy:
    """Round robin over prefill and decode servers; merge routing on every response."""

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        client: httpx.AsyncClient | None = None,
        timeout: float = 600.0,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("give at least one prefill and one decode server")
        self.prefill_urls, self.decode_urls = list(prefill), list(decode)
        self._prefill = itertools.cycle(self.prefill_urls)
        self._decode = itertools.cycle(self.decode_urls)
        self.client = client or httpx.AsyncClient(timeout=timeout)

    async def _post(self, side: str, url: str, body: dict[str, Any]) -> bytes:
        try:
            r = await self.client.post(url, json=body)
        except httpx.HTTPError as e:
            raise UpstreamError(side, 502, f"{side} server {url} failed: {e!r}") from e
        if r.status_code >= 400:
            raise _status_error(side, url, r.status_code, r.content)
        return r.content

    async def handle(self, request: Request) -> Response:
        # The endpoint, whatever prefix the app is mounted under.
        path = next(e for e in ENDPOINTS if request.url.path.endswith(e))
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
        except ValueError as e:
            return error_response(400, "client", f"invalid request body: {e}")
        prefill_url = next(self._prefill).rstrip("/") + path
        decode_url = next(self._decode).rstrip("/") + path
        try:
            prefill_body = await self._post(
                "prefill",
                prefill_url,
                prefill_request(body, chat=path.endswith("chat/completions")),
            )
            prefill_json = json.loads(prefill_body)
            dec = decode_request(body, prefill_json)
            # The requested prompt start: what vLLM's .npy routing (which carries none) starts at.
            start = body.get("routed_experts_prompt_start")
            start = start if isinstance(start, int) and start >= 0 else None
            if body.get("stream"):
                return await self._stream(decode_url, dec, prefill_body, start)
            decode_body = await self._post("decode", decode_url, dec)
            merged = await asyncio.to_thread(_merge, prefill_body, decode_body, start)
            return Response(merged, media_type="application/json")
        except UpstreamError as e:
            log.warning("%s %s: %s", path, e.side, e.message)
            return error_response(e.status, e.side, e.message)
        except ValueError as e:  # prefill body that is not JSON
            log.warning("%s prefill: %s", path, e)
            return error_response(502, "prefill", f"prefill returned invalid JSON: {e}")

    async def _stream(
        self, url: str, body: dict[str, Any], prefill_body: bytes, start: int | None
    ) -> Response:
        request = self.client.build_request("POST", url, json=body)
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise UpstreamError("decode", 502, f"decode server {url} failed: {e!r}") from e
        if upstream.status_code >= 400:
            content = await upstream.aread()
            await upstream.aclose()
            raise _status_error("decode", url, upstream.status_code, content)
        merger = StreamMerger(prefill_body, start)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for line in upstream.aiter_lines():
                    data = line.encode()
                    try:
                        data = await asyncio.to_thread(merger.line, data)
                    except rx.RoutedExpertsError as e:
                        # Headers are sent: report in-band, once, and end the stream.
                        log.warning("%s merge: %s", url, e)
                        yield error_event(502, "merge", str(e))
                        return
                    yield data + b"\n"
            except httpx.HTTPError as e:
                log.warning("%s decode stream: %r", url, e)
                yield error_event(502, "decode", f"decode stream failed: {e!r}")
            finally:
                await upstream.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse(
            {"status": "ok", "prefill": self.prefill_urls, "decode": self.decode_urls}
        )


def _merge(prefill_body: bytes, decode_body: bytes, start: int | None) -> bytes:
    try:
        return rx.merge_response(prefill_body, decode_body, start=start)
    except rx.MergeError as e:
        raise UpstreamError("merge", 502, f"prefill and decode routing do not merge: {e}") from e
    except rx.PayloadError as e:
        raise UpstreamError("merge", 502, f"malformed routing from an upstream: {e}") from e


def _status_error(side: str, url: str, status: int, content: bytes) -> UpstreamError:
    # A 4xx is about the client's request: pass its status on. A 5xx is the upstream's fault.
    text = content[:2000].decode(errors="replace")
    return UpstreamError(
        side, status if status < 500 else 502, f"{side} server {url} answered {status}: {text}"
    )


def create_app(
    prefill: Sequence[str],
    decode: Sequence[str],
    client: httpx.AsyncClient | None = None,
    timeout: float = 600.0,
) -> Starlette:
    """The proxy as an ASGI app: mount it in your own app, or serve it with uvicorn.
    `client` may carry your own transport (e.g. `httpx.ASGITransport` to an in-process engine)."""
    proxy = PDProxy(prefill, decode, client=client, timeout=timeout)
    routes = [Route(path, proxy.handle, methods=["POST"]) for path in ENDPOINTS]
    routes.append(Route("/health", proxy.health, methods=["GET"]))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        if client is None:  # ours to close; a client the caller gave stays theirs
            await proxy.client.aclose()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.proxy = proxy
    return app


def serve(prefill: Sequence[str], decode: Sequence[str], host: str, port: int) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    uvicorn.run(create_app(prefill, decode), host=host, port=port)
