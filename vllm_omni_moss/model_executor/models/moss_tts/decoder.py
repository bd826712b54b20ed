# SPDX-License-Identifier: Apache-2.0
"""The MOSS Audio Tokenizer decoder: codes ``(n_vq, B, T)`` -> audio ``(B, channels, T * hop)``.

Read top-down:

1. :func:`embed_codes` - residual-LFQ decode folded into one lookup table per codebook
   (``lut[q, code]`` already includes the codebook's and the shared output projection)
   plus one bias: ``z[b, t] = sum_q lut[q, codes[q, b, t]] + bias``.
2. :func:`run_decoder` - for each resolution group: input projection, pre-norm layers
   (LayerNorm, QKV, GPT-J RoPE, causal sliding-window attention, LayerScale, exact-GELU
   FFN, no biases), output projection, pure-reshape upsampling.
3. :func:`to_audio` - channel de-interleave (v2 stereo) and float32.

Modules hold weights only. Attention is delegated to a per-step *attention plan*
(``group(g, n_tokens)`` returning ``attend(layer, q, k, v)``): :class:`OfflinePlan`
for whole sequences, :class:`FixedWidthPlan` for the reference streaming path, and
the pools in ``state_pool.py``. Architecture facts: codec-facts §A.3-§A.8.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import step_metadata
from .config import CodecConfig, GroupSpec
from .step_metadata import RingMetadata, rope_tables

__all__ = [
    "CodecDecoder",
    "FixedWidthState",
    "FixedWidthStream",
    "apply_rope",
    "chunk_schedule",
    "embed_codes",
    "run_decoder",
    "to_audio",
]

#: Queries per block in offline attention: bounds the mask to ``block x (block + context)``.
OFFLINE_QUERY_BLOCK = 4096


class DecoderLayer(nn.Module):
    """Weights of one pre-norm transformer layer (no biases except LayerNorm's)."""

    def __init__(self, spec: GroupSpec):
        super().__init__()
        d, ff = spec.d_model, spec.dim_feedforward
        self.norm1 = nn.LayerNorm(d, eps=1e-5)
        self.in_proj = nn.Linear(d, 3 * d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.LayerNorm(d, eps=1e-5)
        self.linear1 = nn.Linear(d, ff, bias=False)
        self.linear2 = nn.Linear(ff, d, bias=False)
        if spec.layer_scale is None:
            self.layer_scale_1 = self.layer_scale_2 = None
        else:
            self.layer_scale_1 = nn.Parameter(torch.full((d,), spec.layer_scale))
            self.layer_scale_2 = nn.Parameter(torch.full((d,), spec.layer_scale))


class DecoderGroup(nn.Module):
    """Weights of one resolution group: projections and layers."""

    def __init__(self, spec: GroupSpec):
        super().__init__()
        self.input_proj = nn.Linear(spec.input_dim, spec.d_model, bias=False) if spec.input_proj else None
        self.output_proj = nn.Linear(spec.d_model, spec.output_dim, bias=False) if spec.output_proj else None
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))


