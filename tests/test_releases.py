"""The release matrix of docs/format.md §3.5, row by row: a body built as each producer release
builds it (field names, field order, encodings and token counts read from that release's source,
cited in format.md) is read right, merged right, or refused with a message that says why.

The routing in every body is the same sequence: a prompt of 3 tokens, 2 generated, 2 layers,
top_k 2, so rows for positions 0..3 (the last sampled token has none)."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import numpy as np
import pytest

import routed_experts as rx
from routed_experts.proxy import StreamMerger

ROWS = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 0], [3, 2]], [[5, 4], [7, 6]]])
PROMPT, GENERATED = 3, 2
WHOLE = rx.RoutedExperts.from_array(ROWS)


def npy_b64(arr: np.ndarray) -> str:
    """vLLM 0.22+: `np.save` into a buffer, base64 (0.28+ adds allow_pickle=False; same bytes)."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def flat_b64(arr: np.ndarray) -> str:
    """SGLang: pybase64 of the int32 tensor's bytes."""
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<i4").tobytes()).decode()


def usage(prompt: int = PROMPT, completion: int = GENERATED) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, "prompt_tokens_details": None}


def same(p: rx.RoutedExperts | None, arr: np.ndarray, start: int = 0) -> bool:
    return p is not None and p.start == start and np.array_equal(p.array, arr)


# --- vLLM 0.22.0 to 0.33.0: one base64 .npy per choice (PR #39568) ---------------------------

# Byte for byte what vLLM 0.22.0 writes for ROWS as uint8 (checked against np.save below).
VLLM_022_LITERAL = (
    "k05VTVBZAQB2AHsnZGVzY3InOiAnfHUxJywgJ2ZvcnRyYW5fb3JkZXInOiBGYWxzZSwgJ3NoYXBlJzogKDQsIDIsIDIp"
    "LCB9ICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgIAoAAQIDBAUGBwEA"
    "AwIFBAcG"
)


def vllm_022_completion(routed: str | None, completion: int = GENERATED) -> dict[str, Any]:
    return {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m",
        "choices": [{"index": 0, "text": " a b", "logprobs": None, "finish_reason": "length",
                     "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                     "prompt_token_ids": None, "routed_experts": routed}],
        "service_tier": None, "system_fingerprint": None, "usage": usage(completion=completion),
        "kv_transfer_params": None,
    }


def vllm_022_chat(routed: str | None) -> dict[str, Any]:
    message = {"role": "assistant", "content": "a b", "refusal": None, "annotations": None,
               "audio": None, "function_call": None, "tool_calls": [], "reasoning": None}
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "length",
                     "stop_reason": None, "token_ids": None, "routed_experts": routed}],
        "service_tier": None, "system_fingerprint": None, "usage": usage(),
        "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None,
    }


def test_vllm_022_npy_literal_is_what_np_save_writes() -> None:
    assert npy_b64(ROWS.astype(np.uint8)) == VLLM_022_LITERAL


@pytest.mark.parametrize("make", [vllm_022_completion, vllm_022_chat])
def test_vllm_022_bodies_read_whole(make: Any) -> None:
    body = json.dumps(make(VLLM_022_LITERAL))
    assert same(rx.from_response(body), ROWS)


def test_vllm_028_prompt_start_is_needed_and_checked_against_usage() -> None:
    # routed_experts_prompt_start=1 (0.28+ on the OpenAI endpoints): rows [1, 4), not echoed.
    body = json.dumps(vllm_022_completion(npy_b64(ROWS[1:].astype(np.uint8))))
    assert same(rx.from_response(body, start=1), ROWS[1:], start=1)
    # Without the start the counts say where the rows end, and so which start fits.
    fits = r"holds 3 rows from position 0.*pass that start \(1\)"
    with pytest.raises(rx.PayloadError, match=fits):
        rx.from_response(body)
    with pytest.raises(rx.PayloadError, match="contradict the body's token counts"):
        rx.from_response(body, start=2)


