# SPDX-License-Identifier: Apache-2.0
"""The glue between a layer's sublayers in one pass: LayerScale, residual add and the next LayerNorm.

A pre-norm layer of the codec decoder (docs/codec_architecture.md, "One layer") ends each sublayer with
``x = x + layer_scale * update`` and starts the next one with ``LayerNorm(x)``. In PyTorch under bf16
autocast that is seven kernels: the scale, the add, three casts to float32 (LayerNorm runs in float32
under autocast: input, weight, bias), the norm, and the cast of its output back to bf16 for the next
projection. :func:`residual_layer_norm` does it in one kernel per token row, with the same roundings:

* ``x' = x + layer_scale * update`` in float32, rounded once to the dtype of ``update`` (``x`` is
  first cast to it, as the decoder does). PyTorch rounds twice in bf16: the product, then the sum.
  The compiled kernel keeps the product in float32 (its intermediate rounding does not survive
  Triton's code generation), so some bf16 elements differ from PyTorch's by one ulp (the CUDA tests
  of ``test_ops_residual_norm.py`` bound the error); without LayerScale both are one rounding and equal.
* ``h = LayerNorm(x')`` computed in float32 (weight and bias in float32), rounded to ``x'``'s dtype,
  which is what the next projection consumes under autocast. It differs from PyTorch's float32
  LayerNorm of the same ``x'`` only in how the mean and variance are accumulated (a two-pass float32
  sum here, Welford there): a few float32 ulps before the final rounding.

Dispatch is ``ops/dispatch.py``'s ``runs_triton_kernel``: CUDA tensors launch the kernel; CPU tensors run
the reference (bitwise the unfused decoder) unless the Triton interpreter is active at import (bfloat16
excepted). The decoder calls the kernel only on CUDA, so CPU decoding (and its parity with upstream) is
unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import HAS_TRITON, device_guard, runs_triton_kernel, tl, triton

__all__ = ["add_scaled", "layer_norm_float32", "residual_layer_norm", "residual_layer_norm_reference"]


def add_scaled(x: torch.Tensor, update: torch.Tensor, layer_scale: torch.Tensor | None) -> torch.Tensor:
    """``x + layer_scale * update`` in ``update``'s dtype (``update`` unscaled when ``layer_scale`` is None)."""
    if layer_scale is not None:
        update = layer_scale * update
    return x.to(update.dtype) + update


def layer_norm_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim in float32 (as bf16 autocast runs it), rounded back to ``x.dtype``."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def residual_layer_norm_reference(x, update, layer_scale, weight, bias, eps: float):
    """PyTorch oracle for :func:`residual_layer_norm`; same arguments and results (the unfused decoder)."""
    x = add_scaled(x, update, layer_scale)
    return x, layer_norm_float32(x, weight, bias, eps)


if HAS_TRITON:

    @triton.jit
    def _residual_layer_norm_kernel(
        x_ptr,
        update_ptr,
        scale_ptr,
        weight_ptr,
        bias_ptr,
        x_out_ptr,
        h_ptr,
        width,
        eps,
        HAS_SCALE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program: one token row of `width` channels; every tensor is contiguous (B * T, width).
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        ok = c < width
        update = tl.load(update_ptr + row * width + c, mask=ok, other=0.0)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + c, mask=ok, other=0.0)
            update = (scale.to(tl.float32) * update.to(tl.float32)).to(update.dtype)
        x = tl.load(x_ptr + row * width + c, mask=ok, other=0.0).to(update.dtype)
        x = (x.to(tl.float32) + update.to(tl.float32)).to(update.dtype)
        tl.store(x_out_ptr + row * width + c, x, mask=ok)
        xf = x.to(tl.float32)
        mean = tl.sum(xf, axis=0) / width
        centred = tl.where(ok, xf - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / width + eps)
        weight = tl.load(weight_ptr + c, mask=ok, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + c, mask=ok, other=0.0).to(tl.float32)
        h = centred * rstd * weight + bias
        tl.store(h_ptr + row * width + c, h.to(h_ptr.dtype.element_ty), mask=ok)


