# SPDX-License-Identifier: Apache-2.0
"""Per-step ring metadata: built once, read by every attention layer that shares it.

A ring of capacity ``C`` holds the last ``C`` tokens of one stream in one layer:
absolute token position ``p`` lives at ring index ``p mod C``. Offsets count the
tokens a stream has written since its last reset (never reduced mod ``C``). The
facts behind both ring semantics are in ``docs/ring_semantics.md``.

Two ring semantics exist, chosen once per pool (``config.RING_SEMANTICS``):

* ``"upstream"`` (vLLM-Omni 0.30.0's v2 codec, ``audio_tokenizer_v2.py``): write the
  chunk into the ring first, then attend over the ``C`` ring cells. When a row writes
  more than ``C`` tokens several share a cell; the later position owns it.
* ``"exact"`` (the v1 codec, ``audio_tokenizer.py``): attend over
  ``[pre-write ring || chunk]`` (``C + T`` keys), then write the chunk.

Per-frame validity: row ``b`` writes only its first ``valid_tokens[b]`` tokens (its
real frames). Tokens at or beyond that count are padding: they write no ring cell,
advance no offset and are visible to no query. Rows with ``valid_tokens == 0``
(graph padding rows, empty rows) change nothing.

Within a resolution group every layer has the same offsets, so the same metadata
serves all its layers. The legacy pool rebuilds it per layer (as upstream does);
the compact pool builds it once per group per step. Both call
:func:`build_ring_metadata`, so the values are identical bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import CODEC_ABILITIES, GroupSpec, check_ring_semantics

__all__ = [
    "RingMetadata",
    "apply_rope",
    "build_ring_metadata",
    "default_ring_semantics",
    "rope_tables",
]


def default_ring_semantics(codec_version: str) -> str:
    """The ring semantics upstream uses for a codec version (``CodecAbilities.default_ring_semantics``):
    ``"upstream"`` for v2, ``"exact"`` for v1.

    Raises:
        ValueError: an unknown codec version.
    """
    abilities = CODEC_ABILITIES.get(codec_version)
    if abilities is None:
        raise ValueError(f"unknown codec version {codec_version!r}; expected 'v1' or 'v2'")
    return abilities.default_ring_semantics


@dataclass(frozen=True)
class RingMetadata:
    """What the attention layers of one group read in one streaming step.

    Attributes:
        offsets: ``(B,)`` int64 pre-step token offsets (RoPE start, query positions).
        valid_tokens: ``(B,)`` int64 valid tokens each row writes (0 for padding rows).
        next_offsets: ``(B,)`` int64 ``offsets + valid_tokens``.
        write_source: ``(B, W)`` int64, ``W = min(T, C)``: the chunk tokens a row writes,
            its last ``min(valid_tokens, C)`` valid tokens (the later token owns a shared
            cell), then the last of them repeated; rows that write nothing name token 0.
        write_cell: ``(B, W)`` int64 ring cell of each ``write_source`` token,
            ``(offset + token) mod C``. Within a row the cells of distinct tokens are
            distinct and a repeated entry writes the same value, so the write is
            deterministic whatever order the device scatters in.
        mask: ``(B, 1, T, K)`` bool, True where query ``t`` may attend key ``k``:
            ``0 <= q - p_k < window`` and key ``k`` holds a valid token; ``K = C``
            (``upstream``) or ``C + T`` (``exact``).
        cos / sin: ``(B, 1, T, Dh/2)`` float32 RoPE tables of the chunk's positions.
    """

    offsets: torch.Tensor
    valid_tokens: torch.Tensor
    next_offsets: torch.Tensor
    write_source: torch.Tensor
    write_cell: torch.Tensor
    mask: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def rope_tables(offsets: torch.Tensor, num_tokens: int, head_dim: int, max_period: float):
    """GPT-J RoPE angle tables for positions ``offsets[b] + t``.

    Args:
        offsets: ``(B,)`` int64 start positions.
        num_tokens: ``T``.
        head_dim: ``Dh`` (even).
        max_period: RoPE base (``max_period`` of the checkpoint's transformer config).
    Returns:
        ``(cos, sin)``, each ``(B, 1, T, Dh/2)`` float32, with frequencies
        ``exp(-ln(max_period) * 2i / Dh)`` (docs/codec_architecture.md).
    """
    device = offsets.device
    ds = torch.arange(head_dim // 2, device=device, dtype=torch.float64)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / head_dim))
    ts = offsets.view(-1, 1) + torch.arange(num_tokens, device=device, dtype=torch.long)
    # Float64 angles, reduced mod 2 pi before the float32 cos/sin: exact to ~1e-7 rad up to 1e9 tokens.
    angles = torch.remainder(freqs * ts.view(offsets.shape[0], 1, num_tokens, 1).double(), 2 * math.pi)
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``(..., B, H, T, Dh)`` by GPT-J interleaved pairs in float32, cast back to ``x.dtype``.

    ``cos``/``sin`` ``(B, 1, T, Dh/2)`` (:func:`rope_tables`) broadcast over the leading dims, so
    queries and keys (``qkv[:2]``) rotate in one pass. Pair ``(x[2i], x[2i+1])`` becomes
    ``(x[2i] cos - x[2i+1] sin, x[2i] sin + x[2i+1] cos)`` (the convention of ``apply_rope`` in
    upstream's ``audio_tokenizer_v2.py``). Each product and each sum is rounded to float32 on its
    own (one PyTorch kernel per operation, no fused multiply-add); the Triton kernels of
    ``ops/ring_attention.py`` rotate with the same roundings, so their keys are bitwise these.
    """
    dims = x.shape[:-1]
    half = x.shape[-1] // 2
    pair = x.view(*dims, half, 2)
    re, im = pair[..., 0].float(), pair[..., 1].float()
    rot = torch.stack(((re * cos - im * sin).to(x.dtype), (re * sin + im * cos).to(x.dtype)), dim=-1)
    return rot.view(*dims, 2 * half)


def _latest_position(last: torch.Tensor, capacity: int) -> torch.Tensor:
    """``(B, C)``: the latest position ``<= last[b]`` stored at each ring index (negative if none)."""
    ring = torch.arange(capacity, device=last.device, dtype=torch.long)
    return last - torch.remainder(last - ring, capacity)


def build_ring_metadata(
    spec: GroupSpec,
    ring_semantics: str,
    offsets: torch.Tensor,
    valid_tokens: torch.Tensor,
    num_tokens: int,
) -> RingMetadata:
    """Build the step metadata of one group (or one layer, for the legacy pool).

    Args:
        spec: the resolution group (``ring_capacity`` ``C``, equal to the attention ``window``,
            ``head_dim``, ``max_period``).
        ring_semantics: ``"upstream"`` or ``"exact"`` (module docstring).
        offsets: ``(B,)`` int64 pre-step token offsets of the execution rows.
        valid_tokens: ``(B,)`` int64 valid tokens per row, each in ``[0, num_tokens]``.
        num_tokens: ``T`` tokens per row in this step (frames x tokens per frame).
    Raises:
        ValueError: unknown ``ring_semantics``.

    Pure tensor code with no data-dependent Python branching (compile/graph safe).
    """
    check_ring_semantics(ring_semantics)
    device = offsets.device
    T, C = num_tokens, spec.ring_capacity
    start = offsets.view(-1, 1)
    next_offsets = offsets + valid_tokens
    # The later position owns a cell: a row writes its last min(valid_tokens, C) valid tokens.
    kept = valid_tokens.clamp(max=C).view(-1, 1)
    entry = torch.arange(min(T, C), device=device, dtype=torch.long)
    write_source = (valid_tokens.view(-1, 1) - kept) + torch.minimum(entry, (kept - 1).clamp(min=0))
    write_cell = torch.remainder(start + write_source, C)
    query = start + torch.arange(T, device=device, dtype=torch.long)  # (B, T)
    if ring_semantics == "upstream":
        # Keys are the post-write ring; negative = never written.
        positions = _latest_position(next_offsets.view(-1, 1) - 1, C)
    else:
        cached = _latest_position(start - 1, C)
        current = torch.where(query < next_offsets.view(-1, 1), query, -1)
        positions = torch.cat((cached, current), dim=1)
    rel = query.unsqueeze(-1) - positions.unsqueeze(1)  # (B, T, K)
    mask = (positions.unsqueeze(1) >= 0) & (rel >= 0) & (rel < spec.window)
    cos, sin = rope_tables(offsets, T, spec.head_dim, spec.max_period)
    return RingMetadata(
        offsets=offsets,
        valid_tokens=valid_tokens,
        next_offsets=next_offsets,
        write_source=write_source,
        write_cell=write_cell,
        mask=mask.unsqueeze(1),
        cos=cos,
        sin=sin,
    )
