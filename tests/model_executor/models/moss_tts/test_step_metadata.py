# SPDX-License-Identifier: Apache-2.0
"""step_metadata: hand-computed cells, sources and masks of build_ring_metadata for both ring semantics, and RoPE
positions that a stream's age does not change."""

from __future__ import annotations

import pytest
import torch
from moss_codecs import make_state_pool, random_codes

from vllm_omni_moss.model_executor.models.moss_tts.config import GroupSpec
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_batch
from vllm_omni_moss.model_executor.models.moss_tts.step_metadata import (
    build_ring_metadata,
    default_ring_semantics,
    rope_tables,
)

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]

C = 5


def _spec(context: int = C) -> GroupSpec:
    return GroupSpec(
        index=0,
        input_dim=8,
        output_dim=8,
        d_model=8,
        num_heads=2,
        num_layers=1,
        dim_feedforward=8,
        ring_capacity=context,
        tokens_per_frame=1,
        upsample=1,
        layer_scale=None,
        max_period=10_000.0,
        input_proj=False,
        output_proj=False,
    )


def _meta(semantics, offsets, written, T):
    return build_ring_metadata(_spec(), semantics, torch.tensor(offsets), torch.tensor(written), T)


def test_rows_write_their_last_valid_tokens_once_per_cell():
    # Row 0: offset 3, 4 valid tokens of 4: positions 3..6 -> cells 3, 4, 0, 1.
    # Row 1: offset 0, 3 valid tokens of 4: the padding entry repeats the last valid token.
    # Row 2: a padding row: nothing valid (its entries name token 0; its rows are not kept).
    meta = _meta("upstream", [3, 0, 9], [4, 3, 0], 4)
    assert meta.next_offsets.tolist() == [7, 3, 9]
    assert meta.write_source.tolist() == [[0, 1, 2, 3], [0, 1, 2, 2], [0, 0, 0, 0]]
    assert meta.write_cell.tolist() == [[3, 4, 0, 1], [0, 1, 2, 2], [4, 4, 4, 4]]
    # 7 valid tokens of 8 into 5 cells: the last 5 valid tokens (2..6) own the cells.
    wide = _meta("upstream", [0], [7], 8)
    assert wide.write_source.tolist() == [[2, 3, 4, 5, 6]]
    assert wide.write_cell.tolist() == [[2, 3, 4, 0, 1]]


def test_upstream_semantics_attend_over_the_post_write_ring():
    # Offset 3, 2 of 3 tokens valid: positions 3, 4 written; position 5 is padding.
    meta = _meta("upstream", [3], [2], 3)
    assert meta.mask.shape == (1, 1, 3, C)
    # Ring after the write holds positions 0..4 at cells 0..4.
    assert meta.mask[0, 0].tolist() == [
        [True, True, True, True, False],  # query 3 sees positions 0..3
        [True, True, True, True, True],  # query 4 sees 0..4
        [False, True, True, True, True],  # padding query 5 sees valid keys 1..4 (its output is discarded)
    ]


def test_exact_semantics_attend_over_ring_and_valid_chunk_tokens():
    meta = _meta("exact", [6], [2], 3)
    assert meta.mask.shape == (1, 1, 3, C + 3)
    # Cached cells hold positions 5, 1, 2, 3, 4 (cells 0..4); chunk tokens are positions 6, 7 and padding.
    assert meta.mask[0, 0].tolist() == [
        [True, False, True, True, True, True, False, False],  # query 6: positions 2..6
        [True, False, False, True, True, True, True, False],  # query 7: positions 3..7
        [True, False, False, False, True, True, True, False],  # padding query 8: never sees padding
    ]
    # Padding rows see no chunk token at all.
    pad = _meta("exact", [6], [0], 3)
    assert not pad.mask[0, 0, :, C:].any()


def test_fresh_rows_mask_unwritten_cells():
    meta = _meta("upstream", [0], [2], 2)
    assert meta.mask[0, 0].tolist() == [[True, False, False, False, False], [True, True, False, False, False]]
    exact = _meta("exact", [0], [2], 2)
    assert not exact.mask[0, 0, :, :C].any()


def test_rope_tables_follow_absolute_positions():
    cos, sin = rope_tables(torch.tensor([0, 7]), 3, 4, 10_000.0)
    assert cos.shape == (2, 1, 3, 2)
    angle = torch.tensor([8.0, 8.0 * 10_000.0 ** (-0.5)])  # row 1, token 1: position 8
    torch.testing.assert_close(cos[1, 0, 1], torch.cos(angle))
    torch.testing.assert_close(sin[1, 0, 1], torch.sin(angle))


def test_bad_semantics_and_versions():
    with pytest.raises(ValueError, match=r"unknown ring semantics 'v2'; expected one of \('upstream', 'exact'\)"):
        _meta("v2", [0], [1], 1)
    assert default_ring_semantics("v2") == "upstream" and default_ring_semantics("v1") == "exact"
    with pytest.raises(ValueError, match="unknown codec version 'v3'"):
        default_ring_semantics("v3")


@pytest.mark.parametrize("start_frames", [10**3, 10**6, 5 * 10**8])
def test_a_stream_decodes_the_same_whatever_its_age(start_frames, ring_decoder):
    """RoPE attention depends on position differences only: a stream whose position counters start at
    ``start_frames`` (up to 1e9 tokens in the second group) decodes as one that starts at 0, once the
    window of every layer holds only its own tokens (30 frames for this codec: 3 layers of 5 frames per
    group, two groups), within 1e-5 in float32; its rings have wrapped many times by then."""
    codes = random_codes(ring_decoder, 1, 60, seed=9)
    audio = []
    for start in (0, start_frames):
        pool = make_state_pool(ring_decoder)
        pool.initialize(1)
        pool.frames_decoded[0] = start
        parts = []
        for a in range(0, 60, 15):
            chunk = codes[:, :, a : a + 15]
            out, _ = decode_batch(pool, chunk, torch.tensor([15]), torch.tensor([0]), torch.tensor([True]))
            parts.append(out)
        audio.append(torch.cat(parts, dim=-1))
    spf = ring_decoder.config.samples_per_frame
    young, old = audio[0][..., 40 * spf :], audio[1][..., 40 * spf :]
    assert (old - young).abs().max().item() <= 1e-5 * young.abs().max().item()
