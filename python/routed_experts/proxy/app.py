"""The proxy as a plain ASGI app: vLLM's disaggregated protocol in front of prefill and decode
servers, every response's routing merged by absolute position.

Bodies stay bytes from end to end: the client's request is the only JSON parsed in Python (it is
small); the prefill body is read by the Rust scanner (`kv_transfer_params` and the routing's row
counts, one walk, GIL released), and the decode body or stream is merged by it. Upstreams are
called with aiohttp (its C parser reads a 4 MB body at a quarter of httpx's CPU cost).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import orjson

import routed_experts as rx
from routed_experts._core import StreamMerger, _read_prefill

from .config import ProxyConfig
from .metrics import Metrics
from .protocol import (
    ENDPOINTS,
    REQUEST_ID,
    BodyError,
    UpstreamError,
    decode_request,
    encode_request,
    error_body,
    error_event,
    parse_client_body,
    prefill_request,
)
from .upstreams import FAILED, OK, UNKNOWN, Lease, Pool, Upstream

log = logging.getLogger("routed_experts.proxy")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
T = TypeVar("T")

MiB = 1024 * 1024
# Bodies at least this large are read or merged on a worker thread (the Rust core releases the
# GIL), so the event loop keeps serving other requests meanwhile. Smaller ones are handled in
# the loop: their Rust work takes a millisecond or two, and a hand-off to a thread cost more
# CPU than that saves (measured at 8192 x 48 x 8, 32 in flight: 10.2 ms of proxy CPU per
# request with both of a request's bodies handed off, 9.4 ms with neither).
OFFLOAD_BYTES = 8 * MiB
# When every server of a side is out of rotation, one is probed (GET /health) before a request
# is refused: at most once a second, answered within two seconds (or --connect-timeout).
PROBE_INTERVAL = 1.0
PROBE_TIMEOUT = 2.0


@dataclass
class Exchange:
    """One client request on its way: what the log line and the metrics report."""

    request_id: str
    endpoint: str
    began: float = field(default_factory=time.perf_counter)
    status: int = 0
    side: str = "none"
    stream: bool = False
    prefill: str = "-"
    decode: str = "-"
    seconds: dict[str, float] = field(default_factory=dict)
    bytes_out: int = 0
    finished: bool = False  # the last byte of the response was handed to the server


class PDProxy:
    """Round robin over prefill and decode servers; merge routing on every response.

    Both halves of a request carry one request id (the client's `X-Request-Id`, or a new one),
    which comes back to the client; the client's `Authorization` (or `upstream_api_key`) goes to
    both. Upstream addresses appear in the log, /health and /metrics, never in what a completion
    request gets back. Call it as an ASGI app; `aclose()` closes its connection pool.
    """

    def __init__(
        self, prefill: Sequence[str], decode: Sequence[str], config: ProxyConfig | None = None
    ) -> None:
        self.config = config = config or ProxyConfig()
        self.metrics = Metrics()
        self.prefill = Pool(
            "prefill", prefill, config.eject_after, config.eject_seconds, self._health_changed
        )
        self.decode = Pool(
            "decode", decode, config.eject_after, config.eject_seconds, self._health_changed
        )
        for u in self.prefill.upstreams + self.decode.upstreams:
            self.metrics.upstream_healthy.labels(u.side, u.url).set(1)
        self.in_flight = 0
        self.buffered = 0  # bytes of client bodies being received (max_buffered_bytes)
        self._session: aiohttp.ClientSession | None = None

    # --- ASGI -----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = _route(scope), scope["method"]
        # Exact routes: a path that merely ends like one (`/admin/v1/completions`,
        # `/etc/passwd/metrics`) is a 404, so an ingress's path rules cannot be walked around.
        if path in ENDPOINTS:
            if method != "POST":
                err = UpstreamError("client", 405, f"{path} takes POST", allow="POST")
                await self._error(send, err, [])
                return
            await self._completion(scope, receive, send, path)
            return
        routes = {
            "/v1/models": self._models,
            "/healthcheck": self._healthcheck,
            "/health": self._health,
            "/metrics": self._metrics,
        }
        handler = routes.get(path)
        if handler is None:
            await self._error(send, UpstreamError("client", 404, f"no {method} {path}"), [])
            return
        if method not in ("GET", "HEAD"):
            err = UpstreamError("client", 405, f"{path} takes GET", allow="GET, HEAD")
            await self._error(send, err, [])
            return
        await handler(scope, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def aclose(self) -> None:
        """Close the connection pool (the app opens a new one if it is called again)."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def session(self) -> aiohttp.ClientSession:
        """The upstream connection pool, made in the running loop on first use. Connections are
        pooled per upstream (up to `max_in_flight` each, no shared cap), so a server that holds
        its connections cannot starve requests to the others."""
        if self._session is None or self._session.closed:
            c = self.config
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=c.max_in_flight, keepalive_timeout=4.0
            )
            timeout = aiohttp.ClientTimeout(
                total=None, connect=None, sock_connect=c.connect_timeout, sock_read=c.read_timeout
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=timeout,
                read_bufsize=MiB,
                skip_auto_headers=("Accept-Encoding",),
            )
        return self._session

    # --- completions ----------------------------------------------------------------------

    async def _completion(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        ex = Exchange(_request_id(scope), endpoint)
        ids = [(REQUEST_ID.encode(), ex.request_id.encode())]
        # The body first, within --body-timeout and the budget of bodies being received: a
        # request takes a completion slot only once its body is whole, so clients that drip
        # their bodies cannot hold the slots that real requests need.
        try:
            raw = await self._receive_body(scope, receive)
        except ClientGone:
            ex.status, ex.side = 499, "client"
            self._record(ex)
            return
        except UpstreamError as e:
            await self._finish(ex, send, e, ids)
            self._record(ex)
            return
        if self.in_flight >= self.config.max_in_flight:
            self.metrics.rejected.labels("in_flight").inc()
            err = UpstreamError(
                "proxy",
                503,
                f"the proxy is serving its limit of {self.config.max_in_flight} requests",
                retry_after=1,
            )
            await self._finish(ex, send, err, ids)
            self._record(ex)
            return
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            # The body is read: from now on a message from the server means the client left
            # (or the response is complete), and a client that left cancels the work.
            work = asyncio.ensure_future(self._serve(ex, raw, scope, send, ids))
            watch = asyncio.ensure_future(_disconnected(receive))
            try:
                await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watch.cancel()
                if not work.done() and not ex.finished:
                    # Stop the upstream calls: their connections close, so the servers stop
                    # generating for a client that is gone.
                    work.cancel()
                    ex.status, ex.side = 499, "client"
                    with contextlib.suppress(asyncio.CancelledError):
                        await work
                else:
                    await work
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            self._record(ex)

    async def _receive_body(self, scope: Scope, receive: Receive) -> bytes:
        """The client's whole body, or an UpstreamError: 413 past --max-request-bytes, 408
        past --body-timeout, 503 past --max-buffered-bytes of bodies being received at once
        (each closes the connection: its unread rest must not be read as another request)."""
        c = self.config
        budget = _Budget(self, c.max_buffered_bytes)
        try:
            return await asyncio.wait_for(
                _read_request(scope, receive, c.max_request_bytes, budget), c.body_timeout
            )
        except asyncio.TimeoutError:
            self.metrics.rejected.labels("body_timeout").inc()
            raise UpstreamError(
                "client", 408, f"the request body did not arrive within {c.body_timeout:g} s",
                close=True,
            ) from None
        finally:
            budget.release()

    async def _serve(
        self, ex: Exchange, raw: bytes, scope: Scope, send: Send, ids: list[Any]
    ) -> None:
        try:
            try:
                body = parse_client_body(raw)
            except BodyError as e:
                err = UpstreamError("client", 400, f"invalid request body: {e}", param=e.param)
                raise err from None
            ex.stream = bool(body.get("stream"))
            await self._exchange(ex, scope, body, send, ids)
        except UpstreamError as e:
            log.warning("%s %s %s: %s", ex.request_id, ex.endpoint, e.side, e.message)
            await self._finish(ex, send, e, ids)

    async def _exchange(
        self, ex: Exchange, scope: Scope, body: dict[str, Any], send: Send, ids: list[Any]
    ) -> None:
        headers = self._upstream_headers(scope, ex.request_id)
        chat = ex.endpoint.endswith("chat/completions")
        # A decode server first: with none to take the request, it is refused before a prefill
        # server computes a KV cache that no decode would ever fetch.
        lease = await self._lease(self.decode)
        try:
            await self._prefill_then_decode(ex, body, chat, headers, lease, send, ids)
        except BaseException:
            # `ex.decode` is set as the decode call starts, and that call releases the lease
            # itself; before it, nothing was learnt of the server's health.
            if ex.decode == "-":
                self._released(lease, UNKNOWN)
            raise

    async def _prefill_then_decode(
        self,
        ex: Exchange,
        body: dict[str, Any],
        chat: bool,
        headers: dict[str, str],
        lease: Lease,
        send: Send,
        ids: list[Any],
    ) -> None:
        # The requested prompt start: what vLLM's .npy routing (which carries none) starts at.
        start = body.get("routed_experts_prompt_start")
        try:
            prefill_json = encode_request(prefill_request(body, chat))
        except BodyError as e:
            raise UpstreamError("client", 400, f"invalid request body: {e}") from None
        prefill_body = await self._prefill(ex, prefill_json, headers)
        try:
            kv, rows = await _offload(
                len(prefill_body),
                _read_prefill,
                prefill_body,
                start=start,
                count_rows=start is not None,
            )
        except rx.RoutedExpertsError as e:
            raise UpstreamError("prefill", 502, f"malformed prefill body: {e}") from e
        if start is not None and 0 in rows:
            raise UpstreamError(
                "client",
                400,
                f"routed_experts_prompt_start={start} is not below the prompt's length "
                "(prefill returned no rows)",
                param="routed_experts_prompt_start",
            )
        # Cannot fail: the same body was written for prefill above, one level shallower.
        decode_json = decode_request(body, kv)
        ex.decode = lease.upstream.url
        if ex.stream:
            await self._stream(ex, lease, decode_json, headers, prefill_body, start, send, ids)
            return
        decode_body = await self._fetch(ex, lease, decode_json, headers)
        began = time.perf_counter()
        merged = await _offload(len(decode_body), _merge, prefill_body, decode_body, start)
        ex.seconds["merge"] = time.perf_counter() - began
        self.metrics.merged_bytes.inc(len(merged))
        ex.status = 200
        await _respond(send, 200, merged, ids)
        ex.bytes_out, ex.finished = len(merged), True

    async def _prefill(self, ex: Exchange, data: bytes, headers: dict[str, str]) -> bytes:
        """The prefill call; a server that could not be connected to is replaced by the next."""
        lease = await self._lease(self.prefill)
        ex.prefill = lease.upstream.url
        try:
            return await self._fetch(ex, lease, data, headers)
        except UpstreamError as e:
            retry = self.prefill.pick(avoid=lease.upstream) if e.retryable else None
            if retry is None:
                raise
            log.warning(
                "%s prefill %s unreachable, retrying on %s",
                ex.request_id,
                lease.upstream.url,
                retry.upstream.url,
            )
            ex.prefill = retry.upstream.url
            return await self._fetch(ex, retry, data, headers)

    async def _lease(self, pool: Pool) -> Lease:
        """The next upstream of `pool`. When every one is out of rotation, the one due first
        is probed (`GET /health`, at most once a second) and serves the request if it answers:
        failures alone never shut the last server of a side out. Else 503 + Retry-After."""
        lease = pool.pick()
        if lease is None:
            lease = await self._probe(pool)
        if lease is None:
            self.metrics.rejected.labels("no_upstream").inc()
            raise UpstreamError(
                "proxy",
                503,
                f"no {pool.side} server is in rotation (each failed repeatedly, and none "
                "answered a health probe)",
                retry_after=pool.retry_after(),
            )
        return lease

    async def _probe(self, pool: Pool) -> Lease | None:
        u = pool.probe_candidate(PROBE_INTERVAL)
        if u is None:
            return None
        answered = False
        try:
            timeout = aiohttp.ClientTimeout(total=min(self.config.connect_timeout, PROBE_TIMEOUT))
            async with self.session().get(u.url + "/health", timeout=timeout) as r:
                answered = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        finally:
            lease = pool.probed(u, answered)
        if answered:
            log.warning("%s server %s answered a health probe: trying it", pool.side, u.url)
        return lease

    async def _fetch(
        self, ex: Exchange, lease: Lease, data: bytes, headers: dict[str, str]
    ) -> bytes:
        """POST to an upstream and read its JSON reply, recording the upstream's health."""
        u, side = lease.upstream, lease.upstream.side
        began, outcome = time.perf_counter(), UNKNOWN
        try:
            async with self.session().post(u.url + ex.endpoint, data=data, headers=headers) as r:
                content = await _read_limited(r, self.config.max_upstream_bytes, side)
                outcome = FAILED if r.status >= 500 else OK
                if r.status >= 400:
                    raise _status_error(u, r.status, content)
                if not r.headers.get("content-type", "").startswith("application/json"):
                    log.warning("%s server %s answered %s", side, u.url, r.content_type)
                    raise UpstreamError(side, 502, f"the {side} server did not answer with JSON")
                return content
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            outcome = FAILED
            raise _upstream_failed(u, e) from e
        finally:
            self._released(lease, outcome)
            ex.seconds[side] = ex.seconds.get(side, 0.0) + time.perf_counter() - began

    async def _stream(
        self,
        ex: Exchange,
        lease: Lease,
        data: bytes,
        headers: dict[str, str],
        prefill_body: bytes,
        start: int | None,
        send: Send,
        ids: list[Any],
    ) -> None:
        u = lease.upstream
        began, outcome = time.perf_counter(), UNKNOWN
        response: aiohttp.ClientResponse | None = None
        try:
            try:
                response = await self.session().post(
                    u.url + ex.endpoint, data=data, headers=headers
                )
                if response.status >= 400:
                    content = await _read_limited(
                        response, self.config.max_upstream_bytes, "decode"
                    )
                    outcome = FAILED if response.status >= 500 else OK
                    raise _status_error(u, response.status, content)
                if response.content_type != "text/event-stream":
                    outcome = OK
                    log.warning("decode server %s answered %s", u.url, response.content_type)
                    raise UpstreamError(
                        "decode", 502, "the decode server did not answer with a stream"
                    )
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                outcome = FAILED
                raise _upstream_failed(u, e) from e
            # Headers go out now: from here on, failures are reported in-band.
            ex.status = 200
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), *ids],
                }
            )
            merger = StreamMerger(prefill_body, start, self.config.max_upstream_bytes)
            outcome, tail = await self._relay(ex, u, response, merger, send)
            self.metrics.merged_bytes.inc(merger.merged_bytes)
            await send({"type": "http.response.body", "body": tail})
            ex.bytes_out += len(tail)
            ex.finished = True
        finally:
            if response is not None:
                response.close()
            self._released(lease, outcome)
            ex.seconds["decode"] = time.perf_counter() - began

    async def _relay(
        self,
        ex: Exchange,
        u: Upstream,
        response: aiohttp.ClientResponse,
        merger: StreamMerger,
        send: Send,
    ) -> tuple[str, bytes]:
        """Relay the decode stream through the merger; return the upstream's outcome and the
        last bytes to send (the stream's end, or an error event)."""
        try:
            async for chunk in response.content.iter_any():
                if merger.buffered + len(chunk) >= OFFLOAD_BYTES and b"\n" in chunk:
                    pieces = await asyncio.to_thread(merger.feed, chunk)
                else:
                    pieces = merger.feed(chunk)
                for piece in pieces:
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                    ex.bytes_out += len(piece)
            return OK, b"".join(merger.finish())
        except rx.RoutedExpertsError as e:
            # Headers are sent: report in-band, once, and end the stream.
            err = _stream_error(e)
            return OK, self._in_band(ex, err)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            err = _upstream_failed(u, e)
            return FAILED, self._in_band(ex, err)

    def _in_band(self, ex: Exchange, err: UpstreamError) -> bytes:
        log.warning("%s %s stream %s: %s", ex.request_id, ex.endpoint, err.side, err.message)
        ex.side = err.side
        return error_event(err.status, err.side, err.message)

    # --- other routes ---------------------------------------------------------------------

    async def _models(self, scope: Scope, send: Send) -> None:
        """`GET /v1/models`, relayed from a decode server (clients call it first)."""
        request_id = _request_id(scope)
        ids = [(REQUEST_ID.encode(), request_id.encode())]
        try:
            lease = await self._lease(self.decode)
            outcome = UNKNOWN
            try:
                async with self.session().get(
                    lease.upstream.url + "/v1/models",
                    headers=self._upstream_headers(scope, request_id),
                ) as r:
                    content = await _read_limited(r, self.config.max_upstream_bytes, "decode")
                    outcome = FAILED if r.status >= 500 else OK
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                outcome = FAILED
                raise _upstream_failed(lease.upstream, e) from e
            finally:
                self._released(lease, outcome)
        except UpstreamError as e:
            await self._error(send, e, ids)
            return
        await _respond(send, r.status, content, ids)

    async def _healthcheck(self, scope: Scope, send: Send) -> None:
        # What vLLM's example disaggregated proxy answers: the proxy itself is up.
        await _respond(send, 200, b'{"status":"ok"}', [])

    async def _health(self, scope: Scope, send: Send) -> None:
        """Each upstream's passive health; 503 when a side has no server in rotation."""
        ok = self.prefill.any_healthy() and self.decode.any_healthy()
        doc = {
            "status": "ok" if ok else "unavailable",
            "in_flight": self.in_flight,
            "prefill": self.prefill.status(),
            "decode": self.decode.status(),
        }
        await _respond(send, 200 if ok else 503, orjson.dumps(doc), [])

    async def _metrics(self, scope: Scope, send: Send) -> None:
        body = self.metrics.render()
        await _respond(send, 200, body, [], content_type=self.metrics.content_type.encode())

    # --- bookkeeping ----------------------------------------------------------------------

    def _upstream_headers(self, scope: Scope, request_id: str) -> dict[str, str]:
        headers = {"content-type": "application/json", REQUEST_ID: request_id}
        auth = _header(scope, b"authorization")
        if self.config.upstream_api_key:
            auth = f"Bearer {self.config.upstream_api_key}"
        if auth:
            headers["authorization"] = auth
        return headers

    def _released(self, lease: Lease, outcome: str) -> None:
        pool = self.prefill if lease.upstream.side == "prefill" else self.decode
        pool.release(lease, outcome)
        if outcome == FAILED:
            self.metrics.upstream_failures.labels(lease.upstream.side, lease.upstream.url).inc()

    def _health_changed(self, u: Upstream, healthy: bool) -> None:
        self.metrics.upstream_healthy.labels(u.side, u.url).set(1 if healthy else 0)

    async def _finish(self, ex: Exchange, send: Send, err: UpstreamError, ids: list[Any]) -> None:
        ex.status, ex.side = err.status, err.side
        await self._error(send, err, ids)
        ex.finished = True

    async def _error(self, send: Send, err: UpstreamError, ids: list[Any]) -> None:
        headers = list(ids)
        if err.retry_after is not None:
            headers.append((b"retry-after", str(err.retry_after).encode()))
        if err.allow is not None:
            headers.append((b"allow", err.allow.encode()))
        if err.close:
            headers.append((b"connection", b"close"))
        body = error_body(err.status, err.side, err.message, err.param)
        await _respond(send, err.status, body, headers)

    def _record(self, ex: Exchange) -> None:
        total = time.perf_counter() - ex.began
        m = self.metrics
        m.requests.labels(ex.endpoint, str(ex.status), ex.side).inc()
        m.observe("total", total)
        for phase, seconds in ex.seconds.items():
            m.observe(phase, seconds)
        ms = {p: ex.seconds.get(p, 0.0) * 1e3 for p in ("prefill", "decode", "merge")}
        log.info(
            "request_id=%s endpoint=%s status=%d side=%s stream=%s prefill=%s decode=%s "
            "prefill_ms=%.1f decode_ms=%.1f merge_ms=%.1f total_ms=%.1f bytes_out=%d",
            ex.request_id,
            ex.endpoint,
            ex.status,
            ex.side,
            str(ex.stream).lower(),
            ex.prefill,
            ex.decode,
            ms["prefill"],
            ms["decode"],
            ms["merge"],
            total * 1e3,
            ex.bytes_out,
        )


