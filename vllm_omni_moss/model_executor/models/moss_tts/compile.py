# SPDX-License-Identifier: Apache-2.0
"""``torch.compile`` boundary of a streaming step.

A step is ``step.decode_tensors(pool, codes, valid_frames, state_slot_ids,
valid_rows, frames)``: tensor-only, no host syncs, no Python branching on tensor values, so it
compiles with ``fullgraph=True`` and dynamic row and packed-frame dimensions (``frames``, the
most frames of a row, is a Python int: one compiled variant per value, one per session).

The adapters are ``nn.Module`` s because vLLM's ``support_torch_compile`` decorates
module classes, and its compile cache keys artifacts on the decorated class. The
legacy and compact pools mutate state differently (whole-ring ``index_copy_`` versus
the masked ``commit_ring`` / ``commit_offsets`` ops), so each pool class has its own
adapter class: an artifact compiled for one can never be reused for the other. A pool
kind's record names its adapter (``pool_kinds.PoolKind.compile_adapter``), resolved in
:data:`COMPILE_ADAPTERS`; a kind that names none (the paged pool) is never compiled. The
stage subclasses these classes under vLLM's decorator; this module never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .pool_kinds import POOL_KIND_RECORDS, pool_kind_record
from .state import POOL_CLASSES, DecoderStatePool
from .step import decode_tensors

__all__ = [
    "COMPILE_ADAPTERS",
    "DYNAMIC_ARG_DIMS",
    "CompactDecodeCompileAdapter",
    "LegacyDecodeCompileAdapter",
    "adapter_class_for",
    "compile_decode",
]

#: Dynamic dimensions of the adapter's forward arguments (``support_torch_compile`` format).
DYNAMIC_ARG_DIMS: dict[str, dict[int, str]] = {
    "codes": {1: "packed_frames"},
    "valid_frames": {0: "batch"},
    "state_slot_ids": {0: "batch"},
    "valid_rows": {0: "batch"},
}


class _DecodeCompileAdapter(nn.Module):
    """Module view of one pool's streaming step.

    The decoder is registered as a submodule so the weights are visible to compile
    machinery that walks parameters; the pool is a plain attribute (it owns state
    tensors, not parameters).

    Raises:
        ValueError: a pool whose kind's record names another adapter (or none).
    """

    def __init__(self, pool: DecoderStatePool):
        super().__init__()
        name = self.adapter_name()
        record = pool_kind_record(pool.kind)
        if record is None or record.compile_adapter != name:
            adapted = " or ".join(
                POOL_CLASSES[k].__name__ for k, r in POOL_KIND_RECORDS.items() if r.compile_adapter == name
            )
            raise ValueError(f"{type(self).__name__} adapts {adapted} pools, got a {type(pool).__name__}")
        self.decoder = pool.decoder
        self.pool = pool

    @classmethod
    def adapter_name(cls) -> str:
        """The name the pool kinds' records give this adapter: its own class's, or the core class it derives from
        (vLLM's decorated subclasses)."""
        return next((c.__name__ for c in cls.__mro__ if c.__name__ in COMPILE_ADAPTERS), cls.__name__)

    def _step(self, codes, valid_frames, state_slot_ids, valid_rows, frames):
        return decode_tensors(self.pool, codes, valid_frames, state_slot_ids, valid_rows, frames)


# Each concrete class defines its own ``forward``: vLLM's AOT cache hashes
# ``forward.__qualname__`` and its first line, so an inherited forward would give the
# two pool classes one cache identity.


class LegacyDecodeCompileAdapter(_DecodeCompileAdapter):
    """Adapter for :class:`~.state.LegacyDecoderStatePool` (scratch slots, whole-ring write-back)."""

    def forward(
        self,
        codes: torch.Tensor,
        valid_frames: torch.Tensor,
        state_slot_ids: torch.Tensor,
        valid_rows: torch.Tensor,
        frames: int,
    ) -> torch.Tensor:
        """``codes (n_vq, F)`` int64 packed, ``valid_frames (R,)`` int64, ``state_slot_ids (R,)`` int64,
        ``valid_rows (R,)`` bool, ``frames`` = ``T`` -> ``audio (channels, F * spf)`` float32 packed."""
        return self._step(codes, valid_frames, state_slot_ids, valid_rows, frames)


class CompactDecodeCompileAdapter(_DecodeCompileAdapter):
    """Adapter for :class:`~.state.CompactDecoderStatePool` (null slot, masked commits)."""

    def forward(
        self,
        codes: torch.Tensor,
        valid_frames: torch.Tensor,
        state_slot_ids: torch.Tensor,
        valid_rows: torch.Tensor,
        frames: int,
    ) -> torch.Tensor:
        """``codes (n_vq, F)`` int64 packed, ``valid_frames (R,)`` int64, ``state_slot_ids (R,)`` int64,
        ``valid_rows (R,)`` bool, ``frames`` = ``T`` -> ``audio (channels, F * spf)`` float32 packed."""
        return self._step(codes, valid_frames, state_slot_ids, valid_rows, frames)


#: The adapter classes by the name a pool kind's record gives (``pool_kinds.PoolKind.compile_adapter``).
COMPILE_ADAPTERS: dict[str, type[_DecodeCompileAdapter]] = {
    cls.__name__: cls for cls in (LegacyDecodeCompileAdapter, CompactDecodeCompileAdapter)
}


def adapter_class_for(pool: DecoderStatePool) -> type[_DecodeCompileAdapter]:
    """The adapter class that ``pool``'s kind's record names.

    Raises:
        ValueError: a pool whose kind has no adapter.
    """
    record = pool_kind_record(pool.kind)
    if record is None or record.compile_adapter is None:
        raise ValueError(f"no compile adapter for {type(pool).__name__}")
    return COMPILE_ADAPTERS[record.compile_adapter]


def _mark_dynamic(tensor: torch.Tensor, dims: dict[int, str]) -> None:
    # maybe_mark_dynamic, not mark_dynamic: a row count or packed length of 1 specialises instead of
    # raising, and costs one extra compiled variant rather than a failed capture.
    for dim in dims:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


def compile_decode(pool: DecoderStatePool, backend: str = "inductor") -> Callable:
    """``torch.compile(adapter, dynamic=True, fullgraph=True, backend=backend)`` for ``pool``.

    Returns a callable with the signature of ``step.decode_tensors`` less the pool that
    marks the row and packed-frame dimensions dynamic on every call (cheap: it only tags the
    tensors) before calling the compiled module. Compilation happens on the first call;
    a row count or packed length of 1 specialises and compiles once more. ``backend="aot_eager"``
    traces the same full graph (Dynamo, functionalisation of the state mutations) without
    Inductor's code generation, which takes minutes on CPU.
    """
    adapter = adapter_class_for(pool)(pool)
    compiled = torch.compile(adapter, dynamic=True, fullgraph=True, backend=backend)
    names = tuple(DYNAMIC_ARG_DIMS)

    def decode(codes, valid_frames, state_slot_ids, valid_rows, frames):
        for name, tensor in zip(names, (codes, valid_frames, state_slot_ids, valid_rows)):
            _mark_dynamic(tensor, DYNAMIC_ARG_DIMS[name])
        return compiled(codes, valid_frames, state_slot_ids, valid_rows, frames)

    decode.adapter = adapter  # type: ignore[attr-defined]
    return decode