def test_vllm_npy_with_more_rows_than_tokens_is_refused() -> None:
    # 24 rows in a body whose usage says 12 tokens.
    rows = np.zeros((24, 2, 2), dtype=np.uint8) + 1
    body = vllm_022_completion(npy_b64(rows))
    body["usage"] = usage(7, 5)
    for call in (lambda: rx.from_response(json.dumps(body)),
                 lambda: rx.merge_response(json.dumps(body), json.dumps(body))):
        with pytest.raises(rx.PayloadError, match=r"24 rows.*7 prompt tokens.*5 generated"):
            call()


def test_vllm_022_pd_halves_merge() -> None:
    # The prefill half ran max_tokens=1: 1 generated token, rows [0, 3).
    prefill = json.dumps(vllm_022_completion(npy_b64(ROWS[:3].astype(np.uint8)), completion=1))
    zeroed = ROWS.copy()
    zeroed[:3] = 0
    decode = json.dumps(vllm_022_completion(npy_b64(zeroed.astype(np.uint8))))
    assert same(rx.from_response(rx.merge_response(prefill, decode)), ROWS)


# --- /inference/v1/generate: 0.22-0.24 (no usage), 0.25+ (usage), streamed from 0.24 ---------

def generate_022(routed: str) -> dict[str, Any]:
    return {"request_id": "5f0c", "choices": [{"index": 0, "logprobs": None,
            "finish_reason": "length", "token_ids": [11, 12], "routed_experts": routed}],
            "prompt_logprobs": None, "kv_transfer_params": None}


def generate_025(routed: str) -> dict[str, Any]:
    return {"request_id": "generate-tokens-1", "model": "m", "created": 1700000000,
            "choices": [{"index": 0, "logprobs": None, "finish_reason": "length",
                         "token_ids": [11, 12], "routed_experts": routed}],
            "usage": usage(), "prompt_logprobs": None, "kv_transfer_params": None}


def generate_030(routed: str) -> dict[str, Any]:
    body = generate_025(routed)
    body["prompt_token_ids"] = [1, 2, 3]  # return_token_ids
    return body


@pytest.mark.parametrize("make", [generate_022, generate_025, generate_030])
def test_vllm_generate_bodies_read_whole(make: Any) -> None:
    assert same(rx.from_response(json.dumps(make(VLLM_022_LITERAL))), ROWS)


def test_vllm_generate_030_counts_its_own_prompt_ids() -> None:
    body = generate_030(npy_b64(ROWS[:2].astype(np.uint8)))
    del body["usage"]
    # prompt_token_ids (3) and token_ids (2) count the sequence: 2 rows end early.
    with pytest.raises(rx.PayloadError, match=r"3 prompt tokens \(prompt_token_ids\)"):
        rx.from_response(json.dumps(body))


