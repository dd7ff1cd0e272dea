"""End to end on loopback: stand-in prefill and decode engines, the proxy in front, real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from engines import KV_PARAMS, Engine, Server, max_tokens, prompt_tokens, truth

import routed_experts as rx
from routed_experts.proxy import PREFILL_KV_TRANSFER_PARAMS, create_app


@pytest.fixture
def stack(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Two prefill and two decode engines (round robin) behind the proxy."""
    opts: dict[str, Any] = getattr(request, "param", {})
    prefills = [
        Engine(fmt=opts.get("fmt", "compact"), fail=opts.get("prefill_fail")) for _ in range(2)
    ]
    decodes = [
        Engine(
            mode=opts.get("mode", "full"),
            fmt=opts.get("fmt", "compact"),
            fail=opts.get("decode_fail"),
        )
        for _ in range(2)
    ]
    servers = [Server(e.app()) for e in prefills + decodes]
    for s in servers:
        s.__enter__()
    prefill_urls = [s.url for s in servers[:2]]
    decode_urls = [s.url for s in servers[2:]]
    if opts.get("prefill_down"):
        prefill_urls = ["http://127.0.0.1:9"]  # discard port: nothing listens
    proxy = Server(create_app(prefill_urls, decode_urls, timeout=10))
    proxy.__enter__()
    try:
        yield {"url": proxy.url, "prefills": prefills, "decodes": decodes}
    finally:
        proxy.__exit__()
        for s in servers:
            s.__exit__()


def expected(body: dict[str, Any]) -> rx.RoutedExperts:
    tokens = prompt_tokens(body)
    S = int(body.get("routed_experts_prompt_start", 0))
    return rx.RoutedExperts.from_array(truth(tokens, max_tokens(body))[S:], start=S)


COMPLETION = {"model": "moe", "prompt": list(range(3, 40)), "max_tokens": 9}
CHAT = {
    "model": "moe",
    "messages": [{"role": "user", "content": "route me, please"}],
    "max_completion_tokens": 7,
}

MODES = [{"mode": "full"}, {"mode": "delta"}, {"mode": "full", "fmt": "vllm_npy"}]


