# SPDX-License-Identifier: Apache-2.0
"""The arms of the stage benchmark behind one driver interface: ``decode(chunks) -> {request id: audio}``.

* :class:`OurArm` - this package's :class:`CodecStreamSession` (``v2``, ``legacy``, ``v2-paged``), steps shaped
  and CUDA graphs captured by the package's ladder (``graph_ladder.frame_totals`` of its slots x the largest
  chunk size).
* :class:`UpstreamArm` - vLLM-Omni 0.30.0's model under ``upstream_stage.UpstreamStage``, upstream's buckets.
* :class:`IdealArm` - no codec: zero audio of the right shape at once, and the driver adds no time for it.

Audio is float32 ``(channels, frames * samples_per_frame)`` per request id; state in bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import common
import torch
import upstream_stage

from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import frame_totals
from vllm_omni_moss.model_executor.models.moss_tts.serving import (
    ChunkRequest,
    CodecStreamSession,
    SessionOptions,
    collector_paused,
)
from vllm_omni_moss.model_executor.models.moss_tts.state import StateSpec, build_pool

from .trace import FRAME_RATE

__all__ = [
    "ARMS",
    "AUTO_ARMS",
    "OUR_ARMS",
    "UPSTREAM_H200_BATCH_SIZES",
    "IdealArm",
    "OurArm",
    "StatePlan",
    "UpstreamArm",
    "arm_builder",
    "state_plan",
    "upstream_batch_sizes",
]

ARMS = ("v2", "legacy", "upstream", "ideal", "v2-paged")
#: Arms of ``--arms auto`` (v2-paged only on request).
AUTO_ARMS = ("v2", "legacy", "upstream", "ideal")
#: Arms that are this package's session.
OUR_ARMS = ("v2", "legacy", "v2-paged")
# Stage 1's cudagraph_capture_sizes in upstream's moss_tts_local_h200.yaml (vLLM-Omni 0.30.0).
UPSTREAM_H200_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 256)


def upstream_batch_sizes(concurrency: int) -> list[int]:
    """Upstream's graph batch buckets at ``concurrency`` streams: its deploy file's sizes below it, then the
    concurrency itself (one bucket holds every live stream: upstream's 2N slots)."""
    return [b for b in UPSTREAM_H200_BATCH_SIZES if b < concurrency] + [concurrency]


class Arm:
    """Defaults of the driver interface; ``timed`` False: the driver adds no time for a decode call."""

    timed = True
    ladder: list[int] = []

    def take_replay_seconds(self) -> float | None:
        return None  # --time-replays times our session only

    def take_call_trace(self):
        return None  # --trace-calls traces our session only

    def idle(self) -> bool:
        """No stream waits inside the arm (nothing queued to resume)."""
        return True

    def reset_state_peak(self) -> None:
        pass

    def state_peak_bytes(self) -> int:
        return self.state_bytes_now()

    def state_bytes_now(self) -> int:
        return 0


class IdealArm(Arm):
    """Zero audio for every chunk at once; no weights, no state. Its stalls are the schedule's and the talker's."""

    timed = False

    def __init__(self, concurrency: int, channels: int, samples_per_frame: int, max_frames: int):
        self.concurrency = int(concurrency)
        self.samples_per_frame = int(samples_per_frame)
        self._zeros = torch.zeros(int(channels), int(max_frames) * self.samples_per_frame)
        self.decoded_frames = 0

    def decode(self, chunks: list[upstream_stage.StageChunk]) -> dict[str, torch.Tensor]:
        self.decoded_frames += sum(c.frames for c in chunks)
        return {c.request_id: self._zeros[:, : c.frames * self.samples_per_frame] for c in chunks}

    def abort(self, request_ids: list[str]) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {"steps_by_path": {"graph": 0, "eager": 0}, "decoded_frames": self.decoded_frames, "padded_frames": 0}

    def describe(self) -> dict[str, Any]:
        return {"slots": self.concurrency, "state_bytes": 0, "graphs": 0}

    def close(self) -> None:
        self._zeros = torch.zeros(0)


@dataclass(frozen=True)
class StatePlan:
    """How one of our arms holds its decoder state at one concurrency.

    ``slots``: the session's live slots; ``page_fraction``: the paged pool's fraction of full rings (no
    budget); ``paged_budget``: the paged pool's ``state_budget_bytes`` (bytes) and ``expected_stream_frames``.
    """

    slots: int
    page_fraction: float | None = None
    paged_budget: dict[str, int | None] | None = None


def _pool_bytes(meta_decoder, kind: str, dtype: torch.dtype, slots: int, graphs: bool) -> int:
    """Bytes of the pool a session of ``slots`` slots allocates (on the meta device: nothing is allocated)."""
    pool = build_pool(meta_decoder, StateSpec.from_options(meta_decoder, kind, dtype))
    scratch = pool.scratch_slots_for(slots) if graphs else 0
    pool.initialize(slots, scratch)
    try:
        return int(pool.state_bytes())
    finally:
        pool.close()


def state_plan(
    name: str,
    concurrency: int,
    *,
    meta_decoder,
    state_dtype: torch.dtype,
    graphs: bool,
    budget_gib: float | None = None,
    page_fraction: float = 1.0,
    expected_stream_seconds: float | None = None,
) -> StatePlan:
    """The :class:`StatePlan` of arm ``name`` at ``concurrency`` streams, checked against the pools' own rules.

    Without a budget: one slot per stream (the paged arm at ``page_fraction``). With ``budget_gib``: the
    unpaged arms the most slots (at most ``concurrency``) whose whole pool, null or scratch slots and
    offsets included, fits the budget (the other streams wait in the session's queue); the paged arm the
    budget itself (the pool pays its null pages from it and splits the rest uniformly, or by the groups'
    fill over ``expected_stream_seconds``). ``meta_decoder`` is the arm's decoder on the meta device.

    Raises:
        ValueError: a budget below one stream's pool, or a page fraction or budget the paged pool refuses
            (its message names the minimum).
    """
    if name == "v2-paged":
        kwargs: dict[str, Any] = {"page_fraction": page_fraction}
        if budget_gib is not None:
            frames = None if expected_stream_seconds is None else max(1, round(expected_stream_seconds * FRAME_RATE))
            kwargs = {"state_budget_bytes": int(budget_gib * 2**30), "expected_stream_frames": frames}
        pool = build_pool(meta_decoder, StateSpec.from_options(meta_decoder, "paged", state_dtype, **kwargs))
        pool.initialize(concurrency, 0)  # raises for too few pages
        pool.close()
        if budget_gib is None:
            return StatePlan(concurrency, page_fraction=page_fraction)
        return StatePlan(concurrency, paged_budget=kwargs)
    if budget_gib is None:
        return StatePlan(concurrency)
    kind, budget = common.pool_kind(name), budget_gib * 2**30
    low, high = 0, concurrency  # low slots fit (0 trivially), find the most
    while low < high:
        mid = (low + high + 1) // 2
        if _pool_bytes(meta_decoder, kind, state_dtype, mid, graphs) <= budget:
            low = mid
        else:
            high = mid - 1
    if low == 0:
        need = _pool_bytes(meta_decoder, kind, state_dtype, 1, graphs)
        raise ValueError(f"is below one stream's pool ({need} bytes for one slot of the {kind} pool)")
    return StatePlan(low)


class OurArm(Arm):
    """Our session, built as our stage builds it (``stage.py``): graph frame sizes = the schedule's distinct chunk
    sizes, frame totals ``frame_totals(slots x the largest)`` where graphs are (steps pad to them and replay
    their graphs; without graphs every step is shaped exactly), ``max_step_frames`` = the largest chunk size."""

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
        paged_budget: dict[str, int | None] | None = None,
        trace_calls: bool = False,
    ):
        self.replay_s = 0.0
        self.peak_state = self.state_now = 0
        slots = concurrency if slots is None else slots
        self.ladder = frame_totals(slots * max(chunk_sizes))
        spec = StateSpec.from_options(
            decoder,
            kind=None if kind == "v2" else common.pool_kind(kind),
            page_fraction=page_fraction,
            **(paged_budget or {}),
        )
        options = SessionOptions(
            slots,
            n_vq=n_vq,
            graph_frame_totals=tuple(self.ladder) if graphs else (),
            graph_frame_sizes=tuple(sorted(set(chunk_sizes))),
            max_step_frames=max(chunk_sizes),
            # Streams beyond the slots, and paged streams preempted short of pages, wait in the session's queue.
            max_waiting_streams=concurrency,
            max_waiting_frames=1 << 30,
        )
        self.session = CodecStreamSession(decoder, spec, options)
        self.time_replays = time_replays and self.session.runner is not None
        if self.time_replays:
            self._time_replays(self.session.runner)
        if trace_calls:
            self.session.enable_call_traces(max_calls=None)

    def _time_replays(self, runner) -> None:
        # Bracket every graph replay with device synchronisations (only under --time-replays: the extra
        # syncs cost a little) so a decode call splits into replay time and host time around it. The session
        # stages a step's inputs into the graph's buffers, then calls the runner's replay (serving/step_runner.py).
        replay, device = runner.replay, self.session.device

        def timed(shape):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = replay(shape)
            torch.cuda.synchronize(device)
            self.replay_s += time.perf_counter() - t0
            return out

        runner.replay = timed

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
        with collector_paused():  # as the stage's forward(): no collection anywhere in the call
            return self._results(self.session.decode([ChunkRequest(c.request_id, c.codes, c.finished) for c in chunks]))

    def _results(self, results) -> dict[str, torch.Tensor | None]:
        self.state_now = self.session.pool.state_in_use_bytes()
        self.peak_state = max(self.peak_state, self.state_now)
        out: dict[str, torch.Tensor | None] = {}
        for rid, result in results.items():
            if result.error is not None:
                raise RuntimeError(f"{rid}: the session refused the chunk: {result.error}")
            out[rid] = None if result.queued and result.frames == 0 else result.audio
        return out

    def idle(self) -> bool:
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
            "graph_memory_bytes": int(runner.memory_bytes) if runner is not None else 0,
            "graph_capture_seconds": round(runner.capture_seconds, 3) if runner is not None else 0.0,
        }

    def close(self) -> None:
        self.session.close()