# --- helpers ----------------------------------------------------------------------------------


def keep_freed_memory(threshold: int = 512 * MiB) -> bool:
    """Ask glibc to serve buffers below `threshold` bytes from its heap and to keep what is freed
    there, instead of mapping fresh pages for each multi-MB body and returning them when it is
    freed. Every request reads and writes several MB: with fresh mappings each byte is a page
    fault first (measured: the proxy's kernel time halves). Resident memory then stays at its
    peak instead of falling between bursts. Process-wide, so `serve()` calls it and a mounted
    app leaves it to its host; False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, threshold)) and bool(
        mallopt(m_trim_threshold, 2 * threshold)
    )


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


# A client's request id is kept only when it is short and printable without spaces, so it can
# neither bloat every upstream request nor forge fields in the log line; otherwise it is replaced.
MAX_REQUEST_ID = 128


def _request_id(scope: Scope) -> str:
    """The client's `X-Request-Id` when it is 1 to 128 printable ASCII characters without
    spaces, else a new one: what both halves and the response carry."""
    given = _header(scope, REQUEST_ID.encode())
    if given and len(given) <= MAX_REQUEST_ID and all("!" <= c <= "~" for c in given):
        return given
    return f"rx-{uuid.uuid4().hex}"


def _route(scope: Scope) -> str:
    """The request's path below the app's mount point (`root_path`, when mounted)."""
    path = str(scope["path"])
    root = str(scope.get("root_path", ""))
    if root and path.startswith(root):
        path = path[len(root) :]
    return path or "/"


async def _offload(size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run `fn` (Rust work with the GIL released) on a worker thread when its input is large."""
    if size >= OFFLOAD_BYTES:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


