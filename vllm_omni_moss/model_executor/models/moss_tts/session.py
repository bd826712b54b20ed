# SPDX-License-Identifier: Apache-2.0
"""Streaming session: many request streams multiplexed onto one decoder state pool.

The Stage-1 codec receives, per engine step, one chunk of codes per request
(codec-facts §C.2-§C.5). :class:`CodecStreamSession` turns such a batch into pool
steps and keeps the bookkeeping a pool does not know about:

* **Slots.** A request holds one pool slot from its first chunk to its terminal
  chunk (or an abort). Free slots are a LIFO stack, so the slot released last is
  leased next (its rings are still warm in cache); the first leases are 0, 1, 2...
* **Steps.** All rows of a pool step share ``T`` frames, so the rows of a batch are
  grouped by ``T`` and each group is one step. A chunk longer than
  ``max_step_frames`` is decoded as consecutive single-row steps of at most that
  many frames (its audio is concatenated).
* **Tail coalescing (opt-in, off by default).** With ``coalesce_tails=True`` a terminal
  chunk may be right-padded with zero codes to the smallest graph frame size ``>= T``
  so that it shares a step (and a CUDA graph) with steady chunks, as upstream does;
  its audio is cut back to its own ``T``. This CHANGES the tail's audio: v2 rings
  scatter the whole (padded) chunk before attending, so once a ring is full the
  padding tokens evict keys that the real frames' queries still read (codec-facts
  §B.5; measured on the H200 with v2 geometry: max error 0.019 against an RMS of
  0.009 for a 3-frame tail padded to 15). Off by default: tails run at their own
  ``T`` (eager when no graph has that ``T``). When on, it is allowed only if the
  largest graph batch bucket covers the whole capacity (a merged group could
  otherwise outgrow every bucket); the slot is reset right after the step, so
  padding never reaches a later stream.
* **Terminal chunks.** After the step that decodes a request's terminal chunk its
  slot is reset and returned to the free list.
* **Ended streams.** The ids of ended streams are remembered in a bounded LRU
  (``ended_memory`` ids) together with how they ended, to tell a late chunk from a
  reused id. The rule:

  - ended by its terminal chunk ("finished"): Stage 0 emits a request's chunks in
    order with the terminal one last, so a later chunk *with codes* can only be a new
    stream under the same id: it starts fresh. A later meta-only payload (``T == 0``)
    is a duplicate terminal and is dropped.
  - ended by :meth:`CodecStreamSession.on_requests_finished` while live, or reported
    there before any chunk arrived ("aborted"): chunks still in flight from Stage 0
    are late; every later chunk is dropped without creating state, until one carries
    ``finished=True`` (the aborted stream's tail has drained; the id may then be
    reused) or the id ages out of the LRU.
  - ``on_requests_finished`` for an id that already finished keeps it "finished"
    (the runner reports normal completions there too).

The session imports nothing from vLLM; it runs wherever the pool runs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from .decoder import CodecDecoder
from .state_pool import DecoderStatePool, make_state_pool

__all__ = ["ChunkRequest", "ChunkResult", "CodecStreamSession"]

_FINISHED = "finished"
_ABORTED = "aborted"


@dataclass(frozen=True)
class ChunkRequest:
    """One request's chunk in a Stage-1 batch.

    Attributes:
        request_id: stream key (the Stage-0 request id).
        codes: ``(n_vq, T)`` integer codes, codebook-major, on any device. ``T`` may be
            0 for a meta-only terminal payload. Values outside the codebook are clamped.
        finished: True for the stream's terminal chunk.
    """

    request_id: str
    codes: torch.Tensor
    finished: bool = False


@dataclass(frozen=True)
class ChunkResult:
    """Audio decoded for one request in one :meth:`CodecStreamSession.decode` call.

    Attributes:
        audio: ``(channels, frames * samples_per_frame)`` float32 on CPU (``(channels, 0)``
            when nothing was decoded: a dropped or meta-only chunk).
        sample_rate: samples per second per channel.
        frames: code frames decoded for this request in this call.
    """

    audio: torch.Tensor
    sample_rate: int
    frames: int


@dataclass
class _Row:
    request_id: str
    slot: int
    codes: torch.Tensor  # (n_vq, T) int64 on the pool's device
    terminal: bool


class CodecStreamSession:
    """Request-level streaming on top of a :class:`DecoderStatePool`.

    Args:
        decoder: the codec weights (any device; the pool lives on the same device).
        state_capacity: live streams at most (Stage 1's ``max_num_seqs``).
        pool_kind: ``"v2"`` / ``"legacy"``; default: V2 for v2 codecs, legacy for v1.
        graph_batch_sizes: CUDA-graph batch buckets; sizes outside ``1..state_capacity``
            are ignored.
        graph_frames: CUDA-graph frame sizes (exact ``T`` per graph).
        max_step_frames: longest chunk decoded in one step; longer chunks are split.
        coalesce_tails: pad terminal chunks onto a graph frame size (faster tails, but
            their audio changes; see the module docstring). Default False.
        compile: ``False`` (eager), ``True`` (:func:`compile.compile_decode`), or a
            factory ``pool -> callable`` with the signature of
            ``pool.decode_streaming_tensors`` (the stage passes vLLM's compiled adapter).
            The callable is used for graph capture. Eager steps (no graph fits) use it
            only for ``True``, whose ``torch.compile`` guards recompile on shapes it has not
            seen; a factory's callable may skip guards (vLLM's does), so eager steps then
            take the validated plain step.
        n_vq: codebooks per frame in every chunk; default: all of the codec's.
        ended_memory: ended request ids remembered to drop late chunks.

    Graphs are captured at construction when the decoder is on CUDA and both
    ``graph_batch_sizes`` and ``graph_frames`` are non-empty. Legacy pools then get
    ``max(graph_batch_sizes)`` scratch slots for padding rows.

    Raises:
        ValueError: ``state_capacity < 1``, ``max_step_frames < 1``, bad ``n_vq``, or an
            unknown ``pool_kind``.
    """

    def __init__(
        self,
        decoder: CodecDecoder,
        state_capacity: int,
        *,
        pool_kind: str | None = None,
        graph_batch_sizes: Iterable[int] = (),
        graph_frames: Iterable[int] = (),
        max_step_frames: int = 100,
        coalesce_tails: bool = False,
        compile: bool | Callable[[DecoderStatePool], Callable] = False,
        n_vq: int | None = None,
        ended_memory: int = 4096,
    ):
        if isinstance(state_capacity, bool) or not isinstance(state_capacity, int) or state_capacity < 1:
            raise ValueError(f"state_capacity must be an integer >= 1, got {state_capacity!r}")
        if int(max_step_frames) < 1:
            raise ValueError(f"max_step_frames must be >= 1, got {max_step_frames!r}")
        cfg = decoder.config
        self.n_vq = cfg.num_quantizers if n_vq is None else int(n_vq)
        if not 1 <= self.n_vq <= cfg.num_quantizers:
            raise ValueError(f"n_vq must be in 1..{cfg.num_quantizers} for this codec, got {n_vq!r}")
        self.decoder = decoder
        self.state_capacity = state_capacity
        self.max_step_frames = int(max_step_frames)
        self.sample_rate = int(cfg.sampling_rate)
        self.channels = int(cfg.number_channels)
        self.samples_per_frame = int(cfg.samples_per_frame)
        self.codebook_size = int(cfg.codebook_size)
        self.device = decoder.device
        self.graph_batch_sizes = sorted({int(b) for b in graph_batch_sizes if 0 < int(b) <= state_capacity})
        self.graph_frames = sorted({int(t) for t in graph_frames if int(t) > 0})
        # Merging tails into one group is only safe for graph use when any group size
        # (at most state_capacity rows) still fits a bucket.
        self.coalesce_tails = bool(
            coalesce_tails and self.graph_frames and max(self.graph_batch_sizes, default=0) >= state_capacity
        )
        self._pad_all_terminal_steps = bool(coalesce_tails)
        self._ended_memory = max(0, int(ended_memory))

        use_graphs = self.device.type == "cuda" and bool(self.graph_batch_sizes) and bool(self.graph_frames)
        self.pool = make_state_pool(decoder, pool_kind)
        scratch = max(self.graph_batch_sizes) if use_graphs and self.pool.kind == "legacy" else 0
        self.pool.initialize(state_capacity, scratch)

        if compile is True:
            from .compile import compile_decode

            self._compiled = compile_decode(self.pool)
        elif callable(compile):
            self._compiled = compile(self.pool)
        else:
            self._compiled = None
        self._eager_step = self._compiled if compile is True else None

        self.runner = None
        if use_graphs:
            from .cuda_graph import StreamingGraphRunner

            runner = StreamingGraphRunner(
                self.pool, self.graph_batch_sizes, self.graph_frames, self.n_vq, callable=self._compiled
            )
            runner.capture()
            self.runner = runner if runner.graphs else None

        # pop() leases the top: reversed so that a fresh session leases 0, 1, 2, ...
        self._free: list[int] = list(range(state_capacity - 1, -1, -1))
        self._slots: dict[str, int] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._clamped = 0
        self._closed = False

    # ------------------------------------------------------------------ properties
    @property
    def live_requests(self) -> dict[str, int]:
        """Copy of the live streams: request id -> leased slot."""
        return dict(self._slots)

    @property
    def free_slots(self) -> int:
        """Slots that can still be leased."""
        return len(self._free)

    @property
    def clamped_codes(self) -> int:
        """Codes clamped into ``[0, codebook_size - 1]`` since construction."""
        return self._clamped

    def ended_state(self, request_id: str) -> str | None:
        """``"finished"``, ``"aborted"`` or None (live or unknown / aged out)."""
        return self._ended.get(request_id)

    # ------------------------------------------------------------------ lifecycle
    def on_requests_finished(self, request_ids: Iterable[str]) -> None:
        """Abort, disconnect or preemption: reset and release every slot these ids still hold.

        Ids that are not live are remembered as aborted (so their in-flight chunks are
        dropped) unless they already finished normally.
        """
        if self._closed:
            return
        released = []
        for rid in request_ids:
            rid = str(rid)
            slot = self._slots.pop(rid, None)
            if slot is not None:
                released.append(slot)
                self._remember(rid, _ABORTED)
            elif self._ended.get(rid) != _FINISHED:
                self._remember(rid, _ABORTED)
        if released:
            self.pool.reset(released)
            self._free.extend(released)

    def close(self) -> None:
        """Drop graphs and pool state. Idempotent; :meth:`decode` raises afterwards."""
        if self._closed:
            return
        self._closed = True
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        self._compiled = self._eager_step = None
        self.pool.close()
        self._slots.clear()
        self._free.clear()

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, requests: Sequence[ChunkRequest]) -> dict[str, ChunkResult]:
        """Decode one Stage-1 batch.

        Args:
            requests: at most one chunk per request id.
        Returns:
            A :class:`ChunkResult` for every request id in ``requests`` (empty audio for
            dropped chunks and meta-only payloads).
        Raises:
            ValueError: a request id appears twice, or codes are not an integer
                ``(n_vq, T)`` tensor. Nothing is modified.
            RuntimeError: the session is closed, or more new streams than free slots
                (nothing is modified; admission must count idle live streams against
                ``max_num_seqs``).
        """
        if self._closed:
            raise RuntimeError("this CodecStreamSession is closed")
        if isinstance(requests, ChunkRequest) or not isinstance(requests, Iterable):
            raise TypeError(f"requests must be a sequence of ChunkRequest, got {type(requests).__name__}")
        requests = list(requests)  # iterated more than once below: a generator must not drain early
        codes = self._checked_codes(requests)

        # Plan first, then mutate: a capacity error must leave the session untouched.
        plan: list[tuple[ChunkRequest, torch.Tensor, str]] = []
        new_streams = 0
        for req, c in zip(requests, codes):
            action = self._classify(req, c.shape[1])
            plan.append((req, c, action))
            new_streams += action == "new"
        if new_streams > len(self._free):
            raise RuntimeError(
                f"MOSS codec state capacity exhausted: {new_streams} new streams, {len(self._free)} free of "
                f"{self.state_capacity} slots ({len(self._slots)} live). Stage-1 admission must count idle live "
                f"streams against max_num_seqs={self.state_capacity}; refusing to drop audio codes."
            )

        self._clamp([c for _, c, action in plan if action in ("new", "live") and c.shape[1]])
        results = {req.request_id: self._empty() for req in requests}
        audio: dict[str, list[torch.Tensor]] = {}
        groups: dict[int, list[_Row]] = {}
        for req, c, action in plan:
            rid = req.request_id
            if action == "drop":
                if req.finished and self._ended.get(rid) == _ABORTED:
                    self._ended.pop(rid)  # the aborted stream's tail has drained
                continue
            if action == "new":
                self._ended.pop(rid, None)
                self._slots[rid] = self._free.pop()
            elif action == "ignore":
                if req.finished:
                    self._remember(rid, _FINISHED)
                continue
            slot = self._slots[rid]
            T = c.shape[1]
            if T == 0:
                if req.finished:  # meta-only terminal payload
                    self._finish([rid], reset=True)
                continue
            if T > self.max_step_frames:
                audio[rid] = self._decode_long(rid, slot, c, req.finished)
                continue
            key = T
            if req.finished and self.coalesce_tails:
                key = next((t for t in self.graph_frames if t >= T), T)
            groups.setdefault(key, []).append(_Row(rid, slot, c, req.finished))

        for step_frames in sorted(groups):
            rows = groups[step_frames]
            for row, wav in zip(rows, self._step(rows, step_frames)):
                audio[row.request_id] = [wav]
            self._finish([r.request_id for r in rows if r.terminal], reset=False)

        for rid, parts in audio.items():
            wav = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
            results[rid] = ChunkResult(wav, self.sample_rate, wav.shape[-1] // self.samples_per_frame)
        return results

    # ------------------------------------------------------------------ helpers
    def _checked_codes(self, requests: Sequence[ChunkRequest]) -> list[torch.Tensor]:
        seen: set[str] = set()
        out = []
        for req in requests:
            if not isinstance(req, ChunkRequest):
                raise TypeError(f"requests must hold ChunkRequest objects, got {type(req).__name__}")
            if not isinstance(req.request_id, str) or not req.request_id:
                # Ids are matched against on_requests_finished's strings: anything else would leak a slot.
                raise ValueError(f"request_id must be a non-empty str, got {req.request_id!r}")
            if req.request_id in seen:
                raise ValueError(f"request {req.request_id!r} appears twice in one decode batch")
            seen.add(req.request_id)
            c = req.codes
            if not isinstance(c, torch.Tensor) or c.dim() != 2 or c.shape[0] != self.n_vq:
                shape = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
                raise ValueError(f"request {req.request_id!r}: codes must be ({self.n_vq}, T), got {shape}")
            if c.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
                raise ValueError(f"request {req.request_id!r}: codes must be signed integers (or uint8), got {c.dtype}")
            if c.device.type == "meta":
                raise ValueError(f"request {req.request_id!r}: codes are on the meta device")
            out.append(c)
        return out

    def _classify(self, req: ChunkRequest, frames: int) -> str:
        """``live``, ``new`` (needs a slot), ``drop`` (late chunk) or ``ignore`` (nothing to decode)."""
        rid = req.request_id
        if rid in self._slots:
            return "live"
        ended = self._ended.get(rid)
        if ended == _ABORTED or (ended == _FINISHED and frames == 0):
            return "drop"
        return "new" if frames else "ignore"

    def _clamp(self, chunks: list[torch.Tensor]) -> None:
        # Stage 0 pads with codebook_size (the audio pad code); upstream clamps every chunk.
        # One host sync per batch for the count, after which the clamped copy is used.
        if not chunks:
            return
        hi = self.codebook_size - 1
        bad = torch.stack([((c < 0) | (c > hi)).sum() for c in chunks])
        self._clamped += int(bad.sum())

    def _device_codes(self, c: torch.Tensor) -> torch.Tensor:
        return c.to(self.device, torch.long).clamp(0, self.codebook_size - 1)

    def _decode_long(self, rid: str, slot: int, c: torch.Tensor, finished: bool) -> list[torch.Tensor]:
        T, step = c.shape[1], self.max_step_frames
        parts = []
        for start in range(0, T, step):
            terminal = finished and start + step >= T
            row = _Row(rid, slot, c[:, start : start + step], terminal)
            parts.extend(self._step([row], row.codes.shape[1]))
        if finished:
            self._finish([rid], reset=False)
        return parts

    def _step(self, rows: list[_Row], step_frames: int) -> list[torch.Tensor]:
        """One pool step; returns each row's ``(channels, own_T * spf)`` float32 CPU audio.

        Rows shorter than ``step_frames`` must be terminal; their slots are reset here.
        """
        B, n_vq = len(rows), self.n_vq
        own = [r.codes.shape[1] for r in rows]
        if all(t == step_frames for t in own):
            codes = torch.stack([self._device_codes(r.codes) for r in rows], dim=1)
        else:
            codes = torch.zeros(n_vq, B, step_frames, dtype=torch.long, device=self.device)
            for b, r in enumerate(rows):
                codes[:, b, : own[b]] = self._device_codes(r.codes)
        slots = [r.slot for r in rows]
        slot_ids = torch.tensor(slots, dtype=torch.long, device=self.device)
        lengths = torch.tensor(own, dtype=torch.long, device=self.device)
        terminal = [r.slot for r in rows if r.terminal]

        out = None
        if self.runner is not None:
            pad_frames = self._pad_all_terminal_steps and len(terminal) == B
            out = self.runner.decode(codes, lengths, slot_ids, allow_frame_padding=pad_frames)
        if out is None:
            valid = torch.ones(B, dtype=torch.bool, device=self.device)
            if self._eager_step is not None:
                out, _ = self._eager_step(codes, lengths, slot_ids, valid)
            else:
                out, _ = self.pool.decode_streaming_batch(codes, lengths, slot_ids, valid)
        if terminal:
            # Reset before anyone can lease these slots again; padding frames die here.
            self.pool.reset(terminal)
        audio = out[:B].float().cpu()
        return [audio[b, :, : own[b] * self.samples_per_frame].clone() for b in range(B)]

    def _finish(self, request_ids: list[str], *, reset: bool) -> None:
        slots = [self._slots.pop(rid) for rid in request_ids]
        for rid in request_ids:
            self._remember(rid, _FINISHED)
        if slots and reset:
            self.pool.reset(slots)
        self._free.extend(slots)

    def _remember(self, request_id: str, how: str) -> None:
        if not self._ended_memory:
            return
        self._ended[request_id] = how
        self._ended.move_to_end(request_id)
        while len(self._ended) > self._ended_memory:
            self._ended.popitem(last=False)

    def _empty(self) -> ChunkResult:
        return ChunkResult(torch.zeros(self.channels, 0, dtype=torch.float32), self.sample_rate, 0)
