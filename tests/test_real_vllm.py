"""Bodies a real vLLM sent, read right: every release recorded under tests/real/vllm/<release>/
(by tests/real/harness/record.py, against a tiny MoE model served by vLLM's CPU build), each
body beside the truth (the same model's own routing, from transformers). No vLLM or torch is
needed here: the bodies are files.

Each test is held to what the server really sent: a body built by hand is our reading of an
engine, a recorded one is a fact."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import routed_experts as rx
from routed_experts.proxy import StreamMerger

REAL = Path(__file__).parent / "real" / "vllm"
RELEASES = sorted(p.parent for p in REAL.glob("*/manifest.json"))


def manifest(release: Path) -> dict[str, Any]:
    return json.loads((release / "manifest.json").read_text())


def all_cases() -> Iterator[Any]:
    for release in RELEASES:
        for case in manifest(release)["cases"]:
            yield pytest.param(release, case, id=f"{release.name}/{case['name']}")


def cases_with(*keys: str) -> list[Any]:
    return [c for c in all_cases() if all(k in c.values[1] for k in keys)]


def body(release: Path, rec: dict[str, Any]) -> bytes:
    return (release / rec["body"]).read_bytes()


def start_asked(request: dict[str, Any]) -> int:
    sp = request.get("sampling_params") or {}
    return int(request.get("routed_experts_prompt_start", sp.get("routed_experts_prompt_start", 0)))


def release_of(release: Path) -> tuple[int, ...]:
    return tuple(int(x) for x in release.name.split(".")[:2])


def ignores_top_level_start(release: Path, endpoint: str) -> bool:
    """vLLM 0.22 to 0.27 take the start in sampling params only: completions and chat ignore
    the request's `routed_experts_prompt_start` (format.md §3.5)."""
    return release_of(release) < (0, 28) and endpoint != "/inference/v1/generate"


def expected(truth: dict[str, Any], start: int, layers: list[int] | None = None) -> np.ndarray:
    """Rows [start, P + G - 1): every position but the last sampled token's (of `layers` only,
    where the release writes its MoE layers alone)."""
    rows = np.asarray(truth["rows"], dtype=np.int64)
    if layers is not None:
        rows = rows[:, layers]
    return rows[start : len(truth["ids"]) - 1]


def split_release(release: Path) -> bool:
    """vLLM 0.21.0: routing in two parts (top-level prompt rows, each choice's generated rows),
    nested lists over the MoE layers only (format.md §3.4)."""
    return release_of(release) < (0, 22)


def loses_routing(release: Path, case: dict[str, Any]) -> bool:
    """What vLLM 0.21.0 returns without routing: generate (none at all), and a completion a stop
    string ended (`null` in both places)."""
    if not split_release(release):
        return False
    reply = case["reply"]
    return reply["endpoint"] == "/inference/v1/generate" or "stop" in reply["request"]


def matches_truth(p: rx.RoutedExperts, want: np.ndarray, prompt: int) -> None:
    """The routing equals the model's own, except prompt rows the release marked missing (vLLM
    0.21 leaves prefix-cached prompt positions zero, read as missing: format.md §3.4); no
    generated row is ever missing."""
    got = p.to_numpy().astype(np.int64)
    assert got.shape == want.shape, (got.shape, want.shape)
    missing = (got == -1).all(axis=(1, 2))
    assert not missing[prompt:].any(), "a generated row read as missing"
    np.testing.assert_array_equal(got[~missing], want[~missing])


def events(text: bytes) -> list[dict[str, Any]]:
    out = []
    for line in text.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_a_release_is_recorded() -> None:
    # The corpus is committed; an empty one would let every test below pass by running none.
    assert RELEASES, f"no recorded release under {REAL}"
    for release in RELEASES:
        m = manifest(release)
        assert m["release"] == release.name and m["cases"]


