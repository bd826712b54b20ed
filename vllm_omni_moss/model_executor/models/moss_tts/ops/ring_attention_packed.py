# SPDX-License-Identifier: Apache-2.0
"""The ring attention and write of a ragged step's packed rows, as one op: ``ring_attention_write_packed``.

A ragged step runs every op but the attention on the packed real tokens of its rows (``token_packing.py``):
row ``b``'s ``valid_tokens[b]`` tokens, then row ``b + 1``'s, with dummy tokens after the last row. This op
reads queries, keys and values in that layout, ``(1, H, N, Dh)``, row ``b`` starting at token
``token_start[b]`` (as vLLM's attention takes ``query_start_loc`` for a batch of mixed prefills and decodes), and
writes its output in it, so a ragged step needs no copy of its projections into the ``(B, T)`` grid and back:
the kernels of ``ring_attention.py`` and ``ring_write.py`` address each row from its start and store only its
valid queries (:func:`~.ring_attention.launch_ring_attention_triton` with ``write``: the attention of each row over
its ring and its chunk, then each row's last ``min(valid tokens, C)`` tokens written into its ring). Keys and
queries arrive rotated (``ops/rope.py`` rotates the packed tokens with the packed RoPE tables).

The op is a ``torch.library.custom_op`` (namespace ``vllm_omni_moss``) with ``register_fake``; dispatch is
``ops/dispatch.py``'s ``runs_triton_kernel``: CUDA tensors launch the kernels, CPU tensors run the reference
unless the Triton interpreter is active (``TRITON_INTERPRET=1`` at import), then the kernels run interpreted,
except for bfloat16 rings (the interpreter's bfloat16 arithmetic is not the GPU's). It is safe in
``torch.compile(fullgraph=True)`` (an opaque op, a fake impl) and in CUDA-graph capture (no host syncs).

Output positions that are no row's valid token (the dummies) are left as allocated: no real token reads them.
The reference (:func:`ring_attention_write_packed_reference`) gathers the rows into the grid, runs
``ring_attention_write_reference`` and scatters them back (zeros at the dummies).
"""

from __future__ import annotations

import torch

from ..backends import RING_DTYPES
from ..config import RING_SEMANTICS
from .dispatch import check_tensor, runs_triton_kernel
from .ring_attention import launch_ring_attention_triton, ring_attention_write_reference
from .ring_write import check_page_table

__all__ = ["ring_attention_write_packed", "ring_attention_write_packed_reference"]


