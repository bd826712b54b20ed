# SPDX-License-Identifier: Apache-2.0
"""RoPE of a step's queries and keys as one memory-bound pass, before the ring attention kernel reads them.

The codec rotates queries and keys by GPT-J interleaved pairs (docs/codec_architecture.md, "One layer";
``step_metadata.apply_rope`` is the reference formula). The ring attention kernels of ``ring_attention.py``
can rotate as they load (their ``cos``/``sin`` arguments), but on some H200s that variant of the attention
kernel ran many times slower than the same kernel on rotated inputs, while on others it was about as fast as
this pass and the kernel together (``benchmarks/RESULTS.md``, with the profile of the slow kernel).
This pass rotates once, so the attention kernel reads ready keys on every machine.

Each pair ``(x[2i], x[2i+1])`` is loaded and stored as one word (int32 for 16-bit dtypes, int64 for float32;
the low half holds ``x[2i]``), so accesses stay contiguous. :func:`rope` keeps the reference's roundings
bitwise: the pair is widened to float32, ``x[2i] cos_i - x[2i+1] sin_i`` and ``x[2i] sin_i + x[2i+1] cos_i``
round each product and sum on their own (the kernel is launched with ``enable_fp_fusion=False``), then each
result is rounded once to the input dtype. Index arithmetic: token and row offsets are int64; the plane and
head terms are int32 products, which the decoder's layouts keep far below 2**31 words (a head is ``Dh / 2``
words apart, a plane ``H x Dh / 2``).

Dispatch is ``ops/dispatch.py``'s: CUDA tensors launch the kernel; CPU tensors run the reference unless the
Triton interpreter is active at import, then the kernel runs interpreted (bfloat16 excepted).

:func:`step_rope_tables` builds the tables themselves (``step_metadata.rope_tables``) in one kernel per resolution
group on CUDA; on CPU, interpreter or not, it runs ``rope_tables`` (the interpreter has no libdevice ``fmod``).
"""

from __future__ import annotations

import math

import torch

from ..step_metadata import apply_rope, rope_tables
from .dispatch import HAS_TRITON, check_tensor, device_guard, runs_triton_kernel, tl, triton

__all__ = ["ROPE_DTYPES", "rope", "rope_reference", "step_rope_tables"]

#: Dtypes of the tensors the kernel rotates (16-bit projections under autocast, float32 otherwise).
ROPE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Tokens per program: one (row, token tile, plane, head) per program.
_BLOCK_T = 32


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """PyTorch oracle for :func:`rope`: ``step_metadata.apply_rope`` into a new contiguous tensor."""
    return apply_rope(x, cos, sin).contiguous()