def generate_stream_024(routed: str) -> list[bytes]:
    """0.24+: every event carries routed_experts (null but on the finishing one), then a
    usage-only event (include_usage), then [DONE]."""
    def event(doc: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(doc).encode() + b"\n\n"
    first = {"request_id": "generate-tokens-abc", "choices": [{"index": 0, "logprobs": None,
             "finish_reason": None, "token_ids": [11], "routed_experts": None}], "usage": None}
    last = {"request_id": "generate-tokens-abc", "choices": [{"index": 0, "logprobs": None,
            "finish_reason": "length", "token_ids": [12], "routed_experts": routed}],
            "usage": None}
    tail = {"request_id": "generate-tokens-abc", "choices": [],
            "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}}
    return [event(first), event(last), event(tail), b"data: [DONE]\n\n"]


def test_vllm_generate_stream_routing_event_reads_and_merges() -> None:
    events = generate_stream_024(VLLM_022_LITERAL)
    # The routing event alone: its token_ids are the event's delta, not a count.
    assert same(rx.from_response(events[1][len(b"data: "):].strip()), ROWS)
    zeroed = ROWS.copy()
    zeroed[:3] = 0
    decode_events = generate_stream_024(npy_b64(zeroed.astype(np.uint8)))
    prefill = json.dumps(generate_025(npy_b64(ROWS[:3].astype(np.uint8))) | {
        "usage": usage(completion=1)})
    merger = StreamMerger(prefill)
    out = b"".join(piece for e in decode_events for piece in merger.feed(e))
    out += b"".join(merger.finish())
    assert merger.merged and merger.done
    lines = [line[len(b"data: "):] for line in out.split(b"\n\n") if line.startswith(b"data: {")]
    merged = [json.loads(line) for line in lines]
    assert merged[0] == json.loads(decode_events[0][6:])  # untouched
    assert same(rx.from_response(json.dumps(merged[1])), ROWS)
    assert merged[2] == json.loads(decode_events[2][6:])  # the usage-only event, untouched


# --- vLLM 0.21.0: split nested lists (PR #39917) --------------------------------------------

def vllm_021_completion(prompt_rows: Any, choice_rows: Any | list[Any],
                        completion: int = GENERATED, n: int = 1) -> dict[str, Any]:
    choices = choice_rows if n > 1 else [choice_rows]
    return {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000,
        "prompt_routed_experts": prompt_rows, "model": "m",
        "choices": [{"index": i, "text": " a b", "logprobs": None, "finish_reason": "length",
                     "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                     "prompt_token_ids": None, "routed_experts": rows}
                    for i, rows in enumerate(choices)],
        "service_tier": None, "system_fingerprint": None,
        "usage": usage(completion=completion * n), "kv_transfer_params": None,
    }


def vllm_021_chat(prompt_rows: Any, choice_rows: Any) -> dict[str, Any]:
    message = {"role": "assistant", "content": "a b", "refusal": None, "annotations": None,
               "audio": None, "function_call": None, "tool_calls": [], "reasoning": None}
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000,
        "prompt_routed_experts": prompt_rows, "model": "m",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "length",
                     "stop_reason": None, "token_ids": None, "routed_experts": choice_rows}],
        "service_tier": None, "system_fingerprint": None, "usage": usage(),
        "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
        "kv_transfer_params": None,
    }


PROMPT_ROWS, GEN_ROWS = ROWS[:3].tolist(), ROWS[3:].tolist()


@pytest.mark.parametrize("make", [vllm_021_completion, vllm_021_chat])
def test_vllm_021_split_reads_the_whole_sequence(make: Any) -> None:
    got = rx.from_response(json.dumps(make(PROMPT_ROWS, GEN_ROWS)))
    assert same(got, ROWS)


def test_vllm_021_each_of_n_choices_gets_the_shared_prompt() -> None:
    other = [[[6, 3], [1, 2]]]
    body = json.dumps(vllm_021_completion(PROMPT_ROWS, [GEN_ROWS, other], n=2))
    assert same(rx.from_response(body, 0), ROWS)
    assert same(rx.from_response(body, 1), np.concatenate([ROWS[:3], other]))
    assert rx.from_response(body, 2) is None


def test_vllm_021_prefix_cached_rows_are_missing() -> None:
    # vLLM 0.21 leaves prefix-cached prompt positions at zero (its docs say -1): both are rows
    # no router produced, read as missing (-1).
    for mark in (0, -1):
        prompt = [[[mark, mark], [mark, mark]]] + PROMPT_ROWS[1:]
        got = rx.from_response(json.dumps(vllm_021_completion(prompt, GEN_ROWS)))
        assert got is not None and got.dtype == "int16"
        assert (got.array[0] == -1).all() and np.array_equal(got.array[1:], ROWS[1:])


