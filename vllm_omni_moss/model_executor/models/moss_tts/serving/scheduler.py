# SPDX-License-Identifier: Apache-2.0
"""The scheduler: which streams are live, which wait, who is admitted, who is preempted; it owns the round.

A decode call is one or more rounds, as vLLM's engine step is ``schedule()`` -> model runner ->
``update_from_output()``: :meth:`Scheduler.schedule` routes the call's chunks (its first round), admits, preempts and
takes every ready stream's chunks into one frozen :class:`SchedulerOutput`; the step runner decodes it and hands back
a frozen result; :meth:`Scheduler.update` counts what was decoded, ends the streams that finished or failed and says,
in a frozen :class:`SchedulerUpdate`, whether their slots let waiting streams in (another round) or the call is done.

A stream holds one pool slot from its first chunk with codes to its terminal chunk or an abort. New streams
beyond the free slots wait in a FIFO :class:`~.streams.AdmissionQueue`; their chunks are buffered in order
and decoded once a slot frees. The scheduler asks the pool one question, :meth:`reserve` (can these slots
hold this much context? a paged pool allocates the pages, or nothing): before admitting a stream (the live
streams' buffered and incoming chunks first, then the newcomer's) and before a step (every ready stream's
buffered chunks). When the ready streams do not fit, it preempts a live stream (its state saved to host
memory; it waits ahead of new streams and resumes exactly) and asks again. Unpaged pools always answer yes, so
nothing is ever preempted there.

Fairness (docs/memory.md, "Paged rings"): the victim is the live stream, not ending, preempted the fewest
times so far (the youngest among those), so no stream is preempted again before every other such stream has
been preempted as often; and new streams are admitted in the order they arrived: a stream whose terminal chunk
must be decoded at once takes the new streams queued ahead of it along, as far as the pool holds them
(:meth:`_admit_ending`).

Every pool call the scheduler makes is contained (docs/serving.md, "A pool call that raises outside a step"): one
that raises an ``Exception`` while a stream is admitted, preempted (its state saved, its slot freed) or resumed
(its state restored) fails that stream alone, as a failing step fails its rows' streams (:meth:`Scheduler.update`):
its slot is released (reset), its buffered chunks are dropped, and the call goes on. A call made for several
streams at once that raises fails each of them, with an error naming the call: the reservation of every ready
stream's pages before a step (:meth:`Scheduler.schedule`), or of the live streams' pages before an admission. A
release of several slots that raises is retried slot by slot; a slot whose own release raises fails its stream
(a stream that ended gets the error beside its audio) and is released again as the next call begins
(:attr:`SlotReleases.unreleased`), so no slot or page is lost to a passing failure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from .counters import SessionCounters
from .requests import ChunkRequest
from .streams import AdmissionQueue, ScheduledChunks, Stream

__all__ = ["Scheduler", "SchedulerOutput", "SchedulerUpdate", "SlotReleases", "StreamTable"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One round of a decode call as :meth:`Scheduler.schedule` decided it, for the step runner.

    Attributes:
        chunks: every ready stream's buffered chunks, taken out of its stream (slots in use, state reserved for
            every frame), in the order the streams became live.
        refused: request id -> the error of each of the call's chunks refused as it was routed (an admission bound,
            a refused or ended id), in the call's order; only the call's first round routes chunks.
        admitted: request ids given a slot in this round (new streams and waiting ones), in order.
        resumed: those of ``admitted`` that were preempted and got their saved state back.
        preempted: request ids whose state was saved to the host and slot freed in this round, in order.
        failures: request id -> the error of each stream that a pool call failed in this round outside a step
            (admission, preemption, resumption, a page reservation), in order.
        ending: request ids of the live streams whose terminal chunk has arrived: they end after this round's steps.
    """

    chunks: tuple[ScheduledChunks, ...] = ()
    refused: Mapping[str, str] = field(default_factory=dict)
    admitted: tuple[str, ...] = ()
    resumed: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()
    failures: Mapping[str, str] = field(default_factory=dict)
    ending: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SchedulerUpdate:
    """What :meth:`Scheduler.update` made of a round's result.

    Attributes:
        step_errors: request id -> the error of each stream whose step raised (the runner's error, with a failed
            release of its slot added): the stream was ended.
        failures: request id -> the error of each stream that failed as the round ended outside a step: its slot's
            release raised as it ended, or its terminal chunk got no slot in the call (the call's last round).
        schedule_again: streams ended in this round while others wait: :meth:`Scheduler.schedule` admits them in
            another round of the same call. False: the call is done.
    """

    step_errors: Mapping[str, str] = field(default_factory=dict)
    failures: Mapping[str, str] = field(default_factory=dict)
    schedule_again: bool = False


