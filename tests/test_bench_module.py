"""`routed-experts bench` runs end to end on a tiny payload (its numbers are not asserted)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from routed_experts.bench import run


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
