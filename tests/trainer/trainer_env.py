"""The trainer tests' own Python environment, made once and kept under ~/.cache (outside the
clone), so a rerun on the same machine is quick:

    python3 tests/trainer/trainer_env.py        # prints the environment's python

megatron-core 0.19.2 (which needs CPython 3.12 or newer), transformers 5.24.0, torchtitan 0.3.0
and PyPI's torch 2.13.0 (the CUDA build: it runs on a CPU, and `import torch` needs its CUDA
libraries even there), pinned by tests/trainer/environment.txt: about 2.8 GB to download,
4.9 GB on disk, 1-3 minutes. The library itself is not installed there: the tests put the
clone's python/ first on the path, with the extension `make build-dev` built (abi3: any CPython
3.9+ loads it).

Standard library only; pip does the work.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "real" / "harness")]
import network_retry  # noqa: E402  (a dropped download is tried again)
from engine_env import python312  # noqa: E402  (one way to find CPython 3.12)

PINS = HERE / "environment.txt"
WANTED = ["megatron-core", "transformers", "torch", "pytest", "hypothesis"]
# torchtitan's own requirements are its training loop's (datasets, wandb, tensorboard,
# torchdata, ...): its model code, which rx.replay.torchtitan replays into, imports only these.
WITHOUT_DEPENDENCIES = ["torchtitan", "spmd_types", "tyro", "docstring_parser"]
CACHE = Path(os.environ.get("RX_TRAINER_CACHE", Path.home() / ".cache" / "routed_experts"))


def main() -> None:
    pins = PINS.read_bytes()
    env = CACHE / f"trainer-{hashlib.sha256(pins).hexdigest()[:12]}"
    python = env / "bin" / "python"
    if not (env / ".ready").exists():
        # On stderr: stdout's last line is the python the Makefile reads.
        print(f"make: making the trainer environment in {env} (torch, megatron-core, "
              "transformers, torchtitan: about 2.8 GB to download, 1-3 minutes; once per "
              "machine)",
              file=sys.stderr, flush=True)  # fmt: skip
        shutil.rmtree(env, ignore_errors=True)
        subprocess.run([python312(), "-m", "venv", str(env)], check=True)
        pip = [str(python), "-m", "pip", "-q", "install"]
        network_retry.run([*pip, "--upgrade", "pip"])
        network_retry.run([*pip, "-c", str(PINS), *WANTED])
        network_retry.run([*pip, "--no-deps", "-c", str(PINS), *WITHOUT_DEPENDENCIES])
        (env / ".ready").write_text("")
    print(python)


if __name__ == "__main__":
    main()
