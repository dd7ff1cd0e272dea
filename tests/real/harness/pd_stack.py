"""Two real vLLM servers in prefill/decode, joined by vLLM's ExampleConnector over a shared
folder, behind the project's proxy: the stack the live tests send requests to
(tests/real/test_live_vllm.py, tests/real/test_live_vllm_r3.py). Runs in the project's environment;
the servers run in the engine's.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import engine
import httpx
import tiny_model

from routed_experts.proxy import ProxyServer

HARNESS = Path(__file__).resolve().parent
REPO = HARNESS.parents[2]


def plugin_env(folder: Path) -> dict[str, str]:
    """A server environment that finds the project's vLLM plugin by its entry point (a
    `.dist-info` folder in `folder`, as an installed wheel's metadata has it, beside the
    clone's python/) and enables it."""
    info = folder / "routed_experts_vllm_plugin-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: routed-experts-vllm-plugin\n"
                                   "Version: 0\n")  # fmt: skip
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nrouted_experts = routed_experts.vllm_plugin:register\n"
    )
    return {"PYTHONPATH": os.pathsep.join([str(folder), str(REPO / "python")]),
            "ROUTED_EXPERTS_VLLM_PLUGIN": "1"}  # fmt: skip


class Stack:
    """The tiny model made in `work` (`model_args`: tiny_model.py's flags), served by a prefill
    and a decode server (`serve_args`: more vLLM flags, such as another `--dtype`)."""

    def __init__(
        self, python: Path, release: str, work: Path, model_args: list[str] | None = None,
        serve_args: list[str] | None = None, decode_env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.work = work
        self.python = python
        self.model = work / "tiny-e8"
        subprocess.run(
            [str(python), str(HARNESS / "tiny_model.py"), str(self.model), *(model_args or [])],
            check=True,
        )
        kv = work / "kv"
        extra = list(serve_args or [])
        self.prefill = engine.Server(python, release, self.model, work / "prefill.log",
                                     extra=extra, kv_share=kv, kv_role="kv_producer")  # fmt: skip
        self.decode = engine.Server(python, release, self.model, work / "decode.log",
                                    extra=extra, kv_share=kv, kv_role="kv_consumer",
                                    env=decode_env)  # fmt: skip
        self.proxy: ProxyServer | None = None

    def start(self) -> None:
        for s in (self.prefill, self.decode):
            s.start()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.wait_ready(), (self.prefill, self.decode)))
        self.proxy = ProxyServer([self.prefill.url], [self.decode.url]).__enter__()

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.__exit__(None, None, None)
        for s in (self.prefill, self.decode):
            s.stop()

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def logs(self) -> str:
        tail = []
        for name in ("prefill.log", "decode.log"):
            text = (self.work / name).read_text(errors="replace").splitlines()
            tail.append(f"--- {name} ---\n" + "\n".join(text[-30:]))
        return "\n".join(tail)

    def r3_loop(self, dtype: str, count: int, tokens: int, tag: str = "r3") -> dict[str, Any]:
        """The R3 loop over this stack: `count` greedy completions of `tokens` tokens through
        the proxy (prompts of 60 to 60 + 5 x count words, each new from its first word, the
        sampled tokens' log-probs asked), then r3_loop.py's figures, from the engine's
        environment with the clone's python/ on the path, the model read in `dtype`."""
        words = tiny_model.WORDS
        paths = []
        for i in range(count):
            prompt = f"{tag} {i} " + " ".join(
                words[(i * 7 + j * 3 + j * j) % len(words)] for j in range(60 + 5 * i)
            )
            body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens,
                    "min_tokens": tokens, "temperature": 0, "logprobs": 1,
                    "return_token_ids": True}  # fmt: skip
            r = httpx.post(self.url + "/v1/completions", json=body, timeout=300)
            if r.status_code != 200:
                raise AssertionError(f"{r.status_code}: {r.text}\n{self.logs()}")
            path = self.work / f"{tag}-{dtype}-{i}.json"
            path.write_bytes(r.content)
            paths.append(str(path))
        env = {**os.environ, "PYTHONPATH": str(REPO / "python"), "OMP_NUM_THREADS": "1"}
        out = subprocess.run(
            [str(self.python), str(HARNESS / "r3_loop.py"), str(self.model), dtype, *paths],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        if out.returncode != 0:
            raise AssertionError(out.stderr[-4000:])
        return dict(json.loads(out.stdout))

