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
