# SPDX-License-Identifier: Apache-2.0
"""``torch.compile`` boundary of a streaming step.

A step is ``pool.decode_streaming_tensors(codes, codes_lengths, state_slot_ids,
valid_rows)``: tensor-only, no host syncs, no Python branching on tensor values, so it
compiles with ``fullgraph=True`` and dynamic batch and frame dimensions.

The adapters are ``nn.Module`` s because vLLM's ``support_torch_compile`` decorates
module classes, and its compile cache keys artifacts on the decorated class. The
legacy and V2 pools mutate state differently (whole-ring ``index_copy_`` versus the
masked ``commit_cache`` / ``commit_offsets`` ops), so each pool kind has its own
adapter class: an artifact compiled for one can never be reused for the other. The
stage subclasses these classes under vLLM's decorator; this module never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .state_pool import DecoderStatePool

__all__ = [
    "DYNAMIC_ARG_DIMS",
    "LegacyDecodeCompileAdapter",
    "V2DecodeCompileAdapter",
    "adapter_class_for",
    "compile_decode",
]

#: Dynamic dimensions of the adapter's forward arguments (``support_torch_compile`` format).
DYNAMIC_ARG_DIMS: dict[str, dict[int, str]] = {
    "codes": {1: "batch", 2: "frames"},
    "codes_lengths": {0: "batch"},
    "state_slot_ids": {0: "batch"},
    "valid_rows": {0: "batch"},
}


class _DecodeCompileAdapter(nn.Module):
    """Module view of one pool's streaming step.

    The decoder is registered as a submodule so the weights are visible to compile
    machinery that walks parameters; the pool is a plain attribute (it owns state
    tensors, not parameters).
    """

    pool_kind = ""

    def __init__(self, pool: DecoderStatePool):
        super().__init__()
        if pool.kind != self.pool_kind:
            raise ValueError(f"{type(self).__name__} adapts {self.pool_kind!r} pools, got a {pool.kind!r} pool")
        self.decoder = pool.decoder
        self.pool = pool

    def _step(self, codes, codes_lengths, state_slot_ids, valid_rows):
        return self.pool.decode_streaming_tensors(codes, codes_lengths, state_slot_ids, valid_rows)


# Each concrete class defines its own ``forward``: vLLM's AOT cache hashes
# ``forward.__qualname__`` and its first line, so an inherited forward would give the
# two pool kinds one cache identity.


class LegacyDecodeCompileAdapter(_DecodeCompileAdapter):
    """Adapter for :class:`~.state_pool.LegacyDecoderStatePool` (scratch slots, whole-ring write-back)."""

    pool_kind = "legacy"

    def forward(
        self,
        codes: torch.Tensor,
        codes_lengths: torch.Tensor,
        state_slot_ids: torch.Tensor,
        valid_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``codes (n_vq, B, T)`` int64, ``codes_lengths (B,)`` int64, ``state_slot_ids (B,)`` int64,
        ``valid_rows (B,)`` bool -> ``audio (B, channels, T * spf)`` float32, ``audio_lengths (B,)`` int64."""
        return self._step(codes, codes_lengths, state_slot_ids, valid_rows)


class V2DecodeCompileAdapter(_DecodeCompileAdapter):
    """Adapter for :class:`~.state_pool.V2DecoderStatePool` (null slot, masked commits)."""

    pool_kind = "v2"

    def forward(
        self,
        codes: torch.Tensor,
        codes_lengths: torch.Tensor,
        state_slot_ids: torch.Tensor,
        valid_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``codes (n_vq, B, T)`` int64, ``codes_lengths (B,)`` int64, ``state_slot_ids (B,)`` int64,
        ``valid_rows (B,)`` bool -> ``audio (B, channels, T * spf)`` float32, ``audio_lengths (B,)`` int64."""
        return self._step(codes, codes_lengths, state_slot_ids, valid_rows)


def adapter_class_for(pool: DecoderStatePool) -> type[_DecodeCompileAdapter]:
    """The adapter class for ``pool.kind``.

    Raises:
        ValueError: unknown pool kind.
    """
    for cls in (LegacyDecodeCompileAdapter, V2DecodeCompileAdapter):
        if cls.pool_kind == pool.kind:
            return cls
    raise ValueError(f"no compile adapter for pool kind {pool.kind!r}")


def _mark_dynamic(tensor: torch.Tensor, dims: dict[int, str]) -> None:
    # maybe_mark_dynamic, not mark_dynamic: a bucket of size 1 specialises instead of
    # raising, and costs one extra compiled variant rather than a failed capture.
    for dim in dims:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


def compile_decode(pool: DecoderStatePool, backend: str = "inductor") -> Callable:
    """``torch.compile(adapter, dynamic=True, fullgraph=True, backend=backend)`` for ``pool``.

    Returns a callable with the signature of ``pool.decode_streaming_tensors`` that
    marks the batch and frame dimensions dynamic on every call (cheap: it only tags the
    tensors) before calling the compiled module. Compilation happens on the first call;
    a batch or frame size of 1 specialises and compiles once more. ``backend="aot_eager"``
    traces the same full graph (Dynamo, functionalisation of the state mutations) without
    Inductor's code generation, which takes minutes on CPU.
    """
    adapter = adapter_class_for(pool)(pool)
    compiled = torch.compile(adapter, dynamic=True, fullgraph=True, backend=backend)
    names = tuple(DYNAMIC_ARG_DIMS)

    def decode(codes, codes_lengths, state_slot_ids, valid_rows):
        for name, tensor in zip(names, (codes, codes_lengths, state_slot_ids, valid_rows)):
            _mark_dynamic(tensor, DYNAMIC_ARG_DIMS[name])
        return compiled(codes, codes_lengths, state_slot_ids, valid_rows)

    decode.adapter = adapter  # type: ignore[attr-defined]
    return decode
