# SPDX-License-Identifier: Apache-2.0
"""Streaming session: many request streams multiplexed onto one decoder state pool.

The Stage-1 codec receives, per engine step, one chunk of codes per request
(docs/serving.md). :class:`CodecStreamSession` turns such a batch into pool steps and
keeps the request bookkeeping a pool does not know about; the pool owns the slots.

* **Streams.** A request holds one pool slot from its first chunk with codes to its
  terminal chunk (``finished=True``) or an abort (:meth:`on_requests_finished`). A
  chunk for a request id that is not live starts a fresh stream; a zero-frame chunk
  of an id that is not live decodes nothing. While a stream that got its terminal
  chunk still waits for a slot, a chunk with codes under its id gets an error (it
  neither joins the ended stream nor drops it).
* **One step per batch.** Every ready chunk is decoded in the same pool step: the
  step's ``T`` is the smallest graph frame size ``>=`` the longest chunk, shorter
  chunks are padded to it and marked by their length (padding frames change no state,
  so tails are exact), and on CUDA the step replays one captured graph. Chunks longer
  than the largest graph frame size (or ``max_step_frames`` without graph frame sizes)
  are cut into pieces decoded in consecutive steps together with the other rows'
  pieces. Batches larger than the largest graph bucket are split into steps of that
  size. Steps are planned the same way on every device; only CUDA replays graphs.
* **Admission.** New streams beyond the free slots wait in a FIFO queue: their chunks
  are buffered in order and decoded once a slot frees (in the :meth:`decode` call that
  frees it, or a later one); their audio is returned by that call, under their
  request id, even when the request is not in that call's batch. The queue is bounded
  by ``max_waiting_streams`` streams and ``max_waiting_frames`` buffered frames; past
  either bound the request alone gets an error and its buffered chunks are dropped.
  Live streams always decode.
* **Errors.** A request whose chunk is malformed (codes that are not an integer
  ``(n_vq, T)`` tensor, an empty id) gets a :class:`ChunkResult` with ``error`` set and
  nothing of its stream changes; the other requests of the batch decode normally.
  A batch holding the same request id twice is refused whole (``ValueError``) before
  anything changes. Codes outside ``[0, codebook_size)`` are clamped and counted.

The session imports nothing from vLLM; it runs wherever the pool runs.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .decoder import CodecDecoder
from .state_pool import DecoderStatePool, SlotState, make_state_pool

__all__ = ["CallTrace", "ChunkRequest", "ChunkResult", "CodecStreamSession"]

logger = logging.getLogger(__name__)

_CODE_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass(frozen=True)
class ChunkRequest:
    """One request's chunk in a Stage-1 batch.

    Attributes:
        request_id: stream key (the engine's request id).
        codes: ``(n_vq, T)`` integer codes, codebook-major, on any device. ``T`` may be
            0 (a meta-only payload; with ``finished`` it ends the stream). Values outside
            the codebook are clamped.
        finished: True for the stream's terminal chunk.
    """

    request_id: str
    codes: torch.Tensor
    finished: bool = False


@dataclass(frozen=True)
class ChunkResult:
    """What one :meth:`CodecStreamSession.decode` call produced for one request.

    Attributes:
        audio: ``(channels, frames * samples_per_frame)`` float32 on CPU (``(channels, 0)``
            when nothing was decoded).
        sample_rate: samples per second per channel.
        frames: code frames decoded for this request in this call.
        error: why this request's chunk in this call was refused (nothing of its stream changed
            by it), or None. A refused chunk of a stream whose earlier, buffered chunks were
            decoded in the same call comes back with that audio and the error together.
        queued: True while the stream waits for a slot (its chunk is buffered).
    """

    audio: torch.Tensor
    sample_rate: int
    frames: int
    error: str | None = None
    queued: bool = False


def _result_key(request_id) -> object:
    """The key of a request's result: its id, or the id's ``repr`` when the id cannot key a dict."""
    try:
        hash(request_id)
    except TypeError:
        return repr(request_id)
    return request_id


@dataclass
class CallTrace:
    """Host time of one :meth:`CodecStreamSession.decode` call by phase, in milliseconds of
    ``time.perf_counter`` (:meth:`CodecStreamSession.enable_call_traces`).

    The phases follow each other and add up to ``total_ms``:

    Attributes:
        plan_ms: work before and between steps: request checks, routing chunks to streams, admission,
            ending streams, preempting streams of a paged pool (their state copied to the host), and
            cutting the ready chunks into steps (the whole call when no step runs).
        stage_ms: each step's ``prepare_step`` and the gathering, clamp count, clamp and copies of its
            codes, slot ids and lengths (``_stage_inputs``); on CUDA, when an earlier step of the call has not started on the
            device yet, the wait for its input copies (the next step reuses their page-locked buffer).
        run_ms: the steps themselves as the host sees them: with CUDA graphs the graph's input copies,
            the replay's launch and the output's copy on the device (the GPU may still be running when
            they return); an eager step's launches, and on CUDA the waits inside it.
        to_host_ms: each step's audio rows to the host: on CUDA allocating the page-locked rows and
            queueing their copies behind the step (the host does not wait for them here).
        finish_ms: after the last step: ending streams, admitting and decoding nothing more, result
            objects, copies of still-buffered chunks, and (after ``wait_ms``) joining a stream's pieces.
        wait_ms: on CUDA, the call's one wait for the device, after its host work: the GPU time of its
            steps and audio copies that the host work above did not hide.
        total_ms: the whole call.
        gc_ms: Python garbage collections that started and ended while the call ran (time already inside
            the phases above).
        gc_collections: those collections.
        chunks: requests in the call.
        steps: pool steps the call completed.
        failed: the call raised (after its argument checks, which record nothing); the time from the
            last closed phase to the failure counts in ``finish_ms`` (``plan_ms`` when no step had
            completed), and on CUDA the wait for the copies of the steps that did in ``wait_ms``.
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
    failed: bool = False

    def _lap(self, phase: str, now: float, last: float) -> float:
        # Add now - last to `phase` and return now, the next phase's start.
        setattr(self, phase, getattr(self, phase) + (now - last) * 1e3)
        return now


