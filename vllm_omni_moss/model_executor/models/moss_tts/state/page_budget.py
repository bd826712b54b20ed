# SPDX-License-Identifier: Apache-2.0
"""Page arithmetic of paged rings: how many pages a context needs and how many pages a budget buys.

Pure arithmetic on the codec geometry, the ring dtype and the page size: nothing is allocated here. A page
holds ``page_size`` consecutive ring cells of one slot for every layer of one resolution group (keys and
values); a group's ring is ``ring_capacity / page_size`` pages. Each group also keeps one *null page*, all
zeros, which padding rows and unused page-table entries read (docs/memory.md, "Paged rings").
"""

from __future__ import annotations

import math

import torch

__all__ = ["PageBudget"]


class PageBudget:
    """Pages and bytes of paged rings for one codec, ring dtype and page size.

    Args:
        config: the codec (``CodecConfig``).
        dtype: the ring dtype.
        page_size: tokens per page; divides every group's ring capacity.
    """

    def __init__(self, config, dtype: torch.dtype, page_size: int):
        self.config = config
        self.dtype = dtype
        self.page_size = page_size

    def pages_per_ring(self, spec) -> int:
        """Pages of one slot's ring in group ``spec``."""
        return spec.ring_capacity // self.page_size

    def page_bytes(self, spec) -> int:
        """Bytes of one page of group ``spec`` over all its layers (keys and values)."""
        return 2 * spec.num_heads * self.page_size * spec.head_dim * self.dtype.itemsize * spec.num_layers

    def stream_bytes(self) -> int:
        """Bytes of one stream's full rings, as pages."""
        return sum(self.pages_per_ring(spec) * self.page_bytes(spec) for spec in self.config.groups)

    def null_bytes(self) -> int:
        """Bytes of the null page of every group."""
        return sum(self.page_bytes(spec) for spec in self.config.groups)

    def pages_needed(self, spec, frames: int) -> int:
        """Pages of group ``spec`` a slot holds once it has decoded ``frames`` frames."""
        tokens = frames * spec.tokens_per_frame
        return min(-(-tokens // self.page_size), self.pages_per_ring(spec))

    def fraction_for_budget(self, budget_bytes: int, state_capacity: int) -> float:
        """The fraction of full rings for ``state_capacity`` slots that ``budget_bytes`` of ring pages pay for
        once the null pages are paid, at most 1.

        Raises:
            ValueError: the budget cannot hold one stream's full rings plus the null pages; the message
                names that minimum in bytes.
        """
        null, full = self.null_bytes(), self.stream_bytes()
        if budget_bytes < full + null:
            raise ValueError(
                f"a state budget of {budget_bytes} bytes holds no stream: one stream's full rings plus the "
                f"null pages need {full + null} bytes ({(full + null) / 2**20:.2f} MiB)"
            )
        return min(1.0, (budget_bytes - null) / (state_capacity * full))

    def pages_at(self, fraction: float, state_capacity: int, budgeted: bool) -> list[int]:
        """Physical pages per group, the null page included, for ``fraction`` of full rings for every slot:
        rounded down when a budget pays for them (``budgeted``), up otherwise."""
        share = [fraction * state_capacity * self.pages_per_ring(spec) for spec in self.config.groups]
        if budgeted:
            return [math.floor(x + 1e-9) + 1 for x in share]
        return [math.ceil(x - 1e-9) + 1 for x in share]

    def average_pages(self, frames: int) -> list[float]:
        """Pages per group a stream holds on average over a life of ``frames`` frames (the mean over its
        frame counts 1..frames of :meth:`pages_needed`): what a live stream of that length holds at a random
        moment."""
        out = []
        for spec in self.config.groups:
            n = self.pages_per_ring(spec)
            filling = min(frames, -(-spec.ring_capacity // spec.tokens_per_frame))  # frames until the ring is full
            held = sum(self.pages_needed(spec, f) for f in range(1, filling + 1))
            out.append((held + (frames - filling) * n) / frames)
        return out

    def pages_by_fill(self, budget_bytes: int, state_capacity: int, frames: int) -> list[int]:
        """Physical pages per group, the null page included, for a budget split by each group's fill over a
        stream of ``frames`` frames: one stream's full rings and the null pages first, then the rest in
        proportion to :meth:`average_pages` (rounded down), at most full rings for every slot.

        Raises:
            ValueError: as :meth:`fraction_for_budget`.
        """
        groups = self.config.groups
        page_bytes = [self.page_bytes(spec) for spec in groups]
        per_ring = [self.pages_per_ring(spec) for spec in groups]
        self.fraction_for_budget(budget_bytes, state_capacity)  # the minimum check
        average = self.average_pages(frames)
        rest = budget_bytes - self.stream_bytes() - self.null_bytes()
        streams = rest / sum(a * b for a, b in zip(average, page_bytes))
        return [min(state_capacity * n, n + math.floor(streams * a + 1e-9)) + 1 for a, n in zip(average, per_ring)]

    def pages_for(self, paging, state_capacity: int) -> tuple[list[int], float]:
        """``(physical pages per group with the null page, fraction of full rings they amount to)`` for the
        :class:`~.spec.PagingSpec` ``paging`` and ``state_capacity`` slots.

        Raises:
            ValueError: a budget too small for one stream (:meth:`fraction_for_budget`), or a group left with
                fewer pages than one stream's ring (the message names the fraction that would do).
        """
        budget = paging.state_budget_bytes
        if paging.expected_stream_frames is not None:
            counts = self.pages_by_fill(budget, state_capacity, paging.expected_stream_frames)
            used = sum((c - 1) * self.page_bytes(spec) for c, spec in zip(counts, self.config.groups))
            fraction = used / (state_capacity * self.stream_bytes())  # of full rings, in bytes
        else:
            fraction = paging.page_fraction
            if budget is not None:
                fraction = self.fraction_for_budget(budget, state_capacity)
            counts = self.pages_at(fraction, state_capacity, budget is not None)
        for g, (spec, pages) in enumerate(zip(self.config.groups, counts)):
            n = self.pages_per_ring(spec)
            if pages - 1 < n:
                raise ValueError(
                    f"page_fraction {fraction} gives group {g} {pages - 1} pages; one stream needs {n} "
                    f"(page_fraction >= {n / (state_capacity * n):.4g} for {state_capacity} slots)"
                )
        return counts, fraction
