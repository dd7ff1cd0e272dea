"""The audit's framing, upstream-misbehaviour and churn cases, kept as tests: requests whose
length is ambiguous or whose head is malformed are a 400 that reaches no server (and a pipeline
never desyncs past one); an upstream that lies about its length, sends garbage chunks, a
compressed body, informational heads or a huge head never turns into a 200 with wrong data;
thousands of connections opened and dropped leave no descriptor behind. End to end on loopback,
against the Rust server; every wait is bounded."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from engines import DATA_PLANE, KV_PARAMS, Engine, Server
from test_proxy import COMPLETION, expected
from test_proxy_resilience import stack, wait_for

import routed_experts as rx

pytestmark = pytest.mark.skipif(DATA_PLANE != "rust", reason="the Rust server's own framing")

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
BODY = json.dumps(COMPLETION).encode()


def exchange(url: str, request: bytes) -> bytes:
    """Send `request`, half-close, and read until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        # The server may answer and close before it has read everything (then the
        # half-close, or a read after its answer, meets a closed connection).
        with contextlib.suppress(OSError):
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)
        out = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
    return out


@pytest.mark.parametrize(
    "head",
    [
        b"Content-Length: %d\r\nContent-Length: %d\r\n" % (len(BODY), len(BODY) + 1),
        b"Content-Length: %d, %d\r\n" % (len(BODY), len(BODY)),
        b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % len(BODY),
        b"Content-Length: %d\r\nX-Folded: a\r\n b\r\n" % len(BODY),
        b"Content-Length: %d\r\nX-Bare: a\rb\r\n" % len(BODY),
        b"Content-Length: %d\r\nX-Nul: a\x00b\r\n" % len(BODY),
        b"Content-Length: -1\r\n",
        b"Content-Length: +%d\r\n" % len(BODY),
    ],
    ids=["two-lengths", "length-list", "length-and-chunked", "obs-fold", "bare-cr", "nul",
         "negative-length", "signed-length"],
)
def test_an_ambiguous_or_malformed_head_is_a_400_that_reaches_no_server(head: bytes) -> None:
    prefill, decode = Engine(), Engine()
    with stack([prefill], [decode]) as url:
        answer = exchange(url, HEAD + head + b"\r\n" + BODY)
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
        assert answer.count(b"HTTP/1.1 ") == 1  # nothing after it was read as a request
        assert prefill.requests == [] and decode.requests == []
        ok = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30)
        assert ok.status_code == 200 and rx.from_response(ok.content) == expected(COMPLETION)


def test_a_pipeline_with_a_malformed_middle_request_never_desyncs() -> None:
    prefill, decode = Engine(), Engine()
    good = HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY
    bad = HEAD + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n{}"
    with stack([prefill], [decode]) as url:
        answer = exchange(url, good + bad + good)
    # The first is answered in full, the second is a 400 that closes: the third, whose bytes
    # follow an ambiguous length, is never read as a request.
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 2 and b"HTTP/1.1 400" in answer
    assert len(prefill.requests) == 1 and len(decode.requests) == 1


def decode_body() -> bytes:
    """A real decode reply to COMPLETION, as the stand-in decode engine writes it."""
    with Server(Engine().app()) as engine:
        r = httpx.post(engine.url + "/v1/completions",
                       json={**COMPLETION, "kv_transfer_params": KV_PARAMS}, timeout=30)
    assert r.status_code == 200
    return r.content


@contextmanager
def lying_server(reply: bytes) -> Iterator[str]:
    """A decode server that reads each request's head and body and answers `reply` (raw
    bytes), then closes the connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(10)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:
                        data += conn.recv(65536)
                    head, _, body = data.partition(b"\r\n\r\n")
                    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:"))
                    while len(body) < length:
                        body += conn.recv(65536)
                    conn.sendall(reply)
                except (OSError, StopIteration):
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()


def reply(status: bytes, headers: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 " + status + b"\r\n" + headers + b"\r\n" + body


@pytest.mark.parametrize(
    "case", ["lying-length", "chunk-garbage", "gzip", "informational", "huge-head", "no-head"]
)
def test_an_upstream_that_misbehaves_never_turns_into_a_200_with_wrong_data(case: str) -> None:
    body = decode_body()
    json_head = b"Content-Type: application/json\r\n"
    raw = {
        "lying-length": reply(b"200 OK", json_head + b"Content-Length: %d\r\n" % (len(body) + 99),
                              body),
        "chunk-garbage": reply(b"200 OK", json_head + b"Transfer-Encoding: chunked\r\n",
                               b"ZZZZ\r\n" + body + b"\r\n0\r\n\r\n"),
        "gzip": reply(b"200 OK", json_head + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n"
                      % len(gzip.compress(body)), gzip.compress(body)),
        "informational": b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
        + reply(b"200 OK", json_head + b"Content-Length: %d\r\n" % len(body), body),
        "huge-head": reply(b"200 OK", json_head + b"X-Huge: " + b"h" * (1 << 20) + b"\r\n"
                           + b"Content-Length: %d\r\n" % len(body), body),
        "no-head": b"not http at all\r\n\r\n",
    }[case]
    with lying_server(raw) as decode_url, stack([Engine()], [decode_url]) as url:
        r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30)
        if case == "informational":  # the final head follows: a whole, merged answer
            assert r.status_code == 200 and rx.from_response(r.content) == expected(COMPLETION)
        else:
            assert r.status_code == 502, (r.status_code, r.content[:300])
            assert r.json()["error"]["side"] == "decode"
        if case == "gzip":
            assert 'Content-Encoding "gzip"' in r.json()["error"]["message"]
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["buffered_bytes"] == 0 and health["in_flight"] == 0


def test_upstreams_are_asked_for_identity_bodies() -> None:
    prefill, decode = Engine(), Engine()
    with stack([prefill], [decode]) as url:
        r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30,
                       headers={"accept-encoding": "gzip, br"})
        assert r.status_code == 200
    # Whatever the client accepts, the servers are asked for what the proxy can merge.
    assert prefill.headers[0]["accept-encoding"] == "identity"
    assert decode.headers[0]["accept-encoding"] == "identity"


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux descriptors")
def test_thousands_of_connections_opened_and_dropped_leave_nothing_behind() -> None:
    with stack([Engine()], [Engine()]) as url:
        host, port = url.removeprefix("http://").split(":")
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        before = open_descriptors()
        for i in range(3000):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                if i % 3 == 0:  # some send half a head, some a whole request, some nothing
                    s.sendall(b"GET /health HTTP/1.1\r\nHost")
                elif i % 3 == 1:
                    s.sendall(b"GET /healthcheck HTTP/1.1\r\nHost: x\r\n\r\n")
        # The server notices every close (each within its own read); nothing is kept open.
        wait_for(lambda: open_descriptors() <= before + 8, seconds=30)
        r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30)
        assert r.status_code == 200 and rx.from_response(r.content) == expected(COMPLETION)
