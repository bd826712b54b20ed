# SPDX-License-Identifier: Apache-2.0
"""Rings held in pages: per group a page pool, a free list and one page table per slot.

Logical ring cell ``c`` of slot ``s`` in a group lives in physical page ``page_tables[g][s, c // page_size]``,
row ``c % page_size`` (docs/memory.md, "Paged rings"). Page 0 of every group is the *null page*: all zeros,
never allocated, and what every unused page-table entry names, so padding rows and cells a slot has not
reached read zeros. A slot holds pages only for the context it has reached
(:meth:`~.page_budget.PageBudget.pages_needed`); pages come off a LIFO free list and go back on release.
The host keeps its own copy of every page table, so allocation never reads the device, and allocation only
writes that copy: the new entries reach the device tables at the next :meth:`PagedRings.commit` (one
host-to-device copy for all of them, once per step), as vLLM commits its block tables once per step rather
than once per request.
"""

from __future__ import annotations

import numpy as np
import torch

from .rings import group_tensors

__all__ = ["PagedRings", "PagesExhausted"]


class PagesExhausted(RuntimeError):
    """A paged pool has too few free pages for a step (or a restore); nothing was allocated."""


class PagedRings:
    """Per layer ``(2, pages, H, page_size, Dh)`` pages, with per group ``(S, pages per ring)`` int64 page tables.

    Args:
        budget: the :class:`~.page_budget.PageBudget` of the pool (codec, dtype, page size).
        device: where pages and page tables live.
        to_device: copies host int64 ids to ``device`` (the pool's page-locked path).
    """

    def __init__(self, budget, device: torch.device, to_device):
        self.budget, self.config, self.device = budget, budget.config, device
        self.page_size = budget.page_size
        self._to_device = to_device
        self.drop()

    def allocate(self, num_slots: int, pages_per_group: list[int]) -> None:
        """Pages for ``num_slots`` slots: ``pages_per_group[g]`` physical pages in group ``g``, its null page included."""
        self.drop()
        shapes, first = [], 0
        for spec, pages in zip(self.config.groups, pages_per_group):
            n = self.budget.pages_per_ring(spec)
            shapes.append((2, pages, spec.num_heads, self.page_size, spec.head_dim))
            self.page_tables.append(torch.zeros(num_slots, n, dtype=torch.long, device=self.device))
            self.host_tables.append([[] for _ in range(num_slots)])
            self.tokens_per_frame.append(spec.tokens_per_frame)
            self.pages_per_ring.append(n)
            self.free.append(list(range(pages - 1, 0, -1)))  # page 1 is allocated first
            self._pending.append(([], [], []))
            self.group_layers.append(range(first, first + spec.num_layers))
            first += spec.num_layers
        self.held = np.zeros((len(self.config.groups), num_slots), dtype=np.int64)
        self.groups, self.layers = group_tensors(self.config, shapes, self.budget.dtype, self.device)

    def drop(self) -> None:
        self.groups: list[torch.Tensor] = []
        self.layers: list[torch.Tensor] = []
        self.page_tables: list[torch.Tensor] = []  # per group, (S, n_g) int64 on the device
        self.host_tables: list[list[list[int]]] = []  # per group, per slot: its physical pages in order
        self.free: list[list[int]] = []  # per group, LIFO
        self.group_layers: list[range] = []
        self.tokens_per_frame: list[int] = []
        self.pages_per_ring: list[int] = []
        self.held = np.zeros((0, 0), dtype=np.int64)  # (groups, slots): pages each slot holds
        # Per group, the (rows, cols, pages) of page-table entries allocated since the last commit().
        self._pending: list[tuple[list[int], list[int], list[int]]] = []

    def free_counts(self) -> list[int]:
        return [len(free) for free in self.free]

    def held_pages(self, g: int) -> int:
        """Pages of group ``g`` that slots hold: all but the null page and the free ones."""
        return self.groups[g].shape[2] - 1 - len(self.free[g])

    def held_bytes(self) -> int:
        return sum(self.held_pages(g) * self.budget.page_bytes(spec) for g, spec in enumerate(self.config.groups))

    def extra_by_slot(self, targets: dict[int, int]) -> list[dict[int, int]]:
        """Per group, slot -> pages it must still allocate to hold the context of ``targets`` (slot -> frames
        it will have decoded); only the slots that need some."""
        slots = np.fromiter(targets.keys(), dtype=np.int64, count=len(targets))
        frames = np.fromiter(targets.values(), dtype=np.int64, count=len(targets))
        plan = []
        for g, (tpf, per_ring) in enumerate(zip(self.tokens_per_frame, self.pages_per_ring)):
            # PageBudget.pages_needed over every slot at once: the scheduler asks for thousands of slots a call.
            needed = np.minimum(-(-(frames * tpf) // self.page_size), per_ring)
            extra = needed - self.held[g, slots]
            keep = extra > 0
            plan.append(dict(zip(slots[keep].tolist(), extra[keep].tolist())))
        return plan

    def short(self, plan: list[dict[int, int]]) -> int | None:
        """The first group whose free pages cannot serve ``plan`` (:meth:`extra_by_slot`), or None."""
        return next((g for g, extra in enumerate(plan) if sum(extra.values()) > len(self.free[g])), None)

    def allocate_pages(self, plan: list[dict[int, int]]) -> None:
        """Give each slot of ``plan`` its extra pages (the caller checked :meth:`short`) in the host tables; the
        device tables get the new entries at the next :meth:`commit`."""
        for g, extra in enumerate(plan):
            rows, cols, pages = self._pending[g]
            free = self.free[g]
            for slot, n in extra.items():
                held = self.host_tables[g][slot]
                taken = free[-n:][::-1]  # the pages n pops would give, in that order (LIFO)
                del free[-n:]
                rows += [slot] * n
                cols += range(len(held), len(held) + n)
                held += taken
                pages += taken
                self.held[g, slot] += n

    def commit(self) -> None:
        """Write the page-table entries allocated since the last commit to the device tables: one host-to-device
        copy of all of them (ordered before the work that reads them, no wait) and one ``index_put_`` per group
        that has some. Every step that reads the tables must come after a commit; no-op when none is pending."""
        counts = [len(rows) for rows, _, _ in self._pending]
        if not any(counts):
            return
        flat = [[], [], []]
        for entries in self._pending:
            for column, values in zip(flat, entries):
                column += values
        on_device = self._to_device(torch.tensor(flat, dtype=torch.long))
        start = 0
        for g, n in enumerate(counts):
            if n:
                rows, cols, pages = on_device[:, start : start + n]
                self.page_tables[g].index_put_((rows, cols), pages)
                start += n
        self._pending = [([], [], []) for _ in counts]

    def clear(self, ids: torch.Tensor, host_ids: list[int]) -> None:
        """Return the pages of slots ``host_ids`` (``ids`` on the device) zeroed to the free lists, and point
        their page tables at the null page (after committing pending entries, which may name these slots)."""
        self.commit()
        for g in range(len(self.group_layers)):
            freed = []
            for slot in host_ids:
                freed += self.host_tables[g][slot]
                self.host_tables[g][slot] = []
                self.held[g, slot] = 0
            if freed:  # the group's rings (L, 2, pages, H, page, Dh): pages are dim 2
                self.groups[g].index_fill_(2, self._to_device(torch.tensor(freed, dtype=torch.long)), 0)
                self.free[g].extend(reversed(freed))
            self.page_tables[g].index_fill_(0, ids, 0)

    def zero_slot(self, slot: int) -> None:
        """Zero the pages slot ``slot`` holds, keeping them (a restore writes into them)."""
        for g, group in enumerate(self.groups):
            pages = self.host_tables[g][slot]
            if pages:
                group.index_fill_(2, self._to_device(torch.tensor(pages, dtype=torch.long)), 0)

    def group_of(self, layer: int) -> int:
        return next(g for g, layers in enumerate(self.group_layers) if layer in layers)

    def _cell_pages(self, layer: int, slot: int, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.commit()
        table = self.page_tables[self.group_of(layer)][slot]
        cells = cells.to(self.device)
        return table[cells // self.page_size], cells % self.page_size

    def read_cells(self, layer: int, slot: int, cells: torch.Tensor) -> torch.Tensor:
        """``(2, H, N, Dh)`` copy of logical ring cells ``cells`` ``(N,)`` of one slot."""
        pages, rows = self._cell_pages(layer, slot, cells)
        return self.layers[layer][:, pages, :, rows].permute(1, 2, 0, 3)  # (N, 2, H, Dh) -> (2, H, N, Dh)

    def write_cells(self, layer: int, slot: int, cells: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` ``(2, H, N, Dh)`` into logical ring cells ``cells`` ``(N,)`` of one slot."""
        pages, rows = self._cell_pages(layer, slot, cells)
        self.layers[layer][:, pages, :, rows] = values.permute(2, 0, 1, 3)

    def tables_by_first_layer(self) -> dict[int, torch.Tensor]:
        """Each group's page table keyed by its first layer (what the ring attention ops take)."""
        return {layers.start: table for layers, table in zip(self.group_layers, self.page_tables)}
