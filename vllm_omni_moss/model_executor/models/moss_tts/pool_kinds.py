# SPDX-License-Identifier: Apache-2.0
"""The facts of each decoder state pool kind, in one record per kind: :data:`POOL_KIND_RECORDS`.

A pool kind decides which codecs it serves, which attention backends it runs and through which step plan,
the backend it picks when none is asked for, whether it pages its rings, which extra slots it allocates besides
one per stream, how many frame counters a slot has, and which ``torch.compile`` adapter its steps compile under.
Every module that needs one of these facts reads it here: the state spec (``state/spec.py``) validates options
and counts bytes with it, the plan builders (``attention.py``) and the compile adapters (``compile.py``) are
looked up by the names it gives, and deploy sizing (``deploy_sizing.py``) counts slots with it. Plain data: no
torch, no vLLM (deploy sizing imports it before anything else is loaded).
The kinds themselves are described in docs/glossary.md ("Pool kind") and docs/memory.md ("Slots per pool").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["POOL_KINDS", "POOL_KIND_RECORDS", "PoolKind", "pool_kind_record"]


@dataclass(frozen=True)
class PoolKind:
    """One pool kind's facts.

    Attributes:
        name: the kind as options and deploy files spell it (``codec_pool_kind``).
        needs_compact_codec: whether the kind serves only codecs whose ``CodecAbilities.compact_pool`` is set
            (v2); the legacy pool keeps upstream's per-layer layout and serves every codec.
        plans: attention backend -> the name of its step-plan builder in ``attention.PLAN_BUILDERS``; the
            backends the kind runs are exactly these keys.
        default_backend: the backend used when none is asked for; ``None``: the device's default
            (``backends.default_attention_backend``).
        backend_refusal: the error for any other backend, a ``str.format`` template over ``backend``.
        paged: whether the rings live in pages (the spec then carries a ``PagingSpec``).
        scratch_per_padding_row: whether padding rows of a graph step each take a scratch slot of their own
            (legacy), rather than all reading one null slot or null page (counted as one extra slot).
        offset_table: whether a slot keeps upstream's offset table (one int64 per row of
            ``state.offsets.offset_table_rows``) rather than one int64 frame counter.
        compile_adapter: the name of the ``torch.compile`` adapter class of the kind's pools in
            ``compile.COMPILE_ADAPTERS``, or ``None`` when the kind has none (its steps run eagerly or in CUDA
            graphs, never compiled).
    """

    name: str
    needs_compact_codec: bool
    plans: Mapping[str, str]
    default_backend: str | None
    backend_refusal: str
    paged: bool = False
    scratch_per_padding_row: bool = False
    offset_table: bool = False
    compile_adapter: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "plans", MappingProxyType(dict(self.plans)))

    @property
    def backends(self) -> tuple[str, ...]:
        """The attention backends this kind runs, in :attr:`plans` order."""
        return tuple(self.plans)

    def refuse_backend(self, backend: str) -> ValueError:
        """The error for a ``backend`` this kind does not run (the caller raises it)."""
        return ValueError(self.backend_refusal.format(backend=backend))

    def extra_slots(self, graph_rows: int) -> int:
        """Slots the pool allocates besides one per stream: one scratch slot per padding row of the graph of most
        rows (``graph_rows``, 0 without graphs) for the legacy pool, else one (the null slot, or a paged pool's null
        pages)."""
        return graph_rows if self.scratch_per_padding_row else 1


#: Every pool kind, by name, in the order options list them.
POOL_KIND_RECORDS: Mapping[str, PoolKind] = MappingProxyType(
    {
        "compact": PoolKind(
            name="compact",
            needs_compact_codec=True,
            plans={"sdpa": "compact_sdpa", "triton": "compact_triton"},
            default_backend=None,
            backend_refusal="no 'compact' pool runs attention backend {backend!r}",
            compile_adapter="CompactDecodeCompileAdapter",
        ),
        "legacy": PoolKind(
            name="legacy",
            needs_compact_codec=False,
            plans={"sdpa": "legacy"},
            default_backend="sdpa",
            backend_refusal=(
                "the legacy pool runs upstream's per-layer SDPA path only; attention backend {backend!r} needs the "
                "compact pool (v2 codecs)"
            ),
            scratch_per_padding_row=True,
            offset_table=True,
            compile_adapter="LegacyDecodeCompileAdapter",
        ),
        "paged": PoolKind(
            name="paged",
            needs_compact_codec=True,
            plans={"triton": "paged_triton"},
            default_backend="triton",
            backend_refusal="the paged pool needs attention_backend 'triton' (its ops read pages), got {backend!r}",
            paged=True,
        ),
    }
)

#: The pool kind names, in the order options list them.
POOL_KINDS: tuple[str, ...] = tuple(POOL_KIND_RECORDS)


def pool_kind_record(name: object) -> PoolKind | None:
    """The record of pool kind ``name``, or None when ``name`` is no pool kind (any value: a caller's option);
    each caller raises its own error, naming :data:`POOL_KINDS`."""
    return POOL_KIND_RECORDS.get(name) if isinstance(name, str) else None