class _RoundLog:
    """What happened to streams while one round is scheduled or updated (frozen into its output)."""

    __slots__ = ("admitted", "failures", "preempted", "resumed")

    def __init__(self):
        self.admitted: list[str] = []
        self.resumed: list[str] = []
        self.preempted: list[str] = []
        self.failures: dict[str, str] = {}


class StreamTable:
    """The streams of one session and how they end: finished, failed (contained), aborted or abandoned.

    Args:
        pool: the initialised pool.
        max_waiting_streams / max_waiting_frames: the admission queue's bounds.
        counters: the session's counters.

    Attributes:
        live: request id -> its live :class:`~.streams.Stream`, in the order they became live.
        waiting: the :class:`~.streams.AdmissionQueue`.
        refused: request id -> the error every later chunk under the id gets until the request ends.
        releases: the contained slot releases (:class:`SlotReleases`).
    """

    def __init__(self, pool, max_waiting_streams: int, max_waiting_frames: int, counters):
        self.pool = pool
        self.live: dict[str, Stream] = {}
        self.waiting = AdmissionQueue(max_waiting_streams, max_waiting_frames)
        self.counters: SessionCounters = counters
        # Request id -> the error its refused chunk got: every later chunk under the id gets it too, until the
        # request ends (its terminal chunk, or finish_requests), so a refused request never resumes from zero.
        self.refused: dict[str, str] = {}
        # Slot releases that never raise; slots whose release raised are released again as the next call begins.
        self.releases = SlotReleases(pool)
        self._touched: set[str] = set()  # the streams the running call admitted or scheduled (abandon() ends them)
        self._log = _RoundLog()  # what happened to streams in the round being scheduled or updated

    def _end(self, streams: list[Stream]) -> None:
        """Remove finished live ``streams`` and release their slots. A stream whose slot's release raises gets the
        error beside its audio (the round's ``failures``); its slot is released again as the next call begins."""
        for stream in streams:
            del self.live[stream.request_id]
            self.counters.count_ended(stream.preemptions)
        failed = self.releases.release([s.slot for s in streams])
        for stream in streams:
            exc = failed.get(stream.slot)
            if exc is not None:
                rid = stream.request_id
                error = _error(rid, "releasing its decoder slot as it ended", 0, exc)
                logger.error("MOSS codec: %s", error, exc_info=exc)
                stream.error, self._log.failures[rid] = error, error

    def _fail(self, errors: dict[str, str]) -> None:
        """End the live streams of ``errors`` (request id -> error) whose step raised: their slots are released
        (reset; their state is unknown). A stream that has not got its terminal chunk stays refused with its
        error until its request ends, so that it never resumes from an empty state. A slot whose release raises
        adds that to its stream's error (in ``errors``) and is released again as the next call begins."""
        streams = [self.live.pop(rid) for rid in errors]
        failed = self.releases.release([s.slot for s in streams])
        for stream in streams:
            rid = stream.request_id
            exc = failed.get(stream.slot)
            if exc is not None:
                logger.error("MOSS codec: request %r: releasing its decoder slot failed", rid, exc_info=exc)
                errors[rid] = f"{errors[rid]}; releasing its decoder slot failed with {type(exc).__name__}: {exc}"
            if not stream.finished:
                self.refused[rid] = errors[rid]

    def _failed(self, stream: Stream, what: str, undecoded: int | None, exc: Exception) -> None:
        """End ``stream`` (live or waiting) because a pool call for it (``what``) raised ``exc`` outside a step, as
        :meth:`_fail` ends a failing step's streams: its error (naming ``what``, the exception and the ``undecoded``
        frames) is logged once with the traceback and kept in the round's ``failures`` and ``stream.error``; the slot it
        holds is released (reset: its state is unknown); its buffered chunks and saved state are dropped; a stream
        without its terminal chunk stays refused until its request ends."""
        rid = stream.request_id
        error = _error(rid, what, undecoded, exc)
        logger.error("MOSS codec: %s", error, exc_info=exc)
        stream.error, stream.chunks, stream.saved = error, [], None
        self._log.failures[rid] = error
        self.live.pop(rid, None)
        self.waiting.drop(rid)
        if not stream.finished:
            self.refused[rid] = error
        if stream.slot is not None:
            slot, stream.slot = stream.slot, None
            self.releases.release([slot])  # a slot whose release raises is released again as the next call begins

    def abandon(self, accepted: list[ChunkRequest], exc: Exception) -> None:
        """The call raised ``exc`` past its checks, at a point nobody knows: end every stream it may have changed
        (those of its ``accepted`` chunks, and those it admitted or scheduled) as :meth:`_failed` does, the error
        naming the call; an id of a chunk that is not terminal stays refused even without a stream, so that no
        stream resumes from an empty state."""
        ids = dict.fromkeys([*(req.request_id for req in accepted), *sorted(self._touched)])
        finished = {req.request_id for req in accepted if req.finished}
        for rid in ids:
            stream = self.live.get(rid) or self.waiting.get(rid)
            if stream is not None:
                self._failed(stream, "its decode call", None, exc)
            elif rid not in finished and rid not in self.refused:
                self.refused[rid] = _error(rid, "its decode call", None, exc)

    # ------------------------------------------------------------------ lifecycle
    def finish_requests(self, request_ids) -> None:
        """Abort, disconnect or completion: release every slot these ids hold and drop their buffered chunks.
        Ids that are neither live nor waiting are ignored.

        Raises:
            TypeError: an id that is not a ``str`` (the ids before it are finished all the same).
        """
        released = []
        try:
            for rid in request_ids:
                if not isinstance(rid, str):  # str() of it could end another request's stream ("None", "1")
                    raise TypeError(f"request ids must be str, got {rid!r}")
                waiting = self.waiting.get(rid)
                if waiting is not None and waiting.buffered_frames:
                    logger.error(
                        "MOSS codec: request %r ended while waiting for %s; its %d buffered frames are dropped "
                        "undecoded",
                        rid,
                        "decoder state pages (preempted)" if waiting.saved is not None else "a slot",
                        waiting.buffered_frames,
                    )
                self.waiting.drop(rid)
                self.refused.pop(rid, None)
                stream = self.live.pop(rid, None)
                if stream is not None:
                    released.append(stream.slot)
                for ended in (waiting, stream):
                    if ended is not None:
                        self.counters.count_ended(ended.preemptions)
        finally:
            # An iterable that fails part-way still frees the slots of the streams it ended; a slot whose release
            # raises is logged and released again as the next call begins (its request has ended: no one to tell).
            self.releases.release(released)

    def own_buffered_chunks(self, accepted: list[ChunkRequest]) -> None:
        """Copy the chunks of this call (``accepted``) that are still buffered as it returns (streams that wait,
        or were preempted), so that the caller may reuse its tensors. Looks only at the streams of ``accepted``
        (a call's work stays proportional to its chunks, not to the live streams)."""
        borrowed = {id(req.codes) for req in accepted}
        for rid in {req.request_id for req in accepted}:
            stream = self.live.get(rid) or self.waiting.get(rid)
            if stream is not None and any(id(c) in borrowed for c in stream.chunks):
                stream.chunks = [c.clone() if id(c) in borrowed else c for c in stream.chunks]

    def clear(self) -> None:
        self.live.clear()
        self.waiting.clear()
        self.releases.unreleased.clear()


