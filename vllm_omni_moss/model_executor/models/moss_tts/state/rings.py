# SPDX-License-Identifier: Apache-2.0
"""The ring tensors of a pool: one tensor per resolution group, one view per attention layer.

A ring holds the keys and values of the last ``ring_capacity`` tokens one slot wrote in one layer: token
position ``p`` lives in cell ``p mod ring_capacity`` (docs/ring_semantics.md). Each group's layers share one
zeroed tensor ``(L, 2, S, H, C, Dh)``, so clearing slots costs one fill per group, not one per layer; every
layer reads and writes its view ``(2, S, H, C, Dh)``. :class:`~.paged_rings.PagedRings` keeps the same views
over pages instead of slots.
"""

from __future__ import annotations

import torch

__all__ = ["DenseRings", "group_tensors"]


def group_tensors(config, shapes, dtype, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(group tensors, layer views)``: one zeroed ``(num_layers, *shape)`` tensor per group (``shapes``: one
    ring's shape per group) and every layer's ring as a view of it, in layer order."""
    groups = [torch.zeros(g.num_layers, *shape, device=device, dtype=dtype) for g, shape in zip(config.groups, shapes)]
    return groups, [ring for group in groups for ring in group.unbind(0)]


class DenseRings:
    """Full rings for every slot: per layer ``(2, S, H, C, Dh)`` (plane 0 keys, plane 1 values).

    Args:
        config: the codec (``CodecConfig``).
        dtype: the ring dtype.
        device: where the rings live.
    """

    def __init__(self, config, dtype: torch.dtype, device: torch.device):
        self.config, self.dtype, self.device = config, dtype, device
        self.groups: list[torch.Tensor] = []
        self.layers: list[torch.Tensor] = []

    def allocate(self, num_slots: int) -> None:
        shapes = [(2, num_slots, g.num_heads, g.ring_capacity, g.head_dim) for g in self.config.groups]
        self.groups, self.layers = group_tensors(self.config, shapes, self.dtype, self.device)

    def drop(self) -> None:
        self.groups, self.layers = [], []

    def clear(self, ids: torch.Tensor, host_ids: list[int]) -> None:
        """Zero the rings of slots ``ids`` (on the rings' device; ``host_ids`` the same ids on the host)."""
        for group in self.groups:  # (L, 2, S, H, C, Dh): slots are dim 2
            group.index_fill_(2, ids, 0)

    def read_cells(self, layer: int, slot: int, cells: torch.Tensor) -> torch.Tensor:
        """``(2, H, N, Dh)`` copy of ring cells ``cells`` ``(N,)`` of one slot."""
        return self.layers[layer][:, slot].index_select(2, cells)

    def write_cells(self, layer: int, slot: int, cells: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` ``(2, H, N, Dh)`` into ring cells ``cells`` ``(N,)`` of one slot."""
        self.layers[layer][:, slot].index_copy_(2, cells, values)
