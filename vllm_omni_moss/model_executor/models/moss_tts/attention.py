# SPDX-License-Identifier: Apache-2.0
"""Attention of the codec decoder: the step plan and the attention backends.

A decode step is ``run_decoder(decoder, codes, plan)`` (``decoder.py``). The
:class:`StepPlan` is built once per step by whoever owns the state (a pool, the
fixed-width reference stream, or offline decode) and holds:

* one :class:`GroupStep` per resolution group: the group's ring metadata, built once
  (``None`` for offline decode and for the legacy pool, which rebuilds it per layer);
* the attention backend, an object chosen once when its owner is built, called as
  ``backend(group_step, layer, qkv)`` for every attention layer;
* ``finish()``, run after the last group (commits offsets).

Backends here:

* :class:`OfflineAttention` - whole sequences, exact sliding window, no state.
* :class:`CompactRingAttention` - the compact pool: metadata once per group, masked
  commits of the touched ring cells (``ops/commit.py``).
* :class:`LegacyRingAttention` - vLLM-Omni 0.30.0's per-layer behaviour: offsets
  gathered and metadata rebuilt per layer, whole ring written back per row.
* :class:`FixedWidthAttention` - the reference streaming path: execution row ``b`` is
  state row ``b``, each layer with its own ring and offsets.
* :class:`CompactTritonRingAttention` - the compact pool with attention backend
  ``"triton"``: rings read in place by ``ops/ring_attention.py``, no gather, no mask, each row read
  from its first packed token.
* :class:`GridAttention` - a pool step's packed tokens through a grid backend (the ``"sdpa"`` and legacy
  references, which parity tests use as oracles).

Every pool step is packed (``token_packing.py``): its plan is built with its packing, and its backend reads
packed tokens.

The ``"sdpa"`` backends compute attention with the reference attention,
:func:`~.ops.ring_reference.attend_gathered_rows` (native
SDPA over the gathered ring, physical key order), so pools that share a ring semantics
produce bit-identical audio; the ``"triton"`` backend sees exactly the same keys and
writes bitwise the same ring contents, with its own (float32 online softmax) arithmetic.
A pool's spec picks its backend once (``backends.ATTENTION_BACKENDS``); :func:`step_plan` builds each step's plan
with the builder its kind's record names for that backend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from . import step_metadata
from .config import CodecConfig, GroupSpec
from .ops.commit import commit_offsets, commit_ring
from .ops.ring_attention_packed import ring_attention_write_packed
from .ops.ring_reference import attend_gathered_rows
from .ops.rope import rope as rope_op
from .ops.rope import step_rope_tables
from .pool_kinds import POOL_KIND_RECORDS
from .step_metadata import RingMetadata, apply_rope, rope_tables
from .token_packing import TokenPacking

__all__ = [
    "AttentionBackend",
    "CompactRingAttention",
    "CompactTritonRingAttention",
    "FixedWidthAttention",
    "GridAttention",
    "GroupStep",
    "LegacyRingAttention",
    "OfflineAttention",
    "PLANS_BY_KIND",
    "PLAN_BUILDERS",
    "StepPlan",
    "apply_rope",
    "plan_builder",
    "step_plan",
]

#: Queries per block in offline attention: bounds the mask to ``block x (block + window)``.
OFFLINE_QUERY_BLOCK = 4096


@dataclass(frozen=True)
class GroupStep:
    """One resolution group of one step.

    Attributes:
        spec: the group.
        first_layer: index of the group's first attention layer in the whole decoder.
        num_tokens: ``T`` tokens per row in this step (frames x ``spec.tokens_per_frame``).
        valid_tokens: ``(B,)`` int64 valid tokens per row (0 for padding rows); ``None`` offline.
        meta: ring metadata shared by the group's layers, or ``None`` when the backend
            builds its own (offline, legacy, fixed width).
    """

    spec: GroupSpec
    first_layer: int
    num_tokens: int
    valid_tokens: torch.Tensor | None = None
    meta: RingMetadata | None = None


class AttentionBackend(Protocol):
    def __call__(self, group: GroupStep, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv`` ``(3, B, H, T, Dh)`` projections before RoPE -> ``(B, H, T, Dh)`` (in the ring dtype
        for the ring backends; the decoder casts it to ``qkv``'s); ``layer`` indexes the whole decoder."""
        ...


