# SPDX-License-Identifier: Apache-2.0
"""Old import path of the decoder state pools, kept for one release: the pools live in :mod:`.state`."""

from .state import (  # noqa: F401
    POOL_KINDS,
    CompactDecoderStatePool,
    DecoderStatePool,
    LegacyDecoderStatePool,
    PagedDecoderStatePool,
    PagesExhausted,
    SlotState,
    make_state_pool,
    ring_geometry,
    state_bytes_for,
)

__all__ = [
    "POOL_KINDS",
    "CompactDecoderStatePool",
    "DecoderStatePool",
    "LegacyDecoderStatePool",
    "PagedDecoderStatePool",
    "PagesExhausted",
    "SlotState",
    "make_state_pool",
    "ring_geometry",
    "state_bytes_for",
]
