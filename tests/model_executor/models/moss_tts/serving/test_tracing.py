# SPDX-License-Identifier: Apache-2.0
"""tracing: ``CallTracer`` (on and off, the phases of a call, failures) and the ``CallTrace`` it records."""

from __future__ import annotations

import gc
import sys
import time

import pytest

from vllm_omni_moss.model_executor.models.moss_tts.serving.tracing import CallTrace, CallTracer

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


def test_a_traced_call_adds_its_phases_up_to_its_total():
    tracer = CallTracer()
    assert tracer.traces is None and tracer.trace is None
    traces = tracer.enable(max_calls=2)
    for chunks in (1, 2, 3):
        tracer.begin(chunks, time.perf_counter())
        tracer.lap("plan_ms")
        tracer.trace.steps += 1
        tracer.lap("run_ms")
        tracer.end()
    assert tracer.trace is None and [t.chunks for t in traces] == [2, 3]  # the last max_calls
    last = traces[-1]
    phases = last.plan_ms + last.run_ms + last.finish_ms
    assert phases == pytest.approx(last.total_ms, rel=1e-9, abs=1e-9) and not last.failed
    tracer.begin(1, time.perf_counter())
    tracer.fail()
    tracer.end()
    assert traces[-1].failed and traces[-1].steps == 0 and traces[-1].plan_ms == traces[-1].total_ms
    tracer.disable()
    assert tracer.traces is None
    tracer.lap("run_ms")  # outside a traced call: nothing to close
    assert CallTrace().total_ms == 0.0


@pytest.mark.parametrize("bad", [0, -1, True, 1.0, sys.maxsize + 1])
def test_enable_refuses_a_bad_max_calls(bad):
    with pytest.raises(ValueError, match=rf"^max_calls must be None or an integer in 1\.\.{sys.maxsize}, got "):
        CallTracer().enable(bad)


def test_a_tracer_hears_collections_only_while_it_is_on():
    """The collector hook hands a collection inside a traced call to its trace; once the tracer is off, a
    collection reaches it no more (the next traced call after enable again starts from zero)."""
    tracer = CallTracer()
    traces = tracer.enable(max_calls=None)
    tracer.begin(1, time.perf_counter())
    gc.collect()
    tracer.end()
    assert traces[-1].gc_collections >= 1 and traces[-1].gc_ms > 0
    tracer.begin(1, time.perf_counter())
    tracer.disable()
    gc.collect()  # off: the hook no longer calls this tracer, so its open trace sees nothing
    assert tracer.trace is not None and tracer.trace.gc_collections == 0
