# SPDX-License-Identifier: Apache-2.0
"""``deploy_sizing``: whether a Stage 1 replica's decoder state fits its memory share.

* The share is ``ceil(device bytes x gpu_memory_utilization)``, as vLLM-Omni requests it; bad values are refused.
* ``pool_slots`` gives the slots each pool kind really allocates (compared with the pools themselves).
* ``check_state_fits`` / ``check_stage_state`` pass at the last slot that fits and fail one slot later, with
  messages naming the slots, the bytes per slot and the share (exact text); a state budget is checked as bytes.
"""

from __future__ import annotations

import pytest
import torch
from moss_codecs import make_state_pool

from vllm_omni_moss.model_executor.models.moss_tts import deploy_sizing
from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
from vllm_omni_moss.model_executor.models.moss_tts.decoder import CodecDecoder
from vllm_omni_moss.model_executor.models.moss_tts.deploy_sizing import (
    STEP_RESERVE_BYTES,
    MemoryShare,
    check_stage_state,
    check_state_fits,
    pool_slots,
    slots_that_fit,
)
from vllm_omni_moss.model_executor.models.moss_tts.state import POOL_KINDS

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]

GIB = 2**30
SLOT = 88_678_400  # one v2 slot in bf16 (docs/memory.md)
WEIGHTS = 2_172_687_872  # the v2 decoder in bf16 (benchmarks/results/h200_memory.json, weights.ours.param_bytes)
H200 = round(139.8 * GIB)  # 150,109,106,995 bytes


def test_share_is_the_rounded_up_fraction_of_the_device():
    share = MemoryShare(0.9, H200)
    assert share.bytes == 135_098_196_296  # ceil(150,109,106,995 x 0.9)
    assert str(share) == "gpu_memory_utilization 0.9 of 139.80 GiB = 125.82 GiB"
    assert MemoryShare(1, 7).bytes == 7 and MemoryShare(0.5, 7).bytes == 4


@pytest.mark.parametrize(
    ("utilization", "device", "message"),
    [
        (0, H200, "gpu_memory_utilization must be a number in (0, 1], got 0"),
        (1.5, H200, "gpu_memory_utilization must be a number in (0, 1], got 1.5"),
        ("0.9", H200, "gpu_memory_utilization must be a number in (0, 1], got '0.9'"),
        (True, H200, "gpu_memory_utilization must be a number in (0, 1], got True"),
        (float("nan"), H200, "gpu_memory_utilization must be a number in (0, 1], got nan"),
        (0.9, 0, "device_bytes must be an integer >= 1, got 0"),
        (0.9, 139.8, "device_bytes must be an integer >= 1, got 139.8"),
    ],
)
def test_bad_share_is_refused(utilization, device, message):
    with pytest.raises(ValueError) as err:
        MemoryShare(utilization, device)
    assert str(err.value) == message


def test_pool_kind_records_name_the_pools_their_plans_and_their_slots(tmp_path):
    """One record per pool kind: its name is the pool class's kind, its plans are attention's builders (each
    named once), and deploy sizing counts each kind's extra slots from its record."""
    from vllm_omni_moss.model_executor.models.moss_tts.attention import PLAN_BUILDERS
    from vllm_omni_moss.model_executor.models.moss_tts.pool_kinds import POOL_KIND_RECORDS
    from vllm_omni_moss.model_executor.models.moss_tts.state import POOL_CLASSES

    assert tuple(POOL_KIND_RECORDS) == POOL_KINDS == tuple(POOL_CLASSES) == ("compact", "legacy", "paged")
    assert all(POOL_CLASSES[k].kind == r.name == k for k, r in POOL_KIND_RECORDS.items())
    named = [plan for r in POOL_KIND_RECORDS.values() for plan in r.plans.values()]
    assert sorted(named) == sorted(PLAN_BUILDERS) and len(set(named)) == len(named)
    assert {k: r.backends for k, r in POOL_KIND_RECORDS.items()} == {
        "compact": ("sdpa", "triton"), "legacy": ("sdpa",), "paged": ("triton",),
    }  # fmt: skip
    assert [deploy_sizing.pool_slots(k, 8, 4) for k in POOL_KINDS] == [9, 12, 9]
    with pytest.raises(TypeError):
        POOL_KIND_RECORDS["compact"].plans["sdpa"] = "legacy"  # the records are frozen


