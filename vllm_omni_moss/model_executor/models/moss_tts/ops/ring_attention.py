# SPDX-License-Identifier: Apache-2.0
"""Streaming attention that reads the state pool's rings in place, alone or followed by the ring write.

One attention layer of a streaming step (docs/ring_semantics.md) has two inputs besides the queries:
the keys and values of past tokens, kept per slot in the layer's ring ``(2, S, H, C, Dh)`` of the state
pool, and the keys and values of the chunk itself. The reference path (``attention.py``) gathers each
row's whole ring, concatenates the chunk, builds a dense mask and runs SDPA. The operations here
never gather:

* ``ring_attention`` - for each (row, head, block of queries), walk the key positions the block may see,
  reading old positions from the slot's ring (cell ``position mod C``) and new ones from the chunk, with
  an online softmax in float32. Both ring semantics (``"upstream"``, ``"exact"``) are one kernel: they
  differ only in the oldest visible position. Output ``(B, T, H, Dh)``, the layout the out-projection
  reads after ``transpose(1, 2)`` without a copy.
* ``ring_attention_write`` - ``ring_attention``, then ``ring_write`` (``ops/ring_write.py``: each row's
  last ``min(valid tokens, C)`` chunk tokens into its ring), as one op: for short rows the attention
  kernel stores the chunk itself, one program per (row, head) walking its query blocks in order (a
  block's tokens only overwrite cells that block and earlier ones read).

Key positions a query may see (query at position ``q``, row offset ``o``, ``n`` valid tokens, ``C`` =
ring capacity = attention window): always ``0 <= p <= q`` and ``q - p < C``; under ``"upstream"`` also
``p >= o + n - C`` (the chunk was written before attention, so the ring holds only the last ``C``
positions, the later position owning a shared cell). Positions ``p < o`` are read from the ring,
``p >= o`` from the chunk; both semantics therefore read the ring *before* this step's write, and the
write runs after the attention of the same layer. A query that sees no key (under ``"upstream"``, the
first ``n - C`` tokens of a chunk longer than the ring) outputs zeros, as PyTorch's SDPA does for a
fully masked row. Padding rows (``n = 0``) and padding queries (token ``>= n``) read nothing (not even
their slot id) and output zeros; padding tokens are never read as keys and never written.

Each operation comes with a Triton kernel, a ``torch.library.custom_op`` (namespace ``vllm_omni_moss``)
with ``register_fake``, a PyTorch reference, and a public function that validates shapes. Dispatch is
``ops/_triton.py``'s ``runs_triton_kernel``: CUDA tensors launch the kernel; CPU tensors run the reference
unless the Triton interpreter is active (``TRITON_INTERPRET=1`` at import), then the kernel runs
interpreted, except for bfloat16 rings (the interpreter's bfloat16 arithmetic is not the GPU's). Both are
safe in ``torch.compile(fullgraph=True)`` (opaque ops, fake impls) and in CUDA-graph capture (no host
syncs). Keys and queries arrive either already rotated, or unrotated with the chunk's RoPE tables
(``cos``, ``sin``): the kernels then rotate them as they load them, with float32 roundings equal to
``step_metadata.apply_rope``'s (kernels launched with ``enable_fp_fusion=False``, so no multiply-add
is fused); either way ring contents are bitwise those of the reference path. The decoder passes rotated
inputs (``ops/rope.py``): on some H200s this kernel rotating as it loads ran many times slower than on
rotated inputs (``benchmarks/RESULTS.md``).

Precision: scores ``q . k`` accumulate in float32 (16-bit inputs multiply exactly); the softmax is
float32 with base-2 exponentials; for 16-bit rings the probabilities are rounded to the ring dtype
before they multiply the values on 16-bit tensor cores with float32 accumulation (what fused SDPA
kernels do; faster than TF32 in every v2 shape of the launch sweep, see :func:`attention_launch_config`),
and they stay float32 (IEEE products) for float32 rings. Runs are deterministic: a fixed launch grid and
a fixed key order per program.

The kernel's body for one block of queries is ``ops/_ring_attention_block.py``'s ``_attend_query_block``,
and the store of the fused write ``ops/ring_write.py``'s ``_store_tokens``. ``ring_write``,
``ring_write_reference`` and ``RING_DTYPES`` (``ops/ring_write.py``), the launch table
(``attention_launch_config``, ``FUSED_WRITE_MAX_TOKENS``, ..., ``ops/ring_attention_launch.py``) and
``attend_gathered_rows`` (``ops/ring_reference.py``) are re-exported here, where callers import them from.
"""

