"""The proxy's data plane in Rust (tokio + hyper, inside the extension): what
`routed-experts proxy` runs. It needs no extra."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from types import TracebackType

from routed_experts._core import _ProxyServer

from .config import ProxyConfig

log = logging.getLogger("routed_experts.proxy")


class ProxyServer:
    """The proxy bound to `host:port` (port 0: a free one) and ready to serve; with
    `admin_port`, `/health` and `/metrics` are served there only.

    `serve()` blocks with the GIL released until `stop()` (from another thread) or, with
    `signals=True`, SIGTERM/SIGINT: requests under way get `config.shutdown_timeout` to finish,
    then their upstream calls are cancelled; a second signal (or `stop(now=True)`) stops at
    once. As a context manager it serves on a thread of its own."""

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        config: ProxyConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        admin_port: int | None = None,
    ) -> None:
        self.config = config or ProxyConfig()
        self.host = host
        self._server = _ProxyServer(
            list(prefill), list(decode), host, port, self.config.settings(), admin_port
        )
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.port)

    @property
    def admin_port(self) -> int | None:
        return self._server.admin_port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def serve(self, signals: bool = False) -> None:
        """Serve until stopped (once)."""
        self._server.serve(signals)

    def stop(self, now: bool = False) -> None:
        """Drain and stop (at once with `now`); `serve()` then returns."""
        self._server.stop(now)

    def __enter__(self) -> ProxyServer:
        self._thread = threading.Thread(target=self.serve, name="routed-experts-proxy", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop(now=True)
        if self._thread is not None:
            self._thread.join(timeout=30)


def configure_logging(level: str) -> None:
    """What `routed-experts proxy` logs: `level` and up, one line per record on stderr."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def serve(
    prefill: Sequence[str],
    decode: Sequence[str],
    host: str,
    port: int,
    config: ProxyConfig | None = None,
    log_level: str = "info",
    admin_port: int | None = None,
) -> None:
    """Serve the proxy until SIGTERM or SIGINT (drained within `config.shutdown_timeout`; a
    second signal stops at once). One log line per request, on logger `routed_experts.proxy`."""
    configure_logging(log_level)
    server = ProxyServer(prefill, decode, config, host, port, admin_port)
    admin = f"; admin on port {server.admin_port}" if admin_port is not None else ""
    servers = (
        f"servers from {server.config.upstreams_file} (re-read on SIGHUP)"
        if server.config.upstreams_file
        else f"prefill {' '.join(prefill)}; decode {' '.join(decode)}"
    )
    log.info("routed-experts proxy on http://%s:%d; %s%s", host, server.port, servers, admin)
    server.serve(signals=True)
    log.info("routed-experts proxy stopped")
