# SPDX-License-Identifier: Apache-2.0
"""Main job: the MOSS-TTS codec stage under serving load, ours against upstream's, over a concurrency sweep.

Arms (one process, the same request trace for every arm at a given concurrency):

* ``v2``       - our default :class:`CodecStreamSession` (compact pool for v2 codecs).
* ``legacy``   - the same session on the legacy pool (``pool_kind="legacy"``).
* ``upstream`` - vLLM-Omni 0.30.0's own codec model and pool from the published wheel, served with
  upstream's Stage-1 policy (``upstream_stage.py``: 2N slots, terminal chunks padded onto a captured graph
  frame size, CUDA graphs captured as upstream's stage does, and on CUDA the Triton attention backend of
  upstream's ``moss_tts_local_h200.yaml``). Skipped, with the reason printed, when the wheel's files are
  missing (set ``MOSS_UPSTREAM_MOSS_TTS_DIR`` to an unzipped wheel's ``moss_tts`` directory).
* ``v2-paged`` - only when named in ``--arms``: the same session on the paged pool (``pool_kind="paged"``;
  ``--page-fraction`` of full rings for every slot, 1.0 by default, which never preempts), to measure the
  state its streams hold. ``--state-budget-gib`` instead gives each of our arms the state memory of a budget:
  the paged arm the pages it buys, the unpaged arms the slots it buys (the other streams wait in the queue).

Traffic: at concurrency ``C`` the trace has ``C * --requests-per-stream`` requests, at most ``C`` live at
once (a finished stream is replaced by the next request). Each stream's talker emits code frames at 12.5
frames/s; the stage receives them in chunks that follow ``--chunks`` (a ramp: each size once in order, the
last repeated; ``1,15`` = 1, 15, 15, ...; ``1,4,15`` = 1, 4, 15, 15, ...; the last chunk is what remains).
Request lengths are SYNTHETIC: log-normal, median 4.0 s, sigma 0.45, clipped to 13..256 frames (1.04 to
20.48 s), chosen to resemble the target durations of the Seed-TTS test-en set used in vLLM-Omni's MOSS-TTS
benchmarks. Codes are uniform random and weights random: timing and memory only.

Clock: simulated. It jumps to the next chunk's ready time when the codec is idle, and advances by the
measured wall time of each codec step otherwise. A step is one stage batch: every chunk ready at that
moment, in one ``decode()`` call. A request's next chunk enters the stage only after its previous one was
decoded.

Figures per arm and concurrency (``results.json``: ``arms.<arm>.<C>``):

* ``codec_latency_ms`` {p50, p95, p99}: codec-added latency of every chunk, the first included: the time its
  audio comes out minus the time its last frame was generated.
* ``first_chunk_latency_ms`` {p50, p99}: first audio minus the request's start (includes the generation of
  the first chunk's frames: 80 ms for a 1-frame chunk).
* ``audio_seconds_per_second``: audio produced per simulated second. Capped near ``C`` by construction (each
  live stream produces one second of audio per second), so it is reported but is not the SLO.
* ``steps_by_path`` {graph, eager}: pool steps by path (ours: ``session.stats()``; upstream: the driver).
* ``padded_frame_fraction``: padded / (decoded + padded) frames of real rows (frames beyond a row's length in
  its step); 0 when every row ran at its own length.
* ``peak_memory_bytes``: CUDA ``max_memory_allocated`` during the timed run (reset after setup and warm-up;
  weights, state, graph pools and activations of that arm); null on CPU.
* ``details.peak_state_bytes``: the most decoder state the live streams needed after any decode call
  (``pool.state_in_use_bytes()``: all of it for unpaged pools and upstream, the pages held for a paged pool).
* ``details.state_bytes_over_time``: ``[seconds, bytes]`` pairs, the simulated clock (s) after each decode
  call and the decoder state in use then (bytes, as for ``peak_state_bytes``), cut to at most
  ``STATE_TRACE_POINTS`` (200) points by keeping the largest value of each run of consecutive calls, so that
  its maximum is ``peak_state_bytes``. Upstream's pool holds full rings throughout: a flat line.

SLO: ``codec_latency_ms.p99 <= --slo-ms`` (150). A codec that falls behind real time fails it (its latency
grows without bound); a run is stopped once a chunk's codec-added latency exceeds ``--give-up-ms``, is
marked ``stopped_early`` in ``details`` (its figures then cover the chunks decoded so far) and misses the SLO
whatever its p99. ``arms.<arm>.max_streams_at_slo`` is the largest swept concurrency that holds the SLO
(null if none). A warning is printed when a run's step
time max exceeds 10x its p50, naming the slowest step's batch (chunks and frames): a stall of the machine
when that batch is small, a burst of chunks arriving together when it holds most of the live streams.
``--time-replays`` (CUDA, our arms) brackets every graph replay with device synchronisations and splits each
decode call into replay time and the host time around it (``details.replay_ms``, ``details.host_ms``).
``--trace-calls`` (our arms) records each decode call's host time by phase
(``CodecStreamSession.enable_call_traces``, phases of ``session.CallTrace``): ``details.call_trace_ms`` holds
each phase's p50 and p99 over the run's calls and ``details.slowest_step.trace`` the slowest call's whole trace.

Writes ``results.json`` (rewritten after every run), ``latencies.npz`` (every chunk's codec-added latency in
ms per arm and concurrency, keys ``"<arm>/<C>"``), ``results.md`` (with each run's peak state in GiB),
``latency_cdf.png``, ``concurrency.png`` and ``state_over_time.png`` (decoder state in use against the
simulated clock, one panel per concurrency, one line per arm) into ``--out``. ``--append`` adds runs to an existing ``--out`` made at the same commit with the same settings,
so that a sweep longer than one command's time limit can be split (e.g. ``--concurrency 64,128`` then
``--concurrency 256 --append``); ``max_streams_at_slo`` and the plots then cover every concurrency run.
``--report-only`` rewrites ``results.md`` and the plots from ``--out`` (e.g. after a command was cut short).
On a CPU the default is a tiny-v2 run with ``C`` in {4, 8} (about 30 s on two cores).
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import math
import shlex
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402
import upstream_stage  # noqa: E402

from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS, preset_config  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.session import ChunkRequest, CodecStreamSession  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.state_pool import make_state_pool  # noqa: E402

FRAME_RATE = 12.5  # code frames per second (both MOSS codecs)
ARMS = ("v2", "legacy", "upstream", "v2-paged")
#: Arms of ``--arms auto`` (v2-paged only on request).
AUTO_ARMS = ("v2", "legacy", "upstream")
LENGTH_MODEL = "lognormal(median 4.0 s, sigma 0.45), clipped to 13..256 frames (synthetic, Seed-TTS-EN-like)"
# Stage 1's cudagraph_capture_sizes in upstream's moss_tts_local_h200.yaml (vLLM-Omni 0.30.0); every arm uses
# the sizes <= C plus C itself, so that one bucket holds every live stream (upstream's 2N slots).
UPSTREAM_H200_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 256)
DEFAULT_CONCURRENCY = {"cuda": "64,128,256,512", "cpu": "4,8"}
#: Most ``[seconds, bytes]`` points of ``details.state_bytes_over_time`` per arm and concurrency.
STATE_TRACE_POINTS = 200


# ------------------------------------------------------------------------------------------ trace


def ramp_schedule(total_frames: int, sizes: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` chunks of a stream: ``sizes`` in order, the last size repeated, the last chunk cut."""
    out: list[tuple[int, int]] = []
    start = 0
    while start < total_frames:
        size = sizes[min(len(out), len(sizes) - 1)]
        end = min(start + size, total_frames)
        out.append((start, end))
        start = end
    return out


