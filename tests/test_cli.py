"""The `routed-experts` command."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import routed_experts as rx
from routed_experts.cli import main


def test_demo_runs_and_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--tokens", "256"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b (48 MoE layers, top_k 8" in out and "verified" in out


def write(tmp_path: Path, name: str, data: bytes | str) -> str:
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


def test_inspect_sidecar_and_body(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = rx.RoutedExperts.from_array(np.arange(24, dtype=np.int64).reshape(2, 3, 4), start=7)
    assert main(["inspect", write(tmp_path, "s.json", p.to_json())]) == 0
    out = capsys.readouterr().out
    assert "format: compact" in out and "(2, 3, 4)" in out and "[7, 9)" in out and "uint8" in out
    assert main(["inspect", write(tmp_path, "n.txt", rx.encode(p, "nemo"))]) == 0
    assert "format: nemo" in capsys.readouterr().out
    body = json.dumps({"choices": [{"index": 0, "routed_experts": p.to_dict()}]})
    assert main(["inspect", write(tmp_path, "b.json", body)]) == 0
    assert "format: response body" in capsys.readouterr().out


def test_merge_sidecars_and_bodies(tmp_path: Path) -> None:
    truth = np.arange(6 * 2 * 2, dtype=np.int64).reshape(6, 2, 2) % 200
    pre = rx.RoutedExperts.from_array(truth[:4])
    dec = rx.RoutedExperts.from_array(truth[3:], start=3)
    out = tmp_path / "m.json"
    args = [write(tmp_path, "p.json", pre.to_json()), write(tmp_path, "d.json", dec.to_json())]
    assert main(["merge", *args, "-o", str(out)]) == 0
    assert rx.RoutedExperts.from_json(out.read_bytes()) == rx.RoutedExperts.from_array(truth)
    bodies = [
        json.dumps({"choices": [{"index": 0, "routed_experts": x.to_dict()}]}) for x in (pre, dec)
    ]
    args = [write(tmp_path, "pb.json", bodies[0]), write(tmp_path, "db.json", bodies[1])]
    assert main(["merge", *args, "-o", str(out)]) == 0
    assert rx.from_response(out.read_bytes()) == rx.RoutedExperts.from_array(truth)


def test_convert_between_formats(tmp_path: Path) -> None:
    p = rx.RoutedExperts.from_array(np.arange(12, dtype=np.int64).reshape(2, 3, 2))
    out = tmp_path / "o.txt"
    assert (
        main(
            ["convert", write(tmp_path, "s.json", p.to_json()), "--to", "vllm_npy", "-o", str(out)]
        )
        == 0
    )
    assert rx.detect_format(out.read_text()) == "vllm_npy" and rx.decode(out.read_text()) == p
    src = write(tmp_path, "flat.txt", rx.encode(p, "sglang"))
    assert (
        main(
            ["convert", src, "--to", "compact", "--num-layers", "3", "--top-k", "2", "-o", str(out)]
        )
        == 0
    )
    assert rx.RoutedExperts.from_json(out.read_bytes()) == p


def test_bad_input_exits_2_with_the_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", write(tmp_path, "bad.json", '{"data": 1}')]) == 2
    assert "PayloadError" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing.json")]) == 2


def test_a_reader_that_leaves_ends_inspect_quietly(tmp_path: Path) -> None:
    import subprocess
    import sys

    p = rx.RoutedExperts.from_array(np.arange(4000 * 4 * 2).reshape(4000, 4, 2) % 100)
    path = write(tmp_path, "s.json", p.to_json())
    proc = subprocess.Popen(
        [sys.executable, "-m", "routed_experts", "inspect", "--stats", path],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `| head -0`: the reader is gone before anything is written
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert "BrokenPipeError" not in err and "Traceback" not in err, err
