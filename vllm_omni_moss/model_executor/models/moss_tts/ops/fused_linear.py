# SPDX-License-Identifier: Apache-2.0
"""A projection of a few token rows with the layer's glue folded into it: LayerNorm before; RoPE, GELU or the
residual add after.

A decoder layer (docs/codec_architecture.md, "One layer") runs four projections and, between them, three
passes that are not GEMMs: the two residual adds with the LayerNorm after each (``residual_norm.py``) and
the FFN's GELU (``gelu.py``). On a small step (one stream's first frame: 1 to 32 token rows per resolution
group) every kernel is a few microseconds of launch and one read of its weights; there the passes cost as
much as the GEMMs. :func:`fused_linear` does a projection and its neighbouring glue in one Triton kernel,
so a layer is four projections and its attention (the RoPE pass of ``rope.py`` goes into the QKV projection
too):

* ``norm=(weight, bias, eps)``: each row of ``a`` is layer-normed first, in float32 (the two-pass mean and
  variance of ``residual_norm.py``'s kernel, over the row in ``BLOCK_K`` slices), and rounded to ``a``'s
  dtype before the product, as the projection would read ``LayerNorm(x)``.
* ``gelu=True``: the product, rounded to ``a``'s dtype, goes through ``gelu.py``'s exact GELU
  (:func:`~.gelu.gelu_float32`) and is rounded again: the roundings of ``linear1`` then ``gelu_``.
* ``residual=x``: the result is ``x + layer_scale * product`` with the product rounded first, the scaled
  product kept in float32 and the sum rounded once: the roundings of ``residual_norm.py``'s kernel.
* ``rope=(cos, sin, head_dim)``: the queries' and keys' columns of a QKV projection, rounded, are rotated by
  GPT-J pairs as ``rope.py`` rotates them (bitwise, on the same rounded product).

Each program computes a ``(BLOCK_M, BLOCK_N)`` tile of the output over the whole of ``K`` (no split of
``K``, so the result does not depend on the launch and a replay is bitwise repeatable), reading its
``BLOCK_N`` weight rows once. The product accumulates in float32 through ``tl.dot``, in another order than
cuBLAS does, so outputs differ from the unfused decoder's by the rounding of a bf16 GEMM; the decoder uses
this op only for groups of at most :data:`FUSED_LINEAR_MAX_ROWS` token rows (``decoder.py``), where the
weights' bytes, not the FLOPs, set the time.

Dispatch is ``ops/dispatch.py``'s: CUDA tensors launch the kernel; CPU tensors run the reference (the
unfused PyTorch ops) unless the Triton interpreter is active at import (bfloat16 excepted).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..step_metadata import apply_rope
from .dispatch import HAS_TRITON, device_guard, runs_triton_kernel, tl, triton
from .gelu import erf_constexprs
from .residual_norm import add_scaled, layer_norm_float32

if HAS_TRITON:
    from .gelu import gelu_float32

__all__ = [
    "FUSED_LINEAR_DTYPES",
    "FUSED_LINEAR_MAX_ROWS",
    "fused_linear",
    "fused_linear_reference",
    "launch_config",
    "launch_fused_linear",
]

#: Dtypes the kernel takes (``a``, ``weight``, ``residual`` and the norm's vectors share one).
FUSED_LINEAR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Token rows of a resolution group up to which the decoder runs its layers on this op (``decoder.py``):
#: beyond it cuBLAS and the separate glue passes are faster (``benchmarks/RESULTS.md``).
FUSED_LINEAR_MAX_ROWS = 64


def fused_linear_reference(
    a, weight, norm=None, gelu=False, residual=None, layer_scale=None, rope=None
) -> torch.Tensor:
    """PyTorch oracle for :func:`fused_linear` (same arguments): the unfused decoder's ops in turn."""
    if norm is not None:
        a = layer_norm_float32(a, norm[0], norm[1], norm[2])
    y = F.linear(a, weight)
    if rope is not None:
        cos, sin, head_dim = rope
        rows, rotated = cos.shape[0], 2 * weight.shape[0] // 3
        flat = y.reshape(rows, -1)
        # Each token row as its own (B = rows, T = 1) row of step_metadata.apply_rope.
        qk = flat[:, :rotated].reshape(rows, rotated // head_dim, 1, head_dim)
        turned = apply_rope(qk, cos.view(rows, 1, 1, -1), sin.view(rows, 1, 1, -1))
        y = torch.cat((turned.reshape(rows, rotated), flat[:, rotated:]), dim=1).view(y.shape)
    if gelu:
        y = torch.ops.aten.gelu_(y)
    if residual is not None:
        y = add_scaled(residual, y, layer_scale)
    return y.contiguous()


def launch_config(rows: int, out_features: int, in_features: int) -> dict[str, int]:
    """Block sizes and warps of one launch: the smallest power-of-two row tile (16 to 64) holding ``rows``
    (more rows take several tiles), output tiles narrow enough that the weight read spreads over some 100
    or more programs, and ``BLOCK_K`` 128 (64 for ``K`` below 128)."""
    block_m = min(max(16, triton.next_power_of_2(rows)), 64)
    block_n = 64
    while block_n > 16 and triton.cdiv(out_features, block_n) * triton.cdiv(rows, block_m) < 128:
        block_n //= 2
    block_k = 128 if in_features >= 128 else 64
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 3}


