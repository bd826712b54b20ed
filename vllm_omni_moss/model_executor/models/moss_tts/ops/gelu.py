# SPDX-License-Identifier: Apache-2.0
"""The FFN's exact GELU, in place, as one memory-bound pass.

Between the two GEMMs of a decoder layer's FFN (docs/codec_architecture.md, "One layer") the codec applies
the exact GELU, ``GELU(x) = x / 2 * (1 + erf(x / sqrt(2)))``, to the ``(rows, dim_feedforward)`` output of
``linear1``. It is the widest activation of a step (v2: 3072 or 5120 channels per token row) and the pass
only streams it: one read and one write. PyTorch's in-place ``aten.gelu_`` is not memory-bound on the
H200: it streams the tensor well below the rate of an in-place multiply of the same tensor, which this
kernel comes close to (``benchmarks/RESULTS.md``); its float32 ``erf`` (libdevice ``__nv_erff``) costs
more instructions than the bytes allow.

:func:`gelu_` computes the same formula in float32 (``x * 0.5 * (1 + erf(x * M_SQRT1_2))``, then one
rounding to the tensor's dtype, as ``aten/src/ATen/native/cuda/ActivationGeluKernel.cu`` does) with its own
``erf``: ``erf(z) = sign(z) * (1 - 2 ** p(min(|z| / 4, 1)))``, where ``p`` is a degree-8 polynomial with
``p(0) = 0`` fitted here (``_ERFC_LOG2``, weighted least squares of ``log2(erfc(t))`` on ``[0, 4]``, the
weight ``erfc(t)`` making it a fit of ``erf`` itself) and evaluated by fused multiply-adds; beyond
``|z| = 4``, ``erfc < 1.6e-8`` and ``erf`` rounds to ``+-1`` in float32, as the exact value does. Its error
is at most about ``1.1e-7`` with an exact ``exp2`` (float32 evaluation emulated in float64), the size of
libdevice's own; on the GPU ``tl.exp2`` is the approximate ``ex2`` instruction, which can add about as
much again. Counted as the CUDA test counts (against the float64 formula rounded to bfloat16), over
every finite bfloat16 input the emulated kernel misses in 114 of 65280 values and ``aten.gelu_`` (float32
on the CPU, then rounded) in 257; both lose accuracy where ``1 + erf`` cancels, ``x`` below about -3,
and below about -5.7 both return -0 where the exact GELU is a tiny negative number. The CUDA tests
check on the device that the kernel misses no more values than ``aten.gelu_`` does there, by at most
one bfloat16 step from ``x = -3`` up, and hold bfloat16, float16 and float32 results to the float32
formula's error bound (``2e-7 |x|`` plus the dtype's rounding).

Dispatch is ``ops/dispatch.py``'s: CUDA tensors launch the kernel; CPU tensors run the reference
(``aten.gelu_``) unless the Triton interpreter is active at import (bfloat16 excepted). The decoder calls
the op only on CUDA steps of a bf16 decoder (``decoder.runs_fused_ops``) and not under ``torch.compile`` (inductor
fuses its own GELU there).
"""

from __future__ import annotations

import torch

from .dispatch import HAS_TRITON, device_guard, runs_triton_kernel, tl, triton

__all__ = ["GELU_COEFFICIENTS", "GELU_DTYPES", "gelu_", "gelu_reference_"]

#: Dtypes the kernel takes (16-bit activations under autocast, float32 otherwise).
GELU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Elements per program: 16 per thread at 8 warps, i.e. two 16-byte accesses per thread in bf16.
_BLOCK = 4096
#: Coefficients c1..c8 of p(s) = sum c_k s**k, s = min(|z| / 4, 1), with 2 ** p(s) ~ erfc(4 s) (module
#: docstring); float32 values of the least-squares fit, c0 = 0.
_ERFC_LOG2 = (
    -6.511638641357422,
    -14.694437980651855,
    -9.50684642791748,
    7.266939163208008,
    -0.9440452456474304,
    -5.741562843322754,
    6.867181777954102,
    -2.767754554748535,
)


