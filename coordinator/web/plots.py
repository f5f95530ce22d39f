"""The web view's plots: SVG bytes drawn by matplotlib (no JavaScript, nothing fetched)."""

from __future__ import annotations

import io
from typing import Any

__all__ = ["svg_of", "species_plot_svg"]


def svg_of(fig: Any) -> bytes:
    """A matplotlib figure as SVG bytes; the figure is closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    return buf.getvalue()


def species_plot_svg(counts: dict[str, dict[str, int]], *, top: int = 8) -> bytes:
    """SVG line plot of records per month for the ``top`` species with most records (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    months = sorted({m for per in counts.values() for m in per})
    ranked = sorted(counts, key=lambda s: -sum(counts[s].values()))[:top]
    for name in ranked:
        ax.plot(range(len(months)), [counts[name].get(m, 0) for m in months], marker="o", markersize=3, label=name)
    ax.set_xticks(range(len(months)), months, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("records (top species)")
    ax.set_xlabel("month of capture")
    ax.grid(alpha=0.3)
    if ranked:
        ax.legend(fontsize=8, loc="upper left")
    else:
        ax.text(0.5, 0.5, "no records with a species yet", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    return svg_of(fig)
