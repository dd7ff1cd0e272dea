"""Streamed completions and chat get their routing through the proxy (`stream_routing`
buffered, the default): vLLM streams none on these endpoints, so decode is asked plainly and its
merged answer is written as the stream the client asked for. Read with the OpenAI SDK, as a
client would, against the stand-in engine (which streams as vLLM 0.32 does: no routing)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import routed_experts as rx
from routed_experts.proxy import ProxyServer
from routed_experts.stand_in_engine import StandInEngine, prompt_tokens, routing_of

openai = pytest.importorskip("openai")

MODEL = "qwen3-30b-a3b"
PROMPT = "route these forty-odd bytes of prompt, please"


@pytest.fixture(scope="module")
def proxy_url() -> Iterator[str]:
    with StandInEngine("prefill", MODEL) as p, StandInEngine("decode", MODEL) as d:
        with ProxyServer([p.url], [d.url]) as proxy:
            yield proxy.url


def request(endpoint: str, n: int, max_tokens: int, start: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "max_tokens": max_tokens, "n": n,
                            "routed_experts_prompt_start": start}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return body


def truth(body: dict[str, Any], choice: int) -> np.ndarray:
    S = body["routed_experts_prompt_start"]
    return routing_of(prompt_tokens(body), body["max_tokens"], MODEL, choice)[S:]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("include_usage", [False, True])
def test_the_openai_sdk_reads_every_choices_routing_from_the_stream(
    proxy_url: str, endpoint: str, n: int, include_usage: bool
) -> None:
    client = openai.OpenAI(base_url=proxy_url + "/v1", api_key="none", max_retries=0)
    body = request(endpoint, n, 5, 3)
    extra = {"routed_experts_prompt_start": 3}
    options = {"include_usage": True} if include_usage else None
    if endpoint == "chat":
        stream = client.chat.completions.create(
            model="m", messages=body["messages"], max_tokens=5, n=n, stream=True,
            stream_options=options, extra_body=extra,
        )
    else:
        stream = client.completions.create(
            model="m", prompt=PROMPT, max_tokens=5, n=n, stream=True, stream_options=options,
            extra_body=extra,
        )
    chunks = list(stream)
    text = {i: "" for i in range(n)}
    routed: dict[int, Any] = {}
    usage = []
    for chunk in chunks:
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for c in chunk.choices:
            text[c.index] += (c.delta.content or "") if endpoint == "chat" else c.text
            if c.finish_reason is not None:
                assert c.index not in routed, "one finishing chunk per choice"
                routed[c.index] = rx.from_response(chunk, c.index, start=3)
    assert sorted(routed) == list(range(n))
    for i in range(n):
        got = routed[i]
        assert got is not None and got.start == 3
        np.testing.assert_array_equal(got.to_numpy(), truth(body, i))
        assert text[i] == " tok" * 5
    # Choices differ past the prompt: a merge that gave every choice one choice's rows shows.
    if n == 2:
        assert not np.array_equal(routed[0].to_numpy(), routed[1].to_numpy())
    if include_usage:
        assert [(u.prompt_tokens, u.completion_tokens) for u in usage] == [
            (len(prompt_tokens(body)), 5 * n)
        ]
    else:
        assert usage == []


def events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(e) for e in lines[:-1]]


@pytest.mark.slow_under_emulation  # 24 s under qemu; natively seconds
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    endpoint=st.sampled_from(["completions", "chat"]),
    n=st.integers(1, 3),
    max_tokens=st.integers(1, 9),
    start=st.integers(0, 30),
    logprobs=st.booleans(),
)
def test_the_stream_holds_exactly_the_plain_answer(
    proxy_url: str, endpoint: str, n: int, max_tokens: int, start: int, logprobs: bool
) -> None:
    # Invariant: the stream, put back together choice by choice, is the plain answer: no field
    # dropped or changed, the routing on each choice's finishing chunk.
    path = proxy_url + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    body = request(endpoint, n, max_tokens, start)
    if logprobs:
        body["logprobs"] = True if endpoint == "chat" else 1
    plain = httpx.post(path, json=body, timeout=30)
    assert plain.status_code == 200, plain.text
    plain_doc = plain.json()
    streamed = events(path, {**body, "stream": True})
    rebuilt: dict[int, dict[str, Any]] = {}
    for e in streamed:
        assert (e["id"], e["model"]) == (plain_doc["id"], plain_doc["model"])
        for c in e["choices"]:
            into = rebuilt.setdefault(c["index"], {})
            for key, value in c.items():
                if key in ("delta", "text"):
                    if endpoint == "chat":
                        message = into.setdefault("message", {})
                        message.update({k: v for k, v in value.items() if v or k not in message})
                    elif value:
                        into["text"] = into.get("text", "") + value
                    else:
                        into.setdefault("text", "")
                elif value is not None or key not in into:
                    into[key] = value
    for choice in plain_doc["choices"]:
        assert rebuilt[choice["index"]] == choice
        got = rx.from_response(plain.content, choice["index"], start=start)
        assert got is not None
        np.testing.assert_array_equal(got.to_numpy(), truth(body, choice["index"]))
    closing = streamed[-1]
    assert closing["choices"] == [] and "usage" not in closing
    assert closing["kv_transfer_params"] is None


def test_generate_streams_are_still_relayed_as_they_come(proxy_url: str) -> None:
    # vLLM's generate stream carries routing on its finishing event: relayed, not buffered.
    body = {"model": "m", "token_ids": list(range(3, 30)), "stream": True,
            "sampling_params": {"max_tokens": 4, "n": 2}}
    got = events(proxy_url + "/inference/v1/generate", body)
    assert len(got) == 8  # one event per token per choice, as decode sent them
    finishing = [e for e in got if e["choices"][0]["finish_reason"]]
    for e in finishing:
        i = e["choices"][0]["index"]
        p = rx.from_response(e, i)
        assert p is not None
        np.testing.assert_array_equal(p.to_numpy(), routing_of(body["token_ids"], 4, MODEL, i))