def request_lengths(n: int, seed: int) -> np.ndarray:
    """Frames per request from the documented synthetic distribution."""
    rng = np.random.default_rng(seed)
    seconds = rng.lognormal(mean=math.log(4.0), sigma=0.45, size=n)
    return np.clip(np.round(seconds * FRAME_RATE), 13, 256).astype(int)


@dataclass
class Trace:
    """``lengths[r]`` frames and ``codes[r]`` int64 ``(n_vq, lengths[r])`` on CPU per request ``r``."""

    lengths: np.ndarray
    codes: list[torch.Tensor]


def make_trace(requests: int, n_vq: int, codebook_size: int, seed: int) -> Trace:
    lengths = request_lengths(requests, seed)
    gen = torch.Generator().manual_seed(seed)
    codes = [torch.randint(0, codebook_size, (n_vq, int(t)), generator=gen) for t in lengths]
    return Trace(lengths, codes)


def graph_batch_sizes(concurrency: int) -> list[int]:
    return [b for b in UPSTREAM_H200_BATCH_SIZES if b < concurrency] + [concurrency]


# ------------------------------------------------------------------------------------------ arms


class OurArm:
    """Our session behind the driver interface: ``decode(chunks) -> {request id: audio}``, ``stats()``.

    Built as our stage builds it (``stage.py``): graph frame sizes = the schedule's distinct chunk sizes on
    every device (the session pads each step to them with or without graphs), batch buckets only where
    graphs are captured, ``max_step_frames`` = the largest chunk size.
    """

    def __init__(
        self,
        decoder,
        concurrency: int,
        kind: str,
        graphs: bool,
        chunk_sizes: list[int],
        n_vq: int,
        time_replays: bool = False,
        page_fraction: float | None = None,
        slots: int | None = None,
        paged_budget: dict[str, int] | None = None,
        trace_calls: bool = False,
    ):
        self.replay_s = 0.0
        self.peak_state = 0
        self.state_now = 0
        self.session = CodecStreamSession(
            decoder,
            concurrency if slots is None else slots,
            pool_kind=None if kind == "v2" else common.pool_kind(kind),
            graph_batch_sizes=graph_batch_sizes(concurrency) if graphs else (),
            graph_frame_sizes=sorted(set(chunk_sizes)),
            max_step_frames=max(chunk_sizes),
            n_vq=n_vq,
            # A paged pool below full rings may preempt: preempted streams wait, so the queue holds them all.
            max_waiting_streams=concurrency,
            max_waiting_frames=1 << 30,
            page_fraction=page_fraction,
            **(paged_budget or {}),
        )
        self.time_replays = time_replays and self.session.runner is not None
        if self.time_replays:
            self._time_replays(self.session.runner)
        if trace_calls:
            self.session.enable_call_traces(max_calls=None)

    def _time_replays(self, runner) -> None:
        # Bracket every graph replay with device synchronisations (only under --time-replays: the extra
        # syncs cost a little) so a decode call splits into replay time and host time around it.
        replay = runner.decode

        def timed(codes, lengths, slot_ids):
            torch.cuda.synchronize(codes.device)
            t0 = time.perf_counter()
            out = replay(codes, lengths, slot_ids)
            torch.cuda.synchronize(codes.device)
            self.replay_s += time.perf_counter() - t0
            return out

        runner.decode = timed

    def take_replay_seconds(self) -> float | None:
        """Graph replay seconds since the last call (None without --time-replays)."""
        if not self.time_replays:
            return None
        seconds, self.replay_s = self.replay_s, 0.0
        return seconds

    def take_call_trace(self):
        """The last decode call's ``CallTrace`` (None without --trace-calls); earlier ones are dropped."""
        traces = self.session.call_traces
        if not traces:
            return None
        trace = traces[-1]
        traces.clear()
        return trace

    def reset_state_peak(self) -> None:
        self.peak_state = self.state_now = self.session.pool.state_in_use_bytes()

    def state_peak_bytes(self) -> int:
        """Most state the live streams needed at the end of any decode call since :meth:`reset_state_peak`."""
        return int(self.peak_state)

    def state_bytes_now(self) -> int:
        """Bytes of state the live streams needed at the end of the last decode call."""
        return int(self.state_now)

    def decode(self, chunks: list[upstream_stage.StageChunk]) -> dict[str, torch.Tensor | None]:
        """Audio per request id decoded in this call (a stream resumed from the queue may return several
        chunks at once, or come back without a chunk in ``chunks``); None for a chunk left queued (its
        stream waits for a slot or state pages)."""
        results = self.session.decode([ChunkRequest(c.request_id, c.codes, c.finished) for c in chunks])
        self.state_now = self.session.pool.state_in_use_bytes()
        self.peak_state = max(self.peak_state, self.state_now)
        out: dict[str, torch.Tensor | None] = {}
        for rid, result in results.items():
            if result.error is not None:
                raise RuntimeError(f"{rid}: the session refused the chunk: {result.error}")
            out[rid] = None if result.queued and result.frames == 0 else result.audio
        return out

    def idle(self) -> bool:
        """No stream waits for the session (nothing queued to resume)."""
        return not self.session.waiting_requests

    def abort(self, request_ids: list[str]) -> None:
        self.session.on_requests_finished(request_ids)

    def stats(self) -> dict[str, Any]:
        return self.session.stats()

    def describe(self) -> dict[str, Any]:
        runner = self.session.runner
        return {
            "slots": int(self.session.pool.num_slots),
            "state_bytes": int(self.session.pool.state_bytes()),
            "graphs": len(runner.graphs) if runner is not None else 0,
        }

    def close(self) -> None:
        self.session.close()


