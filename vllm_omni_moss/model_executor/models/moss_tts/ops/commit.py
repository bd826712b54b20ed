# SPDX-License-Identifier: Apache-2.0
"""Masked write-back of the codec decoder's ring KV state.

Two operations commit one decoder step into the persistent state pool:

* ``commit_ring`` copies, per row, the ring cells that row's valid tokens wrote from the step's rings
  ``(2, B, H, C, Dh)`` back into the pool ``(2, S, H, C, Dh)``; rows that wrote no token copy nothing.
* ``commit_offsets`` stores the advanced offsets of valid rows into a per-slot table ``(S,)``.

Both exist because the pool has one shared null slot: every padding row points at it, so a dense
``index_copy_`` would be a duplicate-destination write and would also mutate the null slot, which must
stay all-zero. Here invalid rows write nothing at all.

Each operation has four parts that sit together below: a Triton kernel, a ``torch.library.custom_op``
(namespace ``vllm_omni_moss``) with its ``register_fake``, a plain PyTorch reference, and a public
function that validates shapes and calls the op.

Dispatch inside the ops is ``ops/dispatch.py``'s: CUDA tensors launch the Triton kernel; CPU tensors run
the PyTorch reference unless the Triton interpreter is active at import, then the kernel runs
interpreted.

Both ops are safe inside ``torch.compile(fullgraph=True, dynamic=True)`` (fake impls, shape-only
validation) and inside CUDA-graph capture on CUDA (no host syncs, no data-dependent allocation).
"""

import torch

from .dispatch import HAS_TRITON, check_tensor, device_guard, runs_triton_kernel, tl, triton

# Elements per (time x head_dim) tile of commit_ring; 1024 keeps a bf16 tile at 2 KiB per plane.
_COMMIT_CACHE_TILE_ELEMENTS = 1024
# Rows handled by one program of commit_offsets.
_COMMIT_OFFSETS_BLOCK = 128


# --------------------------------------------------------------------------------------------------
# Validation (shape/dtype/device only: no data reads, so no device sync and no graph break)
# --------------------------------------------------------------------------------------------------


def _check_max_written(op: str, max_written) -> None:
    if isinstance(max_written, bool) or not isinstance(max_written, (int, torch.SymInt)):
        raise TypeError(f"{op}: `max_written` must be an int, got {type(max_written).__name__}")
    if max_written < 0:
        raise ValueError(f"{op}: `max_written` must be >= 0, got {max_written}")


# --------------------------------------------------------------------------------------------------
# commit_ring
# --------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _commit_ring_kernel(
        rows_ptr,
        ring_ptr,
        slot_ids_ptr,
        valid_tokens_ptr,
        offsets_ptr,
        capacity,  # C
        head_dim,  # Dh
        rows_stride_p,
        rows_stride_b,
        rows_stride_h,
        rows_stride_c,
        rows_stride_d,
        ring_stride_p,
        ring_stride_s,
        ring_stride_h,
        ring_stride_c,
        ring_stride_d,
        slot_ids_stride,
        valid_tokens_stride,
        offsets_stride,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Program (row, head, tile) copies chunk tokens t in [tile * BLOCK_T, tile * BLOCK_T + BLOCK_T)
        # of one (row, head) ring, both planes. All addresses are int64: the pool can exceed 2**31
        # elements, so row/head/slot/ring indices are widened before they meet a stride.
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        tile = tl.program_id(2)
        written = tl.load(valid_tokens_ptr + row * valid_tokens_stride).to(tl.int64)
        # Rows that wrote no token (padding rows, empty rows) write nothing, not even to their
        # (typically null) slot; their slot ids may be anything, so they are not even read.
        if written > 0:
            slot = tl.load(slot_ids_ptr + row * slot_ids_stride).to(tl.int64)
            offset = tl.load(offsets_ptr + row * offsets_stride).to(tl.int64)
            # Integer % truncates toward zero in Triton (and in its interpreter); fold into [0, C).
            start = offset % capacity
            start = tl.where(start < 0, start + capacity, start)
            t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
            d = tl.arange(0, BLOCK_D)
            # Valid token t of the chunk lands at ring index (offset + t) mod C. For t < min(n, C) (n the
            # row's written tokens) these indices are distinct and are exactly the set
            # {r : (r - offset) mod C < n}, so enumerating them writes every touched cell once and
            # nothing else. For n >= C that is the whole ring, holding the latest token of each cell.
            num_touched = tl.minimum(written, capacity)
            cell = start + t
            cell = tl.where(cell >= capacity, cell - capacity, cell)
            mask = (t < num_touched)[:, None] & (d < head_dim)[None, :]
            src = (
                rows_ptr
                + row * rows_stride_b
                + head * rows_stride_h
                + cell[:, None] * rows_stride_c
                + d[None, :] * rows_stride_d
            )
            dst = (
                ring_ptr
                + slot * ring_stride_s
                + head * ring_stride_h
                + cell[:, None] * ring_stride_c
                + d[None, :] * ring_stride_d
            )
            keys = tl.load(src, mask=mask)
            tl.store(dst, keys, mask=mask)
            values = tl.load(src + rows_stride_p, mask=mask)
            tl.store(dst + ring_stride_p, values, mask=mask)


