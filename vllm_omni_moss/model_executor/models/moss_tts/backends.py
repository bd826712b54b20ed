# SPDX-License-Identifier: Apache-2.0
"""What this installation can run: the optional Triton import and the attention backends a pool may be built with.

The state spec (``state/spec.py``) checks a pool's attention backend and ring dtype against these facts when it is
made, without importing an op or the attention module: the pool is memory, and the step that runs over it picks
its plan (``attention.step_plan``). The op families (``ops/``) take Triton from here through ``ops/dispatch.py``.
Triton is imported under a guard: without it every module still imports, CPU runs the ops' references, and only
the ``"triton"`` backend is refused.
"""

from __future__ import annotations

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
    "ATTENTION_BACKENDS",
    "HAS_TRITON",
    "RING_DTYPES",
    "check_attention_backend",
    "default_attention_backend",
    "tl",
    "triton",
]

#: Attention backends a compact pool can be built with: ``"sdpa"`` gathers rings and runs
#: native SDPA (the parity oracle); ``"triton"`` reads rings in place (``ops/ring_attention.py``).
ATTENTION_BACKENDS = ("sdpa", "triton")

#: The ring dtypes the Triton ring ops take (the ``"triton"`` backend's rings).
RING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def default_attention_backend(device: torch.device | str) -> str:
    """The attention backend a compact pool on ``device`` uses when none is asked for.

    ``"triton"`` on CUDA when the ``triton`` package is installed (its H200 gates and step table:
    ``benchmarks/RESULTS.md``); ``"sdpa"`` (the reference path) on every other device, and on CUDA
    without Triton.
    """
    return "triton" if torch.device(device).type == "cuda" and HAS_TRITON else "sdpa"


def check_attention_backend(name: str) -> str:
    """``name`` if it is a usable attention backend here.

    Raises:
        ValueError: ``name`` is not one of :data:`ATTENTION_BACKENDS` (the message lists them).
        RuntimeError: ``"triton"`` without the ``triton`` package installed.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {ATTENTION_BACKENDS}")
    if name == "triton" and not HAS_TRITON:
        raise RuntimeError(
            "attention backend 'triton' needs the `triton` package, which is not installed; "
            "install it or use attention backend 'sdpa'"
        )
    return name
