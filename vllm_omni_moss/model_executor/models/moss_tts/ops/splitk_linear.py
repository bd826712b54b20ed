# SPDX-License-Identifier: Apache-2.0
"""The projections of a small step as one split-K GEMM kernel each, summed in a fixed order.

A step of a few token rows (a new stream's first frame, a handful of streams at one frame each) multiplies
every projection weight of the decoder by at most :data:`MAX_ROWS` rows: the v2 codec's 2.1 GB of bf16
weights are read once per step, so the step's GEMMs are bound by how fast they read them. cuBLAS runs those
shapes well above the weights' read time at the device-to-device copy rate (``benchmarks/RESULTS.md``),
because a tile of output columns walks all of ``K`` in one program: too few programs are in flight to
keep the memory system busy.

:func:`splitk_linear` cuts ``K`` as well. The grid is (column tiles, splits): program ``(n, s)`` computes
the float32 partial product of all rows with the tile's ``block_n`` weight rows over its slice of ``K``
(``ceil(K / splits)`` rounded up to ``block_k``) and stores it into a float32 workspace
``(splits, M, N)``. It then increments the tile's arrival counter (an atomic with acquire-release order,
so its stores are visible to whoever sees the count). The program that arrives last sums the tile's
partials in split order ``0, 1, ..., splits - 1``, rounds once to the output dtype, stores the tile and
resets the counter to zero for the next launch. The order of the sum never depends on which program
arrives last, so results are bitwise repeatable; they differ from cuBLAS's by the order of float32
accumulation only (its kernels also split ``K`` for these shapes).

For the FFN's first projection (``gelu=True``) the store applies ``ops/gelu.py``'s exact GELU to the rounded
value and rounds again, as that op's separate pass over the output would: the result is bitwise
``gelu_(splitk_linear(x, weight))`` and the step launches one kernel fewer per layer.

The counters live in one zeroed int32 buffer per device that every launch on it shares, each launch
leaving its counters at zero; so launches of this op on one device must run one after another (the decoder
runs its steps, eager or replayed, on one stream at a time). The buffer is created, zeroed, by the first
launch on a device, which must run outside CUDA graph capture: created inside a capture, it would be zeroed
only when that graph replays, and another graph replayed first would read whatever the memory held. The
decoder's graph runners step once eagerly before they capture; a first launch inside a capture raises.

Dispatch is ``ops/dispatch.py``'s: CUDA tensors launch the kernel; CPU tensors run the reference
(``torch.nn.functional.linear``) unless the Triton interpreter is active at import (bfloat16 excepted).
The decoder calls the op only on CUDA steps of at most :data:`MAX_ROWS` token rows with
``CodecDecoder.fused_glue`` and ``CodecDecoder.splitk_projections`` set (the latter off by default).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import HAS_TRITON, check_tensor, device_guard, runs_triton_kernel, tl, triton
from .gelu import GELU_COEFFICIENTS, gelu_reference_

if HAS_TRITON:
    from .gelu import gelu_f32

__all__ = ["MAX_ROWS", "SPLITK_DTYPES", "splitk_launch_config", "splitk_linear", "splitk_linear_reference"]

#: Most token rows the kernel takes: one block of 16 or 32 rows per program (``tl.dot`` needs 16 at least).
MAX_ROWS = 32
#: Dtypes the kernel takes (activation and weight alike).
SPLITK_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Column tiles the counter buffer of a device holds, for launches of several splits (v2: at most 5120 / 16 = 320).
_MAX_TILES = 4096

#: Largest element offset of ``x`` and of the output: the kernel computes them in int32.
_MAX_OFFSET = 2**31 - 1

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def splitk_launch_config(rows: int, out_features: int, in_features: int) -> dict:
    """Launch parameters of :func:`splitk_linear` for ``(rows, in_features) x (out_features, in_features)^T``.

    Returns:
        ``{"splits", "block_n", "block_k", "num_warps", "num_stages"}``: ``splits`` slices of ``K``,
        ``block_n`` output columns and ``block_k`` of ``K`` per inner step of a program.
    """
    block_n = 32 if out_features <= 1536 else 64
    tiles = -(-out_features // block_n)
    splits = 1
    while tiles * splits < 256 and in_features // (splits * 2) >= 128:
        splits *= 2
    return dict(splits=splits, block_n=block_n, block_k=128, num_warps=4, num_stages=3)


def splitk_linear_reference(x: torch.Tensor, weight: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """PyTorch oracle for :func:`splitk_linear`: ``F.linear(x, weight)``, then with ``gelu``
    ``ops/gelu.py``'s reference (``aten.gelu_``) in place."""
    out = F.linear(x, weight)
    return gelu_reference_(out) if gelu else out