@pytest.mark.parametrize(("release", "case"), cases_with("reply"))
def test_a_real_reply_reads_as_the_models_own_routing(release: Path, case: dict[str, Any]) -> None:
    rec = case["reply"]
    if rec["status"] != 200:
        pytest.fail(f"{case['name']} was recorded with status {rec['status']}")
    text = body(release, rec)
    start = start_asked(rec["request"])
    if rec["content_type"] == "text/event-stream":
        if any("error" in e for e in events(text)):
            release_failed_the_stream(text)
            return
        got = stream_routing(text, start)
        if not got:
            # vLLM sends no routing on /v1/completions and /v1/chat/completions streams, nor on
            # generate streams before 0.24 (format.md §3.5).
            generate = rec["endpoint"] == "/inference/v1/generate"
            streams_routing = generate and release_of(release) >= (0, 24)
            assert not streams_routing, "a generate stream without routing"
            assert b'"routed_experts":"' not in text
            return
        assert len(got) == len(case["truth"])
        for payload, truth in zip(got, case["truth"]):
            assert payload.start == start
            np.testing.assert_array_equal(payload.to_numpy(), expected(truth, start))
        return
    doc = json.loads(text)
    assert len(doc["choices"]) == len(case["truth"])
    if loses_routing(release, case):
        # What the release really sent: no routing, read as none (never made up).
        assert all(rx.from_response(text, choice=i) is None for i in range(len(doc["choices"])))
        return
    if split_release(release):
        # Prompt rows and each choice's generated rows, joined from position 0 (the start is
        # ignored), over the MoE layers alone.
        for i, truth in enumerate(case["truth"]):
            p = rx.from_response(text, choice=i)
            assert p is not None and p.start == 0
            prompt = json.loads(text)["usage"]["prompt_tokens"]
            matches_truth(p, expected(truth, 0, case["moe_layers"]), prompt)
        return
    if start and ignores_top_level_start(release, rec["endpoint"]):
        # The release ignored the start the request asked for (the field is a request field
        # from 0.28): rows from 0, which the counts refuse under the start, never misplace.
        with pytest.raises(rx.PayloadError, match="sent rows from position 0"):
            rx.from_response(text, start=start)
        start = 0
    for i, truth in enumerate(case["truth"]):
        p = rx.from_response(text, choice=i, start=start or None)
        assert p is not None, f"choice {i} has no routing"
        assert p.start == start
        np.testing.assert_array_equal(p.to_numpy(), expected(truth, start))
        experts = manifest(release)["model"]["experts"][case["model"]]
        assert p.dtype == (np.uint8 if experts <= 256 else np.uint16)


PREFILL_STUB = json.dumps({"choices": [{"index": 0, "routed_experts": {
    "data": "AAE=", "shape": [1, 1, 2], "start": 0, "dtype": "uint8"}}]})


def release_failed_the_stream(text: bytes) -> None:
    """A stream the release ended with its own error event (vLLM 0.28 to 0.31's generate with
    n=2 sometimes sends `list index out of range`: a race): the proxy's merger passes the
    engine's error on, and refuses the stream for its missing routing, so it ends without
    `[DONE]`."""
    m = StreamMerger(PREFILL_STUB)
    out = b"".join(m.feed(text))
    assert b'"error"' in out and b"[DONE]" not in out
    with pytest.raises(rx.MergeError, match="missing routing"):
        m.finish()


def stream_routing(text: bytes, start: int) -> list[rx.RoutedExperts]:
    """Each choice's routing from the events that carry it (by choice index)."""
    got: dict[int, rx.RoutedExperts] = {}
    for ev in events(text):
        for c in ev.get("choices") or []:
            if c.get("routed_experts") is not None:
                assert c["index"] not in got, "a choice's routing came twice"
                p = rx.from_response(json.dumps(ev), choice=c["index"], start=start or None)
                assert p is not None
                got[c["index"]] = p
    return [got[i] for i in sorted(got)]