#: Sessions whose call traces are on; the one garbage-collector hook below reads them. A WeakSet, so that
#: tracing never keeps a session (and its pool) alive.
_TRACING_SESSIONS: weakref.WeakSet = weakref.WeakSet()


def _gc_hook(phase: str, info: dict) -> None:
    # gc.callbacks hook, registered once by the first enable_call_traces: hands each collection's start
    # and stop to every tracing session (CodecStreamSession._gc_event).
    for session in list(_TRACING_SESSIONS):
        session._gc_event(phase)


@dataclass
class _Stream:
    request_id: str
    slot: int | None = None  # None while waiting for a slot
    # (n_vq, T) integer codes as the caller sent them (any code dtype, on the caller's device), clamped when a
    # step stages them; the session's own copies once a decode() call returns with them still buffered.
    chunks: list[torch.Tensor] = field(default_factory=list)
    finished: bool = False
    waiting_since: float | None = None
    saved: SlotState | None = None  # the state of a preempted stream, restored when it gets a slot back
    frames_decoded: int = 0  # frames of its own decoded so far (host count, for admission by pages)

    @property
    def buffered_frames(self) -> int:
        return sum(c.shape[1] for c in self.chunks)


@dataclass
class _Counters:
    steps_graph: int = 0
    steps_eager: int = 0
    decoded_frames: int = 0
    padded_frames: int = 0
    admitted_from_queue: int = 0
    preemptions: int = 0
    queue_wait_s_max: float = 0.0
    request_errors: int = 0
    clamped_codes: int = 0
    clamped_on_device: torch.Tensor | None = None  # counts of steps whose codes were on the device, not yet read


class AdmissionQueue:
    """New streams waiting for a slot, oldest first, with their buffered chunks.

    Args:
        max_streams: streams that may wait.
        max_frames: code frames that waiting streams may buffer in total.
    """

    def __init__(self, max_streams: int, max_frames: int):
        self.max_streams = max_streams
        self.max_frames = max_frames
        self._streams: OrderedDict[str, _Stream] = OrderedDict()

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    @property
    def request_ids(self) -> list[str]:
        return list(self._streams)

    @property
    def buffered_frames(self) -> int:
        return sum(s.buffered_frames for s in self._streams.values())

    def get(self, request_id: str) -> _Stream | None:
        return self._streams.get(request_id)

    def refusal(self, frames: int, *, new_stream: bool, capacity: int) -> str | None:
        """Why ``frames`` more frames (of a new stream, or of a waiting one) cannot wait, or None."""
        if new_stream and len(self._streams) >= self.max_streams:
            return (
                f"all {capacity} decoder slots are busy and the admission queue is full "
                f"({len(self._streams)} of max_waiting_streams={self.max_streams} streams waiting)"
            )
        buffered = self.buffered_frames + frames
        if buffered > self.max_frames:
            return (
                f"all {capacity} decoder slots are busy and waiting streams would buffer "
                f"{buffered} frames, over max_waiting_frames={self.max_frames}"
            )
        return None

    def push(self, stream: _Stream) -> None:
        stream.waiting_since = time.monotonic()
        self._streams[stream.request_id] = stream

    def pop_oldest(self) -> _Stream:
        _, stream = self._streams.popitem(last=False)
        return stream

    def peek_oldest(self) -> _Stream:
        return next(iter(self._streams.values()))

    def push_front(self, stream: _Stream) -> None:
        """Queue a preempted stream ahead of every new one (outside the queue's bounds: it was live)."""
        stream.waiting_since = time.monotonic()
        self._streams[stream.request_id] = stream
        self._streams.move_to_end(stream.request_id, last=False)

    def drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def clear(self) -> None:
        self._streams.clear()


