"""What the proxy forwards, logs and answers when a client or a server is not to be trusted:
decode never gets a client's transfer parameters, /v1/models is bounded like a completion, a
broken body is a 400, a server's text cannot forge a log line, and a stream's last error event is
one an SSE client reads. End to end on loopback; every wait is bounded."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from typing import Any

import httpx
import pytest
from engines import Engine
from test_proxy import COMPLETION
from test_proxy_resilience import stack, wait_for

FORGED = {"remote_host": "10.66.66.66", "remote_engine_id": "attacker",
          "remote_block_ids": [0, 1, 2, 3], "do_remote_prefill": True}


@pytest.mark.parametrize("stream", [False, True])
def test_decode_never_receives_a_clients_transfer_parameters(stream: bool) -> None:
    prefill, decode = Engine(fail="no_kv"), Engine()
    with stack([prefill], [decode]) as url:
        body = {**COMPLETION, "stream": stream, "kv_transfer_params": FORGED,
                "ec_transfer_params": FORGED}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            r.read()
    sent = decode.requests[0]
    # Prefill returned none: decode is told so (null), never the client's.
    assert sent["kv_transfer_params"] is None
    assert "ec_transfer_params" not in sent and "ec_transfer_params" not in prefill.requests[0]
    assert "10.66.66.66" not in json.dumps(sent) + json.dumps(prefill.requests[0])


def test_models_is_under_the_in_flight_limit() -> None:
    hung = Engine(fail="hang")
    with stack([Engine()], [hung], max_in_flight=1) as url:
        first: list[int] = []

        def ask() -> None:
            try:
                first.append(httpx.get(url + "/v1/models", timeout=3).status_code)
            except httpx.TimeoutException:
                first.append(0)

        t = threading.Thread(target=ask, daemon=True)
        t.start()
        wait_for(lambda: len(hung.headers) == 1)
        r = httpx.get(url + "/v1/models", timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["side"] == "proxy"
        t.join(timeout=10)
    assert len(hung.headers) == 1  # the second never reached the server


def raw_exchange(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        # The server may answer and close before it has read everything (then the
        # half-close, or a read after its answer, meets a closed connection).
        with contextlib.suppress(OSError):
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)  # a half-close: the answer can still be read
        out = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
    return out


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize(
    "body",
    [
        b"Transfer-Encoding: chunked\r\n\r\nZZ\r\n{}\r\n0\r\n\r\n",  # a bad chunk size
        b"Transfer-Encoding: chunked\r\n\r\n2\n{}\n0\n\n",  # LF-only chunk lines
        b"Transfer-Encoding: chunked\r\n\r\n2;" + b"x" * 100_000 + b"\r\n{}\r\n0\r\n\r\n",
        b"Content-Length: 100\r\n\r\n{\"prompt\": ",  # the client half-closes mid-body
    ],
    ids=["bad-chunk-size", "lf-only", "huge-extension", "half-close"],
)
def test_a_broken_request_body_is_a_400_that_closes(body: bytes) -> None:
    engine = Engine()
    with stack([engine], [Engine()]) as url:
        answer = raw_exchange(url, HEAD + body)
        ok = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30)
        assert ok.status_code == 200
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"connection: close" in head.lower()
    assert json.loads(payload)["error"]["side"] == "client"
    assert len(engine.requests) == 1  # the broken one never reached a server


def test_server_text_cannot_forge_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="routed_experts.proxy")
    evil = "bad\nrequest_id=forged endpoint=/v1/completions status=200 side=none\x1b[2J"

    class Evil(Engine):
        async def handle(self, request: Any) -> Any:
            from starlette.responses import PlainTextResponse

            await request.body()
            return PlainTextResponse(evil, status_code=400)

    with stack([Evil()], [Engine()]) as url:
        r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30)
    assert r.status_code == 400
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("request_id=forged" in m for m in messages)  # it is there, escaped
    for m in messages:
        assert "\n" not in m and "\x1b" not in m, repr(m)


def _events(url: str) -> list[str]:
    body = {**COMPLETION, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        text = r.read().decode()
    # What an SSE client dispatches: blocks ended by a blank line; the data lines of each.
    blocks = text.split("\n\n")[:-1]
    return ["\n".join(line[5:].lstrip() for line in b.split("\n") if line.startswith("data:"))
            for b in blocks]


def test_a_stream_cut_inside_a_line_ends_with_an_error_event_a_client_reads() -> None:
    with stack([Engine()], [Engine(fail="cut_line")]) as url:
        events = _events(url)
    last = json.loads(events[-1])
    assert last["error"]["side"] == "decode" and "DONE" in last["error"]["message"]
    assert all(e == "[DONE]" or json.loads(e) for e in events)  # every event whole JSON


def test_a_second_routing_event_is_a_stream_error_not_merged_twice() -> None:
    with stack([Engine()], [Engine(fail="dup_routing")]) as url:
        events = _events(url)
    routed = [e for e in events if "routed_experts" in e and "error" not in e]
    assert len(routed) == 1
    last = json.loads(events[-1])
    assert "second routing event for choice 0" in last["error"]["message"]