@pytest.mark.parametrize(("release", "case"), cases_with("prefill", "decode"))
def test_real_pd_halves_merge_into_the_whole_sequence(release: Path, case: dict[str, Any]) -> None:
    pre, dec = case["prefill"], case["decode"]
    assert pre["status"] == 200 and dec["status"] == 200, (pre["status"], dec["status"])
    assert dec["alive_after"], "the decode engine died"
    decode_start = start_asked(dec["request"])
    merged = rx.merge_response(
        body(release, pre), body(release, dec), decode_start=decode_start, require_routing=True
    )
    # Every choice (a group's decode generated n from prefill's one), against its own truth.
    assert len(case["truth"]) == len(json.loads(body(release, dec))["choices"])
    for i, truth in enumerate(case["truth"]):
        got = rx.from_response(merged, choice=i)
        assert got is not None and got.start == 0
        np.testing.assert_array_equal(got.to_numpy(), expected(truth, 0))
    # Decode's own rows start where it was asked to: its value carries no start, and read from
    # 0 it is refused by the body's token counts (format.md §3.3), never placed at 0.
    d = rx.from_response(body(release, dec), start=decode_start)
    assert d is not None and d.start == decode_start
    with pytest.raises(rx.PayloadError, match="pass that start|start"):
        rx.from_response(body(release, dec))
    # With no start given, the merge derives it from the decode body's token counts (format.md
    # §4): the same merged body, byte for byte.
    assert rx.merge_response(body(release, pre), body(release, dec), require_routing=True) == merged


@pytest.mark.source_tree
def test_a_saved_pd_exchange_merges_from_the_cli_and_from_rust_with_no_start_given(
    tmp_path: Path,
) -> None:
    # `routed-experts merge` and `cargo run --example merge`, as a user runs them on two saved
    # bodies, against the Python merge with the start the recording asked.
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    example = ["cargo", "run", "--quiet", "--example", "merge", "--"]
    for release, case in (c.values for c in cases_with("prefill", "decode")):
        pre, dec = tmp_path / "prefill.json", tmp_path / "decode.json"
        pre.write_bytes(body(release, case["prefill"]))
        dec.write_bytes(body(release, case["decode"]))
        want = rx.merge_response(pre.read_bytes(), dec.read_bytes(),
                                 decode_start=start_asked(case["decode"]["request"]))  # fmt: skip
        cli = subprocess.run([sys.executable, "-m", "routed_experts", "merge", str(pre), str(dec)],
                             capture_output=True, timeout=120)  # fmt: skip
        assert cli.returncode == 0, (release.name, case["name"], cli.stderr)
        assert cli.stdout.rstrip(b"\n") == want, (release.name, case["name"])
        rust = subprocess.run([*example, pre, dec], cwd=repo, capture_output=True, timeout=900)
        assert rust.returncode == 0, (release.name, case["name"], rust.stderr)
        assert rust.stdout == want + b"\n", (release.name, case["name"])


def json_replies() -> list[Any]:
    return [c for c in cases_with("reply") if c.values[1]["reply"]["body"].endswith(".json")]


def streams() -> list[Any]:
    return [c for c in cases_with("reply") if c.values[1]["reply"]["body"].endswith(".sse")]


@pytest.mark.parametrize(("release", "case"), json_replies())
def test_quality_figures_of_a_real_body_skip_the_dense_layer(
    release: Path, case: dict[str, Any]
) -> None:
    rec = case["reply"]
    m = manifest(release)
    experts = m["model"]["experts"][case["model"]]
    start = start_asked(rec["request"])
    if ignores_top_level_start(release, rec["endpoint"]):
        start = 0
    if loses_routing(release, case):
        return  # nothing to measure: the test above holds it to that
    p = rx.from_response(body(release, rec), start=start or None)
    assert p is not None
    load = rx.expert_load(p, num_experts=experts)
    dense = m["model"]["dense_layers"]
    if split_release(release):
        # MoE layers only: every layer has a router; rows the release zeroed are not counted.
        counts = np.asarray(load.counts)
        rows = p.num_tokens - load.missing_rows
        assert (counts.sum(axis=1) == rows * m["model"]["top_k"]).all()
        assert rx.agreement(p, p).no_router_layers == []
        return
    counts = np.asarray(load.counts)
    for layer in range(m["model"]["layers"]):
        if layer in dense:
            assert counts[layer].sum() == 0 and np.isnan(load.imbalance[layer])
        else:
            assert counts[layer].sum() == p.num_tokens * m["model"]["top_k"]
    # Agreement leaves the dense layer out too: it is no router "agreeing".
    a = rx.agreement(p, p)
    assert a.no_router_layers == dense and a.exact_match == 1.0
    assert all(np.isnan(a.exact_match_per_layer[layer]) for layer in dense)


