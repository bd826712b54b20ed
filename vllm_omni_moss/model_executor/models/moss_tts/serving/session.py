# SPDX-License-Identifier: Apache-2.0
"""Streaming session: many request streams multiplexed onto one decoder state pool.

The Stage-1 codec receives, per engine step, one chunk of codes per request (docs/serving.md).
:class:`CodecStreamSession` is a thin facade over three parts: the pool (:mod:`..state`), the
:class:`~.scheduler.Scheduler` (streams, admission, waiting, preemption) and the
:class:`~.step_runner.StepRunner` (cut, stage, dispatch, copy back).

* **Streams.** A request holds one pool slot from its first chunk with codes to its terminal chunk
  (``finished=True``) or an abort (:meth:`on_requests_finished`). A chunk for a request id that is not live
  starts a fresh stream; a zero-frame chunk of an id that is not live decodes nothing. While a stream that got
  its terminal chunk still waits for a slot, a chunk with codes under its id gets an error (it neither joins
  the ended stream nor drops it).
* **One step per round.** Every step is ragged: the ready chunks of a call are cut into pieces of at most the
  largest graph frame size (``max_step_frames`` without graph frame sizes), and round ``i`` decodes every
  stream's ``i``-th piece in one step whose rows hold any number of valid frames, packed one after another
  (``token_packing.py``). Its shape comes from the session's :class:`~..graph_ladder.StepLadder` (the packed
  frames pad to the next frame total; a round no shape holds is cut into several steps), on every device, and on
  CUDA the step replays the graph captured for that shape. Padding (dummy frames, padding rows) changes no state,
  so tails are exact.
* **Admission.** New streams beyond the free slots wait in a FIFO queue: their chunks are buffered in order
  and decoded once a slot frees (in the :meth:`decode` call that frees it, or a later one); their audio is
  returned by that call, under their request id, even when the request is not in that call's batch. The
  queue is bounded by ``max_waiting_streams`` streams and ``max_waiting_frames`` buffered frames; past either
  bound the request alone gets an error and its buffered chunks are dropped. Live streams always decode, and
  so does every terminal chunk in its own call: a waiting stream whose terminal chunk arrives gets a slot at
  once (a live stream that is not ending is preempted for it, whatever the queue's bounds), and so do the
  streams queued ahead of it, as far as the pool holds them.
* **Errors.** A request whose chunk is malformed (codes that are not an integer ``(n_vq, T)`` tensor, an empty
  id) gets a :class:`ChunkResult` with ``error`` set and nothing of its stream changes; the other requests of
  the batch decode normally. A batch holding the same request id twice is refused whole (``ValueError``)
  before anything changes. Codes outside ``[0, codebook_size)`` are clamped and counted. A pool step that
  raises (a CUDA out-of-memory error, say) fails the streams of its rows alone: each gets its audio decoded
  before the failure with ``error`` set, its slot is released, and later chunks under its id get that error
  until the request ends; every other stream decodes on, in that call and later ones. So does a pool call that
  raises while a stream is admitted, preempted (its state saved) or resumed (restored): that stream alone fails;
  a pool call made for several streams (the page reservation before a step) fails each of them, and a slot
  whose release raises is released as the next call begins (:mod:`.scheduler`). A call that raises past its
  argument checks otherwise ends the streams it touched and keeps the exception in :attr:`last_call_error`.
* **One caller.** A session is not thread-safe: one caller at a time, as vLLM's runner calls ``forward``. Its
  mutating methods (:meth:`decode`, :meth:`on_requests_finished`, :meth:`close`, the call-trace switches) raise
  ``RuntimeError`` when called while another of them runs, from another thread or from inside it (a
  generator of requests or ids, a callback); reads are not guarded.

The session imports nothing from vLLM; it runs wherever the pool runs.
"""

from __future__ import annotations

import functools
import gc
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import torch

from ..state import DecoderStatePool, build_pool
from ..state.spec import StateSpec
from .counters import SessionCounters
from .options import SessionOptions
from .requests import CheckedBatch, ChunkRequest, ChunkResult, check_batch, check_id_collection
from .scheduler import Scheduler
from .step_runner import StepRunner, capture_graphs, compiled_step
from .tracing import CallTrace, CallTracer

