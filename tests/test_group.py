"""A GRPO group through the proxy (format.md §4, §4.1): `n` choices of one prompt. Prefill is
asked for one choice (the prompt's KV and routing are the same for all), decode for the
client's `n`; every choice reads its whole routing, in the engine's answer (the prompt's rows
in every choice) and in the shared-prompt answer (the prompt's rows once)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from engines import EXPERTS, LAYERS, TOP_K, Engine, Server, max_tokens, prompt_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

import routed_experts as rx
from routed_experts.proxy import create_app
from routed_experts.stand_in_engine import routing_of

PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "generate": "/inference/v1/generate",
}


@pytest.fixture(scope="module", params=["per_choice", "shared"])
def group_stack(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """vLLM 0.32's answers (`.npy` text, decode computing from `P - 1`) behind the proxy with
    its defaults, but for `prompt_routing`."""
    prefill, decode = Engine(fmt="vllm_npy", mode="delta"), Engine(fmt="vllm_npy", mode="delta")
    servers = [Server(e.app()) for e in (prefill, decode)]
    for s in servers:
        s.__enter__()
    proxy = Server(create_app([servers[0].url], [servers[1].url], prompt_routing=request.param))
    proxy.__enter__()
    try:
        yield {"url": proxy.url, "prefill": prefill, "decode": decode, "mode": request.param}
    finally:
        proxy.__exit__()
        for s in servers:
            s.__exit__()


def group_request(api: str, n: int, generated: int, start: int | None = None) -> dict[str, Any]:
    prompt = [(i * 37) % 251 + 1 for i in range(300)]
    limits: dict[str, Any] = {"max_tokens": generated, "n": n}
    if start is not None:
        limits["routed_experts_prompt_start"] = start
    if api == "generate":
        return {"model": "moe", "token_ids": prompt, "sampling_params": limits}
    if api == "chat":
        return {"model": "moe", "messages": [{"role": "user", "content": "r" * 300}], **limits}
    return {"model": "moe", "prompt": prompt, **limits}


def choice_truth(body: dict[str, Any], choice: int) -> np.ndarray:
    limits = body.get("sampling_params") or body
    start = int(limits.get("routed_experts_prompt_start") or 0)
    rows = routing_of(prompt_tokens(body), max_tokens(limits), (LAYERS, TOP_K, EXPERTS), choice)
    return rows[start:]


@pytest.mark.parametrize("api", ["completions", "chat", "generate"])
@pytest.mark.parametrize("n", [1, 3, 16])
def test_a_group_is_prefilled_once_and_every_choice_reads_its_own_sequence(
    group_stack: dict[str, Any], api: str, n: int
) -> None:
    prefill, decode = group_stack["prefill"], group_stack["decode"]
    asked = len(prefill.requests), len(decode.requests)
    body = group_request(api, n, generated=6, start=5 if n == 3 else None)
    reply = httpx.post(group_stack["url"] + PATHS[api], json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    # Prefill computed the prompt for one choice; decode generated every choice.
    (to_prefill,) = prefill.requests[asked[0]:]
    (to_decode,) = decode.requests[asked[1]:]
    limits = (lambda b: b.get("sampling_params") or b) if api == "generate" else (lambda b: b)
    assert limits(to_prefill)["n"] == 1 and limits(to_decode)["n"] == n
    doc = json.loads(reply.content)
    assert [c["index"] for c in doc["choices"]] == list(range(n))
    start = 5 if n == 3 else 0
    for i in range(n):
        # vLLM's `.npy` text carries no start: a client passes the one it asked for.
        got = rx.from_response(reply.content, choice=i, start=start)
        assert got is not None and got.start == start, i
        np.testing.assert_array_equal(got.to_numpy(), choice_truth(body, i))
    shared = group_stack["mode"] == "shared"
    assert ("prompt_routed_experts" in doc) == shared
    if shared:
        # The prompt's rows once, each choice's own rows (from the prompt's end) beside them.
        prompt_rows = rx.decode(doc["prompt_routed_experts"])
        assert (prompt_rows.start, prompt_rows.stop) == (start, 300)
        for c in doc["choices"]:
            own = rx.decode(c["routed_experts"])
            assert (own.start, own.stop) == (300, 300 + 6 - 1)


def test_a_request_chooses_its_answer_and_the_field_reaches_no_engine(
    group_stack: dict[str, Any],
) -> None:
    url = group_stack["url"] + PATHS["completions"]
    sizes = {}
    for mode in ("per_choice", "shared"):
        body = {**group_request("completions", 8, 4), "routed_experts_prompt_routing": mode}
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        assert ("prompt_routed_experts" in reply.json()) == (mode == "shared")
        for i in range(8):
            got = rx.from_response(reply.content, choice=i)
            assert got is not None
            np.testing.assert_array_equal(got.to_numpy(), choice_truth(body, i))
        sizes[mode] = len(reply.content)
        for engine in (group_stack["prefill"], group_stack["decode"]):
            assert "routed_experts_prompt_routing" not in engine.requests[-1]
    # Eight choices over a 300-token prompt: the shared answer carries its rows once.
    assert sizes["shared"] * 3 < sizes["per_choice"], sizes


@pytest.mark.parametrize(
    ("field", "stream", "message"),
    [
        ("shared", True, "is for plain requests"),
        ("once", False, "expected per_choice or shared"),
        (True, False, "a string, got true"),
    ],
)
def test_a_shared_answer_it_cannot_give_is_refused_before_any_engine_works(
    group_stack: dict[str, Any], field: Any, stream: bool, message: str
) -> None:
    asked = len(group_stack["prefill"].requests)
    body = {**group_request("completions", 2, 4), "stream": stream,
            "routed_experts_prompt_routing": field}  # fmt: skip
    reply = httpx.post(group_stack["url"] + PATHS["completions"], json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "routed_experts_prompt_routing", error
    assert message in error["message"], error
    assert len(group_stack["prefill"].requests) == asked


def test_a_stream_under_the_shared_setting_ends_each_choice_with_its_whole_routing(
    group_stack: dict[str, Any],
) -> None:
    body = {**group_request("completions", 3, 4), "stream": True}
    with httpx.stream("POST", group_stack["url"] + PATHS["completions"], json=body,
                      timeout=30) as r:  # fmt: skip
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    finishing = [e for e in events for c in e["choices"] if c.get("finish_reason")]
    assert len(finishing) == 3
    for e in finishing:
        (c,) = e["choices"]
        got = rx.from_response(json.dumps(e), choice=c["index"])
        assert got is not None and got.start == 0
        np.testing.assert_array_equal(got.to_numpy(), choice_truth(body, c["index"]))


def npy_body(rows: np.ndarray, prompt: int, generated: int, choices: int = 1) -> bytes:
    values = [rx.encode(rx.RoutedExperts.from_array(rows), "vllm_npy")] * choices
    return json.dumps({
        "choices": [{"index": i, "routed_experts": v} for i, v in enumerate(values)],
        "usage": {"prompt_tokens": prompt, "completion_tokens": generated * choices},
    }).encode()  # fmt: skip


def decode_body(prompt: int, generated: int, n: int, dims: tuple[int, int, int],
                compact: bool) -> bytes:  # fmt: skip
    """Decode's answer to a group asked from `P - 1`: each choice's rows `[P - 1, P + G - 1)`,
    as compact sidecars or vLLM's `.npy` text."""
    rows = [routing_of(list(range(prompt)), generated, dims, c)[prompt - 1:] for c in range(n)]
    return json.dumps({
        "choices": [{"index": c, "routed_experts": rx.encode(
            rx.RoutedExperts.from_array(r, start=prompt - 1),
            "compact" if compact else "vllm_npy")} for c, r in enumerate(rows)],
        "usage": {"prompt_tokens": prompt, "completion_tokens": generated * n},
    }).encode()  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.integers(1, 200),
    generated=st.integers(1, 9),
    n=st.integers(1, 6),
    start_frac=st.floats(0, 1),
    experts=st.sampled_from([64, 384]),
    compact=st.booleans(),
)
def test_shared_and_per_choice_answers_read_the_same_sequences(
    prompt: int, generated: int, n: int, start_frac: float, experts: int, compact: bool
) -> None:
    start = min(int(start_frac * prompt), prompt - 1)
    dims = (3, 2, experts)
    prefill = routing_of(list(range(prompt)), 1, dims)[start:prompt]
    p_body = npy_body(prefill, prompt, 1)
    d_body = decode_body(prompt, generated, n, dims, compact)
    kw = {"start": start, "decode_start": prompt - 1}
    per_choice = rx.merge_response(p_body, d_body, **kw)
    shared = rx.merge_response(p_body, d_body, shared_prompt=True, **kw)
    assert json.loads(shared)["prompt_routed_experts"]["start"] == start
    for c in range(n):
        a, b = rx.from_response(per_choice, choice=c), rx.from_response(shared, choice=c)
        assert a is not None and b is not None
        assert (a.start, a.stop) == (b.start, b.stop) == (start, prompt + generated - 1)
        np.testing.assert_array_equal(a.to_numpy(), b.to_numpy())
    assert rx.from_response(shared, choice=n) is None


