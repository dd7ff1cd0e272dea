"""Never read wrong, round three (issue 38): what a new user and this autumn's producers broke,
each now read right or refused naming what was seen."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import routed_experts as rx
from routed_experts.cli import main


def _rows(tokens: int, layers: int = 2, k: int = 2, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Real routing: k distinct experts of 8, never the filler 0..k-1 in every layer.
    return np.stack([[rng.choice(np.arange(2, 8), k, replace=False) for _ in range(layers)]
                     for _ in range(tokens)])


def test_nemo_values_this_library_writes_read_back_whole() -> None:
    # encode(p, "nemo") writes a payload's rows, no filler: its body reads back all six rows.
    p = rx.RoutedExperts.from_array(_rows(6))
    body = {"choices": [{"index": 0, "message": {"routed_experts": rx.encode(p, "nemo")}}]}
    got = rx.from_response(json.dumps(body))
    assert got is not None and got.num_tokens == 6
    np.testing.assert_array_equal(got.array, p.array)
    # NeMo-RL's own value ends in its filler (0..top_k-1 in every layer): that row is dropped.
    filler = np.tile(np.arange(2), (1, 2, 1))
    nemo = rx.RoutedExperts.from_array(np.concatenate([p.array, filler]), dtype="int16")
    body["choices"][0]["message"]["routed_experts"] = rx.encode(nemo, "nemo")
    got = rx.from_response(json.dumps(body))
    assert got is not None and got == rx.RoutedExperts.from_array(p.array, dtype="int16")


def test_a_nemo_value_of_p_plus_g_rows_must_end_in_the_filler() -> None:
    p = rx.RoutedExperts.from_array(_rows(6))
    body = {"choices": [{"index": 0, "message": {"routed_experts": rx.encode(p, "nemo")}}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
    with pytest.raises(rx.PayloadError, match=r"last \(position 5\) its filler"):
        rx.from_response(json.dumps(body))
    # Five prompt and one generated: P + G - 1 rows, no filler, every row read.
    body["usage"] = {"prompt_tokens": 5, "completion_tokens": 2}
    got = rx.from_response(json.dumps(body))
    assert got is not None and got.num_tokens == 6


def test_pack_places_a_delta_at_its_positions_never_at_0() -> None:
    rows = _rows(2)
    delta = rx.RoutedExperts.from_array(rows, start=3)
    batch, cu, mask = rx.pack([delta], mask=True)
    assert list(cu) == [0, 5]
    assert list(mask) == [False, False, False, True, True]
    np.testing.assert_array_equal(np.asarray(batch)[3:], rows)
    assert not np.asarray(batch)[:3].any()


@pytest.mark.parametrize("value", [b"", "", "  \n", '""'])
def test_empty_input_is_its_own_error(value: bytes | str) -> None:
    with pytest.raises(rx.PayloadError, match="empty input"):
        rx.decode(value, num_layers=48, top_k=8)
    with pytest.raises(rx.PayloadError, match="empty input"):
        rx.detect_format(value)


def test_an_empty_file_is_refused_by_inspect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "empty.txt"
    f.write_bytes(b"")
    assert main(["inspect", str(f), "--num-layers", "48", "--top-k", "8"]) == 2
    out = capsys.readouterr()
    assert "empty.txt: empty, no routing value or response body in it" in out.err
    assert out.out == ""


@pytest.mark.parametrize("fmt", ["vllm_npy", "nemo", "sglang"])
def test_a_json_string_literal_is_read_as_the_text_it_holds(fmt: str, tmp_path: Path) -> None:
    p = rx.RoutedExperts.from_array(_rows(5))
    hints = {"num_layers": 2, "top_k": 2} if fmt == "sglang" else {}
    dumped = json.dumps(rx.encode(p, fmt))  # what json.dump(rx.encode(p, fmt), f) writes
    assert dumped.startswith('"')
    assert rx.detect_format(dumped) == fmt
    got = rx.decode(dumped, **hints)
    np.testing.assert_array_equal(got.array, p.array)
    f = tmp_path / "value.json"
    f.write_text(dumped)
    flags = ["--num-layers", "2", "--top-k", "2"] if fmt == "sglang" else []
    assert main(["inspect", str(f), *flags]) == 0


def test_every_class_an_error_names_is_reachable_as_named() -> None:
    with pytest.raises(rx.PayloadError) as e:
        rx.decode('data: {"choices":[]}\n\ndata: [DONE]\n\n')
    message = str(e.value)
    assert "routed_experts.proxy.StreamMerger" in message
    import routed_experts.proxy

    assert routed_experts.proxy.StreamMerger is not None
    assert "routed_experts.from_response" in message and rx.from_response is not None


def test_an_array_where_json_goes_says_how_to_make_a_payload() -> None:
    a = _rows(3)
    with pytest.raises(rx.PayloadError, match=r"RoutedExperts\.from_array"):
        rx.merge(a, a)
    with pytest.raises(rx.PayloadError, match=r"RoutedExperts\.from_array"):
        rx.Trajectory().append(a)


def test_the_cli_raises_its_size_limit_with_max_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = rx.RoutedExperts.from_array(_rows(64))
    f = tmp_path / "value.json"
    f.write_bytes(p.to_json())
    limit = rx.get_max_bytes()  # the command sets the process's limit: put back after
    try:
        assert main(["inspect", str(f), "--max-bytes", "16"]) == 2
        err = capsys.readouterr().err
        assert "raise it with --max-bytes" in err and "set_max_bytes" not in err
        assert main(["inspect", str(f), "--max-bytes", str(p.nbytes)]) == 0
    finally:
        rx.set_max_bytes(limit)


def test_openai_sdk_objects_are_read_as_the_body_they_came_from() -> None:
    openai = pytest.importorskip("openai")
    p = rx.RoutedExperts.from_array(_rows(4), num_experts=8)
    body = {"id": "c", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None,
                         "routed_experts": rx.encode(p, "vllm_npy")}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    completion = openai.types.Completion.model_validate(body)
    assert completion.choices[0].model_extra["routed_experts"]  # where the SDK keeps it
    got = rx.from_response(completion)
    assert got is not None and got == rx.from_response(json.dumps(body))
    chat = {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "length", "logprobs": None,
                         "message": {"role": "assistant", "content": "x"},
                         "routed_experts": rx.encode(p, "vllm_npy")}]}
    got = rx.from_response(openai.types.chat.ChatCompletion.model_validate(chat))
    assert got is not None and got == p
    t = rx.Trajectory()
    t.append(openai.types.chat.ChatCompletion.model_validate(chat))
    assert t.payload == p


def _weighted_sidecar(rows: np.ndarray, start: int = 0) -> dict:
    """A sidecar as prime-rl's open PR #3523 writes it: FP32 router weights inside."""
    p = rx.RoutedExperts.from_array(rows, start=start)
    weights = np.full(rows.shape, 0.5, dtype="<f4").tobytes()
    import base64

    return dict(p.to_dict(), format_version=1,
                weights={"data": base64.b64encode(weights).decode(), "dtype": "float32"})