class Scheduler(StreamTable):
    """Streams of one session over one pool.

    Args:
        pool: the initialised pool.
        capacity: live streams at most (for messages).
        max_waiting_streams / max_waiting_frames: the admission queue's bounds.
        counters: the session's counters.

    Its streams, and how they end, are its :class:`StreamTable`'s.
    """

    def __init__(self, pool, capacity: int, max_waiting_streams: int, max_waiting_frames: int, counters):
        super().__init__(pool, max_waiting_streams, max_waiting_frames, counters)
        self.capacity = capacity
        # The round last scheduled, until update() takes it back: its chunks left their streams, so a round is
        # scheduled only once the one before it holding chunks was updated, and each round is updated once.
        self._round: SchedulerOutput | None = None
        # Working state of the call being scheduled, set by its first round: frames of its chunks not yet routed
        # (per id), and whether the live streams' pending chunks hold their pages.
        self._incoming: dict[str, int] = {}
        self._live_reserved = False

    # ------------------------------------------------------------------ the round
    def schedule(self, chunks: Sequence[ChunkRequest] | None = None) -> SchedulerOutput:
        """Schedule the next round of a decode call.

        Args:
            chunks: the call's chunks, each already valid (``requests.check_batch``), at most one per id: given to
                the call's first round, which routes them to their streams (after admitting waiting streams to the
                slots freed since the last call); None for the rounds after it (:attr:`SchedulerUpdate.schedule_again`).
        Returns:
            The round, frozen: waiting streams admitted while they fit (those whose terminal chunk arrived first,
            preempting live streams for them), every ready stream's chunks (their state reserved, preempting
            live streams when a paged pool runs short), and what happened to streams on the way.
        Raises:
            RuntimeError: the round scheduled before holds chunks or ending streams that :meth:`update` has not
                taken back (its chunks have left their streams: scheduling again would lose them).
        """
        pending = self._round
        if pending is not None and (pending.chunks or pending.ending):
            raise RuntimeError(
                "Scheduler.schedule: the round scheduled before holds chunks that update() has not taken back; "
                "scheduling again would lose their frames"
            )
        self._log = log = _RoundLog()
        refused: dict[str, str] = {}
        if chunks is not None:
            self._begin_call(chunks)
            for req in chunks:
                error = self._accept(req)
                if error is not None:
                    refused[req.request_id] = error
        self._admit_waiting()
        self._admit_ending()
        ready = self._ready()
        work = tuple(ScheduledChunks(s.request_id, s.slot, tuple(s.chunks)) for s in ready)
        for s in ready:
            s.chunks = []
            self._touched.add(s.request_id)
        self._round = SchedulerOutput(
            work, MappingProxyType(refused), tuple(log.admitted), tuple(log.resumed), tuple(log.preempted),
            MappingProxyType(dict(log.failures)), tuple(rid for rid, s in self.live.items() if s.finished),
        )  # fmt: skip
        return self._round

    def update(self, output: SchedulerOutput, result) -> SchedulerUpdate:
        """Take back what the step runner decoded of ``output`` (``result``, a ``step_runner.RunnerOutput``):
        advance each stream's frames decoded (a stream whose step failed counts the pieces decoded before it), end
        the streams whose step raised (:meth:`_fail`) and the streams of ``output.ending`` (their slots released).
        When streams ended while others wait, the call goes on (another :meth:`schedule`); otherwise it is done and
        a waiting stream whose terminal chunk got no slot fails (:meth:`_fail_stranded_endings`).

        Raises:
            RuntimeError: ``output`` is not the round last scheduled (it was updated already, or another round was
                scheduled after it): its frames would be counted twice.
        """
        if output is not self._round:
            raise RuntimeError(
                "Scheduler.update: this round is not the one last scheduled (updated already, or scheduled before "
                "another); its frames would be counted twice"
            )
        self._round = None
        self._log = log = _RoundLog()
        for rid, frames in result.decoded_frames.items():
            self.live[rid].frames_decoded += frames
        step_errors = dict(result.errors)
        if step_errors:
            self._fail(step_errors)
        self._end([self.live[rid] for rid in output.ending if rid not in step_errors])
        again = bool(output.ending) and bool(self.waiting)
        if not again:
            self._fail_stranded_endings()
        return SchedulerUpdate(MappingProxyType(step_errors), MappingProxyType(dict(log.failures)), again)

    def abandon(self, accepted: list[ChunkRequest], exc: Exception) -> None:
        """:meth:`StreamTable.abandon`; the round in flight is dropped with the streams it held."""
        self._round = None
        super().abandon(accepted, exc)

    def clear(self) -> None:
        self._round = None
        super().clear()

    def _begin_call(self, chunks: Sequence[ChunkRequest]) -> None:
        # The call's first round: admission accounts for its chunks' frames; slots freed since the last call go to
        # waiting streams first.
        self._incoming, self._touched, self._live_reserved = {}, set(), False
        self.releases.retry()  # slots a failed release left in use: their streams are gone, the slots come back
        for req in chunks:
            self._incoming[req.request_id] = self._incoming.get(req.request_id, 0) + req.codes.shape[1]
        self._admit_waiting()

    # ------------------------------------------------------------------ admission
    def _reserve_live(self) -> bool:
        # Once per call: every live stream's buffered and incoming frames get their state first, so that
        # admitting a newcomer never makes a live stream run short (a paged pool would then preempt).
        if not self._live_reserved:
            targets, streams = {}, []
            for rid, s in self.live.items():
                pending = s.buffered_frames + self._incoming.get(rid, 0)
                if pending:
                    targets[s.slot] = s.frames_decoded + pending
                    streams.append(s)
            try:
                self._live_reserved = self.pool.reserve(targets)
            except Exception as exc:  # no one stream to blame: each of them fails; the others need no pages
                what = f"reserving decoder state pages for the live streams' chunks ({len(streams)} streams)"
                for s in streams:
                    self._failed(s, what, s.buffered_frames + self._incoming.get(s.request_id, 0), exc)
                self._live_reserved = True
        return self._live_reserved

    def _admit(self, stream: Stream, chunk_frames: int) -> bool:
        """Give ``stream`` (not live) a slot holding its decoded frames plus ``chunk_frames`` more (all it has
        buffered and brings in this call), restoring a preempted stream's state into it; False when no slot or
        state is free (nothing changed), or when a pool call raised: the stream then failed (:meth:`_failed`,
        ``stream.error`` set)."""
        what = "admitting it to a decoder slot"
        try:
            if not self.pool.free_slot_count or not self._reserve_live():
                return False
            stream.slot = self.pool.acquire()
            if not self.pool.reserve({stream.slot: stream.frames_decoded + chunk_frames}):
                what = "returning the decoder slot it could not get pages for"
                self.pool.release([stream.slot])  # the slot is back on top of the free list, as it was
                stream.slot = None
                return False
            resumed = stream.saved is not None
            if resumed:  # a preempted stream resumes exactly where it stopped
                what = "restoring its preempted decoder state"
                started = time.perf_counter()
                self.pool.restore_slot(stream.slot, stream.saved)
                stream.saved = None
                self.counters.preemption_s += time.perf_counter() - started
        except Exception as exc:  # this stream fails, the call goes on (docs/serving.md, "A step that raises")
            self._failed(stream, what, chunk_frames, exc)
            return False
        self.live[stream.request_id] = stream
        self._touched.add(stream.request_id)
        self._log.admitted.append(stream.request_id)
        if resumed:
            self._log.resumed.append(stream.request_id)
        return True

    def _admit_waiting(self) -> None:
        """Admit waiting streams, oldest first, while they fit (slots a failed release set aside are released
        again first: a passing failure then costs no stream its slot)."""
        self.releases.retry()
        while self.waiting:
            oldest = self.waiting.peek_oldest()
            # All it has buffered and brings in this batch: what the step that follows needs state for.
            pending = oldest.buffered_frames + self._incoming.get(oldest.request_id, 0)
            if self._admit(oldest, pending):
                _admitted(self.waiting.pop_oldest(), self.counters)
            elif oldest.error is None:  # no room (a stream that failed has left the queue: the next one may fit)
                return

    def _accept(self, req: ChunkRequest) -> str | None:
        """Route one valid chunk to its live or waiting stream, or start one. Returns an error or None."""
        rid, frames = req.request_id, req.codes.shape[1]
        self._incoming.pop(rid, None)
        refused = self.refused.pop(rid, None) if req.finished else self.refused.get(rid)
        if refused is not None:
            return refused
        return self._route(req, rid, frames)

    def _refuse(self, req: ChunkRequest, error: str) -> str:
        # An admission bound refused the request: it stays refused until it ends.
        if not req.finished:
            self.refused[req.request_id] = error
        return error

    def _route(self, req: ChunkRequest, rid: str, frames: int) -> str | None:
        stream = self.live.get(rid) or self.waiting.get(rid)
        if stream is None:
            if frames == 0:
                return None  # nothing to decode and no stream to end
            stream = Stream(rid, finished=req.finished)
            if self.waiting or not self._admit(stream, frames):
                if stream.error is not None:
                    return None  # it failed: its error comes back with the call's failures, the chunk is dropped
                # A terminal chunk is never refused by the queue's bounds: _admit_ending gives it a slot in
                # this call (preempting a live stream that is not ending), so it does not stay buffered.
                error = None if req.finished else self.waiting.refusal(frames, new_stream=True, capacity=self.capacity)
                if error is not None:
                    return self._refuse(req, error)
                self.waiting.push(stream)
                logger.info("MOSS codec: stream %r waits for a slot (%d waiting)", rid, len(self.waiting))
        elif stream.finished and frames and stream.slot is None:
            # The id's last stream got its terminal chunk while waiting for a slot (only a waiting stream
            # outlives the call of its terminal chunk): a new stream cannot start under the id yet, and the chunk
            # must not join the ended one.
            return (
                f"request {rid!r}: the stream that last used this id has ended but still waits for a slot "
                f"({stream.buffered_frames} frames queued); a new stream may use the id once that one's audio "
                f"has been returned"
            )
        elif stream.slot is None and frames and stream.saved is None and not req.finished:
            # A preempted stream (saved state) was live: its chunks are always kept, whatever the bounds; so
            # is a terminal chunk (_admit_ending decodes it in this call).
            error = self.waiting.refusal(frames, new_stream=False, capacity=self.capacity)
            if error is not None:
                self.waiting.drop(rid)
                self.counters.count_ended(stream.preemptions)
                return self._refuse(req, f"{error}; the waiting stream's buffered chunks were dropped")
        if frames:
            # Chunks stay as they arrived (dtype, device) until a step gathers them: host chunks then travel in
            # one pinned copy and every step clamps its codes once (the step runner); no per-chunk op here.
            if rid in self.waiting:
                self.waiting.add_chunk(stream, req.codes)
            else:
                stream.chunks.append(req.codes)
        stream.finished = stream.finished or req.finished
        return None

    # ------------------------------------------------------------------ steps
    def _ready(self) -> list[Stream]:
        """The live streams with buffered chunks, their state reserved: preempts live streams that are not
        ending (:meth:`_victim`) until the pool holds the context every ready stream is about to reach (only a
        paged pool can run short). A preempted stream's state goes to host memory and it waits, ahead of new
        streams, to resume exactly; its chunks stay buffered. Streams that only wait to end give their state
        back first."""
        ready = [s for s in self.live.values() if s.chunks]
        while ready and not self._reserve_ready(ready):
            done = [s for s in self.live.values() if s.finished and not s.chunks]
            if done:
                self._end(done)
                continue
            # Only when every live stream ends is the youngest of them preempted; the session then admits it
            # again, in the same call, once the others have ended.
            victim = self._victim() or next(reversed(self.live.values()))
            self._preempt(victim)
            ready = [s for s in ready if s is not victim]
        return ready

    def _reserve_ready(self, ready: list[Stream]) -> bool:
        """The pool's answer for the pages of every ``ready`` stream's next step. When the call raises, no one
        stream is to blame: each of them fails (:meth:`_failed`, the error naming the reservation), ``ready`` is
        emptied and the answer is True (nothing is left to reserve for)."""
        try:
            return self.pool.reserve({s.slot: s.frames_decoded + s.buffered_frames for s in ready})
        except Exception as exc:
            what = f"reserving decoder state pages for the step of the {len(ready)} ready streams"
            for s in ready:
                self._failed(s, what, s.buffered_frames, exc)
            ready.clear()
            return True

    def _victim(self, protected: set[str] | frozenset[str] = frozenset()) -> Stream | None:
        """The live stream to preempt: not ending (a stream whose terminal chunk arrived must be decoded in
        this call), not in ``protected``, preempted the fewest times so far, and the youngest (admitted last)
        among those; None when there is none."""
        candidates = [s for s in self.live.values() if not s.finished and s.request_id not in protected]
        if not candidates:
            return None
        fewest = min(s.preemptions for s in candidates)
        return next(s for s in reversed(candidates) if s.preemptions == fewest)

    def _admit_ending(self) -> None:
        """Admit every waiting stream whose terminal chunk has arrived, oldest first, preempting live streams
        that are not ending (:meth:`_victim`) to make room: the engine finishes a request right after its
        terminal step, so its audio must come out in this call. Then the new streams (never live) that waited
        ahead of the last of them are admitted too, in arrival order, preempting live streams not admitted
        here, until one does not fit: a new stream is not overtaken by a later one while the pool can hold it.
        (Preempted streams wait at the head of the queue and resume as pages free, in :meth:`_admit_waiting`.)
        When every live stream ends in this call too, their slots free first (the session decodes again before
        it returns)."""
        queue = self.waiting.request_ids
        ending = [rid for rid in queue if self.waiting.get(rid).finished]
        if not ending:
            return
        admitted: set[str] = set()
        for rid in ending:
            if not self._admit_preempting(self.waiting.get(rid), admitted):
                return
        for rid in queue[: queue.index(ending[-1])]:
            stream = self.waiting.get(rid)
            if stream is not None and stream.saved is None and not self._admit_preempting(stream, admitted):
                return

    def _fail_stranded_endings(self) -> None:
        """Fail every waiting stream whose terminal chunk arrived but that got no slot in this call: the engine
        finishes its request after the call, so it ends here with an error its client sees rather than queued.
        Only a pool call that raised can leave one (:meth:`_admit_ending` preempts for it otherwise)."""
        for rid in self.waiting.request_ids:
            stream = self.waiting.get(rid)
            if stream is not None and stream.finished and stream.error is None:
                reason = RuntimeError("no decoder slot could be freed for it in this call")
                self._failed(stream, "decoding its terminal chunk", stream.buffered_frames, reason)

    def _admit_preempting(self, stream: Stream, admitted: set[str]) -> bool:
        """Admit waiting ``stream``, preempting live streams not in ``admitted`` while it does not fit; adds
        it to ``admitted``. False (it still waits) when no stream is left to preempt."""
        rid = stream.request_id
        while not self._admit(stream, stream.buffered_frames + self._incoming.get(rid, 0)):
            if stream.error is not None:
                return True  # it failed and left the queue: the streams behind it go on
            victim = self._victim(admitted)
            if victim is None:
                return False
            self._preempt(victim)
        self.waiting.drop(rid)
        _admitted(stream, self.counters)
        admitted.add(rid)
        return True

    def _preempt(self, victim: Stream) -> None:
        """Save live ``victim``'s state to the host, free its slot and queue it ahead of new streams. When saving
        raises, the victim fails instead (its state never reached the host, it cannot resume); its slot is
        freed all the same."""
        started = time.perf_counter()
        try:
            victim.saved = self.pool.save_slot(victim.slot)
        except Exception as exc:  # whatever part of the state was copied is dropped with the stream
            undecoded = victim.buffered_frames + self._incoming.get(victim.request_id, 0)
            self._failed(victim, "saving its decoder state to preempt it", undecoded, exc)
            return
        failed = self.releases.release([victim.slot])
        if failed:  # its state is saved, but the slot it leaves is not free: it cannot wait to resume
            victim.slot = None  # set aside in self.releases.unreleased
            undecoded = victim.buffered_frames + self._incoming.get(victim.request_id, 0)
            self._failed(victim, "freeing its decoder slot to preempt it", undecoded, next(iter(failed.values())))
            return
        self.counters.preemption_s += time.perf_counter() - started
        self.counters.preempted_bytes += victim.saved.nbytes
        victim.slot = None
        victim.preemptions += 1
        del self.live[victim.request_id]
        self.waiting.push_preempted(victim)
        self.counters.preemptions += 1
        self._log.preempted.append(victim.request_id)
        logger.info("MOSS codec: stream %r preempted to free decoder state pages", victim.request_id)


