"""The proxy's bytes, against a reference this test computes itself (numpy, base64 and string
splicing; nothing of the library's): for random prompt starts and lengths, dtypes on each side
(uint8, uint16, int16, int32 with ids past 255 and 65535), both decode forms (the whole sequence
with zeroed prompt rows, or a delta from the last prompt position), up to three choices, plain
and streamed in random chunks, what the client gets is decode's body with each routing value
replaced by the merge of format.md §4, written as §3.1 says, and every other byte as decode
sent it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routed_experts as rx
from conftest import sidecar
from routed_experts.proxy import ProxyConfig, ProxyServer

KV = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [1]}
# What each dtype may hold here: a -1 sentinel for the signed ones, ids past 255 and 65535.
RANGES = {"uint8": (0, 255), "uint16": (0, 65535), "int16": (-1, 32767), "int32": (-1, 200_000)}


class Replay:
    """One stand-in for both sides, answering with the bodies the test set: prefill's to a
    request with `do_remote_decode`, else decode's, streamed in the test's chunks when asked."""

    def __init__(self) -> None:
        self.prefill = b""
        self.decode = b""
        self.stream_chunks: list[bytes] = []
        replay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                self.send_response(200)
                if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                    self._whole(replay.prefill)
                elif body.get("stream"):
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for chunk in replay.stream_chunks:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self._whole(replay.decode)

            def _whole(self, body: bytes) -> None:
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# One proxy and one stand-in for every example: the examples change only the bodies it answers.
@pytest.fixture(scope="module")
def front() -> Iterator[tuple[Replay, str]]:
    replay = Replay()
    try:
        # The replayed streams carry routing: relayed as they are (not `buffered`).
        with ProxyServer([replay.url], [replay.url], ProxyConfig(stream_routing="relay")) as proxy:
            yield replay, proxy.url
    finally:
        replay.close()


@st.composite
def exchanges(draw: st.DrawFn) -> dict[str, Any]:
    """One request's halves: the truth, what prefill and decode send, what the merge is."""
    start = draw(st.integers(0, 6))
    prompt = start + draw(st.integers(1, 12))
    generated = draw(st.integers(1, 8))
    layers, top_k = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    prefill_dtype = draw(st.sampled_from(sorted(RANGES)))
    decode_dtype = draw(st.sampled_from(sorted(RANGES)))
    delta = draw(st.booleans())
    choices = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    rows = prompt + generated - 1  # the last generated token has no row
    lo, hi = RANGES[prefill_dtype]
    prefill = rng.integers(lo, hi + 1, size=(prompt - start, layers, top_k))
    prefill = prefill.astype(prefill_dtype)
    lo, hi = RANGES[decode_dtype]
    decodes = []
    for _ in range(choices):
        tail = rng.integers(lo, hi + 1, size=(generated, layers, top_k)).astype(decode_dtype)
        if delta:  # rows [prompt - 1, rows): one prompt row (computed again), then its own
            own = np.concatenate([prefill[-1:].astype(decode_dtype)
                                  if _fits(prefill[-1:], decode_dtype)
                                  else np.zeros_like(tail[:1]), tail[: generated - 1]])
            decodes.append((own, prompt - 1))
        else:  # rows [start, rows), the prompt's zeroed
            zeros = np.zeros((prompt - start, layers, top_k), dtype=decode_dtype)
            decodes.append((np.concatenate([zeros, tail[: generated - 1]]), start))
    merged_dtype = np.promote_types(prefill_dtype, decode_dtype)
    merged = []
    for own, own_start in decodes:
        skip = max(prompt - own_start, 0)
        m = np.concatenate([prefill.astype(merged_dtype), own[skip:].astype(merged_dtype)])
        assert m.shape[0] == rows - start
        merged.append(m)
    return {"start": start, "prompt": prompt, "generated": generated, "prefill": prefill,
            "prefill_choices": draw(st.sampled_from([1, choices])), "decodes": decodes,
            "merged": merged}


def _fits(rows: np.ndarray, dtype: str) -> bool:
    lo, hi = RANGES[dtype]
    return bool(rows.size == 0 or (rows.min() >= lo and rows.max() <= hi))


