# SPDX-License-Identifier: Apache-2.0
"""The state spec (state/spec.py): a pool's variant resolved and validated once, its paging, and its bytes."""

from __future__ import annotations

import pytest
import torch
from moss_codecs import make_state_pool

from vllm_omni_moss.model_executor.models.moss_tts import backends
from vllm_omni_moss.model_executor.models.moss_tts.state import (
    LegacyDecoderStatePool,
    PagingSpec,
    StateSpec,
    state_bytes_for,
)

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


def test_loose_options_resolve_to_the_codec_and_device_defaults(ring_decoder, ring_decoder_v1):
    """Ring codec (rings of 5 and 10 tokens), fp32 on CPU: v2 -> compact, upstream semantics, sdpa; v1 -> legacy,
    exact semantics; a budget alone picks the paged pool, whose page size is the rings' gcd and whose default
    backend is its own (triton), not the device's."""
    assert StateSpec.from_options(ring_decoder) == StateSpec("compact", torch.float32, "upstream", "sdpa", None)
    assert StateSpec.from_options(ring_decoder_v1) == StateSpec("legacy", torch.float32, "exact", "sdpa", None)
    paged = StateSpec.from_options(ring_decoder, state_budget_bytes=10**6)
    assert paged == StateSpec("paged", torch.float32, "upstream", "triton", PagingSpec(5, None, 10**6, None))
    assert StateSpec.from_options(ring_decoder, "paged").paging == PagingSpec(5, 1.0, None, None)


def test_paging_is_checked_once_and_normalised():
    config = type("Config", (), {"groups": [type("G", (), {"ring_capacity": c})() for c in (125, 250, 400)]})()
    assert PagingSpec.checked(config) == PagingSpec(25, 1.0, None, None)
    assert PagingSpec.checked(config, page_size=5, page_fraction=1) == PagingSpec(5, 1.0, None, None)
    assert PagingSpec.checked(config, state_budget_bytes=7, expected_stream_frames=3) == PagingSpec(25, None, 7, 3)
    with pytest.raises(
        ValueError, match=r"^page_size 50 must divide every group's window; it does not divide \[125\]$"
    ):
        PagingSpec.checked(config, page_size=50)
    with pytest.raises(ValueError, match=r"^page_size must be an integer >= 1, got True$"):
        PagingSpec.checked(config, page_size=True)
    with pytest.raises(ValueError, match=r"^page_fraction must be in \(0, 1\], got 1.5$"):
        PagingSpec.checked(config, page_fraction=1.5)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(attention_backend="sdpa"), "the paged pool needs attention_backend 'triton'"),
        (dict(page_size=4), r"page_size 4 must divide every group's window; it does not divide \[5, 10\]"),
        (dict(page_size=0), "page_size must be an integer >= 1, got 0"),
        (dict(page_fraction=0.0), r"page_fraction must be in \(0, 1\], got 0.0"),
        (dict(page_fraction=0.5, state_budget_bytes=10**6), "page_fraction or state_budget_bytes, not both"),
        (dict(state_budget_bytes=0), "state_budget_bytes must be an integer >= 1, got 0"),
        (dict(state_budget_bytes=1.5e6), "state_budget_bytes must be an integer >= 1, got 1500000.0"),
    ],
)
def test_bad_paged_pools_are_refused(kwargs, message, ring_decoder):
    backend = kwargs.pop("attention_backend", None)
    with pytest.raises(ValueError, match=message):
        StateSpec.resolve(ring_decoder, "paged", attention_backend=backend, paging=kwargs)


def test_backend_and_semantics_must_be_named_and_triton_needs_a_kernel_dtype(ring_decoder):
    with pytest.raises(ValueError, match=r"attention backend 'triton' needs a ring dtype in \(torch.float32, "):
        make_state_pool(ring_decoder, dtype=torch.float64, attention_backend="triton")
    with pytest.raises(ValueError, match="unknown attention backend ''"):
        make_state_pool(ring_decoder, attention_backend="")
    with pytest.raises(ValueError, match="unknown ring semantics ''"):
        make_state_pool(ring_decoder, ring_semantics="")