@pytest.mark.parametrize(
    ("release", "case"),
    [c for c in streams() if b"routed_experts" not in body(c.values[0], c.values[1]["reply"])],
)
def test_a_real_stream_without_routing_ends_in_an_error_not_done(
    release: Path, case: dict[str, Any]
) -> None:
    # The proxy's merger over a real decode stream: where the release streams no routing, the
    # stream's [DONE] is held back and the merge refused, so the client's last event is the
    # proxy's error (an OpenAI client stops reading at [DONE]).
    text = body(release, case["reply"])
    prefill = json.dumps(
        {
            "choices": [
                {
                    "index": 0,
                    "routed_experts": {
                        "data": "AAE=",
                        "shape": [1, 1, 2],
                        "start": 0,
                        "dtype": "uint8",
                    },
                }
            ]
        }
    )
    m = StreamMerger(prefill)
    out = b"".join(m.feed(text))
    assert m.done and b"[DONE]" not in out
    with pytest.raises(rx.MergeError, match="missing routing"):
        m.finish()


def replay_engine(release: Path, case: dict[str, Any], asked: list[dict[str, Any]]) -> Any:
    """An upstream that answers as the recorded servers did: prefill's recorded body to a
    prefill request, decode's to a decode request that asks from where the recording asked;
    a decode request for rows decode never computed gets the 500 a dying vLLM 0.32 gives."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    want = start_asked(case["decode"]["request"])

    async def handle(request: Request) -> Response:
        req = await request.json()
        asked.append(req)
        if (req.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return Response(body(release, case["prefill"]), media_type="application/json")
        if start_asked(req) != want:
            return JSONResponse({"error": {"message": "EngineDeadError"}}, 500)
        return Response(body(release, case["decode"]), media_type="application/json")

    path = case["decode"]["endpoint"]
    return Starlette(routes=[Route(path, handle, methods=["POST"])])


@pytest.mark.parametrize(
    ("release", "case"),
    [c for c in cases_with("prefill", "decode") if c.values[1]["name"].endswith("-from-P-1")],
)
def test_the_proxy_asks_decode_from_the_prompts_last_position(
    release: Path, case: dict[str, Any]
) -> None:
    # The client sends no start; the proxy must ask decode from P - 1 (never from 0: a real
    # vLLM 0.32 decode engine dies looking up rows it never computed), and merge by it.
    from engines import Server

    from routed_experts.proxy import create_app

    asked: list[dict[str, Any]] = []
    client = {k: v for k, v in case["decode"]["request"].items() if k != "kv_transfer_params"}
    sp = client.get("sampling_params")
    if sp is not None:
        client["sampling_params"] = {
            k: v for k, v in sp.items() if k != "routed_experts_prompt_start"
        }
    client.pop("routed_experts_prompt_start", None)
    import httpx

    with Server(replay_engine(release, case, asked)) as up:
        with Server(create_app([up.url], [up.url], read_timeout=30)) as proxy:
            r = httpx.post(proxy.url + case["decode"]["endpoint"], json=client, timeout=60)
    assert r.status_code == 200, r.text
    assert start_asked(asked[-1]) == start_asked(case["decode"]["request"])
    # Prefill is asked as the recording asked it: a group's for one choice.
    assert asked[0].get("n") == case["prefill"]["request"].get("n")
    for i, truth in enumerate(case["truth"]):
        got = rx.from_response(r.content, choice=i)
        assert got is not None and got.start == 0
        np.testing.assert_array_equal(got.to_numpy(), expected(truth, 0))


@pytest.mark.parametrize(("release", "case"), [
    c for c in json_replies()
    if start_asked(c.values[1]["reply"]["request"]) == 0 and len(c.values[1]["truth"]) == 1
    and b'"usage":{' in body(c.values[0], c.values[1]["reply"])  # counts to hold it to
    and not split_release(c.values[0])])  # vLLM 0.21's shape fixes every position (§3.4)
def test_rows_from_0_read_under_a_later_start_are_refused_not_misplaced(
    release: Path, case: dict[str, Any]
) -> None:
    # What a release that ignores the start sends decode's merge: rows from 0. Read under the
    # start the proxy asked for (P - 1), the body's counts refuse it (format.md §3.3).
    text = body(release, case["reply"])
    prompt = json.loads(text)["usage"]["prompt_tokens"]
    with pytest.raises(rx.PayloadError, match="rows"):
        rx.from_response(text, start=prompt - 1)