@pytest.mark.parametrize(
    ("preset", "kind", "bucket"),
    [
        ("tiny-v2", "compact", 8),
        ("tiny-v2", "compact", 0),
        ("tiny-v2", "paged", 8),
        ("tiny-v2", "legacy", 8),
        ("tiny-v2", "legacy", 0),
        ("tiny-v1", "legacy", 4),
    ],
)
def test_pool_slots_are_what_the_pool_allocates(preset, kind, bucket):
    cfg = preset_config(preset)
    pool = make_state_pool(CodecDecoder(cfg), kind)
    pool.initialize(6, pool.scratch_slots_for(bucket))
    slots = pool_slots(kind, 6, bucket)
    assert pool.num_slots == slots == {"compact": 7, "paged": 7, "legacy": 6 + bucket}[kind]
    rings = sum(r.numel() * r.element_size() for r in pool.rings)
    element = pool.rings[0].element_size()
    full = slots * cfg.state_bytes_per_slot(element)
    if kind == "paged":
        # Full pages for every live slot plus one null page per group: less than a whole null slot.
        assert (pool_slots("paged", 6) - 1) * cfg.state_bytes_per_slot(element) < rings < full
    else:
        assert rings == full
    pool.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("pages", 4), "pool_kind must be one of 'compact', 'legacy', 'paged'; got 'pages'"),
        (("compact", 0), "max_num_seqs must be an integer >= 1, got 0"),
        (("compact", 4.0), "max_num_seqs must be an integer >= 1, got 4.0"),
        (("legacy", 4, -1), "graph_rows must be an integer >= 0, got -1"),
    ],
)
def test_pool_slots_refuse_bad_input(args, message):
    with pytest.raises(ValueError) as err:
        pool_slots(*args)
    assert str(err.value) == message


def test_the_last_slot_that_fits_passes_and_the_next_fails():
    share = MemoryShare(0.9, H200)
    reserve = WEIGHTS + STEP_RESERVE_BYTES
    fit = slots_that_fit(SLOT, share, reserve)
    assert fit == 1450 and fit * SLOT <= share.bytes - reserve < (fit + 1) * SLOT
    check_state_fits(fit, SLOT, share, what="Stage 1 max_num_seqs=1449", reserved_bytes=reserve)
    with pytest.raises(ValueError) as err:
        check_state_fits(fit + 1, SLOT, share, what="Stage 1 max_num_seqs=1450", reserved_bytes=reserve)
    assert str(err.value) == (
        "Stage 1 max_num_seqs=1450 needs 1451 slots x 88678400 bytes = 128672358400 bytes (119.84 GiB) of decoder "
        "state, but its memory share (gpu_memory_utilization 0.9 of 139.80 GiB = 125.82 GiB), less 6.02 GiB for "
        "the codec weights, CUDA graphs and step activations, holds 1450 slots: lower max_num_seqs or raise "
        "gpu_memory_utilization"
    )


def test_compact_stage_of_2048_streams_on_90_percent_of_an_h200_fails_naming_slots_bytes_and_share():
    with pytest.raises(ValueError) as err:
        check_stage_state(
            max_num_seqs=2048,
            pool_kind="compact",
            bytes_per_slot=SLOT,
            share=MemoryShare(0.9, H200),
            reserved_bytes=WEIGHTS + STEP_RESERVE_BYTES,
            graph_rows=2048,
        )
    assert str(err.value) == (
        "Stage 1 max_num_seqs=2048 needs 2049 slots x 88678400 bytes = 181702041600 bytes (169.22 GiB) of decoder "
        "state, but its memory share (gpu_memory_utilization 0.9 of 139.80 GiB = 125.82 GiB), less 6.02 GiB for "
        "the codec weights, CUDA graphs and step activations, holds 1450 slots: lower max_num_seqs or raise "
        "gpu_memory_utilization"
    )