def test_a_merge_refuses_weights_inside_a_sidecar_and_never_drops_them() -> None:
    rows = _rows(6)
    prefill = {"choices": [{"index": 0, "routed_experts": _weighted_sidecar(rows[:4])}]}
    decode = {"choices": [{"index": 0, "routed_experts": _weighted_sidecar(rows[3:], start=3)}]}
    # Reading takes the ids (the weights' shape is not settled; nothing is merged from them).
    got = rx.from_response(json.dumps(decode))
    assert got is not None and got.start == 3
    with pytest.raises(rx.MergeError, match="`format_version` key|`weights` key"):
        rx.merge_response(json.dumps(prefill), json.dumps(decode))
    # Any key the library does not know is refused by a merge too, not dropped.
    noted = dict(rx.RoutedExperts.from_array(rows[:4]).to_dict(), note="kept?")
    plain = {"choices": [{"index": 0, "routed_experts": rx.RoutedExperts.from_array(
        rows[3:], start=3).to_dict()}]}
    with pytest.raises(rx.MergeError, match="`note` key: a key the library does not know"):
        rx.merge_response(json.dumps({"choices": [{"index": 0, "routed_experts": noted}]}),
                          json.dumps(plain))


@pytest.mark.parametrize("where", ["nvext", "top"])
def test_routing_moved_to_dynamos_object_store_is_refused_saying_where(where: str) -> None:
    receipt = {"format": "generation_artifact_v1", "contents": ["moe_routes"], "state": "ready",
               "actual_bytes": 8192, "sha256": "9f", "object_id": "art-42"}
    if where == "nvext":
        body = {"choices": [{"index": 0, "message": {"content": "x"}}],
                "nvext": {"routed_experts": None, "generation_artifact": receipt}}
    else:
        body = {"request_id": "r", "choices": [{"index": 0, "token_ids": [3]}],
                "generation_artifact": receipt}
    for call in (lambda: rx.from_response(json.dumps(body)),
                 lambda: rx.merge_response(json.dumps(body), json.dumps(body))):
        with pytest.raises(rx.PayloadError, match="object store.*art-42"):
            call()