def test_vllm_021_speculative_decoding_rows_and_limits() -> None:
    # MTP keeps up to one row per generated token: 2 rows for 2 tokens, placed from P.
    extra = [[[2, 6], [0, 4]]]
    got = rx.from_response(json.dumps(vllm_021_completion(PROMPT_ROWS, GEN_ROWS + extra)))
    assert same(got, np.concatenate([ROWS, extra]))
    # Fewer rows than generated tokens (trimmed to the accepted ones): placed from P, no more.
    fewer = rx.from_response(json.dumps(vllm_021_completion(PROMPT_ROWS, GEN_ROWS, completion=3)))
    assert same(fewer, ROWS)
    too_many = GEN_ROWS + extra + extra
    with pytest.raises(rx.PayloadError, match=r"holds 3 rows but the body counts 2 generated"):
        rx.from_response(json.dumps(vllm_021_completion(PROMPT_ROWS, too_many)))
    with pytest.raises(rx.PayloadError, match=r"holds 2 rows but the body counts 3 prompt"):
        rx.from_response(json.dumps(vllm_021_completion(PROMPT_ROWS[:2], GEN_ROWS)))


def test_vllm_021_null_generated_rows() -> None:
    # max_tokens=1 (a P/D prefill): no generated row is owed; the prompt rows are the sequence.
    one = json.dumps(vllm_021_completion(PROMPT_ROWS, None, completion=1))
    assert same(rx.from_response(one), ROWS[:3])
    # Preempted, or ended on a stop string: tokens generated, their rows null. Loud.
    lost = json.dumps(vllm_021_completion(PROMPT_ROWS, None))
    with pytest.raises(rx.PayloadError, match="generated 2 tokens.*routed_experts is null"):
        rx.from_response(lost)
    # Generated rows without the prompt's cannot be placed.
    with pytest.raises(rx.PayloadError, match="prompt_routed_experts is null"):
        rx.from_response(json.dumps(vllm_021_completion(None, GEN_ROWS)))
    # A start hint does not apply: the split shape fixes every position.
    with pytest.raises(rx.PayloadError, match="`start`"):
        rx.from_response(json.dumps(vllm_021_completion(PROMPT_ROWS, GEN_ROWS)), start=2)


def test_vllm_021_pd_halves_merge_prompt_rows_from_prefill() -> None:
    prefill = vllm_021_completion(PROMPT_ROWS, None, completion=1)
    # Decode loaded the prompt's KV cache and ran none of it: its prompt rows are zeros.
    decode = vllm_021_completion(np.zeros((3, 2, 2), dtype=int).tolist(), GEN_ROWS)
    decode["choices"][0]["text"] = " decoded"
    merged = rx.merge_response(json.dumps(prefill), json.dumps(decode))
    assert same(rx.from_response(merged), ROWS)
    doc = json.loads(merged)
    # The top-level field is prefill's; everything else is decode's.
    assert doc["prompt_routed_experts"] == PROMPT_ROWS
    assert {k: v for k, v in doc.items() if k != "prompt_routed_experts"} == {
        k: v for k, v in decode.items() if k != "prompt_routed_experts"}


def test_vllm_021_pd_halves_that_disagree_are_refused() -> None:
    split = json.dumps(vllm_021_completion(PROMPT_ROWS, GEN_ROWS))
    npy = json.dumps(vllm_022_completion(VLLM_022_LITERAL))
    for a, b in ((split, npy), (npy, split)):
        with pytest.raises(rx.MergeError, match="run different releases"):
            rx.merge_response(a, b)
    other_prompt = json.dumps(vllm_021_completion(PROMPT_ROWS[:2], GEN_ROWS) | {
        "usage": usage(prompt=2)})
    with pytest.raises(rx.MergeError, match="prefill returned 3 prompt rows and decode 2"):
        rx.merge_response(split, other_prompt)


# --- SGLang: /generate from 0.5.7, OpenAI sglext from 0.5.9 ---------------------------------

SGL_B64 = "AAAAAAEAAAACAAAAAwAAAAQAAAAFAAAABgAAAAcAAAABAAAAAAAAAAMAAAACAAAABQAAAAQAAAAHAAAABgAAAA=="
SGL_HINTS = {"num_layers": 2, "top_k": 2}


