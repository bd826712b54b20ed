# SPDX-License-Identifier: Apache-2.0
"""Page arithmetic of paged rings (state/page_budget.py): pages a context needs, pages a budget buys."""

from __future__ import annotations

import pytest
import torch
from moss_codecs import PAGED_TEST_CAPACITY as CAPACITY
from moss_codecs import make_state_pool

from vllm_omni_moss.model_executor.models.moss_tts.state import PageBudget, PagingSpec


def test_a_state_budget_buys_whole_pages_and_refuses_less_than_one_stream(ring_decoder):
    """Ring codec, fp32, 3 layers of 2 heads x 64 per group (moss_codecs.ring_codec_raw): a page of 5
    tokens is 2 x 5 x 128 x 4 bytes x 3 layers = 15,360 bytes in either group; one stream's full rings
    are 1 + 2 pages, plus one null page per group."""
    page = 2 * 5 * 128 * 4 * 3
    assert [(g.num_heads * g.head_dim, g.num_layers) for g in ring_decoder.config.groups] == [(128, 3), (128, 3)]
    pool = make_state_pool(ring_decoder, "paged", state_budget_bytes=2 * page + 5 * page)
    pool.initialize(CAPACITY)
    assert pool.page_fraction == pytest.approx(5 / 9)  # (budget - null pages) / (3 slots x 3 pages)
    assert pool.free_page_counts() == [1, 3]  # floor(5/9 x 3 x 1), floor(5/9 x 3 x 2)
    assert sum(r.numel() * r.element_size() for r in pool.rings) == (2 + 4) * page
    with pytest.raises(
        ValueError,
        match=r"a state budget of 76799 bytes holds no stream: one stream's full rings plus the null pages need "
        r"76800 bytes \(0.07 MiB\)",
    ):
        make_state_pool(ring_decoder, "paged", state_budget_bytes=5 * page - 1).initialize(CAPACITY)


def test_a_budget_split_by_fill_gives_fast_groups_more_pages(ring_decoder):
    """Ring codec: 5-token pages of 15,360 bytes in both groups; rings of 1 and 2 pages (tokens per
    frame 1 and 2). Over a 4-frame stream a live stream holds on average 1 page of group 0 and
    (1 + 1 + 2 + 2) / 4 = 1.5 of group 1. A budget of 20 pages pays the null pages (2) and one full
    stream (3), and the other 15 pages buy 15 / 2.5 = 6 average streams: 1 + 6 and 2 + 9 pages."""
    page = 2 * 5 * 128 * 4 * 3
    pool = make_state_pool(ring_decoder, "paged", state_budget_bytes=20 * page, expected_stream_frames=4)
    assert pool.average_pages(4) == [1.0, 1.5]
    pool.initialize(8)
    assert pool.free_page_counts() == [7, 11]
    assert sum(r.numel() * r.element_size() for r in pool.rings) == 20 * page
    assert pool.page_fraction == pytest.approx(18 / (8 * 3))
    small = make_state_pool(ring_decoder, "paged", state_budget_bytes=20 * page, expected_stream_frames=4)
    small.initialize(3)
    assert small.free_page_counts() == [3, 6]  # never more than full rings for every slot
    with pytest.raises(ValueError, match="expected_stream_frames splits a state budget: give state_budget_bytes too"):
        make_state_pool(ring_decoder, "paged", expected_stream_frames=4)
    with pytest.raises(ValueError, match="expected_stream_frames must be an integer >= 1, got 0"):
        make_state_pool(ring_decoder, "paged", state_budget_bytes=20 * page, expected_stream_frames=0)


# ----------------------------------------------------------------------------------- the arithmetic on its own


def _budget(decoder):
    """Ring codec, fp32, pages of 5 tokens: rings of 1 and 2 pages (1 and 2 tokens per frame), 15,360-byte pages."""
    return PageBudget(decoder.config, torch.float32, 5)


@pytest.mark.cpu
@pytest.mark.core_model
def test_pages_and_bytes_of_one_stream(ring_decoder):
    budget = _budget(ring_decoder)
    first, second = ring_decoder.config.groups
    assert [budget.pages_per_ring(first), budget.pages_per_ring(second)] == [1, 2]
    assert budget.page_bytes(first) == budget.page_bytes(second) == 2 * 2 * 5 * 64 * 4 * 3 == 15_360
    assert budget.stream_bytes() == 3 * 15_360 and budget.null_bytes() == 2 * 15_360
    assert [budget.pages_needed(first, f) for f in (0, 1, 5, 6, 100)] == [0, 1, 1, 1, 1]
    assert [budget.pages_needed(second, f) for f in (0, 1, 2, 3, 5, 6, 100)] == [0, 1, 1, 2, 2, 2, 2]
    assert budget.average_pages(4) == [1.0, 1.5] and budget.average_pages(1) == [1.0, 1.0]


@pytest.mark.cpu
@pytest.mark.core_model
def test_pages_for_a_fraction_round_down_when_a_budget_pays_and_up_otherwise(ring_decoder):
    budget = _budget(ring_decoder)
    # Half of full rings for 3 slots: 1.5 and 3 pages, plus the null page.
    assert budget.pages_at(0.5, 3, budgeted=True) == [2, 4]
    assert budget.pages_at(0.5, 3, budgeted=False) == [3, 4]
    assert budget.fraction_for_budget(2 * 15_360 + 9 * 15_360, 3) == 1.0  # never more than full rings
    assert budget.fraction_for_budget(2 * 15_360 + 3 * 15_360, 3) == pytest.approx(1 / 3)
    assert budget.pages_for(PagingSpec(5, 0.2, None, None), 3) == ([2, 3], 0.2)
    with pytest.raises(
        ValueError,
        match=r"^page_fraction 0.1 gives group 1 1 pages; one stream needs 2 \(page_fraction >= 0.3333 for 3 slots\)$",
    ):
        budget.pages_for(PagingSpec(5, 0.1, None, None), 3)
