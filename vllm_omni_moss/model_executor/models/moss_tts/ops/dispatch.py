# SPDX-License-Identifier: Apache-2.0
"""What every op family of this package shares: Triton (imported under a guard by ``backends.py``), where an op
runs, the device a kernel launches on, and the shape-only argument check.

Dispatch (:func:`runs_triton_kernel`): CUDA tensors launch an op's Triton kernel. CPU tensors run its
PyTorch reference, unless ``TRITON_INTERPRET=1`` was set when this module was imported (Triton decides
at ``@triton.jit`` time whether a kernel is compiled or interpreted, and every op module imports this
one before it decorates its kernels) and :data:`ALLOW_CPU_TRITON_INTERPRETER` is true; then CPU tensors
run the Triton kernel in Triton's interpreter, which is how CPU tests check the real kernels. Without
Triton every op module still imports, and CPU uses the references.
"""

import contextlib
import os

import torch

from ..backends import HAS_TRITON, tl, triton

__all__ = [
    "ALLOW_CPU_TRITON_INTERPRETER",
    "HAS_TRITON",
    "TRITON_INTERPRET_AT_IMPORT",
    "check_tensor",
    "cpu_uses_triton_interpreter",
    "device_guard",
    "runs_triton_kernel",
    "tl",
    "triton",
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


def device_guard(tensor: torch.Tensor):
    """The context a kernel launches in: ``torch.cuda.device(tensor.device)`` for a CUDA tensor (Triton
    launches on the current CUDA device), else a null context."""
    if tensor.is_cuda:
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


# Validation is shape/dtype/device only: no data reads, so no device sync and no graph break. Messages
# are plain f-strings over tuples: Dynamo can trace those (not ``str()`` of a SymInt), so a bad call
# inside torch.compile still reports this text, wrapped in Dynamo's "observed exception".


def check_tensor(op: str, name: str, value, label: str, expected_shape, expected_dtype, device) -> None:
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