def test_kinds_options_and_codecs_are_refused_with_their_messages(ring_decoder, ring_decoder_v1, monkeypatch):
    with pytest.raises(ValueError, match=r"^unknown state pool kind 'ring'; expected one of \('compact', 'legacy', "):
        StateSpec.from_options(ring_decoder, "ring")
    with pytest.raises(ValueError, match="^page_fraction applies to the paged pool, not to a 'compact' pool$"):
        StateSpec.from_options(ring_decoder, "compact", page_fraction=0.5)
    with pytest.raises(ValueError, match="^the compact pool serves v2 codecs; this codec is v1 and keeps the legacy"):
        StateSpec.from_options(ring_decoder_v1, "paged")
    with pytest.raises(ValueError, match="^ring dtype must be a floating-point dtype, got torch.int32$"):
        StateSpec.from_options(ring_decoder, dtype=torch.int32)
    monkeypatch.setattr(backends, "HAS_TRITON", False)
    with pytest.raises(RuntimeError, match="^attention backend 'triton' needs the `triton` package"):
        StateSpec.from_options(ring_decoder, "paged")


def test_state_bytes_count_rings_and_offsets_without_allocating(ring_decoder):
    """Ring codec: a slot's rings are 3 layers x (2 x 2 heads x 5 cells x 64) + 3 x (2 x 2 x 10 x 64) elements,
    46,080 bytes in fp32; the compact and paged pools add one int64 frame counter per slot, the legacy pool
    upstream's table of 2 rows per layer and 1 per group (14 int64 per slot)."""
    config = ring_decoder.config
    rings = 3 * (2 * 2 * 5 * 64) * 4 + 3 * (2 * 2 * 10 * 64) * 4
    assert rings == 46_080
    assert state_bytes_for(config, 3, "compact", 4) == 3 * rings + 3 * 8
    assert state_bytes_for(config, 3, "paged", 4) == 3 * rings + 3 * 8
    assert state_bytes_for(config, 3, "legacy", 4) == 3 * rings + 14 * 3 * 8
    pool = make_state_pool(ring_decoder, "compact")
    pool.initialize(2)  # 2 live slots + the null slot
    assert pool.state_bytes() == state_bytes_for(config, 3, "compact", 4)
    with pytest.raises(ValueError, match=r"^unknown state pool kind 'dense'"):
        state_bytes_for(config, 1, "dense")


def test_v1_codec_keeps_the_legacy_pool(ring_decoder_v1):
    assert isinstance(make_state_pool(ring_decoder_v1), LegacyDecoderStatePool)
    with pytest.raises(ValueError, match="compact pool serves v2 codecs; this codec is v1"):
        make_state_pool(ring_decoder_v1, "compact")
    with pytest.raises(ValueError, match="unknown state pool kind 'shared'"):
        make_state_pool(ring_decoder_v1, "shared")


def test_a_pool_checks_its_spec_against_the_decoder(ring_decoder, ring_decoder_v1):
    """A spec made by hand, or resolved for another decoder, is refused when a pool is built from it, with
    ``resolve``'s own errors; ``build_pool`` takes nothing but a ``StateSpec``."""
    from vllm_omni_moss.model_executor.models.moss_tts.state import CompactDecoderStatePool, build_pool

    good = StateSpec.from_options(ring_decoder)
    assert build_pool(ring_decoder, good).spec == good
    with pytest.raises(ValueError, match=r"^unknown attention backend 'flash'"):
        build_pool(ring_decoder, StateSpec("compact", torch.float32, "exact", "flash"))
    with pytest.raises(ValueError, match=r"^the compact pool serves v2 codecs; this codec is v1"):
        build_pool(ring_decoder_v1, good)
    with pytest.raises(ValueError, match=r"^unknown ring semantics 'bogus'"):
        build_pool(ring_decoder, StateSpec("compact", torch.float32, "bogus", "sdpa"))
    with pytest.raises(TypeError, match=r"^ring dtype must be a torch.dtype, got 'float32'$"):
        build_pool(ring_decoder, StateSpec("compact", "float32", "exact", "sdpa"))
    with pytest.raises(
        ValueError, match=r"does not resolve for this decoder; resolve\(\) gives StateSpec\(kind='paged'"
    ):
        build_pool(ring_decoder, StateSpec("paged", torch.float32, "upstream", "triton", None))
    with pytest.raises(TypeError, match=r"^build_pool needs a StateSpec, got str$"):
        build_pool(ring_decoder, "compact")
    with pytest.raises(ValueError, match=r"^unknown state pool kind 'compactt'; expected one of \('compact', "):
        build_pool(ring_decoder, StateSpec("compactt", torch.float32, "exact", "sdpa"))
    with pytest.raises(TypeError, match=r"^CompactDecoderStatePool needs a StateSpec, got dict$"):
        CompactDecoderStatePool(ring_decoder, {"kind": "compact"})