__all__ = ["CallTrace", "ChunkRequest", "ChunkResult", "CodecStreamSession", "collector_paused"]


class _CollectorPause:
    """The context of :func:`collector_paused`: a class, not a generator, so that nothing is allocated once the
    collector is back on and a collection that came due runs after the caller's block, not at its end."""

    def __enter__(self) -> None:
        self._collecting = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc_info) -> None:
        if self._collecting:
            gc.enable()  # last: the first allocation after the block runs whatever collection came due


def collector_paused() -> _CollectorPause:
    """Pause Python's garbage collector for the ``with`` block, a call every stream waits on, and resume it after
    (unless it was off already): a collection that comes due then runs after the call, at the caller's next
    allocation (docs/serving.md, "No collector pause inside a call"). A call makes no cyclic garbage of its own
    (serving/test_step_runner.py checks it), so nothing piles up. Nests: only the outermost block turns the
    collector back on."""
    return _CollectorPause()


def _one_caller(method):
    """Make ``method`` of a session refuse to start while another guarded method of that session runs: a
    non-blocking lock, so a second thread or a re-entrant call fails at once instead of corrupting streams."""
    name = method.__name__

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        if not self._caller.acquire(blocking=False):
            running = self._running or "another method"  # read without the lock: for the message only
            raise RuntimeError(
                f"CodecStreamSession.{name}() called while {running} of the same session runs (from another "
                "thread or from inside it); a session takes one caller at a time"
            )
        self._running = f"CodecStreamSession.{name}()"
        try:
            return method(self, *args, **kwargs)
        finally:
            self._running = None
            self._caller.release()

    return guarded


