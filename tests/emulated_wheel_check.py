"""Test the aarch64 wheel as a user on a Grace (GH200, GB200) node gets it: installed into a
Debian arm64 CPython run under user-mode emulation (qemu-user), in a root with no compiler at
all, and the test suite run from a copy of tests/ there.

Usage: python tests/emulated_wheel_check.py DIST_DIR  (make test-wheel, as root). It installs
what it needs (Debian's qemu-user-static and debootstrap), registers qemu as the aarch64 binary
handler (binfmt_misc), builds the arm64 root once under target/emulated/ (debootstrap, about
two minutes), downloads the aarch64 wheels of the test tools and extras on the host (the root
needs no network of its own), and installs them offline. Ray is left out (its cluster of
processes takes minutes under emulation; its tests skip without it), tests marked
`slow_under_emulation` are skipped, and properties run fewer examples (tests/conftest.py).

`--prepare` (stdlib only, so CI can start it before anything is built, beside `make test`)
does only the tools, the handler and the root; a lock makes the check wait for it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import network_retry

# The same pytest settings and the same list of compilers a wheel must never need.
from wheel_check import COMPILERS, PYTEST_INI

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent / "target" / "emulated" / "bookworm-arm64"
LOCK = ROOT.with_name("prepare.lock")
LEFT_OUT = {"ray"}  # requirements not installed under emulation (see above)
MIRROR = "http://deb.debian.org/debian"
PYTHON = "3.11"  # bookworm's python3
PLATFORMS = ("manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64")
BINFMT = Path("/proc/sys/fs/binfmt_misc")


def run(cmd: list[str], downloads: bool = False, **kw: object) -> None:
    """`downloads`: a try the network drops is made again after a pause (network_retry.py)."""
    print("emulated_wheel_check: $", " ".join(cmd), flush=True)
    if downloads:
        network_retry.run(cmd, **kw)  # type: ignore[arg-type]
    else:
        subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def install_tools() -> None:
    """qemu-user-static and debootstrap from Debian, when missing."""
    if shutil.which("qemu-aarch64-static") and shutil.which("debootstrap"):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-q"], downloads=True, env=env, stdout=subprocess.DEVNULL)
    run(["apt-get", "install", "-y", "-q", "qemu-user-static", "debootstrap"], downloads=True,
        env=env, stdout=subprocess.DEVNULL)


def register_binfmt() -> None:
    """qemu as the handler of aarch64 ELF files, with the F flag (the handler is opened now, so
    it also runs inside the chroot)."""
    if not (BINFMT / "register").exists():
        run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)])
    if (BINFMT / "qemu-aarch64").exists():
        return
    entry = Path("/usr/lib/binfmt.d/qemu-aarch64.conf").read_text().strip()
    (BINFMT / "register").write_text(entry + "\n")


def arm64_root() -> Path:
    """The Debian arm64 root with python3 and venv, made once (a root being made is built
    beside and moved into place, so an interrupted run leaves none half made)."""
    if (ROOT / "usr" / "bin" / f"python{PYTHON}").exists():
        return ROOT
    building = ROOT.with_name(ROOT.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    building.parent.mkdir(parents=True, exist_ok=True)
    run(["debootstrap", "--arch=arm64", "--variant=minbase", "--include=python3,python3-venv",
         "bookworm", str(building), MIRROR], downloads=True, stdout=subprocess.DEVNULL,
        before_again=lambda: shutil.rmtree(building, ignore_errors=True))
    building.rename(ROOT)
    return ROOT


def prepare() -> Path:
    """The tools, the handler and the root, under the lock (another run may be making them)."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        install_tools()
        register_binfmt()
        return arm64_root()


def in_root(root: Path, script: str) -> None:
    """`script` run by sh inside the root, with a clean environment and the kernel's /proc and
    /dev (tests read /proc/self/status; multiprocessing needs /dev/shm)."""
    env = ["/usr/bin/env", "-i", "PATH=/opt/venv/bin:/usr/bin:/bin", "HOME=/root",
           "LANG=C.UTF-8", "ROUTED_EXPERTS_EMULATED=1"]
    mounted = []
    try:
        for kind, where in (("proc", "proc"), ("bind", "dev"), ("bind", "dev/pts")):
            target = root / where
            target.mkdir(exist_ok=True)
            if os.path.ismount(target):
                continue
            if kind == "proc":
                run(["mount", "-t", "proc", "proc", str(target)])
            else:
                run(["mount", "--bind", f"/{where}", str(target)])
            mounted.append(target)
        run(["chroot", str(root), *env, "/bin/sh", "-ec", script])
    finally:
        for target in reversed(mounted):
            subprocess.run(["umount", "-l", str(target)], check=False)


def main() -> None:
    if os.geteuid() != 0:
        sys.exit("emulated_wheel_check: needs root (apt-get, binfmt_misc, chroot)")
    if sys.argv[1:] == ["--prepare"]:
        prepare()
        return
    dist = Path(sys.argv[1] if len(sys.argv) > 1 else "dist")
    wheels = sorted(dist.glob("routed_experts-*-abi3-*aarch64.whl"))
    if len(wheels) != 1:
        sys.exit(f"emulated_wheel_check: want one aarch64 wheel in {dist}, found {wheels}")
    began = time.monotonic()
    root = prepare()
    # What the run installs, all offline: the wheel, and the aarch64 wheels of the test tools.
    house = root / "wheelhouse"
    shutil.rmtree(house, ignore_errors=True)
    house.mkdir()
    shutil.copy(wheels[0], house)
    platforms = [f"--platform={p}" for p in PLATFORMS]
    suite = root / "suite"
    shutil.rmtree(suite, ignore_errors=True)
    suite.mkdir()
    shutil.copytree(TESTS, suite / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    # The benchmark harness its tests run (not in the wheel): beside the suite, as in a clone.
    shutil.copytree(TESTS.parent / "benches" / "rx_bench", suite / "benches" / "rx_bench",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (suite / "pytest.ini").write_text(PYTEST_INI)
    wanted = [
        line for line in (TESTS / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#") and line.strip() not in LEFT_OUT
    ]
    (suite / "requirements.txt").write_text("\n".join(wanted) + "\n")
    run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", *platforms,
         f"--python-version={PYTHON}", "-d", str(house), "-r", str(suite / "requirements.txt")],
        downloads=True)
    compilers = " ".join(COMPILERS)
    in_root(root, f"""
        for c in {compilers}; do
            if command -v $c >/dev/null; then echo "a compiler is in the root: $c"; exit 1; fi
        done
        rm -rf /opt/venv
        python3 -m venv /opt/venv
        # --no-compile: byte-compiling every module under emulation costs minutes; Python
        # compiles what the tests import as they import it.
        pip install -q --no-compile --no-index --find-links /wheelhouse \\
            {wheels[0].name.split('-')[0]} -r /suite/requirements.txt
        python -c 'import platform; assert platform.machine() == "aarch64", platform.machine()'
        routed-experts demo --tokens 1024
        cd /suite
        python -m pytest -q -m "not source_tree and not slow_under_emulation" -c pytest.ini \\
            --rootdir /suite --durations=15 tests
    """)
    print(f"emulated_wheel_check: {wheels[0].name} passed under qemu-aarch64 in "
          f"{time.monotonic() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main()
