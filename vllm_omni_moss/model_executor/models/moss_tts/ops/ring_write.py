# SPDX-License-Identifier: Apache-2.0
"""The ring write of packed rows: each row's last ``min(valid tokens, C)`` chunk tokens, stored into its slot's ring.

After the attention of one layer of a streaming step (docs/ring_semantics.md) the chunk's keys and values join
the layer's ring ``(2, S, H, C, Dh)`` of the state pool: chunk token ``t`` of a row at offset ``o`` goes to cell
``(o + t) mod C``. Only the last ``min(n, C)`` of the row's ``n`` valid tokens are stored: they are the latest of
their cells and map to distinct cells, so every destination cell is written exactly once and the result never
depends on the order of writes. Padding rows (``n = 0``) do not even read their slot id, and padding tokens are
never written. Rows are packed (``token_packing.py``): row ``b``'s tokens start at token ``token_start[b]`` of
``(1, H, N, Dh)`` keys and values. Keys may arrive unrotated with the chunk's RoPE tables; the kernel then
rotates them as it loads them, bitwise ``step_metadata.apply_rope`` (launched with ``enable_fp_fusion=False``).

This module holds the write kernel and its launch (:func:`launch_ring_write_triton`), which
``ring_attention_write_packed`` runs after the attention kernel for rows too long for the fused write; what the
attention kernel of ``ops/ring_attention.py`` builds on: the jit helpers of both ring kernels (rotated loads, the
addresses of ring cells, and the store of a block of chunk tokens that the attention kernel's fused write runs
too), their RoPE and paging arguments and the page table's check; and the PyTorch reference of the write on the
``(B, H, T, Dh)`` grid (:func:`ring_write_reference`), which the ops' references build on.
"""

from __future__ import annotations

import torch

from ..step_metadata import apply_rope
from .dispatch import HAS_TRITON, device_guard, tl, triton
from .ring_reference import logical_rings, store_logical_rings

__all__ = [
    "check_page_table",
    "launch_ring_write_triton",
    "paging_arguments",
    "ring_write_reference",
    "rope_arguments",
]

#: Elements per (token x head_dim) tile of the write kernel.
_WRITE_TILE_ELEMENTS = 2048


# --------------------------------------------------------------------------------------------------
# The page table's check (shape/dtype/device only: no data reads, so no device sync and no graph break)
# --------------------------------------------------------------------------------------------------


def check_page_table(op: str, page_table, ring) -> None:
    """Check the optional ``(S, n)`` int32/int64 page table against the ``(2, P, H, page_size, Dh)`` paged
    ``ring``; ``op`` names the op in the message.

    Raises:
        TypeError: not a tensor or None. ValueError: not 2-D with at least one page per ring, another
            dtype, or another device than the ring's.
    """
    if page_table is None:
        return
    if not isinstance(page_table, torch.Tensor):
        raise TypeError(f"{op}: `page_table` must be a tensor or None, got {type(page_table).__name__}")
    if page_table.dim() != 2 or page_table.shape[1] < 1:
        raise ValueError(
            f"{op}: `page_table` must be (S, pages per ring) with at least one page, got {tuple(page_table.shape)}"
        )
    if page_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: `page_table` must be int32 or int64, got {page_table.dtype}")
    if page_table.device != ring.device:
        raise ValueError(f"{op}: `page_table` is on {page_table.device}, the ring on {ring.device}")


