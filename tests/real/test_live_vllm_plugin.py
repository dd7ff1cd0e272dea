"""The project's vLLM plugin (routed_experts/vllm_plugin.py) in a real vLLM 0.33 decode server
with routing on (`make test-engines`): a prefill server saves a prompt's KV through vLLM's
ExampleConnector; the decode server, with the plugin found through its entry point and
enabled, loads it for a request marked as the proxy marks it, and answers exactly as one
server answering the prompt alone does. Requests that would need the loaded blocks' routing
are answered right (the blocks are computed again), and the server stays up. Skipped for other
releases, which the plugin refuses (tests/test_vllm_plugin.py)."""

from __future__ import annotations

import base64
import io
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HARNESS = Path(__file__).resolve().parent / "harness"
sys.path.insert(0, str(HARNESS))

import engine  # noqa: E402
import tiny_model  # noqa: E402

from routed_experts import vllm_plugin  # noqa: E402

PYTHON = Path(os.environ["RX_VLLM_PYTHON"])
RELEASE = os.environ["RX_VLLM_RELEASE"]
REPO = HARNESS.parents[2]
# 71 tokens with a last word: decode can load two full 32-token blocks, all before its routing
# start (70).
LONG = " ".join(tiny_model.WORDS[i % 24] for i in range(66))

pytestmark = pytest.mark.skipif(
    not RELEASE.startswith(vllm_plugin.RELEASE), reason=f"the plugin is for vLLM {RELEASE}"
)


class PluginServer(engine.Server):
    """A server whose environment finds the plugin by its entry point (a `.dist-info` folder
    beside the clone's python/, as an installed wheel has it) and enables it."""

    found: Path

    def environment(self) -> dict[str, str]:
        env = super().environment()
        path = [str(self.found), str(REPO / "python"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        env[vllm_plugin.ENABLE] = "1"
        return env


def entry_point(folder: Path) -> Path:
    """What a wheel's metadata holds for the plugin: its `vllm.general_plugins` entry point."""
    info = folder / "routed_experts_vllm_plugin-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: routed-experts-vllm-plugin\n"
                                   "Version: 0\n")  # fmt: skip
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nrouted_experts = routed_experts.vllm_plugin:register\n"
    )
    return folder


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[engine.Server, PluginServer, Path]]:
    with tempfile.TemporaryDirectory(prefix="rx-plugin-") as tmp:
        work = Path(tmp)
        model = work / "tiny-e8"
        import subprocess

        subprocess.run([str(PYTHON), str(HARNESS / "tiny_model.py"), str(model)], check=True)
        kv = work / "kv"
        prefill = engine.Server(PYTHON, RELEASE, model, work / "prefill.log", kv_share=kv,
                                kv_role="kv_producer")  # fmt: skip
        decode = PluginServer(PYTHON, RELEASE, model, work / "decode.log", kv_share=kv,
                              kv_role="kv_consumer")  # fmt: skip
        decode.found = entry_point(work / "plugin")
        try:
            prefill.start()
            decode.start()
            prefill.wait_ready()
            decode.wait_ready()
            yield prefill, decode, work
        finally:
            prefill.stop()
            decode.stop()


def ask(server: engine.Server, prompt: str, **body: Any) -> dict[str, Any]:
    status, raw, _ = engine.post(server.url + "/v1/completions", {
        "model": "tiny", "prompt": prompt, "temperature": 0, "return_token_ids": True, **body})
    assert status == 200, raw[:2000]
    return dict(json.loads(raw))


