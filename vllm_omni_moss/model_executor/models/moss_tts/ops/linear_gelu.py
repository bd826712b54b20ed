# SPDX-License-Identifier: Apache-2.0
"""The FFN's first projection and its exact GELU in one kernel: ``GELU(h @ W1^T)``.

The feed-forward sublayer of a codec decoder layer (docs/codec_architecture.md, "One layer") is
``linear2(GELU(linear1(h)))`` with no biases and the exact (erf) GELU. Unfused under bf16 autocast,
``linear1`` writes its ``(rows, dim_feedforward)`` bf16 output and the GELU kernel reads it back and
writes it again: for the v2 codec at 64 rows x 15 frames that is about 9 GB of memory traffic a step,
3.6 ms on the H200 (``benchmarks/RESULTS.md``, Run H profile, "elementwise"). :func:`linear_gelu`
applies the GELU to each output tile while it is still in registers, so the activation is written once
and never read back before ``linear2``.

Rounding points are the unfused decoder's: the float32 accumulator is rounded to the output dtype (what
``linear1`` returns), widened to float32, put through ``0.5 * y * (1 + erf(y / sqrt(2)))`` (the formula
and float32 opmath of PyTorch's CUDA GELU for 16-bit inputs) and rounded again. Given the same ``linear1``
output the GELU is the same; the products differ from cuBLAS's only in accumulation order (GEMM rounding).

Dispatch: the decoder calls the kernel for 16-bit CUDA tensors only (float32 GEMMs in PyTorch do not use
TF32 by default and Triton's would). CPU tensors run the reference unless the Triton interpreter is
active at import (bfloat16 excepted), as in ``ops/commit.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .commit import HAS_TRITON, _device_guard, runs_triton_kernel, tl, triton

__all__ = ["LAUNCH_KEYS", "linear_gelu", "linear_gelu_launch_config", "linear_gelu_reference"]


def linear_gelu_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """PyTorch oracle for :func:`linear_gelu`: ``gelu_(F.linear(x, weight))``, the unfused decoder's FFN head."""
    return torch.ops.aten.gelu_(F.linear(x, weight))


