"""What an operator sets: the `routed-experts proxy` flags, with their defaults. Needs no extra,
so the Rust data plane runs from a bare install."""

from __future__ import annotations

import urllib.parse
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from routed_experts._core import _check_proxy_settings, _proxy_settings, _proxy_text_settings

MiB = 1024 * 1024


@dataclass(frozen=True)
class ProxyConfig:
    """Everything an operator sets (the `routed-experts proxy` flags). Each setting is declared
    once, in Rust (`routed_experts_proxy::config`, listed by `settings_declared()` with its
    unit, bound and help); these fields carry the same names and defaults, which a test holds
    to that declaration, and the declaration's check refuses what cannot serve (a
    `ConfigError`, a `ValueError`, naming the setting)."""

    read_timeout: float = 600.0
    connect_timeout: float = 10.0
    max_in_flight: int = 256
    max_request_bytes: int = 64 * MiB
    body_timeout: float = 60.0
    max_buffered_bytes: int = 1024 * MiB
    max_upstream_bytes: int = 256 * MiB
    eject_after: int = 3
    eject_seconds: float = 10.0
    upstream_api_key: str | None = None  # sent as `Authorization: Bearer` instead of the client's
    prefill_policy: str = "session"  # round_robin, least_load or session
    decode_policy: str = "least_load"
    session_header: str | None = None  # e.g. "X-Session-Id"; else the body's session_id
    upstreams_file: str | None = None  # `prefill URL` / `decode URL` lines, re-read on SIGHUP
    routing_format: str = "engine"  # the decode engine's own format (vLLM's .npy), or "compact"
    stream_routing: str = "buffered"  # completions/chat streams from a plain decode, or "relay"
    prompt_routing: str = "per_choice"  # or "shared": a plain answer's prompt rows once
    header_timeout: float = 30.0
    max_header_bytes: int = 64 * 1024
    max_connections: int = 4096
    request_timeout: float = 3600.0
    write_timeout: float = 60.0
    shutdown_timeout: float = 30.0
    max_merge_bytes: int = 1024 * MiB

    def __post_init__(self) -> None:
        _check_proxy_settings(asdict(self))

    def settings(self) -> dict[str, Any]:
        """The fields as a dict (what the Rust data plane is given)."""
        return asdict(self)


class Setting(NamedTuple):
    """One proxy setting as Rust declares it."""

    name: str
    unit: str  # "seconds", "count" or "bytes"
    default: int
    minimum: int
    help: str


def settings_declared() -> list[Setting]:
    """Every proxy setting as declared once in Rust, in the order the command lists them."""
    return [Setting(*s) for s in _proxy_settings()]


def text_settings_declared() -> list[tuple[str, str | None, str]]:
    """The proxy settings that take text, as declared in Rust: (name, default, help)."""
    return list(_proxy_text_settings())


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