def rows(answer: dict[str, Any]) -> np.ndarray:
    text = answer["choices"][0]["routed_experts"]
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def cached(answer: dict[str, Any]) -> int:
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def test_a_marked_decode_loads_prefills_kv_and_answers_as_one_server(
    servers: tuple[engine.Server, PluginServer, Path],
) -> None:
    prefill, decode, work = servers
    log = (work / "decode.log").read_text(errors="replace")
    plugin_lines = [line for line in log.splitlines() if "plugin" in line.lower()]
    assert any("routed_experts vLLM plugin active" in line for line in plugin_lines), plugin_lines
    for i, prompt in enumerate([LONG + " alpha", LONG + " beta"]):
        # Prefill saves the prompt's KV (as the proxy asks it: one token, remote decode).
        first = ask(prefill, prompt, max_tokens=1,
                    kv_transfer_params={"do_remote_decode": True})  # fmt: skip
        p = len(first["choices"][0].get("prompt_token_ids") or first["prompt_token_ids"])
        blocks = (p - 2) // 32 * 32  # ExampleConnector's hit: whole blocks before P - 1
        assert blocks == 64, p
        # The oracle: the prefill server answers the prompt alone, from 0 (its KV recomputed,
        # since a producer never loads).
        alone = ask(prefill, prompt, max_tokens=5)
        # Decode, marked and asked from P - 1 as the proxy asks: the two blocks before it load.
        params = {**(first.get("kv_transfer_params") or {}), vllm_plugin.MARKER: True}
        got = ask(decode, prompt, max_tokens=5, routed_experts_prompt_start=p - 1,
                  kv_transfer_params=params)  # fmt: skip
        assert cached(got) == blocks, got.get("usage")
        assert got["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
        np.testing.assert_array_equal(rows(got), rows(alone)[p - 1 :])
        # The same prompt again, unmarked: from P - 1 the loaded blocks may serve (their
        # routing is not asked); from 0 they may not, and the prompt is computed, exactly.
        again = ask(decode, prompt, max_tokens=5, routed_experts_prompt_start=p - 1)
        np.testing.assert_array_equal(rows(again), rows(alone)[p - 1 :])
        whole = ask(decode, prompt, max_tokens=5)
        assert cached(whole) == 0, whole.get("usage")
        np.testing.assert_array_equal(rows(whole), rows(alone))
        assert whole["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
        assert decode.alive(), f"decode died on prompt {i}; see {work / 'decode.log'}"
    # Unmarked, a prompt whose KV prefill saved (a prefix decode has not seen) is recomputed,
    # as vLLM 0.33 does on its own.
    prompt = "gamma " + LONG
    first = ask(prefill, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    p = len(first["choices"][0].get("prompt_token_ids") or first["prompt_token_ids"])
    plain = ask(decode, prompt, max_tokens=5, routed_experts_prompt_start=p - 1,
                kv_transfer_params=first.get("kv_transfer_params"))  # fmt: skip
    assert cached(plain) == 0, plain.get("usage")


def test_the_prefill_server_without_the_plugin_is_left_as_it_is(
    servers: tuple[engine.Server, PluginServer, Path],
) -> None:
    prefill, _, work = servers
    assert "routed_experts vLLM plugin" not in (work / "prefill.log").read_text(errors="replace")


def test_through_the_proxy_marking_decode_the_answer_is_one_servers(
    servers: tuple[engine.Server, PluginServer, Path],
) -> None:
    # The proxy with --vllm-plugin mark: prefill asked for one token, decode marked and asked
    # from P - 1; the merged answer is the answer of the prefill server alone, and decode's
    # usage says it loaded the prompt.
    import routed_experts as rx
    from routed_experts.proxy import ProxyConfig, ProxyServer

    prefill, decode, _ = servers
    with ProxyServer([prefill.url], [decode.url], ProxyConfig(vllm_plugin="mark")) as proxy:
        for n, prompt in [(1, "delta " + LONG), (2, "epsilon " + LONG)]:
            # Sampled with a seed (vLLM takes no greedy n > 1): one server given the same
            # request answers the same choices.
            sampling = {"max_tokens": 5, "n": n, "temperature": 1.0, "seed": 7}
            body = {"model": "tiny", "prompt": prompt, "return_token_ids": True, **sampling}
            status, raw, _ = engine.post(proxy.url + "/v1/completions", body)
            assert status == 200, raw[:2000]
            answer = json.loads(raw)
            alone_raw = engine.post(prefill.url + "/v1/completions", body)[1]
            alone = json.loads(alone_raw)
            assert len(answer["choices"]) == n
            for choice in range(n):
                got, want = rx.from_response(raw, choice=choice), rx.from_response(alone_raw,
                                                                                   choice=choice)
                assert got is not None and want is not None
                np.testing.assert_array_equal(got.to_numpy(), want.to_numpy())
                tokens = answer["choices"][choice]["token_ids"]
                assert tokens == alone["choices"][choice]["token_ids"]
            assert cached(answer) >= 64, answer.get("usage")
    assert decode.alive()
