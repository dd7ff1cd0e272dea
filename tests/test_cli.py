"""The `routed-experts` command."""

from __future__ import annotations

import argparse
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


NOT_ROUTING = [
    ("q.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10", "a PNG image"),
    ("passwd", b"root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/bin/sh\n",
     "plain text of"),
    ("capture.sse", b'data: {"choices":[{"index":0,"text":"a"}]}\n\ndata: [DONE]\n\n',
     "server-sent event stream"),
    ("blob.bin", bytes(range(1, 40)), "binary data of 39 bytes"),
]


@pytest.mark.parametrize(("name", "data", "said"), NOT_ROUTING)
def test_inspect_of_what_is_not_routing_says_what_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, data: bytes, said: str
) -> None:
    path = write(tmp_path, name, data)
    assert main(["inspect", path]) == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err and "not a routing value or a response body" in err, err
    assert said in err, err
    assert "sglang" not in err, err
    assert "--num-layers" not in err, err


def test_a_field_of_the_file_is_named_as_the_files_not_as_a_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = rx.RoutedExperts.from_array(np.arange(12).reshape(2, 3, 2))
    bad = json.loads(p.to_json())
    bad["start"] = -4
    path = write(tmp_path, "s.json", json.dumps(bad))
    assert main(["inspect", path]) == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err and "`start`" in err and "-4" in err and "--start" not in err, err
    # A flag that contradicts the file is named as the flag.
    good = write(tmp_path, "g.json", p.to_json())
    assert main(["inspect", good, "--num-layers", "5"]) == 2
    err = capsys.readouterr().err
    assert "`num_layers`: expected 5 (as given by --num-layers), got 3" in err, err
    # SGLang's flat values need the shape flags, and the message says which.
    flat = write(tmp_path, "flat.txt", rx.encode(p, "sglang"))
    assert main(["inspect", flat]) == 2
    assert "give --num-layers and --top-k" in capsys.readouterr().err


def test_size_flags_take_units_and_help_states_each_default_once() -> None:
    from routed_experts.cli import build_parser

    parser = build_parser()
    urls = ["--prefill", "http://p", "--decode", "http://d"]
    args = parser.parse_args(["proxy", *urls, "--max-request-bytes", "64MiB",
                              "--max-upstream-bytes", "1.5GB", "--max-buffered-bytes", "4096"])
    assert (args.max_request_bytes, args.max_upstream_bytes) == (64 * 2**20, 1_500_000_000)
    assert args.max_buffered_bytes == 4096 and args.max_header_bytes == 64 * 2**10
    for bad in ("64XB", "-1", "MiB", "1e9"):
        with pytest.raises(SystemExit):
            parser.parse_args(["proxy", *urls, "--max-request-bytes", bad])
    with pytest.raises(SystemExit):  # below the smallest head a client may send
        parser.parse_args(["proxy", *urls, "--max-header-bytes", "1KiB"])
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        text = sub.format_help()
        assert "(default: None)" not in text and "(default: False)" not in text, name
        for block in text.split("\n  -"):
            assert block.count("default") <= 1, (name, block)
    proxy_help = subparsers.choices["proxy"].format_help()
    assert "(default: 64MiB)" in proxy_help and "(default: 1GiB)" in proxy_help


@pytest.mark.source_tree
def test_the_version_is_the_crates_and_written_once() -> None:
    import re

    root = Path(__file__).resolve().parents[1]
    cargo = (root / "Cargo.toml").read_text()
    section = cargo.split("[workspace.package]", 1)[1].split("\n[", 1)[0]
    m = re.search(r'^version = "([^"]+)"', section, re.M)
    assert m is not None
    assert rx.__version__ == m.group(1)
    assert 'dynamic = ["version"]' in (root / "pyproject.toml").read_text()
    # No other hand-kept copy in the Python package.
    for path in (root / "python" / "routed_experts").rglob("*.py"):
        assert m.group(1) not in path.read_text(), path


