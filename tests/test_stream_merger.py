"""The stream merger relays bytes: however the stream is cut into chunks, what it sends is the
stream with the routing event merged, every other byte as it came (hypothesis)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routed_experts as rx
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
    assert b"".join(merger.feed(plain)) == plain
    with pytest.raises(rx.MergeError, match="missing routing on the decode side"):
        merger.finish()
