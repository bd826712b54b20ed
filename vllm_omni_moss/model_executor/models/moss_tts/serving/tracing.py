# SPDX-License-Identifier: Apache-2.0
"""Call traces: the host time of each ``CodecStreamSession.decode`` call by phase, for latency diagnosis."""

from __future__ import annotations

import gc
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass

__all__ = ["CallTrace", "CallTracer"]


@dataclass
class CallTrace:
    """Host time of one ``CodecStreamSession.decode`` call by phase, in milliseconds of ``time.perf_counter``
    (``CodecStreamSession.enable_call_traces``).

    The phases follow each other and add up to ``total_ms``:

    Attributes:
        plan_ms: work before and between steps: request checks, routing chunks to streams, admission (with
            the pool's page reservations), ending streams, preempting streams of a paged pool (their state
            copied to the host), and cutting the ready chunks into steps (the whole call when no step runs).
        stage_ms: each step's gathering, clamp count, clamp and copies of its codes, slot ids, valid frames and
            (a graph step) valid rows, into the graph's own input buffers for a graph step; on
            CUDA, when an earlier step of the call has not started on the device yet, the wait for its input
            copies (the next step reuses their page-locked buffer).
        run_ms: the steps themselves as the host sees them: with CUDA graphs the replay's launch (its inputs
            were staged, its output is read in place; the GPU may still be running when it returns); an eager
            step's launches, and on CUDA the waits inside it.
        to_host_ms: each step's audio rows to the host: on CUDA allocating the page-locked rows and queueing
            their copies behind the step (the host does not wait for them here).
        finish_ms: after the last step: ending streams, admitting and decoding nothing more, result objects,
            copies of still-buffered chunks, and (after ``wait_ms``) joining a stream's pieces.
        wait_ms: on CUDA, the call's one wait for the device, after its host work: the GPU time of its steps
            and audio copies that the host work above did not hide.
        total_ms: the whole call.
        gc_ms: Python garbage collections that started and ended while the call ran (time already inside the
            phases above).
        gc_collections: those collections.
        chunks: requests in the call.
        steps: pool steps the call completed.
        failed_steps: pool steps of the call that raised; their streams failed alone, with an error in their
            results (``StepRunner.execute``), and the call went on.
        failed: the call raised (after its argument checks, which record nothing); the time from the last
            closed phase to the failure counts in ``finish_ms`` (``plan_ms`` when no step had completed), and
            on CUDA the wait for the copies of the steps that did in ``wait_ms``.
    """

    plan_ms: float = 0.0
    stage_ms: float = 0.0
    run_ms: float = 0.0
    to_host_ms: float = 0.0
    finish_ms: float = 0.0
    wait_ms: float = 0.0
    total_ms: float = 0.0
    gc_ms: float = 0.0
    gc_collections: int = 0
    chunks: int = 0
    steps: int = 0
    failed_steps: int = 0
    failed: bool = False

    def _lap(self, phase: str, now: float, last: float) -> float:
        # Add now - last to `phase` and return now, the next phase's start.
        setattr(self, phase, getattr(self, phase) + (now - last) * 1e3)
        return now


#: Tracers that are on; the one garbage-collector hook below reads them. A WeakSet, so that tracing never keeps
#: a session (and its pool) alive.
_TRACING: weakref.WeakSet = weakref.WeakSet()


def _gc_hook(phase: str, info: dict) -> None:
    # gc.callbacks hook, registered once by the first enable: hands each collection's start and stop to every
    # tracer that is on (CallTracer.gc_event).
    for tracer in list(_TRACING):
        tracer.gc_event(phase)


class CallTracer:
    """The traces of one session's calls; off until :meth:`enable`.

    Attributes:
        traces: the traces of the last calls, None while tracing is off.
        trace: the running call's trace (None outside a traced call).
    """

    def __init__(self):
        self.traces: deque[CallTrace] | None = None
        self.trace: CallTrace | None = None
        self._mark = 0.0  # perf_counter at the end of the running trace's last phase
        self._started = 0.0  # perf_counter at the start of the running call
        self._gc_started: float | None = None  # perf_counter at the start of a collection inside the call

    def enable(self, max_calls: int | None) -> deque[CallTrace]:
        """Start a new, empty :attr:`traces` of the last ``max_calls`` calls (None keeps all).

        Raises:
            ValueError: ``max_calls`` is not None or an integer in ``1..sys.maxsize``.
        """
        if max_calls is not None and (
            isinstance(max_calls, bool) or not isinstance(max_calls, int) or not 1 <= max_calls <= sys.maxsize
        ):
            raise ValueError(f"max_calls must be None or an integer in 1..{sys.maxsize}, got {max_calls!r}")
        if _gc_hook not in gc.callbacks:
            gc.callbacks.append(_gc_hook)
        self.traces = deque(maxlen=max_calls)
        _TRACING.add(self)
        return self.traces

    def disable(self) -> None:
        _TRACING.discard(self)
        self.traces = None

    def begin(self, chunks: int, started: float) -> None:
        """Open a call's trace (after the call's argument checks, which count as planning)."""
        self.trace, self._mark, self._started, self._gc_started = CallTrace(chunks=chunks), started, started, None

    def lap(self, phase: str) -> None:
        """Close the running trace's current phase as ``phase`` (no-op outside a traced call)."""
        if self.trace is not None:
            self._mark = self.trace._lap(phase, time.perf_counter(), self._mark)

    def fail(self) -> None:
        if self.trace is not None:
            self.trace.failed = True

    def end(self) -> None:
        """Close the running call's trace and keep it in :attr:`traces`."""
        trace, self.trace, self._gc_started = self.trace, None, None
        if trace is None:
            return
        now = time.perf_counter()
        trace._lap("finish_ms" if trace.steps else "plan_ms", now, self._mark)
        trace.total_ms = (now - self._started) * 1e3
        if self.traces is not None:
            self.traces.append(trace)

    def gc_event(self, phase: str) -> None:
        """A collection's start or stop (from the hook). Only collections that start and stop within one traced
        call count toward it: a stop whose start fell outside the call is ignored."""
        trace = self.trace
        if trace is None:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            trace.gc_ms += (time.perf_counter() - self._gc_started) * 1e3
            trace.gc_collections += 1
            self._gc_started = None
