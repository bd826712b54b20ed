# SPDX-License-Identifier: Apache-2.0
"""One slot's state on the host: what preemption saves and restores bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SlotState", "cells_in_use", "check_slot_state", "ring_geometry"]


def ring_geometry(config) -> tuple[tuple[int, int, int, int, int], ...]:
    """Per resolution group ``(layers, heads, ring capacity, head_dim, tokens_per_frame)``: what a slot's state
    depends on besides the ring dtype (two codecs with equal geometry have interchangeable slot states)."""
    return tuple((g.num_layers, g.num_heads, g.ring_capacity, g.head_dim, g.tokens_per_frame) for g in config.groups)


@dataclass(frozen=True)
class SlotState:
    """One stream's decoder state on the host, from :meth:`~.pool.DecoderStatePool.save_slot`.

    Only the ring cells in use are kept: for an attention layer whose stream has written ``o`` tokens
    into a ring of ``C`` cells, the cells of positions ``max(0, o - C) .. o - 1`` (all ``C`` once the
    ring has wrapped; none for a fresh slot). The other cells of a slot are zero by construction (slots
    start zeroed and are reset on release), so :meth:`~.pool.DecoderStatePool.restore_slot` rebuilds the
    slot bit for bit.

    Attributes:
        pool_kind: ``"compact"``, ``"legacy"`` or ``"paged"`` (the offset layout).
        geometry: :func:`ring_geometry` of the codec.
        dtype: the ring dtype.
        ring_semantics: ``"upstream"`` or ``"exact"``.
        offsets: the slot's int64 offsets in the pool's layout: ``(1,)`` frames decoded (compact, paged) or
            the ``(R,)`` column of the legacy offset table.
        cells: per attention layer, ``(2, H, n, Dh)`` keys and values of the ``n = min(o, C)`` latest
            positions, oldest first, on the CPU.
    """

    pool_kind: str
    geometry: tuple[tuple[int, int, int, int, int], ...]
    dtype: torch.dtype
    ring_semantics: str
    offsets: torch.Tensor
    cells: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        """Host bytes held (cells plus offsets)."""
        return sum(t.numel() * t.element_size() for t in (*self.cells, self.offsets))


def cells_in_use(offset: int, capacity: int) -> torch.Tensor:
    """Ring cells of the latest ``min(offset, capacity)`` positions, oldest first, ``(n,)`` int64."""
    used = min(offset, capacity)
    return torch.remainder(torch.arange(offset - used, offset), capacity)


def check_slot_state(pool, state) -> None:
    """Check that ``state`` fits ``pool``: its kind, codec geometry, ring dtype and ring semantics, offsets of
    the pool's layout, and cells of the shapes those offsets imply.

    Raises:
        TypeError: ``state`` is not a :class:`SlotState`.
        ValueError: ``"restore_slot: ..."`` naming the first mismatch.
    """
    if not isinstance(state, SlotState):
        raise TypeError(f"restore_slot: state must be a SlotState (from save_slot), got {type(state).__name__}")
    expected = {
        "pool kind": (pool.kind, state.pool_kind),
        "codec geometry (layers, heads, ring capacity, head_dim, tokens per frame per group)": (
            ring_geometry(pool.config),
            state.geometry,
        ),
        "ring dtype": (pool.dtype, state.dtype),
        "ring semantics": (pool.ring_semantics, state.ring_semantics),
    }
    for what, (ours, theirs) in expected.items():
        if ours != theirs:
            raise ValueError(f"restore_slot: the state's {what} is {theirs!r}; this pool's is {ours!r}")
    shape = pool.offsets.column(0).shape
    offsets = state.offsets
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int64 or offsets.shape != shape:
        got = (getattr(offsets, "shape", None), getattr(offsets, "dtype", None))
        raise ValueError(f"restore_slot: state offsets must be int64 of shape {tuple(shape)}, got {got}")
    if bool((offsets < 0).any()):
        raise ValueError(f"restore_slot: state offsets must be >= 0, got {offsets.tolist()}")
    if len(state.cells) != len(pool.rings):
        raise ValueError(
            f"restore_slot: the state has {len(state.cells)} layers of cells; the codec has {len(pool.rings)}"
        )
    layers = [spec for spec in pool.config.groups for _ in range(spec.num_layers)]
    for layer, (spec, offset, saved) in enumerate(
        zip(layers, pool.offsets.layer_offsets(offsets).tolist(), state.cells)
    ):
        shape = (2, spec.num_heads, min(offset, spec.ring_capacity), spec.head_dim)
        if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != shape or saved.dtype != pool.dtype:
            got = (tuple(getattr(saved, "shape", ())), getattr(saved, "dtype", None))
            raise ValueError(
                f"restore_slot: layer {layer} cells must be {shape} {pool.dtype} for offset {offset}, got {got}"
            )