def test_a_shared_answer_is_not_merged_again() -> None:
    rows = routing_of(list(range(20)), 4, (3, 2, 64))
    p_body = npy_body(rows[:20], 20, 1)
    d_body = npy_body(rows[19:], 20, 4, choices=2)
    shared = rx.merge_response(p_body, d_body, decode_start=19, shared_prompt=True)
    with pytest.raises(rx.MergeError, match="shared-prompt answer"):
        rx.merge_response(p_body, shared, decode_start=19)


@settings(max_examples=40, deadline=None)
@given(
    prompt=st.integers(1, 120),
    generated=st.integers(1, 6),
    n=st.integers(1, 5),
    shared=st.booleans(),
    compact=st.booleans(),
)
def test_a_group_read_once_packs_as_its_choices_read_whole(
    prompt: int, generated: int, n: int, shared: bool, compact: bool
) -> None:
    dims = (3, 2, 64)
    p_body = npy_body(routing_of(list(range(prompt)), 1, dims)[:prompt], prompt, 1)
    d_body = decode_body(prompt, generated, n, dims, compact)
    answer = rx.merge_response(p_body, d_body, decode_start=prompt - 1, shared_prompt=shared)
    group = rx.group_from_response(answer)
    assert len(group) == n
    # The prompt's rows are one object, shared by every choice; each choice's own follow them.
    assert all(len(sample) == 2 and sample[0] is group[0][0] for sample in group)
    assert (group[0][0].start, group[0][0].stop) == (0, prompt)
    assert all(sample[1].start == prompt for sample in group)
    whole = [rx.from_response(answer, choice=c) for c in range(n)]
    for a, b in zip(rx.pack(group, pad_each_to_multiple=4, mask=True),
                    rx.pack(whole, pad_each_to_multiple=4, mask=True)):  # fmt: skip
        np.testing.assert_array_equal(a, b)


