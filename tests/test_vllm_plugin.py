"""The vLLM 0.33 plugin's rules (routed_experts/vllm_plugin.py) on a stand-in of the connector
it wraps, modelled on vLLM 0.33.0's (a hit counts the blocks the server holds, capped below the
last token): a marked request takes prefill's KV only before its routing start, and a later
request never reuses a block without routing where it needs routing. Off unless enabled; another
release is refused by name. The plugin in a real vLLM 0.33 decode server: make test-engines
(tests/real/test_live_vllm.py, its last tests)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from routed_experts import vllm_plugin

BLOCK = 4


def connector_class() -> type:
    """A fresh stand-in class (the plugin patches the class)."""

    class Connector:
        def __init__(self, held: tuple[str, ...] = (), capacity: int = 64) -> None:
            self._block_size = BLOCK
            self._kv_cached: dict[str, list[str]] = {}
            self._loading: dict[str, set[str]] = {}
            self._capacity = capacity
            self.device = set(held)  # block hashes cached on the device
            self.resets = 0

        def _kv_blocks(self, hashes: list[str]) -> Any:
            return ((h, [h]) for h in hashes)

        def _gpu_cached(self, key: str) -> bool:
            return key in self.device

        def max_cache_hit(self, request: Any) -> int:
            n = 0
            for block, keys in self._kv_blocks(request.block_hashes):
                if block not in self._kv_cached and not self._gpu_cached(keys[-1]):
                    break
                n += 1
            return min(n * BLOCK, request.num_tokens - 1)

        def cap_external_hit(self, request: Any, num_local: int, num_external: int) -> int:
            hit = num_local + num_external
            return num_external if hit % BLOCK == 0 and hit <= self.max_cache_hit(request) else 0

        def reset(self) -> None:
            self.resets += 1

    vllm_plugin.patch(Connector)
    return Connector


def request(prompt: int, start: int, marked: bool = False, blocks: int = 3) -> Any:
    return types.SimpleNamespace(
        request_id=f"r{prompt}-{start}", block_hashes=[f"b{i}" for i in range(blocks)],
        num_tokens=prompt, num_prompt_tokens=prompt, num_output_tokens=0,
        sampling_params=types.SimpleNamespace(routed_experts_prompt_start=start),
        kv_transfer_params={vllm_plugin.MARKER: True} if marked else None,
    )  # fmt: skip


def test_a_marked_request_takes_prefills_kv_before_its_routing_start() -> None:
    conn = connector_class()()
    # A fresh decode server holds nothing: unmarked, the hit is refused (vLLM 0.33's rule).
    assert conn.cap_external_hit(request(13, 12), 0, 12) == 0
    # Marked, from P - 1 = 12: the 12 loaded positions all precede the routing start.
    assert conn.cap_external_hit(request(13, 12, marked=True), 0, 12) == 12
    # Past the routing start (asked from 5), or off the block grid, it is vLLM's rule again.
    assert conn.cap_external_hit(request(13, 5, marked=True), 0, 12) == 0
    assert conn.cap_external_hit(request(13, 12, marked=True), 0, 10) == 0
    assert conn.cap_external_hit(request(13, 12, marked=True), 2, 10) == 0
    assert conn.cap_external_hit(request(13, 12, marked=True), 0, 0) == 0


def test_a_later_request_never_reuses_a_block_without_routing_where_it_needs_routing() -> None:
    conn = connector_class()()
    assert conn.cap_external_hit(request(13, 12, marked=True), 0, 8) == 8  # blocks 0 and 1
    conn.device |= {"b0", "b1"}  # the loaded blocks are cached on the device now
    # Asked from 0, a request needs rows of block 0: no reuse, the prompt is computed.
    assert conn.max_cache_hit(request(13, 0)) == 0
    # Asked from 6: block 0 (positions 0-3) may be reused, block 1 (4-7) may not.
    assert conn.max_cache_hit(request(13, 6)) == 4
    # Asked from 12 (P - 1), as the proxy asks: both.
    assert conn.max_cache_hit(request(13, 12)) == 8
    # The guard bounds an external hit through vLLM's own rule too.
    assert conn.cap_external_hit(request(13, 0), 0, 8) == 0
    # Blocks computed here (b2) keep vLLM's rule; a server without marks is unchanged.
    conn.device.add("b2")
    assert connector_class()(held=("b0", "b1", "b2")).max_cache_hit(request(13, 0)) == 12


def test_reset_forgets_the_marks_and_marks_stay_bounded() -> None:
    conn = connector_class()(capacity=2)
    conn.device.add("b0")  # of the three blocks loaded, one is still cached on the device
    assert conn.cap_external_hit(request(13, 12, marked=True), 0, 12) == 12
    # Past the capacity (3 marks, 2 allowed), the marks of blocks no request can hit again are
    # dropped (b1, b2: neither on the device, nor held, nor loading); b0 keeps its mark.
    assert set(conn.__dict__["_routed_experts_unrouted"]) == {"b0"}
    assert conn.max_cache_hit(request(13, 0)) == 0
    conn.reset()
    assert conn.resets == 1 and conn.__dict__["_routed_experts_unrouted"] == {}
    assert conn.max_cache_hit(request(13, 0)) == 4  # vLLM's own rule again


def test_it_is_off_unless_enabled_and_refuses_another_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = types.ModuleType("vllm")
    fake.__version__ = "0.32.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.delenv(vllm_plugin.ENABLE, raising=False)
    vllm_plugin.register()  # installed, not enabled: nothing
    monkeypatch.setenv(vllm_plugin.ENABLE, "1")
    with pytest.raises(RuntimeError, match="built for vLLM 0.33.0, and this is vLLM 0.32.0"):
        vllm_plugin.register()


def test_a_connector_without_what_it_wraps_is_refused_by_name() -> None:
    class Other:
        def cap_external_hit(self) -> None: ...

    with pytest.raises(RuntimeError, match="Other has no max_cache_hit, reset, _kv_blocks"):
        vllm_plugin.patch(Other)


def test_patching_twice_wraps_once() -> None:
    cls = connector_class()
    wrapped = cls.max_cache_hit
    vllm_plugin.patch(cls)
    assert cls.max_cache_hit is wrapped


def test_the_package_declares_the_entry_point_vllm_loads() -> None:
    from importlib.metadata import distribution

    # Read from the installed distribution: entry_points(group=) needs Python 3.10.
    declared = distribution("routed_experts").entry_points
    found = {e.name: e.value for e in declared if e.group == "vllm.general_plugins"}
    assert found.get("routed_experts") == "routed_experts.vllm_plugin:register"