class CodecStreamSession:
    """Request-level streaming on top of a :class:`~..state.DecoderStatePool`.

    Args:
        decoder: the codec weights (any device; the pool lives on the same device).
        spec: the pool's resolved :class:`~..state.StateSpec` (kind, ring dtype, ring semantics, attention
            backend, paging); ``StateSpec.from_options`` builds one from loose pool options.
        options: the session's :class:`~.options.SessionOptions` (slots, codebooks, graph sizes, longest step,
            queue bounds, graph memory); the stage builds it with ``StageOptions.session_options()``.
        compile: ``False`` (eager), ``True`` (:func:`~..compile.compile_decode`), or a factory
            ``pool -> callable`` with the signature of ``step.decode_tensors`` less the pool (the stage passes
            vLLM's compiled adapter). The callable is used for graph capture; eager steps use it only for
            ``True`` (a factory's callable may skip guards; eager steps then take the validated step).

    Graphs are captured at construction when the decoder is on CUDA and ``options`` gives frame totals and frame
    sizes. A session takes one caller at a time (it is not thread-safe): a mutating method called while another
    runs raises ``RuntimeError`` naming both.

    Raises:
        TypeError: ``spec`` not a ``StateSpec``, ``options`` not a ``SessionOptions``, ``compile`` neither a bool
            nor a callable.
        ValueError: ``options.n_vq`` outside ``1..num_quantizers`` of the codec; a ``page_fraction`` or
            ``state_budget_bytes`` of ``spec`` refused by the paged pool, e.g. a budget too small for one stream
            (the message names the minimum).
        GraphMemoryError: the CUDA graphs do not fit ``options.graph_memory_bytes`` (the message names the sizes).
    """

    def __init__(
        self,
        decoder,
        spec: StateSpec,
        options: SessionOptions,
        *,
        compile: bool | Callable[[DecoderStatePool], Callable] = False,
    ):
        if not isinstance(spec, StateSpec):
            raise TypeError(f"CodecStreamSession: spec must be a StateSpec, got {type(spec).__name__}")
        if not isinstance(options, SessionOptions):
            raise TypeError(f"CodecStreamSession: options must be a SessionOptions, got {type(options).__name__}")
        if not (isinstance(compile, bool) or callable(compile)):
            raise TypeError(f"CodecStreamSession: compile must be a bool or a callable, got {compile!r}")
        cfg = decoder.config
        quantizers = cfg.num_quantizers
        if options.n_vq is not None and not 1 <= options.n_vq <= quantizers:
            raise ValueError(f"n_vq must be in 1..{quantizers} for this codec, got {options.n_vq!r}")
        self.options = options
        self.decoder, self.state_capacity, self.device = decoder, options.state_capacity, decoder.device
        self.n_vq = quantizers if options.n_vq is None else options.n_vq
        self.sample_rate, self.channels = int(cfg.sampling_rate), int(cfg.number_channels)
        self.samples_per_frame = int(cfg.samples_per_frame)
        self.graph_frame_sizes = [*options.graph_frame_sizes]
        self.pool = build_pool(decoder, spec)
        use_graphs = self.device.type == "cuda" and options.uses_graphs
        self.pool.initialize(self.state_capacity, self.pool.scratch_slots_for(self.state_capacity) if use_graphs else 0)
        self._counters, self._tracer = SessionCounters(), CallTracer()
        ladder = options.step_ladder
        compiled = compiled_step(self.pool, compile)
        graphs = (
            capture_graphs(self.pool, ladder, self.n_vq, compiled, options.graph_memory_bytes) if use_graphs else None
        )
        #: The step runner (:class:`~.step_runner.StepRunner`): cut, stage, dispatch, copy back.
        self.step_runner = StepRunner(
            self.pool, self.n_vq, ladder, self._counters, self._tracer, graphs=graphs,
            eager_step=compiled if compile is True else None,
        )  # fmt: skip
        #: The scheduler (:class:`~.scheduler.Scheduler`): streams, admission, preemption, the round.
        self.scheduler = Scheduler(
            self.pool, self.state_capacity, options.max_waiting_streams, options.max_waiting_frames, self._counters
        )
        self._closed = False
        self._caller, self._running = threading.Lock(), None  # _one_caller's lock, and the method holding it
        self._call_error: Exception | None = None

    # ------------------------------------------------------------------ properties
    @property
    def runner(self):
        """The CUDA-graph runner (``cuda_graph.StreamingGraphRunner``), or None without graphs."""
        return self.step_runner.graphs

    @property
    def max_step_frames(self) -> int:
        return self.options.max_step_frames

    @property
    def step_ladder(self):
        """How steps are shaped (``graph_ladder.StepLadder``): on CUDA, the frame totals whose graphs were
        captured."""
        return self.step_runner.ladder

    @property
    def max_piece_frames(self) -> int:
        """Most frames of one chunk decoded in one step (:attr:`~.step_runner.StepRunner.max_piece_frames`)."""
        return self.step_runner.max_piece_frames

    @property
    def max_step_rows(self) -> int:
        """Most rows in one step: the slot count."""
        return self.step_runner.max_step_rows

    @property
    def live_requests(self) -> dict[str, int]:
        """Copy of the live streams: request id -> its slot."""
        return {rid: s.slot for rid, s in self.scheduler.live.items()}

    @property
    def waiting_requests(self) -> list[str]:
        """Request ids waiting for a slot, oldest first."""
        return self.scheduler.waiting.request_ids

    @property
    def free_slots(self) -> int:
        """Slots that can still be acquired."""
        return self.pool.free_slot_count

    @property
    def clamped_codes(self) -> int:
        """Codes clamped into ``[0, codebook_size - 1]`` since construction, counted when a step gathers them (a
        chunk refused, or dropped while it waits, counts nothing; one whose step raises counts again if it is
        sent again). Reading it waits for the device when chunks arrived on it (their counts stay on the device
        until read)."""
        return self.step_runner.clamped_codes

    @property
    def last_call_error(self) -> Exception | None:
        """The ``Exception`` the last :meth:`decode` call raised past its argument checks (its streams were ended),
        or None: a caller tells a failure its requests met (an error for each of them) from a call it made
        wrongly (one refused before anything changed: this stays None)."""
        return self._call_error

    @property
    def call_traces(self) -> deque[CallTrace] | None:
        """Traces of the last calls (:meth:`enable_call_traces`); None while tracing is off."""
        return self._tracer.traces

    def stats(self) -> dict[str, object]:
        """Counters since construction: steps by path (``graph``/``eager``), decoded and padded frames (padding
        frames of rows in steps), padding rows (rows graph replays carried beyond their steps'), the admission
        queue (streams and frames waiting now, streams admitted after waiting, the longest wait in seconds),
        streams preempted for state memory (paged pools) with the host bytes of their saved states and the
        seconds saving and restoring took, the streams that ended by how many times each was preempted
        (``{preemptions: streams}``), clamped codes and requests refused or failed."""
        waiting = self.scheduler.waiting
        return self._counters.stats(len(waiting), waiting.buffered_frames, self.clamped_codes)

    # ------------------------------------------------------------------ lifecycle
    @_one_caller
    def on_requests_finished(self, request_ids: Iterable[str]) -> None:
        """Abort, disconnect or completion: release every slot these ids hold and drop their buffered chunks.
        Ids that are not live or waiting are ignored.

        Raises:
            TypeError: ``request_ids`` is a single ``str`` (or bytes), or not a collection at all (``None``); or an
                id in it is not a ``str`` (the ids before it are finished all the same).
            RuntimeError: another of the session's methods runs (one caller at a time; so do the methods below).
        """
        check_id_collection(request_ids, "request_ids")
        if not self._closed:
            self.scheduler.finish_requests(request_ids)

    @_one_caller
    def enable_call_traces(self, max_calls: int | None = 4096) -> deque[CallTrace]:
        """Record a :class:`CallTrace` of every later :meth:`decode` call in :attr:`call_traces` (the last
        ``max_calls``; None keeps all), for latency diagnosis. Costs a few clock reads a step, and a look at the
        tracing sessions on every garbage collection (one hook in ``gc.callbacks``, installed once per process;
        it holds no session alive). Enabling again starts a new, empty :attr:`call_traces`. Returns
        :attr:`call_traces`.

        Raises:
            ValueError: ``max_calls`` is not None or an integer in ``1..sys.maxsize``.
            RuntimeError: the session is closed, or another of its methods runs.
        """
        if self._closed:
            raise RuntimeError("this CodecStreamSession is closed")
        return self._tracer.enable(max_calls)

    @_one_caller
    def disable_call_traces(self) -> None:
        """Stop recording call traces; :attr:`call_traces` becomes None. Idempotent."""
        self._tracer.disable()

    @_one_caller
    def close(self) -> None:
        """Drop graphs and pool state. Idempotent; :meth:`decode` raises afterwards."""
        if self._closed:
            return
        self._closed = True
        self._tracer.disable()
        self.step_runner.close()
        self.pool.close()
        self.scheduler.clear()

    # ------------------------------------------------------------------ decode
    @_one_caller
    @torch.no_grad()
    def decode(self, requests: Sequence[ChunkRequest]) -> dict[str, ChunkResult]:
        """Decode one Stage-1 batch.

        Args:
            requests: at most one chunk per request id.
        Returns:
            A :class:`ChunkResult` for every request id in ``requests`` (with ``error`` set for a refused chunk,
            and beside the audio decoded before it for a stream whose pool step raised, or whose admission,
            preemption or resumption did; ``queued`` while the stream waits), plus one for every waiting
            stream that got a slot and was decoded in this call. A request whose id is not a non-empty ``str``
            gets its error under ``InvalidRequestId(position, request_id)`` (``serving.requests``), a key no
            other request shares. With :meth:`enable_call_traces`, the call also appends its :class:`CallTrace`.
        Raises:
            TypeError: ``requests`` is not a sequence of :class:`ChunkRequest`.
            ValueError: a request id appears twice. Nothing is modified.
            RuntimeError: the session is closed, or another of its methods runs (one caller at a time).
            Exception: whatever raised past those checks outside a pool step (an asynchronous device fault at the
                call's wait, say): every stream of the call's chunks, and every stream it admitted or scheduled,
                is ended as a failed step's are (refused until its request ends), and :attr:`last_call_error`
                holds the exception. Any other ``BaseException`` (``KeyboardInterrupt``) ends them the same
                way, :attr:`last_call_error` a ``RuntimeError`` naming it, and propagates.
        """
        if self._closed:
            raise RuntimeError("this CodecStreamSession is closed")
        tracing = self._tracer.traces is not None  # decided once per call
        started = time.perf_counter() if tracing else 0.0
        self._call_error = None
        batch = check_batch(requests, self.n_vq)
        if tracing:  # the batch's checks above count as planning
            self._tracer.begin(len(batch.keys), started)
        with collector_paused():
            return self._decode_guarded(batch)

    def _decode_guarded(self, batch: CheckedBatch) -> dict[str, ChunkResult]:
        # decode() past its argument checks: a failure ends the call's streams; host copies are awaited always.
        try:
            return self._decode_batch(batch)
        except BaseException as exc:
            self._tracer.fail()
            # The call's streams are in an unknown state: they end (docs/serving.md), whatever left the call (an
            # interrupt too: a stream that lost frames must not go on as if it had them).
            error = exc if isinstance(exc, Exception) else RuntimeError(f"interrupted by {type(exc).__name__}")
            self._call_error = error
            self.scheduler.abandon(list(batch.accepted), error)
            raise
        finally:
            self.step_runner.await_host_copies()  # after a failure too: no copy into a returned row outlives the call
            self._tracer.end()

    def _decode_batch(self, batch: CheckedBatch) -> dict[str, ChunkResult]:
        # decode() past its argument checks (which change nothing): the scheduler's rounds, each executed by the
        # step runner and taken back by the scheduler, until the scheduler says the call is done.
        results: dict[str, ChunkResult] = {}
        for key, error in batch.refused.items():
            self._counters.request_errors += 1
            results[key] = self._empty(error=error)
        audio: dict[str, list[torch.Tensor]] = {}
        failures: dict[str, str] = {}  # streams failed outside a step
        step_errors: dict[str, str] = {}  # streams whose step raised
        try:
            output = self.scheduler.schedule(batch.accepted)
            for rid, error in output.refused.items():
                self._counters.request_errors += 1
                results[rid] = self._empty(error=error)
            while True:
                failures.update(output.failures)
                result = self.step_runner.execute(output)
                for rid, rows in result.audio.items():
                    audio.setdefault(rid, []).extend(rows)
                update = self.scheduler.update(output, result)
                step_errors.update(update.step_errors)
                failures.update(update.failures)
                if not update.schedule_again:
                    break
                output = self.scheduler.schedule()
        finally:
            # Whatever happened above, no buffered chunk outlives this call as the caller's tensor.
            self.scheduler.own_buffered_chunks(list(batch.accepted))
        for rid, error in {**failures, **step_errors}.items():
            refused = results.get(rid)  # this call's chunk under the id was refused too: both errors
            if refused is not None and refused.error == error:
                continue  # it failed as the call began (admitted from the queue): its chunk got the error already
            self._counters.request_errors += 1
            results[rid] = self._empty(error=error if refused is None else f"{refused.error}; {error}")
        return self._results(results, audio, batch.keys)

    def _results(self, results, audio, ids) -> dict[str, ChunkResult]:
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
                results[rid] = self._empty(queued=rid in self.scheduler.waiting)
        self.step_runner.await_host_copies()
        for rid, (parts, error) in joined.items():
            results[rid] = self._result(torch.cat(parts, dim=-1), error)
        return results

    def _result(self, wav: torch.Tensor, error: str | None) -> ChunkResult:
        return ChunkResult(wav, self.sample_rate, wav.shape[-1] // self.samples_per_frame, error)

    def _empty(self, *, error: str | None = None, queued: bool = False) -> ChunkResult:
        return ChunkResult(torch.zeros(self.channels, 0, dtype=torch.float32), self.sample_rate, 0, error, queued)
