"""What a built wheel holds, checked: the package (python/routed_experts, as git tracks it),
its compiled extension and its metadata, and nothing else. Above all no benchmark harness
(benches/rx_bench is run from a clone, never shipped). Standard library only:

    python tests/wheel_contents.py dist/routed_experts-*.whl
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "routed_experts"
# Names of the harness's modules: one in a wheel means the harness was shipped again.
HARNESS = re.compile(r"(^|/)(_?bench\w*|rx_bench|baselines|passthrough|load_client|reliability"
                     r"|sessions|proxy_command|codec)(/|\.py$)")


def tracked() -> set[str]:
    """The package's files as git tracks them (the tree's, outside a clone), wheel-relative."""
    try:
        out = subprocess.run(["git", "ls-files", f"python/{PACKAGE}"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = [p.relative_to(REPO).as_posix() for p in (REPO / "python" / PACKAGE).rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".so"]
    return {f.removeprefix("python/") for f in out}


def problems(wheel: Path, want: set[str]) -> list[str]:
    """What is wrong with `wheel`'s contents against the package's files `want`."""
    names = [n for n in zipfile.ZipFile(wheel).namelist() if not n.endswith("/")]
    found: list[str] = []
    harness = [n for n in names if HARNESS.search(n)]
    if harness:
        found.append(f"benchmark harness shipped: {harness}")
    meta = [n for n in names if n.split("/", 1)[0].endswith(".dist-info")]
    other = [n for n in names if n not in meta and not n.startswith(PACKAGE + "/")]
    if other:
        found.append(f"outside the package and its metadata: {other}")
    package = {n for n in names if n.startswith(PACKAGE + "/")}
    extension = {n for n in package if re.fullmatch(rf"{PACKAGE}/_core\.[\w.-]*(so|pyd)", n)}
    if len(extension) != 1:
        found.append(f"expected one compiled _core extension, got {sorted(extension)}")
    if package - extension - want:
        found.append(f"not tracked in python/{PACKAGE}: {sorted(package - extension - want)}")
    if want - package:
        found.append(f"tracked but missing: {sorted(want - package)}")
    return found


def main(wheels: list[str]) -> int:
    if not wheels:
        print("wheel_contents: give the wheels to check", file=sys.stderr)
        return 2
    want, bad = tracked(), 0
    for w in wheels:
        found = problems(Path(w), want)
        for f in found:
            print(f"wheel_contents: {Path(w).name}: {f}", file=sys.stderr)
        bad += bool(found)
        if not found:
            print(f"wheel_contents: {Path(w).name}: the package, its extension and metadata only")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
