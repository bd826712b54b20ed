# SPDX-License-Identifier: Apache-2.0
"""options: ``SessionOptions``, one frozen record checked and normalised once, and the step ladder it gives."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import StepLadder
from vllm_omni_moss.model_executor.models.moss_tts.serving import SessionOptions

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


def test_graph_sizes_are_normalised_once_and_give_the_ladder():
    options = SessionOptions(3, graph_frame_totals=[8, 2, 2, 1, 0], graph_frame_sizes=[3, 1, 3], max_step_frames=5)
    assert options.graph_frame_totals == (1, 2, 8) and options.graph_frame_sizes == (1, 3) and options.uses_graphs
    assert options.step_ladder == StepLadder(3, 3, (1, 2, 8))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_step_frames = 6


def test_without_graph_sizes_steps_are_exact_and_max_step_frames_long():
    assert SessionOptions(2, max_step_frames=7).step_ladder == StepLadder(2, 7, ())
    only_totals = SessionOptions(2, graph_frame_totals=(2, 4))
    assert not only_totals.uses_graphs and only_totals.step_ladder == StepLadder(2, 100, ())
    assert SessionOptions(1) == SessionOptions(1, None, (), (), 100, 64, 4096, None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"state_capacity": 0}, "state_capacity must be an integer >= 1, got 0"),
        ({"max_step_frames": 0}, "max_step_frames must be an integer >= 1, got 0"),
        ({"max_waiting_streams": -1}, "max_waiting_streams must be an integer >= 0, got -1"),
        ({"max_waiting_frames": -2}, "max_waiting_frames must be an integer >= 0, got -2"),
        ({"n_vq": 1.5}, "n_vq must be an integer or None, got 1.5"),
        ({"n_vq": True}, "n_vq must be an integer or None, got True"),
        ({"graph_memory_bytes": -1}, "graph_memory_bytes must be an integer >= 0, got -1"),
    ],
)
def test_each_bad_field_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        SessionOptions(**{"state_capacity": 2, **kwargs})