class CodecDecoder(nn.Module):
    """Decoder weights of a MOSS Audio Tokenizer (no encoder, no state).

    Buffers:
        lut: ``(num_quantizers, codebook_size, latent_dim)``: per-codebook decode table.
        lut_bias: ``(latent_dim,)``: bias of the quantizer's output projection.
    """

    def __init__(self, config: CodecConfig):
        super().__init__()
        self.config = config
        self.register_buffer("lut", torch.zeros(config.num_quantizers, config.codebook_size, config.latent_dim))
        self.register_buffer("lut_bias", torch.zeros(config.latent_dim))
        self.groups = nn.ModuleList(DecoderGroup(spec) for spec in config.groups)

    @property
    def device(self) -> torch.device:
        return self.lut.device

    @property
    def state_dtype(self) -> torch.dtype:
        """Dtype of streaming KV rings: bf16 on CUDA (as upstream), the weight dtype elsewhere."""
        return torch.bfloat16 if self.device.type == "cuda" else self.groups[0].layers[0].in_proj.weight.dtype

    def to_serving(self, device: torch.device | str) -> CodecDecoder:
        """Move to ``device``; on CUDA cast weights and the table to bf16 (upstream's policy)."""
        device = torch.device(device)
        self.to(device)
        if device.type == "cuda":
            self.to(torch.bfloat16)
        return self.eval()

    def validate_codes(self, codes: torch.Tensor, n_vq: int | None = None) -> None:
        """Check codes are ``(n_vq, B, T)`` integers within the codebook.

        Raises:
            ValueError: wrong rank/dtype, too many codebooks, or a code outside
                ``[0, codebook_size)`` (the message names the offending value).
        """
        cfg = self.config
        if not isinstance(codes, torch.Tensor):
            raise ValueError(f"codes must be a torch.Tensor of shape (n_vq, B, T), got {type(codes).__name__}")
        if codes.dim() != 3:
            raise ValueError(f"codes must have shape (n_vq, B, T), got shape {tuple(codes.shape)}")
        if codes.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise ValueError(f"codes must be a signed integer (or uint8) tensor, got dtype {codes.dtype}")
        if codes.device.type == "meta":
            raise ValueError("codes are on the meta device; they need real values")
        if not 1 <= codes.shape[0] <= cfg.num_quantizers:
            raise ValueError(f"codes have n_vq={codes.shape[0]} codebooks; this codec has 1..{cfg.num_quantizers}")
        if n_vq is not None and codes.shape[0] != n_vq:
            raise ValueError(f"codes have n_vq={codes.shape[0]} codebooks, expected {n_vq}")
        if codes.numel():
            lo, hi = int(codes.min()), int(codes.max())
            if lo < 0 or hi >= cfg.codebook_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"code {bad} is outside the codebook range [0, {cfg.codebook_size - 1}]")

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, chunk_frames: int | Sequence[int] | None = None) -> torch.Tensor:
        """Decode whole sequences.

        Args:
            codes: ``(n_vq, B, T)`` integer codes.
            chunk_frames: ``None`` for offline decode with the exact sliding-window
                mask; otherwise stream through the fixed-width reference path with
                this chunk schedule (an int, or ``[first, steady...]``, see
                :func:`chunk_schedule`).
        Returns:
            ``(B, channels, T * samples_per_frame)`` float32 audio.
        Raises:
            ValueError: invalid codes or schedule.
        """
        self.validate_codes(codes)
        if codes.shape[1] == 0 or codes.shape[2] == 0:
            raise ValueError(f"codes must have B >= 1 rows and T >= 1 frames, got shape {tuple(codes.shape)}")
        codes = codes.to(self.device, torch.long)
        if chunk_frames is None:
            with _autocast(self.device):
                return run_decoder(self, codes, OfflinePlan(self.config))
        with self.streaming(codes.shape[1]) as stream:
            parts = [stream.decode(codes[:, :, a:b]) for a, b in chunk_schedule(codes.shape[-1], chunk_frames)]
        return torch.cat(parts, dim=-1)

    @contextlib.contextmanager
    def streaming(self, batch_size: int) -> Iterator[FixedWidthStream]:
        """Fixed-width reference streaming: execution row ``b`` is state row ``b``.

        Each layer keeps independent state (its own ring and offsets), as the
        upstream reference path does. Yields a :class:`FixedWidthStream`.
        """
        stream = FixedWidthStream(self, FixedWidthState.allocate(self, batch_size))
        try:
            yield stream
        finally:
            stream.close()


# --------------------------------------------------------------------------- step