@pytest.mark.parametrize("stack", MODES, indirect=True, ids=["full", "delta", "vllm_npy"])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("start", [0, 5])
def test_plain_requests_merge_to_the_truth(
    stack: dict[str, Any], endpoint: str, start: int
) -> None:
    body = dict(CHAT if "chat" in endpoint else COMPLETION, routed_experts_prompt_start=start)
    for _ in range(2):  # twice: round robin reaches both pairs
        r = httpx.post(stack["url"] + endpoint, json=body, timeout=30)
        assert r.status_code == 200, r.text
        got = rx.from_response(r.content)
        want = expected(body)
        assert got == want and got is not None and got.start == start
        assert json.loads(r.content)["choices"][0].get("logprobs", {}) is not None
    for engine in stack["prefills"]:
        assert len(engine.requests) == 1
        sent = engine.requests[0]
        assert sent["max_tokens"] == 1 and sent["stream"] is False
        assert sent["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
        assert sent.get("routed_experts_prompt_start") == start
        if "chat" in endpoint:
            assert sent["max_completion_tokens"] == 1
    for engine in stack["decodes"]:
        assert len(engine.requests) == 1
        sent = engine.requests[0]
        assert sent["kv_transfer_params"] == KV_PARAMS  # what prefill returned reached decode
        assert sent.get("routed_experts_prompt_start") == start
        assert max_tokens(sent) == max_tokens(body)


def test_merged_body_keeps_every_other_byte(stack: dict[str, Any]) -> None:
    r = httpx.post(stack["url"] + "/v1/completions", json=COMPLETION, timeout=30)
    doc = json.loads(r.content)
    assert doc["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.12345678901234568
    assert doc["usage"] == {"prompt_tokens": len(COMPLETION["prompt"]), "completion_tokens": 9}


@pytest.mark.parametrize(
    "stack", [{"mode": "full"}, {"mode": "delta"}], indirect=True, ids=["full", "delta"]
)
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_relays_events_and_merges_routing(stack: dict[str, Any], endpoint: str) -> None:
    body = dict(
        CHAT if "chat" in endpoint else COMPLETION, stream=True, routed_experts_prompt_start=2
    )
    events = []
    with httpx.stream("POST", stack["url"] + endpoint, json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == max_tokens(body)
    routed = [c for c in chunks if "routed_experts" in c["choices"][0]]
    assert len(routed) == 1
    got = rx.RoutedExperts.from_json(routed[0]["choices"][0]["routed_experts"])
    assert got == expected(body)
    sent = stack["prefills"][0].requests[0]
    assert sent["stream"] is False and sent["max_tokens"] == 1


@pytest.mark.parametrize("stack", [{"prefill_down": True}], indirect=True)
def test_prefill_unreachable_is_502_prefill(stack: dict[str, Any]) -> None:
    r = httpx.post(stack["url"] + "/v1/completions", json=COMPLETION, timeout=30)
    assert r.status_code == 502
    assert r.json()["error"]["side"] == "prefill"


@pytest.mark.parametrize("stack", [{"decode_fail": "500"}], indirect=True)
def test_decode_failure_is_502_decode(stack: dict[str, Any]) -> None:
    r = httpx.post(stack["url"] + "/v1/completions", json=COMPLETION, timeout=30)
    assert r.status_code == 502
    assert r.json()["error"]["side"] == "decode"
    streamed = httpx.post(
        stack["url"] + "/v1/completions", json=dict(COMPLETION, stream=True), timeout=30
    )
    assert streamed.status_code == 502 and streamed.json()["error"]["side"] == "decode"


@pytest.mark.parametrize("stack", [{"prefill_fail": "400"}], indirect=True)
def test_upstream_4xx_is_passed_on_as_a_client_error(stack: dict[str, Any]) -> None:
    r = httpx.post(stack["url"] + "/v1/completions", json=COMPLETION, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["side"] == "prefill"


@pytest.mark.parametrize("stack", [{"decode_fail": "gap"}], indirect=True)
def test_routing_that_does_not_merge_is_502_merge(stack: dict[str, Any]) -> None:
    r = httpx.post(stack["url"] + "/v1/completions", json=COMPLETION, timeout=30)
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["side"] == "merge" and "are missing" in err["message"]
    with httpx.stream(
        "POST", stack["url"] + "/v1/completions", json=dict(COMPLETION, stream=True), timeout=30
    ) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[-1][6:])["error"]["side"] == "merge"


def test_client_mistakes_are_400_and_health_answers(stack: dict[str, Any]) -> None:
    for bad in (b"{not json", b"[1, 2]"):
        r = httpx.post(stack["url"] + "/v1/completions", content=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["side"] == "client"
    h = httpx.get(stack["url"] + "/health", timeout=30)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert all(not e.requests for e in stack["prefills"] + stack["decodes"])


def test_app_mounts_in_a_users_asgi_app_with_in_process_engines() -> None:
    """The proxy as a piece of the user's own ASGI app, engines reached through ASGI transports."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.routing import Mount

    prefill, decode = Engine(), Engine(mode="delta")

    class Router(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.p = httpx.ASGITransport(app=prefill.app())
            self.d = httpx.ASGITransport(app=decode.app())

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            target = self.p if request.url.host == "prefill" else self.d
            return await target.handle_async_request(request)

    client = httpx.AsyncClient(transport=Router())
    user_app = Starlette(
        routes=[Mount("/moe", app=create_app(["http://prefill"], ["http://decode"], client=client))]
    )

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=user_app), base_url="http://app"
        ) as c:
            return await c.post("/moe/v1/completions", json=COMPLETION)

    r = asyncio.run(call())
    assert r.status_code == 200, r.text
    got = rx.from_response(r.content)
    assert got is not None
    np.testing.assert_array_equal(got.array, expected(COMPLETION).array)