def gelu_reference_(x: torch.Tensor) -> torch.Tensor:
    """PyTorch oracle for :func:`gelu_`: ``aten.gelu_`` (exact erf GELU) in place; returns ``x``."""
    return torch.ops.aten.gelu_(x)


#: ``_ERFC_LOG2`` as the constexpr arguments ``C1``..``C8`` of :func:`gelu_f32` and the kernels that call it.
GELU_COEFFICIENTS = dict(zip(("C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8"), _ERFC_LOG2))


if HAS_TRITON:

    @triton.jit
    def gelu_f32(
        xf, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr,
        C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr,
    ):  # fmt: skip
        # The exact GELU of float32 ``xf`` with this module's ``erf`` (module docstring), in float32. Every
        # kernel that calls it launches with enable_fp_fusion=False, so all of them round alike.
        z = xf * 0.7071067811865476
        s = tl.minimum(tl.abs(z) * 0.25, 1.0)
        p = tl.fma(C8, s, C7)
        p = tl.fma(p, s, C6)
        p = tl.fma(p, s, C5)
        p = tl.fma(p, s, C4)
        p = tl.fma(p, s, C3)
        p = tl.fma(p, s, C2)
        p = tl.fma(p, s, C1)
        erf_abs = 1.0 - tl.exp2(p * s)  # p(0) = 0: erf(0) = 0 exactly
        erf = tl.where(z < 0.0, -erf_abs, erf_abs)
        return (xf * 0.5) * (1.0 + erf)

    @triton.jit
    def _gelu_kernel(
        x_ptr, numel, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
        C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Program: elements [pid * BLOCK, pid * BLOCK + BLOCK) of the flat, contiguous tensor.
        index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = index < numel
        x = tl.load(x_ptr + index, mask=ok, other=0.0)
        y = gelu_f32(x.to(tl.float32), C1, C2, C3, C4, C5, C6, C7, C8)
        tl.store(x_ptr + index, y.to(x.dtype), mask=ok)


def _launch_triton(x: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError("gelu_: the Triton kernel needs the `triton` package")
    numel = x.numel()
    if numel == 0:
        return
    with device_guard(x):
        _gelu_kernel[(triton.cdiv(numel, _BLOCK),)](
            x, numel, **GELU_COEFFICIENTS, BLOCK=_BLOCK, num_warps=8, enable_fp_fusion=False
        )


@torch.library.custom_op("vllm_omni_moss::gelu_", mutates_args=("x",))
def _gelu_op(x: torch.Tensor) -> None:
    if runs_triton_kernel(x):
        _launch_triton(x)
    else:
        gelu_reference_(x)


@_gelu_op.register_fake
def _gelu_fake(x):
    return None


def gelu_(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU of ``x`` in place: PyTorch's float32 formula, with the kernel's own float32
    ``erf`` on CUDA (module docstring: within about 1.1e-7 plus the device ``exp2``'s error).

    Args:
        x: a contiguous tensor of any shape, dtype in :data:`GELU_DTYPES` (the FFN's
            ``(rows, dim_feedforward)`` activation, bf16 on CUDA under autocast).
    Returns:
        ``x``, overwritten with ``GELU(x)``.
    Raises:
        TypeError: ``x`` is not a tensor.
        ValueError: ``x`` has another dtype or is not contiguous (the message names ``x``).
        RuntimeError: a CUDA tensor without Triton installed.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"gelu_: `x` must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in GELU_DTYPES:
        raise ValueError(f"gelu_: `x` must have one of the dtypes {GELU_DTYPES}, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"gelu_: `x` must be contiguous (the kernel walks it flat), got strides {tuple(x.stride())}")
    torch.ops.vllm_omni_moss.gelu_(x)
    return x