def test_sglang_literal_is_int32_bytes() -> None:
    assert flat_b64(ROWS) == SGL_B64


def sglang_chat_059(routed: str) -> dict[str, Any]:
    return {"id": "rid0", "object": "chat.completion", "created": 1700000000, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ab",
                         "reasoning_content": None, "tool_calls": None}, "logprobs": None,
                         "finish_reason": "length", "matched_stop": None}],
            "usage": usage() | {"reasoning_tokens": 0},
            "metadata": {"weight_version": "default"}, "sglext": {"routed_experts": routed}}


def sglang_generate(routed: Any, completion: int = GENERATED, version: str = "0.5.10") -> Any:
    meta: dict[str, Any] = {"id": "rid0", "finish_reason": {"type": "length", "length": 2},
                            "prompt_tokens": 3, "completion_tokens": completion,
                            "cached_tokens": 0}
    if routed is not None or version == "0.5.9":
        meta["routed_experts"] = routed
    elif version in ("0.5.7", "0.5.8"):
        meta["routed_experts"] = []
    return {"text": "ab", "output_ids": [11, 12], "meta_info": meta}


def test_sglang_chat_and_generate_read_whole() -> None:
    assert same(rx.from_response(json.dumps(sglang_chat_059(SGL_B64)), **SGL_HINTS), ROWS)
    completion = sglang_chat_059(SGL_B64)
    completion["object"] = "text_completion"
    completion["choices"] = [{"index": 0, "text": "ab", "logprobs": None,
                              "finish_reason": "length", "matched_stop": None}]
    assert same(rx.from_response(json.dumps(completion), **SGL_HINTS), ROWS)
    assert same(rx.from_response(json.dumps(sglang_generate(SGL_B64)), **SGL_HINTS), ROWS)


@pytest.mark.parametrize("version", ["0.5.7", "0.5.8", "0.5.9", "0.5.10"])
def test_sglang_generate_without_routing_by_release(version: str) -> None:
    # 0.5.7-0.5.8 write [], 0.5.9 null, 0.5.10+ leave the key out: no routing, each.
    body = json.dumps(sglang_generate(None, version=version))
    assert rx.from_response(body, **SGL_HINTS) is None


def test_sglang_start_len_and_the_releases_that_ignore_it() -> None:
    # 0.5.12+: routed_experts_start_len=2 gives rows [2, 4), not echoed.
    delta = json.dumps(sglang_generate(flat_b64(ROWS[2:])))
    assert same(rx.from_response(delta, start=2, **SGL_HINTS), ROWS[2:], start=2)
    with pytest.raises(rx.PayloadError, match=r"pass that start \(2\)"):
        rx.from_response(delta, **SGL_HINTS)
    # 0.5.8-0.5.11 accept the field and ignore it: every row comes back.
    whole = json.dumps(sglang_generate(SGL_B64))
    with pytest.raises(rx.PayloadError, match="ignore routed_experts_start_len"):
        rx.from_response(whole, start=2, **SGL_HINTS)


def test_sglang_stream_chunk_with_empty_choices() -> None:
    chunk = {"id": "rid0", "object": "chat.completion.chunk", "created": 1700000000,
             "model": "m", "choices": [], "usage": None, "sglext": {"routed_experts": SGL_B64}}
    assert same(rx.from_response(json.dumps(chunk), **SGL_HINTS), ROWS)


