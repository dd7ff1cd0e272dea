"""The stream merger relays bytes: however the stream is cut into chunks, what it sends is the
stream with the routing event merged, every other byte as it came (hypothesis)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routed_experts as rx
from conftest import sidecar
from routed_experts.proxy import StreamMerger

rng = np.random.default_rng(3)
TRUTH = rng.integers(1, 200, size=(40, 3, 2), dtype=np.uint8)
PROMPT = 30
PREFILL = json.dumps(
    {
        "choices": [
            {"index": 0, "routed_experts": rx.RoutedExperts.from_array(TRUTH[:PROMPT]).to_dict()}
        ]
    }
).encode()
ZEROED = TRUTH.copy()
ZEROED[:PROMPT] = 0


def stream(key: str = '"routed_experts"', crlf: bool = False) -> tuple[bytes, bytes]:
    """A decode stream (text events, the routing with the last, [DONE]) and what the merger
    must send for it."""
    decode = json.dumps(rx.RoutedExperts.from_array(ZEROED).to_dict())
    merged = json.dumps(rx.RoutedExperts.from_array(TRUTH).to_dict(), separators=(",", ":"))
    nl = b"\r\n" if crlf else b"\n"
    events, want = [], []
    for i in range(6):
        text = {"choices": [{"index": 0, "text": f" t\u00e9{i}"}]}  # \u escapes: a maybe
        line = b"data: " + json.dumps(text).encode() + nl + nl
        events.append(line)
        want.append(line)
    last = '{"choices":[{"index":0,"text":"!",' + key + ":" + decode + "}]}"
    events.append(b"data:" + last.encode() + nl + nl)
    # Only the routing value is replaced (the key stays as it was spelled).
    want.append(b"data: " + last.replace(decode, merged).encode() + nl + nl)
    events.append(b"data: [DONE]" + nl + nl)
    want.append(b"data: [DONE]" + nl + nl)
    return b"".join(events), b"".join(want)


def relay(merger: StreamMerger, chunks: list[bytes]) -> bytes:
    out = [piece for chunk in chunks for piece in merger.feed(chunk)]
    return b"".join(out + merger.finish())


@settings(max_examples=300, deadline=None)
@given(
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
    crlf=st.booleans(),
    escaped=st.booleans(),
)
def test_any_chunking_gives_the_same_merged_stream(
    cuts: list[int], crlf: bool, escaped: bool
) -> None:
    key = '"routed\\u005fexperts"' if escaped else '"routed_experts"'
    whole, want = stream(key, crlf)
    points = sorted({c % (len(whole) + 1) for c in cuts})
    chunks = [whole[a:b] for a, b in zip([0, *points], [*points, len(whole)]) if b > a]
    merger = StreamMerger(PREFILL)
    got = relay(merger, chunks)
    merged = json.loads(got.split(b"data:")[7].split(b"\n")[0])["choices"][0]["routed_experts"]
    assert rx.RoutedExperts.from_json(merged) == rx.RoutedExperts.from_array(TRUTH)
    assert got == want
    assert merger.merged and merger.done


def test_a_stream_cut_short_or_without_routing_raises_after_relaying_what_came() -> None:
    whole, _ = stream()
    cut = whole[: whole.index(b"data: [DONE]")]
    merger = StreamMerger(PREFILL)
    assert b"".join(merger.feed(cut))  # what came was relayed
    with pytest.raises(rx.MergeError, match="without data: \\[DONE\\]"):
        merger.finish()
    plain = b'data: {"choices":[{"index":0,"text":"x"}]}\n\ndata: [DONE]\n\n'
    merger = StreamMerger(PREFILL)
    # All but the [DONE], which waits for finish: the caller's error event must come first.
    assert b"".join(merger.feed(plain)) == plain[: plain.index(b"data: [DONE]")]
    with pytest.raises(rx.MergeError, match="missing routing on the decode side"):
        merger.finish()


def _merger_halves() -> tuple[str, bytes]:
    pre = rx.RoutedExperts.from_array(np.arange(6).reshape(3, 1, 2), num_experts=128)
    rows = np.zeros((5, 1, 2), dtype=np.int64)
    rows[3:] = [[[7, 8]], [[9, 10]]]
    dec = rx.RoutedExperts.from_array(rows, num_experts=128)
    pb = json.dumps({"choices": [{"index": 0, "routed_experts": pre.to_dict()}]})
    event = json.dumps({"choices": [{"index": 0, "routed_experts": dec.to_dict()}]}).encode()
    return pb, b"data: " + event + b"\n\n"


def test_a_line_past_max_line_bytes_is_a_payload_error_naming_the_limit() -> None:
    pb, event = _merger_halves()
    with pytest.raises(rx.PayloadError, match="a line of more than 20 bytes"):
        StreamMerger(pb, max_line_bytes=20).feed(event)
    assert b"".join(StreamMerger(pb, max_line_bytes=len(event)).feed(event))  # one that fits


def test_buffered_holds_the_unfinished_line_and_merged_bytes_the_merged_event() -> None:
    pb, event = _merger_halves()
    m = StreamMerger(pb)
    out = m.feed(b'data: {"choices":[{"index":0,"text":"a"}]}\n\ndata: {"choi')
    assert b"".join(out) == b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
    assert (m.buffered, m.merged_bytes, m.merged, m.done) == (12, 0, False, False)
    out = m.feed(b'ces":[{"index":0,"text":"b"}]}\n\n' + event + b"data: [DONE]\n\n")
    assert m.buffered == 0 and m.merged and m.done
    text = b"".join(out)
    merged_event = text.split(b"\n\n")[1]
    assert merged_event.startswith(b"data: ") and b"[DONE]" not in merged_event
    # The merged event's data: after `data: `, through its line's end.
    assert m.merged_bytes == len(merged_event) - len(b"data: ") + len(b"\n")
    got = rx.from_response(merged_event[len(b"data: "):])
    assert got is not None and got.to_numpy().ravel().tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10]
    assert not text.endswith(b"data: [DONE]\n\n")  # held until finish has checked the stream
    assert b"".join(m.finish()) == b"data: [DONE]\n\n"


def test_a_stream_without_routing_never_sends_done_before_the_error() -> None:
    # vLLM 0.32 sends no routing on a /v1/completions stream: the [DONE] is held back, and
    # finish refuses, so the caller's error event is the stream's last (clients stop at [DONE]).
    pb, _ = _merger_halves()
    m = StreamMerger(pb)
    out = m.feed(b'data: {"choices":[{"index":0,"text":"a"}]}\n\ndata: [DONE]\n\n')
    assert b"".join(out) == b'data: {"choices":[{"index":0,"text":"a"}]}\n\n' and m.done
    with pytest.raises(rx.MergeError, match="missing routing on the decode side"):
        m.finish()


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.integers(2, 60),
    layers=st.integers(1, 4),
    top_k=st.integers(1, 3),
    dtypes=st.tuples(*[st.sampled_from(["uint8", "uint16", "int16", "int32"])] * 2),
    prompt_share=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
    cuts=st.lists(st.integers(min_value=0, max_value=100_000), max_size=12),
)
def test_any_payload_and_chunking_gives_the_stream_with_its_routing_merged(
    tokens: int, layers: int, top_k: int, dtypes: tuple[str, str], prompt_share: float,
    seed: int, cuts: list[int],
) -> None:
    """Random shapes, prompt lengths and a dtype for each half (their merge takes the promoted
    one), against a reference written by hand (conftest.sidecar), not the library."""
    prompt = 1 + int(prompt_share * (tokens - 2))  # 1 .. tokens - 1
    top = {"uint8": 255, "uint16": 65535, "int16": 32767, "int32": 2**31 - 1}
    bound = min(top[d] for d in dtypes)  # values either half can hold
    truth = np.random.default_rng(seed).integers(0, bound + 1, size=(tokens, layers, top_k))
    prefill_rows = truth[:prompt].astype(dtypes[0])
    decode_rows = truth.astype(dtypes[1])
    decode_rows[:prompt] = 0
    prefill = f'{{"choices": [{{"index": 0, "routed_experts": {sidecar(prefill_rows, 0)}}}]}}'
    merged = truth.astype(np.promote_types(*dtypes))

    def events(value: str) -> bytes:
        text = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n' * 3
        last = b'data: {"choices": [{"index": 0, "routed_experts": %s}]}\n\n' % value.encode()
        return text + last + b"data: [DONE]\n\n"

    whole, want = events(sidecar(decode_rows, 0)), events(sidecar(merged, 0))
    points = sorted({c % (len(whole) + 1) for c in cuts})
    chunks = [whole[a:b] for a, b in zip([0, *points], [*points, len(whole)]) if b > a]
    merger = StreamMerger(prefill)
    assert relay(merger, chunks) == want
    assert merger.merged and merger.done and merger.buffered == 0
