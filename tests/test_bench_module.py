"""`routed-experts bench` runs end to end on a tiny payload (its numbers are not asserted)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

import routed_experts as rx
from routed_experts._bench.codec import measure_quality, run, run_quality


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
    from routed_experts._bench.proxy import _within_cpu_ratio

    run = {"load": {"vs_vllm_router": {"cpu_per_request": 0.45}},
           "stream": {"vs_vllm_router": {"cpu_per_request": 0.81}}}
    assert _within_cpu_ratio(run, None)
    assert _within_cpu_ratio(run, 0.9)
    assert not _within_cpu_ratio(run, 0.8)
    assert "stream: CPU per request 0.81x vllm-router's, OVER the bound of 0.8x" in (
        capsys.readouterr().out)
    assert not _within_cpu_ratio({"load": {"proxy": {}}}, 0.8)  # no vllm-router: no pass