from __future__ import annotations

import math

import torch

from ..step_metadata import RING_SEMANTICS, apply_rope, build_ring_metadata
from ._triton import (
    HAS_TRITON,
    _check_tensor,
    _device_guard,
    _paging_arguments,
    _rope_arguments,
    runs_triton_kernel,
    tl,
    triton,
)
from .ring_attention_launch import (
    FUSED_WRITE_MAX_TOKENS,
    LAUNCH_KEYS,
    MIN_ATTENTION_PROGRAMS,
    _launch_config,
    attention_launch_config,
)
from .ring_reference import _logical_rings, _Window, attend_gathered_rows
from .ring_write import (
    RING_DTYPES,
    _check_page_table,
    _check_rope,
    _check_step,
    _launch_ring_write_triton,
    ring_write,
    ring_write_reference,
)

if HAS_TRITON:
    from ._ring_attention_block import _attend_query_block
    from .ring_write import _store_tokens

__all__ = [
    "FUSED_WRITE_MAX_TOKENS",
    "LAUNCH_KEYS",
    "MIN_ATTENTION_PROGRAMS",
    "RING_DTYPES",
    "attend_gathered_rows",
    "attention_launch_config",
    "ring_attention",
    "ring_attention_reference",
    "ring_attention_write",
    "ring_attention_write_reference",
    "ring_write",
    "ring_write_reference",
]


# --------------------------------------------------------------------------------------------------
# Validation (shape/dtype/device only; the checks both ring ops share are ring_write.py's)
# --------------------------------------------------------------------------------------------------


def _check_semantics(op: str, semantics) -> None:
    if semantics not in RING_SEMANTICS:
        raise ValueError(f"{op}: unknown ring semantics {semantics!r}; expected one of {RING_SEMANTICS}")


def _check_attention(op, q, k, v, cache, slot_ids, offsets, num_written, semantics, cos, sin, page_table) -> None:
    """The argument checks of both attention ops (:func:`ring_attention`, :func:`ring_attention_write`)."""
    _check_semantics(op, semantics)
    shape = _check_step(op, k, v, cache, slot_ids, offsets, num_written)
    _check_tensor(op, "q", q, "(B, H, T, Dh)", shape, None, cache.device)
    if not q.dtype.is_floating_point:
        raise ValueError(f"{op}: `q` must have a floating-point dtype, got {q.dtype}")
    _check_rope(op, cos, sin, shape, cache.device)
    _check_page_table(op, page_table, cache)


