"""The proxy's choice of server as an operator sees it: the policies through ProxyServer on
stand-in engines, servers changed on the admin port, and /metrics read by prometheus_client."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from routed_experts.proxy import ProxyConfig, ProxyServer
from routed_experts.stand_in_engine import StandInEngine


def _call(
    url: str, body: Any = None, method: str = "POST", headers: Any = None
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    head = {"content-type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data, head, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            if r.headers.get_content_type() == "application/json":
                return r.status, json.loads(raw)
            return r.status, raw.decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _completion(proxy: ProxyServer, session: str | None = None, header: str | None = None) -> None:
    body: dict[str, Any] = {"model": "m", "prompt": "hello there", "max_tokens": 2}
    if session is not None:
        body["session_id"] = session
    headers = {"X-Session-Id": header} if header is not None else None
    status, _ = _call(proxy.url + "/v1/completions", body, headers=headers)
    assert status == 200


@pytest.mark.parametrize("policy", ["round_robin", "least_load", "session"])
def test_each_policy_serves_and_spreads_keyless_requests(policy: str) -> None:
    with StandInEngine("prefill") as a, StandInEngine("prefill") as b, StandInEngine(
        "decode"
    ) as d, ProxyServer([a.url, b.url], [d.url], ProxyConfig(prefill_policy=policy)) as proxy:
        for _ in range(6):
            _completion(proxy)
        # One at a time, so every policy takes turns (least load: both idle, ties in turn).
        assert a.stats["requests"] == b.stats["requests"] == 3


def test_a_session_header_keys_the_choice_over_the_body() -> None:
    config = ProxyConfig(session_header="X-Session-Id")
    with StandInEngine("prefill") as a, StandInEngine("prefill") as b, StandInEngine(
        "decode"
    ) as d, ProxyServer([a.url, b.url], [d.url], config) as proxy:
        for i in range(8):  # the body's key differs every time; the header's does not
            _completion(proxy, session=f"body-{i}", header="rollout-1")
        assert sorted([a.stats["requests"], b.stats["requests"]]) == [0, 8]


def test_metrics_parse_with_prometheus_client_and_carry_the_policy_families() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    with StandInEngine("prefill") as a, StandInEngine("prefill") as b, StandInEngine(
        "decode"
    ) as d, ProxyServer([a.url], [d.url], admin_port=0) as proxy:
        admin = f"http://127.0.0.1:{proxy.admin_port}"
        for i in range(4):
            _completion(proxy, session=f"s{i}")
        assert _call(admin + "/upstreams", {"side": "prefill", "url": b.url}) == (
            200, {"changed": True},
        )
        assert _call(admin + "/upstreams", {"side": "prefill", "url": a.url}, "DELETE") == (
            200, {"changed": True},
        )
        for i in range(4):
            _completion(proxy, session=f"s{i}")
        assert b.stats["requests"] == 4 and a.stats["requests"] == 4
        status, listing = _call(admin + "/upstreams", method="GET")
        assert status == 200 and listing["prefill"] == {"policy": "session", "servers": [b.url]}
        # Changes are refused where clients connect.
        assert _call(proxy.url + "/upstreams", {"side": "prefill", "url": a.url})[0] == 404
        status, text = _call(admin + "/metrics", method="GET")
        assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = (
        "routed_experts_proxy_build_info", "process_resident_memory_bytes", "process_cpu_seconds",
        "process_open_fds", "routed_experts_proxy_upstream_picks",
        "routed_experts_proxy_upstream_list_changes",
    )
    for name in expected:
        assert name in families, name
    picks = {
        (s.labels["upstream"], s.labels["choice"]): s.value
        for s in families["routed_experts_proxy_upstream_picks"].samples
        if s.labels["side"] == "prefill" and s.name.endswith("_total")
    }
    # The first four meet `a` as their session's first server; after `a` left, `b`, which
    # is not their first server: each of those is a move.
    assert picks[(a.url, "session")] == 4
    assert picks[(b.url, "session_moved")] == 4
    changes = {
        s.labels["change"]: s.value
        for s in families["routed_experts_proxy_upstream_list_changes"].samples
        if s.name.endswith("_total")
    }
    assert changes == {"added": 1.0, "removed": 1.0}
    healthy = {
        s.labels["upstream"]
        for s in families["routed_experts_proxy_upstream_healthy"].samples
        if s.labels["side"] == "prefill"
    }
    assert healthy == {b.url}, "a removed server leaves the health gauge"


@pytest.mark.slow_under_emulation  # thirty engine processes started, one front after another
def test_the_sessions_benchmark_runs_small_and_every_front_answers_right() -> None:
    import argparse

    from rx_bench.sessions import Workload, run_sessions

    w = Workload(sessions=4, turns=3, first=64, growth=32, servers=2, cache_blocks=64,
                 us_per_token=0.0, decode_ms=0.0)
    results = run_sessions(argparse.Namespace(), w)
    fronts = results["fronts"]
    assert {"proxy round_robin", "proxy least_load", "proxy session"} <= set(fronts)
    for name, f in fronts.items():
        assert f["ok"] == f["requests"] == 12 and f["wrong_200"] == 0, name
    # Turns meet their prefix: a session moved past the load bound stays where it went, so
    # only a move in mid-session (rare at this load) costs a turn its prefix.
    assert fronts["proxy session"]["of_ideal"] >= 0.75
    assert isinstance(fronts["proxy session"]["sessions_moved"], int)
    assert results["workload"]["ideal_cached_tokens"] == 4 * (64 + 96) // 16 * 16
