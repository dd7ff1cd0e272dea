"""End to end on loopback: stand-in prefill and decode engines, the proxy in front, real HTTP."""

from __future__ import annotations

import base64
import contextlib
import io
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from engines import (
    KV_PARAMS,
    Engine,
    Server,
    closed_port_url,
    max_tokens,
    prompt_tokens,
    truth,
)

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
        prefill_urls = [closed_port_url()]  # nothing listens
    # The stand-in engines stream routing on completions and chat (as SGLang does): relayed,
    # unless a test asks for the default (`stream_routing` buffered, vLLM's case).
    settings = {"read_timeout": 10, "stream_routing": "relay", **opts.get("proxy", {})}
    proxy = Server(create_app(prefill_urls, decode_urls, **settings))
    proxy.__enter__()
    try:
        yield {
            "url": proxy.url, "prefills": prefills, "decodes": decodes, "opts": opts,
            "upstreams": (prefill_urls, decode_urls),
        }
    finally:
        proxy.__exit__()
        for s in servers:
            s.__exit__()


def expected(body: dict[str, Any]) -> rx.RoutedExperts:
    tokens = prompt_tokens(body)
    S = int(body.get("routed_experts_prompt_start", 0))
    return rx.RoutedExperts.from_array(truth(tokens, max_tokens(body))[S:], start=S)


def read_as_one_vllm_client_does(body: bytes, choice: int = 0) -> np.ndarray:
    """What a client written against one vLLM server does with a reply: the choice's
    `routed_experts`, base64 of a `.npy` file, straight into numpy (no library)."""
    value = json.loads(body)["choices"][choice]["routed_experts"]
    return np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False)


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
    body = dict(CHAT if "chat" in endpoint else COMPLETION, routed_experts_prompt_start=start,
                logprobs=True if "chat" in endpoint else 1)
    for _ in range(2):  # twice: round robin reaches both pairs
        r = httpx.post(stack["url"] + endpoint, json=body, timeout=30)
        assert r.status_code == 200, r.text
        # The start asked for, as a client of one vLLM server passes it: vLLM's .npy value,
        # which the proxy answers in its own format by default, carries none.
        got = rx.from_response(r.content, start=start)
        want = expected(body)
        # Equal values are not enough (uint8 == uint16): the dtype and start too.
        assert got is not None and got == want and got.start == start
        assert got.dtype == want.dtype
        # Decode's logprobs, one per generated token (prefill's has one in all).
        logprobs = json.loads(r.content)["choices"][0]["logprobs"]
        assert len(logprobs.get("content") or logprobs["token_logprobs"]) == max_tokens(body)
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
        # Decode is asked only for rows it computes: from the prompt's last position on (a
        # real vLLM 0.32 decode engine dies asked for the rows of KV it received).
        assert sent["routed_experts_prompt_start"] == max(start, len(prompt_tokens(body)) - 1)
        assert max_tokens(sent) == max_tokens(body)