class UpstreamArm(Arm):
    """Upstream's model under :class:`upstream_stage.UpstreamStage`, upstream's graph buckets."""

    def __init__(self, model, concurrency: int, graphs: bool, chunk_sizes: list[int], n_vq: int, spf: int):
        self.ladder = upstream_batch_sizes(concurrency)
        self.stage = upstream_stage.UpstreamStage(
            model,
            concurrency,
            graph_batch_sizes=self.ladder if graphs else (),
            graph_frame_sizes=sorted(set(chunk_sizes)),
            n_vq=n_vq,
            # Upstream cuts chunks longer than the connector's codec_chunk_frames (the steady size).
            max_step_frames=chunk_sizes[-1],
            samples_per_frame=spf,
        )
        self._state_bytes: int | None = None

    def decode(self, chunks):
        return self.stage.decode(chunks)

    def abort(self, request_ids):
        self.stage.release(request_ids)

    def stats(self):
        return self.stage.stats()

    def state_bytes_now(self) -> int:
        """Upstream's pool holds full rings for every slot from the start: its state bytes at any time."""
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


def arm_builder(name: str, settings, models: dict[str, Any]) -> Callable[[int, list[int]], Arm]:
    """A function ``(concurrency, chunk sizes) -> arm`` for arm ``name``. Weights are built on first use and
    kept in ``models`` (one arm's weights on the device at a time)."""
    device, cfg = settings.device, settings.cfg
    graphs = device.type == "cuda" and not settings.args.eager
    if name == "ideal":
        return lambda c, sizes: IdealArm(c, cfg.number_channels, cfg.samples_per_frame, max(sizes))
    key = "ours" if name in OUR_ARMS else "upstream"
    if key not in models:
        models.clear()
        common.free_memory(device)
        models[key] = _build_weights(key, settings)
    if key == "upstream":
        model = models[key].model
        return lambda c, sizes: UpstreamArm(model, c, graphs, sizes, settings.n_vq, cfg.samples_per_frame)
    decoder, args = models[key], settings.args

    def make(c: int, sizes: list[int]) -> OurArm:
        plan = settings.plans[(name, c)]
        return OurArm(
            decoder,
            c,
            name,
            graphs,
            sizes,
            settings.n_vq,
            args.time_replays,
            plan.page_fraction,
            plan.slots,
            plan.paged_budget,
            args.trace_calls,
        )

    return make


def _build_weights(key: str, settings):
    args, device = settings.args, settings.device
    if key == "ours":
        return common.random_decoder(settings.preset, device, seed=args.seed)
    codec = common.build_upstream_codec(settings.preset, device, args.seed, settings.n_vq)
    if device.type == "cuda":
        switched = upstream_stage.enable_triton_attention(
            codec.model, codec.module.MossAudioTokenizerMultiheadAttention, common.oracle.upstream_dir()
        )
        print(f"upstream: Triton masked attention on {switched} decoder attention modules")
    return codec
