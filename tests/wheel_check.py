"""Test the built wheel as a user gets it: installed into a clean venv of the oldest and the
newest CPython on this machine, with no Rust or C++ compiler on PATH, and the test suite run
from a copy of tests/ outside the source tree, so it can only import the installed package.

Usage: python tests/wheel_check.py DIST_DIR  (make test-wheel). WHEEL_PYTHONS, a space-separated
list of interpreters, replaces the default pair (pyenv's oldest 3.9 and newest 3.13).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import network_retry

TESTS = Path(__file__).resolve().parent
# Tools a wheel install must never need: if one ran, the wheel was not what got installed.
COMPILERS = ("cargo", "rustc", "rustup", "cc", "c++", "gcc", "g++", "clang", "clang++", "zig")
PYTEST_INI = """[pytest]
filterwarnings = error
addopts = -ra --strict-markers -p no:cacheprovider
markers =
    source_tree: needs the source checkout
    slow_under_emulation: minutes under qemu-user; skipped there
"""


def default_pythons() -> list[str]:
    root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    found = []
    for minor in ("3.9", "3.13"):
        hits = sorted(glob.glob(f"{root}/versions/{minor}.*/bin/python{minor}"))
        if not hits:
            sys.exit(f"wheel_check: no CPython {minor} under {root}/versions (set WHEEL_PYTHONS)")
        found.append(hits[-1])
    return found


def bin_without_compilers(into: Path) -> Path:
    """A directory of links to every program on the usual PATH but the compilers."""
    into.mkdir()
    for folder in ("/usr/local/bin", "/usr/bin", "/bin"):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            dropped = name in COMPILERS or name.startswith(("gcc-", "g++-", "clang-", "x86_64-"))
            link = into / name
            if dropped or link.exists() or link.is_symlink():
                continue
            link.symlink_to(os.path.join(folder, name))
    return into


def run(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
    print("wheel_check: $", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, cwd=cwd, check=True)


def check(python: str, wheel: Path, work: Path, clean_bin: Path) -> None:
    venv = work / "venv"
    run([python, "-m", "venv", str(venv)], dict(os.environ))
    env = {
        "PATH": f"{venv / 'bin'}:{clean_bin}",
        "HOME": os.environ.get("HOME", "/root"),
        "VIRTUAL_ENV": str(venv),
        "LANG": "C.UTF-8",
    }
    if "TMPDIR" in os.environ:
        env["TMPDIR"] = os.environ["TMPDIR"]
    missing = [c for c in COMPILERS if shutil.which(c, path=env["PATH"])]
    assert not missing, f"compilers still on PATH: {missing}"
    py = str(venv / "bin" / "python")
    # Binary wheels only: nothing may be built on the way in.
    # A download the network drops is tried again after a pause (network_retry.py).
    pip = [py, "-m", "pip", "install", "-q", "--only-binary=:all:"]
    network_retry.run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], env)
    network_retry.run([*pip, str(wheel)], env)
    network_retry.run([*pip, "-r", str(TESTS / "requirements.txt")], env)
    suite = work / "tests"
    shutil.copytree(TESTS, suite, ignore=shutil.ignore_patterns("__pycache__", "wheel_check.py"))
    # The benchmark harness its tests run (not in the wheel): beside the suite, as in a clone.
    shutil.copytree(TESTS.parent / "benches" / "rx_bench", work / "benches" / "rx_bench",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (work / "pytest.ini").write_text(PYTEST_INI)
    # The suite must import the installed package, not a source tree.
    where = subprocess.run(
        [py, "-c", "import routed_experts, sys; print(routed_experts.__file__)"],
        env=env, cwd=work, capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert where.startswith(str(venv)), f"imported from {where}, not the venv"
    print(f"wheel_check: routed_experts imported from {where}", flush=True)
    run([py, "-m", "pytest", "-q", "-m", "not source_tree", "-c", str(work / "pytest.ini"),
         "--rootdir", str(work), str(suite)], env, cwd=work)


def main() -> None:
    dist = Path(sys.argv[1] if len(sys.argv) > 1 else "dist")
    import platform

    wheels = sorted(dist.glob(f"routed_experts-*-abi3-*{platform.machine()}.whl"))
    if len(wheels) != 1:
        sys.exit(f"wheel_check: want one abi3 wheel in {dist}, found {[w.name for w in wheels]}")
    pythons = os.environ.get("WHEEL_PYTHONS", "").split() or default_pythons()
    with tempfile.TemporaryDirectory(prefix="wheel-check-") as tmp:
        clean_bin = bin_without_compilers(Path(tmp) / "bin")
        for i, python in enumerate(pythons):
            t0 = time.monotonic()
            check(python, wheels[0], Path(tmp) / f"py{i}", clean_bin)
            print(f"wheel_check: {wheels[0].name} passed on {python} "
                  f"in {time.monotonic() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
