"""The proxy as an attacker meets it, end to end on loopback: slow and silent heads, huge heads,
connection floods, endless streams, clients that never read, and shutdown with work under way.
Each test sets short limits by flag, checks the answer a production proxy gives, and checks
that healthy requests are served during and after. Every wait is bounded."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from engines import DATA_PLANE, Engine, Server
from test_proxy import COMPLETION, expected
from test_proxy_resilience import post, proxy_command, stack, wait_for

import routed_experts as rx
from routed_experts.proxy import ProxyConfig, ProxyServer

# The server's own limits: the Rust server's (an ASGI app has those of the server hosting it).
pytestmark = pytest.mark.skipif(
    DATA_PLANE != "rust", reason="limits of the Rust server itself"
)


def address(url: str) -> tuple[str, int]:
    host, port = url.rsplit("/", 1)[1].split(":")
    return host, int(port)


def read_all(s: socket.socket, seconds: float) -> bytes:
    """Everything the server sends until it closes the connection (or `seconds` pass)."""
    s.settimeout(seconds)
    out = b""
    with contextlib.suppress(OSError):
        while chunk := s.recv(65536):
            out += chunk
    return out


def healthy(url: str) -> None:
    r = post(url)
    assert r.status_code == 200 and rx.from_response(r.content) == expected(COMPLETION)


def test_slow_and_silent_heads_get_408_and_are_closed_while_others_are_served() -> None:
    with stack([Engine()], [Engine()], header_timeout=1.0) as url:
        silent = [socket.create_connection(address(url)) for _ in range(20)]
        slow = [socket.create_connection(address(url)) for _ in range(20)]
        stop = threading.Event()

        def drip() -> None:  # slowloris: a head one byte at a time, never finished
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 1000
            for i in range(len(head)):
                if stop.is_set():
                    return
                for s in slow:
                    with contextlib.suppress(OSError):
                        s.send(head[i : i + 1])
                time.sleep(0.1)

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        try:
            healthy(url)  # served while they wait
            answers = [read_all(s, 5) for s in silent + slow]
        finally:
            stop.set()
            dripper.join(timeout=5)
            for s in silent + slow:
                s.close()
        for a in answers:  # each one answered 408, then closed (read_all saw the end)
            assert a.startswith(b"HTTP/1.1 408"), a[:80]
            assert b"connection: close" in a.lower()
            assert b"did not arrive within 1 s" in a
        healthy(url)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'routed_experts_proxy_rejected_total{reason="header_timeout"} 40.0' in metrics


def test_an_idle_keep_alive_connection_is_closed_without_a_reply() -> None:
    with stack([Engine()], [Engine()], header_timeout=0.5) as url:
        s = socket.create_connection(address(url))
        s.sendall(b"GET /healthcheck HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        assert read_all(s, 5) == b""  # closed at the timeout, nothing unasked for sent
        s.close()


def test_a_head_past_the_size_limit_gets_431() -> None:
    with stack([Engine()], [Engine()], max_header_bytes=16384) as url:
        with socket.create_connection(address(url)) as s:
            head = b"GET /healthcheck HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000
            with contextlib.suppress(OSError):  # the server may close before all is sent
                s.sendall(head)
            answer = read_all(s, 5)
        assert answer.startswith(b"HTTP/1.1 431"), answer[:80]
        r = httpx.get(url + "/healthcheck", headers={"X-Big": "a" * 8000}, timeout=10)
        assert r.status_code == 200  # under the limit
        healthy(url)


def test_connections_past_the_cap_get_503_and_the_cap_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="routed_experts.proxy")
    with stack([Engine()], [Engine()], max_connections=4) as url:
        held = [socket.create_connection(address(url)) for _ in range(4)]
        try:
            wait_for(lambda: 'connections 4.0' in _metric_lines(held[0]))
            r = httpx.get(url + "/healthcheck", timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "limit of 4 connections" in r.json()["error"]["message"]
        finally:
            for s in held:
                s.close()
        wait_for(lambda: _answers(url))
        healthy(url)
    assert any("connection cap reached" in r.getMessage() for r in caplog.records)


def _metric_lines(s: socket.socket) -> str:
    """/metrics asked on one of the held connections (which counts as open)."""
    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(5)
    data = b""
    while b"routed_experts_proxy_connections " not in data or not data.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
        if b"upstream_failures_total" in data and data.endswith(b"\n"):
            break
    return data.decode(errors="replace")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/healthcheck", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_an_endless_stream_ends_at_the_request_timeout_with_an_error_event() -> None:
    decode = Engine(fail="slow_stream")
    with stack([Engine()], [decode], request_timeout=1.0) as url:
        body = dict(COMPLETION, stream=True)
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10,
                          headers={"X-Request-Id": "endless"}) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        last = json.loads(events[-1])["error"]
        assert last["code"] == 504 and "--request-timeout" in last["message"]
        assert len(events) > 5  # it was relayed until then
        wait_for(lambda: decode.disconnected == ["endless"])  # and decode was let go


def test_a_plain_request_past_the_request_timeout_is_504() -> None:
    decode = Engine(fail="hang")
    with stack([Engine()], [decode], request_timeout=1.0) as url:
        r = post(url)  # its client gives up at 30 s: only the proxy's timeout answers sooner
        assert r.status_code == 504 and "--request-timeout" in r.json()["error"]["message"]
        wait_for(lambda: len(decode.disconnected) == 1)


def test_a_client_that_stops_reading_is_dropped_at_the_write_timeout() -> None:
    decode = Engine(fail="flood_stream")  # round robin: the healthy request goes to the other
    with stack([Engine()], [decode, Engine()], write_timeout=1.0) as url:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(address(url))
        body = json.dumps(dict(COMPLETION, stream=True)).encode()
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: never-reads\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        try:  # never read: the proxy's writes stall, and past a second it lets go
            wait_for(lambda: decode.disconnected == ["never-reads"], seconds=15)
            metrics = httpx.get(url + "/metrics", timeout=10).text
            assert "routed_experts_proxy_requests_in_flight 0.0" in metrics
            healthy(url)
        finally:
            s.close()


def test_upstream_replies_count_against_the_body_budget() -> None:
    body = json.dumps(COMPLETION).encode()

    def send(url: str) -> httpx.Response:
        return httpx.post(url + "/v1/completions", content=body, timeout=30,
                          headers={"content-type": "application/json"})

    # Room for the client body, not for the prefill reply: refused as one that could never
    # fit (not grown past, and not told to retry).
    with stack([Engine()], [Engine()], max_buffered_bytes=len(body)) as url:
        r = send(url)
        assert r.status_code == 507 and "retry-after" not in r.headers
        assert "could ever hold for it" in r.json()["error"]["message"]
    with stack([Engine()], [Engine()], max_buffered_bytes=64 * 1024) as url:
        for _ in range(3):
            assert send(url).status_code == 200
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["buffered_bytes"] == 0  # every reply's bytes given back


def test_a_prefill_reply_the_budget_could_never_hold_is_refused_at_once_naming_its_size() -> None:
    # A 1,000-token prompt: a prefill reply of about 11 KB, against an 8 KiB budget.
    body = {"model": "moe", "prompt": [i % 50 for i in range(1000)], "max_tokens": 2}
    with stack([Engine()], [Engine()], max_buffered_bytes=8192, read_timeout=600) as url:
        began = time.monotonic()
        r = post(url, body)
        assert time.monotonic() - began < 10  # not a wait for room that never comes
        assert r.status_code == 507 and "retry-after" not in r.headers
        error = r.json()["error"]
        assert error["side"] == "proxy"
        said = re.fullmatch(
            r"the prefill server's reply is (\d+) bytes, more than the (\d+) bytes the proxy "
            r"could ever hold for it \(--max-buffered-bytes 8192\): raise the budget or shorten "
            r"the request",
            error["message"],
        )
        assert said and int(said[1]) > 8192 >= int(said[2]), error["message"]
        assert httpx.get(url + "/health", timeout=10).json()["buffered_bytes"] == 0
        assert post(url).status_code == 200  # a request that fits is served


def test_operator_endpoints_move_to_the_admin_port() -> None:
    with Server(Engine().app()) as p, Server(Engine().app()) as d:
        config = ProxyConfig(read_timeout=10)
        with ProxyServer([p.url], [d.url], config, admin_port=0) as proxy:
            admin = f"http://127.0.0.1:{proxy.admin_port}"
            assert proxy.admin_port not in (None, proxy.port)
            assert httpx.get(proxy.url + "/metrics", timeout=10).status_code == 404
            assert httpx.get(proxy.url + "/health", timeout=10).status_code == 404
            assert httpx.get(admin + "/health", timeout=10).json()["status"] == "ok"
            assert "routed_experts_proxy" in httpx.get(admin + "/metrics", timeout=10).text
            assert httpx.post(admin + "/v1/completions", json=COMPLETION).status_code == 404
            healthy(proxy.url)


@contextlib.contextmanager
def proxy_process(decode_url: str, *flags: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`routed-experts proxy` in a child process, as an operator runs it."""
    with Server(Engine().app()) as p:
        # The stand-in streams routing on completions (as SGLang does): relayed.
        flags = ("--stream-routing", "relay", *flags)
        proc, url, _ = proxy_command(["--prefill", p.url, "--decode", decode_url, *flags])
        try:
            wait_for(lambda: _answers(url), seconds=20)
            yield proc, url
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=20)