# --------------------------------------------------------------------------------------------------
# What both ring kernels use (this module's and ring_attention.py's): rotated loads, the addresses
# of ring cells, the store of a block of chunk tokens, and the kernel arguments of RoPE and paging
# --------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def load_rotated(
        x_ptrs,
        cos_ptrs,
        sin_ptrs,
        load_ok,
        half_ok,
        BLOCK: tl.constexpr,
        BLOCK_D: tl.constexpr,
        ROPE: tl.constexpr,
    ):
        # A (BLOCK, BLOCK_D) tile of queries or keys in its own dtype; with ROPE, rotated by GPT-J pairs
        # (x[2i], x[2i+1]) with the (BLOCK, BLOCK_D // 2) float32 tables, each product and sum rounded
        # to float32 on its own (launched with enable_fp_fusion=False), then rounded to the input dtype:
        # bitwise step_metadata.apply_rope.
        x = tl.load(x_ptrs, mask=load_ok, other=0.0)
        if ROPE:
            cos = tl.load(cos_ptrs, mask=half_ok, other=0.0)
            sin = tl.load(sin_ptrs, mask=half_ok, other=0.0)
            re, im = tl.split(tl.reshape(x.to(tl.float32), (BLOCK, BLOCK_D // 2, 2)))
            rotated = tl.join(re * cos - im * sin, re * sin + im * cos)
            x = tl.reshape(rotated, (BLOCK, BLOCK_D)).to(x.dtype)
        return x

    @triton.jit
    def cell_pointers(
        ring_ptr,
        slot,
        head,
        cell,
        ok,
        page_table_ptr,
        page_table_stride_s,
        page_table_stride_p,
        ring_stride_s,
        ring_stride_h,
        ring_stride_c,
        PAGED: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
    ):
        # Pointers to ring cells `cell` (a vector) of one (slot, head). Unpaged, the slot indexes the
        # the ring's second axis; paged, that axis holds pages and cell c of the slot lives at row
        # c mod PAGE_SIZE of page page_table[slot, c // PAGE_SIZE]. Masked-off cells read no page id.
        # PAGE_SIZE is a compile-time constant, so both become multiplies and shifts.
        if PAGED:
            page = tl.load(
                page_table_ptr + slot * page_table_stride_s + (cell // PAGE_SIZE) * page_table_stride_p,
                mask=ok,
                other=0,
            ).to(tl.int64)
            return ring_ptr + page * ring_stride_s + head * ring_stride_h + (cell % PAGE_SIZE) * ring_stride_c
        else:
            return ring_ptr + slot * ring_stride_s + head * ring_stride_h + cell * ring_stride_c

    @triton.jit
    def store_tokens(
        token,
        ok,
        head,
        slot,
        offset,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        ring_ptr,
        capacity,
        head_dim,
        rope_stride_t,
        rope_stride_d,
        k_stride_h,
        k_stride_t,
        k_stride_d,
        v_stride_h,
        v_stride_t,
        v_stride_d,
        ring_stride_p,
        ring_stride_s,
        ring_stride_h,
        ring_stride_c,
        ring_stride_d,
        page_table_ptr,
        page_table_stride_s,
        page_table_stride_p,
        ROPE: tl.constexpr,
        PAGED: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Store chunk tokens `token` (a BLOCK_T vector, only where `ok`) of one (row, head) into cells
        # (offset + token) mod C of the slot's ring: keys rotated as load_rotated rotates them. The pointers
        # and the tables' pointers point at the row's first token.
        d = tl.arange(0, BLOCK_D)
        load_ok = ok[:, None] & (d < head_dim)[None, :]
        pair = tl.arange(0, BLOCK_D // 2)
        rope = token[:, None] * rope_stride_t + pair[None, :] * rope_stride_d
        keys = load_rotated(
            k_ptr + head * k_stride_h + token[:, None] * k_stride_t + d[None, :] * k_stride_d,
            cos_ptr + rope,
            sin_ptr + rope,
            load_ok,
            ok[:, None] & (pair < head_dim // 2)[None, :],
            BLOCK_T,
            BLOCK_D,
            ROPE,
        )
        values = tl.load(
            v_ptr + head * v_stride_h + token[:, None] * v_stride_t + d[None, :] * v_stride_d,
            mask=load_ok,
        )
        cells = cell_pointers(
            ring_ptr,
            slot,
            head,
            (offset + token) % capacity,
            ok,
            page_table_ptr,
            page_table_stride_s,
            page_table_stride_p,
            ring_stride_s,
            ring_stride_h,
            ring_stride_c,
            PAGED,
            PAGE_SIZE,
        )
        dst = cells[:, None] + d[None, :] * ring_stride_d
        tl.store(dst, keys, mask=load_ok)
        tl.store(dst + ring_stride_p, values, mask=load_ok)


def paging_arguments(ring, page_table, fallback):
    """The ring kernels' view of a ring: ``(capacity, page-table arguments, PAGED, PAGE_SIZE)``.

    ``ring`` is ``(2, S, H, C, Dh)``, or ``(2, P, H, page_size, Dh)`` with ``page_table`` ``(S, n)``;
    the page-table arguments are the table and its two strides, or ``(fallback, 0, 0)`` unpaged (a
    tensor the kernel never reads). Capacity is ``C``, or ``n x page_size``.
    """
    if page_table is None:
        return ring.shape[3], (fallback, 0, 0), False, 1
    page_size = ring.shape[3]
    return page_table.shape[1] * page_size, (page_table, *page_table.stride()), True, page_size


def rope_arguments(cos, sin, fallback):
    """The ring kernels' RoPE arguments: ``((cos, sin, stride_t, stride_d), ROPE)`` for the packed
    ``(1, 1, N, Dh/2)`` tables of packed rows, or ``((fallback, fallback, 0, 0), False)`` without them
    (``fallback`` is a tensor the kernel never reads)."""
    if cos is None:
        return (fallback, fallback, 0, 0), False
    return (cos, sin, cos.stride(2), cos.stride(3)), True


# --------------------------------------------------------------------------------------------------
# The write kernel, its launch, and the reference
# --------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _ring_write_kernel(
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        ring_ptr,
        slot_ids_ptr,
        offsets_ptr,
        valid_tokens_ptr,
        capacity,
        head_dim,
        rope_stride_t,
        rope_stride_d,
        k_stride_h,
        k_stride_t,
        k_stride_d,
        v_stride_h,
        v_stride_t,
        v_stride_d,
        ring_stride_p,
        ring_stride_s,
        ring_stride_h,
        ring_stride_c,
        ring_stride_d,
        slot_ids_stride,
        offsets_stride,
        valid_tokens_stride,
        page_table_ptr,
        page_table_stride_s,
        page_table_stride_p,
        token_start_ptr,  # (B,) first token of each row in k and v
        ROPE: tl.constexpr,
        PAGED: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Program (row, head, tile) stores kept tokens i in [tile * BLOCK_T, tile * BLOCK_T + BLOCK_T).
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        tile = tl.program_id(2)
        written = tl.load(valid_tokens_ptr + row * valid_tokens_stride).to(tl.int64)
        # Rows that wrote nothing do not even read their slot id (padding rows share the null slot).
        if written > 0:
            slot = tl.load(slot_ids_ptr + row * slot_ids_stride).to(tl.int64)
            offset = tl.load(offsets_ptr + row * offsets_stride).to(tl.int64)
            # The last min(n, C) valid tokens are the latest of their cells and map to distinct cells;
            # earlier tokens would be overwritten within the step, so they are skipped.
            kept = tl.minimum(written, capacity)
            i = tile * BLOCK_T + tl.arange(0, BLOCK_T)
            # The row's first token, token_start[b] of the packed (1, H, N, Dh) keys and values (tables likewise).
            start = tl.load(token_start_ptr + row).to(tl.int64)
            k_ptr += start * k_stride_t
            v_ptr += start * v_stride_t
            cos_ptr += start * rope_stride_t
            sin_ptr += start * rope_stride_t
            store_tokens(
                written - kept + i, i < kept, head, slot, offset,
                k_ptr, v_ptr, cos_ptr, sin_ptr, ring_ptr, capacity, head_dim,
                rope_stride_t, rope_stride_d,
                k_stride_h, k_stride_t, k_stride_d,
                v_stride_h, v_stride_t, v_stride_d,
                ring_stride_p, ring_stride_s, ring_stride_h, ring_stride_c, ring_stride_d,
                page_table_ptr, page_table_stride_s, page_table_stride_p,
                ROPE, PAGED, PAGE_SIZE, BLOCK_T, BLOCK_D,
            )  # fmt: skip


def launch_ring_write_triton(
    k, v, ring, slot_ids, offsets, valid_tokens, token_start, num_tokens, cos=None, sin=None, page_table=None
) -> None:
    """Launch the write kernel (compiled on CUDA; interpreted on CPU under TRITON_INTERPRET=1); not validated here.

    Args:
        k, v: packed ``(1, H, N, Dh)`` keys (after RoPE, or before it when ``cos``/``sin`` are given) and values,
            in the ring dtype; row ``b``'s tokens start at ``token_start[b]``.
        ring: ``(2, S, H, C, Dh)`` the layer's rings (or pages, with ``page_table``); mutated.
        slot_ids, offsets, valid_tokens, token_start: ``(B,)`` int64, as ``ring_attention_write_packed`` takes them.
        num_tokens: ``T``, the most tokens of a row.
        cos, sin: optional packed ``(1, 1, N, Dh/2)`` float32 RoPE tables: keys are rotated as they are stored.
        page_table: optional ``(S, n)`` table of a paged ring.

    Chunk token ``t`` of row ``b`` is stored, both planes and all heads, at cell ``(offsets[b] + t) mod C`` of slot
    ``slot_ids[b]`` iff ``valid_tokens[b] - C <= t < valid_tokens[b]`` (:func:`ring_write_reference` on the grid).
    Grid ``(B, H, ceil(min(T, C) / BLOCK_T))``. Raises RuntimeError without Triton.
    """
    if not HAS_TRITON:
        raise RuntimeError("ring_write: the Triton kernel needs the `triton` package")
    num_heads, head_dim = k.shape[1], k.shape[3]
    num_rows = token_start.shape[0]
    capacity, paging, paged, page_size = paging_arguments(ring, page_table, slot_ids)
    kept = min(num_tokens, capacity)
    if num_rows == 0 or num_heads == 0 or head_dim == 0 or kept == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_t = max(1, min(triton.next_power_of_2(kept), _WRITE_TILE_ELEMENTS // block_d))
    grid = (num_rows, num_heads, triton.cdiv(kept, block_t))
    (cos, sin, *rope_strides), rope = rope_arguments(cos, sin, k)
    with device_guard(ring):
        _ring_write_kernel[grid](
            k,
            v,
            cos,
            sin,
            ring,
            slot_ids,
            offsets,
            valid_tokens,
            capacity,
            head_dim,
            *rope_strides,
            *k.stride()[1:],
            *v.stride()[1:],
            *ring.stride(),
            slot_ids.stride(0),
            offsets.stride(0),
            valid_tokens.stride(0),
            *paging,
            token_start,
            ROPE=rope,
            PAGED=paged,
            PAGE_SIZE=page_size,
            BLOCK_T=block_t,
            BLOCK_D=block_d,
            enable_fp_fusion=False,
        )


def ring_write_reference(k, v, ring, slot_ids, offsets, valid_tokens, cos=None, sin=None, page_table=None) -> None:
    """The write on the ``(B, H, T, Dh)`` grid: :func:`launch_ring_write_triton`'s effect on the rows' grid, with
    ``(B, 1, T, Dh/2)`` tables (``ring_attention_write_packed_reference`` gathers the packed rows into it).

    Uses ``nonzero`` (a host sync on CUDA), so it serves CPU execution and tests, not graph capture.
    A paged ring is written through a gathered copy of the rows' rings, stored back page by page.
    """
    if page_table is not None:
        rings = logical_rings(ring, page_table)
        ring_write_reference(k, v, rings, slot_ids, offsets, valid_tokens, cos, sin)
        store_logical_rings(ring, page_table, rings, slot_ids[valid_tokens > 0])
        return
    if cos is not None:
        k = apply_rope(k, cos, sin)
    num_rows, _, num_tokens, _ = k.shape
    capacity = ring.shape[3]
    token = torch.arange(num_tokens, device=k.device)
    kept = (token < valid_tokens.view(-1, 1)) & (token >= valid_tokens.view(-1, 1) - capacity)  # (B, T)
    row_idx, token_idx = kept.nonzero(as_tuple=True)  # (N,), (N,)
    cell = torch.remainder(offsets[row_idx] + token_idx, capacity)
    slot = slot_ids[row_idx]
    # Advanced indices split by a slice move to the front: both sides are (N, H, Dh).
    ring[0, slot, :, cell] = k[row_idx, :, token_idx]
    ring[1, slot, :, cell] = v[row_idx, :, token_idx]
