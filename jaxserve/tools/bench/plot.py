"""Attainment plots like the paper's Figure 8: vs request rate and vs SLO scale, one line per deployment."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

Curve = Sequence[tuple[float, float]]  # (x, attainment in [0, 1])


def plot_attainment(
    path: str | Path,
    by_rate: Mapping[str, Curve],
    by_scale: Mapping[str, Curve] | None = None,
    *,
    target: float | None = 0.9,
    title: str = "",
    rate_label: str = "rate (req/s)",
    dashed: Mapping[str, Curve] | None = None,
) -> Path:
    """Write a PNG: attainment vs rate (left) and, when given, vs SLO scale (right).

    `dashed` curves (e.g. the simulator's prediction) are drawn on the rate axes in the colour of
    the solid curve with the same label prefix.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if by_scale else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 3.6), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color_of: dict[str, str] = {}
    ax = axes[0][0]
    for n, (label, curve) in enumerate(by_rate.items()):
        color_of[label] = colors[n % len(colors)]
        pts = sorted(curve)
        ax.plot([x for x, _ in pts], [100 * y for _, y in pts], "o-", color=color_of[label], label=label)
    for label, curve in (dashed or {}).items():
        base = next((k for k in color_of if label.startswith(k)), None)
        pts = sorted(curve)
        ax.plot(
            [x for x, _ in pts],
            [100 * y for _, y in pts],
            "s--",
            color=color_of.get(base or "", "gray"),
            label=label,
            alpha=0.8,
        )
    ax.set_xlabel(rate_label)
    ax.set_ylabel("SLO attainment (%)")
    if by_scale:
        ax2 = axes[0][1]
        for n, (label, curve) in enumerate(by_scale.items()):
            pts = sorted(curve)
            ax2.plot(
                [x for x, _ in pts], [100 * y for _, y in pts], "o-", color=color_of.get(label, colors[n]), label=label
            )
        ax2.set_xlabel("SLO scale")
        ax2.set_ylabel("SLO attainment (%)")
    for a in axes[0]:
        if target is not None:
            a.axhline(100 * target, color="gray", linestyle=":", linewidth=1)
        a.set_ylim(-3, 103)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