def embed_codes(decoder: CodecDecoder, codes: torch.Tensor) -> torch.Tensor:
    """``(n_vq, B, T)`` int64 codes -> ``(B, T, latent_dim)`` decoder input (sum of table rows + bias)."""
    n_vq = codes.shape[0]
    lut = decoder.lut[:n_vq]
    rows = torch.arange(n_vq, device=codes.device).view(n_vq, 1, 1)
    return lut[rows, codes].sum(dim=0) + decoder.lut_bias


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate ``(B, H, T, Dh)`` q and k by GPT-J interleaved pairs, in float32, cast back."""
    dims = q.shape[:-1]
    half = q.shape[-1] // 2
    out = []
    for x in (q, k):
        pair = x.view(*dims, half, 2)
        re, im = pair[..., 0].float(), pair[..., 1].float()
        rot = torch.stack(((re * cos - im * sin).to(x.dtype), (re * sin + im * cos).to(x.dtype)), dim=-1)
        out.append(rot.view(*dims, 2 * half))
    return out[0], out[1]


AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _layer_forward(layer: DecoderLayer, x: torch.Tensor, num_heads: int, attend) -> torch.Tensor:
    B, T, d = x.shape
    qkv = layer.in_proj(layer.norm1(x)).view(B, T, 3, num_heads, d // num_heads).permute(2, 0, 3, 1, 4)
    attn = attend(qkv[0], qkv[1], qkv[2]).transpose(1, 2).reshape(B, T, d)
    update = layer.out_proj(attn)
    if layer.layer_scale_1 is not None:
        update = layer.layer_scale_1 * update
    x = x.to(update.dtype) + update
    update = layer.linear2(F.gelu(layer.linear1(layer.norm2(x))))
    if layer.layer_scale_2 is not None:
        update = layer.layer_scale_2 * update
    return x.to(update.dtype) + update


def _upsample(x: torch.Tensor, factor: int) -> torch.Tensor:
    """``(B, L, C*h)`` -> ``(B, L*h, C)``: output channel c at time ``l*h + k`` reads input channel ``c*h + k``."""
    if factor == 1:
        return x
    B, L, D = x.shape
    return x.view(B, L, D // factor, factor).transpose(2, 3).reshape(B, L * factor, D // factor)


def to_audio(config: CodecConfig, x: torch.Tensor) -> torch.Tensor:
    """``(B, N, 1)`` interleaved samples -> ``(B, channels, N / channels)`` float32."""
    B, N, _ = x.shape
    c = config.interleave_factor
    return x.view(B, N // c, c).transpose(1, 2).float().contiguous()


def run_decoder(decoder: CodecDecoder, codes: torch.Tensor, plan) -> torch.Tensor:
    """One decode step: codes ``(n_vq, B, T)`` int64 -> audio ``(B, channels, T * hop)`` float32.

    ``plan.group(g, n_tokens)`` is called once per resolution group and returns
    ``attend(layer_index, q, k, v) -> (B, H, T, Dh)``; ``plan.finish()`` runs after
    the last group. Pure tensor code: no Python branching on tensor values.
    """
    cfg = decoder.config
    frames = codes.shape[-1]
    x = embed_codes(decoder, codes)
    for g, (spec, group) in enumerate(zip(cfg.groups, decoder.groups)):
        attend = plan.group(g, frames * spec.tokens_per_frame)
        if group.input_proj is not None:
            x = group.input_proj(x)
        for i, layer in enumerate(group.layers):
            x = _layer_forward(layer, x, spec.num_heads, functools.partial(attend, i))
        if group.output_proj is not None:
            x = group.output_proj(x)
        x = _upsample(x, spec.upsample)
    plan.finish()
    return to_audio(cfg, x)


def _autocast(device: torch.device):
    # Upstream decodes under bf16 autocast on accelerators and in fp32 on CPU.
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def ring_attend(
    version: str, rows: torch.Tensor, meta: RingMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Attention of one layer over its ring, with the reference write semantics.

    Args:
        rows: ``(2, B, H, C, Dh)`` ring rows of the execution batch; updated in place
            with this chunk (the caller persists them).
        meta: the group's :class:`RingMetadata`.
        q, k, v: ``(B, H, T, Dh)`` projections before RoPE.
    Returns:
        ``(B, H, T, Dh)`` attention output (native SDPA, boolean mask).
    """
    q, k = apply_rope(q, k, meta.cos, meta.sin)
    B, H, T, Dh = k.shape
    k = k.to(rows.dtype)
    v = v.to(rows.dtype)
    if version == "v2":
        index = meta.scatter_index.view(B, 1, T, 1).expand(B, H, T, Dh)
        rows[0].scatter_(2, index, k)
        rows[1].scatter_(2, index, v)
        keys, values = rows[0], rows[1]
    else:
        keys = torch.cat((rows[0], k), dim=2)
        values = torch.cat((rows[1], v), dim=2)
        W = meta.scatter_index.shape[1]
        index = meta.scatter_index.view(B, 1, W, 1).expand(B, H, W, Dh)
        rows[0].scatter_(2, index, k[:, :, T - W :])
        rows[1].scatter_(2, index, v[:, :, T - W :])
    return F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=meta.mask)


# --------------------------------------------------------------------------- offline


class OfflinePlan:
    """Whole-sequence attention: positions ``0..N-1``, exact window ``0 <= q - k < context``.

    Queries are processed in blocks of :data:`OFFLINE_QUERY_BLOCK` against only the
    keys they can reach, so mask memory is ``O(block * (block + context))`` whatever
    the length (no ``N x N`` mask for long audio).
    """

    def __init__(self, config: CodecConfig):
        self.config = config

    def group(self, g: int, n_tokens: int) -> AttendFn:
        spec = self.config.groups[g]
        ctx = spec.context
        tables: list[torch.Tensor] = []  # RoPE tables for positions 0..N-1, shared by the group's layers

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if not tables:
                zero = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
                tables.extend(rope_tables(zero, n_tokens, spec.head_dim, spec.max_period))
            q, k = apply_rope(q, k, *tables)
            outs = []
            for start in range(0, n_tokens, OFFLINE_QUERY_BLOCK):
                end = min(start + OFFLINE_QUERY_BLOCK, n_tokens)
                k0 = max(0, start - ctx + 1)
                qpos = torch.arange(start, end, device=q.device).view(-1, 1)
                kpos = torch.arange(k0, end, device=q.device).view(1, -1)
                rel = qpos - kpos
                mask = (rel >= 0) & (rel < ctx)
                outs.append(
                    F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, k0:end], v[:, :, k0:end], attn_mask=mask)
                )
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

        return attend

    def finish(self) -> None:
        pass


