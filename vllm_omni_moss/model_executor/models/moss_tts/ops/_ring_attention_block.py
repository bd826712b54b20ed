# SPDX-License-Identifier: Apache-2.0
"""One block of queries of the ring attention kernel (``ring_attention.py``'s ``_ring_attention_kernel``).

``_attend_query_block`` attends queries ``[first, first + BLOCK_Q)`` of one (row, head) and stores their
output rows: it walks the old key positions the block may see in the slot's ring (position ``p`` in cell
``p mod C``, addressed by ``_triton._cell_pointers``, so paged caches too), then the new positions in
the chunk, and folds each block of keys into a float32 online softmax with base-2 exponentials
(``_online_softmax_block``). The kernel runs it once per program, or, with the fused write, for each
query block of its row in order. Which positions a query sees, what padding reads and the precision of
the dot products are stated in ``ring_attention.py``'s module docstring; the kernel's launch is there too.
"""

from ._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    from ._triton import _cell_pointers, _load_rotated

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
        row,
        head,
        written,
        slot,
        offset,
        q_ptr,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        cache_ptr,
        out_ptr,
        num_tokens,
        capacity,
        head_dim,
        scale_log2,
        rope_stride_b,
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
        # Queries t in [first, first + BLOCK_Q) of one (row, head): attend, then store the output block.
        t = first + tl.arange(0, BLOCK_Q)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        i = tl.arange(0, BLOCK_D // 2)  # RoPE pair index
        i_ok = i < head_dim // 2
        cos_row = cos_ptr + row * rope_stride_b + i[None, :] * rope_stride_d
        sin_row = sin_ptr + row * rope_stride_b + i[None, :] * rope_stride_d
        m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
        # Blocks holding no valid query (all of a padding row's) read nothing and store zeros.
        if first < written:
            q_ok = t < written
            q = _load_rotated(
                q_ptr + row * q_stride_b + head * q_stride_h + t[:, None] * q_stride_t + d[None, :] * q_stride_d,
                cos_row + t[:, None] * rope_stride_t,
                sin_row + t[:, None] * rope_stride_t,
                q_ok[:, None] & d_ok[None, :],
                q_ok[:, None] & i_ok[None, :],
                BLOCK_Q,
                BLOCK_D,
                ROPE,
            ).to(cache_ptr.dtype.element_ty)
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
                cells = _cell_pointers(
                    cache_ptr,
                    slot,
                    head,
                    cell,
                    key_ok,
                    page_table_ptr,
                    page_table_stride_s,
                    page_table_stride_p,
                    cache_stride_s,
                    cache_stride_h,
                    cache_stride_c,
                    PAGED,
                    PAGE_SIZE,
                )
                address = cells[:, None] + d[None, :] * cache_stride_d
                load_ok = key_ok[:, None] & d_ok[None, :]
                keys = tl.load(address, mask=load_ok, other=0.0)
                values = tl.load(address + cache_stride_p, mask=load_ok, other=0.0)
                # Query t sees key j when j >= num_old + t - C + 1 (q - p < C); keys past the ring never.
                # One compare per (query, key): cheaper than forming q - p (benchmarks/RESULTS.md).
                visible = tl.where(key_ok, j, -capacity)[None, :] >= ring_lo[:, None]
                m_i, l_i, acc = _online_softmax_block(
                    q, keys, values, visible, m_i, l_i, acc, scale_log2, QK_PRECISION, PV_PRECISION
                )

            # New positions from the chunk: tokens [max(lowest - offset, 0), min(written, first + BLOCK_Q)).
            chunk_lo = tl.maximum(lowest - offset, 0).to(tl.int32)
            chunk_hi = tl.minimum(written, first + BLOCK_Q)
            k_row = k_ptr + row * k_stride_b + head * k_stride_h
            v_row = v_ptr + row * v_stride_b + head * v_stride_h
            for start in range(chunk_lo, chunk_hi, BLOCK_K):
                s = start + tl.arange(0, BLOCK_K)
                key_ok = s < chunk_hi
                load_ok = key_ok[:, None] & d_ok[None, :]
                keys = _load_rotated(
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
        tl.store(
            out_ptr + row * out_stride_b + head * out_stride_h + t[:, None] * out_stride_t + d[None, :] * out_stride_d,
            out.to(out_ptr.dtype.element_ty),
            mask=(t < num_tokens)[:, None] & d_ok[None, :],
        )
