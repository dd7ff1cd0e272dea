"""Response bodies in each peer's real shape (format.md §3.2): where each engine puts routing,
in its own format, among the keys it really sends. Each decodes to the truth and merges
prefill + decode to the whole; routing anywhere else, or lmdeploy's Ray references, refuse."""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import routed_experts as rx

LAYERS, TOP_K, PROMPT, GENERATED = 4, 2, 6, 3
TRUTH = np.random.default_rng(11).integers(0, 128, size=(PROMPT + GENERATED - 1, LAYERS, TOP_K))
WHOLE = rx.RoutedExperts.from_array(TRUTH)
PREFILL = rx.RoutedExperts.from_array(TRUTH[:PROMPT])  # prefill ran max_tokens=1
# Decode recomputed nothing of the prompt: zeros there, its own rows after.
DECODE = rx.RoutedExperts.from_array(
    np.concatenate([np.zeros_like(TRUTH[:PROMPT]), TRUTH[PROMPT:]]), num_experts=128
)
SGLANG_HINTS = {"num_layers": LAYERS, "top_k": TOP_K}


def usage() -> dict[str, Any]:
    return {"prompt_tokens": PROMPT, "completion_tokens": GENERATED, "total_tokens": 9}


def logprobs() -> dict[str, Any]:
    top = [{"token": "a", "logprob": -0.1, "bytes": [97]}]
    return {"content": [{"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": top}]}


def vllm_chat(p: rx.RoutedExperts) -> dict[str, Any]:
    # vLLM: base64 of an .npy file per choice.
    message = {"role": "assistant", "content": "abc", "reasoning_content": None, "tool_calls": []}
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "moe",
        "choices": [{
            "index": 0, "message": message, "logprobs": logprobs(), "finish_reason": "length",
            "stop_reason": None, "routed_experts": rx.encode(p, "vllm_npy"),
        }],
        "usage": usage(), "prompt_logprobs": None, "kv_transfer_params": None,
    }


def prime_rl_completion(p: rx.RoutedExperts) -> dict[str, Any]:
    # prime-rl / vLLM router: the compact sidecar per choice.
    return {
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "moe",
        "choices": [{
            "index": 0, "text": "abc", "logprobs": None, "finish_reason": "length",
            "prompt_token_ids": list(range(PROMPT)), "token_ids": [7, 8, 9],
            "routed_experts": rx.encode(p),
        }],
        "usage": usage(),
    }


def sglang_chat(p: rx.RoutedExperts) -> dict[str, Any]:
    # SGLang 0.5.9-0.5.23 chat/completions: top-level sglext, flat int32 base64.
    return {
        "id": "x", "object": "chat.completion", "created": 1, "model": "moe",
        "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "abc", "tool_calls": None},
            "logprobs": None, "finish_reason": "length", "matched_stop": None,
        }],
        "usage": usage(), "metadata": {"weight_version": "default"},
        "sglext": {"routed_experts": rx.encode(p, "sglang"), "cached_tokens": 0},
    }


def sglang_completion(p: rx.RoutedExperts) -> dict[str, Any]:
    body = sglang_chat(p)
    body["object"] = "text_completion"
    body["choices"] = [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"}]
    return body


def sglang_generate(p: rx.RoutedExperts) -> dict[str, Any]:
    # SGLang /generate: meta_info, with the dtype named.
    meta = {
        "id": "r1", "finish_reason": {"type": "length", "length": GENERATED},
        "prompt_tokens": PROMPT, "completion_tokens": GENERATED, "cached_tokens": 0,
        "e2e_latency": 0.1, "routed_experts": rx.encode(p.astype("int32"), "sglang"),
        "routed_experts_dtype": "int32",
    }
    return {"text": "abc", "output_ids": [7, 8, 9], "meta_info": meta}


def nemo_rl_chat(p: rx.RoutedExperts) -> dict[str, Any]:
    # NeMo-RL: the nrlre1 envelope in the message.
    message = {"role": "assistant", "content": "abc", "routed_experts": rx.encode(p, "nemo")}
    return {
        "id": "chatcmpl-2", "object": "chat.completion", "model": "moe",
        "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
        "usage": usage(),
    }


def dynamo_chat(p: rx.RoutedExperts) -> dict[str, Any]:
    # NVIDIA Dynamo: nvext at the top level, compact sidecar.
    return {
        "id": "chatcmpl-3", "object": "chat.completion", "model": "moe",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "abc"},
                     "finish_reason": "length"}],
        "usage": usage(), "nvext": {"worker_id": {"prefill": 1}, "routed_experts": rx.encode(p)},
    }