def test_legacy_stage_counts_a_scratch_slot_per_padding_row():
    # Upstream's pool at 256 streams with buckets up to 256 needs 512 slots: more than 30% of an H200 holds.
    share = MemoryShare(0.3, H200)
    reserve = WEIGHTS + STEP_RESERVE_BYTES
    kwargs = dict(bytes_per_slot=SLOT, share=share, reserved_bytes=reserve, graph_rows=256)
    check_stage_state(max_num_seqs=256, pool_kind="compact", **kwargs)
    with pytest.raises(
        ValueError, match=r"^Stage 1 max_num_seqs=256 needs 512 slots x 88678400 bytes .* holds 434 slots"
    ):
        check_stage_state(max_num_seqs=256, pool_kind="legacy", **kwargs)
    assert slots_that_fit(SLOT, share, reserve) == 434


def test_state_budget_is_checked_as_bytes():
    share = MemoryShare(0.9, H200)
    reserve = WEIGHTS + STEP_RESERVE_BYTES
    room = share.bytes - reserve
    common = dict(max_num_seqs=4096, pool_kind="paged", bytes_per_slot=SLOT, share=share, reserved_bytes=reserve)
    check_stage_state(state_budget_bytes=room, **common)  # 4096 slots of full rings would not fit; the budget does
    with pytest.raises(ValueError) as err:
        check_stage_state(state_budget_bytes=120 * GIB, **common)
    assert str(err.value) == (
        f"Stage 1 codec_state_budget_gib=120 needs 128849018880 bytes (120.00 GiB) of decoder state, but its memory "
        f"share (gpu_memory_utilization 0.9 of 139.80 GiB = 125.82 GiB), less 6.02 GiB for the codec weights, CUDA "
        f"graphs and step activations, holds {room} bytes (119.80 GiB): lower codec_state_budget_gib or raise "
        f"gpu_memory_utilization"
    )


def test_a_reserve_larger_than_the_share_holds_no_slot():
    share = MemoryShare(0.01, H200)
    assert slots_that_fit(SLOT, share, WEIGHTS) == 0
    with pytest.raises(ValueError, match=r"needs 2 slots x 88678400 bytes .* holds 0 slots"):
        check_state_fits(2, SLOT, share, what="Stage 1 max_num_seqs=1", reserved_bytes=WEIGHTS)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(slots=0), "slots must be an integer >= 1, got 0"),
        (dict(bytes_per_slot=0), "bytes_per_slot must be an integer >= 1, got 0"),
        (dict(reserved_bytes=-1), "reserved_bytes must be an integer >= 0, got -1"),
        (dict(reserved_bytes=1.5), "reserved_bytes must be an integer >= 0, got 1.5"),
    ],
)
def test_check_state_fits_refuses_bad_input(kwargs, message):
    args = dict(slots=2, bytes_per_slot=SLOT, reserved_bytes=0) | kwargs
    with pytest.raises(ValueError) as err:
        check_state_fits(
            args["slots"],
            args["bytes_per_slot"],
            MemoryShare(0.9, H200),
            what="x",
            reserved_bytes=args["reserved_bytes"],
        )
    assert str(err.value) == message


def test_v2_weights_are_the_reserved_weight_bytes():
    """The weight figure the deploy files and these tests use is the v2 decoder's parameters and buffers in bf16."""
    with torch.device("meta"):
        decoder = CodecDecoder(preset_config("v2"))
    tensors = list(decoder.parameters()) + list(decoder.buffers())
    assert sum(t.numel() for t in tensors) * 2 == WEIGHTS
    assert preset_config("v2").state_bytes_per_slot(2) == SLOT
