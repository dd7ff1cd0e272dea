"""What every framework's replay context shares (format.md §6.2): the rows a model's routers
replay, described once (`RouterRows`); their ids made where the model is; the rows replayed
(`.replayed`); the flip counter (`stats`, `reset_stats`); the hooks, removed on exit.

A framework is a subclass that finds its routers and hands them ids (docs/architecture.md,
"Adding a trainer framework"): it builds a `RouterRows`, calls `ReplayContext.__init__` with
its routers, and writes `_arm` (set replay on the routers, add hooks through `_hook`) and,
where arming changed more than hooks, `_disarm`; or, for a router whose output can be
replaced, only `_forward_hook`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

from . import _device
from ._rows import RouterRows
from ._stats import Counter, ReplayStats


class Target(NamedTuple):
    """One router as its context arms it."""

    router: Any
    ids: Any
    """`[tokens, top_k]` in the index dtype, on the router's device."""
    ordered: Any
    """`ids` sorted within each row: what the flip counter compares a router's own pick to."""
    layer: int
    """Its decoder layer, 0-based (`.replayed`'s key, and its name in `stats`)."""


_C = TypeVar("_C", bound="ReplayContext")


class ReplayContext:
    """Replay set on a model's routers while the context is open. `.replayed[layer]`: the rows
    replayed (0-based decoder layers); `stats()`: what replay changed in the forwards run so far
    (`ReplayStats`: the router flip rate, per layer). A framework's subclass says how."""

    def __init__(
        self,
        routers: Sequence[tuple[Any, int]],
        rows: RouterRows,
        *,
        device: Any,
        dtype: Any,
        pin_memory: bool,
    ) -> None:
        """`routers`: (router, its 0-based decoder layer), in the order of `rows.layers`. The
        ids are made on `device` (`_device.router_tensors`) before anything is armed."""
        ids, replayed = _device.router_tensors(rows, device=device, dtype=dtype,
                                               pin_memory=pin_memory)  # fmt: skip
        self.replayed: dict[int, Any] = {}
        self._targets: list[Target] = []
        for k, (router, layer) in enumerate(routers):
            self.replayed[layer] = replayed[k]
            self._targets.append(Target(router, ids[k], ids[k].sort(dim=-1).values, layer))
        self._counter = Counter(self.replayed)
        self._hooks: list[Any] = []

    def _arm(self) -> None:
        """Set replay on every target (the framework's part of `__enter__`): by default a
        forward hook on each router (`_forward_hook`) that returns its output with the
        replayed ids."""
        for t in self._targets:
            self._hook(t.router.register_forward_hook(self._forward_hook(t)))

    def _forward_hook(self, target: Target) -> Callable[..., Any]:
        """The forward hook that replays `target` (for frameworks armed by the default
        `_arm`)."""
        raise NotImplementedError

    def _disarm(self) -> None:
        """Undo what `_arm` set beyond its hooks (which `__exit__` removes first)."""

    def _hook(self, handle: Any) -> None:
        """Keep a torch hook's handle, to be removed on exit."""
        self._hooks.append(handle)

    def __enter__(self: _C) -> _C:
        self._arm()
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._disarm()

    def stats(self) -> ReplayStats:
        """Per router and overall, over the forwards run inside the context since it was
        entered (or `reset_stats`): rows replayed and filled, and the router flip rate (the
        share of replayed rows whose own top-k, from the same live scores, differs from the
        engine's ids). One small copy from the device."""
        return self._counter.read()

    def reset_stats(self) -> None:
        """Start counting again (each training step, say)."""
        self._counter.reset()