@dataclass(frozen=True)
class StepPlan:
    """Everything one decode step needs besides the weights and the codes."""

    groups: list[GroupStep]
    attention: AttentionBackend
    finish: Callable[[], None] | None = None


def group_steps(
    config: CodecConfig,
    num_frames: int,
    valid_frames: torch.Tensor | None,
    ring_semantics: str | None = None,
    frames_decoded: torch.Tensor | None = None,
) -> list[GroupStep]:
    """The :class:`GroupStep` of every resolution group for a step of ``num_frames`` frames.

    Args:
        config: the codec.
        num_frames: ``T`` frames per row.
        valid_frames: ``(B,)`` int64 valid frames per row, or ``None`` (offline decode).
        ring_semantics, frames_decoded: when ``frames_decoded`` (``(B,)`` int64 frames decoded before
            this step) is given, each group's :class:`~.step_metadata.RingMetadata` is built
            here, once, with these ring semantics; otherwise ``meta`` stays ``None``.
    """
    steps = []
    for g, spec in enumerate(config.groups):
        num_tokens = num_frames * spec.tokens_per_frame
        written = None if valid_frames is None else valid_frames * spec.tokens_per_frame
        meta = None
        if frames_decoded is not None:
            meta = step_metadata.build_ring_metadata(
                spec, ring_semantics, frames_decoded * spec.tokens_per_frame, written, num_tokens
            )
        steps.append(GroupStep(spec, config.group_first_layers[g], num_tokens, written, meta))
    return steps


# --------------------------------------------------------------------------- reference


