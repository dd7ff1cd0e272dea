"""Pictures of replay quality (the `plot` extra: matplotlib): expert load as a layers x experts
heatmap and, given a second routing of the same positions, agreement per layer."""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, none assumed

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402

import routed_experts as rx  # noqa: E402

__all__ = ["plot_routing"]


def plot_routing(
    a: rx.RoutedExperts, b: rx.RoutedExperts | None, num_experts: int, output: str
) -> None:
    """Write `output`: the expert load of `a` (each cell: how often a layer picked an expert,
    over the layer's mean, so 1.0 is an even share), and with `b` the fraction of routers per
    layer whose expert sets match and the mean overlap of their top-k."""
    load = rx.expert_load(a, num_experts)
    panels = 1 if b is None else 2
    fig, axes = plt.subplots(
        panels, 1, figsize=(11, 4.2 * panels), squeeze=False, constrained_layout=True
    )
    _heatmap(axes[0][0], load, a)
    if b is not None:
        _agreement(axes[1][0], rx.agreement(a, b))
    fig.savefig(output, dpi=110)
    plt.close(fig)


def _heatmap(ax: Any, load: rx.ExpertLoad, p: rx.RoutedExperts) -> None:
    counts = load.counts.astype(np.float64)
    mean = counts.mean(axis=1, keepdims=True)
    share = np.divide(counts, mean, out=np.zeros_like(counts), where=mean > 0)
    top = max(2.0, float(np.nanmax(share)) if share.size else 2.0)
    # White is an even share; red above it, blue below.
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top)
    image = ax.imshow(share, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    worst = int(np.nanargmax(load.imbalance)) if load.rows else 0
    ax.set_title(
        f"Expert load, positions [{p.start}, {p.stop}): {load.rows} tokens; "
        f"worst layer {worst} (max/mean {load.imbalance[worst]:.2f}); "
        f"{len(load.never_chosen)} experts never chosen"
    )
    fig = ax.get_figure()
    fig.colorbar(image, ax=ax, label="picks / layer mean (1 = even)")


def _agreement(ax: Any, r: rx.Agreement) -> None:
    layers = np.arange(r.num_layers)
    ax.plot(layers, r.exact_match_per_layer, marker="o", ms=3, label="exact match (same set)")
    ax.plot(layers, r.overlap_per_layer, marker="s", ms=3, label=f"overlap (|A ∩ B| / {r.top_k})")
    ax.set_xlabel("layer")
    ax.set_ylabel("fraction of routers")
    low = min(float(np.nanmin(r.exact_match_per_layer)), float(np.nanmin(r.overlap_per_layer)))
    ax.set_ylim(max(0.0, low - 0.05), 1.005)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    ax.set_title(
        f"Agreement per layer, {r.compared_rows} tokens: exact match {r.exact_match:.3f}, "
        f"{r.tokens_with_difference:.1%} of tokens differ somewhere, "
        f"{r.differing_per_token:.2f} routers per token"
    )
