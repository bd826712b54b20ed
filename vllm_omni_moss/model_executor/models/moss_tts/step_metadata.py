# SPDX-License-Identifier: Apache-2.0
"""Per-step ring metadata: built once, read by every attention layer that shares it.

A ring of capacity ``C`` holds the last ``C`` tokens of one stream in one layer:
absolute token position ``p`` lives at ring index ``p mod C``. Offsets count the
tokens a stream has written since its last reset (never reduced mod ``C``).

Two ring semantics exist (codec-facts §B.5 and §B.10):

* ``v2`` (vLLM-Omni 0.30.0 v2 codec): scatter the whole chunk into the ring first,
  then attend over the ``C`` ring cells in physical order. When ``T >= C`` several
  tokens share a destination; whichever the scatter keeps is what everyone reads.
* ``v1``: attend over ``[pre-write ring || chunk]`` (``C + T`` keys), then write the
  last ``min(T, C)`` tokens.

Within a resolution group every layer has the same offsets, so the same metadata
serves all its layers. The legacy pool rebuilds it per layer (as upstream does);
the V2 pool builds it once per group per step. Both call :func:`build_ring_metadata`
so the values are identical bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["RingMetadata", "build_ring_metadata", "rope_tables"]


@dataclass
class RingMetadata:
    """Everything a layer needs for one streaming step of a group.

    Attributes:
        offsets: ``(B,)`` int64, pre-step token offsets (RoPE start, query positions).
        next_offsets: ``(B,)`` int64, ``offsets + T`` for valid rows, ``offsets`` otherwise.
        valid_lengths: ``(B,)`` int32, ``T`` for valid rows, 0 otherwise.
        scatter_index: ``(B, W)`` int64 ring indices receiving the chunk's last ``W``
            tokens (``W = T`` for v2, ``min(T, C)`` for v1).
        positions: ``(B, K)`` int64 absolute position of each key, -1 when the cell
            holds nothing attendable; ``K = C`` (v2) or ``C + T`` (v1).
        mask: ``(B, 1, T, K)`` bool, True where query ``t`` may attend key ``k``:
            ``0 <= q - p_k < context`` and ``p_k >= 0``.
        cos / sin: ``(B, 1, T, Dh/2)`` float32 RoPE tables for the queries/keys.
        num_tokens: ``T``, tokens of this group in the step.
        capacity: ring capacity ``C``.
    """

    offsets: torch.Tensor
    next_offsets: torch.Tensor
    valid_lengths: torch.Tensor
    scatter_index: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    num_tokens: int
    capacity: int


def rope_tables(offsets: torch.Tensor, num_tokens: int, head_dim: int, max_period: float):
    """GPT-J RoPE angle tables for positions ``offsets[b] + t``.

    Args:
        offsets: ``(B,)`` int64 start positions.
        num_tokens: ``T``.
        head_dim: ``Dh`` (even).
    Returns:
        ``(cos, sin)``, each ``(B, 1, T, Dh/2)`` float32. Frequencies
        ``exp(-ln(max_period) * 2i / Dh)`` as in the MOSS codec (codec-facts §A.6).
    """
    device = offsets.device
    ds = torch.arange(head_dim // 2, device=device, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / head_dim))
    ts = offsets.float().view(-1, 1) + torch.arange(num_tokens, device=device, dtype=torch.float32)
    angles = freqs * ts.view(-1, 1, num_tokens, 1)
    return torch.cos(angles), torch.sin(angles)


def build_ring_metadata(
    offsets: torch.Tensor,
    valid_rows: torch.Tensor,
    num_tokens: int,
    capacity: int,
    context: int,
    version: str,
    head_dim: int,
    max_period: float,
) -> RingMetadata:
    """Build the step metadata of one group (or one layer, for the legacy pool).

    Args:
        offsets: ``(B,)`` int64 pre-step token offsets of the execution rows.
        valid_rows: ``(B,)`` bool; invalid rows never advance.
        num_tokens: ``T`` tokens in this step (frames x tokens per frame).
        capacity: ring capacity ``C`` in tokens.
        context: attention window in tokens.
        version: ``"v1"`` or ``"v2"`` ring semantics (module docstring).
        head_dim, max_period: for the RoPE tables.

    Pure tensor code with no data-dependent Python branching (compile/graph safe).
    """
    device = offsets.device
    T, C = num_tokens, capacity
    t = torch.arange(T, device=device, dtype=torch.long)
    ring = torch.arange(C, device=device, dtype=torch.long)
    next_offsets = torch.where(valid_rows, offsets + T, offsets)
    valid_lengths = torch.where(valid_rows, T, 0).to(torch.int32)
    query = offsets.view(-1, 1) + t  # (B, T)
    if version == "v2":
        scatter_index = query % C
        last = offsets.view(-1, 1) + (T - 1)
        delta = ring - last % C
        positions = torch.where(delta <= 0, last + delta, last + delta - C)
        # Cells at or beyond the post-step end were never written since reset.
        positions = torch.where(ring >= next_offsets.view(-1, 1), -1, positions)
    elif version == "v1":
        kept = min(T, C)
        scatter_index = (offsets.view(-1, 1) + (T - kept) + torch.arange(kept, device=device)) % C
        last = offsets.view(-1, 1) - 1
        delta = ring - last % C
        cached = torch.where(delta <= 0, last + delta, last + delta - C)
        cached = torch.where((ring < offsets.view(-1, 1)) & valid_rows.view(-1, 1), cached, -1)
        current = torch.where(valid_rows.view(-1, 1), query, -1)
        positions = torch.cat((cached, current), dim=1)
    else:
        raise ValueError(f"unknown ring version {version!r}; expected 'v1' or 'v2'")
    rel = query.unsqueeze(-1) - positions.unsqueeze(1)  # (B, T, K)
    mask = (positions.unsqueeze(1) >= 0) & (rel >= 0) & (rel < context)
    cos, sin = rope_tables(offsets, T, head_dim, max_period)
    return RingMetadata(
        offsets=offsets,
        next_offsets=next_offsets,
        valid_lengths=valid_lengths,
        scatter_index=scatter_index,
        positions=positions,
        mask=mask.unsqueeze(1),
        cos=cos,
        sin=sin,
        num_tokens=T,
        capacity=C,
    )