if HAS_TRITON:

    @triton.jit
    def _fused_linear_kernel(
        a_ptr, w_ptr, out_ptr, res_ptr, scale_ptr, norm_w_ptr, norm_b_ptr, cos_ptr, sin_ptr, M, N, K, eps,
        rope_cols, head_dim,
        NORM: tl.constexpr, GELU: tl.constexpr, RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr, IEEE: tl.constexpr,
        ROPE: tl.constexpr,
        C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
        C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # Program (column tile, row tile): out[rows, cols] over all of K. a (M, K), w (N, K), out and
        # res (M, N), all contiguous.
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        a_rows = a_ptr + rows.to(tl.int64)[:, None] * K
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
        dtype = a_ptr.dtype.element_ty
        if NORM:
            total = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                ok = row_ok[:, None] & (k < K)[None, :]
                total += tl.sum(tl.load(a_rows + k[None, :], mask=ok, other=0.0).to(tl.float32), axis=1)
            mean = total / K
            squares = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                ok = row_ok[:, None] & (k < K)[None, :]
                v = tl.load(a_rows + k[None, :], mask=ok, other=0.0).to(tl.float32)
                centred = tl.where(ok, v - mean[:, None], 0.0)
                squares += tl.sum(centred * centred, axis=1)
            rstd = 1.0 / tl.sqrt(squares / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                # Columns past K get weight and bias 0, so they add nothing to the product.
                nw = tl.load(norm_w_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                nb = tl.load(norm_b_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                h = (a.to(tl.float32) - mean[:, None]) * rstd[:, None] * nw[None, :] + nb[None, :]
                a = h.to(dtype)
            w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                # float32 operands: a full-precision product, as cuBLAS's float32 GEMM (no TF32).
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        y = acc.to(dtype)
        if ROPE:
            # GPT-J pairs (columns 2i, 2i+1 of a head) of the first rope_cols columns, rotated as ops/rope.py
            # does: widened to float32, each product and sum rounded on its own, each result once to dtype.
            re, im = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))
            pair_cols = tl.program_id(0) * BLOCK_N + 2 * tl.arange(0, BLOCK_N // 2)
            half = head_dim // 2
            table = rows.to(tl.int64)[:, None] * half + ((pair_cols % head_dim) // 2)[None, :]
            table_ok = row_ok[:, None] & (pair_cols < rope_cols)[None, :]
            cos = tl.load(cos_ptr + table, mask=table_ok, other=1.0)
            sin = tl.load(sin_ptr + table, mask=table_ok, other=0.0)
            re, im = re.to(tl.float32), im.to(tl.float32)
            turned = tl.join((re * cos - im * sin).to(dtype), (re * sin + im * cos).to(dtype))
            y = tl.where((cols < rope_cols)[None, :], tl.reshape(turned, (BLOCK_M, BLOCK_N)), y)
        if GELU:
            y = gelu_float32(y.to(tl.float32), C1, C2, C3, C4, C5, C6, C7, C8).to(dtype)
        ok = row_ok[:, None] & col_ok[None, :]
        tile = rows.to(tl.int64)[:, None] * N + cols[None, :]
        if RESIDUAL:
            update = y.to(tl.float32)
            if HAS_SCALE:
                update = tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :] * update
            x = tl.load(res_ptr + tile, mask=ok, other=0.0).to(dtype)
            y = (x.to(tl.float32) + update).to(dtype)
        tl.store(out_ptr + tile, y, mask=ok)


def launch_fused_linear(
    a, weight, norm, gelu, residual, layer_scale, rope=None, config: dict | None = None
) -> torch.Tensor:
    """Launch the kernel with :func:`fused_linear`'s arguments, unchecked, and the launch ``config``
    (:func:`launch_config`'s keys; default: its choice); ``bench_fused_linear.py`` sweeps configs with it."""
    if not HAS_TRITON:
        raise RuntimeError("fused_linear: the Triton kernel needs the `triton` package")
    K = a.shape[-1]
    N = weight.shape[0]
    a2 = a.reshape(-1, K).contiguous()
    M = a2.shape[0]
    out = torch.empty((*a.shape[:-1], N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        # The empty sum: the product is 0, as F.linear gives.
        return fused_linear_reference(a, weight, norm, gelu, residual, layer_scale, rope)
    weight = weight.contiguous()
    res = residual.reshape(M, N).contiguous() if residual is not None else out
    scale = layer_scale.contiguous() if layer_scale is not None else weight
    norm_w, norm_b, eps = (
        (norm[0].contiguous(), norm[1].contiguous(), float(norm[2])) if norm else (weight, weight, 0.0)
    )
    cos, sin, head_dim = (rope[0].contiguous(), rope[1].contiguous(), rope[2]) if rope else (weight, weight, 2)
    config = config or launch_config(M, N, K)
    grid = (triton.cdiv(N, config["BLOCK_N"]), triton.cdiv(M, config["BLOCK_M"]))
    with device_guard(a):
        _fused_linear_kernel[grid](
            a2, weight, out, res, scale, norm_w, norm_b, cos, sin, M, N, K, eps, 2 * N // 3, head_dim,
            NORM=norm is not None, ROPE=rope is not None, GELU=bool(gelu), RESIDUAL=residual is not None,
            HAS_SCALE=layer_scale is not None, IEEE=a.dtype == torch.float32, **erf_constexprs(), **config, enable_fp_fusion=False,
        )  # fmt: skip
    return out


@torch.library.custom_op("vllm_omni_moss::fused_linear", mutates_args=())
def _fused_linear_op(
    a: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    eps: float,
    gelu: bool,
    residual: torch.Tensor | None,
    layer_scale: torch.Tensor | None,
    rope_cos: torch.Tensor | None,
    rope_sin: torch.Tensor | None,
    head_dim: int,
) -> torch.Tensor:
    norm = (norm_weight, norm_bias, eps) if norm_weight is not None else None
    rope = (rope_cos, rope_sin, head_dim) if rope_cos is not None else None
    if runs_triton_kernel(a):
        return launch_fused_linear(a, weight, norm, gelu, residual, layer_scale, rope)
    return fused_linear_reference(a, weight, norm, gelu, residual, layer_scale, rope)


@_fused_linear_op.register_fake
def _fused_linear_fake(
    a, weight, norm_weight, norm_bias, eps, gelu, residual, layer_scale, rope_cos, rope_sin, head_dim
):
    return a.new_empty((*a.shape[:-1], weight.shape[0]))


def _check(name: str, value, shape, dtype, device) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"fused_linear: `{name}` must be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"fused_linear: `{name}` must have shape {tuple(shape)}, got {tuple(value.shape)}")
    if value.dtype != dtype:
        raise ValueError(f"fused_linear: `{name}` must have dtype {dtype} (the dtype of `a`), got {value.dtype}")
    if value.device != device:
        raise ValueError(f"fused_linear: `{name}` must be on device {device}, got {value.device}")


def fused_linear(
    a: torch.Tensor,
    weight: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    gelu: bool = False,
    residual: torch.Tensor | None = None,
    layer_scale: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """``a @ weight.T`` with LayerNorm before it and RoPE, GELU or a residual add after it, in one kernel on
    CUDA (module docstring for the roundings).

    Args:
        a: ``(..., K)`` token rows, dtype in :data:`FUSED_LINEAR_DTYPES`.
        weight: ``(N, K)`` an ``nn.Linear`` weight (no bias), ``a``'s dtype.
        norm: ``(weight, bias, eps)`` of a LayerNorm over ``K`` applied to ``a`` first (vectors ``(K,)``,
            ``a``'s dtype), or ``None``.
        gelu: apply the exact GELU to the product.
        residual: ``(..., N)`` the residual stream: return ``residual + layer_scale * product``; or ``None``.
        layer_scale: ``(N,)`` LayerScale vector (``a``'s dtype), only with ``residual``; ``None`` adds unscaled.
        rope: ``(cos, sin, head_dim)`` for a QKV projection (``N = 3 x heads x head_dim``, columns ordered
            ``(3, heads, head_dim)``): the queries' and keys' columns (the first ``2 N / 3``) are rotated by
            GPT-J pairs with each token row's tables, ``cos`` and ``sin`` ``(rows, head_dim / 2)`` float32
            (``step_metadata.rope_tables`` of the row's position), bitwise ``ops/rope.py`` on the rounded
            product. Not with ``gelu`` or ``residual``.
    Returns:
        ``(..., N)`` contiguous, ``a``'s dtype; a new tensor (``a`` and ``residual`` are only read).
    Raises:
        TypeError: an argument is not a tensor (or ``norm`` not a triple).
        ValueError: a shape, dtype or device differs from the above, ``gelu`` with ``residual``, ``rope`` with
            either, or ``layer_scale`` without ``residual`` (the message names the argument).
        RuntimeError: CUDA tensors without Triton installed.
    """
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"fused_linear: `a` must be a torch.Tensor, got {type(a).__name__}")
    if a.dim() == 0 or a.dtype not in FUSED_LINEAR_DTYPES:
        raise ValueError(
            f"fused_linear: `a` must have shape (..., K) and a dtype in {FUSED_LINEAR_DTYPES}, "
            f"got shape {tuple(a.shape)} and {a.dtype}"
        )
    K = a.shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"fused_linear: `weight` must be a 2-D (N, K) tensor, got {getattr(weight, 'shape', weight)}")
    N = weight.shape[0]
    _check("weight", weight, (N, K), a.dtype, a.device)
    _check_norm(norm, a)
    if gelu and residual is not None:
        raise ValueError("fused_linear: `gelu` and `residual` cannot both be set (a layer has no such projection)")
    if residual is not None:
        _check("residual", residual, (*a.shape[:-1], N), a.dtype, a.device)
    if layer_scale is not None:
        if residual is None:
            raise ValueError("fused_linear: `layer_scale` needs `residual`")
        _check("layer_scale", layer_scale, (N,), a.dtype, a.device)
    cos, sin, head_dim = _check_rope(rope, a, N, gelu or residual is not None)
    nw, nb, eps = norm if norm is not None else (None, None, 0.0)
    return torch.ops.vllm_omni_moss.fused_linear(
        a, weight, nw, nb, float(eps), bool(gelu), residual, layer_scale, cos, sin, head_dim
    )


def _check_norm(norm, a: torch.Tensor) -> None:
    if norm is not None:
        if not isinstance(norm, tuple) or len(norm) != 3:
            raise TypeError("fused_linear: `norm` must be a (weight, bias, eps) triple or None")
        _check("norm weight", norm[0], (a.shape[-1],), a.dtype, a.device)
        _check("norm bias", norm[1], (a.shape[-1],), a.dtype, a.device)


def _check_rope(rope, a: torch.Tensor, N: int, other_epilogue: bool) -> tuple:
    # (cos, sin, head_dim) of a checked `rope` argument, or (None, None, 0).
    if rope is None:
        return None, None, 0
    if not isinstance(rope, tuple) or len(rope) != 3:
        raise TypeError("fused_linear: `rope` must be a (cos, sin, head_dim) triple or None")
    if other_epilogue:
        raise ValueError("fused_linear: `rope` cannot be set with `gelu` or `residual` (only a QKV projection rotates)")
    cos, sin, head_dim = rope
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2 or N % (3 * head_dim):
        raise ValueError(f"fused_linear: `rope` head_dim must be even and divide N / 3 = {N / 3}, got {head_dim}")
    rows = a.numel() // a.shape[-1] if a.shape[-1] else a.shape[:-1].numel()
    for name, table in (("rope cos", cos), ("rope sin", sin)):
        if not isinstance(table, torch.Tensor):
            raise TypeError(f"fused_linear: `{name}` must be a torch.Tensor, got {type(table).__name__}")
        if tuple(table.shape) != (rows, head_dim // 2) or table.dtype != torch.float32 or table.device != a.device:
            raise ValueError(
                f"fused_linear: `{name}` must be a float32 ({rows}, {head_dim // 2}) tensor on {a.device}, got "
                f"{table.dtype} {tuple(table.shape)} on {table.device}"
            )
    return cos, sin, head_dim
