# SPDX-License-Identifier: Apache-2.0
"""counters: ``SessionCounters`` and the ``stats()`` dict it reports."""

from __future__ import annotations

import pytest

from vllm_omni_moss.model_executor.models.moss_tts.serving.counters import SessionCounters

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


def test_counts_and_stats():
    c = SessionCounters(steps_graph=2, steps_eager=1, decoded_frames=9, padded_frames=3, padding_rows=1)
    c.count_admitted(0.25)
    c.count_admitted(0.125)
    for preemptions in (0, 2, 0):
        c.count_ended(preemptions)
    c.request_errors = 4
    assert (c.admitted_from_queue, c.queue_wait_s_max) == (2, 0.25)
    assert c.stats(waiting_streams=1, waiting_frames=5, clamped_codes=7) == {
        "steps_by_path": {"graph": 2, "eager": 1},
        "decoded_frames": 9,
        "padded_frames": 3,
        "padding_rows": 1,
        "waiting_streams": 1,
        "waiting_frames": 5,
        "admitted_from_queue": 2,
        "preemptions": 0,
        "preempted_bytes": 0,
        "preemption_seconds": 0.0,
        "streams_by_preemptions": {0: 2, 2: 1},
        "queue_wait_s_max": 0.25,
        "clamped_codes": 7,
        "request_errors": 4,
    }
