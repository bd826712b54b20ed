# SPDX-License-Identifier: Apache-2.0
"""step_inputs: a step's codes packed one row after another, clamped and counted; an eager step's inputs as tensors
of their own (on the CPU here)."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import StepShape
from vllm_omni_moss.model_executor.models.moss_tts.serving.counters import SessionCounters
from vllm_omni_moss.model_executor.models.moss_tts.serving.step_inputs import StepInputs
from vllm_omni_moss.model_executor.models.moss_tts.serving.streams import StepBatch

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


def _batch() -> StepBatch:
    a = torch.tensor([[1, -3], [9, 2]], dtype=torch.int16)  # -3 and 9 fall outside a codebook of 8
    b = torch.tensor([[4], [5]], dtype=torch.long)
    return StepBatch(("a", "b"), (2, 0), (a, b), (2, 1), StepShape(2, 2, 4))


def test_stage_eager_packs_clamps_and_counts_the_codes():
    counters = SessionCounters()
    inputs = StepInputs(torch.device("cpu"), 2, 8, counters)
    codes, slot_ids, valid_frames, valid = inputs.stage_eager(_batch())
    assert codes.tolist() == [[1, 0, 4, 0], [7, 2, 5, 0]]  # packed, clamped, then a dummy frame of code 0
    assert slot_ids.tolist() == [2, 0] and valid_frames.tolist() == [2, 1] and valid.tolist() == [True, True]
    assert inputs.clamped_codes == 2 == counters.clamped_codes
    assert all(t.dtype == torch.long and t._base is None for t in (codes, slot_ids, valid_frames))
    inputs.fill_codes(codes, _batch())  # every step counts its own codes
    assert inputs.clamped_codes == 4


def test_codes_in_range_count_nothing():
    inputs = StepInputs(torch.device("cpu"), 1, 8, SessionCounters())
    batch = StepBatch(("a",), (0,), (torch.tensor([[7, 0, 3]]),), (3,), StepShape(1, 3, 3))
    codes = torch.full((1, 3), -1, dtype=torch.long)
    inputs.fill_codes(codes, batch)
    assert codes.tolist() == [[7, 0, 3]] and inputs.clamped_codes == 0


def test_a_large_host_step_is_packed_and_clamped_without_an_aten_kernel():
    # 512 rows of 6 frames: 36,864 codes, past ATen's 32,768-element grain, where a CPU op would wake the intra-op
    # thread pool. Host codes are packed, counted and clamped with NumPy: no ATen op runs but the detach that .numpy()
    # makes (metadata, no kernel), and the result is the concatenation clamped into [0, 1024).
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    pieces = tuple(
        torch.randint(-2, 1027, (12, 6), generator=g, dtype=torch.int32 if b % 2 else torch.long) for b in range(512)
    )
    pieces = pieces[:-1] + (torch.randint(0, 1024, (12, 9), generator=g)[:, 2:5],)  # a strided view, 3 frames
    frames = tuple(p.shape[1] for p in pieces)
    batch = StepBatch(tuple(map(str, range(512))), tuple(range(512)), pieces, frames, StepShape(512, 6, 3072))
    counters = SessionCounters()
    inputs = StepInputs(torch.device("cpu"), 12, 1024, counters)
    codes = torch.full((12, 3072), 5, dtype=torch.long)
    with Ops() as ops:
        inputs.fill_codes(codes, batch)
    assert set(ops.seen) == {"aten.detach.default"}
    expected = torch.cat([p.long() for p in pieces], dim=1)
    assert torch.equal(codes[:, : sum(frames)], expected.clamp(0, 1023)) and not codes[:, sum(frames) :].any()
    assert counters.clamped_codes == int(((expected < 0) | (expected > 1023)).sum()) > 0
