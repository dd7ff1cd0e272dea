"""A real SGLang server, started from an engine environment (`engine_env.py sglang RELEASE`)
and stopped with its whole process group: SGLang's CPU engine on plain-torch kernels, one
thread, float32, the torch-native attention backend, routed-experts capture on. The flags and
environment are in one place: `SERVE_FLAGS`, `serve_env`.

Used by the recorder (`record_sglang.py`, in the engine environment) and by the live test
(from the project's environment): standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

import engine

# The CPU engine's device and attention backend (no CUDA kernels), float32 (the tiny model's
# weights; bfloat16 on this CPU would need AMX kernels SGLang builds only from source), no
# overlap scheduler (it needs CUDA streams), a small KV pool (the tiny model needs little; the
# default fraction of the host's memory is gigabytes), no warm-up request, routing capture on.
SERVE_FLAGS = [
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-overlap-schedule",
    "--dtype", "float32",
    "--mem-fraction-static", "0.05",
    "--max-total-tokens", "4096",
    "--max-running-requests", "8",
    "--skip-server-warmup",
    "--enable-return-routed-experts",
    "--served-model-name", "tiny",
]  # fmt: skip

HOOK = Path(__file__).resolve().parent / "sglang_hook"
HOOK_NOTES = {
    "unpinned_host_memory": "pin_memory=True dropped from torch's factories while CUDA is "
    "unavailable, so the routed-experts host buffer (allocated pinned) is ordinary CPU memory "
    "(without a driver pinning fails and routing capture stops the server at start)",
    "unregistered_host_memory": "srt/mem_cache/pool_host/common.py's alloc_with_host_register "
    "called with pin_memory=False while CUDA is unavailable, so the routed-experts host buffer "
    "is not registered with cudaHostRegister (no driver: the server stops at start)",
    "sgl_kernel_cpu_ops": "where the CUDA-only sgl_kernel package fails to import, a stand-in "
    "module with assign_req_to_token_pool_cpu in plain torch (what the release's Triton "
    "assign_req_to_token_pool does) and the other CPU kernels it imports raising if called "
    "(the release imports them at start; no SGLang file changed)",
    "sgl_kernel_any_name": "the sgl_kernel stand-in answers any name the release imports "
    "from it at start with an op that raises if called (0.5.8 imports GPU kernels such as "
    "silu_and_mul, 0.5.19 speculative-decoding CPU kernels such as "
    "build_tree_kernel_efficient_cpu, at start for modules its CPU engine never calls here)",
}


def release_tuple(release: str) -> tuple[int, int, int]:
    parts = release.split(".")
    return int(parts[0]), int(parts[1]), int(parts[2].split("post")[0].rstrip("."))


def hooks(release: str) -> list[str]:
    """The parts of the start-up shim a server of `release` loads: `unpinned_host_memory`
    up to 0.5.19 (the capture's host buffer allocated pinned), `unregistered_host_memory`
    from 0.5.20 (registered with cudaHostRegister instead); `sgl_kernel_cpu_ops` where the
    server imports the `sgl_kernel` package at start on a CPU: up to 0.5.11
    (`sgl_kernel.kvcacheio`, seen on 0.5.8 and 0.5.10; 0.5.15 imports it on CUDA and HIP
    only) and 0.5.16 on (its CPU kernels); `sgl_kernel_any_name` where it imports kernels it
    never calls here (0.5.8 and earlier, 0.5.16 on)."""
    v = release_tuple(release)
    parts = ["unpinned_host_memory"] if v < (0, 5, 20) else ["unregistered_host_memory"]
    if v < (0, 5, 12) or v >= (0, 5, 16):
        parts.append("sgl_kernel_cpu_ops")
    if v < (0, 5, 9) or v >= (0, 5, 16):
        parts.append("sgl_kernel_any_name")
    return parts


def hook_note(release: str) -> str | None:
    parts = hooks(release)
    if not parts:
        return None
    return "sglang_hook/sitecustomize.py: " + "; ".join(HOOK_NOTES[p] for p in parts)


def serve_env(release: str) -> dict[str, str]:
    """The environment of a server of `release`: SGLang's CPU engine, one OpenMP thread, no
    hub, the shim's parts (`hooks`)."""
    env = dict(os.environ)
    env.update(
        SGLANG_USE_CPU_ENGINE="1",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        DO_NOT_TRACK="1",
        SGLANG_DISABLE_REQUEST_LOGGING="1",
    )
    if hooks(release):
        env["RX_SGLANG_HOOKS"] = ",".join(hooks(release))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HOOK), env.get("PYTHONPATH", "")) if p)
    return env


class Server(engine.Server):
    """`python -m sglang.launch_server` on a loopback port."""

    def __init__(
        self,
        python: Path,
        release: str,
        model: Path,
        log: Path,
        extra: list[str] | None = None,
        port: int | None = None,
    ) -> None:
        super().__init__(python, release, model, log, port=port)
        self.args = [*SERVE_FLAGS, *(extra or [])]

    name = "SGLang"

    def command(self) -> list[str]:
        where = ["--host", "127.0.0.1", "--port", str(self.port)]
        return [str(self.python), "-m", "sglang.launch_server", "--model-path", str(self.model),
                *where, *self.args]  # fmt: skip

    def environment(self) -> dict[str, str]:
        return serve_env(self.release)


post = engine.post
