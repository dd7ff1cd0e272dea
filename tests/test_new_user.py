"""What a new user trips on: numpy conventions, errors that say what to do, the CLI
as typed (through the installed console script), and the repository's own hygiene."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import routed_experts as rx
from conftest import REPO

SIDE = {"data": "CgsUFR4f", "shape": [3, 1, 2], "start": 0, "dtype": "uint8"}
BODY = {"id": "x", "choices": [{"index": 0, "text": "h", "routed_experts": SIDE}]}


def test_dtype_is_a_numpy_dtype_everywhere() -> None:
    p = rx.RoutedExperts.from_json(SIDE)
    assert isinstance(p.dtype, np.dtype)
    assert p.dtype == np.uint8 and p.dtype == "uint8" and p.dtype == p.array.dtype
    wide = p.astype("uint16")
    assert wide.dtype == np.dtype("uint16")
    t = rx.Trajectory()
    assert t.dtype is None
    t.append(p)
    t.append(rx.RoutedExperts.from_array(np.full((1, 1, 2), 300), start=3))
    assert isinstance(t.dtype, np.dtype) and t.dtype == np.uint16


def test_numpy_asarray_is_the_read_only_view() -> None:
    p = rx.RoutedExperts.from_json(SIDE)
    a = np.asarray(p)
    assert a.shape == (3, 1, 2) and not a.flags.writeable
    assert np.shares_memory(a, p.array)
    c = np.array(p)  # numpy's default is a copy
    assert c.flags.writeable and not np.shares_memory(c, p.array)
    assert np.asarray(p, dtype=np.int32).dtype == np.int32
    np.testing.assert_array_equal(np.asarray(p), p.array)


def test_response_readers_accept_parsed_bodies() -> None:
    want = rx.RoutedExperts.from_json(SIDE)
    assert rx.from_response(BODY) == want
    assert rx.from_response(json.dumps(BODY)) == want
    merged = rx.merge_response(BODY, BODY)
    assert rx.from_response(merged) == want


def test_errors_say_what_was_given_and_what_to_call() -> None:
    with pytest.raises(rx.PayloadError, match="got text that is not JSON"):
        rx.RoutedExperts.from_json("hello")
    with pytest.raises(rx.PayloadError, match="got a number"):
        rx.RoutedExperts.from_json("42")
    for value in (BODY, json.dumps(BODY), json.dumps(BODY).encode()):
        for call in (rx.RoutedExperts.from_json, rx.decode):
            with pytest.raises(rx.PayloadError, match=r"response body .*from_response"):
                call(value)  # type: ignore[operator]
    with pytest.raises(rx.PayloadError, match=r"response body .*from_response"):
        rx.merge(BODY, BODY)


def test_public_names_are_the_api() -> None:
    public = {n for n in dir(rx) if not n.startswith("_")}
    modules = {"baselines", "bench", "cli", "proxy", "synthetic", "stand_in_engine", "vllm_plugin"}
    assert public - set(rx.__all__) <= modules, public
    assert "annotations" not in dir(rx)
    for name in rx.__all__:
        assert getattr(rx, name).__doc__, name


def test_the_public_names_are_one_list() -> None:
    # One list of public names, the extension's `__all__` (its exports but the internal `_`
    # names and the proxy's StreamMerger, which `routed_experts.proxy` exports): the package
    # imports it whole and adds its `replay` subpackage; the stub's `__all__` is the same list
    # (stubtest holds the two equal too).
    import ast

    core = rx._core
    exported = {n for n in dir(core) if not n.startswith("_")}
    assert set(core.__all__) == exported - {"StreamMerger"}, exported
    assert rx.__all__ == ["replay", *core.__all__]
    for name in core.__all__:
        assert getattr(rx, name) is getattr(core, name), name
    init = Path(rx.__file__)
    stub = ast.parse(init.with_name("_core.pyi").read_text())
    stub_all = next(n for n in stub.body if isinstance(n, ast.Assign)
                    and getattr(n.targets[0], "id", "") == "__all__")
    assert isinstance(stub_all.value, ast.List)
    stub_names = {e.value for e in stub_all.value.elts if isinstance(e, ast.Constant)}
    assert stub_names == set(core.__all__)
    tree = ast.parse(init.read_text())
    by_name = {a.name for n in tree.body if isinstance(n, ast.ImportFrom)
               and n.module == "routed_experts._core" for a in n.names}
    assert by_name == {"*", "__version__"}, "the package names no public name of its own"
    from routed_experts import proxy

    assert proxy.StreamMerger is rx._core.StreamMerger


def stub_literal(alias_name: str) -> tuple[object, ...]:
    """The values of a `Literal[...]` alias in the stub."""
    import ast
    import typing

    stub = Path(rx.__file__).with_name("_core.pyi").read_text()
    alias = next(n for n in ast.parse(stub).body
                 if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == alias_name)
    assert alias.value is not None
    literal = eval(ast.unparse(alias.value), {"Literal": typing.Literal})  # noqa: S307
    return typing.get_args(literal)


def test_the_formats_python_names_are_the_cores() -> None:
    # One list, the core's: the stub's literal, the CLI's choices and detection agree with it.
    assert stub_literal("_Format") == rx.FORMATS
    from routed_experts.cli import build_parser

    convert = build_parser()._subparsers._group_actions[0].choices["convert"]  # type: ignore[union-attr]
    to = next(a for a in convert._actions if a.dest == "to")
    assert tuple(to.choices) == rx.FORMATS
    payload = rx.RoutedExperts.from_array(np.zeros((2, 1, 1), dtype=np.int64), num_experts=4)
    for name in rx.FORMATS:
        assert rx.detect_format(rx.encode(payload, name)) == name


def test_the_error_kinds_python_names_are_the_cores() -> None:
    # The exceptions' `kind`: the stub's literal is the core's list (tests/test_error_kinds.py).
    assert stub_literal("_ErrorKind") == rx._core._ERROR_KINDS


def test_trajectory_pickles_for_ray_and_multiprocessing() -> None:
    t = rx.Trajectory()
    t.append(SIDE)
    back = pickle.loads(pickle.dumps(t, protocol=5))
    assert back.payload == t.payload


# --- the command line, through the console script as a user runs it ----------------------------

def cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("routed-experts") or str(Path(sys.executable).parent / "routed-experts")
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, timeout=120,
        input=None if stdin is None else stdin.decode(),
    )


@pytest.mark.slow_under_emulation  # 22 s under qemu: Python start-ups for --help
def test_cli_version_and_help_show_every_default() -> None:
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"routed-experts {rx.__version__}"
    for command in ("demo", "inspect", "compare", "plot", "merge", "convert", "engine", "proxy"):
        r = cli(command, "--help")
        assert r.returncode == 0, r.stderr
        options = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("--")]
        assert options, command
    demo_help = cli("demo", "--help").stdout
    assert "(default: 4096)" in demo_help and "(default: qwen3-30b-a3b)" in demo_help


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("demo", "--tokens", "-5"), "--tokens: expected an integer >= 1, got -5"),
        (("demo", "--tokens", "0"), "--tokens: expected an integer >= 1, got 0"),
        (("demo", "--tokens", "many"), "--tokens: expected an integer, got 'many'"),
        (("inspect", "-", "--choice", "-1"), "--choice: expected an integer >= 0, got -1"),
        (("inspect", "-", "--num-layers", "-1"), "--num-layers: expected an integer >= 1"),
    ],
)
def test_cli_refuses_bad_numbers_with_a_message(args: tuple[str, ...], needle: str) -> None:
    r = cli(*args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_cli_errors_name_flags_not_python_arguments(tmp_path: Path) -> None:
    flat = tmp_path / "flat.txt"
    flat.write_text("AQAAAAIAAAA=")
    r = cli("inspect", str(flat))
    assert r.returncode == 2 and "give --num-layers and --top-k" in r.stderr, r.stderr
    assert cli("inspect", str(flat), "--num-layers", "1", "--top-k", "2").returncode == 0


def test_cli_convert_reads_routing_out_of_a_body(tmp_path: Path) -> None:
    body = tmp_path / "body.json"
    body.write_text(json.dumps(BODY))
    r = cli("convert", str(body), "--to", "lists")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [[[10, 11]], [[20, 21]], [[30, 31]]]


@pytest.mark.source_tree
def test_git_tracks_only_intended_files() -> None:
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    # A shell-redirect accident (`pip install x>=1.7,<2` unquoted) leaves files like '=1.7,'.
    odd = [f for f in files if not f[:1].isalnum() and not f.startswith(".")]
    assert not odd, odd
    built = [f for f in files if f.endswith((".so", ".pyd", ".whl")) or "/target/" in f]
    assert not built, built


def test_the_bench_says_when_its_baseline_is_missing() -> None:
    code = (
        "import sys; sys.modules['orjson'] = None\n"  # as if it were not installed
        "from rx_bench.cli import main\n"
        "sys.exit(main(['bench', '--model', 'qwen3-30b-a3b', '--tokens', '16', '--repeat', '1']))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "benches")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert "needs orjson and pybase64 (tests/requirements.txt" in r.stderr


def test_install_hints_name_the_packages_of_each_extra_as_pyproject_declares_them() -> None:
    # The hints name packages, which install today; `routed_experts[...]` would not, unpublished.
    from routed_experts.cli import install_hint

    assert install_hint("torch") == "pip install torch"
    assert install_hint("proxy") == "pip install aiohttp"
    both = install_hint("proxy,torch").split()
    assert both == ["pip", "install", "aiohttp", "torch"] or both == [
        "pip", "install", "torch", "aiohttp"]


@pytest.mark.source_tree
@pytest.mark.parametrize(
    "doc",
    ["README.md", "BENCHMARKS.md", "CHANGELOG.md", "docs/format.md", "docs/usage.md",
     "docs/proxy.md", "docs/development.md", "docs/architecture.md",
     "docs/benchmark-history.md"],
)
def test_markdown_tables_render_as_tables(doc: str) -> None:
    # A table row not joined to its table (no blank line before it, a row after a paragraph)
    # renders as a paragraph of literal pipes.
    import markdown

    html = markdown.markdown((REPO / doc).read_text(), extensions=["tables", "fenced_code"])
    assert "<table>" in html or "|" not in html
    stray = [line for line in html.splitlines() if line.lstrip("<p>").startswith("|")]
    assert not stray, stray
