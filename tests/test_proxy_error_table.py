"""docs/proxy.md's error table, row by row: each row's answer produced against the Rust proxy
(stand-in engines, short limits set by flag), with the status and the `side` the row says.
A row added to the table without a producer here, or a producer of a row no longer there,
fails `test_every_row_of_the_table_has_its_producer`."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from engines import DATA_PLANE, Engine, closed_port_url
from test_proxy import COMPLETION
from test_proxy_abuse import address, read_all
from test_proxy_resilience import in_thread, post, stack, wait_for

pytestmark = [
    pytest.mark.skipif(DATA_PLANE != "rust", reason="the Rust server's own answers"),
    pytest.mark.source_tree,  # the table is docs/proxy.md's
]

PROXY_MD = Path(__file__).resolve().parents[1] / "docs" / "proxy.md"


def table_rows() -> dict[str, str]:
    """The error table's rows: status cell -> side cell."""
    text = PROXY_MD.read_text()
    head = text.index("| status | when | `side` |")
    rows = {}
    for line in text[head:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows[cells[0]] = cells[-1]
    return rows


def sides(cell: str) -> set[str]:
    """The sides a row's cell names (`prefill` / `decode`), or {None} for none."""
    found = set(re.findall(r"`(\w+)`", cell))
    return found or {None}  # type: ignore[arg-type]


# Each producer returns (status, side, headers or raw answer) as the proxy answered.
Answer = tuple[int, Any, Any]


def _json(r: httpx.Response) -> Answer:
    return r.status_code, r.json()["error"]["side"], r.headers


def _raw(raw: bytes) -> Answer:
    """An answer read off the socket: its status, and its JSON error's side."""
    status, body = int(raw.split(b" ", 2)[1]), raw.split(b"\r\n\r\n", 1)[1]
    return status, httpx.Response(status, content=body).json()["error"]["side"], raw


def broken_framing() -> Answer:
    with stack([Engine()], [Engine()]) as url, socket.create_connection(address(url)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                  b"Content-Type: application/json\r\n\r\nzz\r\n{}\r\n")  # fmt: skip
        raw = read_all(s, 10)
    assert b"connection: close" in raw.lower()
    return _raw(raw)


def bad_client_body() -> Answer:
    with stack([Engine()], [Engine()]) as url:
        r = post(url, dict(COMPLETION, routed_experts_prompt_routing="twice"))
        assert r.json()["error"]["param"] == "routed_experts_prompt_routing"
        return _json(r)


def unknown_path_and_method() -> Answer:
    with stack([Engine()], [Engine()]) as url:
        assert httpx.get(url + "/nope", timeout=10).json()["error"]["side"] == "client"
        r = httpx.get(url + "/v1/completions", timeout=10)
        assert r.headers["allow"] == "POST"
        return _json(r)


def silent_head() -> Answer:
    with stack([Engine()], [Engine()], header_timeout=0.5) as url:
        with socket.create_connection(address(url)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # and nothing more
            raw = read_all(s, 10)
    assert b"connection: close" in raw.lower()
    return _raw(raw)


def body_over_the_limit() -> Answer:
    with stack([Engine()], [Engine()], max_request_bytes=2000) as url:
        r = post(url, dict(COMPLETION, prompt=list(range(2000))))
        assert "--max-request-bytes" in r.json()["error"]["message"]
        return _json(r)


def head_over_the_limit() -> Answer:
    with stack([Engine()], [Engine()], max_header_bytes=16384) as url:
        with socket.create_connection(address(url)) as s:
            try:
                s.sendall(b"GET /healthcheck HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000)
            except OSError:
                pass  # closed before all was sent
            raw = read_all(s, 10)
    return int(raw.split(b" ", 2)[1]), None, raw


def upstream_refusal() -> Answer:
    # The stand-in refuses a start past the prompt itself, as vLLM 0.28 on does.
    with stack([Engine()], [Engine()]) as url:
        r = post(url, dict(COMPLETION, routed_experts_prompt_start=10_000))
        assert "routed_experts_prompt_start must be" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] is None
        return _json(r)


def upstream_unreachable() -> Answer:
    with stack([closed_port_url()], [Engine()]) as url:
        return _json(post(url))


def in_flight_full() -> Answer:
    held = Engine(fail="held")
    with stack([held], [Engine()], max_in_flight=1) as url:
        first, _ = in_thread(lambda: post(url))
        wait_for(lambda: held.requests)
        try:
            r = post(url)
            assert r.headers["retry-after"] == "1"
            return _json(r)
        finally:
            held.released.set()
            first.join(timeout=30)


def never_fits() -> Answer:
    body = {"model": "moe", "prompt": [i % 50 for i in range(1000)], "max_tokens": 2}
    with stack([Engine()], [Engine()], max_buffered_bytes=8192) as url:
        return _json(post(url, body))


def silent_upstream() -> Answer:
    with stack([Engine()], [Engine(fail="hang")], read_timeout=1.0) as url:
        return _json(post(url))


PRODUCERS: dict[str, Callable[[], Answer]] = {
    "400 (connection closed)": broken_framing,
    "400": bad_client_body,
    "404, 405 + `Allow`": unknown_path_and_method,
    "408 (connection closed)": silent_head,
    "413 (connection closed)": body_over_the_limit,
    "431 (connection closed)": head_over_the_limit,
    "the upstream's 4xx": upstream_refusal,
    "502": upstream_unreachable,
    "503 + `Retry-After`": in_flight_full,
    "507": never_fits,
    "504": silent_upstream,
}


def test_every_row_of_the_table_has_its_producer() -> None:
    assert sorted(table_rows()) == sorted(PRODUCERS)


@pytest.mark.parametrize("row", sorted(PRODUCERS))
def test_each_row_is_what_the_proxy_answers(row: str) -> None:
    status, side, _ = PRODUCERS[row]()
    statuses = [int(s) for s in re.findall(r"\b[1-5]\d\d\b", row)] or [400]  # an upstream 4xx
    assert status in statuses, (row, status)
    assert side in sides(table_rows()[row]), (row, side)
