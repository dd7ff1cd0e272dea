"""A prefill/decode (P/D) proxy that merges routed experts: vLLM's disaggregated-serving protocol
in front of prefill and decode servers, with every response's routing merged by absolute position.

One implementation, in Rust inside the extension (tokio and hyper; `routed_experts::proxy`),
reached three ways:

- `routed-experts proxy` / `serve(...)`: the server itself, GIL released. No extra needed.
- `ProxyServer(...)`: the same, bound from Python (port 0 picks one), served on a thread with
  `with` or in the calling thread with `serve()`.
- `create_app(...)`: an ASGI app to mount in your own app, which relays to the server running
  on a private loopback port (needs the `proxy` extra: aiohttp).

`StreamMerger` is its stream merge on its own, for a router of your own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from routed_experts._core import StreamMerger

from .config import ProxyConfig, check_url
from .protocol import ENDPOINTS, PREFILL_KV_TRANSFER_PARAMS, REQUEST_ID
from .server import ProxyServer, configure_logging, serve

if TYPE_CHECKING:  # the ASGI relay needs aiohttp (the proxy extra): imported on first use
    from .asgi import PDProxy

__all__ = [
    "ENDPOINTS",
    "PREFILL_KV_TRANSFER_PARAMS",
    "REQUEST_ID",
    "PDProxy",
    "ProxyConfig",
    "ProxyServer",
    "StreamMerger",
    "check_url",
    "configure_logging",
    "create_app",
    "serve",
]


def __getattr__(name: str) -> Any:
    if name == "PDProxy":
        from .asgi import PDProxy

        return PDProxy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def create_app(
    prefill: Sequence[str],
    decode: Sequence[str],
    config: ProxyConfig | None = None,
    **settings: Any,
) -> PDProxy:
    """The proxy as an ASGI app: mount it in your own app, or serve it with any ASGI server.
    `settings` are `ProxyConfig` fields (`read_timeout=30`, `max_in_flight=64`, ...), applied on
    top of `config`. Its data plane starts on the first request; mounted inside another app, its
    lifespan does not run: call `await app.aclose()` on shutdown to stop it."""
    from .asgi import PDProxy

    if settings:
        base = config or ProxyConfig()
        config = ProxyConfig(**{**base.__dict__, **settings})
    for url in [*prefill, *decode]:
        check_url(url)
    return PDProxy(prefill, decode, config)
