# SPDX-License-Identifier: Apache-2.0
"""What a decoder state pool is, decided once: the frozen :class:`StateSpec`.

Every variant of a pool (its kind, ring dtype, ring semantics, attention backend and paging) is resolved and
validated here, when the spec is made; the pool class is then looked up in one table
(:data:`~.pools.POOL_CLASSES`) and nothing downstream re-validates an option or compares a kind string.
Defaults follow upstream (docs/ring_semantics.md): the compact pool for v2 codecs, the legacy pool for v1,
the codec version's ring semantics, Triton attention on CUDA when it is installed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..backends import RING_DTYPES, check_attention_backend, default_attention_backend
from ..checks import check_count
from ..config import check_ring_semantics
from ..pool_kinds import POOL_KINDS, pool_kind_record
from .offsets import offset_table_rows

__all__ = ["PagingSpec", "StateSpec", "state_bytes_for"]


@dataclass(frozen=True)
class PagingSpec:
    """How a paged pool sizes its page pool (:class:`~.page_budget.PageBudget` does the arithmetic).

    Made by :meth:`checked`, which validates the options; the fields are then final.

    Attributes:
        page_size: tokens per page; divides every group's ring capacity.
        page_fraction: pages per group as a fraction of full rings for every slot, in ``(0, 1]``; ``None``
            with a budget.
        state_budget_bytes: bytes of ring pages the pool may hold (the null pages included), or ``None``.
        expected_stream_frames: with a budget, split it by each group's fill over a stream of this many
            frames, or ``None`` (one fraction of full rings for every group).
    """

    page_size: int
    page_fraction: float | None = 1.0
    state_budget_bytes: int | None = None
    expected_stream_frames: int | None = None

    @classmethod
    def checked(
        cls, config, page_size=None, page_fraction=None, state_budget_bytes=None, expected_stream_frames=None
    ) -> PagingSpec:
        """The paging for ``config`` (a ``CodecConfig``): ``page_size`` defaults to the greatest common divisor
        of the groups' ring capacities, ``page_fraction`` to ``1.0`` unless a budget is given.

        Raises:
            ValueError: a page size that is not an integer >= 1 or does not divide every ring capacity, both
                a fraction and a budget, a budget that is not an integer >= 1, a fraction outside ``(0, 1]``,
                ``expected_stream_frames`` without a budget or not an integer >= 1.
        """
        capacities = [g.ring_capacity for g in config.groups]
        size = math.gcd(*capacities) if page_size is None else page_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        bad = [c for c in capacities if c % size]
        if bad:
            raise ValueError(f"page_size {size} must divide every group's window; it does not divide {bad}")
        budget = state_budget_bytes
        if page_fraction is not None and budget is not None:
            raise ValueError("give the paged pool page_fraction or state_budget_bytes, not both")
        if budget is not None:
            check_count(budget, "state_budget_bytes", 1)
        fraction = 1.0 if page_fraction is None else page_fraction
        if isinstance(fraction, bool) or not 0.0 < float(fraction) <= 1.0:
            raise ValueError(f"page_fraction must be in (0, 1], got {page_fraction!r}")
        frames = expected_stream_frames
        if frames is not None:
            if budget is None:
                raise ValueError("expected_stream_frames splits a state budget: give state_budget_bytes too")
            check_count(frames, "expected_stream_frames", 1)
        return cls(size, None if budget is not None else float(fraction), budget, frames)


@dataclass(frozen=True)
class StateSpec:
    """A pool's variant, resolved and validated (:meth:`resolve`).

    Attributes:
        kind: ``"compact"``, ``"legacy"`` or ``"paged"`` (``pool_kinds.POOL_KINDS``; its facts:
            ``pool_kinds.POOL_KIND_RECORDS``).
        dtype: ring dtype (floating point; one of ``backends.RING_DTYPES`` for ``"triton"``).
        ring_semantics: ``"upstream"`` or ``"exact"`` (``config.RING_SEMANTICS``).
        attention_backend: ``"sdpa"`` or ``"triton"`` (``backends.ATTENTION_BACKENDS``).
        paging: the page pool of a ``"paged"`` pool; ``None`` for the other kinds.
    """

    kind: str
    dtype: torch.dtype
    ring_semantics: str
    attention_backend: str
    paging: PagingSpec | None = None

    @classmethod
    def resolve(
        cls,
        decoder,
        kind: str,
        dtype: torch.dtype | None = None,
        ring_semantics: str | None = None,
        attention_backend: str | None = None,
        paging: dict | None = None,
    ) -> StateSpec:
        """The spec of a ``kind`` pool for ``decoder`` (a ``CodecDecoder``), defaults filled in.

        Checks, in this order: the codec version (compact and paged pools serve v2 codecs), the ring dtype,
        the ring semantics, the attention backend (the legacy pool runs ``"sdpa"`` only, the paged pool
        ``"triton"`` only, its default), the Triton ring dtypes, then ``paging`` (the keyword arguments of :meth:`PagingSpec.checked`, for a
        ``"paged"`` pool only).

        Raises:
            ValueError: an unknown ``kind``, ``ring_semantics`` or ``attention_backend`` (the message lists
                the choices), a v1 codec for a compact or paged pool, a non-floating ``dtype``, an attention
                backend the kind does not run, a Triton ring dtype outside ``RING_DTYPES``, a page size that
                does not divide every group's ring capacity.
            RuntimeError: ``"triton"`` without the ``triton`` package installed.
        """
        record = _record(kind)
        config = decoder.config
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"ring dtype must be a torch.dtype, got {dtype!r}")
        if record.needs_compact_codec and not config.abilities.compact_pool:
            raise ValueError(
                f"the compact pool serves v2 codecs; this codec is {config.version} and keeps the legacy pool"
            )
        dtype = dtype or decoder.state_dtype
        if not dtype.is_floating_point:
            raise ValueError(f"ring dtype must be a floating-point dtype, got {dtype}")
        ring_semantics = config.abilities.default_ring_semantics if ring_semantics is None else ring_semantics
        check_ring_semantics(ring_semantics)
        backend = attention_backend
        if backend is None:
            backend = record.default_backend or default_attention_backend(decoder.device)
        backend = check_attention_backend(backend)
        if backend == "triton" and dtype not in RING_DTYPES:
            raise ValueError(f"attention backend 'triton' needs a ring dtype in {RING_DTYPES}, got {dtype}")
        if backend not in record.plans:
            raise record.refuse_backend(backend)
        pages = PagingSpec.checked(config, **(paging or {})) if record.paged else None
        return cls(kind, dtype, ring_semantics, backend, pages)

    def check_for(self, decoder) -> None:
        """Refuse this spec for ``decoder`` where :meth:`resolve` would, and a spec it would not give (one built
        by hand, or resolved for another decoder): every pool checks its spec so, once, when it is built.

        Raises:
            ValueError, RuntimeError, TypeError: as :meth:`resolve`; ValueError naming both specs when
                :meth:`resolve` gives another one for these values.
        """
        paging = None if self.paging is None else asdict(self.paging)
        resolved = StateSpec.resolve(
            decoder, self.kind, self.dtype, self.ring_semantics, self.attention_backend, paging
        )
        if resolved != self:
            raise ValueError(f"the state spec {self} does not resolve for this decoder; resolve() gives {resolved}")

    @classmethod
    def from_options(
        cls,
        decoder,
        kind: str | None = None,
        dtype: torch.dtype | None = None,
        ring_semantics: str | None = None,
        attention_backend: str | None = None,
        page_fraction: float | None = None,
        state_budget_bytes: int | None = None,
        expected_stream_frames: int | None = None,
    ) -> StateSpec:
        """The spec of a pool's loose options (a session's, a stage's): ``"compact"`` for v2 codecs and
        ``"legacy"`` for v1 unless ``kind`` says otherwise; a state budget without a kind picks ``"paged"``.

        Raises:
            ValueError: a paging option for another kind, or as :meth:`resolve`.
            RuntimeError: ``"triton"`` without the ``triton`` package installed.
        """
        if kind is None and state_budget_bytes is not None:
            kind = "paged"
        kind = kind or ("compact" if decoder.config.abilities.compact_pool else "legacy")
        paging = {
            "page_fraction": page_fraction,
            "state_budget_bytes": state_budget_bytes,
            "expected_stream_frames": expected_stream_frames,
        }
        record = pool_kind_record(kind)
        for name, value in paging.items():
            if value is not None and not (record is not None and record.paged):
                raise ValueError(f"{name} applies to the paged pool, not to a {kind!r} pool")
        return cls.resolve(decoder, kind, dtype, ring_semantics, attention_backend, paging)


def _record(kind: str):
    """The facts of pool ``kind``; ValueError naming the choices when there is no such kind."""
    record = pool_kind_record(kind)
    if record is None:
        raise ValueError(f"unknown state pool kind {kind!r}; expected one of {POOL_KINDS}")
    return record


def state_bytes_for(decoder_config, num_slots: int, kind: str, element_size: int = 2) -> int:
    """Persistent bytes of a pool with ``num_slots`` slots (rings plus offsets), without allocating.

    ``kind`` is ``"compact"``, ``"legacy"`` or ``"paged"`` (as compact: the figure for ``page_fraction`` 1.0,
    an upper bound; that pool allocates one null page per group instead of a null slot, plus its page tables:
    docs/memory.md, "Paged rings"). The rings of one slot of the v2 codec are 88,678,400 bytes in bf16
    (docs/memory.md).

    Raises:
        ValueError: unknown ``kind``.
    """
    counters = offset_table_rows(decoder_config) if _record(kind).offset_table else 1
    return num_slots * decoder_config.state_bytes_per_slot(element_size) + counters * num_slots * 8