if HAS_TRITON:

    @triton.jit
    def _epilogue(
        total, out_ptr, GELU: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
        C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr,
    ):  # fmt: skip
        # The tile's float32 sum rounded once to the output dtype; with GELU, ops/gelu.py's GELU of that
        # rounded value, rounded again: bitwise the GEMM followed by gelu_'s pass.
        y = total.to(out_ptr.dtype.element_ty)
        if GELU:
            y = gelu_f32(y.to(tl.float32), C1, C2, C3, C4, C5, C6, C7, C8).to(out_ptr.dtype.element_ty)
        return y

    @triton.jit
    def _splitk_kernel(
        x_ptr, w_ptr, partial_ptr, out_ptr, counter_ptr, M, N, K, k_per_split,
        SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GELU: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
        C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr,
    ):  # fmt: skip
        # Program (column tile n, split s): rows [0, M) x columns [n * BLOCK_N, + BLOCK_N) over K in
        # [s * k_per_split, + k_per_split); the last split of the tile to arrive sums all splits in order.
        tile = tl.program_id(0)
        split = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        k_first = split * k_per_split
        k_end = tl.minimum(k_first + k_per_split, K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_first, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < k_end
            x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(
                w_ptr + cols.to(tl.int64)[:, None] * K + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0
            )
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        ok = row_ok[:, None] & col_ok[None, :]
        out = out_ptr + rows[:, None] * N + cols[None, :]
        if SPLITS == 1:
            tl.store(out, _epilogue(acc, out_ptr, GELU, C1, C2, C3, C4, C5, C6, C7, C8), mask=ok)
        else:
            partial = partial_ptr + rows[:, None] * N + cols[None, :]
            tl.store(partial + split * M * N, acc, mask=ok)
            # Every thread's stores land before the one thread of the program that counts it releases them.
            tl.debug_barrier()
            arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLITS - 1:
                tl.debug_barrier()
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    # .cg: read past this SM's L1, which may hold nothing of the other programs' stores.
                    total += tl.load(partial + s * M * N, mask=ok, other=0.0, cache_modifier=".cg")
                tl.store(out, _epilogue(total, out_ptr, GELU, C1, C2, C3, C4, C5, C6, C7, C8), mask=ok)
                tl.atomic_xchg(counter_ptr + tile, 0)


def _counters(device: torch.device) -> torch.Tensor:
    """The zeroed arrival counters of ``device`` (module docstring).

    Raises:
        RuntimeError: the first launch on a CUDA device runs inside CUDA graph capture.
    """
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"splitk_linear: the first launch on {device} runs inside CUDA graph capture; its arrival counters "
                "must be created and zeroed outside a capture (launch it once eagerly before capturing)"
            )
        _COUNTERS[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def _launch_triton(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: dict, gelu: bool = False) -> None:
    if not HAS_TRITON:
        raise RuntimeError("splitk_linear: the Triton kernel needs the `triton` package")
    M, K = x.shape
    N = weight.shape[0]
    splits, block_n, block_k = config["splits"], config["block_n"], config["block_k"]
    tiles = triton.cdiv(N, block_n)
    # Only launches of several splits count arrivals (splitk_launch_config splits K below 256 tiles only).
    if splits > 1 and tiles > _MAX_TILES:
        raise ValueError(f"splitk_linear: {tiles} column tiles exceed the {_MAX_TILES} counters")
    k_per_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    partial = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    with device_guard(x):
        _splitk_kernel[(tiles, splits)](
            x, weight, partial, out, _counters(x.device), M, N, K, k_per_split, SPLITS=splits,
            BLOCK_M=16 if M <= 16 else 32, BLOCK_N=block_n, BLOCK_K=block_k, GELU=gelu, **GELU_COEFFICIENTS,
            num_warps=config["num_warps"], num_stages=config["num_stages"], enable_fp_fusion=False,
        )  # fmt: skip


@torch.library.custom_op("vllm_omni_moss::splitk_linear", mutates_args=())
def _splitk_op(x: torch.Tensor, weight: torch.Tensor, gelu: bool) -> torch.Tensor:
    if not runs_triton_kernel(x) or x.shape[0] == 0:
        return splitk_linear_reference(x, weight, gelu)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch_triton(x, weight, out, splitk_launch_config(x.shape[0], weight.shape[0], weight.shape[1]), gelu)
    return out


@_splitk_op.register_fake
def _splitk_fake(x, weight, gelu):
    return x.new_empty(x.shape[0], weight.shape[0])


def splitk_linear(x: torch.Tensor, weight: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """``x @ weight.T`` for at most :data:`MAX_ROWS` rows, as one split-K kernel on CUDA (module docstring);
    with ``gelu``, the exact GELU of the product in the same kernel.

    Args:
        x: ``(M, K)`` contiguous activations, ``M <= MAX_ROWS``, dtype in :data:`SPLITK_DTYPES`.
        weight: ``(N, K)`` contiguous weight (``nn.Linear``'s layout), ``x``'s dtype and device.
        gelu: apply ``ops/gelu.py``'s GELU to the rounded product before storing it (the FFN's first
            projection): bitwise ``gelu_(splitk_linear(x, weight))``, one kernel instead of two.
    Returns:
        ``(M, N)`` in ``x``'s dtype: float32 products accumulated per split, the splits summed in order
        and rounded once (then, with ``gelu``, the GELU of that value in float32, rounded again).
    Raises:
        TypeError: ``x`` or ``weight`` is not a tensor, or ``gelu`` is not a bool.
        ValueError: a shape, dtype, device or layout outside the above, or ``x`` or the output of more
            than ``2**31 - 1`` elements (the message names the argument and the limit).
        RuntimeError: a CUDA tensor without Triton installed.
    """
    op = "splitk_linear"
    check_tensor(op, "x", x, "(M, K)", (None, None), None, None)
    check_tensor(op, "weight", weight, "(N, K)", (None, x.shape[1]), x.dtype, x.device)
    if x.dtype not in SPLITK_DTYPES:
        raise ValueError(f"{op}: `x` must have one of the dtypes {SPLITK_DTYPES}, got {x.dtype}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{op}: `x` has {x.shape[0]} rows; the kernel takes at most {MAX_ROWS}")
    # The kernel addresses x, the output and its float32 partials with int32 offsets (the weight's are int64).
    for what, size in (("`x`", x.shape[0] * x.shape[1]), ("the output", x.shape[0] * weight.shape[0])):
        if size > _MAX_OFFSET:
            raise ValueError(f"{op}: {what} has {size} elements; the kernel's int32 offsets take at most {_MAX_OFFSET}")
    for name, t in (("x", x), ("weight", weight)):
        if not t.is_contiguous():
            raise ValueError(f"{op}: `{name}` must be contiguous, got strides {tuple(t.stride())}")
    if not isinstance(gelu, bool):
        raise TypeError(f"{op}: `gelu` must be a bool, got {type(gelu).__name__}")
    return torch.ops.vllm_omni_moss.splitk_linear(x, weight, gelu)