def test_a_samples_parts_must_follow_each_other() -> None:
    a = rx.RoutedExperts.from_array(np.ones((4, 2, 2), dtype=np.uint8))
    later = rx.RoutedExperts.from_array(np.ones((2, 2, 2), dtype=np.uint8), start=5)
    with pytest.raises(rx.MergeError, match="sample 0, part 1 starts at position 5") as e:
        rx.pack([(a, later)])
    assert e.value.kind == "gap" and e.value.details == {"stop": 4, "start": 5}
    with pytest.raises(rx.RoutedExpertsError, match="sample 1, part 1: not a RoutedExperts"):
        rx.pack([(a,), (a, np.ones((2, 2, 2)))])
    assert rx.group_from_response(b'{"choices": [{"index": 0, "text": "x"}]}') == []


def test_the_proxys_answers_read_as_one_group(group_stack: dict[str, Any]) -> None:
    body = group_request("completions", 8, 5)
    reply = httpx.post(group_stack["url"] + PATHS["completions"], json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    group = rx.group_from_response(reply.content)
    assert len(group) == 8 and all(s[0] is group[0][0] for s in group)
    for i, (prompt_rows, own) in enumerate(group):
        np.testing.assert_array_equal(
            np.concatenate([prompt_rows.array, own.array]), choice_truth(body, i))


def test_the_proxys_answer_read_from_the_socket(group_stack: dict[str, Any]) -> None:
    # A prompt whose rows' text passes 4,096 characters, so the reader holds it decoded.
    body = {"model": "moe", "prompt": [(i * 37) % 251 + 1 for i in range(2000)], "n": 6,
            "max_tokens": 5, "routed_experts_prompt_routing": "shared"}  # fmt: skip
    reader = rx.BodyReader()  # read as the socket gives it (format.md §4.1)
    with httpx.stream("POST", group_stack["url"] + PATHS["completions"], json=body,
                      timeout=30) as reply:  # fmt: skip
        assert reply.status_code == 200
        for chunk in reply.iter_raw(4096):
            reader.feed(chunk)
    assert reader.decoded_bytes > 0
    group = reader.group()
    assert len(group) == 6 and all(s[0] is group[0][0] for s in group)
    for i, (prompt_rows, own) in enumerate(group):
        np.testing.assert_array_equal(
            np.concatenate([prompt_rows.array, own.array]), choice_truth(body, i))