def test_sglang_return_meta_info_places() -> None:
    meta = {"id": "rid0", "prompt_tokens": 3, "completion_tokens": 2, "routed_experts": SGL_B64}
    body = sglang_chat_059(SGL_B64)
    body["choices"][0]["meta_info"] = meta
    # 0.5.13-0.5.18: the same routing in sglext and in the choice's meta_info.
    assert same(rx.from_response(json.dumps(body), **SGL_HINTS), ROWS)
    zeroed = ROWS.copy()
    zeroed[:3] = 0
    decode = sglang_chat_059(flat_b64(zeroed))
    decode["choices"][0]["meta_info"] = meta | {"routed_experts": flat_b64(zeroed)}
    prefill = sglang_chat_059(flat_b64(ROWS[:3])) | {"usage": usage(completion=1)}
    merged = json.loads(rx.merge_response(json.dumps(prefill), json.dumps(decode), **SGL_HINTS))
    # Both places rewritten, so they still agree.
    assert merged["sglext"]["routed_experts"] == merged["choices"][0]["meta_info"]["routed_experts"]
    assert same(rx.from_response(json.dumps(merged)), ROWS)
    # Two places that differ are refused.
    body["choices"][0]["meta_info"] = meta | {"routed_experts": flat_b64(zeroed)}
    with pytest.raises(rx.PayloadError, match="two routing values that differ"):
        rx.from_response(json.dumps(body), **SGL_HINTS)
    # 0.5.19+: only the choice's meta_info.
    del body["sglext"]
    body["choices"][0]["meta_info"] = meta
    assert same(rx.from_response(json.dumps(body), **SGL_HINTS), ROWS)


def test_sgl_ext_on_choices_is_no_release_and_refused() -> None:
    # SGLang's docs name choices[i].sgl_ext; no release from 0.5.4 to 0.5.23 writes it.
    body = sglang_chat_059(SGL_B64)
    del body["sglext"]
    body["choices"][0]["sgl_ext"] = {"routed_experts": SGL_B64}
    with pytest.raises(rx.PayloadError, match=r"\$\.choices\[0\]\.sgl_ext\.routed_experts"):
        rx.from_response(json.dumps(body), **SGL_HINTS)


# --- prime-rl, PrimeIntellect router, NeMo-RL, Dynamo, lmdeploy, omni-npu -------------------

def b64(arr: np.ndarray, dtype: str = "uint8") -> str:
    return base64.b64encode(arr.astype(dtype).tobytes()).decode()


@pytest.mark.parametrize(
    "value",
    [
        {"data": b64(ROWS), "shape": [4, 2, 2]},  # prime-rl #2487
        {"data": b64(ROWS), "shape": [4, 2, 2], "start": 0},  # #2632, PrimeIntellect router
        {"data": b64(ROWS), "shape": [4, 2, 2], "start": 0, "dtype": "uint8"},  # #3051 on
    ],
)
def test_prime_rl_compact_by_release(value: dict[str, Any]) -> None:
    body = generate_025("x")
    body["choices"][0]["routed_experts"] = value
    assert same(rx.from_response(json.dumps(body)), ROWS)


def test_base85_compact_is_refused_by_name() -> None:
    # prime-rl before #2487 (and Dynamo before #10529): base85 of the raw int32 array.
    value = {"data": base64.b85encode(ROWS.astype(np.int32).tobytes()).decode(),
             "shape": [4, 2, 2]}
    body = generate_025("x")
    body["choices"][0]["routed_experts"] = value
    with pytest.raises(rx.PayloadError, match="base85.*prime-rl"):
        rx.from_response(json.dumps(body))
    with pytest.raises(rx.PayloadError, match="base85"):
        rx.decode(value)


def test_nemo_rl_message_rows_end_in_a_filler() -> None:
    # NeMo-RL: P+G rows, the last 0..top_k-1 in every layer (not routing), int8 here.
    rows = np.concatenate([ROWS, [[[0, 1], [0, 1]]]])
    value = "nrlre1:int8:5x2x2:" + base64.b64encode(rows.astype(np.int8).tobytes()).decode()
    body = {"id": "chatcmpl-2", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ab",
                         "routed_experts": value}, "finish_reason": "length"}],
            "usage": usage()}
    assert same(rx.from_response(json.dumps(body)), ROWS)
    # P + G - 1 rows (what encode(p, "nemo") writes: no filler) are read whole; fewer are refused.
    whole = value.replace("5x2x2", "4x2x2").rsplit(":", 1)[0] + ":" + b64(ROWS, "int8")
    body["choices"][0]["message"]["routed_experts"] = whole
    assert same(rx.from_response(json.dumps(body)), ROWS)
    short = value.replace("5x2x2", "3x2x2").rsplit(":", 1)[0] + ":" + b64(ROWS[:3], "int8")
    body["choices"][0]["message"]["routed_experts"] = short
    with pytest.raises(rx.PayloadError, match=r"NeMo-RL's rows are \[0, 5\)"):
        rx.from_response(json.dumps(body))


