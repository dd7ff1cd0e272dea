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
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import routed_experts as rx
from routed_experts._core import _routing_count

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
    # vLLM refuses min_tokens above max_tokens: they are for decode only (as vLLM's own proxy).
    req.pop("min_tokens", None)
    req.pop("min_completion_tokens", None)
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
        self.merged = False  # some event carried routing (and was merged)
        self.done = False  # the stream's `data: [DONE]` was seen

    def finish(self) -> None:
        """At the end of the stream: raise RoutedExpertsError if it ended without `[DONE]`
        (cut short), or if no event carried routing while the prefill body did."""
        if not self.done:
            raise rx.MergeError("the decode stream ended without data: [DONE]")
        if not self.merged:
            rx.merge_response(self.prefill_body, b"{}", require_routing=True)

    def line(self, line: bytes) -> bytes:
        if line.strip() == b"data: [DONE]":
            self.done = True
            return line
        # The pre-filter only skips events that cannot hold routing: a key spelled with escapes
        # ("routed\u005fexperts") is the same key, so any line with a \u escape is merged too.
        if not line.startswith(b"data:") or (
            b'"routed_experts"' not in line and b"\\u" not in line
        ):
            return line
        payload = line[5:].lstrip()
        merged = rx.merge_response(self.prefill_body, payload, start=self.start)
        self.merged = self.merged or _routing_count(payload) > 0
        return b"data: " + merged


class UpstreamError(Exception):
    """An upstream server failed; `side` says which ("prefill", "decode", "merge")."""

    def __init__(self, side: str, status: int, message: str) -> None:
        super().__init__(message)
        self.side, self.status, self.message = side, status, message


def error_body(status: int, side: str, message: str) -> dict[str, Any]:
    """The JSON error every failure gives the client, as a response or as a final stream event:
    OpenAI's shape (`message`, `type`, `param`, `code`) plus `side`."""
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    error = {"message": message, "type": kind, "param": None, "side": side, "code": status}
    return {"error": error}


def error_response(
    status: int, side: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, side, message), status, headers=headers)


def error_event(status: int, side: str, message: str) -> bytes:
    return b"data: " + json.dumps(error_body(status, side, message)).encode() + b"\n\n"


