# SPDX-License-Identifier: Apache-2.0
"""The simulated clock and the driver loop: one trace streamed through one arm.

The clock (s) jumps to the next event (a chunk's last frame generated, or an open-loop arrival while a stream
may start) when the arm is idle, and advances by the measured wall time of each decode call otherwise (by 0
for an untimed arm: ``ideal``). A decode call is one stage batch: every chunk ready at that moment. A request
starts when it has arrived and fewer than ``trace.limit`` streams are live (FIFO, first come first served): at
its arrival, or when the stream it waits for ends. The talker is a stage of its own (vLLM-Omni processes each
stage with an engine of its own, on devices of its own: its stage-config documentation, and ``docs/serving.md``,
"Placing the codec stage apart"), so a request that arrives while a decode call runs starts at its arrival, not
when the call returns; a stream ends when its last chunk's audio comes back, at the end of a call. Its talker generates
frames at ``12.5 / talker_rtf`` frames/s from its start, so chunk ``[a, b)`` is ready at ``start + b *
talker_rtf / 12.5``; a chunk enters the stage only after the request's previous chunk was sent. Host work per
decode call is O(chunks of the call) (heaps and per-request lists, no scan over the live streams).
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import upstream_stage

from .playback import Playback
from .trace import FRAME_RATE, CodeSource, Trace, ramp_schedule

__all__ = ["Driver", "Run", "simulate", "warm_up"]


@dataclass
class Run:
    """Raw outcome of one (arm, run key). Times in seconds; per-request lists cover the measured requests."""

    codec_latency: list[float] = field(default_factory=list)  # every chunk: audio out - last frame generated
    first_latency: list[float] = field(default_factory=list)  # first audio - the request's start
    ttfp: list[float] = field(default_factory=list)  # first audio - the request's arrival
    worst_stall: list[float] = field(default_factory=list)  # per request with audio (playback.py)
    queue_wait: list[float] = field(default_factory=list)  # start (or the end, if still queued) - arrival
    live_trace: list[tuple[float, int]] = field(default_factory=list)  # (time, live streams from then), in order
    window: tuple[float, float] = (0.0, 0.0)  # measurement window of live streams and audio (s)
    step_wall: list[float] = field(default_factory=list)
    step_chunks: list[int] = field(default_factory=list)  # chunks decoded by each step
    step_frames: list[int] = field(default_factory=list)  # frames of each step's longest chunk
    step_decoded: list[int] = field(default_factory=list)  # frames of every chunk of each step, summed
    step_replay: list[float] = field(default_factory=list)  # graph replay seconds of each step (--time-replays)
    step_trace: list[Any] = field(default_factory=list)  # session.CallTrace of each step (--trace-calls)
    # Seconds Python's garbage collector ran inside each decode call, and outside it: between the previous call and
    # it (in the driver, as in an engine's loop between forward calls: counted on the simulated clock before the
    # call) and in the device wait after it (where the first allocations after a call run the collection its
    # paused allocations made due; already in the call's wall).
    step_gc: list[float] = field(default_factory=list)
    step_gc_between: list[float] = field(default_factory=list)
    state_trace: list[tuple[float, int]] = field(default_factory=list)  # (clock s, state bytes) after each step
    # The longest a measured request's chunk stayed queued in the arm (for a slot or state pages): from the call
    # that left it queued to the call that returned its audio.
    longest_session_wait: float = 0.0
    serving_s: float = 0.0
    audio_s: float = 0.0  # audio that came out inside the window (s of audio)
    requests: int = 0  # measured requests
    finished_requests: int = 0  # measured requests whose last audio came back
    stopped_early: bool = False


class CollectorTime:
    """Seconds Python's garbage collector runs, from its ``gc.callbacks`` start and stop events, read in laps."""

    def __init__(self) -> None:
        self.seconds, self._started = 0.0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def lap(self) -> float:
        """Collector seconds since the last lap."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def warm_up(arm, concurrency: int, chunk_sizes: list[int], n_vq: int, codebook_size: int) -> None:
    """Untimed: every chunk size once for ``concurrency`` streams, then abort them (first-call costs)."""
    gen = torch.Generator().manual_seed(12345)
    ids = [f"warmup-{i}" for i in range(concurrency)]
    for size in sorted(set(chunk_sizes)):
        codes = torch.randint(0, codebook_size, (n_vq, size), generator=gen)
        arm.decode([upstream_stage.StageChunk(rid, codes) for rid in ids])
    arm.abort(ids)


@dataclass
class _Stream:
    start: float
    schedule: list[tuple[int, int]]
    pending: deque = field(default_factory=deque)  # chunks sent, audio not back yet: (ready time, index, frames)
    done: int = 0  # chunks whose audio came back


class Driver:
    """One trace through one arm (:func:`simulate`). ``channels`` / ``samples_per_frame`` check the audio."""

    def __init__(
        self,
        arm,
        trace: Trace,
        codes: CodeSource,
        chunk_sizes: list[int],
        *,
        talker_rtf: float,
        give_up_s: float,
        channels: int,
        samples_per_frame: int,
        sync,
        bar=None,
    ):
        self.arm, self.trace, self.codes, self.sizes = arm, trace, codes, chunk_sizes
        self.seconds_per_frame = talker_rtf / FRAME_RATE
        self.give_up_s, self.sync, self.bar = give_up_s, sync, bar
        self.channels, self.spf = channels, samples_per_frame
        self.clock, self.next_r, self.live = 0.0, 0, 0
        # Stream places under trace.limit: never used yet (free since 0), and the times streams' ends freed the
        # others, oldest first; a starting request takes the one free longest (unused + len(freed) = limit - live).
        self.unused, self.freed = trace.limit, deque()
        self.live_changes: list[tuple[float, int]] = []  # (time, +1 or -1): a start may date back into a call
        self.streams: dict[int, _Stream] = {}
        self.ready: list[tuple[float, int, int]] = []  # (ready time, request, chunk index)
        self.sent: list[tuple[float, int, int]] = []  # heap of chunks sent, stale once their audio is back
        self.queued_since: dict[int, float] = {}  # request -> clock of the call that first left it queued
        self.playback = Playback(len(trace))
        self.run = Run(requests=trace.measured_count)
        self.collector = CollectorTime()
        self.run.window = trace.window or (0.0, math.inf)

    # ------------------------------------------------------------------ requests
    def _next_arrival(self) -> float | None:
        """The next open-loop arrival that could start a stream (None: none, or every stream is busy)."""
        if self.next_r >= len(self.trace) or self.live >= self.trace.limit:
            return None
        arrival = float(self.trace.arrivals[self.next_r])
        return None if math.isnan(arrival) else arrival

    def _admit(self, now: float) -> None:
        while self.next_r < len(self.trace) and self.live < self.trace.limit:
            r, arrival = self.next_r, float(self.trace.arrivals[self.next_r])
            if arrival > now:  # NaN (closed loop) compares False: it starts now
                break
            if self.unused:
                self.unused, free_since = self.unused - 1, 0.0
            else:
                free_since = self.freed.popleft()
            # Its talker starts at its arrival (during a decode call too) or when its place freed, whichever is
            # later; a closed-loop request arrives when it starts.
            start = free_since if math.isnan(arrival) else max(arrival, free_since)
            schedule = ramp_schedule(int(self.trace.lengths[r]), self.sizes)
            self.streams[r] = _Stream(start, schedule)
            self.next_r, self.live = r + 1, self.live + 1
            self.live_changes.append((start, 1))
            if self.trace.measured[r]:
                self.run.queue_wait.append(0.0 if math.isnan(arrival) else start - arrival)
            heapq.heappush(self.ready, (start + schedule[0][1] * self.seconds_per_frame, r, 0))

    def _end(self, r: int) -> None:
        del self.streams[r]
        self.codes.drop(r)
        self.live -= 1
        self.freed.append(self.clock)
        self.live_changes.append((self.clock, -1))
        if self.trace.measured[r]:
            self.run.finished_requests += 1
            if self.bar is not None:
                self.bar.update(1)

    def _arrival(self, r: int) -> float:
        arrival = float(self.trace.arrivals[r])
        return self.streams[r].start if math.isnan(arrival) else arrival

    # ------------------------------------------------------------------ the loop
    def _advance(self) -> bool:
        """Move the clock to the next event when nothing is ready; False when no event is left."""
        if self.ready or self.arm.idle():
            times = [t for t in (self.ready[0][0] if self.ready else None, self._next_arrival()) if t is not None]
            if not times:
                return False
            self.clock = max(self.clock, min(times))
        self._admit(self.clock)
        return True

    def _done(self) -> bool:
        return self.run.finished_requests == self.run.requests  # every measured request started and ended

    def simulate(self) -> Run:
        self._admit(0.0)
        gc.callbacks.append(self.collector)
        try:
            self._drive()
        finally:
            gc.callbacks.remove(self.collector)
        self._close()
        return self.run

    def _drive(self) -> None:
        while not self._done():
            if not self._advance():
                raise AssertionError("streams are left but no chunk, arrival or queued stream remains")
            batch = []
            while self.ready and self.ready[0][0] <= self.clock:
                batch.append(heapq.heappop(self.ready))
            if not batch and (self.ready or self.arm.idle()):
                continue  # a stream started; its first chunk is not ready yet
            if self._call(batch) or self._waited_too_long():
                self.run.stopped_early = True
                break
            self._admit(self.clock)

    def _call(self, batch: list[tuple[float, int, int]]) -> bool:
        """One decode call of ``batch``; True when a chunk's codec-added latency exceeded the give-up."""
        chunks = []
        for _, r, k in batch:
            a, b = self.streams[r].schedule[k]
            last = k == len(self.streams[r].schedule) - 1
            chunks.append(upstream_stage.StageChunk(f"req-{r}", self.codes.take(r)[:, a:b], last))
        between = self.collector.lap()
        if self.arm.timed:
            self.clock += between  # the engine pays collections between calls before it calls again
        called_at, t0 = self.clock, time.perf_counter()
        audio = self.arm.decode(chunks)
        inside = self.collector.lap()
        self.sync()
        wall = time.perf_counter() - t0 if self.arm.timed else 0.0
        # A collection the call's paused allocations make due runs at the first allocation after it, here in the
        # device wait (already in the wall): it counts between calls, as an engine would pay it after forward().
        self.run.step_gc.append(inside)
        self.run.step_gc_between.append(between + self.collector.lap())
        self._record_step(wall, chunks)
        missing = {c.request_id for c in chunks} - set(audio)
        if missing:
            raise AssertionError(f"no result for {sorted(missing)}")
        for (ready_at, r, k), chunk in zip(batch, chunks):
            stream = self.streams[r]
            stream.pending.append((ready_at, k, chunk.frames))
            heapq.heappush(self.sent, (ready_at, r, k))
            if k + 1 < len(stream.schedule):  # the talker keeps generating whatever the codec does
                ready = stream.start + stream.schedule[k + 1][1] * self.seconds_per_frame
                heapq.heappush(self.ready, (ready, r, k + 1))
        worst = -1.0
        for rid, wav in audio.items():
            r = int(rid.removeprefix("req-"))
            if wav is None:  # queued in the arm, its audio comes in a later call
                self.queued_since.setdefault(r, called_at)
                continue
            since = self.queued_since.pop(r, None)
            if since is not None and self.trace.measured[r]:
                self.run.longest_session_wait = max(self.run.longest_session_wait, self.clock - since)
            worst = max(worst, self._on_audio(r, wav))
        if not batch and worst < 0:
            raise AssertionError("streams wait in the session but nothing can be decoded")
        return worst > self.give_up_s

    def _record_step(self, wall: float, chunks) -> None:
        run = self.run
        run.step_wall.append(wall)
        run.step_chunks.append(len(chunks))
        run.step_frames.append(max((chunk.frames for chunk in chunks), default=0))
        run.step_decoded.append(sum(chunk.frames for chunk in chunks))
        replay = self.arm.take_replay_seconds()
        if replay is not None:
            run.step_replay.append(replay)
        call_trace = self.arm.take_call_trace()
        if call_trace is not None:
            run.step_trace.append(call_trace)
        self.clock += wall
        run.state_trace.append((self.clock, self.arm.state_bytes_now()))

    def _on_audio(self, r: int, wav: torch.Tensor) -> float:
        """Account the chunks of request ``r`` that ``wav`` holds; returns their largest codec-added latency."""
        frames = wav.shape[-1] // self.spf
        if wav.shape[0] != self.channels or wav.shape[-1] != frames * self.spf:
            raise AssertionError(f"req-{r}: audio {tuple(wav.shape)} is not whole frames")
        stream, measured, worst = self.streams.get(r), bool(self.trace.measured[r]), 0.0
        w0, w1 = self.run.window
        while frames > 0:
            if stream is None or not stream.pending:
                raise AssertionError(f"req-{r}: audio for frames that were never sent")
            ready_at, k, chunk_frames = stream.pending.popleft()
            frames -= chunk_frames
            stream.done = k + 1
            latency = self.clock - ready_at
            worst = max(worst, latency)
            if w0 <= self.clock <= w1:
                self.run.audio_s += chunk_frames / FRAME_RATE
            self.playback.on_audio(r, self.clock, chunk_frames)
            if measured:
                self.run.codec_latency.append(latency)
                if k == 0:
                    self.run.first_latency.append(self.clock - stream.start)
                    self.run.ttfp.append(self.clock - self._arrival(r))
        if frames < 0:
            raise AssertionError(f"req-{r}: audio ends inside a chunk")
        if stream is not None and stream.done == len(stream.schedule):
            self._end(r)
        return worst

    def _waited_too_long(self) -> bool:
        """A chunk sent and still undecoded, or a request queued, for longer than the give-up."""
        while self.sent:
            _, r, k = self.sent[0]
            stream = self.streams.get(r)
            if stream is not None and stream.done <= k:
                break
            heapq.heappop(self.sent)  # stale: its audio came back
        if self.sent and self.clock - self.sent[0][0] > self.give_up_s:
            return True
        if self.next_r < len(self.trace):
            arrival = float(self.trace.arrivals[self.next_r])
            return not math.isnan(arrival) and self.clock - arrival > self.give_up_s
        return False

    def _close(self) -> None:
        run = self.run
        run.serving_s = self.clock
        if run.window[1] == math.inf:
            run.window = (run.window[0], self.clock)
        elif run.stopped_early:
            run.window = (run.window[0], max(run.window[0], min(run.window[1], self.clock)))
        live, run.live_trace = 0, [(0.0, 0)]
        for when, change in sorted(self.live_changes, key=lambda c: c[0]):  # stable: equal times keep their order
            live += change
            run.live_trace.append((when, live))
        run.live_trace.append((self.clock, self.live))
        for r in list(self.streams):
            self.playback.cut_off(r, self.clock)
        for r in range(self.next_r, len(self.trace)):  # still queued when a run stopped: the wait so far
            arrival = float(self.trace.arrivals[r])
            if self.trace.measured[r] and arrival <= self.clock:
                run.queue_wait.append(self.clock - arrival)
        for r in range(self.next_r):
            if self.trace.measured[r] and not math.isnan(self.playback.first_audio[r]):
                run.worst_stall.append(self.playback.worst_stall[r])


def simulate(arm, trace: Trace, chunk_sizes: list[int], cfg, args, device, label: str, n_vq: int) -> Run:
    """Stream ``trace`` through ``arm`` (:class:`Driver`) with a progress bar over the measured requests."""
    from tqdm import tqdm

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    bar = tqdm(total=trace.measured_count, desc=label, unit="req", disable=True if args.quiet else None, leave=False)
    try:
        driver = Driver(
            arm,
            trace,
            CodeSource(trace, n_vq, cfg.codebook_size),
            chunk_sizes,
            talker_rtf=args.talker_rtf,
            give_up_s=args.give_up_ms / 1e3,
            channels=cfg.number_channels,
            samples_per_frame=cfg.samples_per_frame,
            sync=sync,
            bar=bar,
        )
        return driver.simulate()
    finally:
        bar.close()
