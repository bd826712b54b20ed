# SPDX-License-Identifier: Apache-2.0
"""What the op files of this package share: the optional Triton import, where an op runs, the
shape-only argument check, and the jit helpers and launch arguments of the two ring kernels
(``ring_attention.py``, ``ring_write.py``): rotated loads and the addresses of ring cells.

Dispatch (:func:`runs_triton_kernel`): CUDA tensors launch an op's Triton kernel. CPU tensors run its
PyTorch reference, unless ``TRITON_INTERPRET=1`` was set when this module was imported (Triton decides
at ``@triton.jit`` time whether a kernel is compiled or interpreted, and every op module imports this
one before it decorates its kernels) and :data:`ALLOW_CPU_TRITON_INTERPRETER` is true; then CPU tensors
run the Triton kernel in Triton's interpreter, which is how CPU tests check the real kernels. Triton is
imported under a guard: without it every op module still imports, and CPU uses the references.
"""

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # Triton is optional on CPU-only installs.
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "ALLOW_CPU_TRITON_INTERPRETER",
    "HAS_TRITON",
    "TRITON_INTERPRET_AT_IMPORT",
    "cpu_uses_triton_interpreter",
    "runs_triton_kernel",
]

# Snapshot at import: whether Triton turned the kernels into interpreted functions is fixed by the
# environment at decoration time, so a later change of the variable cannot change how they run.
TRITON_INTERPRET_AT_IMPORT: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Tests may set this to False to force the references on CPU even in an interpreting process.
ALLOW_CPU_TRITON_INTERPRETER: bool = True


def cpu_uses_triton_interpreter() -> bool:
    """True when the ops run the Triton kernels (interpreted) on CPU tensors instead of the reference."""
    return HAS_TRITON and TRITON_INTERPRET_AT_IMPORT and ALLOW_CPU_TRITON_INTERPRETER


def runs_triton_kernel(tensor: torch.Tensor) -> bool:
    """Whether an op of this package launches its Triton kernel for ``tensor`` (the one whose dtype it
    computes in): always on CUDA; on CPU only under the interpreter (:func:`cpu_uses_triton_interpreter`)
    and not for bfloat16, which Triton's interpreter computes wrongly (it converts float32 to bfloat16
    toward zero and its bfloat16 dot products are not IEEE); the reference runs instead."""
    if tensor.is_cuda:
        return True
    return tensor.device.type == "cpu" and cpu_uses_triton_interpreter() and tensor.dtype != torch.bfloat16


def _device_guard(tensor: torch.Tensor):
    # Triton launches on the current CUDA device; make it the tensors' device.
    if tensor.is_cuda:
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


# Validation is shape/dtype/device only: no data reads, so no device sync and no graph break. Messages
# are plain f-strings over tuples: Dynamo can trace those (not ``str()`` of a SymInt), so a bad call
# inside torch.compile still reports this text, wrapped in Dynamo's "observed exception".


def _check_tensor(op: str, name: str, value, label: str, expected_shape, expected_dtype, device) -> None:
    """Raise unless ``value`` is a tensor of ``expected_shape``/``expected_dtype`` on ``device``.

    ``label`` names the dims, e.g. ``"(2, B, H, C, Dh)"``. ``expected_shape`` entries may be ints, SymInts,
    or None (any size); ``expected_dtype``/``device`` None skip that check. Raises TypeError for a
    non-tensor and ValueError naming ``name`` for a wrong rank, size, dtype or device.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(value).__name__}")
    mismatch = value.dim() != len(expected_shape)
    if not mismatch:
        for actual, expected in zip(value.shape, expected_shape):
            if expected is not None and actual != expected:
                mismatch = True
                break
    if mismatch:
        raise ValueError(f"{op}: `{name}` must have shape {label} = {tuple(expected_shape)}, got {tuple(value.shape)}")
    if expected_dtype is not None and value.dtype != expected_dtype:
        raise ValueError(f"{op}: `{name}` must have dtype {expected_dtype}, got {value.dtype}")
    if device is not None and value.device != device:
        raise ValueError(f"{op}: `{name}` must be on device {device}, got {value.device}")


# --------------------------------------------------------------------------------------------------
# Jit helpers and launch arguments of the ring kernels (ring_attention.py, ring_write.py)
# --------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _load_rotated(
        x_ptrs,
        cos_ptrs,
        sin_ptrs,
        load_ok,
        half_ok,
        BLOCK: tl.constexpr,
        BLOCK_D: tl.constexpr,
        ROPE: tl.constexpr,
    ):
        # A (BLOCK, BLOCK_D) tile of queries or keys in its own dtype; with ROPE, rotated by GPT-J pairs
        # (x[2i], x[2i+1]) with the (BLOCK, BLOCK_D // 2) float32 tables, each product and sum rounded
        # to float32 on its own (launched with enable_fp_fusion=False), then rounded to the input dtype:
        # bitwise step_metadata.apply_rope.
        x = tl.load(x_ptrs, mask=load_ok, other=0.0)
        if ROPE:
            cos = tl.load(cos_ptrs, mask=half_ok, other=0.0)
            sin = tl.load(sin_ptrs, mask=half_ok, other=0.0)
            re, im = tl.split(tl.reshape(x.to(tl.float32), (BLOCK, BLOCK_D // 2, 2)))
            rotated = tl.join(re * cos - im * sin, re * sin + im * cos)
            x = tl.reshape(rotated, (BLOCK, BLOCK_D)).to(x.dtype)
        return x

    @triton.jit
    def _cell_pointers(
        cache_ptr,
        slot,
        head,
        cell,
        ok,
        page_table_ptr,
        page_table_stride_s,
        page_table_stride_p,
        cache_stride_s,
        cache_stride_h,
        cache_stride_c,
        PAGED: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
    ):
        # Pointers to ring cells `cell` (a vector) of one (slot, head). Unpaged, the slot indexes the
        # cache's second axis; paged, that axis holds pages and cell c of the slot lives at row
        # c mod PAGE_SIZE of page page_table[slot, c // PAGE_SIZE]. Masked-off cells read no page id.
        # PAGE_SIZE is a compile-time constant, so both become multiplies and shifts.
        if PAGED:
            page = tl.load(
                page_table_ptr + slot * page_table_stride_s + (cell // PAGE_SIZE) * page_table_stride_p,
                mask=ok,
                other=0,
            ).to(tl.int64)
            return cache_ptr + page * cache_stride_s + head * cache_stride_h + (cell % PAGE_SIZE) * cache_stride_c
        else:
            return cache_ptr + slot * cache_stride_s + head * cache_stride_h + cell * cache_stride_c


def _paging_arguments(cache, page_table, fallback):
    # Ring capacity, the kernels' page-table arguments (pointer, strides), the PAGED flag and PAGE_SIZE.
    if page_table is None:
        return cache.shape[3], (fallback, 0, 0), False, 1
    page_size = cache.shape[3]
    return page_table.shape[1] * page_size, (page_table, *page_table.stride()), True, page_size


def _rope_arguments(cos, sin, fallback):
    # Kernel arguments for the optional RoPE tables: pointers, (b, t, d) strides and the ROPE flag.
    if cos is None:
        return (fallback, fallback, 0, 0, 0), False
    return (cos, sin, cos.stride(0), cos.stride(2), cos.stride(3)), True
