"""A real vLLM in prefill/decode behind the proxy (`make test-engines`, which CI runs): two
servers of vLLM's CPU build joined by its ExampleConnector, the tiny MoE model made here, and
every reply's routing checked against the model's own (transformers, in the engine's
environment). The prompt is long enough that decode receives two 32-token blocks of KV: a vLLM
0.32 decode engine loads them and computes only the rest, as in production, and dies when asked
for rows of positions it did not compute; 0.33 (the release CI runs) ignores KV whose routing it
does not hold and recomputes the prompt (format.md §3.5). Either way the proxy asks decode from
`P - 1`."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import routed_experts as rx
from routed_experts.proxy import ProxyConfig, ProxyServer

HARNESS = Path(__file__).resolve().parent / "harness"
sys.path.insert(0, str(HARNESS))

import engine  # noqa: E402
import tiny_model  # noqa: E402
from pd_stack import Stack, plugin_env  # noqa: E402

from routed_experts import vllm_plugin  # noqa: E402

PYTHON = Path(os.environ["RX_VLLM_PYTHON"])
RELEASE = os.environ["RX_VLLM_RELEASE"]
# 67 tokens: decode loads two full 32-token blocks and computes the last three positions.
LONG = " ".join(tiny_model.WORDS[i % 24] for i in range(66))


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    # On the release the project's vLLM plugin is for, decode runs with it enabled: every test
    # here asks decode as any router does (unmarked), which the plugin leaves as vLLM answers
    # it; the plugin's own tests, last in this file, mark their requests.
    with tempfile.TemporaryDirectory(prefix="rx-live-") as tmp:
        env = plugin_env(Path(tmp) / "plugin") if RELEASE.startswith(vllm_plugin.RELEASE) else None
        s = Stack(PYTHON, RELEASE, Path(tmp), decode_env=env)
        try:
            s.start()
            yield s
        finally:
            s.stop()


def truth(stack: Stack, sequences: list[list[int]]) -> list[np.ndarray]:
    """The model's own routing of each sequence, rows [0, len - 1) (the last sampled token has
    none), from transformers in the engine's environment."""
    out = subprocess.run(
        [str(PYTHON), str(HARNESS / "truth.py"), str(stack.model)],
        input=json.dumps(sequences), capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [np.asarray(t["rows"])[: len(s) - 1] for s, t in zip(sequences, json.loads(out.stdout))]


def both_alive(stack: Stack) -> None:
    assert stack.prefill.alive() and stack.decode.alive(), "an engine died\n" + stack.logs()


def check_reply(stack: Stack, reply: httpx.Response, prompt_ids: list[int] | None = None) -> None:
    assert reply.status_code == 200, reply.text
    doc = reply.json()
    seqs, got = [], []
    for c in doc["choices"]:
        p = rx.from_response(reply.content, choice=c["index"])
        assert p is not None and p.start == 0, f"choice {c['index']} without routing"
        prompt = prompt_ids or doc.get("prompt_token_ids") or c.get("prompt_token_ids")
        seqs.append(list(prompt) + list(c["token_ids"]))
        got.append(p.to_numpy())
    for c, g, t in zip(doc["choices"], got, truth(stack, seqs)):
        np.testing.assert_array_equal(g, t)
        # The proxy answers in vLLM's own format by default: a client of one vLLM server
        # reads it as it reads that server's, base64 of a .npy file straight into numpy.
        rows = np.load(io.BytesIO(base64.b64decode(c["routed_experts"])), allow_pickle=False)
        np.testing.assert_array_equal(rows, t)


COMPLETION = {"model": "tiny", "prompt": LONG, "max_tokens": 5, "temperature": 0,
              "return_token_ids": True}  # fmt: skip
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": LONG}], "max_tokens": 5,
        "temperature": 0, "return_token_ids": True}  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", COMPLETION),
        ("/v1/completions", {**COMPLETION, "n": 2, "temperature": 1.0, "seed": 11}),
        ("/v1/chat/completions", CHAT),
    ],
    ids=["completions", "completions-n2", "chat"],
)
def test_plain_requests_through_the_proxy_merge_to_the_truth(
    stack: Stack, path: str, body: dict[str, Any]
) -> None:
    # A new prompt each time: one seen before would be a prefix-cache hit on prefill.
    body = json.loads(json.dumps(body).replace(LONG, LONG + " " + path.split("/")[-1]
                                               + str(body.get("n", 1))))  # fmt: skip
    check_reply(stack, httpx.post(stack.url + path, json=body, timeout=300))
    both_alive(stack)