def test_the_installed_package_holds_no_benchmark_harness(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The harness is benches/rx_bench, run from a clone: nothing of it is in the package (run
    # against the installed wheel too, by the wheel checks).
    package = Path(rx.__file__).parent
    files = [p.relative_to(package).as_posix() for p in package.rglob("*.py")]
    harness = ("bench", "baselines", "passthrough", "reliability", "load_client", "sessions",
               "proxy_command", "codec")
    found = [f for f in files if any(part.strip("_").startswith(harness)
                                      for part in f.removesuffix(".py").split("/"))]
    assert files and not found, found
    # The demo keeps its synthetic rollouts (the package's own `_synthetic`), and the moved
    # commands say where the benchmarks are now.
    assert main(["demo", "--tokens", "64"]) == 0
    capsys.readouterr()
    for command in ("bench", "bench-proxy"):
        assert main([command, "--requests", "3"]) == 2
        err = capsys.readouterr().err
        assert "not part of the installed package" in err and "make bench-" in err, err


def test_a_repeated_server_flag_adds_servers_it_never_keeps_only_the_last() -> None:
    from routed_experts.cli import build_parser

    parse = build_parser().parse_args
    args = parse(["proxy", "--prefill", "http://p1", "--prefill", "http://p2", "http://p3",
                  "--decode", "http://d1", "--decode", "http://d2"])
    assert args.prefill == ["http://p1", "http://p2", "http://p3"]
    assert args.decode == ["http://d1", "http://d2"]
    assert parse(["proxy", "--prefill", "http://p", "--decode", "http://d"]).prefill == ["http://p"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_choice_the_body_lacks_or_a_value_cannot_have_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = rx.RoutedExperts.from_array(np.arange(24, dtype=np.int64).reshape(2, 3, 4))
    body = write(tmp_path, "b.json", json.dumps({"choices": [{"index": 0,
                                                             "routed_experts": p.to_dict()}]}))
    side = write(tmp_path, "s.json", p.to_json())
    for argv in (["inspect", body, "--choice", "3"], ["convert", body, "--to", "lists",
                                                      "--choice", "1"]):
        rc, out, err = _run(argv, capsys)
        assert (rc, out) == (2, ""), (argv, out)
        assert "b.json: --choice: expected one of the body's choices (0), got" in err, err
    rc, out, err = _run(["inspect", side, "--choice", "1"], capsys)
    assert (rc, out) == (2, "") and "a routing value has no choices" in err, err
    # Nothing half-said on stdout before an error.
    rc, out, err = _run(["inspect", write(tmp_path, "bad.json", b'{"data":"!!","shape":[1]}')],
                        capsys)
    assert rc == 2 and out == "", out


def test_merge_and_compare_name_the_files_they_are_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = rx.RoutedExperts.from_array(np.arange(24, dtype=np.int64).reshape(2, 3, 4))
    body = write(tmp_path, "prefill.json",
                 json.dumps({"choices": [{"index": 0, "routed_experts": p.to_dict()}]}))
    value = write(tmp_path, "full.json", p.to_json())
    rc, _, err = _run(["merge", body, value], capsys)
    assert rc == 1 and "MergeError" in err, err
    assert "prefill.json is a response body and" in err and "full.json is a routing value" in err
    assert "from_response" not in err  # the command's words, not the library's
    other = rx.RoutedExperts.from_array(np.arange(16, dtype=np.int64).reshape(2, 2, 4))
    rc, _, err = _run(["compare", value, write(tmp_path, "b.json", other.to_json())], capsys)
    assert rc == 2 and "full.json (a) with" in err and "b.json (b)" in err, err


def test_an_overflowing_shape_is_not_told_to_raise_the_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    huge = json.dumps({"data": "AAAA", "shape": [2**62, 2**62, 8], "start": 0})
    rc, _, err = _run(["inspect", write(tmp_path, "h.json", huge)], capsys)
    assert rc == 2 and "overflow" in err and "--max-bytes" not in err, err
    big = json.dumps({"data": "AAAA", "shape": [2**20, 2**10, 8], "start": 0})
    rc, _, err = _run(["inspect", write(tmp_path, "b.json", big)], capsys)
    assert rc == 2 and "raise it with --max-bytes" in err, err


def test_convert_to_stdout_ends_its_line(tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
                                         ) -> None:
    p = rx.RoutedExperts.from_array(np.arange(12, dtype=np.int64).reshape(2, 3, 2))
    for fmt in rx.FORMATS:
        assert main(["convert", write(tmp_path, "s.json", p.to_json()), "--to", fmt]) == 0
        out = capfdbinary.readouterr().out
        assert out.endswith(b"\n") and not out.endswith(b"\n\n"), (fmt, out[-20:])


def test_the_help_shows_every_choice_and_every_flag_says_what_it_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from routed_experts.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    proxy_help = sub.choices["proxy"].format_help()
    assert "{compact,engine}" in proxy_help and "{buffered,relay}" in proxy_help, proxy_help
    for name, command in sub.choices.items():
        for action in command._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings[0]} has no help"


@pytest.mark.source_tree
def test_the_wheel_contents_check_refuses_a_shipped_harness(tmp_path: Path) -> None:
    import sys
    import zipfile

    sys.path.insert(0, str(Path(__file__).parent))
    import wheel_contents

    want = wheel_contents.tracked()
    assert "routed_experts/__init__.py" in want and not any("rx_bench" in f for f in want)
    good = tmp_path / "good.whl"
    with zipfile.ZipFile(good, "w") as z:
        for name in [*want, "routed_experts/_core.abi3.so",
                     "routed_experts-0.1.0.dist-info/RECORD"]:
            z.writestr(name, "")
    assert wheel_contents.problems(good, want) == []
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(bad, "w") as z:
        for name in [*want, "routed_experts/_core.abi3.so", "routed_experts/_bench/proxy.py",
                     "rx_bench/codec.py"]:
            z.writestr(name, "")
    found = wheel_contents.problems(bad, want)
    assert any("benchmark harness shipped" in f for f in found), found
    assert any("outside the package" in f for f in found), found


def test_missing_routing_exits_3_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The exit codes (README, "The command"): 3 where routing was expected and none came.
    none = write(tmp_path, "norouting.json",
                 json.dumps({"id": "c", "choices": [{"index": 0, "text": "hi"}]}))
    rc, out, err = _run(["inspect", none], capsys)
    assert (rc, out) == (3, "") and "norouting.json: the response carries no routing" in err, err
    rc, out, _ = _run(["inspect", none, "--allow-missing"], capsys)
    assert rc == 0 and "choice 0: no routing" in out
    rc, _, err = _run(["merge", none, none], capsys)
    assert rc == 3 and "neither" in err and "--allow-missing" in err, err
    rc, out, _ = _run(["merge", none, none, "--allow-missing"], capsys)
    assert rc == 0 and json.loads(out) == json.loads(Path(none).read_text())
    # Prefill with routing, decode without: the decode side's rows are missing.
    p = rx.RoutedExperts.from_array(np.arange(24, dtype=np.int64).reshape(2, 3, 4))
    routed = write(tmp_path, "prefill.json",
                   json.dumps({"choices": [{"index": 0, "routed_experts": p.to_dict()}]}))
    rc, _, err = _run(["merge", routed, none], capsys)
    assert rc == 3 and "missing routing on the decode side" in err, err
    rc, _, err = _run(["compare", none, routed], capsys)
    assert rc == 3 and "norouting.json" in err, err


def test_merge_takes_decode_start_for_a_body_that_does_not_fix_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM's P/D: prefill's rows [0, 5), decode's from P - 1 = 4 to P + G - 1 = 7, no counts.
    truth = (np.arange(7 * 2 * 2).reshape(7, 2, 2) % 9).astype(np.uint8)
    text = {k: rx.encode(rx.RoutedExperts.from_array(a, start=s), "vllm_npy")
            for k, (a, s) in {"p": (truth[:5], 0), "d": (truth[4:], 4)}.items()}
    pre, dec = (write(tmp_path, f"{k}.json",
                      json.dumps({"choices": [{"index": 0, "routed_experts": text[k]}]}))
                for k in ("p", "d"))  # fmt: skip
    rc, out, _ = _run(["merge", pre, dec, "--decode-start", "4"], capsys)
    assert rc == 0
    np.testing.assert_array_equal(rx.from_response(out).array, truth)
    rc, _, err = _run(["merge", pre, dec], capsys)  # read from 0, decode lies inside prefill
    assert rc in (1, 2) and err, err


@pytest.mark.parametrize(("name", "data", "said"), [
    ("empty.json", b"", "empty, no routing value or response body in it"),
    ("img.png", b"\x89PNG\r\n\x1a\n\x00\x00",
     "a PNG image, not a routing value or a response body"),
    ("error.json", b'{"error": {"message": "max_tokens is too large", "code": 400}}',
     'the server\'s error reply, not a response: "max_tokens is too large"'),
    ("request.json", b'{"model": "m", "prompt": "hi"}',
     'a JSON object of keys "model", "prompt", neither a routing value nor a response body'),
])
def test_every_command_names_the_file_and_what_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, data: bytes, said: str
) -> None:
    bad = write(tmp_path, name, data)
    p = rx.RoutedExperts.from_array(np.arange(24, dtype=np.int64).reshape(2, 3, 4))
    good = write(tmp_path, "good.json",
                 json.dumps({"choices": [{"index": 0, "routed_experts": p.to_dict()}]}))
    for argv in (["inspect", bad], ["convert", bad, "--to", "lists"], ["compare", good, bad],
                 ["merge", good, bad], ["merge", bad, good]):
        rc, out, err = _run(argv, capsys)
        assert (rc, out) == (2, ""), (argv, err)
        assert f"{bad}: {said}" in err, (argv, err)


def test_a_raw_npy_file_is_read_as_its_array(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = (np.arange(24).reshape(4, 3, 2) % 11).astype(np.uint8)
    path = tmp_path / "rows.npy"
    np.save(path, a)
    rc, out, _ = _run(["inspect", str(path), "--start", "5"], capsys)
    assert rc == 0 and "format: raw .npy (np.save)" in out and "positions: [5, 9)" in out, out
    rc, out, _ = _run(["convert", str(path), "--to", "lists"], capsys)
    assert rc == 0 and json.loads(out) == a.tolist()
    cut = write(tmp_path, "cut.npy", path.read_bytes()[:100])
    rc, out, err = _run(["inspect", cut], capsys)
    assert (rc, out) == (2, "") and f"{cut}: a .npy file numpy cannot read" in err, err


def test_swapped_pd_inputs_are_said_to_be_swapped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A prefill half counts one generated token; decode counts the choice's.
    truth = (np.arange(8 * 2 * 2).reshape(8, 2, 2) % 9).astype(np.uint8)

    def half(rows: np.ndarray, prompt: int, generated: int) -> str:
        value = rx.encode(rx.RoutedExperts.from_array(rows), "vllm_npy")
        return json.dumps({"choices": [{"index": 0, "text": "x", "routed_experts": value}],
                           "usage": {"prompt_tokens": prompt, "completion_tokens": generated}})

    pre = write(tmp_path, "prefill.json", half(truth[:5], 5, 1))
    dec = write(tmp_path, "decode.json", half(truth[4:], 5, 4))
    rc, _, err = _run(["merge", dec, pre], capsys)
    assert rc == 1 and "the inputs look swapped" in err, err
    assert f"run `routed-experts merge {pre} {dec}`" in err, err
    rc, out, _ = _run(["merge", pre, dec], capsys)  # decode's start derived: P + G - 1 - rows
    assert rc == 0
    np.testing.assert_array_equal(rx.from_response(out).array, truth)


def test_a_bad_flag_is_said_first_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["proxy", "--prefill", "htp://x", "--decode", "http://127.0.0.1:1"])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2
    assert err[0] == ("routed-experts proxy: error: argument --prefill: expected a URL starting "
                      "with http://, got 'htp://x'"), err
    assert err[1:] == ["(`routed-experts proxy --help` lists the flags)"], err


@pytest.mark.source_tree
def test_the_proxy_says_at_start_which_server_does_not_answer() -> None:
    import queue
    import socket
    import subprocess
    import sys
    import threading
    import time

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    engine_port, nobody = free_port(), free_port()
    exe = [sys.executable, "-m", "routed_experts"]
    engine = subprocess.Popen([*exe, "engine", "--role", "decode", "--port", str(engine_port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    proxy = None
    try:
        deadline = time.monotonic() + 30
        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", engine_port)) == 0

        while not listening():
            assert time.monotonic() < deadline, "the stand-in engine never listened"
            time.sleep(0.1)
        proxy = subprocess.Popen(
            [*exe, "proxy", "--prefill", f"http://127.0.0.1:{nobody}", "--decode",
             f"http://127.0.0.1:{engine_port}", "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        assert proxy.stdout is not None
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proxy.stdout],  # type: ignore[union-attr]
                         daemon=True).start()  # fmt: skip
        said: list[str] = []
        while sum("/health" in s for s in said) < 2:
            said.append(lines.get(timeout=30))  # queue.Empty: the proxy never said it
        text = "".join(said)
        assert f"prefill server http://127.0.0.1:{nobody} does not answer /health at start" in text
        assert f"decode server http://127.0.0.1:{engine_port} answers /health" in text, text
        assert proxy.poll() is None  # it serves on: a server that starts later is used
    finally:
        for p in (proxy, engine):
            if p is not None:
                p.kill()
                p.wait()
                if p.stdout is not None:
                    p.stdout.close()
