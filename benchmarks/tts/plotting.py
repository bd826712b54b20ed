# SPDX-License-Identifier: Apache-2.0
"""Plot styling shared by the benchmark plots: one distinct style per arm, matplotlib without a display.

Every arm of one figure gets its own colour (the fixed colour of a known arm, else the first palette colour no
other arm of the figure has), its own marker and line width (wider lines first, so that a line lying on
another's stays visible around it), and the ``ideal`` arm a dashed line.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["ARM_COLORS", "arm_styles", "log_axis", "pyplot"]

ARM_COLORS = {
    "v2": "tab:blue",
    "legacy": "tab:gray",
    "upstream": "tab:orange",
    "v2-paged": "tab:green",
    "ideal": "black",
    "upstream-triton": "tab:red",
}
_PALETTE = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:red", "tab:green", "gold", "navy")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")


def arm_styles(arms: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{arm: matplotlib line keyword arguments}`` for the arms of one figure, pairwise distinct in colour,
    marker and line width."""
    arms = list(dict.fromkeys(arms))
    taken = {ARM_COLORS[a] for a in arms if a in ARM_COLORS}
    spare = [c for c in _PALETTE if c not in taken]
    styles: dict[str, dict[str, Any]] = {}
    for i, arm in enumerate(arms):
        color = ARM_COLORS.get(arm) or (spare.pop(0) if spare else f"C{i % 10}")
        styles[arm] = {
            "color": color,
            "marker": _MARKERS[i % len(_MARKERS)],
            "markersize": 7.0 - 0.6 * (i % 5),
            "markerfacecolor": "none" if i % 2 else color,
            "linewidth": round(2.8 - 2.0 * i / max(1, len(arms) - 1), 3),
            "linestyle": "--" if arm == "ideal" else "-",
        }
    return styles


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log_axis(axis) -> None:
    """Plain numbers on a log axis, major ticks only (minor labels collide on short ranges)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())
