"""The proxy as an ASGI app, to mount in your own app: a relay to the Rust data plane, which the
app runs on a private loopback port on a thread of its own. Every rule of the proxy (the
protocol, merging, errors, limits, metrics) is the Rust data plane's; this module only carries
requests and responses across (with aiohttp, from the `proxy` extra)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import aiohttp
import yarl

from .config import ProxyConfig
from .server import ProxyServer

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Headers about one hop, not the request: never relayed (RFC 9110 §7.6.1). The relay sets
# its own length or chunking for each side.
_HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"transfer-encoding",
    b"te",
    b"trailer",
    b"upgrade",
    b"host",
    b"content-length",
}


class PDProxy:
    """The proxy as an ASGI app. Its data plane (the same as `routed-experts proxy`) starts on
    the first request; `aclose()` stops it (a mounted app's own lifespan does not run, so call
    it from your app's shutdown). The server's own limits (header timeout, connection cap)
    are those of the ASGI server that hosts the app; the rest are `config`'s."""

    def __init__(
        self, prefill: Sequence[str], decode: Sequence[str], config: ProxyConfig | None = None
    ) -> None:
        self.config = config or ProxyConfig()
        self.prefill_urls, self.decode_urls = list(prefill), list(decode)
        self._server: ProxyServer | None = None
        self._lock = threading.Lock()
        self._session: aiohttp.ClientSession | None = None

    def _base_url(self) -> str:
        with self._lock:
            if self._server is None:
                self._server = ProxyServer(self.prefill_urls, self.decode_urls, self.config)
                self._server.__enter__()
            return self._server.url

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No timeouts of the relay's own: the data plane's apply, and it always answers.
            timeout = aiohttp.ClientTimeout(total=None)
            connector = aiohttp.TCPConnector(limit=0)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=timeout,
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            )
        return self._session

    async def aclose(self) -> None:
        """Stop the data plane and close the relay's connections (a later request starts it
        again)."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            await asyncio.to_thread(server.__exit__, None, None, None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        url = self._base_url() + _route(scope)
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k.lower() not in _HOP_BY_HOP
        ]
        body_done, gone = asyncio.Event(), asyncio.Event()
        method = scope["method"]
        body = None if method in ("GET", "HEAD") else _body(receive, body_done, gone)
        if body is None:
            body_done.set()
        relay = asyncio.ensure_future(self._relay(method, url, headers, body, gone, send))
        watch = asyncio.ensure_future(_disconnected(receive, body_done))
        try:
            await asyncio.wait({relay, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not relay.done():
                # The client left: closing the relay's connection tells the data plane, which
                # cancels the upstream calls.
                relay.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await relay

    async def _relay(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: AsyncIterator[bytes] | None,
        gone: asyncio.Event,
        send: Send,
    ) -> None:
        # The path goes as the client wrote it (`encoded`: no `..` resolved on the way), so the
        # data plane's exact routes judge what the client sent.
        target = yarl.URL(url, encoded=True)
        started = False
        try:
            async with self._client().request(method, target, headers=headers, data=body) as r:
                # Its length, and `connection: close` when the data plane ends the connection
                # (after a 408, 413 or 503 the client's unread rest must not be read as a
                # request).
                keep = {b"content-length", b"connection"}
                out = [
                    (k.lower(), v)
                    for k, v in r.raw_headers
                    if k.lower() not in _HOP_BY_HOP or k.lower() in keep
                ]
                await send({"type": "http.response.start", "status": r.status, "headers": out})
                started = True
                async for chunk in r.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except aiohttp.ClientError as e:
            if started or gone.is_set():
                # Broken off mid-response (the client sees the connection end), or the client
                # left while its body was relayed: nobody to answer.
                return
            # Never a plain-text 500: the relay's own failure, in the proxy's error shape.
            message = f"the proxy's server could not be reached: {type(e).__name__}"
            error = {"message": message, "type": "upstream_error", "param": None,
                     "side": "proxy", "code": 502, "kind": None}
            content = json.dumps({"error": error}).encode()
            headers_out = [(b"content-type", b"application/json"),
                           (b"content-length", str(len(content)).encode())]
            await send({"type": "http.response.start", "status": 502, "headers": headers_out})
            await send({"type": "http.response.body", "body": content})
            return
        await send({"type": "http.response.body", "body": b""})


async def _body(
    receive: Receive, done: asyncio.Event, gone: asyncio.Event
) -> AsyncIterator[bytes]:
    """The client's body as it arrives (the data plane applies its size and time limits); a
    client that leaves ends the relay's request with an error, and sets `gone`."""
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
                raise ConnectionResetError("the client left")
            chunk = message.get("body", b"")
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                return
    finally:
        done.set()


async def _disconnected(receive: Receive, body_done: asyncio.Event) -> None:
    """Returns when the server reports the client gone (after the body was read: before, the
    body's reader sees it)."""
    await body_done.wait()
    while (await receive())["type"] != "http.disconnect":
        pass


def _route(scope: Scope) -> str:
    """The request's path below the app's mount point (`root_path`, when mounted), as sent."""
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if raw else str(scope["path"])
    root = str(scope.get("root_path", ""))
    if root and path.startswith(root):
        path = path[len(root) :]
    return path.split("?", 1)[0] or "/"
