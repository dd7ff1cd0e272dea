"""A prefill/decode (P/D) proxy that merges routed experts: vLLM's disaggregated-serving protocol
in front of prefill and decode servers, with every response's routing merged by absolute position.

Two data planes speak the same protocol and pass the same tests:

- `ProxyServer` / `serve` (what `routed-experts proxy` runs): Rust, inside the extension (tokio
  and hyper), with the GIL released. It needs no extra and carries the server's own limits:
  header timeout and size, connection cap, request and write timeouts, drained shutdown.
- `create_app(...)`: the proxy as a Python ASGI app, to mount in your own app (needs the `proxy`
  extra: aiohttp, orjson, prometheus-client, uvicorn). Mounted, it has the limits of the
  server that hosts it. The pieces (`prefill_request`, `decode_request`) are there for your own
  router, and `StreamMerger` (the Rust data plane's stream merge, no extra needed).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from routed_experts._core import StreamMerger

from .config import ProxyConfig
from .server import ProxyServer, configure_logging, serve

if TYPE_CHECKING:  # the Python data plane: imported on first use (it needs the proxy extra)
    from .app import PDProxy, keep_freed_memory
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

__all__ = [
    "ENDPOINTS",
    "PREFILL_KV_TRANSFER_PARAMS",
    "REQUEST_ID",
    "PDProxy",
    "ProxyConfig",
    "ProxyServer",
    "StreamMerger",
    "UpstreamError",
    "create_app",
    "keep_freed_memory",
    "decode_request",
    "error_body",
    "parse_client_body",
    "prefill_request",
    "serve",
    "serve_asgi",
]

_LAZY = {
    "PDProxy": "app",
    "keep_freed_memory": "app",
    "ENDPOINTS": "protocol",
    "PREFILL_KV_TRANSFER_PARAMS": "protocol",
    "REQUEST_ID": "protocol",
    "UpstreamError": "protocol",
    "decode_request": "protocol",
    "error_body": "protocol",
    "parse_client_body": "protocol",
    "prefill_request": "protocol",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


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
    from .app import PDProxy

    if settings:
        base = config or ProxyConfig()
        config = ProxyConfig(**{**base.__dict__, **settings})
    return PDProxy(prefill, decode, config)


def serve_asgi(
    prefill: Sequence[str],
    decode: Sequence[str],
    host: str,
    port: int,
    config: ProxyConfig | None = None,
    log_level: str = "info",
) -> None:
    """Serve the Python data plane with uvicorn (`routed-experts proxy --data-plane python`;
    uvloop and httptools come with the proxy extra). One log line per request comes from the
    proxy, so uvicorn's access log is off."""
    import uvicorn

    from .app import keep_freed_memory

    configure_logging(log_level)
    keep_freed_memory()
    logging.getLogger("routed_experts.proxy").info(
        "routed-experts proxy (Python data plane) on http://%s:%d; prefill %s; decode %s",
        host, port, " ".join(prefill), " ".join(decode),
    )
    uvicorn.run(
        create_app(prefill, decode, config),
        host=host,
        port=port,
        access_log=False,
        log_level=log_level,
    )