class _Budget:
    """The bytes of one client body counted against the proxy's budget of bodies being
    received at once (`max_buffered_bytes`), given back when the body is read or dropped."""

    def __init__(self, proxy: PDProxy, limit: int) -> None:
        self.proxy, self.limit, self.held = proxy, limit, 0

    def take(self, n: int) -> None:
        if self.proxy.buffered + n > self.limit:
            self.proxy.metrics.rejected.labels("buffered_bytes").inc()
            raise UpstreamError(
                "proxy",
                503,
                f"the proxy is receiving its limit of {self.limit} bytes of request bodies",
                retry_after=1,
                close=True,
            )
        self.proxy.buffered += n
        self.held += n

    def release(self) -> None:
        self.proxy.buffered -= self.held
        self.held = 0


async def _read_request(scope: Scope, receive: Receive, limit: int, budget: _Budget) -> bytes:
    """The client's body, refused with 413 past `limit` bytes (by its Content-Length before
    anything is read, else as it arrives), each chunk taken from `budget` as it arrives."""
    declared = _header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        budget.take(len(chunk))
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class ClientGone(Exception):
    """The client disconnected before its request was read."""


def _too_large(size: int, limit: int) -> UpstreamError:
    return UpstreamError(
        "client", 413, f"the request body is {size} bytes, over the limit of {limit}", close=True
    )