def _stream_in_background(url: str) -> tuple[threading.Thread, list[str]]:
    """A stream request on a thread of its own, once its first events arrived: the thread
    ends when the stream does."""
    events: list[str] = []

    def run() -> None:
        with contextlib.suppress(httpx.HTTPError):
            body = dict(COMPLETION, stream=True)
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    events.append(line)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(lambda: len(events) > 2)
    return thread, events


def _read_log_until(proc: subprocess.Popen[str], text: str) -> str:
    """The child's log lines up to and including the first with `text` (the state it names
    has been reached)."""
    assert proc.stderr is not None
    said = ""
    for line in proc.stderr:
        said += line
        if text in line:
            return said
    raise AssertionError(f"the proxy ended without logging {text!r}: {said}")


def test_sigterm_drains_then_cancels_and_exits_0() -> None:
    decode = Engine(fail="slow_stream")
    with Server(decode.app()) as d:
        with proxy_process(d.url, "--shutdown-timeout", "1") as (proc, url):
            stream, _ = _stream_in_background(url)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=20)  # a guard against a hang, not a measure
            assert proc.returncode == 0, err
            # One second of drain, then the stream under way was cancelled.
            assert "shutting down: 1 requests under way get up to 1 s" in err
            assert "shutdown timeout: cancelling 1 requests under way" in err
            wait_for(lambda: len(decode.disconnected) == 1)  # the upstream call was cancelled
            stream.join(timeout=20)
            assert not stream.is_alive()  # and the client's stream ended


