"""What an operator sets: the `routed-experts proxy` flags, with their defaults. Needs no extra,
so the Rust data plane runs from a bare install."""

from __future__ import annotations

import urllib.parse
from dataclasses import asdict, dataclass
from typing import Any

MiB = 1024 * 1024

_SECONDS = (
    "read_timeout",
    "connect_timeout",
    "eject_seconds",
    "body_timeout",
    "header_timeout",
    "request_timeout",
    "write_timeout",
    "shutdown_timeout",
)
_COUNTS = (
    "max_in_flight",
    "max_request_bytes",
    "max_buffered_bytes",
    "max_upstream_bytes",
    "eject_after",
    "max_connections",
)


@dataclass(frozen=True)
class ProxyConfig:
    """Everything an operator sets (the `routed-experts proxy` flags). The last six are the
    server's own limits: the Rust data plane applies them; a Python app mounted in another ASGI
    server gets that server's instead."""

    read_timeout: float = 600.0  # seconds an upstream may stay silent (a whole plain generation)
    connect_timeout: float = 10.0  # seconds to open a connection to an upstream
    max_in_flight: int = 256  # completion requests served at once; beyond: 503 + Retry-After
    max_request_bytes: int = 64 * MiB  # a client body; beyond: 413
    body_timeout: float = 60.0  # seconds to receive a client's whole body; beyond: 408 + close
    max_buffered_bytes: int = 1024 * MiB  # bytes held in bodies at once; beyond: 503
    max_upstream_bytes: int = 256 * MiB  # an upstream body or stream event; beyond: 502
    eject_after: int = 3  # failures in a row that take an upstream out of rotation
    eject_seconds: float = 10.0  # how long it stays out before a trial request
    upstream_api_key: str | None = None  # sent as `Authorization: Bearer` instead of the client's
    header_timeout: float = 30.0  # seconds from accept to a whole request head; beyond: 408
    max_header_bytes: int = 64 * 1024  # a request head; beyond: 431
    max_connections: int = 4096  # client connections open; beyond: 503 and close (logged)
    request_timeout: float = 3600.0  # a whole request, streams included; beyond: 504 / error event
    write_timeout: float = 60.0  # a write to a client that stopped reading; beyond: close
    shutdown_timeout: float = 30.0  # on SIGTERM: time to drain before cancelling

    def __post_init__(self) -> None:
        for name in _SECONDS:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of seconds")
        for name in _COUNTS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_header_bytes < 8192:
            raise ValueError(
                f"max_header_bytes must be at least 8192, got {self.max_header_bytes}"
            )

    def settings(self) -> dict[str, Any]:
        """The fields as a dict (what the Rust data plane is given)."""
        return asdict(self)


def check_url(url: str) -> str:
    """`url` if it can be an upstream's base URL (`http://HOST[:PORT][/PREFIX]`, to which the
    endpoint path is appended), else ValueError saying what is wrong with it. Checked when the
    command line is read; the data plane checks again when it binds."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "https":
        raise ValueError(
            f"{url!r}: https upstreams are not supported (the proxy speaks plain HTTP to the "
            "servers, as vLLM serves it)"
        )
    if parts.scheme != "http":
        raise ValueError(f"expected a URL starting with http://, got {url!r}")
    try:
        parts.port  # noqa: B018 (parsing the port is the check)
    except ValueError:
        raise ValueError(f"expected a port from 1 to 65535 in {url!r}") from None
    if not parts.hostname:
        raise ValueError(f"expected a host in {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"expected no query or fragment in {url!r} (endpoints are appended)")
    return url
