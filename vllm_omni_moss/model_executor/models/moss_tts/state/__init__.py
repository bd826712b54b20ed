# SPDX-License-Identifier: Apache-2.0
"""Decoder state of many live streams: one pool, composed of slots, rings, offsets and page arithmetic.

* :mod:`.spec` - :class:`StateSpec`: a pool's variant (kind, ring dtype, ring semantics, attention backend,
  paging), resolved and validated once.
* :mod:`.pools` - the three kinds (``legacy``, ``compact``, ``paged``) and the table that picks them.
* :mod:`.pool` - what every pool does: slot lifecycle, reservation, save and restore (the
  step that runs the decoder over a pool is ``..step``).
* :mod:`.slots`, :mod:`.rings`, :mod:`.paged_rings`, :mod:`.offsets`, :mod:`.page_budget`,
  :mod:`.snapshot` - the parts a pool is made of.
"""

from ..pool_kinds import POOL_KINDS
from .page_budget import PageBudget
from .paged_rings import PagesExhausted
from .pool import DecoderStatePool
from .pools import (
    POOL_CLASSES,
    CompactDecoderStatePool,
    LegacyDecoderStatePool,
    PagedDecoderStatePool,
    build_pool,
)
from .snapshot import SlotState, ring_geometry
from .spec import PagingSpec, StateSpec, state_bytes_for

__all__ = [
    "POOL_CLASSES",
    "POOL_KINDS",
    "CompactDecoderStatePool",
    "DecoderStatePool",
    "LegacyDecoderStatePool",
    "PageBudget",
    "PagedDecoderStatePool",
    "PagesExhausted",
    "PagingSpec",
    "SlotState",
    "StateSpec",
    "build_pool",
    "ring_geometry",
    "state_bytes_for",
]
