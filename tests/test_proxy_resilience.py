"""The proxy under faults, end to end on loopback: limits, timeouts, passive health
checks, retries, cancellation, metrics and the per-request log line. Every wait is bounded."""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from engines import Engine, Server, closed_port_url, max_tokens
from test_proxy import COMPLETION, expected

import routed_experts as rx
from routed_experts.cli import build_parser
from routed_experts.proxy import ProxyConfig, create_app


def proxy_command(args: list[str]) -> tuple[subprocess.Popen[str], str, list[str]]:
    """`routed-experts proxy ARGS --port 0` in a child process, as an operator runs it: the
    process, its URL (from its start line: the port the system gave it, held from bind to
    serve) and the log lines read up to that one."""
    cmd = [sys.executable, "-m", "routed_experts.cli", "proxy", *args, "--port", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:
        said.append(line)
        found = re.search(r"routed-experts proxy on (http://127\.0\.0\.1:\d+)", line)
        if found:
            return proc, found.group(1), said
    proc.wait(timeout=10)
    raise AssertionError(f"the proxy ended before it said its port: {''.join(said)}")


@contextlib.contextmanager
def stack(
    prefills: list[Engine | str], decodes: list[Engine | str], **settings: Any
) -> Iterator[str]:
    """Engines (or plain URLs) behind a proxy with `settings`; yields the proxy's URL."""
    servers = [Server(e.app()) for e in prefills + decodes if isinstance(e, Engine)]
    with contextlib.ExitStack() as stack:
        for s in servers:
            stack.enter_context(s)
        urls = iter(s.url for s in servers)
        p = [e if isinstance(e, str) else next(urls) for e in prefills]
        d = [e if isinstance(e, str) else next(urls) for e in decodes]
        settings.setdefault("read_timeout", 10)
        # The stand-in engines stream routing on completions (as SGLang does): relayed.
        settings.setdefault("stream_routing", "relay")
        proxy = stack.enter_context(Server(create_app(p, d, **settings)))
        yield proxy.url


def post(url: str, body: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
    kw.setdefault("timeout", 30)
    return httpx.post(url + "/v1/completions", json=body or COMPLETION, **kw)


def in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def wait_for(cond: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_requests_beyond_the_in_flight_limit_get_503_with_retry_after() -> None:
    held = Engine(fail="held")
    with stack([held], [Engine()], max_in_flight=1) as url:
        first, result = in_thread(lambda: post(url))
        wait_for(lambda: held.requests)  # the first request holds the only slot, until released
        r = post(url)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["side"] == "proxy"
        held.released.set()
        first.join(30)
        assert result[0].status_code == 200  # the one in flight was served
        assert post(url).status_code == 200  # and the slot is free again
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'routed_experts_proxy_rejected_total{reason="in_flight"} 1.0' in metrics
        assert 'side="proxy",status="503"} 1.0' in metrics


def test_a_decode_server_that_holds_a_request_does_not_starve_the_other() -> None:
    held, healthy = Engine(fail="held"), Engine()
    with stack([Engine()], [held, healthy]) as url:
        # The first request goes to the held server; the second, to the other (least load),
        # is answered while the first is still held (the pool is per server).
        stuck, stuck_result = in_thread(lambda: post(url))
        wait_for(lambda: held.requests)
        r = post(url)
        assert r.status_code == 200 and rx.from_response(r.content) == expected(COMPLETION)
        assert stuck.is_alive() and not stuck_result
        held.released.set()
        stuck.join(30)
        assert stuck_result[0].status_code == 200


def test_a_hung_decode_server_times_out_and_is_ejected() -> None:
    hung, healthy = Engine(fail="hang"), Engine()
    # Ejected for 300 s: on a loaded machine (CI runs this beside a qemu emulation) the ten
    # requests below have taken over ten seconds, and the default ejection was over before
    # /health was read.
    settings = {"read_timeout": 1.0, "eject_after": 2, "eject_seconds": 300}
    with stack([Engine()], [hung, healthy], **settings) as url:
        # Least load takes turns between idle servers: the hung one's turns time out (504),
        # the other's are served; its second timeout in a row takes it out of rotation, and
        # from then on every request succeeds.
        statuses = [post(url).status_code for _ in range(4)]
        assert statuses == [504, 200, 504, 200]
        statuses = [post(url).status_code for _ in range(6)]
        assert statuses == [200] * 6
        assert len(hung.requests) == 2
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 200  # a decode server is still in rotation
        decode = health.json()["decode"]
        assert [u["healthy"] for u in decode] == [False, True]
        assert decode[0]["consecutive_failures"] == 2 and decode[0]["retry_in_s"] > 0


def test_an_ejected_server_gets_a_trial_after_eject_seconds_and_rejoins() -> None:
    flaky = Engine(fail="500")
    # Four seconds of ejection: the request below comes within them even on a loaded machine.
    with stack([Engine()], [flaky], eject_after=2, eject_seconds=4.0) as url:
        assert [post(url).status_code for _ in range(2)] == [502, 502]
        r = post(url)  # well within the seconds of ejection
        assert r.status_code == 503 and r.json()["error"]["side"] == "proxy"
        assert int(r.headers["retry-after"]) >= 1
        assert "no decode server is in rotation" in r.json()["error"]["message"]
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        assert len(flaky.requests) == 2  # the ejected server was not called
        flaky.fail = None
        # /health says when its ejection is over; then the next request is its trial.
        wait_for(lambda: _decode_health(url)["retry_in_s"] == 0, seconds=20)
        assert post(url).status_code == 200  # the trial request
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'routed_experts_proxy_upstream_healthy{side="decode"' in metrics
        assert 'routed_experts_proxy_rejected_total{reason="no_upstream"} 1.0' in metrics


def _gauge(url: str, name: str) -> float:
    """The value of an unlabelled metric in /metrics."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def _decode_health(url: str) -> dict[str, Any]:
    """The first decode server's entry in /health."""
    return dict(httpx.get(url + "/health", timeout=10).json()["decode"][0])


def test_the_last_decode_server_is_probed_not_shut_out_and_no_prefill_runs_without_it() -> None:
    # One decode server, ejected for a long time after two failures. While it is broken its
    # health probe fails: 503 + Retry-After, and no prefill runs for a decode that cannot come.
    # Once it is back, the next request probes it and is served, long before eject-seconds.
    prefill, decode = Engine(), Engine(fail="500")
    with stack([prefill], [decode], eject_after=2, eject_seconds=300) as url:
        httpx.get(url + "/health", timeout=10)  # started (an ASGI app starts at its first)
        wait_for(lambda: decode.health_checks == 1)  # the proxy's probe at start
        decode.health_checks = 0
        assert [post(url).status_code for _ in range(2)] == [502, 502]
        prefills = len(prefill.requests)
        probing = time.monotonic()  # before the request that probes
        r = post(url)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert "none answered a health probe" in r.json()["error"]["message"]
        assert len(prefill.requests) == prefills  # refused before any prefill
        assert decode.health_checks == 1 and len(decode.requests) == 2
        r = post(url)
        assert r.status_code == 503
        # Within a second of the last probe it is refused without another. A loaded machine
        # (CI beside a qemu emulation) can take longer than that over one request, and then a
        # second probe is due: the rule's own test is pool.rs's, on a clock it controls.
        if time.monotonic() - probing < 1.0:
            assert decode.health_checks == 1
        probes = decode.health_checks
        decode.fail = None
        # Refused without a probe until a second has passed since the last; then one probe
        # finds it answering and the request is served.
        answers: list[httpx.Response] = []
        wait_for(lambda: answers.append(post(url)) or answers[-1].status_code == 200)
        assert {a.status_code for a in answers[:-1]} <= {503}
        r = answers[-1]
        assert rx.from_response(r.content) == expected(COMPLETION)
        assert decode.health_checks == probes + 1  # one probe found it answering
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # back in rotation


def _drip(url: str, body: bytes, seconds_per_byte: float, stop: threading.Event,
          sent_head: threading.Event | None = None) -> int:
    """POST `body` one byte at a time (a slow client); the status it gets, 0 for none. Once the
    head is sent, `sent_head` is set; once `stop` is set, it sends no more and waits."""
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n" % len(body))
        if sent_head is not None:
            sent_head.set()
        for byte in body:
            if stop.is_set():
                break
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break  # the proxy closed the connection
            time.sleep(seconds_per_byte)
        try:
            head = s.recv(4096)
        except OSError:
            return 0
    return int(head.split()[1]) if head.startswith(b"HTTP/") else 0


def test_slow_bodies_hold_no_completion_slot_and_are_timed_out() -> None:
    # Two slow clients dripping a body at 20 bytes/s (8 s for this body), with one completion
    # slot: real requests are still served while they drip, and the slow ones get 408 at
    # --body-timeout. The timeout leaves seconds for the scrape and the requests to run while
    # both drip, even under qemu (at 1 s, the aarch64 wheel check once saw both timed out
    # before its first scrape answered).
    import json

    body = json.dumps(COMPLETION).encode()
    stop = threading.Event()
    heads = [threading.Event(), threading.Event()]
    with stack([Engine()], [Engine()], max_in_flight=1, body_timeout=4.0) as url:
        results: list[int] = []
        drips = [threading.Thread(
            target=lambda h=h: results.append(_drip(url, body, 0.05, stop, h))) for h in heads]
        for t in drips:
            t.start()
        try:
            assert all(h.wait(10) for h in heads)
            # Both slow clients connected (with the scrape itself: three connections open).
            wait_for(lambda: _gauge(url, "routed_experts_proxy_connections") >= 3)
            for _ in range(3):
                r = post(url)
                assert r.status_code == 200, r.text
        finally:
            # They send no more; the proxy answers each at its body timeout.
            stop.set()
            for t in drips:
                t.join(timeout=10)
        assert results == [408, 408]
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'routed_experts_proxy_rejected_total{reason="body_timeout"} 2.0' in metrics


def test_bodies_past_the_buffer_budget_get_503_and_the_budget_is_given_back() -> None:
    import json

    body = json.dumps(COMPLETION).encode()

    def send(url: str) -> httpx.Response:
        return httpx.post(url + "/v1/completions", content=body, timeout=30,
                          headers={"content-type": "application/json"})

    with stack([Engine()], [Engine()], max_buffered_bytes=len(body) - 1) as url:
        r = send(url)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.headers["connection"] == "close"
        assert "bytes of request bodies" in r.json()["error"]["message"]
    with stack([Engine()], [Engine()], max_buffered_bytes=64 * 1024) as url:
        for _ in range(3):  # each body's bytes are given back once the request is done
            assert send(url).status_code == 200


def test_a_prefill_server_that_refuses_connections_is_retried_on_the_next() -> None:
    good = Engine()
    with stack([closed_port_url(), good], [Engine()]) as url:
        for _ in range(4):
            r = post(url)
            assert r.status_code == 200 and rx.from_response(r.content) == expected(COMPLETION)
        assert len(good.requests) == 4


def test_a_prefill_that_is_unreachable_everywhere_is_502_after_one_retry() -> None:
    with stack([closed_port_url(), closed_port_url()], [Engine()]) as url:
        r = post(url)
        assert r.status_code == 502 and r.json()["error"]["side"] == "prefill"
        assert "could not be reached" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_the_upstream_request(stream: bool) -> None:
    decode = Engine(fail="slow_stream" if stream else "hang")
    with stack([Engine()], [decode]) as url:
        body = dict(COMPLETION, stream=stream)
        headers = {"X-Request-Id": f"leaving-{stream}"}
        if stream:
            with httpx.stream(
                "POST", url + "/v1/completions", json=body, headers=headers, timeout=10
            ) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")  # events flow; then the client leaves
        else:
            with pytest.raises(httpx.ReadTimeout):
                post(url, body, headers=headers, timeout=0.5)
        wait_for(lambda: decode.disconnected)
        assert decode.disconnected == [f"leaving-{stream}"]
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'status="499"' in metrics


def test_body_limits_413_for_clients_502_for_upstreams() -> None:
    with stack([Engine()], [Engine()], max_request_bytes=2000) as url:
        big = dict(COMPLETION, prompt=list(range(2000)))
        r = post(url, big)
        assert r.status_code == 413 and r.json()["error"]["side"] == "client"
        assert "over the limit of 2000" in r.json()["error"]["message"]
        assert "(--max-request-bytes)" in r.json()["error"]["message"]
        # its unread rest must not be parsed as another request: the connection is closed
        assert r.headers["connection"] == "close"
        assert post(url).status_code == 200  # a small one still passes
    with stack([Engine()], [Engine()], max_upstream_bytes=500) as url:
        r = post(url)
        assert r.status_code == 502 and r.json()["error"]["side"] == "prefill"
        message = r.json()["error"]["message"]
        # The size it would need: a proxy started with it takes the reply.
        size = int(message.split("reply is ")[1].split(" ")[0])
        assert f"a proxy started with --max-upstream-bytes {size} takes it" in message
    with stack([Engine()], [Engine()], max_upstream_bytes=size) as url:
        assert post(url).status_code == 200


def test_a_stream_event_over_the_upstream_limit_ends_in_an_error_event() -> None:
    # The prefill body is small enough; the decode event with its routing is not.
    with stack([Engine()], [Engine()], max_upstream_bytes=700) as url:
        body = dict(COMPLETION, prompt=[1, 2], max_tokens=200, stream=True)
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert '"side":"decode"' in events[-1] and "limit on one event" in events[-1]


def test_metrics_and_one_log_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="routed_experts.proxy")
    with stack([Engine()], [Engine()]) as url:
        assert post(url, headers={"X-Request-Id": "metered-1"}).status_code == 200
        assert httpx.post(url + "/v1/completions", content=b"{", timeout=10).status_code == 400
        text = httpx.get(url + "/metrics", timeout=10).text
    assert (
        'routed_experts_proxy_requests_total{endpoint="/v1/completions",side="none",'
        'status="200"} 1.0' in text
    )
    assert 'status="400"' in text and 'side="client"' in text
    for phase in ("prefill", "decode", "merge", "total"):
        assert f'routed_experts_proxy_phase_seconds_count{{phase="{phase}"}}' in text
    assert "routed_experts_proxy_merged_bytes_total" in text
    assert "routed_experts_proxy_requests_in_flight 0.0" in text
    lines = [r.getMessage() for r in caplog.records if "request_id=metered-1" in r.getMessage()]
    assert len(lines) == 1
    line = lines[0]
    for part in ("status=200", "side=none", "prefill_ms=", "decode_ms=", "merge_ms=", "total_ms="):
        assert part in line


def test_a_failed_streams_log_line_names_its_decode_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # As a plain request's line does: which server, and how long it took to fail.
    caplog.set_level(logging.INFO, logger="routed_experts.proxy")
    decode = Engine(fail="500")
    with Server(decode.app()) as d, stack([Engine()], [d.url]) as url:
        body = {**COMPLETION, "stream": True}
        r = post(url, body, headers={"X-Request-Id": "failed-stream"})
        assert r.status_code == 502
    lines = [r.getMessage() for r in caplog.records if "request_id=failed-stream" in r.getMessage()]
    assert len(lines) == 1 and f"decode={d.url}" in lines[0], lines
    assert "decode=-" not in lines[0]


def _rows(text: str, name: str, **labels: str) -> float:
    """The value of the metric line `name` whose labels include `labels`."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} with {labels}")


@pytest.mark.parametrize("stream", [False, True])
def test_routing_a_broken_engine_sends_is_counted_per_upstream(stream: bool) -> None:
    good, zero, dup = Engine(), Engine(fail="zero_routes"), Engine(fail="duplicate_routes")
    servers = [Server(e.app()) for e in (good, zero, dup)]
    with contextlib.ExitStack() as es:
        for s in servers:
            es.enter_context(s)
        g, z, d = (s.url for s in servers)
        for prefill, decode in ((g, g), (g, z), (g, d)):
            proxy = es.enter_context(Server(create_app([prefill], [decode], read_timeout=10)))
            body = {**COMPLETION, "stream": stream}
            with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
                r.read()
            text = httpx.get(proxy.url + "/metrics", timeout=10).text
            name = "routed_experts_proxy_suspect_routing_rows_total"
            checked = _rows(text, "routed_experts_proxy_routing_rows_checked_total",
                            side="decode", upstream=decode)
            # Decode's rows from the end of prefill's on: its generated rows (9 - 1 here).
            assert checked == max_tokens(COMPLETION) - 1
            assert _rows(text, "routed_experts_proxy_routing_rows_checked_total",
                         side="prefill", upstream=prefill) > 0
            assert _rows(text, name, side="prefill", kind="zero") == 0
            zeros = _rows(text, name, side="decode", kind="zero", upstream=decode)
            dups = _rows(text, name, side="decode", kind="duplicate", upstream=decode)
            assert (zeros, dups) == {g: (0, 0), z: (checked, 0), d: (0, checked)}[decode]


def test_unknown_routes_and_methods() -> None:
    with stack([Engine()], [Engine()]) as url:
        assert httpx.get(url + "/nope", timeout=10).status_code == 404
        r = httpx.get(url + "/v1/completions", timeout=10)
        assert r.status_code == 405 and r.json()["error"]["side"] == "client"
        assert r.headers["allow"] == "POST"
        r = httpx.post(url + "/health", timeout=10)
        assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"


def test_routes_are_exact_not_suffixes() -> None:
    # A path that only ends like a route must not be served: an ingress that exposes only
    # /v1/* (or hides /metrics) could otherwise be walked around.
    def raw(url: str, method: str, path: str) -> int:
        """The status of a request whose path goes out exactly as written (clients such as
        httpx resolve `..` before sending; an attacker's client does not)."""
        host, port = url.rsplit("/", 1)[1].split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                      "Connection: close\r\n\r\n{}".encode())
            return int(s.recv(64).split()[1])

    prefill, decode = Engine(), Engine()
    with stack([prefill], [decode]) as url:
        for path in ("/etc/passwd/metrics", "/v1/health", "/v1/../metrics", "/v1/%2e%2e/metrics",
                     "/x/healthcheck", "/metrics/", "/v1/models/x"):
            assert raw(url, "GET", path) == 404, path
        for path in ("/admin/x/v1/completions", "/v1/completions/", "/v2/v1/chat/completions",
                     "/v1/../v1/completions"):
            assert raw(url, "POST", path) == 404, path
        assert not prefill.requests and not decode.requests
        assert raw(url, "GET", "/metrics") == 200
        assert httpx.get(url + "/metrics", timeout=10).text.count("routed_experts") > 0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("body_timeout", 0, "body_timeout must be a positive number of seconds"),
        ("read_timeout", -1.0, "read_timeout must be a positive number of seconds"),
        ("max_buffered_bytes", 0, "max_buffered_bytes must be at least 1"),
        ("max_in_flight", 0, "max_in_flight must be at least 1"),
    ],
)
def test_config_refuses_limits_that_serve_nothing(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProxyConfig(**{field: value})


def test_every_proxy_setting_is_declared_once_and_each_copy_follows_it() -> None:
    """The declaration in Rust (routed_experts_proxy::config) is the one list: the Python
    config's fields and defaults, the command's flags, their defaults and help are all held to
    it (the table of docs/proxy.md: the next test)."""
    import dataclasses

    from routed_experts.proxy.config import settings_declared

    declared = settings_declared()
    names = [s.name for s in declared]
    assert len(set(names)) == len(names) and "max_merge_bytes" in names
    from routed_experts.proxy.config import text_settings_declared

    fields = {f.name: f.default for f in dataclasses.fields(ProxyConfig)}
    text = {name: default for name, default, _ in text_settings_declared()}
    assert set(fields) - set(text) == set(names)
    assert {n: fields[n] for n in text} == text
    parser = build_parser()
    args = parser.parse_args(["proxy", "--prefill", "http://p", "--decode", "http://d"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {a.dest: a for a in sub.choices["proxy"]._actions}
    for s in declared:
        assert fields[s.name] == s.default, s.name
        assert getattr(args, s.name) == s.default, s.name
        assert flags[s.name].help == s.help, s.name
        flag = "--" + s.name.replace("_", "-")
        if s.minimum > 1 or s.unit != "seconds":
            below = str(s.minimum - 1)
            with pytest.raises(SystemExit):
                parser.parse_args(["proxy", "--prefill", "http://p", "--decode", "http://d",
                                   flag, below])
            with pytest.raises(rx.ConfigError, match=s.name):
                ProxyConfig(**{s.name: s.minimum - 1})


@pytest.mark.source_tree
def test_the_proxy_manual_table_lists_every_proxy_setting_with_its_default() -> None:
    import re
    from pathlib import Path

    from routed_experts.cli import size_text
    from routed_experts.proxy.config import settings_declared

    manual = (Path(__file__).resolve().parents[1] / "docs" / "proxy.md").read_text()
    for s in settings_declared():
        flag = "--" + s.name.replace("_", "-")
        shown = size_text(s.default) if s.unit == "bytes" else str(s.default)
        assert re.search(rf"^\| `{flag}` \| {re.escape(shown)} \|", manual, re.M), (flag, shown)


@pytest.mark.parametrize("value", [-3, 2**70, "x", object(), True])
def test_a_bad_setting_is_a_config_error_naming_it(value: Any) -> None:
    from routed_experts.proxy.config import settings_declared

    for s in settings_declared():
        with pytest.raises(rx.ConfigError, match=s.name):
            ProxyConfig(**{s.name: value})
    from routed_experts.proxy.config import text_settings_declared

    for name, _, _ in text_settings_declared():
        if not isinstance(value, str):
            with pytest.raises(rx.ConfigError, match=f"{name}: expected a str"):
                ProxyConfig(**{name: value})
    with pytest.raises(rx.ConfigError, match="prefill_policy: expected one of round_robin"):
        ProxyConfig(prefill_policy="cache_aware")
    with pytest.raises(rx.ConfigError, match="session_header: expected a header name"):
        ProxyConfig(session_header="X Session")
    with pytest.raises(rx.ConfigError,
                       match='routing_format: expected compact or engine, got "npy"'):
        ProxyConfig(routing_format="npy")


def test_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="read_timeout"):
        ProxyConfig(read_timeout=0)
    with pytest.raises(ValueError, match="max_in_flight"):
        ProxyConfig(max_in_flight=0)
    with pytest.raises(TypeError):
        create_app(["p"], ["d"], no_such_setting=1)


def test_a_prefill_body_with_two_kv_transfer_params_is_502_prefill() -> None:
    decode = Engine()
    with stack([Engine(fail="dup_kv")], [decode]) as url:
        r = post(url)
        assert r.status_code == 502 and r.json()["error"]["side"] == "prefill"
        assert "duplicate key `kv_transfer_params`" in r.json()["error"]["message"]
        assert not decode.requests  # decode was never called with a guess


@pytest.mark.slow_under_emulation  # 75 s under qemu-user (CI's critical path); natively seconds
def test_bench_proxy_runs_every_part_small(tmp_path: Any) -> None:
    """The benchmark command end to end on a small shape: every part runs, bounded, and no 200
    carries wrong routing."""
    import json

    from rx_bench.cli import main

    out = tmp_path / "bench.json"
    rc = main(
        [
            "bench-proxy",
            "--tokens", "64", "--layers", "2", "--top-k", "2",
            "--requests", "20", "--concurrency", "4", "--memory-concurrency", "4",
            "--idle-wait", "2",
            "--json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    results = json.loads(out.read_text())
    for part in ("load", "stream"):
        assert results[part]["proxy"]["ok"] == 20 and results[part]["passthrough"]["ok"] == 20
        # vllm-router (tests/requirements.txt installs it) as a column, its routing checked
        assert results[part]["vllm-router"]["ok"] == 20
        assert set(results[part]["vs_vllm_router"]) == {"cpu_per_request", "requests_per_s", "p99"}
        # The fair race: vllm-router's decode answers every row, so both send the same bytes,
        # and the no-merge floor relays that many with nothing to merge.
        assert results[part]["floor"]["ok"] == 20 and "vs_floor" in results[part]
        assert results[part]["pinned"] is True
    assert len(results["memory"]["rounds"]) == 3
    faults = results["faults"]
    assert all(f["wrong_200"] == 0 for f in faults.values())
    # Least load (decode's default) sends the hung server no more than it holds: its requests
    # under way keep it last, so fewer than --eject-after fail and it may stay in rotation.
    hung = faults["one decode hung"]
    assert hung["ejected"] in ([], ["decode[1]"])
    assert hung["requests"] - hung["ok"] <= 3
    assert hung["ok_of_healthy_pct"] == 100.0
    assert faults["decode drops routing"]["ok"] == 0
    assert faults["one prefill down"]["ok"] == faults["one prefill down"]["requests"]


@pytest.mark.slow_under_emulation  # 15 s under qemu: the bench harness's own Python
def test_bench_proxy_without_vllm_router_says_how_to_add_it(
    monkeypatch: Any, capsys: Any
) -> None:
    from rx_bench import proxy as bench
    from rx_bench.cli import main

    monkeypatch.setattr(bench, "vllm_router", lambda: None)
    argv = ["bench-proxy", "--tokens", "16", "--layers", "1", "--top-k", "2", "--requests", "4",
            "--concurrency", "2", "--only", "load"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "(vllm-router not installed: pip install vllm-router (tests/requirements.txt" in out
    rows = [ln.split()[0] for ln in out.splitlines() if "req/s" in ln and "wrong 200s" in ln]
    assert rows == ["passthrough", "proxy", "floor"]


def test_the_proxy_command_serves_and_logs_one_line_per_request() -> None:
    """`routed-experts proxy` as an operator starts it: the Rust data plane, the flags, the log
    line on stderr (through Python's logging); stopped with SIGTERM."""

    with Server(Engine().app()) as p, Server(Engine().app()) as d:
        args = ["--prefill", p.url, "--decode", d.url, "--read-timeout", "30",
                "--max-in-flight", "8"]
        proc, port_url, said = proxy_command(args)
        port = port_url.rsplit(":", 1)[1]
        try:
            wait_for(lambda: _answers(port_url + "/healthcheck"), seconds=20)
            r = post(port_url, headers={"X-Request-Id": "from-the-cli"})
            assert r.status_code == 200 and rx.from_response(r.content) == expected(COMPLETION)
        finally:
            proc.terminate()
            _, rest = proc.communicate(timeout=20)
    err = "".join(said) + rest
    # SIGTERM drains the requests under way (none here) and exits 0.
    assert proc.returncode == 0, err
    assert "shutdown complete: every request finished" in err
    assert "request_id=from-the-cli endpoint=/v1/completions status=200" in err
    start_line = f"routed-experts proxy on http://127.0.0.1:{port}; prefill {p.url}; decode {d.url}"
    assert start_line in err


@pytest.mark.parametrize(
    ("flag", "url", "message"),
    [
        ("--prefill", "localhost:18100", "expected a URL starting with http://"),
        ("--decode", "http://localhost:99999", "expected a port from 1 to 65535"),
        ("--decode", "http://:8000", "expected a host"),
        ("--prefill", "ftp://h:1", "expected a URL starting with http://"),
        ("--decode", "http://h:1/?x=1", "expected no query or fragment"),
    ],
)
def test_the_proxy_command_checks_upstream_urls_before_it_starts(
    flag: str, url: str, message: str
) -> None:
    import subprocess
    import sys

    good = "http://127.0.0.1:1"
    urls = {"--prefill": good, "--decode": good, flag: url}
    cmd = [sys.executable, "-m", "routed_experts.cli", "proxy"]
    cmd += [arg for pair in urls.items() for arg in pair]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"argument {flag}: {message}" in r.stderr


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
