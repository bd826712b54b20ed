# SPDX-License-Identifier: Apache-2.0
"""A decoder layer's LayerNorm as one pass, and the reference of a sublayer's end.

A pre-norm layer of the codec decoder (docs/codec_architecture.md, "One layer") ends each sublayer with
``x = x + layer_scale * update`` and starts the next one with ``LayerNorm(x)``.

* The fused path (a bf16 decoder on CUDA, ``decoder.runs_fused_ops``) folds LayerScale into the rows of the
  projection before it (``CodecDecoder.to_serving``) and lets that GEMM add the residual itself
  (``x.addmm_``: ``x + h W^T`` in float32 on the accumulator, one rounding to bf16). What is left between
  sublayers is the norm: :func:`layer_norm` reads ``x`` once and writes ``h`` once. Under bf16 autocast
  PyTorch runs it as five kernels (three casts to float32: input, weight, bias; the norm; the cast back).
* The references (CPU, float32 decoders): :func:`residual_layer_norm_reference`, the unfused arithmetic
  upstream runs, and :func:`layer_norm_float32`.

:func:`layer_norm` computes ``LayerNorm(x)`` in float32 (weight and bias in float32) and rounds once to
``x``'s dtype, what the next projection consumes under autocast. It differs from PyTorch's float32 LayerNorm of
the same ``x`` only in how the mean and variance are accumulated (a two-pass float32 sum here, Welford there):
a few float32 ulps before the final rounding.

Dispatch is ``ops/dispatch.py``'s ``runs_triton_kernel``: CUDA tensors launch the kernel; CPU tensors run the
reference unless the Triton interpreter is active at import (bfloat16 excepted).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import HAS_TRITON, device_guard, runs_triton_kernel, tl, triton

__all__ = ["add_scaled", "layer_norm", "layer_norm_float32", "residual_layer_norm_reference"]


def add_scaled(x: torch.Tensor, update: torch.Tensor, layer_scale: torch.Tensor | None) -> torch.Tensor:
    """``x + layer_scale * update`` in ``update``'s dtype (``update`` unscaled when ``layer_scale`` is None)."""
    if layer_scale is not None:
        update = layer_scale * update
    return x.to(update.dtype) + update


def layer_norm_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim in float32 (as bf16 autocast runs it), rounded back to ``x.dtype``."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def residual_layer_norm_reference(x, update, layer_scale, weight, bias, eps: float):
    """A sublayer's end on the reference path: ``x' = x + layer_scale * update`` (:func:`add_scaled`) and
    ``h = LayerNorm(x')`` (:func:`layer_norm_float32`); returns ``(x', h)``."""
    x = add_scaled(x, update, layer_scale)
    return x, layer_norm_float32(x, weight, bias, eps)


if HAS_TRITON:

    @triton.jit
    def _layer_norm_kernel(x_ptr, weight_ptr, bias_ptr, h_ptr, width, eps, BLOCK: tl.constexpr):
        # Program: one token row of `width` channels; x and h are contiguous (rows, width).
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        ok = c < width
        xf = tl.load(x_ptr + row * width + c, mask=ok, other=0.0).to(tl.float32)
        mean = tl.sum(xf, axis=0) / width
        centred = tl.where(ok, xf - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / width + eps)
        weight = tl.load(weight_ptr + c, mask=ok, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + c, mask=ok, other=0.0).to(tl.float32)
        h = centred * rstd * weight + bias
        tl.store(h_ptr + row * width + c, h.to(h_ptr.dtype.element_ty), mask=ok)


def _launch_triton(x, weight, bias, eps):
    """Launch the kernel over a contiguous copy of ``x``; returns ``h``."""
    if not HAS_TRITON:
        raise RuntimeError("layer_norm: the Triton kernel needs the `triton` package")
    width = x.shape[-1]
    x = x.contiguous()
    h = torch.empty_like(x)
    rows = h.numel() // max(width, 1)
    if rows == 0:
        return h
    # The kernel indexes the (d,) vectors with unit stride.
    weight, bias = weight.contiguous(), bias.contiguous()
    with device_guard(x):
        _layer_norm_kernel[(rows,)](
            x, weight, bias, h, width, eps, BLOCK=triton.next_power_of_2(width), num_warps=4 if width <= 1024 else 8
        )
    return h


@torch.library.custom_op("vllm_omni_moss::layer_norm", mutates_args=())
def _layer_norm_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    if runs_triton_kernel(x):
        return _launch_triton(x, weight, bias, eps)
    return layer_norm_float32(x, weight, bias, eps).contiguous()


@_layer_norm_op.register_fake
def _layer_norm_fake(x, weight, bias, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _check(name: str, value, shape, device) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"layer_norm: `{name}` must be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"layer_norm: `{name}` must have shape {tuple(shape)}, got {tuple(value.shape)}")
    if not value.dtype.is_floating_point:
        raise ValueError(f"layer_norm: `{name}` must have a floating-point dtype, got {value.dtype}")
    if value.device != device:
        raise ValueError(f"layer_norm: `{name}` must be on device {device}, got {value.device}")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``LayerNorm(x)`` over the last dim in float32, rounded once to ``x``'s dtype, in one pass.

    Args:
        x: ``(..., d)`` the residual stream (bf16 on the fused path).
        weight, bias: ``(d,)`` the LayerNorm's affine parameters (any float dtype; read as float32).
        eps: the LayerNorm epsilon (1e-5 in the codec).
    Returns:
        ``h``, ``(..., d)``, contiguous, in ``x``'s dtype.
    Raises:
        TypeError: an argument is not a tensor.
        ValueError: a shape, dtype or device differs from the above (the message names the tensor).
        RuntimeError: CUDA tensors without Triton installed.
    """
    _check("x", x, getattr(x, "shape", ()), getattr(x, "device", None))
    if x.dim() == 0:
        raise ValueError("layer_norm: `x` must have shape (..., d), got a 0-dim tensor")
    for name, value in (("weight", weight), ("bias", bias)):
        _check(name, value, (x.shape[-1],), x.device)
    return torch.ops.vllm_omni_moss.layer_norm(x, weight, bias, float(eps))