REQUEST_ID = "x-request-id"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_client_body(raw: bytes) -> dict[str, Any]:
    """The client's request as a dict; anything else is a ValueError (a 400): not JSON, NaN or
    Infinity (json.loads takes them by default; vLLM would not), not an object, nested beyond
    Python's recursion limit."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    start = body.get("routed_experts_prompt_start")
    if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 0):
        raise ValueError(
            f"routed_experts_prompt_start must be a non-negative integer, got {start!r}"
        )
    return body


class PDProxy:
    """Round robin over prefill and decode servers; merge routing on every response.

    Both halves of a request carry one request id (the client's `X-Request-Id`, or a new one),
    which comes back to the client; the client's `Authorization` (or `upstream_api_key`) goes to
    both. Upstream addresses appear in the log, never in what the client receives.
    """

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        client: httpx.AsyncClient | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        upstream_api_key: str | None = None,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("give at least one prefill and one decode server")
        self.prefill_urls, self.decode_urls = list(prefill), list(decode)
        self._prefill = itertools.cycle(self.prefill_urls)
        self._decode = itertools.cycle(self.decode_urls)
        self.upstream_api_key = upstream_api_key
        self.client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=connect_timeout)
        )

    def _headers(self, request: Request, request_id: str) -> dict[str, str]:
        headers = {REQUEST_ID: request_id}
        auth = request.headers.get("authorization")
        if self.upstream_api_key:
            auth = f"Bearer {self.upstream_api_key}"
        if auth:
            headers["authorization"] = auth
        return headers

    async def _post(
        self, side: str, url: str, body: dict[str, Any], headers: dict[str, str]
    ) -> bytes:
        try:
            r = await self.client.post(url, json=body, headers=headers)
        except httpx.HTTPError as e:
            raise _upstream_failed(side, url, e) from e
        if r.status_code >= 400:
            raise _status_error(side, url, r.status_code, r.content)
        if not r.headers.get("content-type", "").startswith("application/json"):
            log.warning("%s server %s answered %s", side, url, r.headers.get("content-type"))
            raise UpstreamError(side, 502, f"the {side} server did not answer with JSON")
        return r.content

    async def handle(self, request: Request) -> Response:
        # The endpoint, whatever prefix the app is mounted under.
        path = next(e for e in ENDPOINTS if request.url.path.endswith(e))
        request_id = _request_id(request)
        ids = {REQUEST_ID: request_id}
        try:
            body = parse_client_body(await request.body())
        except ValueError as e:
            return error_response(400, "client", f"invalid request body: {e}", ids)
        headers = self._headers(request, request_id)
        prefill_url = next(self._prefill).rstrip("/") + path
        decode_url = next(self._decode).rstrip("/") + path
        # The requested prompt start: what vLLM's .npy routing (which carries none) starts at.
        start = body.get("routed_experts_prompt_start")
        try:
            prefill_body = await self._post(
                "prefill",
                prefill_url,
                prefill_request(body, chat=path.endswith("chat/completions")),
                headers,
            )
            prefill_json = _json_object("prefill", prefill_body)
            if start is not None:
                await asyncio.to_thread(_check_prompt_start, prefill_body, start)
            dec = decode_request(body, prefill_json)
            if body.get("stream"):
                return await self._stream(decode_url, dec, prefill_body, start, headers, ids)
            decode_body = await self._post("decode", decode_url, dec, headers)
            merged = await asyncio.to_thread(_merge, prefill_body, decode_body, start)
            return Response(merged, media_type="application/json", headers=ids)
        except UpstreamError as e:
            log.warning("%s %s %s: %s", request_id, path, e.side, e.message)
            return error_response(e.status, e.side, e.message, ids)

    async def _stream(
        self,
        url: str,
        body: dict[str, Any],
        prefill_body: bytes,
        start: int | None,
        headers: dict[str, str],
        ids: dict[str, str],
    ) -> Response:
        request = self.client.build_request("POST", url, json=body, headers=headers)
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise _upstream_failed("decode", url, e) from e
        if upstream.status_code >= 400:
            content = await upstream.aread()
            await upstream.aclose()
            raise _status_error("decode", url, upstream.status_code, content)
        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            await upstream.aclose()
            log.warning("decode server %s answered %s", url, upstream.headers.get("content-type"))
            raise UpstreamError("decode", 502, "the decode server did not answer with a stream")
        merger = StreamMerger(prefill_body, start)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for line in upstream.aiter_lines():
                    data = line.encode()
                    try:
                        data = await asyncio.to_thread(merger.line, data)
                    except rx.RoutedExpertsError as e:
                        # Headers are sent: report in-band, once, and end the stream.
                        log.warning("%s merge: %s", ids[REQUEST_ID], e)
                        yield _stream_error(e)
                        return
                    yield data + b"\n"
                try:
                    await asyncio.to_thread(merger.finish)
                except rx.RoutedExpertsError as e:
                    log.warning("%s stream: %s", ids[REQUEST_ID], e)
                    yield _stream_error(e)
            except httpx.HTTPError as e:
                log.warning("%s decode stream %s: %r", ids[REQUEST_ID], url, e)
                yield error_event(502, "decode", f"the decode stream failed: {type(e).__name__}")
            finally:
                await upstream.aclose()

        return StreamingResponse(events(), media_type="text/event-stream", headers=ids)

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse(
            {"status": "ok", "prefill": self.prefill_urls, "decode": self.decode_urls}
        )

    async def healthcheck(self, request: Request) -> JSONResponse:
        # What vLLM's example disaggregated proxy answers.
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        """`GET /v1/models`, relayed from a decode server (clients call it first)."""
        url = next(self._decode).rstrip("/") + "/v1/models"
        request_id = _request_id(request)
        try:
            r = await self.client.get(url, headers=self._headers(request, request_id))
        except httpx.HTTPError as e:
            err = _upstream_failed("decode", url, e)
            return error_response(err.status, err.side, err.message)
        return Response(r.content, r.status_code, media_type="application/json")


def _request_id(request: Request) -> str:
    """The client's `X-Request-Id`, or a new one: what both halves and the response carry."""
    return request.headers.get(REQUEST_ID) or f"rx-{uuid.uuid4().hex}"


def _upstream_failed(side: str, url: str, e: httpx.HTTPError) -> UpstreamError:
    """A server that could not be reached or read: its address in the log, not to the client."""
    log.warning("%s server %s failed: %r", side, url, e)
    return UpstreamError(side, 502, f"the {side} server failed: {type(e).__name__}")


def _json_object(side: str, body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        raise UpstreamError(side, 502, f"the {side} server returned invalid JSON") from None
    if not isinstance(doc, dict):
        raise UpstreamError(side, 502, f"the {side} server returned JSON that is not an object")
    return doc


def _check_prompt_start(prefill_body: bytes, start: int) -> None:
    """Prefill's routing covers [start, P): no rows means the start was not below the prompt."""
    try:
        p = rx.from_response(prefill_body, start=start)
    except rx.RoutedExpertsError as e:
        raise UpstreamError("prefill", 502, f"malformed routing from prefill: {e}") from e
    if p is not None and p.num_tokens == 0:
        raise UpstreamError(
            "client",
            400,
            f"routed_experts_prompt_start={start} is not below the prompt's length "
            "(prefill returned no rows)",
        )


_MISSING_SIDE = re.compile(r"missing routing on the (prefill|decode) side")


def _merge_error(e: rx.RoutedExpertsError) -> UpstreamError:
    missing = _MISSING_SIDE.search(str(e))
    if missing:
        return UpstreamError(missing.group(1), 502, str(e))
    if isinstance(e, rx.MergeError):
        return UpstreamError("merge", 502, f"prefill and decode routing do not merge: {e}")
    return UpstreamError("merge", 502, f"malformed routing from an upstream: {e}")


def _stream_error(e: rx.RoutedExpertsError) -> bytes:
    err = _merge_error(e)
    if "without data: [DONE]" in str(e):
        err = UpstreamError("decode", 502, "the decode stream ended before data: [DONE]")
    return error_event(err.status, err.side, err.message)


def _merge(prefill_body: bytes, decode_body: bytes, start: int | None) -> bytes:
    try:
        return rx.merge_response(prefill_body, decode_body, start=start, require_routing=True)
    except rx.RoutedExpertsError as e:
        raise _merge_error(e) from e


def _status_error(side: str, url: str, status: int, content: bytes) -> UpstreamError:
    # A 4xx is about the client's request: pass its status on. A 5xx is the upstream's fault.
    text = content[:2000].decode(errors="replace")
    log.warning("%s server %s answered %s: %s", side, url, status, text)
    return UpstreamError(
        side, status if status < 500 else 502, f"the {side} server answered {status}: {text}"
    )


def create_app(
    prefill: Sequence[str],
    decode: Sequence[str],
    client: httpx.AsyncClient | None = None,
    timeout: float = 600.0,
    connect_timeout: float = 10.0,
    upstream_api_key: str | None = None,
) -> Starlette:
    """The proxy as an ASGI app: mount it in your own app, or serve it with uvicorn.
    `client` may carry your own transport (e.g. `httpx.ASGITransport` to an in-process engine).
    `timeout` bounds reading from an upstream, `connect_timeout` connecting to one;
    `upstream_api_key` replaces the client's `Authorization` towards the servers."""
    proxy = PDProxy(
        prefill,
        decode,
        client=client,
        timeout=timeout,
        connect_timeout=connect_timeout,
        upstream_api_key=upstream_api_key,
    )
    routes = [Route(path, proxy.handle, methods=["POST"]) for path in ENDPOINTS]
    routes.append(Route("/health", proxy.health, methods=["GET"]))
    routes.append(Route("/healthcheck", proxy.healthcheck, methods=["GET"]))
    routes.append(Route("/v1/models", proxy.models, methods=["GET"]))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        if client is None:  # ours to close; a client the caller gave stays theirs
            await proxy.client.aclose()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.proxy = proxy
    return app


def serve(
    prefill: Sequence[str],
    decode: Sequence[str],
    host: str,
    port: int,
    timeout: float = 600.0,
    connect_timeout: float = 10.0,
    upstream_api_key: str | None = None,
) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    app = create_app(
        prefill,
        decode,
        timeout=timeout,
        connect_timeout=connect_timeout,
        upstream_api_key=upstream_api_key,
    )
    uvicorn.run(app, host=host, port=port)