def _grid_index(token_start: torch.Tensor, num_tokens: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    # ``(B, T)`` packed positions of the grid's cells (clamped into the packed length) and the cells that hold a
    # row's token at all (inside the packed length).
    index = token_start.view(-1, 1) + torch.arange(num_tokens, device=token_start.device)
    return index.clamp(max=max(total - 1, 0)), index < total


def ring_attention_write_packed_reference(
    q, k, v, ring, slot_ids, offsets, valid_tokens, token_start, num_tokens, ring_semantics, page_table=None
) -> torch.Tensor:
    """PyTorch oracle for :func:`ring_attention_write_packed`: the rows gathered into the ``(B, H, T, Dh)`` grid,
    :func:`~.ring_attention.ring_attention_write_reference`, and the output scattered back (zeros elsewhere)."""
    total = q.shape[2]
    if total == 0:  # no token to gather (every row holds none): the kernels' empty answer
        return q.new_empty((1, 0, q.shape[1], q.shape[3]), dtype=ring.dtype)
    index, inside = _grid_index(token_start, num_tokens, total)

    def grid(x: torch.Tensor) -> torch.Tensor:
        rows = x[0][:, index]  # (H, B, T, Dh)
        return torch.where(inside.view(1, *inside.shape, 1), rows, torch.zeros((), dtype=x.dtype)).transpose(0, 1)

    out = ring_attention_write_reference(
        grid(q), grid(k), grid(v), ring, slot_ids, offsets, valid_tokens, ring_semantics, page_table=page_table
    )  # (B, T, H, Dh)
    packed = out.new_zeros((1, total, *out.shape[2:]))
    valid = torch.arange(num_tokens, device=q.device) < valid_tokens.view(-1, 1)
    packed[0, index[valid]] = out[valid]
    return packed


@torch.library.custom_op("vllm_omni_moss::ring_attention_write_packed", mutates_args=("ring",))
def _ring_attention_write_packed_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: torch.Tensor,
    slot_ids: torch.Tensor,
    offsets: torch.Tensor,
    valid_tokens: torch.Tensor,
    token_start: torch.Tensor,
    num_tokens: int,
    ring_semantics: str,
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    if runs_triton_kernel(ring):
        return launch_ring_attention_triton(
            q, k, v, ring, slot_ids, offsets, valid_tokens, token_start, num_tokens, ring_semantics,
            page_table=page_table, write=True,
        )  # fmt: skip
    return ring_attention_write_packed_reference(
        q, k, v, ring, slot_ids, offsets, valid_tokens, token_start, num_tokens, ring_semantics, page_table
    )


@_ring_attention_write_packed_op.register_fake
def _packed_fake(
    q, k, v, ring, slot_ids, offsets, valid_tokens, token_start, num_tokens, ring_semantics, page_table=None
) -> torch.Tensor:
    return q.new_empty((1, q.shape[2], q.shape[1], q.shape[3]), dtype=ring.dtype)


def ring_attention_write_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: torch.Tensor,
    slot_ids: torch.Tensor,
    offsets: torch.Tensor,
    valid_tokens: torch.Tensor,
    token_start: torch.Tensor,
    num_tokens: int,
    ring_semantics: str,
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's streaming attention and ring write over packed rows (module docstring).

    Args:
        q: ``(1, H, N, Dh)`` floating queries after RoPE (cast to the ring dtype).
        k, v: ``(1, H, N, Dh)`` keys after RoPE and values, in the ring dtype.
        ring: ``(2, S, H, C, Dh)`` the layer's rings (keys, values); mutated. ``C``: capacity and window.
        slot_ids: ``(B,)`` int64 slot of each row, read only for rows with tokens (distinct, in ``[0, S)``).
        offsets: ``(B,)`` int64 tokens each row wrote before this chunk (not reduced mod ``C``; not advanced).
        ring_semantics: ``"upstream"`` or ``"exact"`` (``config.RING_SEMANTICS``).
        page_table: optional ``(S, n)`` int32/int64 table of a paged ring ``(2, P, H, page_size, Dh)``: cell
            ``c`` of slot ``s`` is row ``c mod page_size`` of page ``page_table[s, c // page_size]``.
        valid_tokens: ``(B,)`` int64 tokens of each row, in ``[0, num_tokens]``.
        token_start: ``(B,)`` int64 first packed token of each row: rows ``b`` and ``b + 1`` do not overlap and
            ``token_start[b] + valid_tokens[b] <= N`` (data is not checked: that would need a host sync).
        num_tokens: ``T``, the most tokens of one row (the grid's length).
    Returns:
        ``(1, N, H, Dh)`` in the ring dtype: each row's valid queries at their packed positions (zeros for
        queries that see no key); other positions as allocated.
    Raises:
        TypeError: an argument is not a tensor. ValueError: a shape, dtype or device is inconsistent (the
        message names the argument), ``num_tokens`` is not an integer >= 1, or unknown ``ring_semantics``.
        RuntimeError: CUDA tensors without Triton installed.
    """
    op = "ring_attention_write_packed"
    check_tensor(op, "ring", ring, "(2, S, H, C, Dh)", (2, None, None, None, None), None, None)
    if ring.dtype not in RING_DTYPES:
        raise ValueError(f"{op}: `ring` must have one of the dtypes {RING_DTYPES}, got {ring.dtype}")
    heads, head_dim = ring.shape[2], ring.shape[4]
    check_tensor(op, "q", q, "(1, H, N, Dh)", (1, heads, None, head_dim), None, ring.device)
    shape = tuple(q.shape)
    for name, t in (("k", k), ("v", v)):
        check_tensor(op, name, t, "(1, H, N, Dh)", shape, ring.dtype, ring.device)
    check_tensor(op, "token_start", token_start, "(B,)", (None,), torch.int64, ring.device)
    rows = (token_start.shape[0],)
    for name, t in (("slot_ids", slot_ids), ("offsets", offsets), ("valid_tokens", valid_tokens)):
        check_tensor(op, name, t, "(B,)", rows, torch.int64, ring.device)
    if not q.dtype.is_floating_point:
        raise ValueError(f"{op}: `q` must have a floating-point dtype, got {q.dtype}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"{op}: `num_tokens` must be an integer >= 1, got {num_tokens!r}")
    if ring_semantics not in RING_SEMANTICS:
        raise ValueError(f"{op}: unknown ring semantics {ring_semantics!r}; expected one of {RING_SEMANTICS}")
    check_page_table(op, page_table, ring)
    return torch.ops.vllm_omni_moss.ring_attention_write_packed(
        q, k, v, ring, slot_ids, offsets, valid_tokens, token_start, num_tokens, ring_semantics, page_table
    )