class CodecStreamSession:
    """Request-level streaming on top of a :class:`~.state_pool.DecoderStatePool`.

    Args:
        decoder: the codec weights (any device; the pool lives on the same device).
        state_capacity: live streams at most (Stage 1's ``max_num_seqs``).
        pool_kind: ``"compact"`` / ``"legacy"`` / ``"paged"``; default: compact for v2 codecs, legacy for v1.
        state_dtype: ring dtype; default ``decoder.state_dtype``.
        attention_backend: the pool's attention backend, ``"sdpa"`` or ``"triton"``; default:
            the pool's (:class:`~.state_pool.DecoderStatePool`).
        ring_semantics: the pool's ring semantics, ``"upstream"`` or ``"exact"``; default:
            upstream's for the codec version.
        graph_batch_sizes: CUDA-graph batch buckets; sizes outside ``1..state_capacity``
            are ignored.
        graph_frame_sizes: CUDA-graph frame sizes, e.g. the chunk schedule's sizes.
        max_step_frames: longest piece decoded in one step when no graph serves the step.
        compile: ``False`` (eager), ``True`` (:func:`~.compile.compile_decode`), or a
            factory ``pool -> callable`` with the signature of
            ``pool.decode_streaming_tensors`` (the stage passes vLLM's compiled adapter).
            The callable is used for graph capture; eager steps use it only for ``True``
            (a factory's callable may skip guards; eager steps then take the validated step).
        n_vq: codebooks per frame in every chunk; default: all of the codec's.
        max_waiting_streams: new streams that may wait for a slot.
        max_waiting_frames: code frames that waiting streams may buffer in total.
        page_fraction: state pages of a ``"paged"`` pool, as a fraction of full rings for every slot
            (:class:`~.state_pool.PagedDecoderStatePool`); below 1 the session admits streams while
            pages last and preempts the youngest live stream when a step runs short.
        state_budget_bytes: instead of ``page_fraction``, the bytes of ring pages a ``"paged"`` pool may
            hold (picks the paged pool when ``pool_kind`` is None); ``state_capacity`` then caps live
            streams and the budget decides how many of them fit (``docs/memory.md``, "Paged rings").
        expected_stream_frames: with ``state_budget_bytes``, split the budget by the groups' fill over a
            stream of this many frames (:class:`~.state_pool.PagedDecoderStatePool`).

    Graphs are captured at construction when the decoder is on CUDA and both size
    lists are non-empty.

    Raises:
        ValueError: ``state_capacity < 1``, ``max_step_frames < 1``, a negative queue
            bound, bad ``n_vq``, or an unknown ``pool_kind``, ``attention_backend`` or
            ``ring_semantics`` (or ``"triton"`` for the legacy pool); a ``page_fraction`` or
            ``state_budget_bytes`` refused by the paged pool, e.g. a budget too small for one
            stream (the message names the minimum).
        RuntimeError: ``attention_backend="triton"`` without the ``triton`` package.
    """

    def __init__(
        self,
        decoder: CodecDecoder,
        state_capacity: int,
        *,
        pool_kind: str | None = None,
        state_dtype: torch.dtype | None = None,
        attention_backend: str | None = None,
        ring_semantics: str | None = None,
        graph_batch_sizes: Iterable[int] = (),
        graph_frame_sizes: Iterable[int] = (),
        max_step_frames: int = 100,
        compile: bool | Callable[[DecoderStatePool], Callable] = False,
        n_vq: int | None = None,
        max_waiting_streams: int = 64,
        max_waiting_frames: int = 4096,
        page_fraction: float | None = None,
        state_budget_bytes: int | None = None,
        expected_stream_frames: int | None = None,
    ):
        if isinstance(state_capacity, bool) or not isinstance(state_capacity, int) or state_capacity < 1:
            raise ValueError(f"state_capacity must be an integer >= 1, got {state_capacity!r}")
        for name, value, low in (
            ("max_step_frames", max_step_frames, 1),
            ("max_waiting_streams", max_waiting_streams, 0),
            ("max_waiting_frames", max_waiting_frames, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        cfg = decoder.config
        self.n_vq = cfg.num_quantizers if n_vq is None else int(n_vq)
        if not 1 <= self.n_vq <= cfg.num_quantizers:
            raise ValueError(f"n_vq must be in 1..{cfg.num_quantizers} for this codec, got {n_vq!r}")
        self.decoder = decoder
        self.state_capacity = state_capacity
        self.max_step_frames = max_step_frames
        self.sample_rate = int(cfg.sampling_rate)
        self.channels = int(cfg.number_channels)
        self.samples_per_frame = int(cfg.samples_per_frame)
        self.codebook_size = int(cfg.codebook_size)
        self.device = decoder.device
        self.graph_batch_sizes = sorted({int(b) for b in graph_batch_sizes if 0 < int(b) <= state_capacity})
        self.graph_frame_sizes = sorted({int(t) for t in graph_frame_sizes if int(t) > 0})

        use_graphs = self.device.type == "cuda" and bool(self.graph_batch_sizes) and bool(self.graph_frame_sizes)
        self.pool = make_state_pool(
            decoder,
            pool_kind,
            state_dtype,
            ring_semantics,
            attention_backend,
            page_fraction,
            state_budget_bytes,
            expected_stream_frames,
        )
        scratch = self.pool.scratch_slots_for(self.graph_batch_sizes[-1]) if use_graphs else 0
        self.pool.initialize(state_capacity, scratch)
        self._compiled = self._compiled_step(compile)
        self._eager_step = self._compiled if compile is True else None
        self.runner = self._capture_graphs() if use_graphs else None
        # A page-locked host buffer of a step's inputs (int64), reused by every step, and page-locked audio
        # rows from torch's caching host allocator (_to_host). With graphs both are prepared here for the
        # largest graph step, so no step pays for pinning memory; without graphs the input buffer grows to
        # the largest step taken (docs/memory.md).
        self._pinned_inputs: torch.Tensor | None = None
        # Recorded after each step's input copies from that buffer (CUDA only): it may be overwritten
        # once the device has read it. Audio copies queued and not yet awaited: _await_host_copies.
        self._inputs_read = torch.cuda.Event() if self.device.type == "cuda" else None
        self._copies_pending = False
        if self.runner is not None:
            rows, frames = self.graph_batch_sizes[-1], self.graph_frame_sizes[-1]
            self._input_buffer((self.n_vq * frames + 2) * rows)
            # Pin one burst's audio rows once and free them: the caching host allocator keeps the blocks.
            warm = [self._audio_row(frames) for _ in range(rows)]
            del warm

        self._live: dict[str, _Stream] = {}
        self._incoming: dict[str, int] = {}  # during decode(): frames of this batch not yet buffered, per id
        self._waiting = AdmissionQueue(max_waiting_streams, max_waiting_frames)
        self._counters = _Counters()
        self._closed = False
        #: Traces of the last calls (:meth:`enable_call_traces`); None while tracing is off.
        self.call_traces: deque[CallTrace] | None = None
        self._trace: CallTrace | None = None  # the running call's trace
        self._trace_mark = 0.0  # perf_counter at the end of the trace's last phase
        self._gc_started: float | None = None  # perf_counter at the start of a collection inside the call

    def _compiled_step(self, compile) -> Callable | None:
        if compile is True:
            from .compile import compile_decode

            return compile_decode(self.pool)
        return compile(self.pool) if callable(compile) else None

    def _capture_graphs(self):
        from .cuda_graph import StreamingGraphRunner

        runner = StreamingGraphRunner(
            self.pool, self.graph_batch_sizes, self.graph_frame_sizes, self.n_vq, callable=self._compiled
        )
        runner.capture()
        return runner if runner.graphs else None

    # ------------------------------------------------------------------ properties
    @property
    def live_requests(self) -> dict[str, int]:
        """Copy of the live streams: request id -> leased slot."""
        return {rid: s.slot for rid, s in self._live.items()}

    @property
    def waiting_requests(self) -> list[str]:
        """Request ids waiting for a slot, oldest first."""
        return self._waiting.request_ids

    @property
    def free_slots(self) -> int:
        """Slots that can still be leased."""
        return self.pool.free_slot_count

    @property
    def clamped_codes(self) -> int:
        """Codes clamped into ``[0, codebook_size - 1]`` since construction, counted when a step gathers
        them (a chunk refused, or dropped while it waits, counts nothing; one whose step raises counts
        again if it is sent again). Reading it waits for the device when chunks arrived on it (their
        counts stay on the device until read)."""
        c = self._counters
        if c.clamped_on_device is not None:
            c.clamped_codes += int(c.clamped_on_device)
            c.clamped_on_device = None
        return c.clamped_codes

    def stats(self) -> dict[str, object]:
        """Counters since construction: steps by path (``graph``/``eager``), decoded and padded
        frames (padding frames of rows in steps), the admission queue (streams and frames
        waiting now, streams admitted after waiting, the longest wait in seconds), streams
        preempted for state memory (paged pools), clamped codes and refused requests."""
        c = self._counters
        return {
            "steps_by_path": {"graph": c.steps_graph, "eager": c.steps_eager},
            "decoded_frames": c.decoded_frames,
            "padded_frames": c.padded_frames,
            "waiting_streams": len(self._waiting),
            "waiting_frames": self._waiting.buffered_frames,
            "admitted_from_queue": c.admitted_from_queue,
            "preemptions": c.preemptions,
            "queue_wait_s_max": c.queue_wait_s_max,
            "clamped_codes": self.clamped_codes,
            "request_errors": c.request_errors,
        }

    # ------------------------------------------------------------------ lifecycle
    def on_requests_finished(self, request_ids: Iterable[str]) -> None:
        """Abort, disconnect or completion: release every slot these ids hold and drop their
        buffered chunks. Ids that are not live or waiting are ignored.

        Raises:
            TypeError: ``request_ids`` is a single ``str`` (or bytes), not a collection of ids.
        """
        if isinstance(request_ids, (str, bytes)):
            raise TypeError(f"request_ids must be a collection of request ids, got the single id {request_ids!r}")
        if self._closed:
            return
        released = []
        try:
            for rid in request_ids:
                rid = str(rid)
                waiting = self._waiting.get(rid)
                if waiting is not None and waiting.buffered_frames:
                    logger.error(
                        "MOSS codec: request %r ended while waiting for %s; its %d buffered frames are dropped "
                        "undecoded",
                        rid,
                        "decoder state pages (preempted)" if waiting.saved is not None else "a slot",
                        waiting.buffered_frames,
                    )
                self._waiting.drop(rid)
                stream = self._live.pop(rid, None)
                if stream is not None:
                    released.append(stream.slot)
        finally:
            # An iterable that fails part-way still frees the slots of the streams it ended.
            if released:
                self.pool.release(released)

    def enable_call_traces(self, max_calls: int | None = 4096) -> deque[CallTrace]:
        """Record a :class:`CallTrace` of every later :meth:`decode` call in :attr:`call_traces` (the
        last ``max_calls``; None keeps all), for latency diagnosis. Costs a few clock reads a step, and a
        look at the tracing sessions on every garbage collection (one hook in ``gc.callbacks``, installed
        once per process; it holds no session alive). Enabling again starts a new, empty
        :attr:`call_traces`. Returns :attr:`call_traces`.

        Raises:
            ValueError: ``max_calls`` is not None or an integer in ``1..sys.maxsize``.
            RuntimeError: the session is closed.
        """
        if self._closed:
            raise RuntimeError("this CodecStreamSession is closed")
        if max_calls is not None and (
            isinstance(max_calls, bool) or not isinstance(max_calls, int) or not 1 <= max_calls <= sys.maxsize
        ):
            raise ValueError(f"max_calls must be None or an integer in 1..{sys.maxsize}, got {max_calls!r}")
        if _gc_hook not in gc.callbacks:
            gc.callbacks.append(_gc_hook)
        self.call_traces = deque(maxlen=max_calls)
        _TRACING_SESSIONS.add(self)
        return self.call_traces

    def disable_call_traces(self) -> None:
        """Stop recording call traces; :attr:`call_traces` becomes None. Idempotent."""
        _TRACING_SESSIONS.discard(self)
        self.call_traces = None

    def _gc_event(self, phase: str) -> None:
        # A collection's start or stop (_gc_hook). Only collections that start and stop within one traced
        # call count toward it: a stop whose start fell outside the call is ignored.
        trace = self._trace
        if trace is None:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            trace.gc_ms += (time.perf_counter() - self._gc_started) * 1e3
            trace.gc_collections += 1
            self._gc_started = None

    def _lap(self, phase: str) -> None:
        # Close the running trace's current phase as `phase` (no-op while tracing is off).
        if self._trace is not None:
            self._trace_mark = self._trace._lap(phase, time.perf_counter(), self._trace_mark)

    def close(self) -> None:
        """Drop graphs and pool state. Idempotent; :meth:`decode` raises afterwards."""
        if self._closed:
            return
        self._closed = True
        self.disable_call_traces()
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        self._compiled = self._eager_step = None
        self.pool.close()
        self._live.clear()
        self._waiting.clear()

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, requests: Sequence[ChunkRequest]) -> dict[str, ChunkResult]:
        """Decode one Stage-1 batch.

        Args:
            requests: at most one chunk per request id.
        Returns:
            A :class:`ChunkResult` for every request id in ``requests`` (with ``error`` set
            for a refused chunk, ``queued`` while the stream waits), plus one for every
            waiting stream that got a slot and was decoded in this call. A request whose id
            is not a string gets its error under that id (its ``repr`` if it cannot key a dict).
            With :meth:`enable_call_traces`, the call also appends its :class:`CallTrace`.
        Raises:
            TypeError: ``requests`` is not a sequence of :class:`ChunkRequest`.
            ValueError: a request id appears twice. Nothing is modified.
            RuntimeError: the session is closed.
        """
        if self._closed:
            raise RuntimeError("this CodecStreamSession is closed")
        tracing = self.call_traces is not None  # decided once per call
        started = time.perf_counter() if tracing else 0.0
        if isinstance(requests, ChunkRequest) or not isinstance(requests, Iterable):
            raise TypeError(f"requests must be a sequence of ChunkRequest, got {type(requests).__name__}")
        requests = list(requests)
        for req in requests:
            if not isinstance(req, ChunkRequest):
                raise TypeError(f"requests must hold ChunkRequest objects, got {type(req).__name__}")
        ids = [_result_key(req.request_id) for req in requests]
        named = [rid for rid in ids if isinstance(rid, str)]
        dupes = sorted(rid for rid, n in Counter(named).items() if n > 1)
        if dupes:
            raise ValueError(f"request {dupes[0]!r} appears twice in one decode batch")
        if tracing:  # the batch's checks above count as planning
            self._trace, self._trace_mark, self._gc_started = CallTrace(chunks=len(requests)), started, None
        try:
            return self._decode_batch(requests, ids)
        except BaseException:
            if self._trace is not None:
                self._trace.failed = True
            raise
        finally:
            self._await_host_copies()  # after a failure too: no copy into a returned row outlives the call
            trace, self._trace, self._gc_started = self._trace, None, None
            if trace is not None:
                now = time.perf_counter()
                trace._lap("finish_ms" if trace.steps else "plan_ms", now, self._trace_mark)
                trace.total_ms = (now - started) * 1e3
                if self.call_traces is not None:
                    self.call_traces.append(trace)

    def _decode_batch(self, requests: list[ChunkRequest], ids: list[object]) -> dict[str, ChunkResult]:
        # decode() past its argument checks (which change nothing).
        results: dict[str, ChunkResult] = {}
        accepted = []
        for req, key in zip(requests, ids):
            error = self._chunk_error(req)
            if error is None:
                accepted.append(req)
            else:
                self._counters.request_errors += 1
                results[key] = self._empty(error=error)
        # Frames this batch brings to each request, not yet buffered (admission accounts for them).
        self._incoming = {}
        for req in accepted:
            self._incoming[req.request_id] = self._incoming.get(req.request_id, 0) + req.codes.shape[1]
        self._admit_waiting()  # slots freed since the last call go to waiting streams first
        try:
            for req in accepted:
                self._incoming.pop(req.request_id, None)
                error = self._accept(req)
                if error is not None:
                    self._counters.request_errors += 1
                    results[req.request_id] = self._empty(error=error)
            audio = self._decode_ready()
        finally:
            # Whatever happened above, no buffered chunk outlives this call as the caller's tensor.
            self._own_buffered_chunks({id(req.codes) for req in accepted})
        # Result objects are made while the device may still run the last step; only the audio of a stream
        # decoded in several pieces is joined after the wait (its rows must hold their samples by then).
        joined: dict[str, tuple[list[torch.Tensor], str | None]] = {}
        for rid, parts in audio.items():
            refused = results.get(rid)  # this call's chunk refused, the buffered ones decoded
            error = None if refused is None else refused.error
            if len(parts) == 1:
                results[rid] = self._result(parts[0], error)
            else:
                joined[rid] = (parts, error)
                results[rid] = None  # keeps the key's place; filled below
        for rid in ids:
            if rid not in results:
                results[rid] = self._empty(queued=rid in self._waiting)
        self._await_host_copies()
        for rid, (parts, error) in joined.items():
            results[rid] = self._result(torch.cat(parts, dim=-1), error)
        return results

    def _result(self, wav: torch.Tensor, error: str | None) -> ChunkResult:
        return ChunkResult(wav, self.sample_rate, wav.shape[-1] // self.samples_per_frame, error)

    # ------------------------------------------------------------------ intake
    def _chunk_error(self, req: ChunkRequest) -> str | None:
        """Why ``req`` cannot be taken (checked before anything changes), or None."""
        rid, c = req.request_id, req.codes
        if not isinstance(rid, str) or not rid:
            # Ids are matched against on_requests_finished's strings: anything else would leak a slot.
            return f"request_id must be a non-empty str, got {rid!r}"
        if not isinstance(req.finished, bool):
            return f"request {rid!r}: finished must be a bool, got {req.finished!r}"
        if isinstance(c, torch.Tensor) and (c.layout != torch.strided or c.is_nested):
            layout = "nested" if c.is_nested else c.layout
            return f"request {rid!r}: codes must be a dense (strided) tensor, got a {layout} tensor"
        if not isinstance(c, torch.Tensor) or c.dim() != 2 or c.shape[0] != self.n_vq:
            shape = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
            return f"request {rid!r}: codes must have shape ({self.n_vq}, T), got {shape}"
        if c.dtype not in _CODE_DTYPES:
            return f"request {rid!r}: codes must be signed integers (or uint8), got {c.dtype}"
        if c.device.type == "meta":
            return f"request {rid!r}: codes are on the meta device"
        return None

    def _accept(self, req: ChunkRequest) -> str | None:
        """Route one valid chunk to its live or waiting stream, or start one. Returns an error or None."""
        rid, frames = req.request_id, req.codes.shape[1]
        stream = self._live.get(rid) or self._waiting.get(rid)
        if stream is None:
            if frames == 0:
                return None  # nothing to decode and no stream to end
            stream = _Stream(rid)
            if self._waiting or not self._can_admit(0, frames):
                error = self._waiting.refusal(frames, new_stream=True, capacity=self.state_capacity)
                if error is not None:
                    return error
                self._waiting.push(stream)
                logger.info("MOSS codec: stream %r waits for a slot (%d waiting)", rid, len(self._waiting))
            else:
                stream.slot = self.pool.acquire()
                self._live[rid] = stream
        elif stream.finished and frames and stream.slot is None:
            # The id's last stream got its terminal chunk while waiting for a slot (only a waiting stream
            # outlives the call of its terminal chunk): a new stream cannot start under the id yet, and the
            # chunk must not join the ended one.
            return (
                f"request {rid!r}: the stream that last used this id has ended but still waits for a slot "
                f"({stream.buffered_frames} frames queued); a new stream may use the id once that one's audio "
                f"has been returned"
            )
        elif stream.slot is None and frames and stream.saved is None:
            # A preempted stream (saved state) was live: its chunks are always kept, whatever the bounds.
            error = self._waiting.refusal(frames, new_stream=False, capacity=self.state_capacity)
            if error is not None:
                self._waiting.drop(rid)
                return f"{error}; the waiting stream's buffered chunks were dropped"
        if frames:
            # Chunks stay as they arrived (dtype, device) until a step gathers them: host chunks then travel
            # in one pinned copy and every step clamps its codes once (_stage_inputs); no per-chunk op here.
            stream.chunks.append(req.codes)
        stream.finished = stream.finished or req.finished
        return None

    def _own_buffered_chunks(self, borrowed: set[int]) -> None:
        """Copy the chunks of this call (``borrowed``: their tensors' ids) that are still buffered as it
        returns (streams that wait, or were preempted), so that the caller may reuse its tensors."""
        streams = list(self._live.values()) + [self._waiting.get(rid) for rid in self._waiting.request_ids]
        for stream in streams:
            if any(id(c) in borrowed for c in stream.chunks):
                stream.chunks = [c.clone() if id(c) in borrowed else c for c in stream.chunks]

    def _can_admit(self, frames: int, chunk_frames: int) -> bool:
        """Whether a stream with ``frames`` decoded can take a slot and decode ``chunk_frames`` more, after
        the live streams' buffered chunks (and this batch's chunks for them not yet buffered) get the state
        they need: admitting it must not make a live stream run short (a paged pool would then preempt)."""
        if not self.pool.can_admit(frames, chunk_frames):
            return False
        if self.pool.room_for_all(frames, chunk_frames):  # unpaged pools, and paged ones with pages to spare
            return True
        live = [s for s in self._live.values() if s.chunks or self._incoming.get(s.request_id)]
        return self.pool.can_admit(
            frames,
            chunk_frames,
            {s.slot: s.buffered_frames + self._incoming.get(s.request_id, 0) for s in live},
            {s.slot: s.frames_decoded for s in live},
        )

    def _admit_waiting(self) -> None:
        while self._waiting:
            oldest = self._waiting.peek_oldest()
            # All it has buffered and brings in this batch: what the step that follows needs pages for.
            pending = oldest.buffered_frames + self._incoming.get(oldest.request_id, 0)
            if not self._can_admit(oldest.frames_decoded, pending):
                return
            stream = self._waiting.pop_oldest()
            rid = stream.request_id
            stream.slot = self.pool.acquire()
            if stream.saved is not None:  # a preempted stream resumes exactly where it stopped
                self.pool.restore_slot(stream.slot, stream.saved)
                stream.saved = None
            waited = time.monotonic() - stream.waiting_since
            stream.waiting_since = None
            self._live[rid] = stream
            self._counters.admitted_from_queue += 1
            self._counters.queue_wait_s_max = max(self._counters.queue_wait_s_max, waited)
            logger.info("MOSS codec: stream %r got slot %d after waiting %.3f s", rid, stream.slot, waited)

    # ------------------------------------------------------------------ steps
    def _decode_ready(self) -> dict[str, list[torch.Tensor]]:
        """Decode every live stream's buffered chunks; end finished streams. Admits waiting
        streams whenever slots are free (also those freed by this call's terminal chunks). Returns
        each stream's audio rows in order; on CUDA their copies may still be running
        (:meth:`_await_host_copies`)."""
        audio: dict[str, list[torch.Tensor]] = {}
        while True:
            self._admit_waiting()
            ready = self._fit_state([s for s in self._live.values() if s.chunks])
            ending = [s for s in self._live.values() if s.finished]
            if ready:
                for rid, rows in self._decode_streams(ready).items():
                    audio.setdefault(rid, []).extend(rows)
            self._end(ending)
            if not (ending and self._waiting):
                return audio

    def _end(self, streams: list[_Stream]) -> None:
        """Remove finished live ``streams`` and release their slots."""
        for stream in streams:
            del self._live[stream.request_id]
        if streams:
            self.pool.release([s.slot for s in streams])

    def _fit_state(self, ready: list[_Stream]) -> list[_Stream]:
        """Preempt the youngest live streams until the pool holds the context every ready stream is about
        to reach (only a paged pool can run short). A preempted stream's state goes to host memory
        (``save_slot``) and it waits, ahead of new streams, to resume exactly; its chunks stay buffered."""
        if self.pool.room_for_all(0, 0):  # every leased slot could fill its rings (unpaged pools: always)
            return ready
        while ready and self.pool.pages_short(
            {s.slot: s.buffered_frames for s in ready}, {s.slot: s.frames_decoded for s in ready}
        ):
            done = [s for s in self._live.values() if s.finished and not s.chunks]
            if done:  # streams that only wait to end give their pages back before anyone is preempted
                self._end(done)
                continue
            victim = next(reversed(self._live.values()))  # the youngest: admitted last
            victim.saved = self.pool.save_slot(victim.slot)
            self.pool.release([victim.slot])
            victim.slot = None
            del self._live[victim.request_id]
            self._waiting.push_front(victim)
            self._counters.preemptions += 1
            logger.info("MOSS codec: stream %r preempted to free decoder state pages", victim.request_id)
            ready = [s for s in ready if s is not victim]
        return ready

    @property
    def max_piece_frames(self) -> int:
        """Most frames of one chunk decoded in one step: the largest graph frame size, or
        ``max_step_frames`` when no graph frame sizes are configured."""
        return self.graph_frame_sizes[-1] if self.graph_frame_sizes else self.max_step_frames

    @property
    def max_step_rows(self) -> int | None:
        """Most rows in one step: the largest graph bucket (None: unbounded, no buckets)."""
        return self.graph_batch_sizes[-1] if self.graph_batch_sizes else None

    def _decode_streams(self, streams: list[_Stream]) -> dict[str, list[torch.Tensor]]:
        """Decode the buffered chunks of ``streams`` in as few steps as the graphs allow.

        Each stream's chunks keep their boundaries (a stream that waited in the queue is
        decoded chunk by chunk, as if it had never waited); a chunk longer than
        :attr:`max_piece_frames` is cut into pieces. Step ``i`` decodes every stream's
        ``i``-th piece, split into steps of at most :attr:`max_step_rows` rows. Returns each
        stream's audio rows, one per piece.
        """
        limit = self.max_piece_frames
        pieces: dict[str, list[torch.Tensor]] = {}
        for s in streams:
            pieces[s.request_id] = [
                c if c.shape[1] <= limit else c[:, a : a + limit] for c in s.chunks for a in range(0, c.shape[1], limit)
            ]
            s.chunks = []
        max_rows = self.max_step_rows or len(streams)
        parts: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in streams}
        for i in range(max(len(p) for p in pieces.values())):
            rows = [s for s in streams if len(pieces[s.request_id]) > i]
            for first in range(0, len(rows), max_rows):
                batch = rows[first : first + max_rows]
                step_pieces = [pieces[s.request_id][i] for s in batch]
                done = [s.frames_decoded for s in batch]
                for s, piece, wav in zip(batch, step_pieces, self._step([s.slot for s in batch], step_pieces, done)):
                    parts[s.request_id].append(wav)
                    s.frames_decoded += piece.shape[1]
        return parts

    def _step_frames(self, longest: int) -> int:
        # The same padding with or without captured graphs, so CPU runs take the steps a GPU does.
        return next((t for t in self.graph_frame_sizes if t >= longest), longest)

    def _step(self, slots: list[int], pieces: list[torch.Tensor], done: list[int]) -> list[torch.Tensor]:
        """One pool step (``done``: frames each slot has decoded before it); returns each row's
        ``(channels, own_T * spf)`` float32 CPU audio (on CUDA still being copied: :meth:`_to_host`)."""
        self._lap("plan_ms")
        own = [p.shape[1] for p in pieces]
        B, T = len(pieces), self._step_frames(max(own))
        self.pool.prepare_step(slots, own, done)  # a paged pool allocates the pages this step writes
        codes, slot_ids, lengths = self._stage_inputs(pieces, own, slots, T)
        self._lap("stage_ms")
        out = self.runner.decode(codes, lengths, slot_ids) if self.runner is not None else None
        if out is not None:
            self._counters.steps_graph += 1
        else:
            self._counters.steps_eager += 1
            valid = torch.ones(B, dtype=torch.bool, device=self.device)
            step = self._eager_step or self.pool.decode_streaming_batch
            out, _ = step(codes, lengths, slot_ids, valid)
        self._lap("run_ms")
        served = out.shape[-1] // self.samples_per_frame
        self._counters.decoded_frames += sum(own)
        self._counters.padded_frames += B * served - sum(own)
        rows = self._to_host(out, own)
        self._lap("to_host_ms")
        if self._trace is not None:
            self._trace.steps += 1
        return rows

    def _input_buffer(self, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the session's pinned int64 input buffer (grown when too small),
        free to overwrite: it first waits until the device has read the previous step's inputs from it
        (that step's host-to-device copies, marked by ``_inputs_read``; a step of the same call may not
        have started yet, since the call waits for the device only once, at its end)."""
        if self._inputs_read is not None:
            self._inputs_read.synchronize()
        if self._pinned_inputs is None or self._pinned_inputs.numel() < numel:
            self._pinned_inputs = torch.empty(numel, dtype=torch.long, pin_memory=True)
        return self._pinned_inputs[:numel]

    def _stage_inputs(self, pieces: list[torch.Tensor], own: list[int], slots: list[int], T: int):
        """``(codes (n_vq, B, T), slot_ids (B,), lengths (B,))``, int64 tensors of their own on the pool's
        device, codes clamped into ``[0, codebook_size)`` and zero past each row's length. On CUDA, codes
        from the host are gathered in the pinned input buffer and arrive in one host-to-device copy; slot
        ids and lengths always travel through it. Pieces of one dtype and device are gathered by one
        stack (all of length ``T``) or one padded gather, not row by row."""
        B = len(pieces)
        pinned = self.device.type == "cuda"
        # Codes from the host (as Stage 0 sends them) to a CUDA pool are gathered in the pinned buffer;
        # anything else is gathered on the pool's device directly.
        stage_codes = pinned and all(p.device.type == "cpu" for p in pieces)
        codes_numel = self.n_vq * B * T if stage_codes else 0
        if pinned:
            staged = self._input_buffer(codes_numel + 2 * B)
        else:
            staged = torch.empty(2 * B, dtype=torch.long)
        meta = staged[codes_numel:].view(2, B)
        meta.copy_(torch.tensor([slots, own], dtype=torch.long))
        if stage_codes:
            codes = staged[:codes_numel].view(self.n_vq, B, T)
        else:
            codes = torch.empty(self.n_vq, B, T, dtype=torch.long, device=self.device)
        kinds = {(p.dtype, p.device) for p in pieces}
        uniform = len(kinds) == 1
        if uniform and all(n == T for n in own):
            if kinds == {(codes.dtype, codes.device)}:
                torch.stack(pieces, dim=1, out=codes)  # gathered in place: no temporary
            else:
                codes.copy_(torch.stack(pieces, dim=1))
        elif uniform:
            padded = torch.nn.utils.rnn.pad_sequence([p.t() for p in pieces], batch_first=True)  # (B, max, n_vq)
            codes.zero_()
            codes[:, :, : padded.shape[1]] = padded.permute(2, 0, 1)
        else:
            codes.zero_()
            for b, p in enumerate(pieces):
                codes[:, b, : own[b]] = p
        self._count_clamped(codes)
        codes.clamp_(0, self.codebook_size - 1)
        # Each result owns its storage (no views of one staging tensor, whose strides torch.compile would
        # guard on): the copies below always make new tensors.
        slot_ids = meta[0].to(self.device, non_blocking=pinned, copy=True)
        lengths = meta[1].to(self.device, non_blocking=pinned, copy=True)
        codes = codes.to(self.device, non_blocking=pinned)
        if pinned:
            self._inputs_read.record(torch.cuda.current_stream(self.device))
        return codes, slot_ids, lengths

    def _count_clamped(self, codes: torch.Tensor) -> None:
        """Count the codes of a step's gathered ``(n_vq, B, T)`` int64 ``codes`` that its clamp will change
        (padding is 0, in range). Host codes (as Stage 0 sends them) take one min/max pass and a count only
        when one is out of range; device codes are counted on the device without a sync (read lazily by
        :attr:`clamped_codes`). Stage 0 pads with ``codebook_size``; upstream clamps every chunk."""
        hi = self.codebook_size - 1
        if codes.is_cuda:
            outside = ((codes < 0) | (codes > hi)).sum()
            c = self._counters
            c.clamped_on_device = outside if c.clamped_on_device is None else c.clamped_on_device + outside
            return
        low, high = torch.aminmax(codes)
        if int(low) < 0 or int(high) > hi:
            self._counters.clamped_codes += int(((codes < 0) | (codes > hi)).sum())

    def _audio_row(self, frames: int) -> torch.Tensor:
        """An empty ``(channels, frames * spf)`` float32 tensor in page-locked host memory."""
        return torch.empty((self.channels, frames * self.samples_per_frame), dtype=torch.float32, pin_memory=True)

    def _to_host(self, out: torch.Tensor, own: list[int]) -> list[torch.Tensor]:
        """Each row's ``(channels, own * spf)`` float32 audio on the host, a tensor of its own.

        On CUDA each row is copied from the device straight into a page-locked tensor of its own from
        torch's caching host allocator; when the caller drops a row its block returns to that cache for
        a later step. The copies are queued behind the step and not awaited here: the call awaits all of
        them once, after its host work (:meth:`_await_host_copies`), so that work runs while the device
        does. (One copy into a shared buffer followed by a host copy per row cost 13 ms at 128 rows of 15
        frames on the H200's host, these copies 1.9 ms: benchmarks/RESULTS.md.)"""
        spf = self.samples_per_frame
        if not out.is_cuda:
            host = out.float()
            return [host[b, :, : n * spf].clone() for b, n in enumerate(own)]
        rows = [self._audio_row(n) for n in own]
        for b, (row, n) in enumerate(zip(rows, own)):
            row.copy_(out[b, :, : n * spf], non_blocking=True)
        self._copies_pending = True
        return rows

    def _await_host_copies(self) -> None:
        """Wait once for the device to finish this call's steps and audio copies (no-op when none are
        queued). Traced as ``finish_ms`` up to here and ``wait_ms`` for the wait."""
        if not self._copies_pending:
            return
        self._lap("finish_ms")
        torch.cuda.current_stream(self.device).synchronize()
        self._copies_pending = False
        self._lap("wait_ms")

    def _empty(self, *, error: str | None = None, queued: bool = False) -> ChunkResult:
        return ChunkResult(torch.zeros(self.channels, 0, dtype=torch.float32), self.sample_rate, 0, error, queued)