# --------------------------------------------------------------------------------------------------
# ring_attention
# --------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _ring_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        cache_ptr,
        out_ptr,
        slot_ids_ptr,
        offsets_ptr,
        num_written_ptr,
        num_tokens,  # T
        capacity,  # C, also the attention window
        head_dim,  # Dh
        scale_log2,  # log2(e) / sqrt(Dh)
        rope_stride_b,  # of cos and sin (B, 1, T, Dh/2)
        rope_stride_t,
        rope_stride_d,
        q_stride_b,
        q_stride_h,
        q_stride_t,
        q_stride_d,
        k_stride_b,
        k_stride_h,
        k_stride_t,
        k_stride_d,
        v_stride_b,
        v_stride_h,
        v_stride_t,
        v_stride_d,
        cache_stride_p,
        cache_stride_s,
        cache_stride_h,
        cache_stride_c,
        cache_stride_d,
        out_stride_b,
        out_stride_t,
        out_stride_h,
        out_stride_d,
        slot_ids_stride,
        offsets_stride,
        num_written_stride,
        page_table_ptr,
        page_table_stride_s,
        page_table_stride_p,
        UPSTREAM: tl.constexpr,
        ROPE: tl.constexpr,
        PAGED: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_D: tl.constexpr,
        QK_PRECISION: tl.constexpr,
        PV_PRECISION: tl.constexpr,
        WRITE: tl.constexpr,
    ):
        # Without WRITE, program (row, head, block) attends queries [block * BLOCK_Q, + BLOCK_Q) of one
        # (row, head) and reads the ring only. With WRITE, program (row, head, 0) walks the row's query
        # blocks in order and stores each block's kept tokens into the ring after attending it (the
        # write of ring_write, fused). That order is what makes the fused write safe under "exact":
        # token t overwrites the cell of position offset + t - C, which only queries t - C <= t' < t
        # read, all in this block or earlier ones; later blocks read no cell written so far. Under
        # "upstream" no query reads a cell this step overwrites at all.
        # Row, head and slot are widened to int64 before they meet a stride (pools exceed 2**31 elements).
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        written = tl.load(num_written_ptr + row * num_written_stride).to(tl.int32)
        # Padding rows (written == 0) never read their slot id: it may be out of range.
        has_work = written > 0
        slot = tl.load(slot_ids_ptr + row * slot_ids_stride, mask=has_work, other=0).to(tl.int64)
        offset = tl.load(offsets_ptr + row * offsets_stride, mask=has_work, other=0).to(tl.int64)
        if WRITE:
            kept_lo = written - tl.minimum(written, capacity)  # first token ring_write keeps
            for first in range(0, num_tokens, BLOCK_Q):
                _attend_query_block(
                    first, row, head, written, slot, offset,
                    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, cache_ptr, out_ptr,
                    num_tokens, capacity, head_dim, scale_log2,
                    rope_stride_b, rope_stride_t, rope_stride_d,
                    q_stride_b, q_stride_h, q_stride_t, q_stride_d,
                    k_stride_b, k_stride_h, k_stride_t, k_stride_d,
                    v_stride_b, v_stride_h, v_stride_t, v_stride_d,
                    cache_stride_p, cache_stride_s, cache_stride_h, cache_stride_c, cache_stride_d,
                    out_stride_b, out_stride_t, out_stride_h, out_stride_d,
                    page_table_ptr, page_table_stride_s, page_table_stride_p,
                    UPSTREAM, ROPE, PAGED, PAGE_SIZE, BLOCK_Q, BLOCK_K, BLOCK_D, QK_PRECISION, PV_PRECISION,
                )  # fmt: skip
                token = first + tl.arange(0, BLOCK_Q)
                if first + BLOCK_Q > kept_lo and first < written:
                    _store_tokens(
                        token, (token >= kept_lo) & (token < written), row, head, slot, offset,
                        k_ptr, v_ptr, cos_ptr, sin_ptr, cache_ptr, capacity, head_dim,
                        rope_stride_b, rope_stride_t, rope_stride_d,
                        k_stride_b, k_stride_h, k_stride_t, k_stride_d,
                        v_stride_b, v_stride_h, v_stride_t, v_stride_d,
                        cache_stride_p, cache_stride_s, cache_stride_h, cache_stride_c, cache_stride_d,
                        page_table_ptr, page_table_stride_s, page_table_stride_p,
                        ROPE, PAGED, PAGE_SIZE, BLOCK_Q, BLOCK_D,
                    )  # fmt: skip
        else:
            _attend_query_block(
                tl.program_id(2) * BLOCK_Q, row, head, written, slot, offset,
                q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, cache_ptr, out_ptr,
                num_tokens, capacity, head_dim, scale_log2,
                rope_stride_b, rope_stride_t, rope_stride_d,
                q_stride_b, q_stride_h, q_stride_t, q_stride_d,
                k_stride_b, k_stride_h, k_stride_t, k_stride_d,
                v_stride_b, v_stride_h, v_stride_t, v_stride_d,
                cache_stride_p, cache_stride_s, cache_stride_h, cache_stride_c, cache_stride_d,
                out_stride_b, out_stride_t, out_stride_h, out_stride_d,
                page_table_ptr, page_table_stride_s, page_table_stride_p,
                UPSTREAM, ROPE, PAGED, PAGE_SIZE, BLOCK_Q, BLOCK_K, BLOCK_D, QK_PRECISION, PV_PRECISION,
            )  # fmt: skip