# --------------------------------------------------------------------------- fixed width


@dataclass
class FixedWidthState:
    """Reference streaming state: per layer, its own ring ``(2, B, H, C, Dh)`` and offsets ``(B,)``.

    Execution row ``b`` is state row ``b``; nothing is shared between layers.
    """

    rings: list[torch.Tensor]
    offsets: list[torch.Tensor]

    @classmethod
    def allocate(cls, decoder: CodecDecoder, batch_size: int) -> FixedWidthState:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        rings, offsets = [], []
        for spec in decoder.config.groups:
            for _ in range(spec.num_layers):
                rings.append(
                    torch.zeros(
                        2,
                        batch_size,
                        spec.num_heads,
                        spec.context,
                        spec.head_dim,
                        device=decoder.device,
                        dtype=decoder.state_dtype,
                    )
                )
                offsets.append(torch.zeros(batch_size, dtype=torch.long, device=decoder.device))
        return cls(rings, offsets)


class FixedWidthPlan:
    """One step of the fixed-width reference path (per-layer metadata, in-place rings)."""

    def __init__(self, config: CodecConfig, state: FixedWidthState, batch_size: int):
        self.config = config
        self.state = state
        self.valid = torch.ones(batch_size, dtype=torch.bool, device=state.offsets[0].device)

    def group(self, g: int, n_tokens: int) -> AttendFn:
        spec = self.config.groups[g]
        first = self.config.group_first_layers[g]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            li = first + i
            ring, offsets = self.state.rings[li], self.state.offsets[li]
            meta = step_metadata.build_ring_metadata(
                offsets,
                self.valid,
                n_tokens,
                spec.context,
                spec.context,
                self.config.version,
                spec.head_dim,
                spec.max_period,
            )
            out = ring_attend(self.config.version, ring, meta, q, k, v)
            offsets.copy_(meta.next_offsets)
            return out

        return attend

    def finish(self) -> None:
        pass


class FixedWidthStream:
    """Handle yielded by :meth:`CodecDecoder.streaming`: feed chunks, get audio."""

    def __init__(self, decoder: CodecDecoder, state: FixedWidthState):
        self.decoder = decoder
        self.state: FixedWidthState | None = state
        self.batch_size = state.offsets[0].shape[0]

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Decode the next chunk: ``(n_vq, B, T)`` -> ``(B, channels, T * hop)`` float32.

        Raises:
            RuntimeError: the stream is closed.
            ValueError: bad codes or a batch size other than the stream's.
        """
        if self.state is None:
            raise RuntimeError("this fixed-width stream is closed")
        self.decoder.validate_codes(codes)
        if codes.shape[1] != self.batch_size:
            raise ValueError(f"chunk has batch {codes.shape[1]}, the stream was opened for {self.batch_size}")
        if codes.shape[2] == 0:
            raise ValueError("chunk has T=0 frames; each chunk needs at least one frame")
        codes = codes.to(self.decoder.device, torch.long)
        with _autocast(self.decoder.device):
            return run_decoder(self.decoder, codes, FixedWidthPlan(self.decoder.config, self.state, self.batch_size))

    def close(self) -> None:
        self.state = None


def chunk_schedule(total_frames: int, chunks: int | Sequence[int]) -> list[tuple[int, int]]:
    """Split ``total_frames`` into ``[start, end)`` chunks.

    ``chunks`` is an int (every chunk that size) or a list: the first element is the
    first chunk, the remaining elements repeat cyclically (``[1, 15]`` gives 1, 15,
    15, ...; ``[1, 3, 7, 2]`` gives 1, 3, 7, 2, 3, 7, 2, ...). The last chunk may be
    shorter.

    Raises:
        ValueError: an empty schedule or a non-positive chunk size.
    """
    try:
        sizes = [chunks] if isinstance(chunks, numbers.Integral) else list(chunks)
    except TypeError:
        raise ValueError(f"chunk schedule must be an int or a list of ints, got {chunks!r}") from None
    if not sizes or any(not isinstance(s, numbers.Integral) or isinstance(s, bool) or s < 1 for s in sizes):
        raise ValueError(f"chunk schedule must be positive integers, got {chunks!r}")
    sizes = [int(s) for s in sizes]
    steady = sizes[1:] or sizes
    out, start, k = [], 0, 0
    size = sizes[0]
    while start < total_frames:
        end = min(start + size, total_frames)
        out.append((start, end))
        start = end
        size = steady[k % len(steady)]
        k += 1
    return out