class UpstreamArm:
    """Upstream's model under :class:`upstream_stage.UpstreamStage`, behind the same interface as :class:`OurArm`."""

    def __init__(self, model, concurrency: int, graphs: bool, chunk_sizes: list[int], n_vq: int, spf: int):
        self.stage = upstream_stage.UpstreamStage(
            model,
            concurrency,
            graph_batch_sizes=graph_batch_sizes(concurrency) if graphs else (),
            graph_frame_sizes=sorted(set(chunk_sizes)),
            n_vq=n_vq,
            # Upstream cuts chunks longer than the connector's codec_chunk_frames (the steady size).
            max_step_frames=chunk_sizes[-1],
            samples_per_frame=spf,
        )
        self._state_bytes: int | None = None

    def decode(self, chunks):
        return self.stage.decode(chunks)

    def take_replay_seconds(self) -> float | None:
        return None  # --time-replays times our session only

    def take_call_trace(self):
        return None  # --trace-calls traces our session only

    def abort(self, request_ids):
        self.stage.release(request_ids)

    def stats(self):
        return self.stage.stats()

    def idle(self) -> bool:
        return True

    def reset_state_peak(self) -> None:
        pass  # upstream's pool holds full rings for every slot from the start

    def state_peak_bytes(self) -> int:
        return self.state_bytes_now()

    def state_bytes_now(self) -> int:
        """Upstream's pool holds full rings for every slot: its state bytes at any time."""
        if self._state_bytes is None:
            self._state_bytes = common.upstream_state_bytes(self.stage.model)
        return self._state_bytes

    def describe(self) -> dict[str, Any]:
        stage = self.stage
        return {
            "slots": stage.num_slots,
            "state_bytes": common.upstream_state_bytes(stage.model),
            "graphs": len(stage.graphs),
            "graph_failures": {f"{b}x{t}": err for (b, t), err in stage.graph_failures.items()},
            "pad_tails": stage.pad_tails,
        }

    def close(self):
        self.stage.close()


# ------------------------------------------------------------------------------------------ one run


@dataclass
class Run:
    """Raw outcome of one (arm, concurrency): latencies in seconds, step walls in seconds."""

    codec_latency: list[float] = field(default_factory=list)
    first_latency: list[float] = field(default_factory=list)
    step_wall: list[float] = field(default_factory=list)
    step_chunks: list[int] = field(default_factory=list)  # chunks decoded by each step
    step_frames: list[int] = field(default_factory=list)  # frames of each step's longest chunk
    step_replay: list[float] = field(default_factory=list)  # graph replay seconds of each step (--time-replays)
    step_trace: list[Any] = field(default_factory=list)  # session.CallTrace of each step (--trace-calls)
    state_trace: list[tuple[float, int]] = field(default_factory=list)  # (clock s, state bytes) after each step
    serving_s: float = 0.0
    audio_s: float = 0.0
    finished_requests: int = 0
    stopped_early: bool = False


def warm_up(arm, concurrency: int, chunk_sizes: list[int], n_vq: int, codebook_size: int) -> None:
    """Untimed: every chunk size once for ``concurrency`` streams, then abort them (first-call costs)."""
    gen = torch.Generator().manual_seed(12345)
    ids = [f"warmup-{i}" for i in range(concurrency)]
    for size in sorted(set(chunk_sizes)):
        codes = torch.randint(0, codebook_size, (n_vq, size), generator=gen)
        arm.decode([upstream_stage.StageChunk(rid, codes) for rid in ids])
    arm.abort(ids)


def simulate(arm, trace: Trace, concurrency: int, chunk_sizes: list[int], cfg, args, device, label: str) -> Run:
    from tqdm import tqdm

    n = len(trace.lengths)
    schedules = [ramp_schedule(int(t), chunk_sizes) for t in trace.lengths]
    waiting = deque(range(n))
    ready: list[tuple[float, int, int]] = []  # (time its last frame was generated, request, chunk index)
    start: dict[int, float] = {}
    run = Run()
    clock = 0.0
    give_up = args.give_up_ms / 1e3

    def admit(now: float) -> None:
        while waiting and len(start) - run.finished_requests < concurrency:
            r = waiting.popleft()
            start[r] = now
            heapq.heappush(ready, (now + schedules[r][0][1] / FRAME_RATE, r, 0))

    admit(0.0)
    bar = tqdm(total=n, desc=label, unit="req", disable=args.quiet, leave=False)
    pending: dict[int, deque] = {}  # request -> chunks sent and not yet decoded: (ready time, index, frames)
    while ready or not arm.idle():
        if ready:
            clock = max(clock, ready[0][0])  # idle until the next chunk's last frame is generated
        batch = []
        while ready and ready[0][0] <= clock:
            batch.append(heapq.heappop(ready))
        chunks = []
        for _, r, k in batch:
            a, b = schedules[r][k]
            chunks.append(upstream_stage.StageChunk(f"req-{r}", trace.codes[r][:, a:b], k == len(schedules[r]) - 1))
        t0 = time.perf_counter()
        audio = arm.decode(chunks)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        run.step_wall.append(wall)
        run.step_chunks.append(len(chunks))
        run.step_frames.append(max((chunk.frames for chunk in chunks), default=0))
        replay = arm.take_replay_seconds()
        if replay is not None:
            run.step_replay.append(replay)
        call_trace = arm.take_call_trace()
        if call_trace is not None:
            run.step_trace.append(call_trace)
        clock += wall
        run.state_trace.append((clock, arm.state_bytes_now()))
        missing = {c.request_id for c in chunks} - set(audio)
        if missing:
            raise AssertionError(f"{label}: no result for {sorted(missing)}")
        for (ready_at, r, k), chunk in zip(batch, chunks):
            pending.setdefault(r, deque()).append((ready_at, k, chunk.frames))
            if k + 1 < len(schedules[r]):  # the talker keeps generating whatever the codec does
                heapq.heappush(ready, (start[r] + schedules[r][k + 1][1] / FRAME_RATE, r, k + 1))
        latencies = []
        for rid, wav in audio.items():
            if wav is None:
                continue  # queued: its audio comes in a later call
            r = int(rid.removeprefix("req-"))
            frames = wav.shape[-1] // cfg.samples_per_frame
            if wav.shape[0] != cfg.number_channels or wav.shape[-1] != frames * cfg.samples_per_frame:
                raise AssertionError(f"{label} {rid}: audio {tuple(wav.shape)} is not whole frames")
            while frames > 0:
                if not pending.get(r):
                    raise AssertionError(f"{label} {rid}: audio for frames that were never sent")
                ready_at, k, chunk_frames = pending[r].popleft()
                frames -= chunk_frames
                run.audio_s += chunk_frames / FRAME_RATE
                latencies.append(clock - ready_at)
                if k == 0:
                    run.first_latency.append(clock - start[r])
                if k + 1 == len(schedules[r]):
                    run.finished_requests += 1
                    bar.update(1)
            if frames < 0:
                raise AssertionError(f"{label} {rid}: audio ends inside a chunk")
        if not batch and not latencies:
            raise AssertionError(f"{label}: streams wait in the session but nothing can be decoded")
        run.codec_latency += latencies
        if latencies and max(latencies) > give_up:
            run.stopped_early = True
            break
        oldest = min((q[0][0] for q in pending.values() if q), default=None)
        if oldest is not None and clock - oldest > give_up:  # a chunk queued for too long
            run.stopped_early = True
            break
        admit(clock)
    bar.close()
    run.serving_s = clock
    return run