class SlotReleases:
    """The scheduler's releases of pool slots, contained: a release that raises never escapes a call.

    Args:
        pool: the pool whose slots are released.

    Attributes:
        unreleased: slots whose own release raised: still in use, their state unknown; :meth:`retry` releases
            them again (the scheduler does as each call begins).
    """

    def __init__(self, pool):
        self.pool = pool
        self.unreleased: list[int] = []

    def release(self, slots: list[int]) -> dict[int, Exception]:
        """Release (reset) ``slots``, never raising an ``Exception``: when the call raises, each slot still in use
        is released alone. Returns the slots whose own release raised, with the exception: they are set aside in
        :attr:`unreleased`."""
        if not slots:
            return {}
        try:
            self.pool.release(slots)
            return {}
        except Exception as exc:
            if len(slots) == 1:
                failed = {slots[0]: exc}
            else:
                logger.warning("MOSS codec: releasing decoder slots %s raised; releasing them one by one", slots)
                failed = {}
                for slot in slots:
                    try:
                        if slot in self.pool.slots_in_use:  # a pool that released part of them keeps it
                            self.pool.release([slot])
                    except Exception as one:
                        failed[slot] = one
        for slot, exc in failed.items():
            logger.error("MOSS codec: releasing decoder slot %d failed; retried as the next call begins", slot,
                         exc_info=exc)  # fmt: skip
        self.unreleased.extend(failed)
        return failed

    def retry(self) -> None:
        """Release again the slots a failed release left in use (their streams are gone)."""
        if self.unreleased:
            slots, self.unreleased = self.unreleased, []
            self.release([slot for slot in slots if slot in self.pool.slots_in_use])


def _admitted(stream: Stream, counters: SessionCounters) -> None:
    """End waiting ``stream``'s wait, now that it holds a slot: counted and logged."""
    waited = time.monotonic() - stream.waiting_since
    stream.waiting_since = None
    counters.count_admitted(waited)
    logger.info("MOSS codec: stream %r got slot %d after waiting %.3f s", stream.request_id, stream.slot, waited)


def _error(rid: str, what: str, undecoded: int | None, exc: BaseException) -> str:
    """The error of a stream that a pool call (``what``) failed outside a step; ``undecoded``: its frames left
    undecoded, None when they are not known."""
    error = f"request {rid!r}: {what} failed with {type(exc).__name__}: {exc}; the stream was ended"
    return error if undecoded is None else f"{error}, frames left undecoded: {undecoded}"
