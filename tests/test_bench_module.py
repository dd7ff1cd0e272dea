"""`routed-experts bench` runs end to end on a tiny payload (its numbers are not asserted)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

import routed_experts as rx
from rx_bench.codec import measure_quality, run, run_quality


def test_bench_prints_the_side_by_side_table(tmp_path: Path) -> None:
    out = io.StringIO()
    rows = run(["qwen3-30b-a3b"], [64], 1, out, json_out=str(tmp_path / "b.json"))
    text = out.getvalue()
    ops = {r.op for r in rows}
    assert ops == {
        "decode sidecar",
        "from_response",
        "merge_response (splice)",
        "merge_response (general)",
        "encode (to_json)",
    }
    assert "| qwen3-30b-a3b | 64 | decode sidecar |" in text
    assert "two threads decoding" in text and "peak memory of from_response" in text
    saved = json.loads((tmp_path / "b.json").read_text())
    assert len(saved["rows"]) == len(rows) and saved["peak"]["output"] == 64 * 48 * 8


def test_bench_quality_prints_agreement_and_load_beside_numpy() -> None:
    out = io.StringIO()
    rows = run_quality(["kimi-k2"], [64], 1, out)
    assert [r.op for r in rows] == ["agreement", "expert_load"]
    assert all(r.fast is not None and r.ours > 0 for r in rows)
    text = out.getvalue()
    assert "| model | tokens | operation | input MB | routed_experts ms | numpy ms |" in text
    assert "| kimi-k2 | 64 | agreement |" in text and "| kimi-k2 | 64 | expert_load |" in text


def test_the_benchmarked_recompute_differs_in_one_expert_of_a_tenth_of_the_routers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What bench --quality times must be what it says: checked through rx.agreement itself.
    seen: list[rx.Agreement] = []
    real = rx.agreement
    monkeypatch.setattr(rx, "agreement", lambda a, b: seen.append(real(a, b)) or seen[-1])
    measure_quality("qwen3-30b-a3b", 2048, 1)
    r = seen[0]
    assert 0.08 < 1 - r.exact_match < 0.12
    assert 1 - r.overlap == pytest.approx((1 - r.exact_match) / 8)  # one expert of eight


def test_the_cpu_ratio_bound_fails_a_run_over_it(capsys: pytest.CaptureFixture[str]) -> None:
    from rx_bench.proxy_command import _within_cpu_ratio

    run = {"load": {"vs_vllm_router": {"cpu_per_request": 0.45}},
           "stream": {"vs_vllm_router": {"cpu_per_request": 0.81}}}
    assert _within_cpu_ratio(run, None)
    assert _within_cpu_ratio(run, 0.9)
    assert not _within_cpu_ratio(run, 0.8)
    assert "stream: CPU per request 0.81x vllm-router's, OVER the bound of 0.8x" in (
        capsys.readouterr().out)
    assert not _within_cpu_ratio({"load": {"proxy": {}}}, 0.8)  # no vllm-router: no pass


def test_the_vllm_shaped_bench_bodies_merge_to_the_truth_and_hold_the_start() -> None:
    # vLLM 0.32's P/D bodies: `.npy` text, decode's rows from P - 1 with no start in them. The
    # merge the proxy must return is the whole sequence; the stand-in refuses a decode request
    # asking another start (the real release dies), and answers one that asks none (as
    # vllm-router sends: its row measures the relay alone).
    import numpy as np

    from rx_bench.proxy import Bodies, Engine

    b = Bodies.make(600, 3, 2, "vllm")
    assert b.decode_start == 600 - 512  # 512 generated (GENERATED): P = 89, decode from 88
    assert rx.detect_format(json.loads(b.prefill)["choices"][0]["routed_experts"]) == "vllm_npy"
    merged = rx.from_response(b.merged)
    prefill = rx.from_response(b.prefill)
    decode = rx.from_response(b.decode, start=b.decode_start)
    assert merged is not None and prefill is not None and decode is not None
    assert merged.shape == (600, 3, 2) and decode.shape == (512, 3, 2)
    np.testing.assert_array_equal(merged.to_numpy()[: prefill.shape[0]], prefill.to_numpy())
    np.testing.assert_array_equal(merged.to_numpy()[b.decode_start :], decode.to_numpy())
    sent = rx.from_response(b.merged_stream.split(b"\n\n")[-3][6:])
    assert sent == merged
    engine = Engine("decode", b, None, "vllm")
    request = b'{"kv_transfer_params":{"remote_engine_id":"bench-prefill"}'
    for start, status in [(b.decode_start, b"200"), (0, b"400"), (None, b"200")]:
        asked = b"" if start is None else b',"routed_experts_prompt_start":%d' % start
        reply = engine.reply(b"/v1/completions", request + asked + b"}")
        assert reply is not None and reply[0].split()[1] == status, (start, reply[0])
    with pytest.raises(ValueError, match="bodies must be one of"):
        Bodies.make(600, 3, 2, "npy")