def _rotated(qkv: torch.Tensor, meta: RingMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` of ``(3, B, H, T, Dh)`` projections, queries and keys rotated with the group's RoPE tables
    (the inputs of the reference attention, :func:`~.ops.ring_reference.attend_gathered_rows`)."""
    qk = apply_rope(qkv[:2], meta.cos, meta.sin)
    return qk[0], qk[1], qkv[2]


# --------------------------------------------------------------------------- backends


class OfflineAttention:
    """Whole-sequence attention: positions ``0..N-1``, exact window ``0 <= q - k < window``.

    Queries are processed in blocks of :data:`OFFLINE_QUERY_BLOCK` against only the keys
    they can reach, so mask memory is ``O(block * (block + window))`` whatever the length.
    """

    def __call__(self, group: GroupStep, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        spec, n = group.spec, group.num_tokens
        ctx = spec.window
        zero = torch.zeros(qkv.shape[1], dtype=torch.long, device=qkv.device)
        q, k = apply_rope(qkv[:2], *rope_tables(zero, n, spec.head_dim, spec.max_period))
        v = qkv[2]
        outs = []
        for start in range(0, n, OFFLINE_QUERY_BLOCK):
            end = min(start + OFFLINE_QUERY_BLOCK, n)
            k0 = max(0, start - ctx + 1)
            rel = torch.arange(start, end, device=q.device).view(-1, 1) - torch.arange(k0, end, device=q.device)
            mask = (rel >= 0) & (rel < ctx)
            outs.append(
                F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, k0:end], v[:, :, k0:end], attn_mask=mask)
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class CompactRingAttention:
    """Compact pool: reads the group's shared metadata, commits only touched cells of writing rows.

    Args:
        rings: the pool's per-layer rings ``(2, S, H, C, Dh)``.
        ring_semantics: the pool's ring semantics.
        slots: ``(B,)`` int64 slot of each execution row (padding rows on the null slot).
    """

    def __init__(self, rings: list[torch.Tensor], ring_semantics: str, slots: torch.Tensor):
        self.rings, self.ring_semantics, self.slots = rings, ring_semantics, slots

    def __call__(self, group: GroupStep, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        ring, meta = self.rings[layer], group.meta
        rows = ring.index_select(1, self.slots)
        out = attend_gathered_rows(self.ring_semantics, rows, meta, *_rotated(qkv, meta))
        commit_ring(rows, ring, self.slots, meta.offsets, meta.valid_tokens, group.num_tokens)
        return out


class CompactTritonRingAttention:
    """Compact pool, ``"triton"`` backend: rings read in place, chunk tokens written once, on packed tokens.

    Per layer: :func:`~.ops.rope.rope` rotates the packed queries and keys in one pass (bitwise
    :func:`apply_rope`, so the stored keys are the reference path's), then
    :func:`~.ops.ring_attention_packed.ring_attention_write_packed` runs attention over each row's ring and
    chunk, reading the row from its first packed token, and writes each row's last ``min(valid tokens, C)``
    tokens (on CUDA inside the attention kernel for rows of at most 32 tokens). The attention kernel can rotate
    as it loads, but that variant ran far slower on some H200s than the kernel on rotated inputs
    (docs/ring_semantics.md). Needs no :class:`~.step_metadata.RingMetadata`: each group's offsets, row starts and
    RoPE tables (gathered at the packed tokens) are built once here, at construction.

    Args:
        config: the codec.
        rings: the pool's per-layer rings ``(2, S, H, C, Dh)``.
        ring_semantics: the pool's ring semantics.
        slots: ``(R,)`` int64 slot of each row (padding rows on the null slot).
        frames_decoded: ``(R,)`` int64 frames each row decoded before this step.
        packing: the step's :class:`~.token_packing.TokenPacking`; every layer takes ``(3, 1, H, N, Dh)``
            packed projections and answers ``(1, H, N, Dh)``.
        page_tables: for a paged pool, each group's ``(S, pages per ring)`` page table keyed by the
            group's first layer (``ops.ring_attention_packed``'s ``page_table``); rings are then pages.
    """

    def __init__(
        self,
        config: CodecConfig,
        rings: list[torch.Tensor],
        ring_semantics: str,
        slots: torch.Tensor,
        frames_decoded: torch.Tensor,
        packing: TokenPacking,
        page_tables: dict[int, torch.Tensor] | None = None,
    ):
        self.rings, self.ring_semantics, self.slots = rings, ring_semantics, slots
        self.page_tables = page_tables or {}
        self.tables: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for level, (spec, first_layer) in enumerate(zip(config.groups, config.group_first_layers)):
            offsets = frames_decoded * spec.tokens_per_frame
            num_tokens = packing.frames * spec.tokens_per_frame
            cos, sin = step_rope_tables(offsets, num_tokens, spec.head_dim, spec.max_period)
            half, read = cos.shape[-1], packing.read[level]
            cos, sin = (t.reshape(-1, half).index_select(0, read).view(1, 1, -1, half) for t in (cos, sin))
            self.tables[first_layer] = (offsets, packing.token_starts(level), cos, sin)

    def __call__(self, group: GroupStep, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        offsets, token_start, cos, sin = self.tables[group.first_layer]
        ring = self.rings[layer]
        # Rotation rounds to the projection dtype first, then keys and values go to the ring dtype (a
        # no-op when they match): as the reference path.
        qk = rope_op(qkv[:2], cos, sin)
        q, keys, values = qk[0], qk[1].to(ring.dtype), qkv[2].to(ring.dtype)
        out = ring_attention_write_packed(
            q, keys, values, ring, self.slots, offsets, group.valid_tokens, token_start, group.num_tokens,
            self.ring_semantics, page_table=self.page_tables.get(group.first_layer),
        )  # fmt: skip
        return out.transpose(1, 2)


class GridAttention:
    """A backend of the ``(R, H, T, Dh)`` grid (the ``"sdpa"`` and legacy references) on a packed step: each
    layer's packed projections go into the grid of the step's rows, and the answer comes back packed.

    Args:
        inner: the grid backend.
        packing: the step's :class:`~.token_packing.TokenPacking`.
        levels: the level (group index) of each group's first layer.
    """

    def __init__(self, inner: AttentionBackend, packing: TokenPacking, levels: dict[int, int]):
        self.inner, self.packing, self.levels = inner, packing, levels

    def __call__(self, group: GroupStep, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        level, p = self.levels[group.first_layer], self.packing
        _, _, H, N, Dh = qkv.shape
        tokens = qkv[:, 0].permute(2, 0, 1, 3).reshape(1, N, 3 * H * Dh)
        rows = p.to_rows(level, tokens)  # (R, T, 3 H Dh)
        R, T = rows.shape[:2]
        out = self.inner(group, layer, rows.view(R, T, 3, H, Dh).permute(2, 0, 3, 1, 4))  # (R, H, T, Dh)
        packed = p.to_tokens(level, out.transpose(1, 2).reshape(R, T, H * Dh))  # (1, N, H Dh)
        return packed.view(1, N, H, Dh).transpose(1, 2)


class LegacyRingAttention:
    """vLLM-Omni 0.30.0's layer behaviour: per-layer offsets and metadata, whole-ring write-back.

    Args:
        rings: the pool's per-layer rings ``(2, S, H, C, Dh)``.
        offset_table: ``(R, S)`` int64 offsets (rows per :class:`~.state.LegacyDecoderStatePool`).
        layer_rows: per layer, its (attention offset, ring end offset) rows of ``offset_table``.
        group_rows: last layer of a group -> that group's own offset row (v2 codecs only).
        ring_semantics: the pool's ring semantics.
        slots: ``(B,)`` int64 slot of each execution row (padding rows on scratch slots).
    """

    def __init__(self, rings, offset_table, layer_rows, group_rows, ring_semantics: str, slots: torch.Tensor):
        self.rings, self.offset_table = rings, offset_table
        self.layer_rows, self.group_rows = layer_rows, group_rows
        self.ring_semantics, self.slots = ring_semantics, slots

    def __call__(self, group: GroupStep, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        attn_row, ring_row = self.layer_rows[layer]
        offsets = self.offset_table[attn_row].index_select(0, self.slots)
        meta = step_metadata.build_ring_metadata(
            group.spec, self.ring_semantics, offsets, group.valid_tokens, group.num_tokens
        )
        ring = self.rings[layer]
        rows = ring.index_select(1, self.slots)
        # The whole rows are written back: rows that write nothing must come back as they were.
        out = attend_gathered_rows(self.ring_semantics, rows, meta, *_rotated(qkv, meta), keep_empty_rows=True)
        ring.index_copy_(1, self.slots, rows)
        for row in {attn_row, ring_row}:
            self.offset_table[row].index_copy_(0, self.slots, meta.next_offsets)
        group_row = self.group_rows.get(layer)
        if group_row is not None:
            advanced = self.offset_table[group_row].index_select(0, self.slots) + group.valid_tokens
            self.offset_table[group_row].index_copy_(0, self.slots, advanced)
        return out


class FixedWidthAttention:
    """Reference streaming: per layer its own ring ``(2, B, H, C, Dh)`` and offsets ``(B,)``, all rows valid."""

    def __init__(self, rings: list[torch.Tensor], offsets: list[torch.Tensor], ring_semantics: str):
        self.rings, self.offsets, self.ring_semantics = rings, offsets, ring_semantics

    def __call__(self, group: GroupStep, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        offsets = self.offsets[layer]
        meta = step_metadata.build_ring_metadata(
            group.spec, self.ring_semantics, offsets, group.valid_tokens, group.num_tokens
        )
        out = attend_gathered_rows(self.ring_semantics, self.rings[layer], meta, *_rotated(qkv, meta))
        offsets.copy_(meta.next_offsets)
        return out


# --------------------------------------------------------------------------- plan builders
#
# A pool's step plan, chosen once per pool from (pool kind, attention backend): each builder reads the pool's
# rings and offsets and returns the StepPlan of one packed step over routed ``slots`` (R,), ``valid_frames`` (R,)
# int64 (0 for invalid rows) and the step's ``packing`` (its T is ``packing.frames``). Every backend reads the
# packed tokens: the Triton one from each row's start, the grid references through :class:`GridAttention`.


def _levels(config: CodecConfig) -> dict[int, int]:
    return {first: level for level, first in enumerate(config.group_first_layers)}


def legacy_plan(pool, slots: torch.Tensor, valid_frames: torch.Tensor, packing: TokenPacking) -> StepPlan:
    offsets = pool.offsets
    attention = LegacyRingAttention(
        pool.rings, offsets.offset_table, offsets.layer_rows, offsets.group_rows, pool.ring_semantics, slots
    )
    return StepPlan(
        group_steps(pool.config, packing.frames, valid_frames), GridAttention(attention, packing, _levels(pool.config))
    )


def _compact_finish(pool, frames_decoded, valid_frames, slots):
    # Rows that decoded nothing keep their counter and never write (the null slot included).
    return functools.partial(
        commit_offsets, frames_decoded + valid_frames, pool.frames_decoded, slots, valid_frames > 0
    )


def compact_sdpa_plan(pool, slots: torch.Tensor, valid_frames: torch.Tensor, packing: TokenPacking) -> StepPlan:
    # Ring metadata (cells, sources, masks) once per group; gathered rows, masked commits.
    frames_decoded = pool.frames_decoded.index_select(0, slots)
    groups = group_steps(pool.config, packing.frames, valid_frames, pool.ring_semantics, frames_decoded)
    attention = GridAttention(
        CompactRingAttention(pool.rings, pool.ring_semantics, slots), packing, _levels(pool.config)
    )
    return StepPlan(groups, attention, _compact_finish(pool, frames_decoded, valid_frames, slots))


def compact_triton_plan(pool, slots, valid_frames, packing: TokenPacking, tables=None) -> StepPlan:
    # No ring metadata: the kernels derive positions from offsets, row starts and valid token counts.
    frames_decoded = pool.frames_decoded.index_select(0, slots)
    groups = group_steps(pool.config, packing.frames, valid_frames)
    attention = CompactTritonRingAttention(
        pool.config, pool.rings, pool.ring_semantics, slots, frames_decoded, packing, page_tables=tables
    )
    return StepPlan(groups, attention, _compact_finish(pool, frames_decoded, valid_frames, slots))


def paged_triton_plan(pool, slots: torch.Tensor, valid_frames: torch.Tensor, packing: TokenPacking) -> StepPlan:
    # The compact plan over pages: every group's page table, keyed by its first layer.
    return compact_triton_plan(pool, slots, valid_frames, packing, pool.store.tables_by_first_layer())


#: Step-plan builders by the plan name a pool kind gives for its backend (``pool_kinds.PoolKind.plans``).
PLAN_BUILDERS: dict[str, Callable] = {
    "legacy": legacy_plan,
    "compact_sdpa": compact_sdpa_plan,
    "compact_triton": compact_triton_plan,
    "paged_triton": paged_triton_plan,
}


#: The step-plan builder of every (pool kind, attention backend) some pool runs, as the kinds' records name it: a
#: plain dict, so that ``torch.compile`` traces the lookup of a step's builder as a constant.
PLANS_BY_KIND: dict[tuple[str, str], Callable] = {
    (kind, backend): PLAN_BUILDERS[plan]
    for kind, record in POOL_KIND_RECORDS.items()
    for backend, plan in record.plans.items()
}


def plan_builder(kind: str, backend: str) -> Callable:
    """The step-plan builder of a pool of ``kind`` with attention ``backend``: ``(pool, slots, valid_frames,
    packing) -> StepPlan``; the kind's record (``pool_kinds.PoolKind.plans``) names it.

    Raises:
        ValueError: a combination no pool runs (the state spec refuses it first).
    """
    builder = PLANS_BY_KIND.get((kind, backend))
    if builder is None:
        raise ValueError(f"no {kind!r} pool runs attention backend {backend!r}")
    return builder


def step_plan(pool, slots: torch.Tensor, valid_frames: torch.Tensor, packing: TokenPacking) -> StepPlan:
    """The :class:`StepPlan` of one packed step over ``pool``, built by the plan builder of its spec's kind and
    attention backend: ``slots`` ``(R,)`` routed slot ids, ``valid_frames`` ``(R,)`` int64 (0 for invalid rows),
    ``packing`` the step's :class:`~.token_packing.TokenPacking`."""
    return plan_builder(pool.kind, pool.attention_backend)(pool, slots, valid_frames, packing)