def test_a_second_signal_stops_at_once() -> None:
    decode = Engine(fail="slow_stream")
    with Server(decode.app()) as d:
        with proxy_process(d.url, "--shutdown-timeout", "600") as (proc, url):
            _stream_in_background(url)
            proc.send_signal(signal.SIGTERM)
            said = _read_log_until(proc, "shutting down: 1 requests under way get up to 600 s")
            assert proc.poll() is None  # draining: the stream may take its time
            proc.send_signal(signal.SIGTERM)
            # Stopped long before the 600 s of drain (the timeout guards against a hang).
            _, err = proc.communicate(timeout=20)
            assert proc.returncode == 0 and "stopping at once" in err, said + err


def test_the_cli_refuses_https_upstreams() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "routed_experts.cli", "proxy", "--prefill", "https://h:1",
         "--decode", "http://h:2"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2
    assert "argument --prefill: 'https://h:1': https upstreams are not supported" in r.stderr


def test_more_concurrent_large_events_than_the_budget_holds_never_lock_up() -> None:
    """Streams whose routing events arrive in pieces, more of them at once than the body budget
    holds: each completes with its routing merged, gets a clean error event, or a 503 before it
    started; none waits on another holder until its timeout; afterwards the budget is empty and
    requests succeed."""
    prompt = [i % 50 for i in range(300)]  # about 3 KB of routing an event, 3 KB a prefill body
    body = {"model": "moe", "prompt": prompt, "max_tokens": 4, "stream": True}
    want = expected(body)
    # A read timeout far past the clients' own: a lock-up shows as clients timing out.
    with stack([Engine()], [Engine(fail="dribble")], max_buffered_bytes=24 * 1024,
               max_in_flight=64, read_timeout=600) as url:
        results: list[str] = []

        def one() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                text = r.read().decode()
            if r.status_code == 503:  # refused before any upstream call: the budget was full
                assert json.loads(text)["error"]["side"] == "proxy"
                results.append("refused")
                return
            events = [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]
            if events[-1] == "[DONE]":
                routed = [json.loads(e) for e in events[:-1] if "routed_experts" in e]
                assert len(routed) == 1 and rx.from_response(json.dumps(routed[0])) == want
                results.append("done")
            else:
                error = json.loads(events[-1])["error"]
                assert error["side"] == "proxy" and "holding its limit" in error["message"]
                results.append("error")

        threads = [threading.Thread(target=one, daemon=True) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(results) == 16, results
        # Holders never waited on each other (before, every holder waited for room that only
        # another holder could free, until the read timeout): all answered, some finished.
        assert "done" in results, results
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["buffered_bytes"] == 0 and health["in_flight"] == 0
        assert post(url).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_slow_readers_response_keeps_its_slot_and_budget_until_it_is_written(
    stream: bool,
) -> None:
    """The completion slot and the budget of the bodies a response is made of stay taken until
    the bytes are written to the client, not only until the server has queued them: a client
    that reads slowly is counted (in flight, buffered) for as long as it holds them."""
    pad = 24 << 20  # far more than the sockets' buffers take in
    body = {**COMPLETION, "stream": stream}
    with stack([Engine()], [Engine(pad=pad)], max_in_flight=4) as url:

        def health() -> dict[str, int]:
            return dict(httpx.get(url + "/health", timeout=10).json())

        data = json.dumps(body).encode()
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow reader's window
            s.connect(address(url))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
            s.settimeout(10)
            got = s.recv(4096)
            assert got.startswith(b"HTTP/1.1 200"), got[:200]
            # Everything the proxy could queue is queued; the client has read one piece.
            wait_for(lambda: health()["buffered_bytes"] >= pad // 2)
            time.sleep(1.0)  # nothing the client does frees them: still held a second later
            h = health()
            assert h["in_flight"] == 1 and h["buffered_bytes"] >= pad // 2, h
            got += read_all_until(s, b"\r\n0\r\n\r\n" if stream else b'"}', 60)
        wait_for(lambda: health()["buffered_bytes"] == 0 and health()["in_flight"] == 0)
        text = got.split(b"\r\n\r\n", 1)[1]
        assert len(text) > pad
        if not stream:
            assert rx.from_response(text) == expected(COMPLETION)
        healthy(url)


def read_all_until(s: socket.socket, end: bytes, seconds: float) -> bytes:
    """What the server sends until it ends with `end` (or `seconds` pass)."""
    s.settimeout(seconds)
    out = bytearray()
    while not out.endswith(end):
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        out += chunk
    return bytes(out)
