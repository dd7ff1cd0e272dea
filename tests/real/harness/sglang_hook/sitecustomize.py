"""A recording-only start-up shim for SGLang releases on this CPU (no NVIDIA driver).

Its parts, chosen per release by `sglang_engine.hooks` (RX_SGLANG_HOOKS):

`unpinned_host_memory` (0.5.7 to 0.5.19): SGLang's routed-experts capture keeps its host copy
of every token's routing in a buffer it allocates with `pin_memory=True`
(`srt/state_capturer/base.py`, `BaseHostCache`, 0.5.12 to 0.5.19;
`srt/layers/moe/routed_experts_capturer.py` before).
Pinning asks the CUDA driver for page-locked memory, which fails without one ("Found no
NVIDIA driver"), so `--enable-return-routed-experts` stops the CPU engine at start. Here
`torch.zeros`, `torch.empty`, `torch.ones`, `torch.full` and `torch.tensor` are given a
wrapper that, only while `torch.cuda.is_available()` is False, drops `pin_memory=True` from
the call: the same buffer, the same values, ordinary CPU memory (pinning only makes a
device-to-host copy asynchronous; on the CPU engine there is none). Each call site that had
its pin dropped is logged once (`rx-sglang-hook: ...`) to the server's log.

`unregistered_host_memory` (0.5.20 on): the host buffer is allocated through
`srt/mem_cache/pool_host/common.py`'s `ALLOC_MEMORY_FUNCS` (`alloc_with_host_register`, the
default for every device but NPU, MUSA and XPU), which registers it with `cudaHostRegister`
(`torch.cuda.cudart()`, no driver here) when asked for `pin_memory`. The module's
`alloc_with_host_register` is wrapped to pass `pin_memory=False` while CUDA is unavailable:
the same allocation (the release's own allocator), unregistered.

`sgl_kernel_cpu_ops` (releases that import the `sgl_kernel` package on a CPU at start: up to
0.5.11, whose `srt/mem_cache/memory_pool_host.py` imports `sgl_kernel.kvcacheio` on every
device but NPU, XPU and MPS; and 0.5.16 on, which import SGLang's CPU kernels from it when the
CPU engine runs: `sglang/kernels/ops/kvcache/cache_move.py`, `copy_all_layer_kv_cache_cpu`;
`srt/mem_cache/allocation.py`, `assign_req_to_token_pool_cpu`). PyPI's `sgl-kernel` and
`sglang-kernel` wheels hold only CUDA builds: `import sgl_kernel` raises ImportError
(`libcuda.so.1`, no `common_ops`), and the server stops before it starts. Where the real package
fails to import, `sgl_kernel` is a stand-in module: `assign_req_to_token_pool_cpu` in plain
torch, doing what the release's own Triton kernel for other devices does
(`assign_req_to_token_pool`: each request's new KV slots written into its row of the
request-to-token table); the other CPU kernels these releases import raise if ever called;
any other name is missing, as it is from the failed real package (an ImportError where a
release imports it, which its GPU-only paths expect here). The package's pure-Python
submodules (`sgl_kernel.kvcacheio`: wrappers that call `torch.ops.sgl_kernel` only when used,
for the hierarchical cache, off here) import as they are. Routing capture and its
serialisation are the release's own.

`sgl_kernel_any_name` (with `sgl_kernel_cpu_ops`, for 0.5.7, 0.5.8 and 0.5.16 on): these
import kernels from `sgl_kernel` at start for modules the CPU engine imports and, serving one
request at a time without speculative decoding, never calls (0.5.8:
`srt/layers/moe/moe_runner/deep_gemm.py`, `from sgl_kernel import silu_and_mul` on every
device but NPU and HIP; 0.5.19: `srt/speculative/eagle_utils.py`,
`build_tree_kernel_efficient_cpu` and `verify_tree_greedy_cpu` on CPU). There the stand-in
gives any name asked for, as an op that raises if it is ever called: a start-up import
succeeds, a call fails loudly, nothing is computed by a stand-in but
`assign_req_to_token_pool_cpu`.

No SGLang file is changed: the server gets this folder on its PYTHONPATH and the parts in
RX_SGLANG_HOOKS (`sglang_engine.serve_env`), so `sitecustomize` is imported at start by the
server and by every process it spawns; each patch is applied when its module is imported.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
from typing import Any, Callable

PARTS = {p for p in os.environ.get("RX_SGLANG_HOOKS", "").split(",") if p}
_SEEN: set[str] = set()


def _say(msg: str) -> None:
    print(f"rx-sglang-hook: {msg}", file=sys.stderr, flush=True)


def _unpin(torch: Any) -> None:
    def wrap(name: str) -> None:
        orig = getattr(torch, name)

        @functools.wraps(orig)
        def factory(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("pin_memory") and not torch.cuda.is_available():
                kwargs["pin_memory"] = False
                f = sys._getframe(1)
                where = f"{f.f_code.co_filename.split('site-packages/')[-1]}:{f.f_lineno}"
                if where not in _SEEN:
                    _SEEN.add(where)
                    _say(f"torch.{name}(pin_memory=True) at {where}: allocated unpinned")
            return orig(*args, **kwargs)

        setattr(torch, name, factory)

    for name in ("zeros", "empty", "ones", "full", "tensor"):
        wrap(name)
    _say("pin_memory dropped from torch factories while CUDA is unavailable")


def _assign_req_to_token_pool_cpu(
    req_pool_indices: Any,
    req_to_token: Any,
    start_offset: Any,
    end_offset: Any,
    out_cache_loc: Any,
    pool_len: int,
) -> None:
    """`req_to_token[req_pool_indices[i], start[i]:end[i]]` = request i's run of
    `out_cache_loc` (the runs in request order), as `assign_req_to_token_pool` does."""
    if "assign" not in _SEEN:
        _SEEN.add("assign")
        _say("sgl_kernel.assign_req_to_token_pool_cpu: the plain-torch stand-in called")
    offset = 0
    for i in range(int(req_pool_indices.numel())):
        s, e = int(start_offset[i]), int(end_offset[i])
        row = int(req_pool_indices[i])
        req_to_token[row, s:e] = out_cache_loc[offset : offset + e - s].to(req_to_token.dtype)
        offset += e - s


def _not_here(name: str) -> Callable[..., Any]:
    def op(*_a: Any, **_k: Any) -> Any:
        raise NotImplementedError(f"rx-sglang-hook: sgl_kernel.{name} has no stand-in")

    return op


STANDINS: dict[str, Callable[..., Any]] = {
    "assign_req_to_token_pool_cpu": _assign_req_to_token_pool_cpu,
    **{
        n: _not_here(n)
        for n in (
            "copy_all_layer_kv_cache_cpu",
            "assign_extend_cache_locs_cpu",
            "fill_accept_out_cache_loc_cpu",
            "fill_bonus_tokens_cpu",
            "assign_draft_cache_locs_contiguous_cpu",
            "build_draft_decode_metadata_cpu",
        )
    },
}


def _sgl_kernel_or_standin(module: Any, run: Callable[[Any], None]) -> None:
    try:
        run(module)
        return
    except ImportError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
    module.__dict__.update(STANDINS)

    def missing(name: str) -> Any:
        if name.startswith("__") or "sgl_kernel_any_name" not in PARTS:
            raise AttributeError(f"sgl_kernel stand-in has no {name!r} (the real one: {reason})")
        op = _not_here(name)  # imported at start by a module the CPU engine never calls
        setattr(module, name, op)
        return op

    module.__getattr__ = missing
    _say(f"sgl_kernel did not import ({reason}): a stand-in with {sorted(STANDINS)}")


def _unregister(mod: Any) -> None:
    import torch

    orig = mod.alloc_with_host_register

    @functools.wraps(orig)
    def alloc_with_host_register(*args: Any, **kwargs: Any) -> Any:
        if not torch.cuda.is_available():
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            elif len(args) >= 4 and args[3]:
                args = (*args[:3], False, *args[4:])
        return orig(*args, **kwargs)

    mod.alloc_with_host_register = alloc_with_host_register
    _say("alloc_with_host_register: no cudaHostRegister while CUDA is unavailable")


PATCHES: dict[str, Callable[[Any], None]] = {}
WRAPS: dict[str, Callable[[Any, Callable[[Any], None]], None]] = {}
if "sgl_kernel_cpu_ops" in PARTS:
    WRAPS["sgl_kernel"] = _sgl_kernel_or_standin
if "unpinned_host_memory" in PARTS:
    PATCHES["torch"] = _unpin
if "unregistered_host_memory" in PARTS:
    PATCHES["sglang.srt.mem_cache.pool_host.common"] = _unregister


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the patched modules with the other finders and patches them once executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch, wrap = PATCHES.get(name), WRAPS.get(name)
        if patch is None and wrap is None:
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
            if wrap is not None:
                wrap(module, run)
                return
            run(module)
            try:
                patch(module)  # type: ignore[misc]
            except Exception as e:  # a failed patch must say so, not stop the server
                _say(f"patching {name} failed: {e!r}")

        loader.exec_module = exec_module
        return spec


if PATCHES or WRAPS:
    sys.meta_path.insert(0, _Finder())