# ------------------------------------------------------------------------------------------ figures


def _pct(values: list[float], q: float, scale: float = 1e3) -> float | None:
    return round(float(np.percentile(np.asarray(values), q)) * scale, 3) if values else None


def summarize(run: Run, stats: dict[str, Any], peak: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the exact-key figures of ``arms.<arm>.<C>``, the run's details)."""
    decoded, padded = int(stats["decoded_frames"]), int(stats["padded_frames"])
    figures = {
        "audio_seconds_per_second": round(run.audio_s / run.serving_s, 4) if run.serving_s > 0 else None,
        "codec_latency_ms": {f"p{q}": _pct(run.codec_latency, q) for q in (50, 95, 99)},
        "first_chunk_latency_ms": {f"p{q}": _pct(run.first_latency, q) for q in (50, 99)},
        "steps_by_path": {path: int(stats["steps_by_path"][path]) for path in ("graph", "eager")},
        "padded_frame_fraction": round(padded / (decoded + padded), 6) if decoded + padded else 0.0,
        "peak_memory_bytes": peak,
    }
    walls = run.step_wall
    details = {
        "finished_requests": run.finished_requests,
        "chunks": len(run.codec_latency),
        "steps": len(walls),
        "stopped_early": run.stopped_early,
        "serving_seconds": round(run.serving_s, 4),
        "codec_busy_seconds": round(sum(walls), 4),
        "audio_seconds": round(run.audio_s, 4),
        "decoded_frames": decoded,
        "padded_frames": padded,
        "step_ms": {"p50": _pct(walls, 50), "p99": _pct(walls, 99), "max": round(max(walls) * 1e3, 3)},
    }
    slowest = int(np.argmax(walls))
    if slowest < len(run.step_chunks):
        details["slowest_step"] = {"chunks": run.step_chunks[slowest], "max_frames": run.step_frames[slowest]}
    if run.step_replay and len(run.step_replay) == len(walls):
        # Per decode call: graph replay time and the host time around it (call wall minus replay).
        host = [w - r for w, r in zip(walls, run.step_replay)]
        details["replay_ms"] = {"p50": _pct(run.step_replay, 50), "p99": _pct(run.step_replay, 99)}
        details["host_ms"] = {"p50": _pct(host, 50), "p99": _pct(host, 99)}
        details["slowest_step"]["replay_ms"] = round(run.step_replay[slowest] * 1e3, 3)
    if run.step_trace and len(run.step_trace) == len(walls):
        traces = [asdict(t) for t in run.step_trace]
        phases = [k for k, v in traces[0].items() if k.endswith("_ms")]
        details["call_trace_ms"] = {
            k: {f"p{q}": _pct([t[k] for t in traces], q, 1.0) for q in (50, 99)} for k in phases
        }
        details["slowest_step"]["trace"] = {
            k: round(v, 3) if k.endswith("_ms") else v for k, v in traces[slowest].items()
        }
    return figures, details


def downsample_max(points: list[tuple[float, int]], limit: int = STATE_TRACE_POINTS) -> list[list[float | int]]:
    """At most ``limit`` ``[seconds, bytes]`` pairs from ``points`` (in time order): the points are split into
    ``min(len(points), limit)`` runs of consecutive points (sizes differ by at most one) and each run gives
    its point of largest bytes (the first such), so the maximum, and the time it was reached, are kept."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    n = len(points)
    buckets = min(n, limit)
    out: list[list[float | int]] = []
    for i in range(buckets):
        run = points[i * n // buckets : (i + 1) * n // buckets]
        seconds, value = max(run, key=lambda point: point[1])
        out.append([round(float(seconds), 4), int(value)])
    return out


def holds_slo(figures: dict[str, Any], details: dict[str, Any], slo_ms: float) -> bool:
    """``codec_latency_ms.p99 <= slo_ms`` over a whole run (a run stopped early or failed never holds it)."""
    p99 = figures["codec_latency_ms"]["p99"]
    complete = not details.get("stopped_early") and "error" not in details
    return complete and p99 is not None and p99 <= slo_ms


def max_streams_at_slo(
    per_concurrency: dict[str, dict[str, Any]], details: dict[str, dict[str, Any]], slo_ms: float
) -> int | None:
    """Largest swept concurrency (keys are decimal strings) that holds the SLO; None when none does."""
    held = [int(c) for c, figures in per_concurrency.items() if holds_slo(figures, details[c], slo_ms)]
    return max(held) if held else None


def stall_warning(arm: str, concurrency: int, details: dict[str, Any]) -> str | None:
    """A warning when the step-time max exceeds 10x its p50, naming the slowest step's batch: a stall of the
    machine when that batch is small, a burst of chunks decoded in one step when it is large."""
    step = details["step_ms"]
    if not (step["p50"] and step["max"] > 10 * step["p50"]):
        return None
    warning = f"warning: {arm} C={concurrency}: step time max {step['max']:.1f} ms > 10x its p50 {step['p50']:.1f} ms"
    slowest = details.get("slowest_step")
    if slowest is None:
        return warning + " (a stall of the machine, not the codec, is the likely cause)"
    return (
        f"{warning}; that step decoded {slowest['chunks']} chunks of up to {slowest['max_frames']} frames "
        "(a burst of chunks when that is most of the live streams, a stall of the machine when it is a few)"
    )


# ------------------------------------------------------------------------------------------ driver


def state_budget(args, name: str, decoder, concurrency: int) -> tuple[float | None, int | None, dict | None]:
    """(page_fraction, slots, paged_budget) of one of our arms at ``concurrency`` streams: ``--page-fraction``
    and one slot per stream without ``--state-budget-gib``; with it, the unpaged arms as many slots as the
    budget buys (the other streams wait in the session's queue) and the paged arm the budget itself, as the
    session's ``state_budget_bytes`` (the pool pays its null pages from it and splits the rest uniformly, or by
    the groups' fill with ``--expected-stream-seconds``). Raises SystemExit for a budget below one slot, and
    for the paged arm below what its pool needs (one stream's rings plus the null pages; the pool's message
    names the minimum). Runs of earlier arms are already in ``results.json`` then."""
    paged = name == "v2-paged"
    if args.state_budget_gib is None:
        return (args.page_fraction if paged else None), None, None
    slot_bytes = decoder.config.state_bytes_per_slot(torch.empty((), dtype=decoder.state_dtype).element_size())
    budget = args.state_budget_gib * 2**30
    if budget < slot_bytes:
        raise SystemExit(f"--state-budget-gib {args.state_budget_gib} is below one stream's rings ({slot_bytes} bytes)")
    if paged:
        frames = None
        if args.expected_stream_seconds is not None:
            frames = max(1, round(args.expected_stream_seconds * FRAME_RATE))
        # The pool's own check (nothing is allocated before initialize).
        pool = make_state_pool(decoder, "paged", state_budget_bytes=int(budget))
        try:
            pool.page_fraction_for_budget(int(budget), concurrency)
        except ValueError as exc:
            raise SystemExit(f"--state-budget-gib {args.state_budget_gib} for {name}: {exc}") from None
        return None, None, {"state_budget_bytes": int(budget), "expected_stream_frames": frames}
    return None, min(concurrency, int(budget // slot_bytes)), None


def _arm_factory(name: str, args, device, cfg, chunk_sizes: list[int], models: dict[str, Any]):
    graphs = device.type == "cuda" and not args.eager
    if name in ("v2", "legacy", "v2-paged"):
        if "ours" not in models:
            models.clear()  # one arm's weights on the device at a time
            common.free_memory(device)
            models["ours"] = common.random_decoder(args.preset, device, seed=args.seed)
        decoder = models["ours"]

        def make(c: int) -> OurArm:
            fraction, slots, budget = state_budget(args, name, decoder, c)
            return OurArm(
                decoder,
                c,
                name,
                graphs,
                chunk_sizes,
                args.n_vq,
                args.time_replays,
                fraction,
                slots,
                budget,
                args.trace_calls,
            )

        return make
    if "upstream" not in models:
        models.clear()
        common.free_memory(device)
        codec = common.build_upstream_codec(args.preset, device, args.seed, args.n_vq)
        if device.type == "cuda":
            switched = upstream_stage.enable_triton_attention(
                codec.model, codec.module.MossAudioTokenizerMultiheadAttention, common.oracle.upstream_dir()
            )
            print(f"upstream: Triton masked attention on {switched} decoder attention modules")
        models["upstream"] = codec
    model = models["upstream"].model
    return lambda c: UpstreamArm(model, c, graphs, chunk_sizes, args.n_vq, cfg.samples_per_frame)


def run_arm(name: str, make_arm, trace: Trace, concurrency: int, chunk_sizes, cfg, args, device):
    t0 = time.perf_counter()
    arm = make_arm(concurrency)
    try:
        warm_up(arm, concurrency, chunk_sizes, args.n_vq, cfg.codebook_size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        setup_s = time.perf_counter() - t0
        described = arm.describe()
        arm.reset_state_peak()
        before = arm.stats()
        run = simulate(arm, trace, concurrency, chunk_sizes, cfg, args, device, f"{name} C={concurrency}")
        after = arm.stats()
        described["peak_state_bytes"] = arm.state_peak_bytes()
        peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    finally:
        arm.close()
        del arm
        common.free_memory(device)
    delta = {
        "steps_by_path": {p: after["steps_by_path"][p] - before["steps_by_path"][p] for p in ("graph", "eager")},
        "decoded_frames": after["decoded_frames"] - before["decoded_frames"],
        "padded_frames": after["padded_frames"] - before["padded_frames"],
    }
    preempted = after.get("preemptions", 0) - before.get("preemptions", 0)  # our sessions count them
    figures, details = summarize(run, delta, peak)
    details["setup_seconds"] = round(setup_s, 3)
    details["preemptions"] = preempted
    details.update(described)
    details["state_bytes_over_time"] = downsample_max(run.state_trace)
    return figures, details, run


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="auto", help="codec geometry; auto = v2 on CUDA, tiny-v2 on CPU")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument(
        "--arms",
        default="auto",
        help="subset of v2,legacy,upstream,v2-paged (default: every arm that can run but v2-paged)",
    )
    p.add_argument("--concurrency", default="auto", help="live streams per run, e.g. 64,128,256,512 (CPU: 4,8)")
    p.add_argument("--requests-per-stream", type=int, default=17, help="requests = concurrency x this (17)")
    p.add_argument("--chunks", default="1,15", help="chunk ramp in frames: each once, the last repeated (1,15)")
    p.add_argument("--n-vq", type=int, default=12, help="codebooks per frame (MOSS-TTS-Local: 12)")
    p.add_argument("--slo-ms", type=float, default=150.0, help="codec-added latency p99 bound (150 ms)")
    p.add_argument("--give-up-ms", type=float, default=5000.0, help="stop a run once a chunk waits this long")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (every arm)")
    p.add_argument(
        "--state-budget-gib",
        type=float,
        default=None,
        help="decoder state memory per arm (our arms): the slots (v2, legacy) or pages (v2-paged) it buys",
    )
    p.add_argument(
        "--expected-stream-seconds",
        type=float,
        default=None,
        help="v2-paged with --state-budget-gib: split the budget by the groups' fill over a stream this long",
    )
    p.add_argument(
        "--page-fraction",
        type=float,
        default=1.0,
        help="v2-paged: state pages as a fraction of full rings for every slot (1.0: never preempts)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/bench_codec_stage", help="output directory")
    p.add_argument(
        "--append",
        action="store_true",
        help="add these runs to --out's results (same commit and settings): a sweep split over several commands",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rewrite results.md and the plots from --out's results.json and latencies.npz",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--time-replays",
        action="store_true",
        help="CUDA, our arms: time each graph replay between device syncs; details gain replay_ms and host_ms",
    )
    p.add_argument(
        "--trace-calls",
        action="store_true",
        help="our arms: each decode call's host time by phase; details gain call_trace_ms and slowest_step.trace",
    )
    args = p.parse_args(argv)
    if args.requests_per_stream < 1 or args.n_vq < 1:
        p.error("--requests-per-stream and --n-vq must be >= 1")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.give_up_ms <= args.slo_ms:
        p.error("--give-up-ms must exceed --slo-ms (a run is only stopped once it has missed the SLO)")
    if args.preset != "auto" and args.preset not in PRESETS:
        p.error(f"--preset must be auto or one of {sorted(PRESETS)}")
    # Checked here, before any arm runs and writes results: the pools would refuse them only when built.
    if not 0.0 < args.page_fraction <= 1.0:
        p.error(f"--page-fraction must be in (0, 1], got {args.page_fraction}")
    for name in ("state_budget_gib", "expected_stream_seconds"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            p.error(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if not (math.isfinite(args.slo_ms) and args.slo_ms > 0):
        p.error(f"--slo-ms must be a positive number, got {args.slo_ms}")
    return args


def _select_arms(args, cfg, device) -> tuple[list[str], dict[str, str]]:
    names = list(AUTO_ARMS) if args.arms == "auto" else common.parse_str_list(args.arms, ARMS)
    skipped: dict[str, str] = {}
    for name in ("v2", "v2-paged"):
        if name in names and cfg.version != "v2":
            skipped[name] = f"preset {args.preset!r} is a {cfg.version} codec; the compact pool serves v2 codecs"
    if "upstream" in names:
        ok, reason = common.upstream_status(args.preset, device)
        directory = common.oracle.upstream_dir()
        if ok and device.type == "cuda" and not (directory / "streaming_attention.py").is_file():
            ok, reason = False, f"{directory}/streaming_attention.py (the triton attention backend) not found"
        if not ok:
            skipped["upstream"] = reason
    return [a for a in names if a not in skipped], skipped


def _run_header(args, device, chunk_sizes: list[int], concurrencies: list[int], skipped, command) -> dict[str, Any]:
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit, command = common.git_commit(), shlex.join(command)
    return {
        "date": date,
        "commit": commit,
        "command": command,
        "invocations": [{"date": date, "commit": commit, "command": command}],
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        "n_vq": args.n_vq,
        "seed": args.seed,
        "chunks": chunk_sizes,
        "cuda_graphs": device.type == "cuda" and not args.eager,
        "graph_frame_sizes": sorted(set(chunk_sizes)),
        "graph_batch_sizes": {str(c): graph_batch_sizes(c) for c in concurrencies},
        "concurrency": concurrencies,
        "requests_per_stream": args.requests_per_stream,
        "requests": {str(c): c * args.requests_per_stream for c in concurrencies},
        "length_model": LENGTH_MODEL,
        "frame_rate": FRAME_RATE,
        "slo": {"codec_latency_p99_ms": args.slo_ms},
        "give_up_ms": args.give_up_ms,
        # Settings that change what our arms run or how they are timed.
        "state_budget_gib": args.state_budget_gib,
        "expected_stream_seconds": args.expected_stream_seconds,
        "page_fraction": args.page_fraction,
        "time_replays": args.time_replays,
        "trace_calls": args.trace_calls,
        "skipped": skipped,
    }


# Run settings that must agree before --append merges a new invocation into an existing results.json.
_SAME_RUN_KEYS = (
    "commit",
    "device_name",
    "preset",
    "n_vq",
    "seed",
    "chunks",
    "cuda_graphs",
    "requests_per_stream",
    "length_model",
    "slo",
    "give_up_ms",
    "state_budget_gib",
    "expected_stream_seconds",
    "page_fraction",
    "time_replays",
    "trace_calls",
)


def _merge_previous(result: dict[str, Any], out: Path) -> dict[str, dict[int, np.ndarray]]:
    """``--append``: fold ``out``'s results.json (same settings and commit) into ``result``, in place.

    Returns the stored latencies (``latencies.npz``) of the previous invocations: arm -> C -> ms.
    Raises:
        SystemExit: no previous results, or settings that differ (named in the message).
    """
    path = out / "results.json"
    if not path.is_file():
        raise SystemExit(f"--append: {path} does not exist")
    previous = json.loads(path.read_text())
    run, old = result["run"], previous["run"]
    differ = [k for k in _SAME_RUN_KEYS if old.get(k) != run[k]]
    if differ:
        raise SystemExit(
            f"--append: {path} was made with other settings: "
            + ", ".join(f"{k} {old.get(k)!r} != {run[k]!r}" for k in differ)
        )
    run["invocations"] = old["invocations"] + run["invocations"]
    run["concurrency"] = sorted(set(old["concurrency"]) | set(run["concurrency"]))
    for key in ("graph_batch_sizes", "requests"):
        run[key] = {c: v for c, v in sorted({**old[key], **run[key]}.items(), key=lambda kv: int(kv[0]))}
    run["skipped"] = {**old["skipped"], **run["skipped"]}
    arms = list(dict.fromkeys([*previous["arms"], *result["arms"]]))
    result["arms"] = {arm: previous["arms"].get(arm, {}) for arm in arms}
    result["details"] = {arm: previous["details"].get(arm, {}) for arm in arms}
    result["warnings"] = previous["warnings"]
    return {arm: {} for arm in arms} | _load_latencies(out)


def _load_latencies(out: Path) -> dict[str, dict[int, np.ndarray]]:
    stored: dict[str, dict[int, np.ndarray]] = {}
    if (out / "latencies.npz").is_file():
        with np.load(out / "latencies.npz") as data:
            for key in data.files:
                arm, c = key.split("/")
                stored.setdefault(arm, {})[int(c)] = data[key]
    return stored


def _save_latencies(latencies: dict[str, dict[int, np.ndarray]], path: Path) -> None:
    arrays = {f"{arm}/{c}": values for arm, per_c in latencies.items() for c, values in per_c.items()}
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    command = [sys.executable, "benchmarks/tts/bench_codec_stage.py", *(sys.argv[1:] if argv is None else argv)]
    args = _parse(argv)
    out = Path(args.out)
    if args.report_only:
        if not (out / "results.json").is_file():
            raise SystemExit(f"--report-only: {out / 'results.json'} does not exist")
        result = json.loads((out / "results.json").read_text())
        _write_reports(result, _load_latencies(out), out)
        return result
    device = common.resolve_device(args.device)
    if args.preset == "auto":
        args.preset = "v2" if device.type == "cuda" else "tiny-v2"
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny kernels: a second intra-op thread only adds contention
    cfg = preset_config(args.preset)
    if args.n_vq > cfg.num_quantizers:
        raise SystemExit(f"--n-vq {args.n_vq} > the codec's {cfg.num_quantizers} codebooks")
    try:
        concurrencies = common.parse_int_list(
            DEFAULT_CONCURRENCY[device.type] if args.concurrency == "auto" else args.concurrency
        )
    except ValueError as exc:
        raise SystemExit(f"--concurrency {args.concurrency!r}: {exc}") from None
    try:
        chunk_sizes = [int(v) for v in args.chunks.split(",") if v.strip()]
    except ValueError:
        chunk_sizes = []
    if not chunk_sizes or min(chunk_sizes) < 1:
        raise SystemExit(f"--chunks must be positive frame counts, got {args.chunks!r}")
    try:
        arms, skipped = _select_arms(args, cfg, device)
    except ValueError as exc:
        raise SystemExit(f"--arms {args.arms!r}: {exc}") from None
    for arm, reason in skipped.items():
        print(f"skipped arm {arm}: {reason}")
    if not arms:
        raise SystemExit(f"no arm left to run ({'; '.join(f'{a}: {r}' for a, r in skipped.items())})")

    result: dict[str, Any] = {
        "run": _run_header(args, device, chunk_sizes, concurrencies, skipped, command),
        "arms": {arm: {} for arm in arms},
        "details": {arm: {} for arm in arms},
        "warnings": [],
    }
    # Codec-added latency of every chunk, ms, per arm and concurrency (for the CDF plot; latencies.npz).
    latencies: dict[str, dict[int, np.ndarray]] = {arm: {} for arm in arms}
    if args.append:
        latencies = _merge_previous(result, out)
    out.mkdir(parents=True, exist_ok=True)
    traces = {
        c: make_trace(c * args.requests_per_stream, args.n_vq, cfg.codebook_size, args.seed) for c in concurrencies
    }
    models: dict[str, Any] = {}
    t_all = time.perf_counter()
    for arm in arms:
        make_arm = _arm_factory(arm, args, device, cfg, chunk_sizes, models)
        for c in concurrencies:
            t_run = time.perf_counter()
            try:
                figures, details, run = run_arm(arm, make_arm, traces[c], c, chunk_sizes, cfg, args, device)
            except torch.cuda.OutOfMemoryError as exc:
                figures = _empty_figures()
                details, run = {"error": f"OutOfMemoryError: {str(exc)[:300]}"}, Run()
                common.free_memory(device)
            details["wall_seconds"] = round(time.perf_counter() - t_run, 1)  # setup, warm-up and run
            _record(result, arm, c, figures, details, args.slo_ms)
            latencies[arm][c] = np.asarray(run.codec_latency, dtype=np.float64) * 1e3
            common.write_json(out / "results.json", result)
            _save_latencies(latencies, out / "latencies.npz")
    models.clear()
    common.free_memory(device)
    result["run"]["invocations"][-1]["wall_seconds"] = round(time.perf_counter() - t_all, 1)
    common.write_json(out / "results.json", result)
    _write_reports(result, latencies, out)
    return result


def _write_reports(result: dict[str, Any], latencies: dict[str, dict[int, np.ndarray]], out: Path) -> None:
    md = results_markdown(result)
    (out / "results.md").write_text(md)
    plot_latency_cdf(result, latencies, out / "latency_cdf.png")
    plot_concurrency(result, out / "concurrency.png")
    plot_state_over_time(result, out / "state_over_time.png")
    print(md)
    print(f"wrote {out}/results.json, results.md, latencies.npz, latency_cdf.png, concurrency.png, state_over_time.png")


def _record(result: dict[str, Any], arm: str, c: int, figures, details, slo_ms: float) -> None:
    """Put one run's figures and details into ``result`` (C keys in increasing order), update the SLO line."""
    per_c = {**_per_c(result["arms"][arm]), str(c): figures}
    per_c = dict(sorted(per_c.items(), key=lambda kv: int(kv[0])))
    result["details"][arm] = dict(
        sorted({**result["details"][arm], str(c): details}.items(), key=lambda kv: int(kv[0]))
    )
    result["arms"][arm] = {**per_c, "max_streams_at_slo": max_streams_at_slo(per_c, result["details"][arm], slo_ms)}
    warning = stall_warning(arm, c, details) if "step_ms" in details else None
    if warning:
        print(warning)
        result["warnings"].append(warning)
    print(_progress_line(arm, c, figures, details, slo_ms), flush=True)


def _empty_figures() -> dict[str, Any]:
    return {
        "audio_seconds_per_second": None,
        "codec_latency_ms": {"p50": None, "p95": None, "p99": None},
        "first_chunk_latency_ms": {"p50": None, "p99": None},
        "steps_by_path": {"graph": 0, "eager": 0},
        "padded_frame_fraction": None,
        "peak_memory_bytes": None,
    }


def _per_c(arm_entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in arm_entry.items() if k != "max_streams_at_slo"}


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _progress_line(arm: str, c: int, f: dict[str, Any], d: dict[str, Any], slo_ms: float) -> str:
    if "error" in d:
        return f"{arm} C={c}: {d['error']}"
    lat = f["codec_latency_ms"]
    return (
        f"{arm} C={c}: codec p50/p99 {_fmt(lat['p50'])}/{_fmt(lat['p99'])} ms, "
        f"{_fmt(f['audio_seconds_per_second'], '.2f')} audio-s/s, steps graph/eager "
        f"{f['steps_by_path']['graph']}/{f['steps_by_path']['eager']}, SLO {'held' if holds_slo(f, d, slo_ms) else 'missed'}"
        + (" (stopped early)" if d.get("stopped_early") else "")
    )


def results_markdown(result: dict[str, Any]) -> str:
    run = result["run"]
    slo = run["slo"]["codec_latency_p99_ms"]
    lines = [
        f"# Codec stage under load: {run['preset']} codec geometry on {run['device_name']}",
        "",
        f"Commit `{run['commit']}`, {run['date']}. Command: `{run['command']}`.",
        "",
        f"{run['requests_per_stream']} requests per stream (requests = concurrency x that), chunks {run['chunks']} "
        f"(ramp, last repeated) at {run['frame_rate']} frames/s, n_vq {run['n_vq']}, CUDA graphs "
        f"{run['cuda_graphs']} (frame sizes {run['graph_frame_sizes']}). Lengths: {run['length_model']}.",
        f"SLO: codec-added latency p99 <= {slo:g} ms (every chunk, the first included).",
        "",
        "| arm | C | requests | audio-s/s | codec p50 / p95 / p99 ms | first chunk p50 / p99 ms | steps graph / eager "
        "| padded frames | peak GiB | peak state GiB | SLO |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, entry in result["arms"].items():
        for c, f in _per_c(entry).items():
            lat, first = f["codec_latency_ms"], f["first_chunk_latency_ms"]
            d = result["details"][arm][c]
            peak, peak_state = f["peak_memory_bytes"], d.get("peak_state_bytes")
            flags = "held" if holds_slo(f, d, slo) else "missed"
            if d.get("stopped_early"):
                flags += " (stopped early)"
            if "error" in d:
                flags = d["error"].split(":")[0]
            lines.append(
                f"| {arm} | {c} | {run['requests'][c]} | {_fmt(f['audio_seconds_per_second'], '.2f')} | "
                f"{_fmt(lat['p50'])} / {_fmt(lat['p95'])} / {_fmt(lat['p99'])} | "
                f"{_fmt(first['p50'])} / {_fmt(first['p99'])} | "
                f"{f['steps_by_path']['graph']} / {f['steps_by_path']['eager']} | "
                f"{_fmt(f['padded_frame_fraction'], '.3f')} | {_fmt(None if peak is None else common.gib(peak), '.2f')} "
                f"| {_fmt(None if peak_state is None else common.gib(peak_state), '.4g')} | {flags} |"
            )
    lines += ["", "| arm | max streams at SLO |", "|---|---|"]
    lines += [f"| {arm} | {entry.get('max_streams_at_slo')} |" for arm, entry in result["arms"].items()]
    for arm, reason in run["skipped"].items():
        lines += ["", f"Skipped arm `{arm}`: {reason}"]
    lines += [""] + [f"- {w}" for w in result["warnings"]]
    return "\n".join(lines).rstrip() + "\n"


# ------------------------------------------------------------------------------------------ plots


ARM_COLORS = {"v2": "tab:blue", "legacy": "tab:gray", "upstream": "tab:orange", "v2-paged": "tab:green"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log_axis(axis) -> None:
    """Plain numbers on a log axis, major ticks only (minor labels collide on short ranges)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot_latency_cdf(result: dict[str, Any], latencies: dict[str, dict[int, np.ndarray]], path: Path) -> None:
    """One panel per arm: the CDF of codec-added latency (ms) per concurrency, p50 and p99 marked."""
    plt = _pyplot()
    arms = list(latencies)
    fig, axes = plt.subplots(1, max(1, len(arms)), figsize=(5.2 * max(1, len(arms)), 4.0), squeeze=False)
    slo = result["run"]["slo"]["codec_latency_p99_ms"]
    for ax, arm in zip(axes[0], arms):
        for i, (c, values) in enumerate(sorted(latencies[arm].items())):
            if not len(values):
                continue
            ms = np.sort(values)
            y = np.arange(1, len(ms) + 1) / len(ms)
            (line,) = ax.plot(
                ms, y, drawstyle="steps-post", label=f"C={c}, {result['run']['requests'][str(c)]} requests"
            )
            for q, marker in ((50, "o"), (99, "^")):
                x = float(np.percentile(ms, q))
                ax.plot([x], [q / 100], marker=marker, color=line.get_color(), linestyle="none")
                ax.annotate(
                    f"p{q} {x:.0f}",
                    (x, q / 100),
                    textcoords="offset points",
                    xytext=(4, -10 - 9 * i),  # one label row per curve: close percentiles stay readable
                    fontsize=7,
                    color=line.get_color(),
                )
        ax.axvline(slo, color="tab:red", linestyle="--", linewidth=0.8, label=f"SLO p99 {slo:g} ms")
        ax.set_xscale("log")
        _log_axis(ax.xaxis)
        ax.set_xlabel("codec-added latency per chunk (ms, log)")
        ax.set_ylabel("fraction of chunks")
        concurrency = ",".join(str(c) for c in sorted(latencies[arm]))
        ax.set_title(
            f"{arm}: concurrency {concurrency}, {result['run']['requests_per_stream']} requests/stream", fontsize=9
        )
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"{result['run']['preset']} codec geometry on {result['run']['device_name']} (o = p50, ^ = p99)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_concurrency(result: dict[str, Any], path: Path) -> None:
    """Audio seconds per second and codec-added latency p50/p99 against concurrency, one line per arm."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4.0))
    slo = result["run"]["slo"]["codec_latency_p99_ms"]
    for arm, entry in result["arms"].items():
        per_c = {int(c): f for c, f in _per_c(entry).items()}
        cs = sorted(per_c)
        aps = [per_c[c]["audio_seconds_per_second"] for c in cs]
        (line,) = left.plot(
            cs, [np.nan if v is None else v for v in aps], marker="o", color=ARM_COLORS.get(arm), label=arm
        )
        for q, style in (("p50", ":"), ("p99", "-")):
            vals = [per_c[c]["codec_latency_ms"][q] for c in cs]
            right.plot(
                cs,
                [np.nan if v is None else v for v in vals],
                marker="o",
                linestyle=style,
                color=line.get_color(),
                label=f"{arm} {q}",
            )
    cs_all = result["run"]["concurrency"]
    left.plot(cs_all, cs_all, color="gray", linestyle="--", linewidth=0.8, label="C (real-time cap)")
    right.axhline(slo, color="tab:red", linestyle="--", linewidth=0.8, label=f"SLO p99 {slo:g} ms")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        _log_axis(ax.xaxis)
        ax.set_xticks(cs_all, [str(c) for c in cs_all])
        ax.set_xlabel("concurrency (live streams)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    left.set_ylabel("audio seconds per second")
    right.set_ylabel("codec-added latency (ms, log)")
    right.set_yscale("log")
    _log_axis(right.yaxis)
    requests = ", ".join(f"{c}: {n}" for c, n in result["run"]["requests"].items())
    left.set_title(f"throughput (requests per C: {requests})", fontsize=9)
    right.set_title(f"latency, {result['run']['requests_per_stream']} requests/stream", fontsize=9)
    fig.suptitle(f"{result['run']['preset']} codec geometry on {result['run']['device_name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_state_over_time(result: dict[str, Any], path: Path) -> None:
    """Decoder state in use (GiB) against the simulated clock (s): one panel per concurrency, one line per arm
    (``details.<arm>.<C>.state_bytes_over_time``; runs without it are left out)."""
    plt = _pyplot()
    cs = [str(c) for c in result["run"]["concurrency"]]
    fig, axes = plt.subplots(1, max(1, len(cs)), figsize=(5.2 * max(1, len(cs)), 4.0), squeeze=False)
    for ax, c in zip(axes[0], cs):
        for arm, per_c in result["details"].items():
            trace = per_c.get(c, {}).get("state_bytes_over_time")
            if not trace:
                continue
            seconds = [t for t, _ in trace]
            state = [common.gib(b) for _, b in trace]
            peak = common.gib(per_c[c].get("peak_state_bytes", max(b for _, b in trace)))
            ax.plot(
                seconds,
                state,
                drawstyle="steps-post",
                color=ARM_COLORS.get(arm),
                linestyle="--" if arm == "upstream" else "-",  # legacy's line may lie under it
                label=f"{arm} (peak {peak:.3g} GiB)",
            )
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("decoder state in use (GiB)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"C={c}, {result['run']['requests'].get(c, '?')} requests", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"decoder state in use: {result['run']['preset']} on {result['run']['device_name']}, "
        f"{result['run']['requests_per_stream']} requests per stream, concurrency {','.join(cs)}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