def test_nemo_rl_nested_lists_before_its_pr_3292_end_in_a_filler_too() -> None:
    rows = np.concatenate([ROWS, [[[0, 1], [0, 1]]]])
    body = {"id": "chatcmpl-2", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ab",
                         "routed_experts": rows.tolist()}, "finish_reason": "length"}],
            "usage": usage()}
    assert same(rx.from_response(json.dumps(body)), ROWS)


def test_vllm_026_all_zero_routes_are_read_as_sent_and_named_by_validate() -> None:
    # vLLM 0.26 with monolithic FlashInfer kernels (issue #54730): right shape, every id 0.
    zeros = np.zeros_like(ROWS, dtype=np.uint8)
    got = rx.from_response(json.dumps(vllm_022_completion(npy_b64(zeros))))
    assert got is not None and got.num_tokens == 4
    with pytest.raises(rx.PayloadError, match="all-zero row at position 0"):
        got.validate()
    assert got.validation_report()["zero_rows"] == 4


def test_dynamo_nvext_and_engine_data() -> None:
    value = {"data": b64(ROWS), "shape": [4, 2, 2], "start": 0, "dtype": "uint8"}
    base = {"id": "chatcmpl-3", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ab"},
                         "finish_reason": "length"}], "usage": usage()}
    for nvext in ({"routed_experts": value}, {"engine_data": {"routed_experts": value}},
                  {"routed_experts": value, "engine_data": {"routed_experts": value}}):
        assert same(rx.from_response(json.dumps(base | {"nvext": nvext})), ROWS)


def test_lmdeploy_lists_at_the_choice_and_in_meta_info() -> None:
    chat = {"id": "1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ab"},
                         "finish_reason": "stop", "routed_experts": ROWS.tolist()}],
            "usage": usage()}
    assert same(rx.from_response(json.dumps(chat)), ROWS)
    generate = {"text": "ab", "meta_info": {"prompt_tokens": 3, "completion_tokens": 2,
                                            "routed_experts": ROWS.tolist()}}
    assert same(rx.from_response(json.dumps(generate)), ROWS)
    # More rows than the sequence has positions.
    generate["meta_info"]["routed_experts"] = np.concatenate([ROWS, ROWS[:2]]).tolist()
    with pytest.raises(rx.PayloadError, match="the sequence has 5 positions"):
        rx.from_response(json.dumps(generate))


def test_omni_npu_routing_object_is_refused_by_name() -> None:
    value = {"routed_experts_shape": [4, 2, 2], "routed_experts_dtype": "uint8",
             "routed_experts_str_len": 24, "routed_experts_str": b64(ROWS)}
    body = vllm_022_completion(None)
    body["choices"][0]["routed_experts"] = value
    with pytest.raises(rx.PayloadError, match="omni-npu.*zlib"):
        rx.from_response(json.dumps(body))
    # Its P/D prefill stashes the same keys in kv_transfer_params: routing-like keys out of place.
    stash = vllm_022_completion(None) | {"kv_transfer_params": value}
    with pytest.raises(rx.PayloadError, match=r"\$\.kv_transfer_params\.routed_experts_shape"):
        rx.from_response(json.dumps(stash))


# --- drift: routing-like keys nobody writes, routing weights --------------------------------