def test_nested_lists_of_vllm_021s_generated_count_are_refused_naming_both_readings() -> None:
    # vLLM 0.21's body after a router dropped its top-level prompt_routed_experts: the choice's
    # generated rows (G - 1 of them) would read as lmdeploy's rows from position 0.
    rows = _rows(4)
    body = {"choices": [{"index": 0, "routed_experts": rows.tolist()}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 5}}
    with pytest.raises(rx.PayloadError, match="ambiguous.*lmdeploy.*vLLM 0.21"):
        rx.from_response(json.dumps(body))
    # lmdeploy's own count (P + G - 1 rows) reads from 0.
    body["choices"][0]["routed_experts"] = _rows(13).tolist()
    got = rx.from_response(json.dumps(body))
    assert got is not None and (got.start, got.stop) == (0, 13)


class _Terminal:
    """A stderr that says it is a terminal, keeping what is written."""

    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass


def test_long_cli_work_shows_progress_on_a_terminal_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert main(["demo", "--tokens", "64"]) == 0
    assert "making a synthetic" in term.text and "timing encode and decode" in term.text
    assert "routed-experts:" not in capsys.readouterr().out  # progress never on stdout
    monkeypatch.undo()
    assert main(["demo", "--tokens", "64"]) == 0
    assert capsys.readouterr().err == ""  # not a terminal: silent


@pytest.mark.source_tree
def test_what_the_readme_says_the_command_prints_it_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # What the README said is now in the proxy's manual and the library guide.
    docs = Path(__file__).resolve().parent.parent / "docs"
    manual, guide = (docs / "proxy.md").read_text(), (docs / "usage.md").read_text()
    quoted = "argument --prefill: expected a\nURL starting with http://, got 'localhost:8100'"
    assert quoted in manual
    with pytest.raises(SystemExit) as e:
        main(["proxy", "--prefill", "localhost:8100", "--decode", "http://127.0.0.1:9"])
    assert e.value.code == 2
    assert quoted.replace("\n", " ") in capsys.readouterr().err
    # The policies are choices the usage shows.
    with pytest.raises(SystemExit):
        main(["proxy", "--help"])
    assert "{round_robin,least_load,session}" in capsys.readouterr().out
    # to_json returns bytes, as the library guide says.
    assert isinstance(rx.RoutedExperts.from_array(_rows(1)).to_json(), bytes)
    assert "`p.to_json()` (bytes)" in guide


def test_an_openai_sdk_stream_chunk_with_routing_is_read() -> None:
    # SGLang's OpenAI stream sends its routing in a chunk of its own: `choices` empty,
    # `sglext.routed_experts` (the SDK keeps `sglext` in model_extra).
    openai = pytest.importorskip("openai")
    import base64

    rows = _rows(3)
    flat = base64.b64encode(rows.astype("<i4").tobytes()).decode()
    chunk = openai.types.chat.ChatCompletionChunk.model_validate(
        {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [], "sglext": {"routed_experts": flat}})
    assert chunk.model_extra is not None and "sglext" in chunk.model_extra
    got = rx.from_response(chunk, num_layers=2, top_k=2)
    assert got is not None
    np.testing.assert_array_equal(got.to_numpy(), rows)