def _launch_ring_attention_triton(
    q,
    k,
    v,
    cache,
    slot_ids,
    offsets,
    num_written,
    semantics,
    cos=None,
    sin=None,
    page_table=None,
    *,
    write=False,
    tuning=None,
) -> torch.Tensor:
    """Launch the attention kernel (compiled on CUDA; interpreted on CPU under TRITON_INTERPRET=1).

    Arguments as in :func:`ring_attention`; not validated here. With ``write``, the chunk is also
    stored into the rings as :func:`ring_write` stores it (:func:`ring_attention_write`): fused into
    the attention kernel when the launch configuration's ``fused_write`` says so, else by the write
    kernel after it. ``tuning`` overrides entries of :func:`attention_launch_config` (benchmarks
    sweep it). Returns ``(B, T, H, Dh)`` in the cache dtype. Raises RuntimeError without Triton.
    """
    if not HAS_TRITON:
        raise RuntimeError("ring_attention: the Triton kernel needs the `triton` package")
    num_rows, num_heads, num_tokens, head_dim = q.shape
    out = torch.empty((num_rows, num_tokens, num_heads, head_dim), dtype=cache.dtype, device=q.device)
    if out.numel() == 0:
        return out
    config = _launch_config(num_tokens, cache.dtype, tuning, num_rows * num_heads)
    fused = write and config["fused_write"]
    _run_attention_kernel(
        q, k, v, cache, out, slot_ids, offsets, num_written, semantics, cos, sin, page_table, config, fused
    )
    if write and not fused:
        _launch_ring_write_triton(k, v, cache, slot_ids, offsets, num_written, cos, sin, page_table)
    return out


def _run_attention_kernel(
    q, k, v, cache, out, slot_ids, offsets, num_written, semantics, cos, sin, page_table, config, fused
) -> None:
    """One launch of the attention kernel, into ``out`` ``(B, T, H, Dh)``, with ``config`` (an
    :func:`attention_launch_config` dict); ``fused``: the kernel also stores the chunk. Grid
    ``(B, H, ceil(T / block_q))``, or ``(B, H, 1)`` when fused (one program walks a row's blocks)."""
    num_rows, num_heads, num_tokens, head_dim = q.shape
    capacity, paging, paged, page_size = _paging_arguments(cache, page_table, slot_ids)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_q = config["block_q"]
    grid = (num_rows, num_heads, 1 if fused else triton.cdiv(num_tokens, block_q))
    (cos_arg, sin_arg, *rope_strides), rope = _rope_arguments(cos, sin, q)
    with _device_guard(cache):
        _ring_attention_kernel[grid](
            q,
            k,
            v,
            cos_arg,
            sin_arg,
            cache,
            out,
            slot_ids,
            offsets,
            num_written,
            num_tokens,
            capacity,
            head_dim,
            math.log2(math.e) / math.sqrt(head_dim),
            *rope_strides,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *cache.stride(),
            *out.stride(),
            slot_ids.stride(0),
            offsets.stride(0),
            num_written.stride(0),
            *paging,
            UPSTREAM=semantics == "upstream",
            ROPE=rope,
            PAGED=paged,
            PAGE_SIZE=page_size,
            BLOCK_Q=block_q,
            BLOCK_K=config["block_k"],
            BLOCK_D=block_d,
            QK_PRECISION="ieee",
            PV_PRECISION=config["pv"],
            WRITE=fused,
            num_warps=config["num_warps"],
            num_stages=config["num_stages"],
            enable_fp_fusion=False,
        )


