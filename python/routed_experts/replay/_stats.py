"""What replay changed, counted while a replay context is open (format.md §6.2): per router,
the rows replayed and filled, and the replayed rows whose own top-k (what the router would
have picked from its live scores) differs from the engine's ids: the router flip rate, the
mismatch R3 removes, split by layer. The counts stay on the model's device until asked for,
so counting costs no wait: one small copy when `stats()` is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LayerStats:
    """One router's counts, summed over the forwards it ran inside the context."""

    layer: int
    """The router's decoder layer, 0-based (the payload's layer, where it holds every layer)."""
    rows: int
    """Rows routed (tokens x forwards)."""
    replayed: int
    """Rows given the engine's ids."""
    filled: int
    """Rows without routing, given spread ids."""
    flipped: int
    """Replayed rows whose own top-k, as a set, differs from the engine's."""

    @property
    def flip_rate(self) -> float:
        """`flipped / replayed` (NaN when nothing was replayed)."""
        return self.flipped / self.replayed if self.replayed else math.nan


@dataclass(frozen=True)
class ReplayStats:
    """Every router's `LayerStats`, and their sums: what to log each step."""

    layers: dict[int, LayerStats] = field(default_factory=dict)
    forwards: int = 0
    """Forwards counted (each router's, the most any ran: recompute in backward counts too)."""

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.layers.values())

    @property
    def replayed(self) -> int:
        return sum(s.replayed for s in self.layers.values())

    @property
    def filled(self) -> int:
        return sum(s.filled for s in self.layers.values())

    @property
    def flipped(self) -> int:
        return sum(s.flipped for s in self.layers.values())

    @property
    def flip_rate(self) -> float:
        """Over every router: flipped rows over replayed rows (NaN when none was replayed)."""
        replayed = self.replayed
        return self.flipped / replayed if replayed else math.nan

    def as_dict(self, prefix: str = "replay/") -> dict[str, float]:
        """Flat figures for a metrics logger (wandb, tensorboard): the overall flip rate and
        counts, then `flip_rate/layer_{i}` per router."""
        out: dict[str, float] = {
            f"{prefix}flip_rate": self.flip_rate,
            f"{prefix}replayed_rows": float(self.replayed),
            f"{prefix}filled_rows": float(self.filled),
            f"{prefix}flipped_rows": float(self.flipped),
        }
        for layer, s in sorted(self.layers.items()):
            out[f"{prefix}flip_rate/layer_{layer}"] = s.flip_rate
        return out


class Counter:
    """Device-side counts of one context's routers: `add` in a router's forward, `read` once.
    `replayed`: per decoder layer, its `[tokens]` bool of the rows replayed, where the router's
    ids are."""

    def __init__(self, replayed: dict[int, Any]) -> None:
        import torch

        self.masks = replayed
        self.index = {layer: i for i, layer in enumerate(replayed)}
        device = next(iter(replayed.values())).device if replayed else "cpu"
        self.flipped = torch.zeros(len(replayed), dtype=torch.int64, device=device)
        self.forwards = [0] * len(replayed)

    def add(self, layer: int, native: Any, forced_sorted: Any) -> None:
        """One forward of `layer`'s router: `native` its own top-k ids `[tokens, top_k]`,
        `forced_sorted` the ids it was given, sorted along top_k (sets compared)."""
        i = self.index[layer]
        differs = (native.sort(dim=-1).values != forced_sorted).any(dim=-1)
        self.flipped[i] += (differs & self.masks[layer]).sum()
        self.forwards[i] += 1

    def reset(self) -> None:
        self.flipped.zero_()
        self.forwards = [0] * len(self.forwards)

    def read(self) -> ReplayStats:
        import torch

        flipped = self.flipped.cpu().tolist()
        masks = list(self.masks.values())
        replayed = torch.stack([m.sum() for m in masks]).cpu().tolist() if masks else []
        layers = {}
        for i, (layer, mask) in enumerate(self.masks.items()):
            n = self.forwards[i]
            rows, kept = n * int(mask.shape[0]), n * int(replayed[i])
            layers[layer] = LayerStats(layer, rows, kept, rows - kept, int(flipped[i]))
        return ReplayStats(layers, max(self.forwards, default=0))