if HAS_TRITON:

    @triton.jit
    def _rope_kernel(
        w_ptr, cos_ptr, sin_ptr, out_ptr, num_rows, num_heads, num_tokens, half,
        w_stride_p, w_stride_b, w_stride_h, w_stride_t, rope_stride_b, rope_stride_t, rope_stride_d,
        DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr,
    ):  # fmt: skip
        # Program (row, tile, plane x head): tokens [tile * BLOCK_T, + BLOCK_T) of one row, plane and head.
        # Each pair (x[2i], x[2i+1]) is one word (int32 for 16-bit dtypes, int64 for float32; the low half
        # holds x[2i]), so loads and stores stay contiguous and wide.
        row = tl.program_id(0).to(tl.int64)
        t = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
        plane = tl.program_id(2) // num_heads
        head = tl.program_id(2) % num_heads
        i = tl.arange(0, BLOCK_I)[None, :]
        ok = (t < num_tokens) & (i < half)
        table = row * rope_stride_b + t * rope_stride_t + i * rope_stride_d
        cos = tl.load(cos_ptr + table, mask=ok, other=0.0)
        sin = tl.load(sin_ptr + table, mask=ok, other=0.0)
        src = w_ptr + plane * w_stride_p + row * w_stride_b + head * w_stride_h + t * w_stride_t + i
        w = tl.load(src, mask=ok, other=0)
        if DTYPE == tl.float32:
            re = (w & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
            im = ((w >> 32) & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        else:
            re = (w & 0xFFFF).to(tl.uint16).to(DTYPE, bitcast=True).to(tl.float32)
            im = ((w >> 16) & 0xFFFF).to(tl.uint16).to(DTYPE, bitcast=True).to(tl.float32)
        # Each product and sum rounded to float32 on its own (enable_fp_fusion=False), as apply_rope.
        a = re * cos - im * sin
        b = re * sin + im * cos
        if DTYPE == tl.float32:
            lo = a.to(tl.uint32, bitcast=True).to(tl.int64)
            word = lo | (b.to(tl.uint32, bitcast=True).to(tl.int64) << 32)
        else:
            lo = a.to(DTYPE).to(tl.uint16, bitcast=True).to(tl.int32)
            word = lo | (b.to(DTYPE).to(tl.uint16, bitcast=True).to(tl.int32) << 16)
        dst = out_ptr + ((plane * num_rows + row) * num_heads + head) * num_tokens * half
        tl.store(dst + t * half + i, word, mask=ok)


#: Integer dtype of one (x[2i], x[2i+1]) pair, per element dtype.
_PAIR_WORDS = {torch.float32: torch.int64, torch.bfloat16: torch.int32, torch.float16: torch.int32}


def _launch_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if not HAS_TRITON:
        raise RuntimeError("rope: the Triton kernel needs the `triton` package")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_planes, num_rows, num_heads, num_tokens, head_dim = x.shape
    if out.numel() == 0:
        return out
    if x.stride(-1) != 1 or any(s % 2 for s in x.stride()[:-1]) or x.storage_offset() % 2:
        # Pairs must be whole words. A fresh copy, not contiguous(): a tensor PyTorch already counts as
        # contiguous may still start at an odd offset or carry an odd stride on a dim of size 1.
        x = x.clone(memory_format=torch.contiguous_format)
    words = x.view(_PAIR_WORDS[x.dtype])
    half = head_dim // 2
    dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x.dtype]
    grid = (num_rows, triton.cdiv(num_tokens, _BLOCK_T), num_planes * num_heads)
    with device_guard(x):
        _rope_kernel[grid](
            words, cos, sin, out.view(words.dtype), num_rows, num_heads, num_tokens, half,
            *words.stride()[:4], cos.stride(0), cos.stride(2), cos.stride(3),
            DTYPE=dtype, BLOCK_T=_BLOCK_T, BLOCK_I=max(16, triton.next_power_of_2(half)), num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out


@torch.library.custom_op("vllm_omni_moss::rope", mutates_args=())
def _rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if runs_triton_kernel(x):
        return _launch_triton(x, cos, sin)
    return rope_reference(x, cos, sin)


@_rope_op.register_fake
def _rope_fake(x, cos, sin):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate planes of queries or keys by GPT-J pairs: bitwise ``step_metadata.apply_rope``.

    Args:
        x: ``(P, B, H, T, Dh)`` in any strides (``qkv[:2]`` of a decoder layer: queries and keys), dtype in
            :data:`ROPE_DTYPES`; ``Dh`` even.
        cos, sin: ``(B, 1, T, Dh / 2)`` float32 tables of the rows' token positions
            (``step_metadata.rope_tables``), the same strides on the ``B``, ``T`` and ``Dh / 2`` dims, on
            ``x``'s device.
    Returns:
        A new contiguous ``(P, B, H, T, Dh)`` tensor in ``x``'s dtype. Inference only: the op has no
        autograd formula.
    Raises:
        TypeError: an argument is not a tensor.
        ValueError: a shape, dtype or device does not match (the message names the argument), or ``Dh``
            is odd.
        RuntimeError: a CUDA tensor without Triton installed.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"rope: `x` must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ROPE_DTYPES:
        raise ValueError(f"rope: `x` must have one of the dtypes {ROPE_DTYPES}, got {x.dtype}")
    if x.dim() != 5:
        raise ValueError(f"rope: `x` must have 5 dims (P, B, H, T, Dh), got shape {tuple(x.shape)}")
    _, num_rows, _, num_tokens, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"rope: RoPE needs an even head dim, got Dh = {head_dim}")
    table = (num_rows, 1, num_tokens, head_dim // 2)
    check_tensor("rope", "cos", cos, "(B, 1, T, Dh/2)", table, torch.float32, x.device)
    check_tensor("rope", "sin", sin, "(B, 1, T, Dh/2)", table, torch.float32, x.device)
    # The kernel reads both tables with cos's strides of the B, T and Dh/2 dims (dim 1 has size 1).
    if [cos.stride(d) for d in (0, 2, 3)] != [sin.stride(d) for d in (0, 2, 3)]:
        raise ValueError(
            f"rope: `cos` and `sin` must have the same strides on their B, T and Dh/2 dims, got {cos.stride()} "
            f"and {sin.stride()}"
        )
    return torch.ops.vllm_omni_moss.rope(x, cos, sin)


if HAS_TRITON:
    from triton.language.extra import libdevice

    @triton.jit
    def _tables_kernel(
        offsets_ptr, cos_ptr, sin_ptr, num_tokens, half,
        LOG_STEP: tl.constexpr, TWO_PI: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr,
    ):  # fmt: skip
        # Program (row, token tile): angles (offsets[row] + t) * f_i in float64, reduced mod 2 pi (fmod: both
        # are non-negative, so it is torch.remainder), their cos and sin rounded once to float32.
        row = tl.program_id(0).to(tl.int64)
        t = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
        i = tl.arange(0, BLOCK_I)[None, :]
        ok = (t < num_tokens) & (i < half)
        # libdevice's float64 functions are the CUDA math library's, which PyTorch's CUDA kernels call.
        # The two constants as float64 (a float argument would arrive as float32): the Python doubles the
        # reference computes with.
        freq = libdevice.exp(i.to(tl.float64) * tl.full((1, BLOCK_I), LOG_STEP, tl.float64))
        position = (tl.load(offsets_ptr + row) + t).to(tl.float64)
        angle = libdevice.fmod(freq * position, tl.full((BLOCK_T, BLOCK_I), TWO_PI, tl.float64))
        at = (row * num_tokens + t) * half + i
        tl.store(cos_ptr + at, libdevice.cos(angle).to(tl.float32), mask=ok)
        tl.store(sin_ptr + at, libdevice.sin(angle).to(tl.float32), mask=ok)


@torch.library.custom_op("vllm_omni_moss::rope_tables", mutates_args=())
def _tables_op(offsets: torch.Tensor, num_tokens: int, head_dim: int, max_period: float) -> list[torch.Tensor]:
    if not (offsets.is_cuda and HAS_TRITON):
        return list(rope_tables(offsets, num_tokens, head_dim, max_period))
    return _launch_tables(offsets, num_tokens, head_dim, max_period)


def _launch_tables(offsets: torch.Tensor, num_tokens: int, head_dim: int, max_period: float) -> list[torch.Tensor]:
    # The kernel's launch, apart from the op so that a CPU test can record its arguments.
    rows, half = offsets.shape[0], head_dim // 2
    cos = torch.empty(rows, 1, num_tokens, half, dtype=torch.float32, device=offsets.device)
    sin = torch.empty_like(cos)
    if cos.numel():
        grid = (rows, triton.cdiv(num_tokens, _BLOCK_T))
        with device_guard(offsets):
            _tables_kernel[grid](
                offsets, cos, sin, num_tokens, half, LOG_STEP=-math.log(max_period) * 2 / head_dim,
                TWO_PI=2 * math.pi, BLOCK_T=_BLOCK_T, BLOCK_I=max(16, triton.next_power_of_2(half)), num_warps=4,
            )  # fmt: skip
    return [cos, sin]


@_tables_op.register_fake
def _tables_fake(offsets, num_tokens, head_dim, max_period):
    shape = (offsets.shape[0], 1, num_tokens, head_dim // 2)
    return [offsets.new_empty(shape, dtype=torch.float32), offsets.new_empty(shape, dtype=torch.float32)]


def step_rope_tables(
    offsets: torch.Tensor, num_tokens: int, head_dim: int, max_period: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``step_metadata.rope_tables`` as one kernel on CUDA (a step builds a table per resolution group; the
    PyTorch formula is a dozen kernels each). The same float64 arithmetic: ``f_i = exp(i x (-ln(max_period)
    x 2 / Dh))``, angle ``(offset + t) x f_i`` reduced mod 2 pi, float32 cos and sin (the CUDA tests check
    the tables bitwise against ``rope_tables`` on the device). CPU tensors run ``rope_tables`` itself.

    Args:
        offsets: ``(B,)`` int64 start positions, contiguous.
        num_tokens: ``T``; head_dim: ``Dh`` (even); max_period: the RoPE base.
    Returns:
        ``(cos, sin)``, each ``(B, 1, T, Dh / 2)`` float32, contiguous.
    Raises:
        ValueError: ``offsets`` not a 1-D int64 tensor, ``num_tokens`` not an int ``>= 0``, ``head_dim`` not an
            even int ``>= 2``, or ``max_period`` not a finite number ``> 0`` (the message names the argument).
    """
    _check_table_args(offsets, num_tokens, head_dim, max_period)
    cos, sin = torch.ops.vllm_omni_moss.rope_tables(
        offsets.contiguous(), int(num_tokens), int(head_dim), float(max_period)
    )
    return cos, sin


def _check_table_args(offsets, num_tokens, head_dim, max_period) -> None:
    # Sizes traced symbolically (torch.SymInt) are the compiler's; only Python ints are checked here.
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype != torch.int64:
        got = f"shape {tuple(offsets.shape)} and {offsets.dtype}" if isinstance(offsets, torch.Tensor) else None
        raise ValueError(
            f"step_rope_tables: `offsets` must be a (B,) int64 tensor, got {got or type(offsets).__name__}"
        )
    if (
        isinstance(num_tokens, bool)
        or not isinstance(num_tokens, (int, torch.SymInt))
        or (isinstance(num_tokens, int) and num_tokens < 0)
    ):
        raise ValueError(f"step_rope_tables: `num_tokens` must be an int >= 0, got {num_tokens!r}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, torch.SymInt)):
        raise ValueError(f"step_rope_tables: `head_dim` must be an int, got {type(head_dim).__name__} {head_dim!r}")
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"step_rope_tables: RoPE needs an even head dim, got Dh = {head_dim}")
    if isinstance(max_period, bool) or not isinstance(max_period, (int, float)) or not 0 < max_period < math.inf:
        raise ValueError(f"step_rope_tables: `max_period` must be a finite number > 0, got {max_period!r}")