UNKNOWN_PLACES = [
    (["choices", 0, "completion_routed_experts"], "$.choices[0].completion_routed_experts"),
    (["routed_expert_weights"], "$.routed_expert_weights"),
    (["choices", 0, "message", "routed_expert_weights"],
     "$.choices[0].message.routed_expert_weights"),
    (["choices", 0, "logprobs", "routed_experts"], "$.choices[0].logprobs.routed_experts"),
    (["usage", "routedExperts"], "$.usage.routedExperts"),
    (["metrics", "prompt_routed_experts"], "$.metrics.prompt_routed_experts"),
    (["choices", 0, "routed_experts_v2"], "$.choices[0].routed_experts_v2"),
    (["sglext", "routed_experts_topk_weights"], "$.sglext.routed_experts_topk_weights"),
    (["nvext", "engine_data", "Routed-Expert-IDs"], "$.nvext.engine_data.Routed-Expert-IDs"),
]


@pytest.mark.parametrize(("where", "path"), UNKNOWN_PLACES)
def test_routing_like_keys_at_unknown_places_are_errors_naming_the_path(
    where: list[Any], path: str
) -> None:
    body: Any = vllm_022_completion(None)
    body["metrics"] = {}
    node = body
    for key in where[:-1]:
        if isinstance(node, dict) and node.get(key) is None:
            node[key] = {}
        node = node[key]
    node[where[-1]] = [[[1, 2]]]
    text = json.dumps(body)
    valid = json.dumps(vllm_022_completion(VLLM_022_LITERAL))
    for call in (lambda: rx.from_response(text), lambda: rx.merge_response(text, text),
                 lambda: rx.merge_response(valid, text), lambda: rx.merge_response(text, valid),
                 lambda: StreamMerger(valid).line(b"data: " + text.encode()),
                 lambda: StreamMerger(text).line(b"data: " + valid.encode())):
        with pytest.raises(rx.PayloadError, match=path.replace("$", r"\$").replace(
                "[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            call()


def test_routing_weights_are_read_past_but_never_merged() -> None:
    ids = {"data": b64(ROWS), "shape": [4, 2, 2], "start": 0, "dtype": "uint8"}
    body = generate_025("x")
    body["choices"][0]["routed_experts"] = ids
    body["choices"][0]["routed_expert_weights"] = {"data": "AAAA", "shape": [1, 1, 1],
                                                   "dtype": "float32"}
    assert same(rx.from_response(json.dumps(body)), ROWS)
    plain = generate_025("x")
    plain["choices"][0]["routed_experts"] = ids
    for pair in ((body, plain), (plain, body), (body, body)):
        with pytest.raises(rx.MergeError, match="routed_expert_weights.*not merged"):
            rx.merge_response(json.dumps(pair[0]), json.dumps(pair[1]))


def test_vllm_021_turns_stitch_into_one_trajectory() -> None:
    rng = np.random.default_rng(5)
    truth = rng.integers(1, 60, size=(10, 2, 2))
    # Turn 1: a prompt of 3, 2 generated: rows [0, 4). Turn 2 resends those 5 tokens and 2 more,
    # the first 4 from the prefix cache (zeros in vLLM 0.21), and generates 4: rows [0, 10).
    turn1 = vllm_021_completion(truth[:3].tolist(), truth[3:4].tolist())
    cached = np.zeros_like(truth[:4])
    turn2 = vllm_021_completion(np.concatenate([cached, truth[4:7]]).tolist(),
                                truth[7:10].tolist(), completion=4) | {"usage": usage(7, 4)}
    t = rx.Trajectory()
    for body in (turn1, turn2):
        got = rx.from_response(json.dumps(body))
        assert got is not None
        t.append(got, overlap="keep")
    assert np.array_equal(t.payload.array, truth)
    # The cached rows are missing, never zeros that a check would compare as routing.
    second = rx.from_response(json.dumps(turn2))
    assert second is not None and (second.array[:4] == -1).all()
