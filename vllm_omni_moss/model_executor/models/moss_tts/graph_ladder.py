# SPDX-License-Identifier: Apache-2.0
"""The batch buckets of the codec's CUDA graphs: one ladder for the stage, the session and the benchmarks.

A step of ``B`` rows replays the graph of the smallest bucket ``>= B``; its ``bucket - B`` extra rows are
padding rows (they read the null slot and write nothing) and cost what real rows cost. The ladder bounds
that waste: powers of two up to :data:`DENSE_UP_TO` rows (where a step's time is dominated by its fixed
cost, not its rows), then buckets that grow by at most :data:`GROWTH`, so that a batch of more than
``DENSE_UP_TO`` rows never replays a graph of more than ``GROWTH`` times its rows. The last bucket is the
slot count, so that every batch the pool can hold is one replay.
"""

from __future__ import annotations

import math

from .checks import check_count

__all__ = [
    "DENSE_UP_TO",
    "GROWTH",
    "batch_buckets",
    "bucket_for",
    "graph_sizes",
    "packed_total_for",
    "packed_totals",
]

#: Buckets up to this many rows are the powers of two.
DENSE_UP_TO = 64
#: Above :data:`DENSE_UP_TO`, a bucket holds at most this many times the rows of the smallest batch it serves.
GROWTH = 1.25
#: Buckets above :data:`DENSE_UP_TO` are multiples of this many rows (the slot count excepted).
_MULTIPLE = 8


def batch_buckets(max_rows: int) -> list[int]:
    """The ladder of batch buckets for a pool of ``max_rows`` slots, ascending, ending at ``max_rows``.

    Every ``B`` in ``1..max_rows`` has a bucket ``b >= B`` with ``b <= 2 B`` for ``B <= 64`` and
    ``b <= 1.25 B`` above (``max_rows = 2048`` gives 24 buckets).

    Raises:
        ValueError: ``max_rows`` is not an integer >= 1.
    """
    check_count(max_rows, "max_rows", 1)
    buckets = [1 << i for i in range(DENSE_UP_TO.bit_length()) if 1 << i < max_rows]
    while buckets and buckets[-1] >= DENSE_UP_TO and math.floor(GROWTH * (buckets[-1] + 1)) < max_rows:
        # The next bucket serves every batch from the last bucket + 1 up: at most GROWTH x that smallest one.
        nxt = math.floor(GROWTH * (buckets[-1] + 1)) // _MULTIPLE * _MULTIPLE
        buckets.append(max(nxt, buckets[-1] + 1))
    return buckets + [max_rows]


def bucket_for(buckets: list[int], rows: int) -> int | None:
    """The smallest bucket of ``buckets`` (ascending) holding ``rows`` rows, or None when none does."""
    return next((b for b in buckets if b >= rows), None)


def graph_sizes(sizes, upper: int | None = None) -> list[int]:
    """Graph batch or frame sizes as the session and the graph runner keep them: distinct, ascending, each
    ``int(size)`` in ``1..upper`` (no upper bound when ``upper`` is None); other sizes are dropped."""
    return sorted({int(n) for n in sizes if 0 < int(n) and (upper is None or int(n) <= upper)})


def packed_totals(bucket: int, frame_sizes: list[int], least_rows: int = 1) -> list[int]:
    """The total frames of the packed graphs of one bucket: ``bucket x t`` for every frame size ``t`` of
    ``frame_sizes`` (ascending) below the largest. They serve ragged steps at the largest frame size, whose rows
    hold ``bucket x t`` real frames or fewer (docs/serving.md, "Ragged steps"). A step the bucket serves has at
    least ``least_rows`` rows (one past the bucket below), one of them longer than the second largest frame size
    (else the step would pad to that), so totals below ``second largest + least_rows`` frames would never be
    replayed and are left out."""
    least = (frame_sizes[-2] + least_rows) if len(frame_sizes) > 1 else 0
    return [bucket * t for t in frame_sizes[:-1] if bucket * t >= least]


def packed_total_for(bucket: int, frame_sizes: list[int], frames: int) -> int | None:
    """The smallest of :func:`packed_totals` ``(bucket, frame_sizes)`` holding ``frames`` real frames, or None:
    the step runs in its grid (``frames`` more than every packed total, or no smaller frame size)."""
    return next((n for n in packed_totals(bucket, frame_sizes) if n >= frames), None)
