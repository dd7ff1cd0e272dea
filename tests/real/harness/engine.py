"""A real vLLM server, started from an engine environment and stopped with its whole process
group. The flags and environment that make vLLM's CPU build return routing here (2 cores, no
GPU) are in one place: `SERVE_FLAGS`, `serve_env`.

Used by the recorder (`record.py`, in the engine environment) and by the live test (from the
project's environment): standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

# The flags every release that returns routing over HTTP needs here: float32 (the CPU kernels'
# bfloat16 path needs AVX-512 BF16), eager mode (no graph capture on CPU), prefix caching and
# routed-expert capture; a block size that lets a 70-token prompt move two full blocks in P/D.
SERVE_FLAGS = [
    "--dtype", "float32",
    "--block-size", "32",
    "--enforce-eager",
    "--enable-prefix-caching",
    "--enable-return-routed-experts",
    "--enable-prompt-tokens-details",
    "--max-model-len", "1024",
    "--served-model-name", "tiny",
]  # fmt: skip


def release_flags(release: str) -> list[str]:
    """Flags of one release: 0.30 on serve `/inference/v1/generate` only with
    `--enable-scale-out` (before 0.30 the flag does not exist, and stops the server: 0.25 to
    0.29 serve generate among the scale-out endpoints, 0.21 to 0.24 among the disaggregated
    ones, without asking)."""
    major, minor = (int(x) for x in release.split(".")[:2])
    return ["--enable-scale-out"] if (major, minor) >= (0, 30) else []


# A recording-only `sitecustomize` (see its docstring), loaded in the servers of the releases
# that need one of its parts: `vllm_cpu_version` where the release asks for a distribution
# named `vllm` before it trusts Triton (0.28 to 0.31), `interp_log1p` where Model Runner V2's
# random sampler calls libdevice's log1p, which Triton's interpreter lacks (0.28 to 0.30),
# `cpu_experts_capture` where Model Runner V2 refuses the CPU MoE kernel as unable to report
# routing (0.28, 0.29), `cpu_routing` where the V1 runner captures and the CPU MoE kernel
# picks the experts itself, never reporting them to the capture (before 0.28), `fp32_no_amx`
# where the CPU MoE kernel cannot run float32 weights on a CPU with AMX (0.21 to 0.24, 0.27).
HOOK = Path(__file__).resolve().parent / "recording_hook"
HOOK_NOTES = {
    "vllm_cpu_version": "importlib.metadata.version('vllm') answers vllm-cpu's version + "
    "'+cpu' (as 0.32 asks itself), so the release finds Triton and runs Model Runner V2",
    "interp_log1p": "Triton's interpreter given a libdevice log1p (an 8-term series, as "
    "0.32's sampler has its own), which Model Runner V2's random sampler calls",
    "cpu_experts_capture": "the CPU MoE kernel (CPUUnquantizedExperts) declared able to "
    "report routing, and its own top-k ids handed to the capture function Model Runner V2 "
    "binds to it (the release refuses to start otherwise; no vLLM file changed)",
    "fp32_no_amx": "the CPU MoE kernel's grouped-gemm check told there is no AMX, so it "
    "takes its float32 vector path (with AMX, 0.27 refuses float32 weights; 0.21 to 0.24 fall "
    "to a per-expert torch path that dies building its activation outside a vLLM config)",
    "cpu_routing": "the CPU MoE kernel's own top-k ids handed to the release's routed-experts "
    "capture, which its CPU path skips (no vLLM file changed)",
}


def _minor(release: str) -> tuple[int, int]:
    major, minor = (int(x) for x in release.split(".")[:2])
    return major, minor


def v2_model_runner(release: str) -> bool:
    """Model Runner V2 captures routing from 0.28 on; before, only the V1 runner does (V2
    refuses `--enable-return-routed-experts`, or has no capture)."""
    return _minor(release) >= (0, 28)


def hooks(release: str) -> list[str]:
    """The parts of the recording hook a server of `release` loads (none for 0.32)."""
    if _minor(release) >= (0, 32):
        return []
    if _minor(release) >= (0, 31):
        return ["vllm_cpu_version"]
    if _minor(release) >= (0, 30):
        return ["vllm_cpu_version", "interp_log1p"]
    if _minor(release) >= (0, 28):
        return ["vllm_cpu_version", "interp_log1p", "cpu_experts_capture"]
    if _minor(release) in ((0, 25), (0, 26)):
        return ["cpu_routing"]
    return ["cpu_routing", "fp32_no_amx"]


def hook_note(release: str) -> str | None:
    """What the recording hook does for `release`, or None where it is not loaded."""
    parts = hooks(release)
    if not parts:
        return None
    return "recording_hook/sitecustomize.py: " + "; ".join(HOOK_NOTES[p] for p in parts)


def pd_skipped(release: str) -> str | None:
    """Why P/D is not recorded for `release` on this CPU, where the release would start it
    (0.22 to 0.30 refuse routed experts with any KV connector at start; the recorder notes
    that from the server's own error)."""
    if _minor(release) <= (0, 21):
        return (
            "0.21's ExampleConnector cannot move KV on a CPU: start_load_kv calls .cuda() on "
            "every block it reads (the decode engine dies: no NVIDIA driver), and its "
            "save/inject index the cache as [2, pages, page_size, ...] while the CPU backend's "
            "is [2, blocks, kv_heads, block_size, head_size], so a decode server whose block "
            "ids differ from prefill's gets misplaced KV and routing unlike the model's"
        )
    return None


def serve_env(release: str) -> dict[str, str]:
    """The environment for a server of `release`: Model Runner V2 (which captures routing from
    0.28 on) with Triton's interpreter behind the do-nothing "cpu" backend, a 1 GiB KV cache,
    one thread, no hub; before 0.28, the V1 runner. The recording hook's parts where the
    release needs them (`hooks`)."""
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TRITON_INTERPRET="1",
        VLLM_USE_V2_MODEL_RUNNER="1" if v2_model_runner(release) else "0",
    )
    if hooks(release):
        env["RX_RECORDING_HOOKS"] = ",".join(hooks(release))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(HOOK), env.get("PYTHONPATH", "")) if p
        )
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`python -m vllm.entrypoints.openai.api_server` on a loopback port (the `vllm` console
    script asks for a distribution named `vllm`; the CPU build is `vllm-cpu`)."""

    def __init__(
        self,
        python: Path,
        release: str,
        model: Path,
        log: Path,
        extra: list[str] | None = None,
        kv_share: Path | None = None,
        kv_role: str = "kv_both",
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.python, self.release, self.model, self.log = python, release, model, log
        self.env = dict(env or {})  # more of the server's environment; PYTHONPATH goes first
        self.port = port or free_port()
        self.args = [*SERVE_FLAGS, *release_flags(release), *(extra or [])]
        if kv_share is not None:
            # P/D on CPU: vLLM's ExampleConnector over a shared folder (Nixl, Mooncake and
            # MoRIIO refuse routed experts). Prefill only saves (`kv_producer`): a prefill
            # server that loads a prompt's blocks from the folder computes no routing for them,
            # and vLLM 0.32 dies when asked for it from 0, as a decode server does.
            cfg = {
                "kv_connector": "ExampleConnector",
                "kv_role": kv_role,
                "kv_connector_extra_config": {"shared_storage_path": str(kv_share)},
            }
            self.args += ["--kv-transfer-config", json.dumps(cfg)]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # The engine's name in messages; the command and environment that serve it (another
    # engine's server overrides these three).
    name = "vLLM"

    def command(self) -> list[str]:
        server = "vllm.entrypoints.openai.api_server"
        where = ["--host", "127.0.0.1", "--port", str(self.port)]
        return [str(self.python), "-m", server, "--model", str(self.model), *where, *self.args]

    def environment(self) -> dict[str, str]:
        env = serve_env(self.release)
        for key, value in self.env.items():
            before = env.get(key, "") if key == "PYTHONPATH" else ""
            env[key] = os.pathsep.join(p for p in (value, before) if p)
        return env

    def start(self) -> Server:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "ab")  # noqa: SIM115 (the child holds it)
        self.proc = subprocess.Popen(
            self.command(), stdout=out, stderr=subprocess.STDOUT, env=self.environment(),
            start_new_session=True, cwd=str(self.log.parent),
        )  # fmt: skip
        out.close()
        return self

    def wait_ready(self, timeout: float = 600) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} {self.release} exited ({self.proc.returncode}); see {self.log}"
                )
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise TimeoutError(
            f"{self.name} {self.release} not ready in {timeout:.0f} s; see {self.log}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        self.proc = None

    def __enter__(self) -> Server:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def post(url: str, body: Any, timeout: float = 300) -> tuple[int, bytes, str]:
    """POST JSON; the status, the raw body and its content type (errors included)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), r.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers.get("content-type", "")