def ring_attention_reference(
    q, k, v, cache, slot_ids, offsets, num_written, semantics, cos=None, sin=None, page_table=None
) -> torch.Tensor:
    """PyTorch oracle for :func:`ring_attention`; same arguments and result.

    Rotates ``q`` and ``k`` with ``step_metadata.apply_rope`` when tables are given, gathers the
    rows' rings, builds the step's ring metadata (``step_metadata.build_ring_metadata``) and runs
    :func:`attend_gathered_rows` (the reference path's computation); padding queries and padding
    rows are then set to zero, as the kernel leaves them.
    """
    if cos is not None:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    num_rows, num_heads, num_tokens, head_dim = q.shape
    # Rows that write nothing are never looked up (their ids may be out of range).
    slots = torch.where(num_written > 0, slot_ids, 0)
    if page_table is not None:
        cache = _logical_rings(cache, page_table)
    rows = cache.index_select(1, slots)
    meta = build_ring_metadata(_Window(cache.shape[3], head_dim), semantics, offsets, num_written, num_tokens)
    out = attend_gathered_rows(semantics, rows, meta, q, k, v)  # (B, H, T, Dh)
    valid = torch.arange(num_tokens, device=q.device) < num_written.view(num_rows, 1)  # (B, T)
    out = torch.where(valid.view(num_rows, 1, num_tokens, 1), out, torch.zeros((), dtype=out.dtype))
    return out.transpose(1, 2).contiguous()


@torch.library.custom_op("vllm_omni_moss::ring_attention", mutates_args=())
def _ring_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    slot_ids: torch.Tensor,
    offsets: torch.Tensor,
    num_written: torch.Tensor,
    semantics: str,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    args = (q, k, v, cache, slot_ids, offsets, num_written, semantics, cos, sin, page_table)
    if runs_triton_kernel(cache):
        return _launch_ring_attention_triton(*args)
    return ring_attention_reference(*args)


def _attention_fake(
    q, k, v, cache, slot_ids, offsets, num_written, semantics, cos=None, sin=None, page_table=None
) -> torch.Tensor:
    # The fake impl of both attention ops: an empty (B, T, H, Dh) output in the cache dtype.
    num_rows, num_heads, num_tokens, head_dim = q.shape
    return q.new_empty((num_rows, num_tokens, num_heads, head_dim), dtype=cache.dtype)


