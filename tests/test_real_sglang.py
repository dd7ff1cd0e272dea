"""Bodies a real SGLang sent, read right: every release recorded under
tests/real/sglang/<release>/ (by tests/real/harness/record_sglang.py, against a tiny MoE model
with no dense layer served by SGLang's CPU engine), each body beside the truth (the same
model's own routing, from transformers). No SGLang or torch is needed here: the bodies are
files.

What SGLang sends (format.md §3.5): base64 of flat int32 ids, rows `[S, P + G - 1)` over every
hidden layer, at `meta_info.routed_experts` on `/generate` (a list of results for a batch or
`n > 1`, each its own), at top-level `sglext.routed_experts` on the OpenAI endpoints (choice
0 only), and with `return_meta_info` also at `choices[0].meta_info.routed_experts`. Streams
carry it once: `/generate`'s finishing event, and the OpenAI endpoints' chunk
`{"choices": [], "sglext": {...}}` after the finishing one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import routed_experts as rx

REAL = Path(__file__).parent / "real" / "sglang"
RELEASES = sorted(p.parent for p in REAL.glob("*/manifest.json"))
GEN = "/generate"


def manifest(release: Path) -> dict[str, Any]:
    return json.loads((release / "manifest.json").read_text())


def all_cases() -> Iterator[Any]:
    for release in RELEASES:
        for case in manifest(release)["cases"]:
            yield pytest.param(release, case, id=f"{release.name}/{case['name']}")


def body(release: Path, rec: dict[str, Any]) -> bytes:
    return (release / rec["body"]).read_bytes()


def version(release: Path) -> tuple[int, int, int]:
    a, b, c = release.name.split(".")[:3]
    return int(a), int(b), int(c.split("post")[0].rstrip("."))


def start_asked(request: dict[str, Any]) -> int:
    return int(request.get("routed_experts_start_len", 0))


def honours_start(release: Path) -> bool:
    """`routed_experts_start_len` is honoured from 0.5.12 (0.5.8 to 0.5.11 take it and send
    rows from 0; format.md §3.5)."""
    return version(release) >= (0, 5, 12)


def routes_openai(release: Path) -> bool:
    """The OpenAI endpoints return routing (`sglext`) from 0.5.9; 0.5.7 and 0.5.8 only on
    `/generate` (format.md §3.5)."""
    return version(release) >= (0, 5, 9)


def shape(release: Path) -> dict[str, int]:
    """SGLang's flat values carry no shape: the model's layers (every hidden layer) and top_k."""
    m = manifest(release)["model"]
    return {"num_layers": m["layers"], "top_k": m["top_k"]}


def expected(truth: dict[str, Any], start: int) -> np.ndarray:
    """Rows [start, P + G - 1): every position but the last sampled token's."""
    return np.asarray(truth["rows"], dtype=np.int64)[start : len(truth["ids"]) - 1]


def events(text: bytes) -> list[dict[str, Any]]:
    return [
        json.loads(line[6:])
        for line in text.decode().splitlines()
        if line.startswith("data: ") and line.strip() != "data: [DONE]"
    ]


def n_results(doc: Any) -> int:
    return len(doc) if isinstance(doc, list) else len(doc.get("choices") or [doc])


def test_a_release_is_recorded() -> None:
    assert RELEASES, f"no recorded release under {REAL}"
    for release in RELEASES:
        m = manifest(release)
        assert m["release"] == release.name and m["cases"]
        assert m["model"]["dense_layers"] == [], "SGLang's qwen3_moe runs every layer as MoE"


@pytest.mark.parametrize(("release", "case"), list(all_cases()))
def test_a_real_reply_reads_as_the_models_own_routing(release: Path, case: dict[str, Any]) -> None:
    rec = case["reply"]
    assert rec["status"] == 200, f"{case['name']} was recorded with status {rec['status']}"
    assert rec["alive_after"]
    text = body(release, rec)
    start = start_asked(rec["request"])
    routed = rec["endpoint"] == GEN or routes_openai(release)
    if start and not honours_start(release):
        # The release took the start and sent rows from 0: refused under the start asked
        # for (the counts say where rows from 0 end), read from 0.
        if rec["content_type"] == "application/json" and routed:
            with pytest.raises(rx.PayloadError, match="sent rows from position 0"):
                rx.from_response(text, start=start, **shape(release))
        start = 0
    if rec["content_type"] == "text/event-stream":
        # The routing comes once, in one event: read it there, each other event has none.
        got = []
        for ev in events(text):
            p = rx.from_response(json.dumps(ev), start=start or None, **shape(release))
            if p is not None:
                got.append(p)
        if not routed:
            assert not got and b"routed_experts" not in text
            return
        assert len(got) == 1, f"{len(got)} events with routing"
        assert got[0].start == start
        np.testing.assert_array_equal(got[0].to_numpy(), expected(case["truth"][0], start))
        return
    doc = json.loads(text)
    assert n_results(doc) == len(case["truth"])
    for i, truth in enumerate(case["truth"]):
        if routed and rec["endpoint"] != GEN and i > 0:
            # The OpenAI endpoints send choice 0's routing alone (`sglext`): the others' rows
            # are lost, and reading one says so (format.md §3.2), never None.
            with pytest.raises(rx.PayloadError, match=f"choice {i} carries no routing") as e:
                rx.from_response(text, choice=i, start=start or None, **shape(release))
            assert e.value.kind == "rows_lost" and "sglext" in str(e.value)
            continue
        p = rx.from_response(text, choice=i, start=start or None, **shape(release))
        if not routed:
            assert p is None, "routing where this release sends none"
            continue
        assert p is not None, f"result {i} has no routing"
        assert p.start == start and p.dtype == np.int32
        np.testing.assert_array_equal(p.to_numpy(), expected(truth, start))