def _prefill_body(x: dict[str, Any]) -> bytes:
    value = sidecar(x["prefill"], x["start"])
    choices = ",".join(
        f'{{"index": {i}, "text": "x", "finish_reason": "length", "routed_experts": {value}}}'
        for i in range(x["prefill_choices"])
    )
    return f'{{"id": "p", "choices": [{choices}], "kv_transfer_params": {json.dumps(KV)}}}'.encode()


def _choice(i: int, value: str) -> str:
    # Spaces after separators and a field after the routing: bytes the proxy must not touch.
    return (f'{{"index": {i}, "text": " tok\\u00e9", "routed_experts": {value}, '
            f'"finish_reason": "length", "logprobs": null}}')


@pytest.mark.slow_under_emulation  # 27 s under qemu (its kernels: test_base64_kernel, kept)
@settings(max_examples=60, deadline=None)
@given(x=exchanges())
def test_a_plain_reply_is_decodes_body_with_each_value_the_merge(
    front: tuple[Replay, str], x: dict[str, Any]
) -> None:
    replay, url = front
    replay.prefill = _prefill_body(x)
    sent = [_choice(i, sidecar(own, s)) for i, (own, s) in enumerate(x["decodes"])]
    replay.decode = f'{{"id": "d", "choices": [{", ".join(sent)}], "usage": null}}'.encode()
    want = [_choice(i, sidecar(m, x["start"])) for i, m in enumerate(x["merged"])]
    expected = f'{{"id": "d", "choices": [{", ".join(want)}], "usage": null}}'.encode()
    request = {"model": "m", "prompt": list(range(x["prompt"])), "max_tokens": x["generated"],
               "n": len(x["decodes"]), "routed_experts_prompt_start": x["start"]}
    r = httpx.post(url + "/v1/completions", json=request, timeout=30)
    assert r.status_code == 200, r.text
    assert r.content == expected


@pytest.mark.slow_under_emulation  # 27 s under qemu, as above
@settings(max_examples=60, deadline=None)
@given(x=exchanges(), cuts=st.lists(st.integers(1, 10_000), max_size=12))
def test_a_stream_is_decodes_events_with_each_routing_event_the_merge(
    front: tuple[Replay, str], x: dict[str, Any], cuts: list[int]
) -> None:
    replay, url = front
    replay.prefill = _prefill_body(x)

    def events(values: list[str]) -> bytes:
        out = []
        for i in range(len(values)):
            out.append(b'data: {"id": "d", "choices": [{"index": %d, "text": " a"}]}\n\n' % i)
        for i, value in enumerate(values):  # each choice's routing with its last event
            out.append(b'data: {"id": "d", "choices": [%s]}\n\n' % _choice(i, value).encode())
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    stream = events([sidecar(own, s) for own, s in x["decodes"]])
    expected = events([sidecar(m, x["start"]) for m in x["merged"]])
    # The stream in the drawn pieces (each at least a byte), the rest in one.
    pieces, at = [], 0
    for cut in sorted(set(cuts)):
        if at < cut < len(stream):
            pieces.append(stream[at:cut])
            at = cut
    replay.stream_chunks = [*pieces, stream[at:]]
    request = {"model": "m", "prompt": list(range(x["prompt"])), "max_tokens": x["generated"],
               "n": len(x["decodes"]), "stream": True,
               "routed_experts_prompt_start": x["start"]}
    with httpx.stream("POST", url + "/v1/completions", json=request, timeout=30) as r:
        assert r.status_code == 200
        got = r.read()
    assert got == expected


@settings(max_examples=200, deadline=None)
@given(x=exchanges())
def test_merge_response_gives_the_same_bytes_as_the_reference(x: dict[str, Any]) -> None:
    """The library's own merge_response (what a router in Python calls), on the same halves:
    mixed dtypes, ids past 255 and 65535, several choices."""
    sent = [_choice(i, sidecar(own, s)) for i, (own, s) in enumerate(x["decodes"])]
    decode = f'{{"id": "d", "choices": [{", ".join(sent)}], "usage": null}}'.encode()
    want = [_choice(i, sidecar(m, x["start"])) for i, m in enumerate(x["merged"])]
    expected = f'{{"id": "d", "choices": [{", ".join(want)}], "usage": null}}'.encode()
    assert rx.merge_response(_prefill_body(x), decode) == expected
    assert rx.merge_response(_prefill_body(x), decode, splice=False) == expected
