# SPDX-License-Identifier: Apache-2.0
"""The shape of every serving step: one function for the session, the graph runner, the stage and the benchmarks.

Every step is ragged (docs/serving.md, "Steps"): its rows hold any number of valid frames up to the step's frame
size, and every op but the ring attention runs on their frames packed one after another. A step's cost therefore
follows its packed frames, not its rows, and its CUDA graph is keyed by them, as vLLM keys its graphs by token
count: :func:`frame_totals` is the ladder of packed frame totals, fine enough that a step pads at most
``1 / GROWTH_DIVISOR`` of its frames (every total up to ``2 x GROWTH_DIVISOR`` is on it). A step of ``F`` real
frames replays the graph of the smallest total ``>= F``; its extra frames are dummies that read nothing a real
token reads and write nothing.

:class:`StepShape` is the frozen shape of one step and the key of its graph. :class:`StepLadder` answers the one
question a planner asks (:meth:`StepLadder.shape`) and cuts a round whose frames no shape holds
(:meth:`StepLadder.cut`); the CPU and the GPU plan with the same ladder, so a CPU run takes the steps a GPU does.
"""

from __future__ import annotations

import bisect
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from .checks import check_count

__all__ = ["GROWTH_DIVISOR", "StepLadder", "StepShape", "frame_totals", "graph_sizes"]

#: Above ``2 x GROWTH_DIVISOR`` frames, consecutive totals of the ladder differ by ``floor(total / GROWTH_DIVISOR)``
#: frames: a step pads at most ``1 / GROWTH_DIVISOR`` (3.1%) of its frames, about half that on average.
GROWTH_DIVISOR = 32


def frame_totals(max_total: int) -> list[int]:
    """The ladder of packed frame totals up to ``max_total``, ascending, ending at ``max_total``.

    Every total up to ``2 x GROWTH_DIVISOR`` (small steps, where a step's fixed cost dominates), then each
    total ``n`` followed by ``n + floor(n / GROWTH_DIVISOR)``: ``frame_totals(3840)`` (640 slots of 6-frame
    chunks) has 206 totals, ``frame_totals(2304)`` (384 slots) 189, ``frame_totals(4560)`` (760 slots) 211.

    Raises:
        ValueError: ``max_total`` is not an integer >= 1.
    """
    check_count(max_total, "max_total", 1)
    totals, n = [], 1
    while n < max_total:
        totals.append(n)
        n += max(1, n // GROWTH_DIVISOR)
    return totals + [max_total]


def graph_sizes(sizes) -> list[int]:
    """Graph frame sizes or frame totals as a session keeps them: distinct, ascending; sizes below 1 are dropped.

    Raises:
        ValueError: a size that is not an integer (a float or a bool is refused, never rounded).
    """
    bad = [n for n in sizes if isinstance(n, bool) or not isinstance(n, numbers.Integral)]
    if bad:
        raise ValueError(f"graph sizes must be integers, got {bad[0]!r} in {list(sizes)!r}")
    return sorted({int(n) for n in sizes if 0 < int(n)})


@dataclass(frozen=True)
class StepShape:
    """The shape of one step and the key of the CUDA graph that replays it.

    Attributes:
        rows: ``R``, rows of the step: its streams, then padding rows (they decode nothing).
        frames: ``T``, the most valid frames one row may hold (the ring attention's query length per row).
        total_frames: ``F``, packed frames: the rows' valid frames one after another, then dummy frames.
    """

    rows: int
    frames: int
    total_frames: int

    def __post_init__(self) -> None:
        for name in ("rows", "frames", "total_frames"):
            check_count(getattr(self, name), name, 1)


@dataclass(frozen=True)
class StepLadder:
    """How a session shapes its steps.

    Attributes:
        max_rows: most rows of one step (the pool's slot count).
        frames: ``T`` of every step (the largest chunk size decoded in one step; longer chunks are cut).
        totals: the packed frame totals steps are padded to, ascending (:func:`frame_totals`, or those whose
            graphs were captured); empty: every step is shaped exactly (its rows, its real frames), as without
            graphs.

    Raises:
        ValueError: ``max_rows`` or ``frames`` is not an integer >= 1, ``totals`` is not ascending integers >= 1, or
            its largest total is below ``frames`` (a row of ``frames`` frames would fit no step).
    """

    max_rows: int
    frames: int
    totals: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_count(self.max_rows, "max_rows", 1)
        check_count(self.frames, "frames", 1)
        totals = tuple(self.totals)
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in totals) or list(totals) != sorted(
            set(totals)
        ):
            raise ValueError(f"totals must be distinct ascending integers >= 1, got {list(totals)}")
        if totals and totals[-1] < self.frames:
            raise ValueError(
                f"the largest frame total {totals[-1]} is below the frame size {self.frames}: a row of "
                f"{self.frames} frames would fit no step"
            )
        object.__setattr__(self, "totals", totals)

    @property
    def max_total(self) -> int | None:
        """Most real frames of one step (None: unbounded, no ladder)."""
        return self.totals[-1] if self.totals else None

    def shape_of_total(self, total: int) -> StepShape:
        """The shape of the steps padded to ``total`` packed frames: ``min(max_rows, total)`` rows (a row holds a
        frame at least, so no such step has more rows), :attr:`frames` frames."""
        return StepShape(min(self.max_rows, total), self.frames, total)

    def shape(self, lengths: Sequence[int]) -> StepShape | None:
        """The shape of a step whose rows hold ``lengths`` valid frames (each ``1..frames``): with a ladder,
        :meth:`shape_of_total` of the smallest total holding their sum; without, exactly their rows, their
        longest row and their sum. None when no total holds them (cut the round: :meth:`cut`) or there are more
        rows than :attr:`max_rows`."""
        rows, real = len(lengths), sum(lengths)
        if not 1 <= rows <= self.max_rows:
            return None
        if not self.totals:
            return StepShape(rows, max(lengths), real)
        i = bisect.bisect_left(self.totals, real)
        return None if i == len(self.totals) else self.shape_of_total(self.totals[i])

    def cut(self, lengths: Sequence[int]) -> list[int]:
        """Sizes of consecutive groups of rows with valid frames ``lengths`` (in order), each of which
        :meth:`shape` holds: one group when the whole round fits, otherwise each group as many rows as fit.

        Raises:
            ValueError: a length outside ``1..frames``.
        """
        sizes, rows, real, limit = [], 0, 0, self.max_total
        for n in lengths:
            if not 1 <= n <= self.frames:
                raise ValueError(f"a row of {n} frames does not fit steps of {self.frames} frames")
            if rows and (rows == self.max_rows or (limit is not None and real + n > limit)):
                sizes.append(rows)
                rows, real = 0, 0
            rows, real = rows + 1, real + n
        return sizes + [rows] if rows else sizes
