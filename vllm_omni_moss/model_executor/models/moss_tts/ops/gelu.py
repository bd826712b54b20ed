# SPDX-License-Identifier: Apache-2.0
"""The FFN's exact GELU, in place, as one memory-bound pass.

Between the two GEMMs of a decoder layer's FFN (docs/codec_architecture.md, "One layer") the codec applies
the exact GELU, ``GELU(x) = x / 2 * (1 + erf(x / sqrt(2)))``, to the ``(rows, dim_feedforward)`` output of
``linear1``. It is the widest activation of a step (v2: 3072 or 5120 channels per token row) and the pass
only streams it: one read and one write. PyTorch's in-place ``aten.gelu_`` moved about 3 TB/s on the H200
(``benchmarks/RESULTS.md``, Run O: 7.0 ms of a B128/T15 step for about 19 GB); :func:`gelu_` does the same
arithmetic with 16-byte accesses and large blocks.

Roundings follow PyTorch's CUDA GELU (``aten/src/ATen/native/cuda/ActivationGeluKernel.cu``, exact
branch): each element is widened to float32, ``x * 0.5 * (1 + erf(x * M_SQRT1_2))`` is computed in float32
(the halving is exact), with Triton's ``erf`` (libdevice ``__nv_erff``) and without fused multiply-adds
(``enable_fp_fusion=False``), then rounded once to the tensor's dtype. The CUDA test compares the result
with ``aten.gelu_`` element by element (``tests/.../test_ops_gelu.py``).

Dispatch is ``ops/commit.py``'s: CUDA tensors launch the kernel; CPU tensors run the reference
(``aten.gelu_``) unless the Triton interpreter is active at import (bfloat16 excepted). The decoder calls
the op only on CUDA steps with ``CodecDecoder.fused_glue`` set and not under ``torch.compile`` (inductor
fuses its own GELU there).
"""

from __future__ import annotations

import torch

from .commit import HAS_TRITON, _device_guard, runs_triton_kernel, tl, triton

__all__ = ["GELU_DTYPES", "gelu_", "gelu_reference_"]

#: Dtypes the kernel takes (16-bit activations under autocast, float32 otherwise).
GELU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Elements per program: 16 per thread at 8 warps, i.e. two 16-byte accesses per thread in bf16.
_BLOCK = 4096


def gelu_reference_(x: torch.Tensor) -> torch.Tensor:
    """PyTorch oracle for :func:`gelu_`: ``aten.gelu_`` (exact erf GELU) in place; returns ``x``."""
    return torch.ops.aten.gelu_(x)


if HAS_TRITON:

    @triton.jit
    def _gelu_kernel(x_ptr, numel, BLOCK: tl.constexpr):
        # Program: elements [pid * BLOCK, pid * BLOCK + BLOCK) of the flat, contiguous tensor.
        index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = index < numel
        x = tl.load(x_ptr + index, mask=ok, other=0.0)
        xf = x.to(tl.float32)
        y = (xf * 0.5) * (1.0 + tl.math.erf(xf * 0.7071067811865476))
        tl.store(x_ptr + index, y.to(x.dtype), mask=ok)


def _launch_triton(x: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError("gelu_: the Triton kernel needs the `triton` package")
    numel = x.numel()
    if numel == 0:
        return
    with _device_guard(x):
        _gelu_kernel[(triton.cdiv(numel, _BLOCK),)](x, numel, BLOCK=_BLOCK, num_warps=8, enable_fp_fusion=False)


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
    """Exact (erf) GELU of ``x`` in place, with PyTorch's float32 arithmetic (module docstring).

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