async def _disconnected(receive: Receive) -> None:
    """Returns when the server reports the client gone (or, in some servers, the response
    complete): what cancels a request's upstream calls."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _read_limited(r: aiohttp.ClientResponse, limit: int, side: str) -> bytes:
    """An upstream's whole body, refused (502) past `limit` bytes, by its Content-Length before
    reading, else as it arrives (also bounding what a compressed body inflates to)."""
    if r.content_length is not None and r.content_length > limit:
        raise _upstream_too_large(side, r.content_length, limit)
    chunks, size = [], 0
    # iter_chunks hands over the parser's pieces one by one (iter_any would join what is
    # buffered first): the one join below is the only copy made here.
    async for chunk, _ in r.content.iter_chunks():
        size += len(chunk)
        if size > limit:
            raise _upstream_too_large(side, size, limit)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _upstream_too_large(side: str, size: int, limit: int) -> UpstreamError:
    return UpstreamError(
        side,
        502,
        f"the {side} server's reply is {'at least ' if size > limit else ''}{size} bytes, over "
        f"the limit of {limit} (--max-upstream-bytes)",
    )


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    headers: list[Any],
    content_type: bytes = b"application/json",
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _upstream_failed(u: Upstream, e: BaseException) -> UpstreamError:
    """A server that could not be reached or read: its address in the log, not to the client.
    A timeout is a 504; a connection never made may be retried elsewhere."""
    log.warning("%s server %s failed: %r", u.side, u.url, e)
    if isinstance(e, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
        return UpstreamError(
            u.side,
            502,
            f"the {u.side} server could not be reached: {type(e).__name__}",
            retryable=True,
        )
    if isinstance(e, asyncio.TimeoutError):
        return UpstreamError(
            u.side, 504, f"the {u.side} server did not answer in time (read timeout)"
        )
    return UpstreamError(u.side, 502, f"the {u.side} server failed: {type(e).__name__}")


def _status_error(u: Upstream, status: int, content: bytes) -> UpstreamError:
    # A 4xx is about the client's request: pass its status on. A 5xx is the upstream's fault.
    text = content[:2000].decode(errors="replace")
    log.warning("%s server %s answered %s: %s", u.side, u.url, status, text)
    return UpstreamError(
        u.side, status if status < 500 else 502, f"the {u.side} server answered {status}: {text}"
    )


_MISSING_SIDE = ("prefill", "decode")


def _merge_error(e: rx.RoutedExpertsError) -> UpstreamError:
    text = str(e)
    for side in _MISSING_SIDE:
        if f"missing routing on the {side} side" in text:
            return UpstreamError(side, 502, text)
    if isinstance(e, rx.MergeError):
        return UpstreamError("merge", 502, f"prefill and decode routing do not merge: {e}")
    return UpstreamError("merge", 502, f"malformed routing from an upstream: {e}")


def _stream_error(e: rx.RoutedExpertsError) -> UpstreamError:
    if "without data: [DONE]" in str(e):
        return UpstreamError("decode", 502, "the decode stream ended before data: [DONE]")
    if "decode stream: a line of more than" in str(e):
        return UpstreamError("decode", 502, str(e))
    return _merge_error(e)


def _merge(prefill_body: bytes, decode_body: bytes, start: int | None) -> bytes:
    try:
        return rx.merge_response(prefill_body, decode_body, start=start, require_routing=True)
    except rx.RoutedExpertsError as e:
        raise _merge_error(e) from e