@pytest.mark.parametrize("stack", [{"fmt": "vllm_021"}], indirect=True, ids=["vllm_021"])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_021_split_bodies_merge_through_the_proxy(
    stack: dict[str, Any], endpoint: str
) -> None:
    body = CHAT if "chat" in endpoint else COMPLETION
    r = httpx.post(stack["url"] + endpoint, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert rx.from_response(r.content) == expected(body)
    doc = json.loads(r.content)
    # The prompt rows are prefill's, written where vLLM 0.21 writes them.
    P = len(prompt_tokens(body))
    assert doc["prompt_routed_experts"] == truth(prompt_tokens(body), 1)[:P].tolist()
    # A client start does not apply to this shape: refused, never a 200 with shifted rows.
    r = httpx.post(stack["url"] + endpoint, json={**body, "routed_experts_prompt_start": 2},
                   timeout=30)
    assert r.status_code == 502 and "start" in r.text, r.text


GENERATE = {"token_ids": list(range(3, 40)),
            "sampling_params": {"max_tokens": 9, "temperature": 0.0}}


@pytest.mark.parametrize("stack", [{"fmt": "vllm_npy"}, {"fmt": "compact"}], indirect=True,
                         ids=["vllm_npy", "compact"])
@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("stream", [False, True])
def test_generate_endpoint_merges_plain_and_streamed(
    stack: dict[str, Any], start: int, stream: bool
) -> None:
    body: dict[str, Any] = {
        **GENERATE, "stream": stream,
        "sampling_params": {**GENERATE["sampling_params"], "routed_experts_prompt_start": start}}
    want = rx.RoutedExperts.from_array(truth(body["token_ids"], 9)[start:], start=start)
    url = stack["url"] + "/inference/v1/generate"
    if not stream:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert rx.from_response(r.content, start=start) == want
        doc = json.loads(r.content)
        assert doc["usage"]["completion_tokens"] == 9
        assert doc["choices"][0]["token_ids"] == [7] * 9
    else:
        with httpx.stream("POST", url, json=body, timeout=30) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        # Routing once, on the finishing event (the last); every other event's null, as sent.
        routed = [c for c in chunks if c["choices"] and c["choices"][0]["routed_experts"]]
        assert len(routed) == 1 and routed[0]["choices"][0]["finish_reason"] == "length"
        assert rx.from_response(json.dumps(routed[0]), start=start) == want
        assert routed[0] == chunks[-1] and len(chunks) == 9
        assert all(c["choices"][0]["routed_experts"] is None for c in chunks[:-1])
    prefill = stack["prefills"][0].requests[0]
    assert prefill["sampling_params"]["max_tokens"] == 1 and prefill["stream"] is False
    assert prefill["sampling_params"]["routed_experts_prompt_start"] == start
    assert prefill["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    decode = stack["decodes"][0].requests[0]
    assert decode["sampling_params"]["max_tokens"] == 9
    assert decode["kv_transfer_params"] == KV_PARAMS


def read_npy_text(text: str) -> np.ndarray:
    """vLLM's routing text read as a client of one vLLM engine reads it: numpy, no library."""
    import base64
    import io

    return np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)


ENGINE_FORMAT = {"fmt": "vllm_npy", "proxy": {"routing_format": "engine"}}


@pytest.mark.parametrize("stack", [ENGINE_FORMAT], indirect=True, ids=["engine_format"])
@pytest.mark.parametrize(("endpoint", "stream"), [
    ("/v1/completions", False), ("/v1/chat/completions", False),
    # vLLM sends routing on no completions or chat stream: generate's only.
    ("/inference/v1/generate", False), ("/inference/v1/generate", True)])
@pytest.mark.parametrize("start", [0, 5])
def test_routing_format_engine_answers_vllms_own_npy_text(
    stack: dict[str, Any], endpoint: str, start: int, stream: bool
) -> None:
    """`routing_format="engine"`: the merged routing in the decode engine's format, vLLM's
    `.npy` text holding rows `[S, P + G - 1)`, what numpy reads from one vLLM engine."""
    if endpoint.endswith("generate"):
        body: dict[str, Any] = {
            **GENERATE, "stream": stream,
            "sampling_params": {**GENERATE["sampling_params"],
                                "routed_experts_prompt_start": start}}
        prompt, generated = body["token_ids"], 9
    else:
        body = dict(CHAT if "chat" in endpoint else COMPLETION, routed_experts_prompt_start=start)
        prompt, generated = prompt_tokens(body), max_tokens(body)
    want = truth(prompt, generated)[start:]
    url = stack["url"] + endpoint
    if stream:
        with httpx.stream("POST", url, json=body, timeout=30) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        doc = json.loads(events[-2])
    else:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 200, r.text
        doc = json.loads(r.content)
    text = doc["choices"][0]["routed_experts"]
    assert isinstance(text, str) and text.startswith("k05VTVBZ")  # the .npy magic
    got = read_npy_text(text)
    # The dtype the engine sent (128 experts: uint8), the truth's rows.
    assert got.dtype == np.uint8 and np.array_equal(got, want)


def test_a_merged_body_keeps_decodes_logprobs_and_usage(stack: dict[str, Any]) -> None:
    # Fields only decode sends reach the client (the byte-for-byte property of every other
    # byte is tests/test_proxy_bytes.py's).
    r = httpx.post(stack["url"] + "/v1/completions", json={**COMPLETION, "logprobs": 1},
                   timeout=30)
    doc = json.loads(r.content)
    assert doc["choices"][0]["logprobs"]["token_logprobs"] == [-0.12345678901234568] * 9
    assert doc["usage"] == {"prompt_tokens": 37, "total_tokens": 46, "completion_tokens": 9}


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
    assert err["kind"] == "gap", err  # the core's rule, for a client to branch on
    with httpx.stream(
        "POST", stack["url"] + "/v1/completions", json=dict(COMPLETION, stream=True), timeout=30
    ) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    last = json.loads(lines[-1][6:])["error"]
    assert (last["side"], last["kind"]) == ("merge", "gap"), last


def test_client_mistakes_are_400_and_health_answers(stack: dict[str, Any]) -> None:
    for bad in (b"{not json", b"[1, 2]"):
        r = httpx.post(stack["url"] + "/v1/completions", content=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["side"] == "client"
    h = httpx.get(stack["url"] + "/health", timeout=30)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert all(not e.requests for e in stack["prefills"] + stack["decodes"])


def test_app_mounts_in_a_users_asgi_app() -> None:
    """The proxy as a piece of the user's own ASGI app, beside the user's own routes."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    prefill, decode = Engine(), Engine(mode="delta")
    with Server(prefill.app()) as p, Server(decode.app()) as d:
        proxy = create_app([p.url], [d.url])

        async def own(request: Any) -> PlainTextResponse:
            return PlainTextResponse("mine")

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            yield
            await proxy.aclose()  # a mounted app's own lifespan does not run

        user_app = Starlette(
            routes=[Route("/own", own), Mount("/moe", app=proxy)], lifespan=lifespan
        )
        with Server(user_app) as app:
            r = httpx.post(app.url + "/moe/v1/completions", json=COMPLETION, timeout=30)
            assert r.status_code == 200, r.text
            assert httpx.get(app.url + "/own", timeout=30).text == "mine"
            assert httpx.get(app.url + "/moe/health", timeout=30).json()["status"] == "ok"
    got = rx.from_response(r.content)
    assert got is not None
    np.testing.assert_array_equal(got.array, expected(COMPLETION).array)


# --- integrity: never a 200 with wrong or missing routing -----------------------------------------

def stream_events(url: str, body: dict[str, Any], **kw: Any) -> tuple[httpx.Response, list[str]]:
    with httpx.stream("POST", url, json=body, timeout=30, **kw) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return r, events


@pytest.mark.parametrize("stack", [{"decode_fail": "no_done"}], indirect=True)
def test_a_stream_cut_short_ends_with_an_error_event(stack: dict[str, Any]) -> None:
    r, events = stream_events(stack["url"] + "/v1/completions", dict(COMPLETION, stream=True))
    assert r.status_code == 200  # headers were sent before the cut
    last = json.loads(events[-1])
    assert last["error"]["side"] == "decode" and "[DONE]" in last["error"]["message"]


@pytest.mark.parametrize("stack", [{"decode_fail": "json_reply"}], indirect=True)
def test_a_json_reply_to_a_stream_request_is_502(stack: dict[str, Any]) -> None:
    body = dict(COMPLETION, stream=True)
    r = httpx.post(stack["url"] + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["side"] == "decode"


@pytest.mark.parametrize("stack", [{"decode_fail": "sse_reply"}], indirect=True)
def test_a_stream_reply_to_a_plain_request_is_502(stack: dict[str, Any]) -> None:
    r = httpx.post(stack["url"] + "/v1/completions", json=COMPLETION, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["side"] == "decode"


@pytest.mark.parametrize("stack", [{"decode_fail": "no_routing"}], indirect=True)
def test_decode_without_routing_is_502_decode_never_a_200(stack: dict[str, Any]) -> None:
    r = httpx.post(stack["url"] + "/v1/completions", json=COMPLETION, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["side"] == "decode"
    assert r.json()["error"]["kind"] == "missing_routing"
    _, events = stream_events(stack["url"] + "/v1/completions", dict(COMPLETION, stream=True))
    last = json.loads(events[-1])
    assert last["error"]["side"] == "decode" and "missing routing" in last["error"]["message"]
    assert last["error"]["kind"] == "missing_routing"
    assert "[DONE]" not in events  # a client stops at [DONE]: the error would go unseen


@pytest.mark.parametrize(
    "stack", [{"prefill_fail": "no_routing", "mode": "delta"}], indirect=True
)
def test_prefill_without_routing_is_502_prefill_and_decode_asked_from_its_last_position(
    stack: dict[str, Any],
) -> None:
    # A prefill server started without routing beside a decode server with it: decode is asked
    # from P - 1 all the same (the "delta" stand-in answers 500 before that, where vLLM 0.32's
    # engine dies), and the client gets the missing half named, never a 200.
    P = len(COMPLETION["prompt"])
    r = httpx.post(stack["url"] + "/v1/completions", json=COMPLETION, timeout=30)
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["side"] == "prefill" and "missing routing on the prefill side" in error["message"]
    _, events = stream_events(stack["url"] + "/v1/completions", dict(COMPLETION, stream=True))
    last = json.loads(events[-1])
    assert last["error"]["side"] == "prefill" and "[DONE]" not in events
    asked = [q for d in stack["decodes"] for q in d.requests]
    assert len(asked) == 2 and all(q["routed_experts_prompt_start"] == P - 1 for q in asked)


@pytest.mark.parametrize(
    "stack",
    [{"prefill_fail": "no_routing", "decode_fail": "no_routing", "mode": "delta"}],
    indirect=True,
)
def test_without_routing_on_either_side_the_halves_are_relayed(stack: dict[str, Any]) -> None:
    # No routing anywhere (servers started without it): a plain P/D relay, decode asked from
    # P - 1 all the same, since the proxy cannot know decode's setting before it answers.
    r = httpx.post(stack["url"] + "/v1/completions", json=COMPLETION, timeout=30)
    assert r.status_code == 200, r.text
    assert "routed_experts" not in r.json()["choices"][0]
    _, events = stream_events(stack["url"] + "/v1/completions", dict(COMPLETION, stream=True))
    assert events[-1] == "[DONE]"
    asked = [q for d in stack["decodes"] for q in d.requests]
    assert [q["routed_experts_prompt_start"] for q in asked] == [len(COMPLETION["prompt"]) - 1] * 2


@pytest.mark.parametrize("stack", [{"decode_fail": "escaped_key"}], indirect=True)
def test_an_escaped_routing_key_in_a_stream_is_merged(stack: dict[str, Any]) -> None:
    body = dict(COMPLETION, stream=True)
    _, events = stream_events(stack["url"] + "/v1/completions", body)
    assert events[-1] == "[DONE]"
    routed = [json.loads(e) for e in events[:-1] if "routed" in e]
    got = rx.RoutedExperts.from_json(routed[-1]["choices"][0]["routed_experts"])
    assert got == expected(body)  # prompt rows from prefill, not decode's zeros


# --- protocol -----------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_one_request_id_for_both_halves_and_back(stack: dict[str, Any], stream: bool) -> None:
    body = dict(COMPLETION, stream=stream)
    for given in (None, "client-id-7"):
        headers = {"X-Request-Id": given} if given else {}
        with httpx.stream(
            "POST", stack["url"] + "/v1/completions", json=body, headers=headers, timeout=30
        ) as r:
            r.read()
        rid = r.headers["x-request-id"]
        assert rid == given if given else rid.startswith("rx-")
        seen = [h["x-request-id"] for e in stack["prefills"] + stack["decodes"] for h in e.headers]
        assert seen.count(rid) == 2  # the prefill and the decode half


@pytest.mark.parametrize(
    "stack",
    [{}, {"proxy": {"upstream_api_key": "server-key"}}],
    indirect=True,
    ids=["client", "flag"],
)
def test_authorization_reaches_both_servers(stack: dict[str, Any]) -> None:
    r = httpx.post(
        stack["url"] + "/v1/completions",
        json=COMPLETION,
        headers={"Authorization": "Bearer client-key"},
        timeout=30,
    )
    assert r.status_code == 200
    key = stack["opts"].get("proxy", {}).get("upstream_api_key")
    want = f"Bearer {key}" if key else "Bearer client-key"
    for e in stack["prefills"][:1] + stack["decodes"][:1]:
        assert e.headers[0]["authorization"] == want
    # /v1/models follows the same rule (the upstream key in place of the client's).
    r = httpx.get(stack["url"] + "/v1/models", headers={"Authorization": "Bearer client-key"},
                  timeout=30)
    assert r.status_code == 200
    sent = [h for e in stack["decodes"] for h in e.headers if "content-length" not in h]
    assert sent and sent[-1].get("authorization") == want


def test_min_tokens_go_to_decode_only(stack: dict[str, Any]) -> None:
    body = dict(COMPLETION, min_tokens=3, min_completion_tokens=3)
    assert httpx.post(stack["url"] + "/v1/completions", json=body, timeout=30).status_code == 200
    prefill, decode = stack["prefills"][0].requests[0], stack["decodes"][0].requests[0]
    assert "min_tokens" not in prefill and "min_completion_tokens" not in prefill
    assert decode["min_tokens"] == 3 and decode["min_completion_tokens"] == 3


@pytest.mark.parametrize("start", [-1, "3", 2.5, True, 10_000])
def test_a_bad_prompt_start_is_a_400(stack: dict[str, Any], start: Any) -> None:
    body = dict(COMPLETION, routed_experts_prompt_start=start)
    r = httpx.post(stack["url"] + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "routed_experts_prompt_start" in err["message"]
    if start == 10_000:  # only an engine knows the prompt's length in tokens: prefill refused
        assert err["side"] == "prefill" and len(stack["decodes"][0].requests) == 0
        return
    assert err["side"] == "client"
    assert err["type"] == "invalid_request_error"
    assert err["param"] == "routed_experts_prompt_start"  # the field at fault, named


def test_a_start_past_the_prompt_is_a_400_when_prefill_ignored_it() -> None:
    # vLLM 0.25 to 0.27 ignore the start on completions: prefill's rows from 0 tell the
    # proxy the prompt's length, and a start past it is the client's error, decode never asked.
    prefill, decode = Engine(release="0.27"), Engine(release="0.27")
    with Server(prefill.app()) as p, Server(decode.app()) as d, Server(
        create_app([p.url], [d.url])
    ) as proxy:
        body = dict(COMPLETION, routed_experts_prompt_start=10_000)
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["side"] == "client" and err["param"] == "routed_experts_prompt_start"
        assert "not below the prompt's length (37 tokens)" in err["message"]
        assert len(prefill.requests) == 1 and decode.requests == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_id_is_kept_only_when_short_and_printable(
    stack: dict[str, Any], stream: bool
) -> None:
    # A long id would ride on every upstream request; one with spaces or control characters
    # would forge fields in the log line. Both are replaced, never echoed or forwarded.
    body = dict(COMPLETION, stream=stream)
    kept = "a" * 128
    for given, keep in ((kept, True), ("a" * 129, False), ("x endpoint=/admin status=200", False),
                        ("tab\there", False), ("é-accent".encode(), False)):
        with httpx.stream("POST", stack["url"] + "/v1/completions", json=body,
                          headers={"X-Request-Id": given}, timeout=30) as r:
            r.read()
        rid = r.headers["x-request-id"]
        assert (rid == given) if keep else (rid.startswith("rx-") and len(rid) < 40), rid
        seen = [h["x-request-id"] for e in stack["prefills"] + stack["decodes"] for h in e.headers]
        assert seen.count(rid) == 2  # both halves carry the id the client got back
        assert (given in seen) == keep  # a refused id never reaches an upstream (bytes never do)


def test_a_body_nested_past_what_json_writers_take_is_a_400_before_any_upstream(
    stack: dict[str, Any],
) -> None:
    # orjson reads 1024 levels but writes about 255 (the exact limit varies by release): such a
    # body used to be a plain-text 500.
    url = stack["url"] + "/v1/completions"
    for depth in (300, 1000):
        nested = b"[" * depth + b"]" * depth
        body = b'{"model": "moe", "prompt": [1, 2], "extra": ' + nested + b"}"
        r = httpx.post(url, content=body, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["side"] == "client" and "cannot be written back as JSON" in err["message"]
    assert all(not e.requests for e in stack["prefills"] + stack["decodes"])
    shallow = b'{"model": "moe", "prompt": [1, 2], "extra": ' + b"[" * 200 + b"]" * 200 + b"}"
    assert httpx.post(url, content=shallow, timeout=30).status_code == 200


def test_models_and_healthcheck_answer(stack: dict[str, Any]) -> None:
    m = httpx.get(stack["url"] + "/v1/models", timeout=30)
    assert m.status_code == 200 and m.json()["data"][0]["id"] == "moe"
    h = httpx.get(stack["url"] + "/healthcheck", timeout=30)
    assert h.status_code == 200 and h.json() == {"status": "ok"}


def test_malformed_client_bodies_are_400_not_500_or_502(stack: dict[str, Any]) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    nan = b'{"model": "moe", "prompt": [1, 2], "temperature": NaN}'
    for bad in (deep, nan, b'{"model": "moe", "prompt": [1], "max_tokens": Infinity}'):
        r = httpx.post(stack["url"] + "/v1/completions", content=bad, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["side"] == "client"
    assert all(not e.requests for e in stack["prefills"] + stack["decodes"])


@pytest.mark.parametrize("stack", [{"prefill_fail": "array"}], indirect=True)
def test_a_prefill_body_that_is_not_an_object_is_502_prefill(stack: dict[str, Any]) -> None:
    r = httpx.post(stack["url"] + "/v1/completions", json=COMPLETION, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["side"] == "prefill"


@pytest.mark.parametrize(
    "stack", [{"prefill_down": True}, {"decode_fail": "500"}], indirect=True, ids=["down", "500"]
)
def test_client_messages_do_not_name_upstream_addresses(stack: dict[str, Any]) -> None:
    r = httpx.post(stack["url"] + "/v1/completions", json=COMPLETION, timeout=30)
    assert r.status_code == 502
    assert "127.0.0.1" not in r.text and "http://" not in r.text


def test_the_asgi_app_answers_its_own_failures_in_the_error_shape() -> None:
    """The ASGI app relays to its server: a client that leaves mid-body gets nothing and raises
    nothing, and a relay that cannot reach the server answers a JSON 502, never a plain 500."""
    import asyncio

    from routed_experts.proxy import create_app

    app = create_app([closed_port_url()], [closed_port_url()])
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}

    async def run(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        pending = iter(messages)

        async def receive() -> dict[str, Any]:
            message = next(pending, None)
            if message is None:
                await asyncio.sleep(3600)
            assert message is not None
            return message

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await asyncio.wait_for(app(scope, receive, send), 30)
        return sent

    async def main() -> None:
        part = {"type": "http.request", "body": b'{"model"', "more_body": True}
        left = await run([part, {"type": "http.disconnect"}])
        assert left == []
        server = app._base_url()
        await app.aclose()
        app._base_url = lambda: server  # type: ignore[method-assign]  # a server now gone
        sent = await run([{"type": "http.request", "body": b"{}", "more_body": False}])
        assert sent[0]["status"] == 502
        err = json.loads(sent[1]["body"])["error"]
        assert err["side"] == "proxy" and "could not be reached" in err["message"]
        assert err["kind"] is None  # the shape of the data plane's own errors
        await app.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("stack", [{"proxy": {"max_merge_bytes": 64}}], indirect=True)
def test_the_merge_cap_is_the_proxys_own_setting(stack: dict[str, Any]) -> None:
    # Over the proxy's cap: a 502 that names the limit, plain and streamed.
    r = httpx.post(stack["url"] + "/v1/completions", json=COMPLETION, timeout=30)
    message = r.json()["error"]["message"]
    assert r.status_code == 502 and "limit of 64 bytes" in message, r.text
    assert r.json()["error"]["kind"] == "too_large"
    # The proxy's own setting is named, not the Python API's (the core's kind says which).
    assert "--max-merge-bytes" in message and "set_max_bytes" not in message, message
    # The Python API's own cap is another setting: lowering it does not reach a running proxy,
    # and a proxy with room merges while it is low.
    limit = rx.get_max_bytes()
    rx.set_max_bytes(64)
    try:
        with Server(create_app(*stack["upstreams"], read_timeout=10)) as roomy:
            ok = httpx.post(roomy.url + "/v1/completions", json=COMPLETION, timeout=30)
    finally:
        rx.set_max_bytes(limit)
    assert ok.status_code == 200, ok.text
    got = rx.from_response(ok.content)
    assert got is not None and got == expected(COMPLETION)


@pytest.mark.parametrize("stack", [{"mode": "full", "fmt": "vllm_npy"}], indirect=True,
                         ids=["vllm_npy"])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("start", [0, 5])
def test_a_client_of_one_vllm_server_reads_the_proxys_answer_unchanged(
    stack: dict[str, Any], endpoint: str, start: int
) -> None:
    # Issue 55: the engine's own format is the default, so the proxy is a drop-in in front of
    # a vLLM client: the same key, .npy text of rows [S, P + G - 1), read with np.load.
    body = dict(CHAT if "chat" in endpoint else COMPLETION, routed_experts_prompt_start=start)
    r = httpx.post(stack["url"] + endpoint, json=body, timeout=30)
    assert r.status_code == 200, r.text
    rows = read_as_one_vllm_client_does(r.content)
    want = expected(body)
    assert rows.dtype == want.dtype and rows.shape == want.to_numpy().shape
    np.testing.assert_array_equal(rows, want.to_numpy())

