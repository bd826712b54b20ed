# SPDX-License-Identifier: Apache-2.0
"""Streaming attention that reads the state pool's rings in place: the kernel, its launch and launch table, and
the PyTorch reference on the ``(B, H, T, Dh)`` grid.

One attention layer of a streaming step (docs/ring_semantics.md) has two inputs besides the queries: the keys and
values of past tokens, kept per slot in the layer's ring ``(2, S, H, C, Dh)`` of the state pool, and the keys and
values of the chunk itself. The reference path (``attention.py``'s ``"sdpa"`` backend) gathers each row's whole
ring, concatenates the chunk, builds a dense mask and runs SDPA. The kernel here never gathers: for each (row,
head, block of queries) it walks the key positions the block may see, reading old positions from the slot's ring
(cell ``position mod C``) and new ones from the chunk, with an online softmax in float32. Both ring semantics
(``"upstream"``, ``"exact"``) are one kernel: they differ only in the oldest visible position. Rows are packed
(``token_packing.py``): row ``b``'s tokens start at token ``token_start[b]`` of ``(1, H, N, Dh)`` queries, keys
and values, and its output at the same tokens of ``(1, N, H, Dh)``, the layout the out-projection reads. With
``write`` the launch also stores each row's last ``min(valid tokens, C)`` chunk tokens into its ring
(``ops/ring_write.py``): for short rows the attention kernel stores the chunk itself, one program per (row, head)
walking its query blocks in order (a block's tokens only overwrite cells that block and earlier ones read), else
the write kernel runs after it. ``ops/ring_attention_packed.py``'s ``ring_attention_write_packed`` is the op that
launches it.

Key positions a query may see (query at position ``q``, row offset ``o``, ``n`` valid tokens, ``C`` =
ring capacity = attention window): always ``0 <= p <= q`` and ``q - p < C``; under ``"upstream"`` also
``p >= o + n - C`` (the chunk was written before attention, so the ring holds only the last ``C``
positions, the later position owning a shared cell). Positions ``p < o`` are read from the ring,
``p >= o`` from the chunk; both semantics therefore read the ring *before* this step's write, and the
write runs after the attention of the same layer. A query that sees no key (under ``"upstream"``, the
first ``n - C`` tokens of a chunk longer than the ring) outputs zeros, as PyTorch's SDPA does for a
fully masked row. Padding rows (``n = 0``) and padding queries (token ``>= n``) read nothing (not even
their slot id); padding tokens are never read as keys and never written, and no output is stored for them.

The launch is safe in CUDA-graph capture (no host syncs). Keys and queries arrive either already rotated, or
unrotated with the chunk's packed RoPE tables (``cos``, ``sin``): the kernels then rotate them as they load them,
with float32 roundings equal to ``step_metadata.apply_rope``'s (kernels launched with ``enable_fp_fusion=False``,
so no multiply-add is fused); either way ring contents are bitwise those of the reference path. The decoder
passes rotated inputs (``ops/rope.py``): on some H200s this kernel rotating as it loads ran many times slower than
on rotated inputs (``benchmarks/RESULTS.md``); ``bench_ring_attention.py`` times both.

Precision: scores ``q . k`` accumulate in float32 (16-bit inputs multiply exactly); the softmax is
float32 with base-2 exponentials; for 16-bit rings the probabilities are rounded to the ring dtype
before they multiply the values on 16-bit tensor cores with float32 accumulation (what fused SDPA
kernels do; faster than TF32 in every v2 shape of the launch sweep, see :func:`attention_launch_config`),
and they stay float32 (IEEE products) for float32 rings. Runs are deterministic: a fixed launch grid and
a fixed key order per program.

The kernel walks one block of queries with ``_attend_query_block`` (its online softmax is
``_online_softmax_block``); the fused write stores chunk tokens with ``ring_write.py``'s
``store_tokens``, which also holds the jit helpers, RoPE and paging arguments both ring kernels share. The
launch table (:func:`attention_launch_config`) is plain Python: it answers where Triton is not installed. The
reference (:func:`ring_attention_write_reference`, the attention alone :func:`ring_attention_reference`) runs on
the grid of the rows: ``attend_gathered_rows`` over the gathered rings, then ``ring_write_reference``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..step_metadata import apply_rope, build_ring_metadata
from .dispatch import HAS_TRITON, device_guard, tl, triton
from .ring_reference import attend_gathered_rows, logical_rings
from .ring_write import launch_ring_write_triton, paging_arguments, ring_write_reference, rope_arguments

if HAS_TRITON:
    from .ring_write import cell_pointers, load_rotated, store_tokens

__all__ = [
    "FUSED_WRITE_MAX_TOKENS",
    "LAUNCH_KEYS",
    "MIN_ATTENTION_PROGRAMS",
    "attention_launch_config",
    "launch_ring_attention_triton",
    "ring_attention_reference",
    "ring_attention_write_reference",
]


# --------------------------------------------------------------------------------------------------
# Launch table (per step shape: blocks, warps, stages, how probabilities meet values, fused write)
# --------------------------------------------------------------------------------------------------

#: Keys per inner iteration of the attention kernel.
_BLOCK_KEYS = 64
#: Largest block of queries per program for float32 rings (smaller steps use the next power of two >= T,
#: at least 16); 16-bit rings go up to 128 (``attention_launch_config``).
_MAX_BLOCK_QUERIES = 64
#: Most tokens per row for which the attention kernel fuses the write (``attention_launch_config``).
FUSED_WRITE_MAX_TOKENS = 32
#: Fewest programs of 128 queries a 16-bit step needs before it uses 128-query blocks (about two per SM
#: of an H200's 132; ``attention_launch_config``).
MIN_ATTENTION_PROGRAMS = 256
#: The keys of a launch configuration (``attention_launch_config``), which ``tuning`` may override.
LAUNCH_KEYS = ("block_q", "block_k", "num_warps", "num_stages", "pv", "fused_write")


def attention_launch_config(num_tokens: int, ring_dtype: torch.dtype, row_heads: int | None = None) -> dict:
    """Launch parameters of the attention kernel for a step of ``num_tokens`` tokens per row.

    Args:
        num_tokens: ``T``, tokens per row in the step.
        ring_dtype: the rings' dtype.
        row_heads: ``B x H``, the step's (row, head) pairs; None counts as many.
    Returns:
        A dict with ``block_q`` (queries per program), ``block_k`` (keys per inner iteration),
        ``num_warps``, ``num_stages`` (software pipelining depth of the key loops), ``pv`` (how
        probabilities meet values: ``"low"`` rounds them to the 16-bit ring dtype and multiplies on
        16-bit tensor cores, ``"ieee"`` keeps float32) and ``fused_write`` (whether
        a launch with ``write`` stores the chunk from the attention kernel, one program per
        (row, head) walking its query blocks in order, rather than with the write kernel after it).

    Chosen on an H200 from the launch sweeps of ``benchmarks/RESULTS.md`` (block sizes, stages and
    ``pv`` over the v2 codec's six group shapes at 64 and 128 rows, T = 1 and 15 frames; the 64-query
    block and the fused write at 1 to 128 rows). For 16-bit rings ``"low"`` was the fastest in every
    shape. The best block is
    the smallest power of two >= T up to 64 queries (16, 32, 64), and 128 above, except when a step
    has fewer than ``MIN_ATTENTION_PROGRAMS`` programs of 128 queries (one row at T = 15): 64 then
    doubles them. Three pipeline stages won at 30 tokens and above, two at 15. The fused write pays
    only where a row is one small block (T <= 32 tokens: reading the chunk again and one launch are
    a large share there); with several blocks per row, one program per (row, head) left the device
    idler than the separate write costs. Float32 rings keep the configuration they were validated
    with (and the same write rule).
    """
    if ring_dtype == torch.float32:
        block_q = min(_MAX_BLOCK_QUERIES, max(16, _next_power_of_2(num_tokens)))
        config = dict(block_q=block_q, block_k=_BLOCK_KEYS, num_warps=4, num_stages=2, pv="ieee")
    else:
        block_q = max(16, _next_power_of_2(num_tokens))
        if block_q > 64:
            few = row_heads is not None and row_heads * -(-num_tokens // 128) < MIN_ATTENTION_PROGRAMS
            block_q = 64 if few else 128
        num_stages = 2 if num_tokens <= 16 else 3
        config = dict(block_q=block_q, block_k=_BLOCK_KEYS, num_warps=4, num_stages=num_stages, pv="low")
    config["fused_write"] = num_tokens <= FUSED_WRITE_MAX_TOKENS
    return config


def _launch_config(num_tokens: int, ring_dtype: torch.dtype, tuning: dict | None, row_heads: int | None = None) -> dict:
    """:func:`attention_launch_config` with ``tuning``'s entries in place of the defaults.

    Raises:
        ValueError: ``tuning`` names a key outside :data:`LAUNCH_KEYS`.
    """
    config = attention_launch_config(num_tokens, ring_dtype, row_heads)
    unknown = sorted(set(tuning or ()) - set(LAUNCH_KEYS))
    if unknown:
        raise ValueError(f"ring_attention: unknown launch configuration keys {unknown}; expected some of {LAUNCH_KEYS}")
    config.update(tuning or {})
    return config


def _next_power_of_2(n: int) -> int:
    # triton.next_power_of_2's value, here so that attention_launch_config also answers without Triton.
    return 1 << max(n - 1, 0).bit_length()


# --------------------------------------------------------------------------------------------------
# The kernel (one block of queries, its online softmax, the program), its launch, the reference
# --------------------------------------------------------------------------------------------------

if HAS_TRITON:
    # The kernel's body for one block of queries is _attend_query_block: it walks the old key positions the
    # block may see in the slot's ring (position p in cell p mod C, addressed by cell_pointers, so paged
    # caches too), then the new positions in the chunk, and folds each block of keys into a float32 online
    # softmax with base-2 exponentials (_online_softmax_block). The kernel runs it once per program, or,
    # with the fused write, for each query block of its row in order.

    @triton.jit
    def _online_softmax_block(
        q,
        keys,
        values,
        visible,
        m_i,
        l_i,
        acc,
        scale_log2,
        QK_PRECISION: tl.constexpr,
        PV_PRECISION: tl.constexpr,
    ):
        # One block of keys folded into the running (max, sum, output) of each query, base 2.
        scores = tl.dot(q, tl.trans(keys), input_precision=QK_PRECISION) * scale_log2
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A query with no visible key so far keeps m = -inf; rebasing on 0 keeps exp2 finite (it gives 0).
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(scores - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if PV_PRECISION == "low":
            # Probabilities rounded to the values' 16-bit dtype (as fused SDPA kernels do), accumulated in float32.
            acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, values.to(tl.float32), input_precision=PV_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _attend_query_block(
        first,  # the block's first query (chunk token index)
        head,
        written,
        slot,
        offset,
        q_ptr,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        ring_ptr,
        out_ptr,
        num_tokens,
        capacity,
        head_dim,
        scale_log2,
        rope_stride_t,
        rope_stride_d,
        q_stride_h,
        q_stride_t,
        q_stride_d,
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
        out_stride_t,
        out_stride_h,
        out_stride_d,
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
    ):
        # Queries t in [first, first + BLOCK_Q) of one (row, head): attend, then store the output block. The
        # pointers of q, k, v, out and the tables point at the row's first token.
        t = first + tl.arange(0, BLOCK_Q)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        i = tl.arange(0, BLOCK_D // 2)  # RoPE pair index
        i_ok = i < head_dim // 2
        cos_row = cos_ptr + i[None, :] * rope_stride_d
        sin_row = sin_ptr + i[None, :] * rope_stride_d
        m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
        # Blocks holding no valid query (all of a padding row's) read nothing and store zeros.
        if first < written:
            q_ok = t < written
            q = load_rotated(
                q_ptr + head * q_stride_h + t[:, None] * q_stride_t + d[None, :] * q_stride_d,
                cos_row + t[:, None] * rope_stride_t,
                sin_row + t[:, None] * rope_stride_t,
                q_ok[:, None] & d_ok[None, :],
                q_ok[:, None] & i_ok[None, :],
                BLOCK_Q,
                BLOCK_D,
                ROPE,
            ).to(ring_ptr.dtype.element_ty)
            # Oldest position any query of the block may see: the window of its first query, and under
            # "upstream" the oldest position the post-write ring still holds.
            lowest = offset + first - capacity + 1
            if UPSTREAM:
                lowest = tl.maximum(lowest, offset + written - capacity)
            lowest = tl.maximum(lowest, 0)

            # Old positions [lowest, offset) from the ring: position p lives in cell p mod C.
            num_old = (offset - lowest).to(tl.int32)  # <= C - 1; negative when there is none
            first_cell = (lowest % capacity).to(tl.int32)
            ring_lo = num_old + t - capacity + 1  # the oldest ring key j each query sees
            for start in range(0, num_old, BLOCK_K):
                j = start + tl.arange(0, BLOCK_K)  # key position lowest + j
                key_ok = j < num_old
                cell = (first_cell + j) % capacity
                cells = cell_pointers(
                    ring_ptr,
                    slot,
                    head,
                    cell,
                    key_ok,
                    page_table_ptr,
                    page_table_stride_s,
                    page_table_stride_p,
                    ring_stride_s,
                    ring_stride_h,
                    ring_stride_c,
                    PAGED,
                    PAGE_SIZE,
                )
                address = cells[:, None] + d[None, :] * ring_stride_d
                load_ok = key_ok[:, None] & d_ok[None, :]
                keys = tl.load(address, mask=load_ok, other=0.0)
                values = tl.load(address + ring_stride_p, mask=load_ok, other=0.0)
                # Query t sees key j when j >= num_old + t - C + 1 (q - p < C); keys past the ring never.
                # One compare per (query, key): cheaper than forming q - p (benchmarks/RESULTS.md).
                visible = tl.where(key_ok, j, -capacity)[None, :] >= ring_lo[:, None]
                m_i, l_i, acc = _online_softmax_block(
                    q, keys, values, visible, m_i, l_i, acc, scale_log2, QK_PRECISION, PV_PRECISION
                )

            # New positions from the chunk: tokens [max(lowest - offset, 0), min(written, first + BLOCK_Q)).
            chunk_lo = tl.maximum(lowest - offset, 0).to(tl.int32)
            chunk_hi = tl.minimum(written, first + BLOCK_Q)
            k_row = k_ptr + head * k_stride_h
            v_row = v_ptr + head * v_stride_h
            for start in range(chunk_lo, chunk_hi, BLOCK_K):
                s = start + tl.arange(0, BLOCK_K)
                key_ok = s < chunk_hi
                load_ok = key_ok[:, None] & d_ok[None, :]
                keys = load_rotated(
                    k_row + s[:, None] * k_stride_t + d[None, :] * k_stride_d,
                    cos_row + s[:, None] * rope_stride_t,
                    sin_row + s[:, None] * rope_stride_t,
                    load_ok,
                    key_ok[:, None] & i_ok[None, :],
                    BLOCK_K,
                    BLOCK_D,
                    ROPE,
                )
                values = tl.load(v_row + s[:, None] * v_stride_t + d[None, :] * v_stride_d, mask=load_ok, other=0.0)
                # Query t sees token s when t - C < s <= t; a stored query (t < T) never sees a token past
                # the loop's end, which compares as 2C + T.
                s_key = tl.where(key_ok, s, 2 * capacity + num_tokens)[None, :]
                visible = (s_key <= t[:, None]) & (s_key > t[:, None] - capacity)
                m_i, l_i, acc = _online_softmax_block(
                    q, keys, values, visible, m_i, l_i, acc, scale_log2, QK_PRECISION, PV_PRECISION
                )

        # l == 0: the query saw no key (zeros, as SDPA). A NaN l (a NaN or infinite key or value it saw)
        # is kept: the output is NaN, as SDPA's, not a silent zero.
        has_keys = (t < written) & (l_i != 0.0)
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        out = tl.where(has_keys[:, None], out, 0.0)
        # A row is followed by the next row's tokens: only its valid queries are stored.
        store_ok = t < written
        tl.store(
            out_ptr + head * out_stride_h + t[:, None] * out_stride_t + d[None, :] * out_stride_d,
            out.to(out_ptr.dtype.element_ty),
            mask=store_ok[:, None] & d_ok[None, :],
        )

    @triton.jit
    def _ring_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        ring_ptr,
        out_ptr,
        slot_ids_ptr,
        offsets_ptr,
        valid_tokens_ptr,
        token_start_ptr,  # (B,) first token of each row in q, k, v and out
        num_tokens,  # T, the most tokens of a row
        capacity,  # C, also the attention window
        head_dim,  # Dh
        scale_log2,  # log2(e) / sqrt(Dh)
        rope_stride_t,  # of cos and sin (1, 1, N, Dh/2)
        rope_stride_d,
        q_stride_h,  # of q, k, v (1, H, N, Dh)
        q_stride_t,
        q_stride_d,
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
        out_stride_t,  # of out (1, N, H, Dh)
        out_stride_h,
        out_stride_d,
        slot_ids_stride,
        offsets_stride,
        valid_tokens_stride,
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
        # write kernel's store, fused). That order is what makes the fused write safe under "exact":
        # token t overwrites the cell of position offset + t - C, which only queries t - C <= t' < t
        # read, all in this block or earlier ones; later blocks read no cell written so far. Under
        # "upstream" no query reads a cell this step overwrites at all.
        # Row, head and slot are widened to int64 before they meet a stride (pools exceed 2**31 elements).
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        written = tl.load(valid_tokens_ptr + row * valid_tokens_stride).to(tl.int32)
        # Padding rows (written == 0) never read their slot id: it may be out of range.
        has_work = written > 0
        slot = tl.load(slot_ids_ptr + row * slot_ids_stride, mask=has_work, other=0).to(tl.int64)
        offset = tl.load(offsets_ptr + row * offsets_stride, mask=has_work, other=0).to(tl.int64)
        # Where the row's tokens start: token token_start[b] of the packed (1, ., N, .) tensors. The helpers then
        # address the row from these bases.
        start = tl.load(token_start_ptr + row).to(tl.int64)
        q_ptr += start * q_stride_t
        k_ptr += start * k_stride_t
        v_ptr += start * v_stride_t
        out_ptr += start * out_stride_t
        cos_ptr += start * rope_stride_t
        sin_ptr += start * rope_stride_t
        if WRITE:
            kept_lo = written - tl.minimum(written, capacity)  # first token the write keeps
            for first in range(0, num_tokens, BLOCK_Q):
                _attend_query_block(
                    first, head, written, slot, offset,
                    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, ring_ptr, out_ptr,
                    num_tokens, capacity, head_dim, scale_log2,
                    rope_stride_t, rope_stride_d,
                    q_stride_h, q_stride_t, q_stride_d,
                    k_stride_h, k_stride_t, k_stride_d,
                    v_stride_h, v_stride_t, v_stride_d,
                    ring_stride_p, ring_stride_s, ring_stride_h, ring_stride_c, ring_stride_d,
                    out_stride_t, out_stride_h, out_stride_d,
                    page_table_ptr, page_table_stride_s, page_table_stride_p,
                    UPSTREAM, ROPE, PAGED, PAGE_SIZE, BLOCK_Q, BLOCK_K, BLOCK_D, QK_PRECISION, PV_PRECISION,
                )  # fmt: skip
                token = first + tl.arange(0, BLOCK_Q)
                if first + BLOCK_Q > kept_lo and first < written:
                    store_tokens(
                        token, (token >= kept_lo) & (token < written), head, slot, offset,
                        k_ptr, v_ptr, cos_ptr, sin_ptr, ring_ptr, capacity, head_dim,
                        rope_stride_t, rope_stride_d,
                        k_stride_h, k_stride_t, k_stride_d,
                        v_stride_h, v_stride_t, v_stride_d,
                        ring_stride_p, ring_stride_s, ring_stride_h, ring_stride_c, ring_stride_d,
                        page_table_ptr, page_table_stride_s, page_table_stride_p,
                        ROPE, PAGED, PAGE_SIZE, BLOCK_Q, BLOCK_D,
                    )  # fmt: skip
        else:
            _attend_query_block(
                tl.program_id(2) * BLOCK_Q, head, written, slot, offset,
                q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, ring_ptr, out_ptr,
                num_tokens, capacity, head_dim, scale_log2,
                rope_stride_t, rope_stride_d,
                q_stride_h, q_stride_t, q_stride_d,
                k_stride_h, k_stride_t, k_stride_d,
                v_stride_h, v_stride_t, v_stride_d,
                ring_stride_p, ring_stride_s, ring_stride_h, ring_stride_c, ring_stride_d,
                out_stride_t, out_stride_h, out_stride_d,
                page_table_ptr, page_table_stride_s, page_table_stride_p,
                UPSTREAM, ROPE, PAGED, PAGE_SIZE, BLOCK_Q, BLOCK_K, BLOCK_D, QK_PRECISION, PV_PRECISION,
            )  # fmt: skip


def launch_ring_attention_triton(
    q,
    k,
    v,
    ring,
    slot_ids,
    offsets,
    valid_tokens,
    token_start,
    num_tokens,
    ring_semantics,
    cos=None,
    sin=None,
    page_table=None,
    *,
    write=False,
    tuning=None,
) -> torch.Tensor:
    """Launch the attention kernel (compiled on CUDA; interpreted on CPU under TRITON_INTERPRET=1); not validated.

    Args:
        q, k, v: packed ``(1, H, N, Dh)`` queries (any float dtype; cast to the ring dtype), keys and values (in the
            ring dtype), after RoPE or, with ``cos``/``sin``, before it; row ``b``'s tokens start at
            ``token_start[b]``.
        ring, slot_ids, offsets, valid_tokens, token_start, ring_semantics, page_table: as
            ``ring_attention_write_packed`` takes them.
        num_tokens: ``T``, the most tokens of a row.
        cos, sin: optional packed ``(1, 1, N, Dh/2)`` float32 RoPE tables of the tokens' positions: the kernels
            then rotate ``q`` and ``k`` as they load them, bitwise ``step_metadata.apply_rope``.
        write: also store the chunk into the rings (``ops/ring_write.py``): fused into the attention kernel when
            the launch configuration's ``fused_write`` says so, else by the write kernel after it.
        tuning: entries that override :func:`attention_launch_config`'s (benchmarks sweep them).
    Returns:
        ``(1, N, H, Dh)`` in the ring dtype: each row's valid queries at their packed positions (zeros for
        queries that see no key), other positions as allocated.
    Raises:
        RuntimeError: without Triton. ValueError: ``tuning`` names an unknown key.
    """
    if not HAS_TRITON:
        raise RuntimeError("ring_attention: the Triton kernel needs the `triton` package")
    num_heads, head_dim = q.shape[1], q.shape[3]
    num_rows = token_start.shape[0]
    out = torch.empty((1, q.shape[2], num_heads, head_dim), dtype=ring.dtype, device=q.device)
    if out.numel() == 0 or num_rows == 0:
        return out
    config = _launch_config(num_tokens, ring.dtype, tuning, num_rows * num_heads)
    fused = write and config["fused_write"]
    _run_attention_kernel(
        q, k, v, ring, out, slot_ids, offsets, valid_tokens, ring_semantics, cos, sin, page_table, config, fused,
        (token_start, num_tokens),
    )  # fmt: skip
    if write and not fused:
        launch_ring_write_triton(
            k, v, ring, slot_ids, offsets, valid_tokens, token_start, num_tokens, cos, sin, page_table
        )
    return out


def _run_attention_kernel(
    q, k, v, ring, out, slot_ids, offsets, valid_tokens, ring_semantics, cos, sin, page_table, config, fused, rows
) -> None:
    """One launch of the attention kernel, into ``out`` ``(1, N, H, Dh)``, with ``config`` (an
    :func:`attention_launch_config` dict); ``fused``: the kernel also stores the chunk; ``rows``:
    ``(token_start, T)``. Grid ``(B, H, ceil(T / block_q))``, or ``(B, H, 1)`` when fused (one program walks a
    row's blocks)."""
    token_start, num_tokens = rows
    num_rows = token_start.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[3]
    capacity, paging, paged, page_size = paging_arguments(ring, page_table, slot_ids)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_q = config["block_q"]
    grid = (num_rows, num_heads, 1 if fused else triton.cdiv(num_tokens, block_q))
    (cos_arg, sin_arg, *rope_strides), rope = rope_arguments(cos, sin, q)
    with device_guard(ring):
        _ring_attention_kernel[grid](
            q,
            k,
            v,
            cos_arg,
            sin_arg,
            ring,
            out,
            slot_ids,
            offsets,
            valid_tokens,
            token_start,
            num_tokens,
            capacity,
            head_dim,
            math.log2(math.e) / math.sqrt(head_dim),
            *rope_strides,
            *q.stride()[1:],
            *k.stride()[1:],
            *v.stride()[1:],
            *ring.stride(),
            *out.stride()[1:],
            slot_ids.stride(0),
            offsets.stride(0),
            valid_tokens.stride(0),
            *paging,
            UPSTREAM=ring_semantics == "upstream",
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


@dataclass(frozen=True)
class _Window:
    # The fields of GroupSpec that build_ring_metadata reads; the reference needs no RoPE tables but
    # build_ring_metadata computes them, so any base serves.
    ring_capacity: int
    head_dim: int
    max_period: float = 10000.0

    @property
    def window(self) -> int:
        return self.ring_capacity


def ring_attention_reference(
    q, k, v, ring, slot_ids, offsets, valid_tokens, ring_semantics, cos=None, sin=None, page_table=None
) -> torch.Tensor:
    """The attention of :func:`launch_ring_attention_triton` on the rows' ``(B, H, T, Dh)`` grid: ``q``, ``k``, ``v``
    ``(B, H, T, Dh)``, tables ``(B, 1, T, Dh/2)``, the other arguments as the launch takes them; returns
    ``(B, T, H, Dh)``, zeros for padding queries, padding rows and queries that see no key.

    Rotates ``q`` and ``k`` with ``step_metadata.apply_rope`` when tables are given, gathers the
    rows' rings, builds the step's ring metadata (``step_metadata.build_ring_metadata``) and runs
    :func:`attend_gathered_rows` (the reference path's computation); padding queries and padding
    rows are then set to zero, as the kernel leaves them.
    """
    if cos is not None:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    num_rows, num_heads, num_tokens, head_dim = q.shape
    # Rows that write nothing are never looked up (their ids may be out of range).
    slots = torch.where(valid_tokens > 0, slot_ids, 0)
    if page_table is not None:
        ring = logical_rings(ring, page_table)
    rows = ring.index_select(1, slots)
    meta = build_ring_metadata(_Window(ring.shape[3], head_dim), ring_semantics, offsets, valid_tokens, num_tokens)
    out = attend_gathered_rows(ring_semantics, rows, meta, q, k, v)  # (B, H, T, Dh)
    valid = torch.arange(num_tokens, device=q.device) < valid_tokens.view(num_rows, 1)  # (B, T)
    out = torch.where(valid.view(num_rows, 1, num_tokens, 1), out, torch.zeros((), dtype=out.dtype))
    return out.transpose(1, 2).contiguous()


def ring_attention_write_reference(
    q, k, v, ring, slot_ids, offsets, valid_tokens, ring_semantics, cos=None, sin=None, page_table=None
) -> torch.Tensor:
    """The attention and write of :func:`launch_ring_attention_triton` (``write=True``) on the rows' grid:
    :func:`ring_attention_reference`, then ``ring_write_reference``; arguments and result as
    :func:`ring_attention_reference`'s, ``ring`` mutated as the launch mutates it."""
    out = ring_attention_reference(q, k, v, ring, slot_ids, offsets, valid_tokens, ring_semantics, cos, sin, page_table)
    ring_write_reference(k, v, ring, slot_ids, offsets, valid_tokens, cos, sin, page_table)
    return out
