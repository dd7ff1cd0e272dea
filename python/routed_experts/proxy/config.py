"""What an operator sets: the `routed-experts proxy` flags, with their defaults. Needs no extra,
so the Rust data plane runs from a bare install."""

from __future__ import annotations

import urllib.parse
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from routed_experts._core import _check_proxy_settings, _proxy_settings, _proxy_text_settings

_NUMBERS = {name: (unit, default) for name, unit, default, _, _ in _proxy_settings()}
_TEXTS = {name: default for name, default, _ in _proxy_text_settings()}


def _seconds(name: str) -> float:
    """The default Rust declares for a setting in seconds."""
    unit, default = _NUMBERS[name]
    assert unit == "seconds", (name, unit)
    return float(default)


def _count(name: str) -> int:
    """The default Rust declares for a setting counted in requests, bytes or servers."""
    unit, default = _NUMBERS[name]
    assert unit in ("count", "bytes"), (name, unit)
    return int(default)


def _word(name: str) -> str:
    """The default Rust declares for a text setting that has one."""
    default = _TEXTS[name]
    assert default is not None, name
    return default


def _unset(name: str) -> str | None:
    """The default of a text setting that Rust declares unset."""
    default = _TEXTS[name]
    assert default is None, (name, default)
    return default


@dataclass(frozen=True)
class ProxyConfig:
    """Everything an operator sets (the `routed-experts proxy` flags). Each setting is declared
    once, in Rust (`routed_experts_proxy::config`, listed by `settings_declared()` with its
    unit, bound and help); each field takes its default from that declaration (none is
    restated here; a test holds the names to it), and the declaration's check refuses what
    cannot serve (a `ConfigError`, a `ValueError`, naming the setting)."""

    read_timeout: float = _seconds("read_timeout")
    connect_timeout: float = _seconds("connect_timeout")
    max_in_flight: int = _count("max_in_flight")
    max_request_bytes: int = _count("max_request_bytes")
    body_timeout: float = _seconds("body_timeout")
    max_buffered_bytes: int = _count("max_buffered_bytes")
    max_upstream_bytes: int = _count("max_upstream_bytes")
    eject_after: int = _count("eject_after")
    eject_seconds: float = _seconds("eject_seconds")
    upstream_api_key: str | None = _unset("upstream_api_key")
    prefill_policy: str = _word("prefill_policy")
    decode_policy: str = _word("decode_policy")
    session_header: str | None = _unset("session_header")
    upstreams_file: str | None = _unset("upstreams_file")
    routing_format: str = _word("routing_format")
    stream_routing: str = _word("stream_routing")
    prompt_routing: str = _word("prompt_routing")
    vllm_plugin: str = _word("vllm_plugin")
    header_timeout: float = _seconds("header_timeout")
    max_header_bytes: int = _count("max_header_bytes")
    max_connections: int = _count("max_connections")
    request_timeout: float = _seconds("request_timeout")
    write_timeout: float = _seconds("write_timeout")
    shutdown_timeout: float = _seconds("shutdown_timeout")
    max_merge_bytes: int = _count("max_merge_bytes")

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