def json_cases() -> list[Any]:
    return [c for c in all_cases() if c.values[1]["reply"]["body"].endswith(".json")]


@pytest.mark.parametrize(
    ("release", "case"),
    [
        c
        for c in json_cases()
        if start_asked(c.values[1]["reply"]["request"]) and honours_start(c.values[0])
    ],
)
def test_a_delta_read_from_0_is_refused_naming_the_start(
    release: Path, case: dict[str, Any]
) -> None:
    # Rows from the requested start, read with no start: the body's counts refuse them and name
    # the start that fits (format.md §3.3), never place them at 0. (Releases that ignore the
    # start send rows from 0: the first test holds them to that.)
    text = body(release, case["reply"])
    want = start_asked(case["reply"]["request"])
    with pytest.raises(rx.PayloadError, match=rf"pass that start \({want}\)"):
        rx.from_response(text, **shape(release))


@pytest.mark.parametrize(
    ("release", "case"),
    [
        c
        for c in json_cases()
        if not start_asked(c.values[1]["reply"]["request"]) and len(c.values[1]["truth"]) == 1
    ],
)
def test_rows_from_0_read_under_a_later_start_are_refused_not_misplaced(
    release: Path, case: dict[str, Any]
) -> None:
    # What a release that ignores the start sends (0.5.8 to 0.5.11): rows from 0. Read under a
    # start, the body's counts refuse it.
    text = body(release, case["reply"])
    if case["reply"]["endpoint"] != GEN and not routes_openai(release):
        return  # no routing to refuse
    with pytest.raises(rx.PayloadError, match="sent rows from position 0"):
        rx.from_response(text, start=2, **shape(release))


@pytest.mark.parametrize(("release", "case"), json_cases())
def test_the_shape_must_be_given(release: Path, case: dict[str, Any]) -> None:
    # Flat int32 values carry no shape: without num_layers and top_k, an error that says so.
    if case["reply"]["endpoint"] != GEN and not routes_openai(release):
        assert rx.from_response(body(release, case["reply"])) is None
        return
    with pytest.raises(rx.PayloadError, match="give num_layers and top_k"):
        rx.from_response(body(release, case["reply"]))


@pytest.mark.parametrize(
    ("release", "case"), [c for c in json_cases() if c.values[1]["name"].endswith("chat-meta")]
)
def test_chat_meta_info_holds_the_same_text_as_sglext(release: Path, case: dict[str, Any]) -> None:
    # 0.5.13 to 0.5.18 write the value at both places (one producer's pair, read once); 0.5.19+
    # only in the choice's meta_info.
    doc = json.loads(body(release, case["reply"]))
    if version(release) < (0, 5, 13):
        # return_meta_info is 0.5.13's: an older release passes the field by.
        assert "meta_info" not in doc["choices"][0]
        return
    in_choice = doc["choices"][0]["meta_info"]["routed_experts"]
    if version(release) < (0, 5, 19):
        assert doc["sglext"]["routed_experts"] == in_choice
    else:
        assert "routed_experts" not in (doc.get("sglext") or {})


@pytest.mark.parametrize(
    ("release", "case"), [c for c in json_cases() if c.values[1]["name"].endswith("cache-hit")]
)
def test_a_prefix_cache_hit_keeps_every_prompt_row(release: Path, case: dict[str, Any]) -> None:
    # SGLang keeps routing beside each KV slot: the cached prefix's rows come back as computed,
    # none missing or zero.
    text = body(release, case["reply"])
    doc = json.loads(text)
    assert doc["meta_info"]["cached_tokens"] > 0
    p = rx.from_response(text, **shape(release))
    assert p is not None
    got = p.to_numpy()
    assert not (got == -1).all(axis=(1, 2)).any()
    np.testing.assert_array_equal(got, expected(case["truth"][0], 0))


@pytest.mark.parametrize(("release", "case"), json_cases())
def test_quality_figures_count_every_layer(release: Path, case: dict[str, Any]) -> None:
    # No dense layer: every layer is a router and every row counts top_k picks in each.
    rec = case["reply"]
    m = manifest(release)
    start = start_asked(rec["request"]) if honours_start(release) else 0
    p = rx.from_response(body(release, rec), start=start or None, **shape(release))
    if p is None:
        assert rec["endpoint"] != GEN and not routes_openai(release)
        return
    load = rx.expert_load(p, num_experts=m["model"]["experts"][case["model"]])
    counts = np.asarray(load.counts)
    assert (counts.sum(axis=1) == p.num_tokens * m["model"]["top_k"]).all()
    a = rx.agreement(p, p)
    assert a.no_router_layers == [] and a.exact_match == 1.0


@pytest.mark.parametrize(
    ("release", "case"), [c for c in all_cases() if c.values[1]["model"] == "e288"]
)
def test_ids_above_255_read_as_int32(release: Path, case: dict[str, Any]) -> None:
    # 288 experts: the same flat int32, ids above 255 among them.
    rec = case["reply"]
    truth = case["truth"][0]
    assert np.asarray(truth["rows"]).max() > 255
    p = rx.from_response(body(release, rec), **shape(release))
    if rec["endpoint"] != GEN and not routes_openai(release):
        assert p is None
        return
    assert p is not None and p.dtype == np.int32
    np.testing.assert_array_equal(p.to_numpy(), expected(truth, 0))
