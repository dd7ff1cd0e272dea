"""A prefill/decode (P/D) proxy that merges routed experts: vLLM's disaggregated-serving protocol
in front of prefill and decode servers, with every response's routing merged by absolute position.

Use it as a command (`routed-experts proxy`), mount `create_app(...)` in your own ASGI app, or call
the pieces (`prefill_request`, `decode_request`, `StreamMerger`) from your own router. It needs the
`proxy` extra: aiohttp (upstream calls), orjson (the client's JSON), prometheus-client
(`/metrics`), and uvicorn with uvloop and httptools (the server of `routed-experts proxy`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .app import PDProxy, ProxyConfig, keep_freed_memory
from .protocol import (
    ENDPOINTS,
    PREFILL_KV_TRANSFER_PARAMS,
    REQUEST_ID,
    UpstreamError,
    decode_request,
    error_body,
    parse_client_body,
    prefill_request,
)
from .stream import StreamMerger

__all__ = [
    "ENDPOINTS",
    "PREFILL_KV_TRANSFER_PARAMS",
    "REQUEST_ID",
    "PDProxy",
    "ProxyConfig",
    "StreamMerger",
    "UpstreamError",
    "create_app",
    "keep_freed_memory",
    "decode_request",
    "error_body",
    "parse_client_body",
    "prefill_request",
    "serve",
]


def create_app(
    prefill: Sequence[str],
    decode: Sequence[str],
    config: ProxyConfig | None = None,
    **settings: Any,
) -> PDProxy:
    """The proxy as an ASGI app: mount it in your own app, or serve it with any ASGI server.
    `settings` are `ProxyConfig` fields (`read_timeout=30`, `max_in_flight=64`, ...), applied on
    top of `config`. Mounted inside another app, its lifespan does not run: call `await
    app.aclose()` on shutdown to close its connection pool."""
    if settings:
        base = config or ProxyConfig()
        config = ProxyConfig(**{**base.__dict__, **settings})
    return PDProxy(prefill, decode, config)


def serve(
    prefill: Sequence[str],
    decode: Sequence[str],
    host: str,
    port: int,
    config: ProxyConfig | None = None,
    log_level: str = "info",
) -> None:
    """Serve the proxy with uvicorn (its "auto" choices take uvloop and httptools, which the
    proxy extra installs). One log line per request comes from the proxy, so uvicorn's access
    log is off."""
    import uvicorn

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    keep_freed_memory()
    logging.getLogger("routed_experts.proxy").info(
        "routed-experts proxy on http://%s:%d; prefill %s; decode %s",
        host, port, " ".join(prefill), " ".join(decode),
    )
    uvicorn.run(
        create_app(prefill, decode, config),
        host=host,
        port=port,
        access_log=False,
        log_level=log_level,
    )