def generation_tokens(server: engine.Server) -> float:
    """The tokens a server has sampled so far (its `vllm:generation_tokens_total`)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:generation_tokens_total")]  # fmt: skip
    assert counts, "the server's /metrics has no vllm:generation_tokens_total"
    return sum(counts)


@pytest.mark.parametrize("n", [4, 16])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_group_is_prefilled_once_and_every_choice_merges_to_the_truth(
    stack: Stack, path: str, n: int
) -> None:
    # A GRPO group: the proxy asks prefill for one choice (the prompt's KV and routing are the
    # same for all; vLLM's own counter shows the one token it sampled) and decode for n.
    base = COMPLETION if path == "/v1/completions" else CHAT
    body = json.loads(json.dumps(base).replace(LONG, f"{LONG} group {path[4:]} {n}"))
    body = {**body, "n": n, "temperature": 1.0, "seed": 3}
    before = generation_tokens(stack.prefill)
    check_reply(stack, httpx.post(stack.url + path, json=body, timeout=300))
    sampled = 0.0
    for _ in range(50):  # the counter is updated as the engine logs its step
        sampled = generation_tokens(stack.prefill) - before
        if sampled:
            break
        time.sleep(0.1)
    assert sampled == 1, f"prefill sampled {sampled} tokens for a group of {n}"
    both_alive(stack)


def test_the_shared_prompt_answer_carries_the_prompt_once_and_reads_to_the_truth(
    stack: Stack,
) -> None:
    n = 8
    body = {**COMPLETION, "prompt": f"{LONG} shared", "n": n, "temperature": 1.0, "seed": 5,
            "routed_experts_prompt_routing": "shared"}  # fmt: skip
    reply = httpx.post(stack.url + "/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    doc = reply.json()
    prompt = doc.get("prompt_token_ids") or doc["choices"][0]["prompt_token_ids"]
    shared = rx.decode(doc["prompt_routed_experts"])
    assert (shared.start, shared.stop) == (0, len(prompt))
    seqs = [list(prompt) + list(c["token_ids"]) for c in doc["choices"]]
    for c, want in zip(doc["choices"], truth(stack, seqs)):
        got = rx.from_response(reply.content, choice=c["index"])
        assert got is not None and got.start == 0
        np.testing.assert_array_equal(got.to_numpy(), want)
        assert rx.decode(c["routed_experts"]).start == len(prompt)
    both_alive(stack)


def test_the_loop_in_float32_replays_what_native_routing_already_agrees_with(
    stack: Stack,
) -> None:
    # The R3 loop (tests/real/test_live_vllm_r3.py closes it in bfloat16) on the float32 stack: the
    # wide-gated model routes the same in both libraries, so replay changes nothing it needs to
    # and hands every router the engine's ids; the log-probs agree to float32 rounding.
    f = stack.r3_loop("float32", count=3, tokens=8, tag="fp32 loop")
    assert f["replay_agree"] == f["native_agree"] == f["routers"] > 0, f
    assert f["flipped"] == 0 and f["replay_logprob_gap"]["max"] < 1e-3, f
    both_alive(stack)


def generate_ids(stack: Stack, text: str) -> list[int]:
    r = httpx.post(stack.prefill.url + "/tokenize", json={"model": "tiny", "prompt": text})
    return list(r.json()["tokens"])


def test_generate_plain_and_streamed_merge_to_the_truth(stack: Stack) -> None:
    ids = generate_ids(stack, LONG + " generate")
    body = {
        "model": "tiny",
        "token_ids": ids,
        "sampling_params": {"max_tokens": 5, "temperature": 0},
    }
    check_reply(
        stack, httpx.post(stack.url + "/inference/v1/generate", json=body, timeout=300), ids
    )
    ids = generate_ids(stack, LONG + " stream")
    body = {**body, "token_ids": ids, "stream": True}
    with httpx.stream("POST", stack.url + "/inference/v1/generate", json=body, timeout=300) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-1]
    events = [json.loads(line[6:]) for line in lines[:-1]]
    generated = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    routed = [e for e in events if any(c.get("routed_experts") for c in e["choices"])]
    assert len(routed) == 1, "the routing comes once, with the finishing event"
    p = rx.from_response(json.dumps(routed[0]))
    assert p is not None and p.start == 0
    np.testing.assert_array_equal(p.to_numpy(), truth(stack, [ids + generated])[0])
    both_alive(stack)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_completions_and_chat_end_with_every_choices_routing(
    stack: Stack, endpoint: str, n: int
) -> None:
    # vLLM sends no routing on these streams; the proxy (`stream_routing` buffered, the
    # default) asks decode plainly and answers the stream the client asked for, each choice's
    # routing on its finishing chunk. Read with the OpenAI SDK, as a client would.
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0,
                           timeout=300)
    text = f"{LONG} sdk stream {endpoint} {n}"
    extra = {"return_token_ids": True}
    common = {"model": "tiny", "max_tokens": 5, "n": n, "stream": True, "extra_body": extra,
              "stream_options": {"include_usage": True}, "temperature": 1.0 if n > 1 else 0,
              "seed": 11}
    if endpoint == "chat":
        stream = client.chat.completions.create(
            messages=[{"role": "user", "content": text}], **common)
    else:
        stream = client.completions.create(prompt=text, **common)
    prompt: list[int] | None = None
    routed, generated, usage = {}, {}, []
    for chunk in stream:
        prompt = prompt or (chunk.model_extra or {}).get("prompt_token_ids")
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for c in chunk.choices:
            extra_fields = c.model_extra or {}
            prompt = prompt or extra_fields.get("prompt_token_ids")
            if c.finish_reason is not None:
                routed[c.index] = rx.from_response(chunk, c.index)
                generated[c.index] = extra_fields["token_ids"]
    assert sorted(routed) == list(range(n)) and prompt, (routed, prompt)
    want = truth(stack, [list(prompt) + list(generated[i]) for i in range(n)])
    for i in range(n):
        got = routed[i]
        assert got is not None and got.start == 0
        np.testing.assert_array_equal(got.to_numpy(), want[i])
    assert [u.completion_tokens for u in usage] == [sum(len(g) for g in generated.values())]
    both_alive(stack)


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)],
    ids=["completions", "chat"],
)
def test_a_relayed_stream_the_release_sends_no_routing_on_ends_in_an_error_never_done(
    stack: Stack, path: str, body: dict[str, Any]
) -> None:
    # `stream_routing` relay: decode's own stream, which vLLM sends without routing here.
    # The client sees every token, then the proxy's error as the last event, and no [DONE] (an
    # OpenAI client stops reading there); the error names the setting that gives the routing.
    body = {**body, "stream": True}
    relay = ProxyConfig(stream_routing="relay")
    with ProxyServer([stack.prefill.url], [stack.decode.url], relay) as proxy:
        with httpx.stream("POST", proxy.url + path, json=body, timeout=300) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert "data: [DONE]" not in lines
    last = json.loads(lines[-1][6:])
    assert last["error"]["side"] == "decode" and "missing routing" in last["error"]["message"]
    assert "--stream-routing buffered" in last["error"]["message"]
    both_alive(stack)


def answered_again(
    stack: Stack, body: dict[str, Any], tag: str, attempts: int = 120
) -> httpx.Response:
    """The first 200 once the restarted server is back in rotation (until then: 502 or 503).
    Every prompt new from its first token: prefill saves each prompt's KV blocks in the shared
    folder, and a restarted prefill server (its own prefix cache empty) that finds a prompt's
    leading blocks there loads them, computes no routing for them and dies when asked for
    routing from 0 (vLLM 0.32; format.md §3.5; 0.33 recomputes them instead)."""
    for i in range(attempts):
        body = {**body, "prompt": f"{tag} back {i} {LONG}"}
        r = httpx.post(stack.url + "/v1/completions", json=body, timeout=300)
        if r.status_code == 200:
            return r
        assert r.status_code in (502, 503), r.text
        time.sleep(1)
    raise AssertionError(f"not answered again in {attempts} tries: {r.text}")


def test_decode_killed_mid_stream_and_down_gives_clear_errors_then_is_taken_back(
    stack: Stack,
) -> None:
    # Killed while it streams: the stream ends with the proxy's error event, no [DONE].
    ids = generate_ids(stack, LONG + " killed mid-stream")
    long = {"max_tokens": 400, "min_tokens": 400, "temperature": 0}
    body = {"model": "tiny", "token_ids": ids, "stream": True, "sampling_params": long}
    lines = []
    with httpx.stream("POST", stack.url + "/inference/v1/generate", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if len(lines) == 2:
                    stack.decode.stop()
    assert "data: [DONE]" not in lines
    assert json.loads(lines[-1][6:])["error"]["side"] == "decode", lines[-1]
    down_then_taken_back(stack, stack.decode, "decode")


def test_prefill_killed_gives_a_clear_error_then_is_taken_back(stack: Stack) -> None:
    stack.prefill.stop()
    down_then_taken_back(stack, stack.prefill, "prefill")


def down_then_taken_back(stack: Stack, server: engine.Server, side: str) -> None:
    """While `server` is down a plain request is an error naming its side (or, once the proxy
    ejected it, the proxy's 503); restarted, it is taken back and answers right."""
    body = {**COMPLETION, "prompt": f"{side} down {LONG}"}
    r = httpx.post(stack.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code in (502, 503), r.text
    assert r.json()["error"]["side"] in (side, "proxy"), r.text
    server.start()
    server.wait_ready()
    check_reply(stack, answered_again(stack, COMPLETION, side))
    both_alive(stack)


# The project's vLLM plugin (routed_experts/vllm_plugin.py), enabled on this stack's decode on
# the release it is for: these tests, last, mark their requests as the proxy's --vllm-plugin
# mark does. Their prompts start with words no other test's prompt starts with, so decode holds
# none of their blocks from before. The plugin's rules without vLLM: tests/test_vllm_plugin.py.
on_plugin_release = pytest.mark.skipif(
    not RELEASE.startswith(vllm_plugin.RELEASE), reason=f"the plugin is not for vLLM {RELEASE}"
)


def _ask(server: engine.Server, prompt: str, **body: Any) -> dict[str, Any]:
    status, raw, _ = engine.post(server.url + "/v1/completions", {
        "model": "tiny", "prompt": prompt, "temperature": 0, "return_token_ids": True, **body})
    assert status == 200, raw[:2000]
    return dict(json.loads(raw))


def _rows(answer: dict[str, Any]) -> np.ndarray:
    text = answer["choices"][0]["routed_experts"]
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def _cached(answer: dict[str, Any]) -> int:
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _prompt_length(answer: dict[str, Any]) -> int:
    return len(answer["choices"][0].get("prompt_token_ids") or answer["prompt_token_ids"])


@on_plugin_release
def test_plugin_a_marked_decode_loads_prefills_kv_and_answers_as_one_server(stack: Stack) -> None:
    prefill, decode = stack.prefill, stack.decode
    log = (stack.work / "decode.log").read_text(errors="replace")
    plugin_lines = [line for line in log.splitlines() if "plugin" in line.lower()]
    assert any("routed_experts vLLM plugin active" in line for line in plugin_lines), plugin_lines
    for prompt in ["alpha " + LONG + " one", "alpha " + LONG + " two"]:
        # Prefill saves the prompt's KV (as the proxy asks it: one token, remote decode).
        first = _ask(prefill, prompt, max_tokens=1,
                     kv_transfer_params={"do_remote_decode": True})  # fmt: skip
        p = _prompt_length(first)
        blocks = (p - 2) // 32 * 32  # ExampleConnector's hit: whole blocks before P - 1
        assert blocks == 64, p
        # The oracle: the prefill server answers the prompt alone, from 0 (a producer never
        # loads KV).
        alone = _ask(prefill, prompt, max_tokens=5)
        # Decode, marked and asked from P - 1 as the proxy asks: the blocks before it load (the
        # second prompt finds the first's, shared, on decode already).
        params = {**(first.get("kv_transfer_params") or {}), vllm_plugin.MARKER: True}
        got = _ask(decode, prompt, max_tokens=5, routed_experts_prompt_start=p - 1,
                   kv_transfer_params=params)  # fmt: skip
        assert _cached(got) == blocks, got.get("usage")
        assert got["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
        np.testing.assert_array_equal(_rows(got), _rows(alone)[p - 1 :])
        # The same prompt again, unmarked: from P - 1 the loaded blocks may serve (their routing
        # is not asked); from 0 they may not, and the prompt is computed, exactly.
        again = _ask(decode, prompt, max_tokens=5, routed_experts_prompt_start=p - 1)
        np.testing.assert_array_equal(_rows(again), _rows(alone)[p - 1 :])
        whole = _ask(decode, prompt, max_tokens=5)
        assert _cached(whole) == 0, whole.get("usage")
        np.testing.assert_array_equal(_rows(whole), _rows(alone))
        assert whole["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
        both_alive(stack)
    # Unmarked, a prompt whose KV prefill saved (a prefix decode has not seen) is recomputed,
    # as vLLM 0.33 does on its own.
    prompt = "gamma " + LONG
    first = _ask(prefill, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    p = _prompt_length(first)
    plain = _ask(decode, prompt, max_tokens=5, routed_experts_prompt_start=p - 1,
                 kv_transfer_params=first.get("kv_transfer_params"))  # fmt: skip
    assert _cached(plain) == 0, plain.get("usage")
    # The prefill server, without the plugin, is left as it is.
    assert "routed_experts vLLM plugin" not in (stack.work / "prefill.log").read_text(
        errors="replace")


@on_plugin_release
def test_plugin_through_the_proxy_marking_decode_the_answer_is_one_servers(stack: Stack) -> None:
    # The proxy with --vllm-plugin mark: prefill asked for one token, decode marked and asked
    # from P - 1; the merged answer is the prefill server's own to the same request, and
    # decode's usage says it loaded the prompt.
    prefill, decode = stack.prefill, stack.decode
    with ProxyServer([prefill.url], [decode.url], ProxyConfig(vllm_plugin="mark")) as proxy:
        for n, prompt in [(1, "delta " + LONG), (2, "epsilon " + LONG)]:
            # Sampled with a seed (vLLM takes no greedy n > 1): one server given the same
            # request answers the same choices.
            sampling = {"max_tokens": 5, "n": n, "temperature": 1.0, "seed": 7}
            body = {"model": "tiny", "prompt": prompt, "return_token_ids": True, **sampling}
            status, raw, _ = engine.post(proxy.url + "/v1/completions", body)
            assert status == 200, raw[:2000]
            answer = json.loads(raw)
            alone_raw = engine.post(prefill.url + "/v1/completions", body)[1]
            alone = json.loads(alone_raw)
            assert len(answer["choices"]) == n
            for choice in range(n):
                got = rx.from_response(raw, choice=choice)
                want = rx.from_response(alone_raw, choice=choice)
                assert got is not None and want is not None
                np.testing.assert_array_equal(got.to_numpy(), want.to_numpy())
                tokens = answer["choices"][choice]["token_ids"]
                assert tokens == alone["choices"][choice]["token_ids"]
            assert _cached(answer) >= 64, answer.get("usage")
    both_alive(stack)
