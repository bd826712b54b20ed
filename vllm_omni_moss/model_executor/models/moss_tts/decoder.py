# SPDX-License-Identifier: Apache-2.0
"""The MOSS Audio Tokenizer decoder: codes ``(n_vq, B, T)`` -> audio ``(B, channels, T * hop)``.

Read top-down:

1. :func:`embed_codes` - residual-LFQ decode folded into one lookup table per codebook
   (``lut[q, code]`` already includes the codebook's and the shared output projection)
   plus one bias: ``z[b, t] = sum_q lut[q, codes[q, b, t]] + bias``.
2. :func:`run_decoder` - for each resolution group: input projection, pre-norm layers
   (LayerNorm, QKV, GPT-J RoPE, causal sliding-window attention, LayerScale, exact-GELU
   FFN, no biases; served on CUDA, LayerScale folded into the projections, each residual added
   by its GEMM, the GELU in the FFN's first GEMM's epilogue, ``ops/layer_norm.py`` between
   sublayers: :func:`_run_fused_layers`), output projection, pure-reshape upsampling.
3. :func:`to_audio` - channel de-interleave (v2 stereo) and float32.

Modules hold weights only. Attention and state are reached through a
:class:`~.attention.StepPlan` built once per step by the state's owner: offline
decode and the fixed-width reference stream here, the pools in ``state/``.
A whole step reads top-down in :func:`run_decoder` and ``attention.py``.
Architecture facts: docs/codec_architecture.md.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .attention import AttentionBackend, FixedWidthAttention, GroupStep, OfflineAttention, StepPlan, group_steps
from .config import CodecConfig, GroupSpec
from .ops.layer_norm import add_scaled, layer_norm, layer_norm_float32, residual_layer_norm_reference
from .step_metadata import check_ring_semantics
from .token_packing import TokenPacking

__all__ = [
    "CodecDecoder",
    "FixedWidthState",
    "FixedWidthStream",
    "chunk_frames_at",
    "chunk_schedule",
    "embed_codes",
    "run_decoder",
    "runs_fused_ops",
    "to_audio",
    "validate_codes",
]


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
        # ``(dim_feedforward,)`` zeros, the bias of the FFN's first GEMM on the fused path (its GELU epilogue
        # takes one); made by CodecDecoder.prepare_fused_layers (to_serving on CUDA), not part of the checkpoint.
        self.register_buffer("ffn_zero_bias", None, persistent=False)


def validate_codes(cfg: CodecConfig, codes: torch.Tensor, n_vq: int | None = None) -> None:
    """Check codes are ``(n_vq, B, T)`` integers within the codebook of ``cfg`` (its ``num_quantizers`` and
    ``codebook_size``, from the checkpoint's ``quantizer_kwargs``); needs no weights.

    Raises:
        ValueError: wrong rank/dtype, too many codebooks, or a code outside
            ``[0, codebook_size)`` (the message names the offending value).
    """
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
        """Dtype of streaming KV rings: the weight dtype (bf16 for a v2 codec served on CUDA,
        as upstream; float32 on CPU and for codecs kept in float32)."""
        return self.groups[0].layers[0].in_proj.weight.dtype

    def to_serving(self, device: torch.device | str) -> CodecDecoder:
        """Move to ``device``; on CUDA cast weights and the table to bf16 (upstream's policy) and make what the
        fused layer ops read (:func:`runs_fused_ops`): LayerScale folded into the rows of the projection before it
        (in float32, before the cast) and each group's zero bias of the FFN's first GEMM. CPU decoders are only
        moved: they keep the reference layout, bitwise upstream's arithmetic."""
        device = torch.device(device)
        self.to(device)
        if device.type == "cuda":
            self.prepare_fused_layers()  # before the cast: the fold multiplies in the checkpoint's precision
            self.to(torch.bfloat16)
        return self.eval()

    def prepare_fused_layers(self) -> None:
        """Lay the weights out as the fused layer ops read them (:func:`run_decoder` with :func:`runs_fused_ops`),
        on the decoder's device and in its weight dtype: LayerScale folded into the projections
        (:meth:`fold_layer_scale`) and each group's ``(dim_feedforward,)`` zero bias of the FFN's first GEMM
        (a buffer, cast and moved with the module). :meth:`to_serving` calls it on CUDA before the bf16 cast."""
        self.fold_layer_scale()
        for group, spec in zip(self.groups, self.config.groups):
            group.ffn_zero_bias = torch.zeros(spec.dim_feedforward, dtype=self.state_dtype, device=self.device)

    @torch.no_grad()
    def fold_layer_scale(self) -> None:
        """``W <- diag(layer_scale) W`` for each layer's ``out_proj`` (``layer_scale_1``) and ``linear2``
        (``layer_scale_2``), the product in float32 (float64 for float64 weights) and rounded once to the weight's dtype; the LayerScale
        parameters are then dropped (``None``). The layer computes the same function: ``x + s * (h W^T)`` is
        ``x + h (diag(s) W)^T``."""
        for group in self.groups:
            for layer in group.layers:
                for name, linear in (("layer_scale_1", layer.out_proj), ("layer_scale_2", layer.linear2)):
                    scale = getattr(layer, name)
                    if scale is not None:
                        w = linear.weight
                        wide = torch.promote_types(w.dtype, torch.float32)
                        w.copy_((scale.to(wide)[:, None] * w.to(wide)).to(w.dtype))
                        setattr(layer, name, None)

    def validate_codes(self, codes: torch.Tensor, n_vq: int | None = None) -> None:
        """:func:`validate_codes` against this decoder's config."""
        validate_codes(self.config, codes, n_vq)

    @torch.no_grad()
    def decode(
        self,
        codes: torch.Tensor,
        chunk_frames: int | Sequence[int] | None = None,
        ring_semantics: str | None = None,
    ) -> torch.Tensor:
        """Decode whole sequences.

        Args:
            codes: ``(n_vq, B, T)`` integer codes.
            chunk_frames: ``None`` for offline decode with the exact sliding-window
                mask; otherwise stream through the fixed-width reference path with
                this chunk schedule (an int, or ``[first, steady...]``, see
                :func:`chunk_schedule`).
            ring_semantics: ring semantics of the streaming path (see :meth:`streaming`).
        Returns:
            ``(B, channels, T * samples_per_frame)`` float32 audio.
        Raises:
            ValueError: invalid codes, schedule or ring semantics.
        """
        if ring_semantics is not None:
            check_ring_semantics(ring_semantics)
        self.validate_codes(codes)
        if codes.shape[1] == 0 or codes.shape[2] == 0:
            raise ValueError(f"codes must have B >= 1 rows and T >= 1 frames, got shape {tuple(codes.shape)}")
        codes = codes.to(self.device, torch.long)
        if chunk_frames is None:
            plan = StepPlan(group_steps(self.config, codes.shape[-1], None), OfflineAttention())
            with decode_autocast(self):
                return run_decoder(self, codes, plan)
        with self.streaming(codes.shape[1], ring_semantics) as stream:
            parts = [stream.decode(codes[:, :, a:b]) for a, b in chunk_schedule(codes.shape[-1], chunk_frames)]
        return torch.cat(parts, dim=-1)

    @contextlib.contextmanager
    def streaming(self, batch_size: int, ring_semantics: str | None = None) -> Iterator[FixedWidthStream]:
        """Fixed-width reference streaming: execution row ``b`` is state row ``b``.

        Each layer keeps independent state (its own ring and offsets), as the
        upstream reference path does. ``ring_semantics``: ``"upstream"`` or ``"exact"``
        (``step_metadata.py``); default: upstream's for the codec version. Yields a
        :class:`FixedWidthStream`.

        Raises:
            ValueError: unknown ``ring_semantics`` or ``batch_size < 1``.
        """
        semantics = ring_semantics or self.config.abilities.default_ring_semantics
        check_ring_semantics(semantics)
        stream = FixedWidthStream(self, FixedWidthState.allocate(self, batch_size), semantics)
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


#: Token rows of one FFN pass: larger steps run the FFN in slices of this many rows, so its widest
#: activation (rows x dim_feedforward) stays at most 65536 x 3072 bf16 = 384 MiB for the v2 codec. A
#: B128/T15 step (61,440 rows in the last group) runs each FFN in one pass: smaller slices only launched
#: more kernels at the same kernel time (benchmarks/history/928a734.md).
FFN_ROW_CHUNK = 65536


def _row_slices(rows: int) -> list[tuple[int, int]]:
    """``[start, stop)`` slices of at most :data:`FFN_ROW_CHUNK` of ``rows`` token rows; one slice when traced
    under torch.compile (a loop over the row count would specialise the graph on it, one recompile per step
    size, and the compiler plans the step's memory itself)."""
    # is_compiling first: comparing a traced row count would guard the graph on it.
    if torch.compiler.is_compiling() or rows <= FFN_ROW_CHUNK:
        return [(0, rows)]
    return [(start, min(start + FFN_ROW_CHUNK, rows)) for start in range(0, rows, FFN_ROW_CHUNK)]


def _feed_forward(layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
    """The reference FFN: ``linear2(GELU(linear1(h)))`` on ``(B, T, d)`` with the exact GELU in place
    (``aten.gelu_``), in :func:`_row_slices` (each row is independent, so slicing changes no value beyond the
    GEMMs' own choice of kernel); each slice's ``linear2`` writes its rows of the output in place when the
    weight has the activation's dtype and gradients are off (decoding always runs under ``no_grad``)."""
    B, T, d = h.shape
    rows = B * T
    slices = _row_slices(rows)
    if len(slices) == 1:
        return layer.linear2(torch.ops.aten.gelu_(layer.linear1(h)))
    flat = h.reshape(rows, d)
    weight = layer.linear2.weight
    out = None
    for start, stop in slices:
        head = torch.ops.aten.gelu_(layer.linear1(flat[start:stop]))
        if out is None:
            # linear2 computes in the activation's dtype under autocast; the output has it either way.
            out = head.new_empty(rows, weight.shape[0])
        # out= has no autograd formula: with gradients on, the slice is computed, then copied.
        if weight.dtype == head.dtype and not torch.is_grad_enabled():
            torch.mm(head, weight.t(), out=out[start:stop])
        else:
            out[start:stop] = layer.linear2(head)
        del head
    return out.view(B, T, -1)


def _add_product_(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x + a @ w`` for a 2-D ``x``: in place (``addmm_``, the GEMM reads ``x`` as its ``C``); traced under
    torch.compile, out of place, returned (the compiler plans the memory, and an in-place update of a view the
    graph reads elsewhere is what its functionalisation must not reorder)."""
    if torch.compiler.is_compiling():
        return torch.addmm(x, a, w)
    return x.addmm_(a, w)


def _add_feed_forward_(layer: DecoderLayer, h: torch.Tensor, x: torch.Tensor, zero_bias: torch.Tensor) -> torch.Tensor:
    """The fused FFN: ``x += linear2(GELU(linear1(h)))`` (:func:`_add_product_`: in place, out of place when
    traced), ``h`` and ``x`` contiguous ``(B, T, d)``; returns ``x``. Two GEMMs per :func:`_row_slices` slice
    and no pass between or after them.

    ``linear1``'s GEMM applies the GELU in its epilogue (``torch._addmm_activation(zero_bias, ...,
    use_gelu=True)``, ``zero_bias`` the ``(dim_feedforward,)`` zeros it needs): on CUDA cuBLASLt's GELU
    epilogue, the tanh form computed in float32 on the accumulator before the one rounding to bf16 (the
    reference rounds the GEMM's output first, then applies the exact GELU; docs/codec_architecture.md gives
    both errors against float32). ``linear2``'s GEMM adds its product to ``x`` (``addmm_``, ``beta=1``): one
    rounding of the sum. LayerScale is already in ``linear2``'s rows (:meth:`CodecDecoder.to_serving`)."""
    rows, d = x.shape[0] * x.shape[1], x.shape[2]
    flat_h, flat_x = h.view(rows, d), x.view(rows, d)
    w1, w2 = layer.linear1.weight.t(), layer.linear2.weight.t()
    slices = _row_slices(rows)
    out = flat_x
    for start, stop in slices:
        hidden = torch._addmm_activation(zero_bias, flat_h[start:stop], w1, use_gelu=True)
        part = _add_product_(flat_x[start:stop], hidden, w2)
        del hidden
        if len(slices) == 1:
            out = part
    return out.view(x.shape)


def _attend(layer: DecoderLayer, inputs: list[torch.Tensor], group: GroupStep, index: int, attention) -> torch.Tensor:
    """Attention of layer ``index`` (global) on the normalised ``h`` popped from ``inputs``, ``(B, T, d)`` ->
    ``(B, T, d)`` in the projections' dtype, before the output projection. ``h`` and the ``qkv`` projection are
    dropped as soon as they are consumed: the step's transient memory is bounded by the widest two
    activations, not by everything a layer makes."""
    h = inputs.pop()
    B, T, d = h.shape
    heads = group.spec.num_heads
    qkv = layer.in_proj(h)
    del h
    qkv = qkv.view(B, T, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
    # Ring backends answer in the ring dtype; the out-projection takes the projections' dtype.
    return attention(group, index, qkv).to(qkv.dtype).transpose(1, 2).reshape(B, T, d)


def _run_layers(
    weights: DecoderGroup,
    inputs: list[torch.Tensor],
    group: GroupStep,
    attention: AttentionBackend,
    fused: bool,
) -> torch.Tensor:
    """A group's pre-norm layers on ``(B, T, d)``.

    ``inputs`` is a one-element list holding the group's input; it is emptied, so that no reference
    outside keeps the input alive once the first sublayer has replaced it (the step's transient memory
    then holds one residual stream, not two). ``fused`` (bf16 on CUDA, :func:`runs_fused_ops`): each
    sublayer's last GEMM adds into the residual stream in place, LayerScale folded into its rows, and
    :func:`~.ops.layer_norm.layer_norm` is the one pass between sublayers; the FFN is
    :func:`_add_feed_forward_`. Otherwise the references: ``x + layer_scale * update`` then the next
    LayerNorm (:func:`~.ops.layer_norm.residual_layer_norm_reference`), the exact-GELU FFN. A packed step's
    ``x`` is ``(1, N, d)``, its ``N`` packed tokens as one row, and its attention reads them so
    (:mod:`.token_packing`).
    """
    x = inputs.pop()
    layers = weights.layers
    if not layers:
        return x
    if fused:
        return _run_fused_layers(weights, x.contiguous(), group, attention)
    norm = layers[0].norm1
    h = layer_norm_float32(x, norm.weight, norm.bias, norm.eps)
    for i, layer in enumerate(layers):
        update = layer.out_proj(_attend(layer, [h], group, group.first_layer + i, attention))
        del h
        norm = layer.norm2
        x, h = residual_layer_norm_reference(x, update, layer.layer_scale_1, norm.weight, norm.bias, norm.eps)
        del update
        update = _feed_forward(layer, h)
        if i + 1 == len(layers):
            return add_scaled(x, update, layer.layer_scale_2)
        norm = layers[i + 1].norm1
        x, h = residual_layer_norm_reference(x, update, layer.layer_scale_2, norm.weight, norm.bias, norm.eps)
        del update
    return x


def _run_fused_layers(weights: DecoderGroup, x: torch.Tensor, group: GroupStep, attention) -> torch.Tensor:
    """:func:`_run_layers` on the fused path: ``x`` contiguous ``(B, T, d)``, updated in place (out of place
    when traced, :func:`_add_product_`) and returned."""
    B, T, d = x.shape
    # Each norm's output is handed over without a name here, so it is freed as soon as it is consumed.
    for i, layer in enumerate(weights.layers):
        norm = layer.norm1
        attn = _attend(
            layer, [layer_norm(x, norm.weight, norm.bias, norm.eps)], group, group.first_layer + i, attention
        )
        x = _add_product_(x.view(B * T, d), attn.reshape(B * T, d), layer.out_proj.weight.t()).view(B, T, d)
        del attn
        norm = layer.norm2
        x = _add_feed_forward_(layer, layer_norm(x, norm.weight, norm.bias, norm.eps), x, weights.ffn_zero_bias)
    return x


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


def run_decoder(
    decoder: CodecDecoder, codes: torch.Tensor, plan: StepPlan, packing: TokenPacking | None = None
) -> torch.Tensor:
    """One decode step: codes ``(n_vq, B, T)`` int64 -> audio ``(B, channels, T * hop)`` float32, or with
    ``packing`` (a packed step, :mod:`.token_packing`) packed codes ``(n_vq, F)`` -> packed audio
    ``(channels, F * hop)``.

    ``plan`` holds one :class:`~.attention.GroupStep` per resolution group and the
    attention backend (which reads the packed tokens of a packed step); ``plan.finish`` runs after the last
    group. Pure tensor code: no Python branching on tensor values.
    """
    if packing is not None:
        codes = codes.view(codes.shape[0], 1, -1)
    x = embed_codes(decoder, codes)
    fused = runs_fused_ops(decoder)
    if fused:
        check_served(decoder)
    for group, weights in zip(plan.groups, decoder.groups):
        if weights.input_proj is not None:
            x = weights.input_proj(x)
        inputs = [x]
        del x  # _run_layers takes the only reference (see its docstring)
        x = _run_layers(weights, inputs, group, plan.attention, fused)
        if weights.output_proj is not None:
            x = weights.output_proj(x)
        x = _upsample(x, group.spec.upsample)
    if plan.finish is not None:
        plan.finish()
    audio = to_audio(decoder.config, x)
    return audio if packing is None else audio[0]


def runs_fused_ops(decoder: CodecDecoder) -> bool:
    """Whether ``decoder``'s steps run the fused layer ops: the serving configuration, bf16 weights on CUDA
    (:meth:`CodecDecoder.to_serving`). Every other decode (CPU, and float32 weights anywhere, the reference
    precision the accuracy tests compare against) runs their PyTorch references, the unfused ops."""
    return decoder.device.type == "cuda" and decoder.state_dtype == torch.bfloat16


def check_served(decoder: CodecDecoder) -> None:
    """Refuse a bf16 CUDA decoder that :meth:`CodecDecoder.to_serving` did not prepare for the fused ops.

    Raises:
        RuntimeError: a layer whose LayerScale is not folded, or a group without its FFN zero bias (the
            message says what to call).
    """
    unfolded = any(
        scale is not None for group in decoder.groups for layer in group.layers
        for scale in (layer.layer_scale_1, layer.layer_scale_2)
    )  # fmt: skip
    if unfolded or any(group.ffn_zero_bias is None for group in decoder.groups):
        raise RuntimeError(
            "a bf16 decoder on CUDA runs the fused layer ops, which read weights CodecDecoder.to_serving('cuda') "
            "prepares; this one was cast or moved without it"
        )


def decode_autocast(decoder: CodecDecoder):
    """The autocast context a decode of ``decoder`` runs in: bfloat16 autocast for a bfloat16 decoder on
    CUDA, as upstream decodes its bf16 (v2) codec on accelerators (``audio_tokenizer_v2.py``); else a null
    context, float32 weights (CPU, and the v1 codec everywhere) decoding in float32."""
    if decoder.device.type == "cuda" and decoder.state_dtype == torch.bfloat16:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


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
                        spec.ring_capacity,
                        spec.head_dim,
                        device=decoder.device,
                        dtype=decoder.state_dtype,
                    )
                )
                offsets.append(torch.zeros(batch_size, dtype=torch.long, device=decoder.device))
        return cls(rings, offsets)


class FixedWidthStream:
    """Handle yielded by :meth:`CodecDecoder.streaming`: feed chunks, get audio."""

    def __init__(self, decoder: CodecDecoder, state: FixedWidthState, ring_semantics: str | None = None):
        self.decoder = decoder
        self.state: FixedWidthState | None = state
        self.batch_size = state.offsets[0].shape[0]
        self.ring_semantics = ring_semantics or decoder.config.abilities.default_ring_semantics

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
        num_frames = codes.shape[-1]
        valid_frames = torch.full((self.batch_size,), num_frames, dtype=torch.long, device=codes.device)
        config = self.decoder.config
        attention = FixedWidthAttention(self.state.rings, self.state.offsets, self.ring_semantics)
        plan = StepPlan(group_steps(config, num_frames, valid_frames), attention)
        with decode_autocast(self.decoder):
            return run_decoder(self.decoder, codes, plan)

    def close(self) -> None:
        self.state = None


def chunk_frames_at(index: int, ramp: Sequence[int], steady: int) -> int:
    """Frames of chunk ``index`` (0-based) under a chunk ramp: ``ramp[index]`` for the first ``len(ramp)``
    chunks, ``steady`` after them.

    The rule of vLLM-Omni 0.30.0's ``ramp_chunk_size`` (``stage_input_processors/chunk_size_utils.py``) for the
    connector keys ``codec_chunk_ramp`` and ``codec_chunk_frames``; this is the core's one reading of it (the
    benchmarks run without vLLM), checked against that function in ``tests/model_executor/models/moss_tts/
    test_talker_chunker.py``.
    """
    return ramp[index] if index < len(ramp) else steady


def chunk_schedule(total_frames: int, chunks: int | Sequence[int]) -> list[tuple[int, int]]:
    """Split ``total_frames`` into ``[start, end)`` chunks.

    ``chunks`` is an int (every chunk that size) or a list read as a chunk ramp whose last size repeats
    (:func:`chunk_frames_at` with ``steady = chunks[-1]``): ``[1, 15]`` gives 1, 15, 15, ...; ``[1, 4, 15]``
    gives 1, 4, 15, 15, ...: what the talker's chunker sends for ``codec_chunk_ramp: [1, 4, 15]`` and
    ``codec_chunk_frames: 15``. The last chunk may be shorter.

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
    out, start = [], 0
    while start < total_frames:
        end = min(start + chunk_frames_at(len(out), sizes, sizes[-1]), total_frames)
        out.append((start, end))
        start = end
    return out