def lmdeploy_generate(p: rx.RoutedExperts) -> dict[str, Any]:
    # lmdeploy /generate without Ray transport: nested lists token[layer[expert]].
    meta = {"finish_reason": {"type": "length"}, "prompt_tokens": PROMPT,
            "completion_tokens": GENERATED, "routed_experts": p.array.tolist()}
    return {"text": "abc", "output_ids": [7, 8, 9], "meta_info": meta}


PEERS: dict[str, tuple[Callable[[rx.RoutedExperts], dict[str, Any]], dict[str, int]]] = {
    "vllm_chat": (vllm_chat, {}),
    "prime_rl_completion": (prime_rl_completion, {}),
    "sglang_chat": (sglang_chat, SGLANG_HINTS),
    "sglang_completion": (sglang_completion, SGLANG_HINTS),
    "sglang_generate": (sglang_generate, SGLANG_HINTS),
    "nemo_rl_chat": (nemo_rl_chat, {}),
    "dynamo_chat": (dynamo_chat, {}),
    "lmdeploy_generate": (lmdeploy_generate, {}),
}


@pytest.mark.parametrize("peer", sorted(PEERS))
def test_each_peers_body_decodes_and_merges(peer: str) -> None:
    make, hints = PEERS[peer]
    prefill, decode = json.dumps(make(PREFILL)), json.dumps(make(DECODE)).encode()
    got = rx.from_response(decode, **hints)
    assert got is not None and np.array_equal(got.array, DECODE.array), peer
    merged = rx.merge_response(prefill, decode, **hints)
    assert rx.from_response(merged) == WHOLE, peer
    # Everything but the routing value is the decode body's, byte for byte.
    before, after = json.loads(decode), json.loads(merged)
    assert _without_routing(before) == _without_routing(after)


def _without_routing(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _without_routing(v) for k, v in doc.items() if k != "routed_experts"}
    if isinstance(doc, list):
        return [_without_routing(v) for v in doc]
    return doc


def test_sglang_batch_results_are_indexed_by_position() -> None:
    batch = [sglang_generate(PREFILL), sglang_generate(DECODE)]
    got = rx.from_response(json.dumps(batch), 1, **SGLANG_HINTS)
    assert got is not None and np.array_equal(got.array, DECODE.array)


@pytest.mark.parametrize("peer", ["vllm_chat", "sglang_chat", "nemo_rl_chat", "dynamo_chat"])
def test_routing_moved_to_a_place_no_peer_uses_is_refused(peer: str) -> None:
    make, hints = PEERS[peer]
    body = make(DECODE)
    body["choices"][0]["logprobs"] = {"routed_experts": rx.encode(DECODE)}
    for call in (
        lambda: rx.from_response(json.dumps(body), **hints),
        lambda: rx.merge_response(json.dumps(make(PREFILL)), json.dumps(body), **hints),
    ):
        with pytest.raises(rx.PayloadError, match=r"\$\.choices\[0\]\.logprobs\.routed_experts"):
            call()


class ObjectRef:
    """What lmdeploy pickles: a stand-in with the same pickle framing as Ray's ObjectRef."""

    def __init__(self, key: bytes) -> None:
        self.key = key


def test_lmdeploy_ray_references_are_refused_with_a_message_that_says_so() -> None:
    for protocol in (2, 4, 5):
        ref = base64.b64encode(pickle.dumps(ObjectRef(b"\x01" * 28), protocol)).decode()
        # The pickled length rarely fits num_layers x top_k, but the check does not rely on it.
        body = {"text": "x", "meta_info": {"routed_experts": ref}}
        with pytest.raises(rx.PayloadError, match="pickled Python object.*Ray ObjectRef"):
            rx.from_response(json.dumps(body), num_layers=1, top_k=1, dtype="uint8")
    key = {"text": "x", "meta_info": {"routed_experts": "routed_experts-3f2a-17"}}
    with pytest.raises(rx.PayloadError, match="shared store"):
        rx.from_response(json.dumps(key), **SGLANG_HINTS)