def _launch_triton(x, update, layer_scale, weight, bias, eps):
    """Launch the kernel over contiguous copies of ``x`` and ``update``; returns ``(x', h)``."""
    if not HAS_TRITON:
        raise RuntimeError("residual_layer_norm: the Triton kernel needs the `triton` package")
    width = x.shape[-1]
    update = update.contiguous()
    x = x.contiguous()
    x_out = torch.empty(update.shape, dtype=update.dtype, device=update.device)
    h = torch.empty_like(x_out)
    rows = x_out.numel() // max(width, 1)
    if rows == 0:
        return x_out, h
    # The kernel indexes the (d,) vectors with unit stride.
    weight, bias = weight.contiguous(), bias.contiguous()
    scale = layer_scale.contiguous() if layer_scale is not None else weight
    with device_guard(x):
        _residual_layer_norm_kernel[(rows,)](
            x,
            update,
            scale,
            weight,
            bias,
            x_out,
            h,
            width,
            eps,
            HAS_SCALE=layer_scale is not None,
            BLOCK=triton.next_power_of_2(width),
            num_warps=4 if width <= 1024 else 8,
        )
    return x_out, h


@torch.library.custom_op("vllm_omni_moss::residual_layer_norm", mutates_args=())
def _residual_layer_norm_op(
    x: torch.Tensor,
    update: torch.Tensor,
    layer_scale: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if runs_triton_kernel(update):
        return _launch_triton(x, update, layer_scale, weight, bias, eps)
    x_out, h = residual_layer_norm_reference(x, update, layer_scale, weight, bias, eps)
    return x_out.contiguous(), h.contiguous()


@_residual_layer_norm_op.register_fake
def _residual_layer_norm_fake(x, update, layer_scale, weight, bias, eps):
    return torch.empty_like(update, memory_format=torch.contiguous_format), torch.empty_like(
        update, memory_format=torch.contiguous_format
    )


def _check(name: str, value, shape, device) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"residual_layer_norm: `{name}` must be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"residual_layer_norm: `{name}` must have shape {tuple(shape)}, got {tuple(value.shape)}")
    if not value.dtype.is_floating_point:
        raise ValueError(f"residual_layer_norm: `{name}` must have a floating-point dtype, got {value.dtype}")
    if value.device != device:
        raise ValueError(f"residual_layer_norm: `{name}` must be on device {device}, got {value.device}")


def residual_layer_norm(
    x: torch.Tensor,
    update: torch.Tensor,
    layer_scale: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x' = x + layer_scale * update`` and ``h = LayerNorm(x')``, in one pass (module docstring).

    Args:
        x: ``(..., d)`` the residual stream (any float dtype; cast to ``update``'s dtype first).
        update: ``(..., d)`` the sublayer's output (bf16 on CUDA under autocast, float32 on CPU).
        layer_scale: ``(d,)`` LayerScale vector in ``update``'s dtype, or ``None`` (update added unscaled).
        weight, bias: ``(d,)`` the next LayerNorm's affine parameters.
        eps: the LayerNorm epsilon (1e-5 in the codec).
    Returns:
        ``(x', h)``, both ``(..., d)``, contiguous, in ``update``'s dtype.
    Raises:
        TypeError: an argument is not a tensor.
        ValueError: a shape, dtype or device differs from the above (the message names the tensor).
        RuntimeError: CUDA tensors without Triton installed.
    """
    _check("update", update, getattr(update, "shape", ()), getattr(update, "device", None))
    if update.dim() == 0:
        raise ValueError("residual_layer_norm: `update` must have shape (..., d), got a 0-dim tensor")
    width = update.shape[-1]
    _check("x", x, update.shape, update.device)
    for name, value in (("layer_scale", layer_scale), ("weight", weight), ("bias", bias)):
        if value is not None or name != "layer_scale":
            _check(name, value, (width,), update.device)
    if layer_scale is not None and layer_scale.dtype != update.dtype:
        raise ValueError(
            f"residual_layer_norm: `layer_scale` must have the dtype of `update` ({update.dtype}), got {layer_scale.dtype}"
        )
    return torch.ops.vllm_omni_moss.residual_layer_norm(x, update, layer_scale, weight, bias, float(eps))