def _launch_commit_ring_triton(
    rows: torch.Tensor,
    ring: torch.Tensor,
    slot_ids: torch.Tensor,
    offsets: torch.Tensor,
    valid_tokens: torch.Tensor,
    max_written: int,
) -> None:
    """Launch the commit_ring Triton kernel (compiled on CUDA; interpreted on CPU under TRITON_INTERPRET=1).

    Arguments as in :func:`commit_ring`; not validated here. Uses the tensors' strides, so views work.
    Grid ``(B, H, ceil(min(max_written, C) / BLOCK_T))``. Raises RuntimeError when Triton is not installed.
    """
    if not HAS_TRITON:
        raise RuntimeError("commit_ring: the Triton kernel needs the `triton` package")
    _, num_rows, num_heads, capacity, head_dim = rows.shape
    num_touched = min(int(max_written), capacity)
    if num_rows == 0 or num_heads == 0 or head_dim == 0 or num_touched == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_t = max(1, min(triton.next_power_of_2(num_touched), _COMMIT_CACHE_TILE_ELEMENTS // block_d))
    grid = (num_rows, num_heads, triton.cdiv(num_touched, block_t))
    with device_guard(ring):
        _commit_ring_kernel[grid](
            rows,
            ring,
            slot_ids,
            valid_tokens,
            offsets,
            capacity,
            head_dim,
            *rows.stride(),
            *ring.stride(),
            slot_ids.stride(0),
            valid_tokens.stride(0),
            offsets.stride(0),
            BLOCK_T=block_t,
            BLOCK_D=block_d,
        )


def touched_ring_mask(offsets: torch.Tensor, valid_tokens: torch.Tensor, capacity: int) -> torch.Tensor:
    """Ring cells each row's valid tokens write.

    offsets: ``(B,)`` int64 pre-step token offsets; valid_tokens: ``(B,)`` int64 valid tokens per row.
    Returns ``(B, C)`` bool, True at ring index r iff ``(r - offsets[b]) mod C < valid_tokens[b]``; all
    True when ``valid_tokens[b] >= C``, none when it is 0.
    """
    cell = torch.arange(capacity, device=offsets.device, dtype=offsets.dtype)
    distance = torch.remainder(cell[None, :] - offsets[:, None], capacity)  # in [0, C)
    return distance < valid_tokens[:, None]


def commit_ring_reference(
    rows: torch.Tensor,
    ring: torch.Tensor,
    slot_ids: torch.Tensor,
    offsets: torch.Tensor,
    valid_tokens: torch.Tensor,
    max_written: int,
) -> None:
    """PyTorch oracle for :func:`commit_ring`; same arguments and effect.

    Uses ``nonzero`` (a host sync on CUDA), so it serves CPU execution and tests, not graph capture.
    """
    touched = touched_ring_mask(offsets, valid_tokens.clamp(max=max_written), rows.shape[3])  # (B, C)
    row_idx, ring_idx = touched.nonzero(as_tuple=True)  # (N,), (N,)
    # Only writing rows' slot ids are looked up: padding rows may carry out-of-range ids.
    slot_idx = slot_ids[row_idx]
    # Advanced indices split by a slice move to the front: both sides are (N, 2, H, Dh).
    ring[:, slot_idx, :, ring_idx] = rows[:, row_idx, :, ring_idx]


@torch.library.custom_op("vllm_omni_moss::commit_ring", mutates_args=("ring",))
def _commit_ring_op(
    rows: torch.Tensor,
    ring: torch.Tensor,
    slot_ids: torch.Tensor,
    offsets: torch.Tensor,
    valid_tokens: torch.Tensor,
    max_written: int,
) -> None:
    if runs_triton_kernel(ring):
        _launch_commit_ring_triton(rows, ring, slot_ids, offsets, valid_tokens, max_written)
    else:
        commit_ring_reference(rows, ring, slot_ids, offsets, valid_tokens, max_written)


@_commit_ring_op.register_fake
def _commit_ring_fake(rows, ring, slot_ids, offsets, valid_tokens, max_written) -> None:
    return None


def commit_ring(
    rows: torch.Tensor,
    ring: torch.Tensor,
    slot_ids: torch.Tensor,
    offsets: torch.Tensor,
    valid_tokens: torch.Tensor,
    max_written: int,
) -> None:
    """Write the ring cells each row's valid tokens wrote from ``rows`` into ``ring``.

    Args:
        rows: ``(2, B, H, C, Dh)`` the step's rings after its write (plane 0 keys, plane 1 values).
        ring: ``(2, S, H, C, Dh)`` persistent pool, same dtype and device as ``rows``; mutated.
        slot_ids: ``(B,)`` int64 pool slot of each row. Among rows that wrote tokens they must be
            distinct and in ``[0, S)``; other rows' ids are never read.
        offsets: ``(B,)`` int64 pre-step token offsets (tokens written before this chunk, not mod C).
        valid_tokens: ``(B,)`` int64 valid tokens each row wrote this step, in ``[0, max_written]``;
            rows with 0 (padding rows) write nothing, so the null slot stays untouched.
        max_written: the step's tokens per row ``T`` (an upper bound of ``valid_tokens``, >= 0).

    For a row b, ring index r is touched iff ``(r - offsets[b]) mod C < valid_tokens[b]`` (every r when
    ``valid_tokens[b] >= C``); ``rows[p, b, h, r, :]`` is copied to ``ring[p, slot_ids[b], h, r, :]`` for
    both planes and all heads.

    Raises:
        TypeError: a tensor argument is not a tensor, or ``max_written`` is not an int.
        ValueError: a shape, dtype or device is inconsistent (message names the argument), or
            ``max_written < 0``. Data (slot ranges, uniqueness, counts) is not checked: that would
            need a sync.
        RuntimeError: CUDA tensors without Triton installed.
    """
    op = "commit_ring"
    check_tensor(op, "ring", ring, "(2, S, H, C, Dh)", (2, None, None, None, None), None, None)
    _, _, num_heads, capacity, head_dim = ring.shape
    check_tensor(op, "rows", rows, "(2, B, H, C, Dh)", (2, None, num_heads, capacity, head_dim), None, None)
    if rows.dtype != ring.dtype:
        raise ValueError(f"{op}: `rows` must have the dtype of `ring` ({ring.dtype}), got {rows.dtype}")
    if rows.device != ring.device:
        raise ValueError(f"{op}: `rows` must be on the device of `ring` ({ring.device}), got {rows.device}")
    num_rows = rows.shape[1]
    check_tensor(op, "slot_ids", slot_ids, "(B,)", (num_rows,), torch.int64, ring.device)
    check_tensor(op, "offsets", offsets, "(B,)", (num_rows,), torch.int64, ring.device)
    check_tensor(op, "valid_tokens", valid_tokens, "(B,)", (num_rows,), torch.int64, ring.device)
    _check_max_written(op, max_written)
    torch.ops.vllm_omni_moss.commit_ring(rows, ring, slot_ids, offsets, valid_tokens, max_written)


# --------------------------------------------------------------------------------------------------
# commit_offsets
# --------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _commit_offsets_kernel(
        values_ptr,
        table_ptr,
        slot_ids_ptr,
        valid_rows_ptr,
        num_rows,
        values_stride,
        table_stride,
        slot_ids_stride,
        valid_rows_stride,
        BLOCK: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_range = rows < num_rows
        valid = tl.load(valid_rows_ptr + rows * valid_rows_stride, mask=in_range, other=0) != 0
        # Invalid rows neither read their slot id nor write: many of them share the null slot.
        write = in_range & valid
        slot = tl.load(slot_ids_ptr + rows * slot_ids_stride, mask=write, other=0).to(tl.int64)
        value = tl.load(values_ptr + rows * values_stride, mask=write)
        tl.store(table_ptr + slot * table_stride, value, mask=write)


def _launch_commit_offsets_triton(
    values: torch.Tensor,
    table: torch.Tensor,
    slot_ids: torch.Tensor,
    valid_rows: torch.Tensor,
) -> None:
    """Launch the commit_offsets Triton kernel (compiled on CUDA; interpreted on CPU under TRITON_INTERPRET=1).

    Arguments as in :func:`commit_offsets`; not validated here. Grid ``(ceil(B / 128),)``.
    Raises RuntimeError when Triton is not installed.
    """
    if not HAS_TRITON:
        raise RuntimeError("commit_offsets: the Triton kernel needs the `triton` package")
    num_rows = values.shape[0]
    if num_rows == 0:
        return
    grid = (triton.cdiv(num_rows, _COMMIT_OFFSETS_BLOCK),)
    with device_guard(table):
        _commit_offsets_kernel[grid](
            values,
            table,
            slot_ids,
            valid_rows,
            num_rows,
            values.stride(0),
            table.stride(0),
            slot_ids.stride(0),
            valid_rows.stride(0),
            BLOCK=_COMMIT_OFFSETS_BLOCK,
        )


def commit_offsets_reference(
    values: torch.Tensor,
    table: torch.Tensor,
    slot_ids: torch.Tensor,
    valid_rows: torch.Tensor,
) -> None:
    """PyTorch oracle for :func:`commit_offsets`; same arguments and effect (host sync on CUDA)."""
    (row_idx,) = valid_rows.nonzero(as_tuple=True)
    table[slot_ids[row_idx]] = values[row_idx]


@torch.library.custom_op("vllm_omni_moss::commit_offsets", mutates_args=("table",))
def _commit_offsets_op(
    values: torch.Tensor,
    table: torch.Tensor,
    slot_ids: torch.Tensor,
    valid_rows: torch.Tensor,
) -> None:
    if runs_triton_kernel(table):
        _launch_commit_offsets_triton(values, table, slot_ids, valid_rows)
    else:
        commit_offsets_reference(values, table, slot_ids, valid_rows)


@_commit_offsets_op.register_fake
def _commit_offsets_fake(values, table, slot_ids, valid_rows) -> None:
    return None


def commit_offsets(
    values: torch.Tensor,
    table: torch.Tensor,
    slot_ids: torch.Tensor,
    valid_rows: torch.Tensor,
) -> None:
    """Store ``table[slot_ids[b]] = values[b]`` for every valid row b.

    Args:
        values: ``(B,)`` int64 new offsets (typically the step's ``next_offsets``).
        table: ``(S,)`` int64 per-slot offsets (e.g. one group's row of the offset table); mutated.
        slot_ids: ``(B,)`` int64; among valid rows distinct and in ``[0, S)``; invalid rows' ids are
            never read.
        valid_rows: ``(B,)`` bool; rows that are False write nothing.

    Raises:
        TypeError: an argument is not a tensor.
        ValueError: a shape, dtype or device is inconsistent (message names the argument).
        RuntimeError: CUDA tensors without Triton installed.
    """
    op = "commit_offsets"
    check_tensor(op, "table", table, "(S,)", (None,), torch.int64, None)
    check_tensor(op, "values", values, "(B,)", (None,), torch.int64, table.device)
    num_rows = values.shape[0]
    check_tensor(op, "slot_ids", slot_ids, "(B,)", (num_rows,), torch.int64, table.device)
    check_tensor(op, "valid_rows", valid_rows, "(B,)", (num_rows,), torch.bool, table.device)
    torch.ops.vllm_omni_moss.commit_offsets(values, table, slot_ids, valid_rows)


__all__ = [
    "commit_ring",
    "commit_ring_reference",
    "commit_offsets",
    "commit_offsets_reference",
    "touched_ring_mask",
]
