"""The stand-in engine `routed-experts engine` runs: its routing, its prefix cache model, its
protocol (what it refuses), and the proxy's merge of its halves against its truth."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import routed_experts as rx
from routed_experts.proxy import ProxyConfig, ProxyServer
from routed_experts.stand_in_engine import (
    BLOCK,
    PrefixCache,
    StandInEngine,
    VllmAnswers,
    routing_of,
)


def _post(url: str, body: Any, path: str = "/v1/completions") -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@given(st.lists(st.integers(0, 255), min_size=1, max_size=60), st.integers(1, 20))
def test_a_rows_routing_depends_only_on_the_tokens_up_to_it(tokens: list[int], more: int) -> None:
    rows = routing_of(tokens, 1, "deepseek-v3")
    assert rows.shape == (len(tokens), 58, 8)
    longer = routing_of([*tokens, 3] * 2, more, "deepseek-v3")
    np.testing.assert_array_equal(longer[: len(tokens)], rows)
    # top_k distinct experts in every layer of every row, within the model's experts
    assert rows.min() >= 0 and rows.max() < 256
    ordered = np.sort(rows, axis=-1)
    assert (np.diff(ordered, axis=-1) > 0).all()


@given(st.lists(st.integers(0, 255), min_size=1, max_size=70), st.integers(1, 6),
       st.integers(0, 69), st.sampled_from(["0.32", "0.27"]),
       st.sampled_from(["/v1/completions", "/inference/v1/generate"]))
def test_each_half_answers_its_rows_of_the_truth_or_refuses(
    tokens: list[int], generated: int, start: int, release: str, path: str
) -> None:
    # Prefill: rows [S, P). Decode: rows [S, P + G - 1) when it computed them, else a 500 (a
    # real vLLM 0.32 decode dies). Release 0.27 ignores the start on completions (rows from 0).
    model = (2, 2, 16)
    truth = routing_of(tokens, generated, model)
    P = len(tokens)
    if path.endswith("generate"):
        body: dict[str, Any] = {"token_ids": tokens, "sampling_params": {
            "max_tokens": generated, "routed_experts_prompt_start": start}}
    else:
        body = {"prompt": tokens, "max_tokens": generated, "routed_experts_prompt_start": start}
    ignored = release == "0.27" and not path.endswith("generate")
    S = 0 if ignored else start
    for role in ("prefill", "decode"):
        answers = VllmAnswers(role, model, release=release)
        kv = ({"do_remote_decode": True} if role == "prefill"
              else answers.kv_transfer_params(tokens) | {"remote_engine_id": "p"})
        status, doc = answers.reply(path, {**body, "kv_transfer_params": kv})
        if S >= P:
            assert status == 400 and "routed_experts_prompt_start" in doc["error"]["message"]
            continue
        if role == "decode" and S < (P - 1) // BLOCK * BLOCK:
            assert status == 500 and "never computed" in doc["error"]["message"]
            continue
        assert status == 200, doc
        stop = P if role == "prefill" else P + generated - 1
        p = rx.from_response(json.dumps(doc), start=S)
        assert p is not None and (p.start, p.stop) == (S, stop)
        np.testing.assert_array_equal(p.to_numpy(), truth[S:stop])


def test_the_prefix_cache_matches_whole_leading_blocks_and_evicts_the_least_recent() -> None:
    cache = PrefixCache(capacity=4)
    a = list(range(3 * BLOCK + 5))
    assert cache.lookup_and_insert(a) == 0
    assert cache.lookup_and_insert(a) == 3 * BLOCK  # the tail of 5 is no block
    assert cache.lookup_and_insert([*a[: 2 * BLOCK], 999, *a[2 * BLOCK :]]) == 2 * BLOCK
    # A block matches only after the same prefix: the same tokens later in a prompt do not.
    b = [7] * BLOCK + a[: BLOCK]
    assert cache.lookup_and_insert(b) == 0
    # Capacity 4: a's first blocks were used longest ago and are gone.
    assert cache.lookup_and_insert(a) == 0


@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=3 * BLOCK), max_size=12))
def test_cached_tokens_never_exceed_the_prompt_and_a_repeat_is_a_whole_hit(
    prompts: list[list[int]],
) -> None:
    cache = PrefixCache(capacity=10_000)
    for p in prompts:
        assert 0 <= cache.lookup_and_insert(p) <= len(p)
        assert cache.lookup_and_insert(p) == len(p) - len(p) % BLOCK


def test_the_protocol_is_vllms_and_what_it_cannot_serve_is_refused() -> None:
    with StandInEngine("prefill", cache_blocks=64) as prefill, StandInEngine("decode") as decode:
        kv = {"do_remote_decode": True}
        status, body = _post(prefill.url, {"prompt": "hello", "kv_transfer_params": kv})
        assert status == 200
        doc = json.loads(body)
        assert doc["kv_transfer_params"]["do_remote_prefill"] is True
        p = rx.from_response(body)
        assert p is not None and p.shape == (5, 48, 8) and p.start == 0
        # Prefill refuses a request that is not one; decode one without prefill's params.
        assert _post(prefill.url, {"prompt": "hello"})[0] == 400
        assert _post(decode.url, {"prompt": "hello", "max_tokens": 2})[0] == 400
        assert _post(prefill.url, b"[1, 2]")[0] == 400
        assert _post(prefill.url, b"{not json")[0] == 400
        assert _post(prefill.url, {"prompt": ""})[0] == 400
        assert _post(prefill.url, {"prompt": "x"}, path="/v2/other")[0] == 404
        assert _get(prefill.url + "/stats") == {
            "requests": 1, "prompt_tokens": 5, "cached_tokens": 0,
        }
    with pytest.raises(ValueError, match="role"):
        StandInEngine("both")
    with pytest.raises(ValueError, match="model"):
        StandInEngine("decode", model="gpt-moe")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/inference/v1/generate"]
)
def test_the_proxy_merges_its_halves_to_the_truth(stream: bool, path: str) -> None:
    with StandInEngine("prefill", model="kimi-k2") as prefill, StandInEngine(
        "decode", model="kimi-k2"
    ) as decode, ProxyServer([prefill.url], [decode.url]) as proxy:
        text = "a prompt of forty-one bytes, give or take"
        body: dict[str, Any] = {"model": "m", "max_tokens": 6, "stream": stream}
        if path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": text}]
        elif path.endswith("generate"):
            body = {"model": "m", "token_ids": list(text.encode()), "stream": stream,
                    "sampling_params": {"max_tokens": 6}}
        else:
            body["prompt"] = text
        status, reply = _post(proxy.url, body, path)
        assert status == 200, reply
        if stream:
            events = [line[6:] for line in reply.split(b"\n") if line.startswith(b"data: ")]
            assert events[-1] == b"[DONE]"
            # The finishing event's routing (merged, in the engine's own format: vLLM's .npy
            # text, as one vLLM server streams generate); the others' are null or absent. On
            # completions and chat, where vLLM streams none, the proxy asked decode plainly and
            # wrote its answer as the stream (`stream_routing` buffered, the default).
            reply = next(e for e in events if b'"routed_experts": "' in e
                         or b'"routed_experts":"' in e)
        p = rx.from_response(reply)
        assert p is not None
        assert p.to_numpy().dtype == np.uint16  # 384 experts
        np.testing.assert_array_equal(
            p.to_numpy(), routing_of(list(text.encode()), 6, "kimi-k2")
        )


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_relayed_stream_without_routing_ends_in_an_error_naming_the_way_out(path: str) -> None:
    # `stream_routing` relay: decode's own stream, which from vLLM carries no routing on these
    # endpoints. The client's stream ends in the proxy's error, never in a [DONE] it would stop
    # reading at, and the error says what to do instead.
    with StandInEngine("prefill") as prefill, StandInEngine("decode") as decode, ProxyServer(
        [prefill.url], [decode.url], ProxyConfig(stream_routing="relay")
    ) as proxy:
        body: dict[str, Any] = {"model": "m", "max_tokens": 3, "stream": True}
        if path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": "hello"}]
        else:
            body["prompt"] = "hello"
        status, reply = _post(proxy.url, body, path)
        assert status == 200, reply
        events = [line[6:] for line in reply.split(b"\n") if line.startswith(b"data: ")]
        assert b"[DONE]" not in events
        error = json.loads(events[-1])["error"]
        assert "missing routing" in error["message"]
        assert "--stream-routing buffered" in error["message"], error
        assert '/inference/v1/generate' in error["message"]


def test_a_decode_asked_for_rows_it_did_not_compute_answers_500() -> None:
    # As a real vLLM 0.32 decode engine, which dies instead: the prompt's whole 16-token blocks
    # came over the KV connector; its last position and what follows decode computed.
    with StandInEngine("prefill") as prefill, StandInEngine("decode") as decode:
        tokens = list(range(1, 41))  # 40 tokens: blocks [0, 32) received
        kv = json.loads(_post(prefill.url, {"prompt": tokens, "kv_transfer_params":
                                            {"do_remote_decode": True}})[1])["kv_transfer_params"]
        for start, status in ((None, 500), (31, 500), (32, 200), (39, 200)):
            body: dict[str, Any] = {"prompt": tokens, "max_tokens": 3, "kv_transfer_params": kv}
            if start is not None:
                body["routed_experts_prompt_start"] = start
            got, reply = _post(decode.url, body)
            assert got == status, reply
            if status == 200:
                p = rx.from_response(reply, start=start)
                assert p is not None and (p.start, p.stop) == (start, 42)


def test_sighup_rereads_the_upstreams_file_all_or_nothing(tmp_path: Any) -> None:
    """`routed-experts proxy --upstreams-file`: SIGHUP makes the lists the file's; a file with
    a bad line changes nothing (and says so in the log); requests go on throughout."""
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).with_name("routed-experts"))
    listing = tmp_path / "upstreams"
    with StandInEngine("prefill") as p1, StandInEngine("prefill") as p2, StandInEngine(
        "decode"
    ) as d:
        listing.write_text(f"# one of each\nprefill {p1.url}\ndecode {d.url}\n")
        proc = subprocess.Popen(
            [exe, "proxy", "--upstreams-file", str(listing), "--port", "0"],
            stderr=subprocess.PIPE, text=True,
        )
        try:
            assert proc.stderr is not None
            port = None
            for line in proc.stderr:
                found = re.search(r"on http://127\.0\.0\.1:(\d+); servers from", line)
                if found:
                    port = found.group(1)
                    break
            assert port, "the proxy never said its port"
            url = f"http://127.0.0.1:{port}"

            def servers() -> list[str]:
                return list(_get(url + "/upstreams")["prefill"]["servers"])

            def after_sighup(want: list[str]) -> str:
                proc.send_signal(signal.SIGHUP)
                assert proc.stderr is not None
                for line in proc.stderr:  # the reload's log line says it is done
                    if "SIGHUP" in line and ("decode" in line or "unchanged" in line):
                        break
                assert servers() == want
                assert _post(url, {"model": "m", "prompt": "hi", "max_tokens": 2})[0] == 200
                return line

            assert servers() == [p1.url]
            listing.write_text(f"prefill {p1.url}\nprefill {p2.url}\ndecode {d.url}\n")
            after_sighup([p1.url, p2.url])
            listing.write_text(f"prefill {p2.url}\nprefill localhost:1\ndecode {d.url}\n")
            said = after_sighup([p1.url, p2.url])
            assert "line 2: expected a URL" in said and "unchanged" in said
            listing.write_text(f"prefill {p2.url}\n")
            said = after_sighup([p1.url, p2.url])
            assert "no decode server" in said
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            if proc.stderr is not None:
                proc.stderr.close()


def test_the_command_takes_servers_from_the_flags_or_the_file_never_both(
    tmp_path: Any, capsys: Any
) -> None:
    from routed_experts.cli import main

    listing = tmp_path / "upstreams"
    listing.write_text("prefill http://127.0.0.1:1\ndecode http://127.0.0.1:2\n")
    assert main(["proxy", "--port", "0"]) == 2
    assert "give the servers as --prefill and --decode, or in --upstreams-file" in (
        capsys.readouterr().err
    )
    both = ["proxy", "--port", "0", "--upstreams-file", str(listing), "--prefill", "http://a:1"]
    assert main(both) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["proxy", "--port", "0", "--upstreams-file", str(tmp_path / "none")]) == 2
    assert "upstreams_file" in capsys.readouterr().err


def test_a_bad_policy_or_header_on_the_command_line_is_named_not_a_traceback(
    capsys: Any,
) -> None:
    from routed_experts.cli import main

    servers = ["proxy", "--port", "0", "--prefill", "http://127.0.0.1:1", "--decode",
               "http://127.0.0.1:2"]
    with pytest.raises(SystemExit) as e:  # a choice of the command's, named by argparse
        main([*servers, "--prefill-policy", "cache_aware"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--prefill-policy: invalid choice: 'cache_aware'" in err
    assert "'round_robin', 'least_load', 'session'" in err and "Traceback" not in err
    assert main([*servers, "--session-header", "X Session"]) == 2
    assert "session_header: expected a header name" in capsys.readouterr().err


def _recorded(name: str) -> tuple[dict[str, Any], bytes]:
    """A case vLLM 0.32 really answered (tests/real/vllm/0.32.0/): its reply record and body."""
    from pathlib import Path

    folder = Path(__file__).parent / "real" / "vllm" / "0.32.0"
    manifest = json.loads((folder / "manifest.json").read_text())
    case = next(c for c in manifest["cases"] if c["name"] == name)
    return case["reply"], (folder / case["reply"]["body"]).read_bytes()


def _shape(text: bytes) -> list[tuple[str, bool]]:
    """Where routing sits in a body or stream, and whether each place holds a value: the parts
    of a reply the library reads, as (path, has routing)."""
    docs = [text] if not text.startswith(b"data:") else [
        line[6:] for line in text.split(b"\n") if line.startswith(b"data: {")]
    out = []
    for d in docs:
        doc = json.loads(d)
        for c in doc.get("choices") or []:
            if "routed_experts" in c:
                place = f"choices[{c['index']}].routed_experts"
                out.append((place, c["routed_experts"] is not None))
        out.append(("usage", doc.get("usage") is not None))
    return out


@pytest.mark.parametrize("name", ["e8-completions", "e8-chat", "e8-generate", "e8-generate-start",
                                  "e8-completions-stream", "e8-chat-stream", "e8-generate-stream"])
def test_the_stand_in_answers_where_and_as_the_real_release_does(name: str) -> None:
    # The same request to the stand-in: routing at the same places, in the same format, over
    # the same positions for the start asked; streams carry it (or not) as the real one did.
    rec, real = _recorded(name)
    request = dict(rec["request"])
    # The stand-in answers as a decode server (given prefill's kv_transfer_params); this real
    # request had no KV from a prefill, so every row is one it computed.
    with StandInEngine("decode", uncomputed_rows="zeros") as engine:
        kv = {"do_remote_prefill": True, "remote_engine_id": "x"}
        request["kv_transfer_params"] = kv
        if "sampling_params" in request:
            start = request["sampling_params"].get("routed_experts_prompt_start", 0)
        else:
            start = request.get("routed_experts_prompt_start", 0)
        status, mine = _post(engine.url, request, rec["endpoint"])
    assert status == 200, mine
    real_places, my_places = _shape(real), _shape(mine)
    # Each event's routing places, without the usage-only bookkeeping the stand-in skips.
    assert [p for p in my_places if p[0] != "usage"] == [p for p in real_places if p[0] != "usage"]
    if not real.startswith(b"data:"):
        assert dict(my_places)["usage"] == dict(real_places)["usage"]
        for body in (real, mine):
            value = json.loads(body)["choices"][0]["routed_experts"]
            assert rx.detect_format(value) == "vllm_npy"
            p = rx.from_response(body, start=start or None)
            doc = json.loads(body)
            assert p is not None and p.start == start
            assert p.stop == doc["usage"]["prompt_tokens"] + doc["usage"]["completion_tokens"] - 1


def test_n_choices_each_generate_their_own_tokens_and_share_the_prompts_rows() -> None:
    with StandInEngine("prefill") as prefill:
        kv = {"do_remote_decode": True}
        status, reply = _post(prefill.url, {"prompt": "hello there", "n": 3, "max_tokens": 4,
                                            "kv_transfer_params": kv})
        assert status == 200
        doc = json.loads(reply)
        assert [c["index"] for c in doc["choices"]] == [0, 1, 2]
        rows = [rx.from_response(reply, i) for i in range(3)]
        assert all(r is not None and r.num_tokens == 11 for r in rows)
        for bad in (0, 17, 2.0, "2", True):
            body = {"prompt": "x", "n": bad, "kv_transfer_params": kv}
            status, reply = _post(prefill.url, body)
            assert status == 400 and b"n must be an integer in 1..16" in reply, (bad, reply)
    a, b = (routing_of([1, 2, 3], 4, "qwen3-30b-a3b", choice) for choice in (0, 1))
    np.testing.assert_array_equal(a[:3], b[:3])  # the prompt's rows agree
    assert not np.array_equal(a[3:], b[3:])  # the generated ones do not


def test_a_decode_stopped_mid_stream_ends_the_clients_stream_with_an_error_event() -> None:
    # `routed-experts engine --stream-ms`: events 30 ms apart, so the decode server can be
    # stopped while it streams, and the proxy's client sees an error event, never a [DONE].
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "routed_experts.cli", "engine", "--role", "decode", "--port",
           "0", "--stream-ms", "30"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        port = int(line.rsplit(":", 1)[1])  # "stand-in decode engine (...) on http://H:P"
        with StandInEngine("prefill") as prefill, ProxyServer(
            [prefill.url], [f"http://127.0.0.1:{port}"]
        ) as proxy:
            body = {"model": "m", "token_ids": list(range(3, 40)), "stream": True,
                    "sampling_params": {"max_tokens": 200}}
            req = urllib.request.Request(
                proxy.url + "/inference/v1/generate", json.dumps(body).encode(),
                {"content-type": "application/json"})
            events = []
            with urllib.request.urlopen(req, timeout=30) as r:
                for raw in r:
                    if raw.startswith(b"data: "):
                        events.append(raw[6:].strip())
                        if len(events) == 5:
                            proc.kill()  # mid-stream
        assert len(events) > 5 and b"[DONE]" not in events
        error = json.loads(events[-1])["error"]
        assert error["side"] == "decode", error
    finally:
        proc.kill()
        proc.communicate(timeout=10)