_ring_attention_op.register_fake(_attention_fake)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    slot_ids: torch.Tensor,
    offsets: torch.Tensor,
    num_written: torch.Tensor,
    semantics: str,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's streaming attention for ``B`` rows, reading the rings in place (module docstring).

    Args:
        q: ``(B, H, T, Dh)`` floating queries (any float dtype; cast to the cache dtype), after
            RoPE, or before it when ``cos``/``sin`` are given.
        k, v: ``(B, H, T, Dh)`` the chunk's keys (after RoPE, or before it when ``cos``/``sin``
            are given) and values, in the cache dtype.
        cache: ``(2, S, H, C, Dh)`` the layer's rings (plane 0 keys, plane 1 values), read only. ``C``
            is both the ring capacity and the attention window (``GroupSpec.ring_capacity``).
        slot_ids: ``(B,)`` int64 slot of each row; read only for rows with ``num_written > 0``.
        offsets: ``(B,)`` int64 tokens each row wrote before this chunk (not reduced mod ``C``).
        num_written: ``(B,)`` int64 valid tokens of each row, in ``[0, T]``; tokens at or beyond it
            are padding.
        semantics: ``"upstream"`` or ``"exact"`` (``step_metadata.RING_SEMANTICS``).
        cos, sin: optional ``(B, 1, T, Dh/2)`` float32 RoPE tables of the chunk's positions
            (``step_metadata.rope_tables``): the kernel then rotates ``q`` and ``k`` as it loads
            them, bitwise ``step_metadata.apply_rope``, saving one pass over them.
        page_table: optional ``(S, n)`` int32/int64 table of a paged cache: ``cache`` is then
            ``(2, P, H, page_size, Dh)``, pages rather than slots on its second axis, each slot's ring
            has ``C = n x page_size`` cells and cell ``c`` of slot ``s`` is row ``c mod page_size`` of
            page ``page_table[s, c // page_size]``. Entries a step reads must be in ``[0, P)``.
    Returns:
        ``(B, T, H, Dh)`` in the cache dtype; zeros for padding queries, padding rows and queries
        that see no key. Call :func:`ring_write` (with the same tables) afterwards to store the chunk.
    Raises:
        TypeError: an argument is not a tensor.
        ValueError: a shape, dtype or device is inconsistent (the message names the argument), or
            unknown ``semantics``. Data (slot ranges, counts) is not checked: that would need a sync.
        RuntimeError: CUDA tensors without Triton installed.
    """
    _check_attention("ring_attention", q, k, v, cache, slot_ids, offsets, num_written, semantics, cos, sin, page_table)
    return torch.ops.vllm_omni_moss.ring_attention(
        q, k, v, cache, slot_ids, offsets, num_written, semantics, cos, sin, page_table
    )


def ring_attention_write_reference(
    q, k, v, cache, slot_ids, offsets, num_written, semantics, cos=None, sin=None, page_table=None
) -> torch.Tensor:
    """PyTorch oracle for :func:`ring_attention_write`: :func:`ring_attention_reference`, then
    :func:`ring_write_reference`; same arguments, result and effect."""
    out = ring_attention_reference(q, k, v, cache, slot_ids, offsets, num_written, semantics, cos, sin, page_table)
    ring_write_reference(k, v, cache, slot_ids, offsets, num_written, cos, sin, page_table)
    return out


@torch.library.custom_op("vllm_omni_moss::ring_attention_write", mutates_args=("cache",))
def _ring_attention_write_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    slot_ids: torch.Tensor,
    offsets: torch.Tensor,
    num_written: torch.Tensor,
    semantics: str,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    args = (q, k, v, cache, slot_ids, offsets, num_written, semantics, cos, sin, page_table)
    if runs_triton_kernel(cache):
        return _launch_ring_attention_triton(*args, write=True)
    return ring_attention_write_reference(*args)


_ring_attention_write_op.register_fake(_attention_fake)


def ring_attention_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    slot_ids: torch.Tensor,
    offsets: torch.Tensor,
    num_written: torch.Tensor,
    semantics: str,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's streaming attention and ring write: :func:`ring_attention` then :func:`ring_write`.

    Arguments and result as in :func:`ring_attention`; ``cache`` is mutated as :func:`ring_write`
    mutates it (same arguments), so the output and the ring contents are bitwise those of the two
    calls in order. On CUDA, for rows of at most ``FUSED_WRITE_MAX_TOKENS`` tokens, the write runs
    inside the attention kernel (``attention_launch_config``'s ``fused_write``), which saves reading
    the chunk's keys and values a second time and one launch per layer; longer rows run the two
    kernels in turn.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`ring_attention` and :func:`ring_write`.
    """
    _check_attention(
        "ring_attention_write", q, k, v, cache, slot_ids, offsets, num_written, semantics, cos, sin, page_table
    )
    return torch.ops.vllm_omni_moss.ring_attention_write(
        q, k, v, cache, slot_ids, offsets, num_written, semantics, cos, sin, page_table
    )
