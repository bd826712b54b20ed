# SPDX-License-Identifier: Apache-2.0
"""Offsets of a pool's slots: one frame counter per slot, or upstream's table of per-layer offsets.

A slot's *offsets* say how many tokens each of its rings has been written since the slot's last reset
(docs/ring_semantics.md). Within a resolution group every layer has the same offset, ``frames decoded x
tokens per frame``, so one counter per slot holds them all (:class:`FrameCounters`); vLLM-Omni 0.30.0 keeps
them per layer in one int64 table (:class:`OffsetTable`, docs/memory.md). Both answer the same questions:
the persistent tensors, a slot's offsets as one column (what a :class:`~.snapshot.SlotState` keeps), and
every layer's token offset.
"""

from __future__ import annotations

import torch

__all__ = ["FrameCounters", "OffsetTable", "offset_table_rows"]


def offset_table_rows(config) -> int:
    """Rows of upstream's offset table: v2 keeps an attention offset and a ring end offset per layer plus
    one offset per group; v1 one offset per attention layer (docs/memory.md; ``CodecConfig.abilities``)."""
    abilities = config.abilities
    return abilities.offset_rows_per_layer * config.num_layers + abilities.group_offset_rows * len(config.groups)


class FrameCounters:
    """``frames_decoded`` ``(S,)`` int64: code frames each slot decoded since its reset.

    The token offset of group ``g`` is ``frames_decoded x tokens_per_frame[g]``.
    """

    def __init__(self, config):
        self.config = config
        self.frames_decoded: torch.Tensor | None = None

    def allocate(self, num_slots: int, device: torch.device) -> None:
        self.frames_decoded = torch.zeros(num_slots, dtype=torch.long, device=device)

    def drop(self) -> None:
        self.frames_decoded = None

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.frames_decoded is None else [self.frames_decoded]

    def reset(self, ids: torch.Tensor) -> None:
        self.frames_decoded.index_fill_(0, ids, 0)

    def column(self, slot: int) -> torch.Tensor:
        """A copy of ``slot``'s offsets, ``(1,)`` int64: its frames decoded."""
        return self.frames_decoded[slot : slot + 1].clone()

    def write_column(self, slot: int, column: torch.Tensor) -> None:
        self.frames_decoded[slot : slot + 1] = column

    def layer_offsets(self, column: torch.Tensor) -> torch.Tensor:
        """``(L,)`` int64 token offset of every attention layer, from a CPU column."""
        frames = int(column[0])
        groups = self.config.groups
        return torch.tensor([frames * g.tokens_per_frame for g in groups for _ in range(g.num_layers)])


class OffsetTable:
    """vLLM-Omni 0.30.0's offsets: ``offset_table`` ``(R, S)`` int64 in upstream's row layout.

    v2 codecs list, per group, an (attention offset, ring end offset) row pair for each layer, then the
    group's own offset row; v1 codecs one row per layer (``R = offset_table_rows(config)``).

    Attributes:
        layer_rows: per attention layer, its (attention offset, ring end offset) rows (the same row twice for v1).
        group_rows: the last layer of each group -> that group's own row (v2 codecs only).
    """

    def __init__(self, config):
        self.config = config
        self.offset_table: torch.Tensor | None = None
        self.layer_rows: list[tuple[int, int]] = []
        self.group_rows: dict[int, int] = {}
        per_layer, group_rows, row = config.abilities.offset_rows_per_layer, config.abilities.group_offset_rows, 0
        for g, spec in enumerate(config.groups):
            for _ in range(spec.num_layers):
                self.layer_rows.append((row, row + per_layer - 1))
                row += per_layer
            if group_rows:
                self.group_rows[config.group_first_layers[g] + spec.num_layers - 1] = row
                row += 1
        assert row == offset_table_rows(config)

    def allocate(self, num_slots: int, device: torch.device) -> None:
        self.offset_table = torch.zeros(offset_table_rows(self.config), num_slots, dtype=torch.long, device=device)

    def drop(self) -> None:
        self.offset_table = None

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.offset_table is None else [self.offset_table]

    def reset(self, ids: torch.Tensor) -> None:
        self.offset_table.index_fill_(1, ids, 0)  # every offset of these slots in one kernel

    def column(self, slot: int) -> torch.Tensor:
        """A copy of ``slot``'s offsets, ``(R,)`` int64."""
        return self.offset_table[:, slot].clone()

    def write_column(self, slot: int, column: torch.Tensor) -> None:
        self.offset_table[:, slot] = column

    def layer_offsets(self, column: torch.Tensor) -> torch.Tensor:
        """``(L,)`` int64 token offset of every attention layer, from a CPU column."""
        return column[[attention for attention, _ in self.layer_rows]]