if HAS_TRITON:

    @triton.jit
    def _linear_gelu_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        rows,
        n_out,
        k_in,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        EVEN_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # x: (rows, k_in), w: (n_out, k_in), out: (rows, n_out), all contiguous. One program computes one
        # (BLOCK_M, BLOCK_N) output tile; tiles are visited in column bands of GROUP_M row tiles so that
        # consecutive programs share weight tiles in L2.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(rows, BLOCK_M)
        tiles_n = tl.cdiv(n_out, BLOCK_N)
        band = pid // (GROUP_M * tiles_n)
        first_m = band * GROUP_M
        band_rows = min(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (pid % (GROUP_M * tiles_n)) % band_rows
        tile_n = (pid % (GROUP_M * tiles_n)) // band_rows

        m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        row_ok = m < rows
        col_ok = n < n_out
        x_tile = x_ptr + m.to(tl.int64)[:, None] * k_in + kk[None, :]
        w_tile = w_ptr + n.to(tl.int64)[None, :] * k_in + kk[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_tile, mask=row_ok[:, None], other=0.0)
                b = tl.load(w_tile, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = (k0 + kk) < k_in
                a = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_tile, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            x_tile += BLOCK_K
            w_tile += BLOCK_K
        # linear1's rounding, then the exact GELU in float32, then the activation's rounding.
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
        out = out_ptr + m.to(tl.int64)[:, None] * n_out + n[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _linear_gelu_tma_kernel(
        x_desc,
        w_desc,
        out_desc,
        rows,
        n_out,
        k_in,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        PROGRAMS: tl.constexpr,
        FLATTEN: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # Persistent: PROGRAMS programs (one per SM at most) walk the output tiles in the banded order of
        # _linear_gelu_kernel. Tiles move through tensor-memory-accelerator descriptors (rows past the end
        # load as zeros and are not stored); FLATTEN lets the compiler pipeline the next tile's loads
        # under this tile's epilogue.
        tiles_m = tl.cdiv(rows, BLOCK_M)
        tiles_n = tl.cdiv(n_out, BLOCK_N)
        k_steps = tl.cdiv(k_in, BLOCK_K)
        band_tiles = GROUP_M * tiles_n
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=FLATTEN):
            first_m = (tile // band_tiles) * GROUP_M
            band_rows = min(tiles_m - first_m, GROUP_M)
            row0 = (first_m + (tile % band_tiles) % band_rows) * BLOCK_M
            col0 = ((tile % band_tiles) // band_rows) * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for step in range(k_steps):
                a = x_desc.load([row0, step * BLOCK_K])
                b = w_desc.load([col0, step * BLOCK_K])
                acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
            y = acc.to(out_desc.dtype).to(tl.float32)
            y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
            out_desc.store([row0, col0], y.to(out_desc.dtype))


#: The keys of a launch configuration (:func:`linear_gelu_launch_config`), which ``tuning`` may override.
LAUNCH_KEYS = ("kernel", "block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages", "flatten")


def linear_gelu_launch_config(rows: int, n_out: int, k_in: int) -> dict:
    """Launch parameters of the kernel for a ``(rows, k_in) x (k_in, n_out)`` product.

    Returns a dict with the keys of :data:`LAUNCH_KEYS`: output tile ``block_m x block_n``, ``block_k``
    inputs per inner iteration, ``group_m`` row tiles per band of the tile order, ``num_warps`` and
    ``num_stages`` (software pipelining depth). Chosen on an H200 by sweeping the v2 codec's FFN shapes
    (``benchmarks/tts/bench_linear_gelu.py``; ``benchmarks/RESULTS.md``, "Fused GELU sweep").
    """
    if rows <= 64:
        return dict(
            kernel="pointer", block_m=16, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4, flatten=False
        )
    return dict(kernel="tma", block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, flatten=True)


def _launch_config(rows: int, n_out: int, k_in: int, tuning: dict | None) -> dict:
    config = linear_gelu_launch_config(rows, n_out, k_in)
    unknown = sorted(set(tuning or ()) - set(LAUNCH_KEYS))
    if unknown:
        raise ValueError(f"linear_gelu: unknown launch configuration keys {unknown}; expected some of {LAUNCH_KEYS}")
    config.update(tuning or {})
    return config


def _launch_triton(x: torch.Tensor, weight: torch.Tensor, tuning: dict | None = None) -> torch.Tensor:
    """Launch the kernel on ``x`` viewed as ``(rows, k_in)``; returns ``(..., n_out)`` in ``x``'s dtype."""
    if not HAS_TRITON:
        raise RuntimeError("linear_gelu: the Triton kernel needs the `triton` package")
    k_in = x.shape[-1]
    n_out = weight.shape[0]
    flat = x.reshape(-1, k_in).contiguous()
    weight = weight.contiguous()
    rows = flat.shape[0]
    out = torch.empty((*x.shape[:-1], n_out), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    config = _launch_config(rows, n_out, k_in, tuning)
    # IEEE products for float32 inputs, as PyTorch's default matmul (no TF32); Triton's default (which
    # only concerns float32 operands) otherwise.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    tiles = triton.cdiv(rows, config["block_m"]) * triton.cdiv(n_out, config["block_n"])
    with _device_guard(x):
        # Descriptors need 16-byte aligned row strides; other widths take the pointer kernel.
        if config["kernel"] == "tma" and (k_in * x.element_size()) % 16 == 0 and (n_out * x.element_size()) % 16 == 0:
            from triton.tools.tensor_descriptor import TensorDescriptor

            programs = min(tiles, _processor_count(x.device))
            block_m, block_n, block_k = config["block_m"], config["block_n"], config["block_k"]
            _linear_gelu_tma_kernel[(programs,)](
                TensorDescriptor.from_tensor(flat, [block_m, block_k]),
                TensorDescriptor.from_tensor(weight, [block_n, block_k]),
                TensorDescriptor.from_tensor(out.view(rows, n_out), [block_m, block_n]),
                rows,
                n_out,
                k_in,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                BLOCK_K=block_k,
                GROUP_M=config["group_m"],
                PROGRAMS=programs,
                FLATTEN=config["flatten"],
                PRECISION=precision,
                num_warps=config["num_warps"],
                num_stages=config["num_stages"],
            )
            return out
        _linear_gelu_kernel[(tiles,)](
            flat,
            weight,
            out,
            rows,
            n_out,
            k_in,
            BLOCK_M=config["block_m"],
            BLOCK_N=config["block_n"],
            BLOCK_K=config["block_k"],
            GROUP_M=config["group_m"],
            EVEN_K=k_in % config["block_k"] == 0,
            PRECISION=precision,
            num_warps=config["num_warps"],
            num_stages=config["num_stages"],
        )
    return out


_PROCESSOR_COUNTS: dict[int, int] = {}


def _processor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (programs of the persistent kernel); 4 on CPU."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROCESSOR_COUNTS:
        _PROCESSOR_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _PROCESSOR_COUNTS[index]


@torch.library.custom_op("vllm_omni_moss::linear_gelu", mutates_args=())
def _linear_gelu_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if runs_triton_kernel(x):
        return _launch_triton(x, weight)
    return linear_gelu_reference(x, weight).contiguous()


@_linear_gelu_op.register_fake
def _linear_gelu_fake(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear_gelu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``GELU(x @ weight^T)`` with the exact GELU, in one kernel (module docstring).

    Args:
        x: ``(..., k_in)`` activations (bf16 on CUDA under autocast; any float dtype).
        weight: ``(n_out, k_in)`` an ``nn.Linear`` weight (no bias) in ``x``'s dtype and on its device.
    Returns:
        ``(..., n_out)`` contiguous, in ``x``'s dtype.
    Raises:
        TypeError: an argument is not a tensor.
        ValueError: a shape, dtype or device that differs from the above (the message names the tensor
            and what it expected).
        RuntimeError: CUDA tensors without Triton installed.
    """
    for name, value in (("x", x), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"linear_gelu: `{name}` must be a torch.Tensor, got {type(value).__name__}")
        if not value.dtype.is_floating_point:
            raise ValueError(f"linear_gelu: `{name}` must have a floating-point dtype, got {value.dtype}")
    if x.dim() < 1:
        raise ValueError("linear_gelu: `x` must have shape (..., k_in), got a 0-dim tensor")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"linear_gelu: `weight` must have shape (n_out, {x.shape[-1]}) for `x` of shape {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"linear_gelu: `weight` must have the dtype of `x` ({x.dtype}), got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"linear_gelu: `weight` must be on the device of `x` ({x.device}), got {weight.device}")
    return torch.ops.vllm_omni_moss.linear_gelu(x, weight)
