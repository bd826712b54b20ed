# SPDX-License-Identifier: Apache-2.0
"""The PyTorch computation the ring ops are held to, and the reference path of ``attention.py``.

:func:`attend_gathered_rows` is one layer's streaming attention over ring rows gathered from the state
pool: scatter the chunk's valid tokens into the rows, then SDPA with the step's dense mask
(``step_metadata.build_ring_metadata``). The ``"sdpa"`` attention backend runs it on every step, and
``ring_attention.py``'s references run it on the rows they gather. Those references and
``ring_write.py``'s read and write a paged ring through a copy of its rings in logical order
(:func:`logical_rings`, stored back by :func:`store_logical_rings`, whose boolean row selection is a
host sync on CUDA): a reference path for CPU execution and tests, not for graph capture. Nothing here
runs Triton.

Padding frames change nothing, bit for bit, on CPU (``docs/ring_semantics.md``, "Padded frames and per-frame
validity"): under ``exact`` semantics a query's keys are ``[pre-write ring || chunk]``, ``C + T`` of them, so a
padded step (larger ``T``) would hand PyTorch's CPU SDPA more masked keys, and its blocking gives other bits (in
bf16 about 3e-3 of the audio's peak). On CPU each query therefore attends over its own ``C`` keys instead
(:func:`_attend_own_window`): the ring as it stands once the chunk's tokens up to the query are written, the
same unmasked keys (the window is ``C``), a key count that does not depend on ``T``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..step_metadata import RingMetadata

__all__ = ["attend_gathered_rows", "logical_rings", "store_logical_rings"]


def attend_gathered_rows(
    ring_semantics: str,
    rows: torch.Tensor,
    meta: RingMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep_empty_rows: bool = False,
) -> torch.Tensor:
    """Streaming attention over gathered ring rows with native SDPA (the reference computation).

    Args:
        ring_semantics: ``"upstream"`` (write, then attend over the ``C`` cells) or ``"exact"``
            (attend over ``[pre-write ring || chunk]``, then write).
        rows: ``(2, B, H, C, Dh)`` ring rows of the execution batch (ring dtype); updated in
            place with this step's valid tokens. A cell several valid tokens reach holds the
            latest of them, whatever order the device scatters in. Rows that write nothing
            (``valid_tokens == 0``) are left undefined unless ``keep_empty_rows``.
        meta: the group's :class:`~..step_metadata.RingMetadata` (write cells, sources, mask).
        q, k: ``(B, H, T, Dh)`` rotated queries and keys; v: ``(B, H, T, Dh)`` values.
        keep_empty_rows: leave rows that write nothing unchanged (for callers that persist
            whole rows, as the legacy pool does); costs one elementwise pass over the writes.
    Returns:
        ``(B, H, T, Dh)`` in the ring dtype; rows of padding queries are unspecified (may be NaN).
    """
    k, v = k.to(rows.dtype), v.to(rows.dtype)
    B, H, T, Dh = k.shape
    own_window = ring_semantics == "exact" and q.device.type == "cpu"
    if own_window:  # before the writes below: the keys are the pre-write ring's
        out = _attend_own_window(rows, meta, q.to(rows.dtype), k, v)
    elif ring_semantics == "exact":
        # Padding tokens may carry non-finite values (queries that saw no key); a masked key
        # still meets its value in SDPA's product (0 x NaN), so they are zeroed here.
        valid = (torch.arange(T, device=k.device) < meta.valid_tokens.view(B, 1)).view(B, 1, T, 1)
        keys = torch.cat((rows[0], torch.where(valid, k, 0)), dim=2)
        values = torch.cat((rows[1], torch.where(valid, v, 0)), dim=2)
    W = meta.write_cell.shape[1]
    cell = meta.write_cell.view(B, 1, W, 1).expand(B, H, W, Dh)
    source = meta.write_source.view(B, 1, W, 1).expand(B, H, W, Dh)
    for plane, x in ((rows[0], k), (rows[1], v)):
        written = x.gather(2, source)
        if keep_empty_rows:
            # All entries of an empty row name one cell: write back that cell's own value.
            empty = (meta.valid_tokens == 0).view(B, 1, 1, 1)
            written = torch.where(empty, plane.gather(2, cell[:, :, :1]), written)
        plane.scatter_(2, cell, written)
    if own_window:
        return out
    if ring_semantics == "upstream":
        keys, values = rows[0], rows[1]
    return F.scaled_dot_product_attention(q.to(rows.dtype), keys, values, attn_mask=meta.mask)


def _attend_own_window(
    rows: torch.Tensor, meta: RingMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """``exact`` attention in which every query attends over ``C`` keys whatever ``T``: query ``t`` (position
    ``p_t = offset + t``) reads in ring cell ``c`` the latest position ``p <= p_t`` with ``p mod C == c``, the
    chunk's token ``p - offset`` when ``p >= offset``, else the pre-write ring's cell (which holds that
    position); a cell with ``p < 0`` was never written and is masked. These are exactly the keys of
    ``[pre-write ring || chunk]`` that the step's mask leaves a valid query (the window is ``C``: positions
    ``p_t - C < p <= p_t``), so a valid query never reads a padding token. A query is computed alone (one SDPA
    over ``B x H x T`` batches of one query and ``C`` keys), so its bits depend neither on ``T`` nor on the
    other rows. ``rows`` is only read; returns ``(B, H, T, Dh)``."""
    B, H, T, Dh = q.shape
    C = rows.shape[3]
    start = meta.offsets.view(B, 1, 1)
    query = start + torch.arange(T, device=q.device).view(1, T, 1)  # (B, T, 1)
    cells = torch.arange(C, device=q.device).view(1, 1, C)
    position = query - torch.remainder(query - cells, C)  # (B, T, C)
    in_chunk = position >= start
    token = torch.where(in_chunk, position - start, 0).view(B, 1, T * C, 1).expand(B, H, T * C, Dh)
    shape = (B, H, T, C, Dh)

    def window(plane: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        from_chunk = x.gather(2, token).view(shape)
        return torch.where(in_chunk.view(B, 1, T, C, 1), from_chunk, plane.unsqueeze(2).expand(shape))

    mask = (position >= 0).view(B, 1, T, 1, C)
    out = F.scaled_dot_product_attention(q.unsqueeze(3), window(rows[0], k), window(rows[1], v), attn_mask=mask)
    return out.squeeze(3)


def logical_rings(ring: torch.Tensor, page_table: torch.Tensor | None) -> torch.Tensor:
    """``(2, S, H, C, Dh)`` rings of every slot of ``page_table``: ``ring`` itself when unpaged, else a
    gathered copy of each slot's pages in logical order (``C = pages per ring x page size``)."""
    if page_table is None:
        return ring
    pages = ring[:, page_table]  # (2, S, n, H, page, Dh)
    planes, num_slots, num_pages, heads, page_size, head_dim = pages.shape
    return pages.permute(0, 1, 3, 2, 4, 5).reshape(planes, num_slots, heads, num_pages * page_size, head_dim)


def store_logical_rings(ring, page_table, rings, slots) -> None:
    """Write the logical rings ``(2, S, H, C, Dh)`` of ``slots`` (a ``(N,)`` int64 tensor) back into their
    pages of ``ring`` ``(2, P, H, page_size, Dh)`` through ``page_table`` ``(S, C / page_size)``: the
    inverse of :func:`logical_rings` for those slots."""
    planes, _, heads, capacity, head_dim = rings.shape
    num_pages = page_table.shape[1]
    pages = rings[:, slots].view(planes, len(slots), heads, num_pages, capacity // num_pages, head_dim)
    ring[:, page_table[slots]] = pages.permute(0, 1, 3, 2, 4, 5)
