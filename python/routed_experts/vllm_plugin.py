"""A vLLM general plugin, for vLLM 0.33.0 only, that lets a decode server with routing on load
prefill's KV for the requests the proxy marks (docs/proxy.md, "vLLM 0.33 and P/D"; the design
and what it was read from: docs/design/vllm-0.33-pd-plugin.md).

vLLM 0.33 takes an external KV hit only for blocks whose routing the server holds, so a P/D
decode server recomputes the whole prompt. For a request whose `kv_transfer_params` carry
`"routed_experts_plugin": true`, this plugin takes the hit when every loaded position lies
before where the request's routing starts (`routed_experts_prompt_start`, which the proxy sets
to `P - 1`): such a request never asks for rows of the positions it did not compute, so its
answer is exact. The loaded blocks are remembered as holding no routing, and a later request
that would need their rows does not reuse them (it computes them): nothing is ever answered
from a block without routing, and the engine never fails reading one.

Off unless installed and enabled: the entry point (`vllm.general_plugins`, `routed_experts`)
does nothing without `ROUTED_EXPERTS_VLLM_PLUGIN=1` in the server's environment. Enabled on
another vLLM release, it stops the server at start, naming the release. It logs a line when
active. It uses only the standard library (vLLM imports it in each of its processes; the
package it sits in loads its extension there, as any `import routed_experts` does).
"""

from __future__ import annotations

import logging
import os
from typing import Any

ENABLE = "ROUTED_EXPERTS_VLLM_PLUGIN"
MARKER = "routed_experts_plugin"
RELEASE = "0.33.0"
# What the plugin wraps or reads of vLLM 0.33.0's aux output connector (scheduler side).
WRAPPED = ("cap_external_hit", "max_cache_hit", "reset")
READ = ("_kv_blocks", "_gpu_cached")
_UNROUTED = "_routed_experts_unrouted"

log = logging.getLogger("vllm.routed_experts_plugin")


def register() -> None:
    """vLLM's entry point: patch the connector when enabled; refuse another release."""
    if os.environ.get(ENABLE) != "1":
        return
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    if version.split("+")[0] != RELEASE:
        raise RuntimeError(
            f"routed_experts vLLM plugin: built for vLLM {RELEASE}, and this is vLLM {version}: "
            f"unset {ENABLE} (or install vLLM {RELEASE})"
        )
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    patch(AuxOutputSchedulerConnector)
    log.warning("routed_experts vLLM plugin active (vLLM %s, pid %d): requests marked %r take "
             "prefill's KV before their routing start", version, os.getpid(), MARKER)


def patch(cls: Any) -> None:
    """Wrap `cls`'s cap and cache-hit rules (once; the class must have what is wrapped)."""
    missing = [name for name in WRAPPED + READ if not hasattr(cls, name)]
    if missing:
        raise RuntimeError(
            f"routed_experts vLLM plugin: {cls.__name__} has no {', '.join(missing)}: not the "
            f"vLLM {RELEASE} this plugin was built for"
        )
    if getattr(cls, "_routed_experts_patched", False):
        return
    cap, max_hit, reset = cls.cap_external_hit, cls.max_cache_hit, cls.reset

    def cap_external_hit(self: Any, request: Any, num_local: int, num_external: int) -> int:
        if marked(request) and num_external > 0:
            hit, size = num_local + num_external, self._block_size
            if hit % size == 0 and num_local % size == 0 and hit <= emit_start(request):
                unrouted = _unrouted(self)
                for i, (block, keys) in enumerate(self._kv_blocks(request.block_hashes)):
                    if i >= hit // size:
                        break
                    if i >= num_local // size:
                        unrouted[block] = keys
                _forget_unreachable(self)
                log.debug("%s: %d tokens of prefill's KV taken", request.request_id,
                          num_external)  # fmt: skip
                return num_external
        return int(cap(self, request, num_local, num_external))

    def max_cache_hit(self: Any, request: Any) -> int:
        # Every hit, local or external, is bounded here: it stops at the first block that
        # holds no routing where the request needs routing.
        n = int(max_hit(self, request))
        unrouted = _unrouted(self)
        if not unrouted or n == 0:
            return n
        start, size = emit_start(request), self._block_size
        for i, (block, _) in enumerate(self._kv_blocks(request.block_hashes)):
            if i * size >= n:
                break
            if block in unrouted and (i + 1) * size > start:
                return int(i * size)
        return n

    def reset_state(self: Any) -> Any:
        _unrouted(self).clear()
        return reset(self)

    cls.cap_external_hit = cap_external_hit
    cls.max_cache_hit = max_cache_hit
    cls.reset = reset_state
    cls._routed_experts_patched = True


def marked(request: Any) -> bool:
    """Whether the proxy marked the request (`kv_transfer_params`' `routed_experts_plugin`)."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and params.get(MARKER) is True


def emit_start(request: Any) -> int:
    """The first position whose routing the request returns: its routing start, within its
    prompt, or its last token once it has output (as vLLM 0.33's connector computes it)."""
    start = min(request.sampling_params.routed_experts_prompt_start, request.num_prompt_tokens)
    return int(max(start, 0 if request.num_output_tokens == 0 else request.num_tokens - 1))


def _unrouted(conn: Any) -> dict[Any, Any]:
    """The blocks loaded without routing, with their block hashes."""
    found: dict[Any, Any] | None = conn.__dict__.get(_UNROUTED)
    if found is None:
        found = conn.__dict__[_UNROUTED] = {}
    return found


def _forget_unreachable(conn: Any) -> None:
    """Past the connector's own capacity, drop the marks of blocks no request can hit again
    (neither cached on the device, nor held by the connector, nor being loaded): such a block
    comes back only computed (with routing) or loaded again (marked again)."""
    unrouted = _unrouted(conn)
    if len(unrouted) <= conn._capacity:
        return
    loading = set().union(*conn._loading.values())
    for block, keys in list(unrouted.items()):
        if block not in conn._kv_cached and block not in loading and not conn._gpu_cached(keys[-1]):
            del unrouted[block]
