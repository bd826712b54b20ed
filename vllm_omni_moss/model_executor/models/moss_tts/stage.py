# SPDX-License-Identifier: Apache-2.0
"""vLLM-Omni Stage 1 for MOSS-TTS: codes from Stage 0 in, waveform out.

Drop-in replacement for vLLM-Omni 0.30.0's ``MossTTSCodecDecoder``
(``vllm_omni/model_executor/models/moss_tts/modeling_moss_tts_codec.py``): same constructor, ``forward``
contract and architecture name, upstream's model-interface flags plus ``requires_request_ids``. It is
registered on ``OmniModelRegistry`` under ``MossTTSCodecDecoder`` (by this package's plugin entry point, or
by the registry entry of the fork form). This module keeps the vLLM model contract; its options are read by
``stage_options.py``, payloads assembled by ``payload.py``, vLLM's compiler wrapped by ``vllm_compile.py``.
Differences in behaviour (details in ``docs/serving_stage.md``):

* Only the codec decoder is loaded (:func:`~.checkpoint.load_checkpoint`); the encoder is never built.
* Under vLLM's dummy load format (``--load-format dummy``) the stage serves a random codec of a real geometry
  (``hf_overrides: {codec_dummy_preset: v2 | v1}``, default v2) and warns that its audio is noise, where upstream's
  stays silent.
* Streams are keyed by the runner's request ids (the strings ``on_requests_finished`` receives), never by
  batch position; the payload's own id is a logged cross-check.
* A request fails alone: a malformed payload, a missing stream id or a session error is logged once for that
  request, which gets empty audio (or, when a decoder step of its stream raised, the audio decoded before it); the
  others decode. A terminal payload always ends its stream and frees its slot, even when malformed.
* A chunk the engine's token budget split across steps is buffered until the size its payload declares is
  complete.
* Precision per codec as upstream (v1 in float32, v2 in bfloat16 on CUDA), overridable with
  ``hf_overrides: {codec_dtype: ...}``.
* Codec attention: ``hf_overrides: {codec_attention_backend: sdpa | triton}`` (upstream's field; ``triton``
  reads the rings in place, ``ops/ring_attention.py``) and ``codec_ring_semantics: upstream | exact`` pick the
  pool's attention backend (v1 codecs keep ``sdpa``, as upstream) and ring semantics; unset, the pool's
  defaults.
"""

from __future__ import annotations

import gc
import itertools
import numbers
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm_omni.model_executor.models.output_templates import OmniOutput
from vllm_omni.model_executor.stage_input_processors.chunk_size_utils import parse_chunk_ramp

from .checkpoint import load_checkpoint, resolve_checkpoint_dir
from .config import load_config, preset_config
from .decoder import CodecDecoder
from .deploy_sizing import STEP_RESERVE_BYTES, MemoryShare, check_stage_state
from .payload import PayloadAssembler, PayloadError, StreamChunk, meta_count, meta_of, payload_id, same_request
from .random_codec import random_decoder
from .serving import ChunkRequest, ChunkResult, CodecStreamSession, collector_paused
from .serving.requests import CODE_DTYPES, check_id_collection
from .stage_options import CODEC_DTYPES, StageOptions, codec_dtype_for
from .state import StateSpec
from .talker_chunker import chunk_schedule_of
from .vllm_compile import vllm_compile_factory

__all__ = ["CODEC_DTYPES", "MossTTSCodecDecoder", "codec_dtype_for", "connector_chunk_frames", "staging_device"]

logger = init_logger(__name__)

#: Seed of the random codec served under vLLM's dummy load format: the weights ``vllm-omni-moss make-checkpoint``
#: writes by default for the same preset.
DUMMY_SEED = 0


class MossTTSCodecDecoder(nn.Module):
    """Stage 1 of MOSS-TTS: ``(n_vq, T)`` codes per request -> float32 audio.

    Built by vLLM from ``vllm_config``, whose options :class:`~.stage_options.StageOptions` reads and checks:
    the codebooks per frame, the codec checkpoint and precision, the pool's attention backend, ring semantics,
    kind and state budget, the slot count (``max_num_seqs``), the connector's chunk schedule (the graph frame
    sizes and the longest step) and the ladder of packed frame totals its step shapes pad to.

    Under vLLM's dummy load format the constructor builds and starts a random codec (:meth:`_load_random_codec`).

    Raises:
        ValueError: as :meth:`~.stage_options.StageOptions.from_vllm_config`. A budget too small for one stream
            fails when the decoder state is built, naming the minimum; under the dummy load format, at
            construction.
    """

    # Model-interface flags: upstream's, read by vLLM from the class in its global registry (upstream's) and by
    # the omni runner from this one; plus requires_request_ids, which makes vLLM-Omni's generation runner pass
    # `request_ids` to forward (vllm_omni/worker/gpu_generation_model_runner.py).
    input_modalities = "audio"
    have_multimodal_outputs: bool = True
    has_preprocess: bool = False
    has_postprocess: bool = False
    enable_update_additional_information: bool = True
    requires_raw_input_tokens: bool = True
    requires_exact_input_shape: bool = True
    requires_request_ids: bool = True

    _OUTPUT_SAMPLE_RATE: int = 24_000
    #: Seconds between two session statistics lines in the log.
    STATS_INTERVAL_S: float = 30.0

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.vllm_config = vllm_config
        # The talker's chunker resolves its schedule with the same function (talker_chunker.chunk_schedule_of).
        self.options = options = StageOptions.from_vllm_config(vllm_config, parse_chunk_ramp)
        self.n_vq, self.state_capacity, self.token_budget = options.n_vq, options.state_capacity, options.token_budget
        self.graph_frame_sizes, self.graph_frame_totals = options.graph_frame_sizes, options.graph_frame_totals
        self.max_step_frames, self.async_chunk = options.max_step_frames, options.async_chunk
        self.stats_interval_s = self.STATS_INTERVAL_S
        self._codec: CodecDecoder | None = None
        self._dtype = torch.float32
        self._session: CodecStreamSession | None = None
        self._state_spec: StateSpec | None = None
        self._channels = 1
        self._sr_tensor = torch.tensor(self._OUTPUT_SAMPLE_RATE, dtype=torch.int32)
        self._payloads = PayloadAssembler(self.n_vq)
        self._held: dict[str, list[torch.Tensor]] = {}  # stream key -> audio decoded while it was not batched
        self._held_frames: dict[str, int] = {}  # stream key -> frames of that audio
        self._reported: set[str] = set()  # stream keys whose error was logged
        self._mismatch_warned: set[str] = set()  # stream keys whose payload names another request
        self._stats_logged_at = time.monotonic()
        if options.dummy_preset is not None:
            self._load_random_codec(options.dummy_preset)

    # ------------------------------------------------------------------ vLLM stubs
    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        """``(N,)`` ids -> ``(N, 1)`` float32 zeros: the codec has no token embedding."""
        return torch.zeros((input_ids.shape[0], 1), device=input_ids.device, dtype=torch.float32)

    def compute_logits(self, hidden_states: Any, sampling_metadata: Any = None) -> None:
        return None

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Drain ``weights`` (the talker's checkpoint; nothing here needs it) and load the codec decoder from
        its own checkpoint onto the stage device, in the dtype of :func:`~.stage_options.codec_dtype_for`.

        Returns:
            Names of the loaded parameters as seen from this module (``_codec.*``).
        Raises:
            FileNotFoundError / CheckpointError / ValueError: from the codec checkpoint.
            ValueError: ``n_vq`` exceeds the codec's quantizers.
        """
        for _ in weights:
            pass
        device = torch.device(self.vllm_config.device_config.device)
        download_dir = getattr(getattr(self.vllm_config, "load_config", None), "download_dir", None)
        directory = resolve_checkpoint_dir(self.options.codec_path, download_dir)
        self._codec, self._dtype = _checkpoint_codec(self.options, self.n_vq, directory, device)
        self._start_serving(str(directory), device)
        return {f"_codec.{name}" for name, _ in self._codec.named_parameters()}

    def _load_random_codec(self, preset: str) -> None:
        """Serve :func:`_random_codec` under vLLM's dummy load format, which never calls :meth:`load_weights`."""
        device = torch.device(self.vllm_config.device_config.device)
        codec, self._dtype = _random_codec(self.options, self.n_vq, device)
        # Kept out of the module tree: vLLM's DummyModelLoader next overwrites every parameter and buffer it finds
        # there with uniform noise in [-1e-3, 1e-3] (model_loader/dummy_loader.py), decode table included.
        self.__dict__["_codec"] = codec
        with torch.device("cpu"):  # vLLM builds the model under its target device; start as load_weights does
            self._start_serving(f"random {preset} weights", device)

    def _start_serving(self, source: str, device: torch.device) -> None:
        """Log the codec (from ``source``), check its state against the memory share, build the session if due."""
        cfg = self._codec.config
        self._channels, self._sr_tensor = int(cfg.number_channels), torch.tensor(cfg.sampling_rate, dtype=torch.int32)
        _log_loaded(self, source, device)
        self._state_spec = _state_spec(self.options, self._codec, self._dtype)
        _check_state_fits_share(
            self.vllm_config, device, self._codec, self._state_spec, self.state_capacity, self._graph_rows()
        )
        # Graphs are captured at load, not on the first request; a budget too small for one stream fails at load.
        if (self.async_chunk and self.graph_frame_totals and self.graph_frame_sizes) or self.options.state_budget_bytes:
            self._ensure_session()

    def _graph_rows(self) -> int:
        # The most rows of a graph (what a legacy pool needs scratch slots for: one a slot), 0 without graphs.
        return self.state_capacity if self.graph_frame_totals and self.graph_frame_sizes else 0

    def _ensure_session(self) -> CodecStreamSession:
        if self._session is None:
            graphs = self._graph_rows() > 0
            self._session = CodecStreamSession(
                self._codec,
                self._state_spec,
                self.options.session_options(),
                compile=vllm_compile_factory(self.vllm_config) if graphs else False,
            )
            _log_graphs(self._session.runner, self.options.graph_memory_bytes)
            # What is alive after startup (weights, pool, graphs) leaves the collector's generations, as vLLM
            # freezes its worker after capturing graphs: no later collection traverses it (docs/serving.md,
            # "Steps").
            gc.collect()
            gc.freeze()
        return self._session

    # ------------------------------------------------------------------ output
    def _empty_audio(self) -> torch.Tensor:
        return torch.zeros((self._channels, 0) if self._channels > 1 else (0,), dtype=torch.float32)

    def _output(self, audios: list[torch.Tensor]) -> OmniOutput:
        return OmniOutput(
            text_hidden_states=None,
            multimodal_outputs={"model_outputs": audios, "sr": [self._sr_tensor] * len(audios)},
        )

    def _shape_audio(self, wav: torch.Tensor) -> torch.Tensor:
        # Mono codecs return (samples,), multi-channel ones (channels, samples), as upstream.
        return wav.reshape(-1) if wav.shape[0] == 1 else wav

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        runtime_additional_information: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> OmniOutput:
        """Decode one batch of requests.

        Args:
            input_ids: every request's codebook-major flat codes ``[n_vq * T_i]``, concatenated.
            seq_token_counts: (kwarg, required when ``input_ids`` is non-empty) tokens per request, integers
                ``>= 0``; tokens of ``input_ids`` past their sum (the runner's padding) are ignored.
            request_ids: (kwarg) the runner's request id per request: the stream keys.
            runtime_additional_information: per request dict; ``meta`` may hold ``stream_finished`` /
                ``finished``, ``req_id``, ``codec_chunk_frames`` / ``code_flat_numel`` (the chunk's declared
                size), ``is_segment_finished`` and ``left_context_size`` (see ``docs/serving_stage.md``).
        Returns:
            ``OmniOutput`` with ``multimodal_outputs["model_outputs"]``: per request float32 CPU audio,
            ``(channels, samples)`` or ``(samples,)`` for mono, empty for a request that failed (logged) or has
            nothing to decode yet; and ``["sr"]``: per request int32 scalar tensors.
        Raises:
            RuntimeError: ``seq_token_counts`` missing or longer than ``input_ids``, or ``request_ids`` of
                another length than ``seq_token_counts``; a session call refused before it changed anything
                (a programming error that no request caused). A session call that fails past that point fails
                each of its requests alone (logged; empty audio) instead.
            TypeError: ``seq_token_counts`` is not a list or tuple.
            ValueError: an entry of ``seq_token_counts`` that is not an integer ``>= 0`` (named in the message).
        """
        infos = list(runtime_additional_information or [{}])
        if self._codec is None:
            logger.warning("MossTTSCodecDecoder.forward before load_weights(); returning silence")
            return self._output([self._empty_audio() for _ in infos])
        if self.async_chunk and runtime_additional_information is None:
            return self._output([self._empty_audio() for _ in infos])  # profiling run
        batch = self._split_batch(input_ids, kwargs.get("seq_token_counts"), infos)
        if batch is None:
            return self._output([self._empty_audio() for _ in infos])
        if not self.async_chunk:
            return self._output([self._decode_offline(i, seg, info) for i, (seg, info) in enumerate(batch)])
        # No garbage collection anywhere in forward(), which every stream of the batch waits on: it runs between
        # engine steps (docs/serving.md, "No collector pause inside a call").
        with collector_paused():
            audios = self._decode_streams(batch, kwargs.get("request_ids"))
            self._maybe_log_stats()
            return self._output(audios)

    def _split_batch(self, input_ids, counts_value: Any, infos: list[Any]) -> list[tuple[torch.Tensor, dict]] | None:
        """Per request ``(flat codes, info dict)``; None when there is nothing to split."""
        flat = input_ids.reshape(-1) if input_ids is not None else torch.zeros(0, dtype=torch.long)
        counts = _token_counts(counts_value)
        if counts is None:
            if flat.numel() == 0:
                return None
            raise RuntimeError("MOSS codec needs seq_token_counts to split the concatenated codes per request")
        # Carries on with zero tokens too: a batch of meta-only terminal payloads must still release its streams.
        if sum(counts) > flat.numel():
            raise RuntimeError(f"seq_token_counts {counts} sum to more than the {flat.numel()} input tokens")
        infos = (infos + [{}] * len(counts))[: len(counts)]
        bounds = list(itertools.accumulate(counts, initial=0))
        return [(flat[a:b], info if isinstance(info, dict) else {}) for a, b, info in zip(bounds, bounds[1:], infos)]

    def _decode_offline(self, index: int, seg: torch.Tensor, info: dict) -> torch.Tensor:
        """Whole-utterance decode (``async_chunk`` off), minus ``left_context_size`` frames.

        A malformed ``meta`` or ``left_context_size`` fails that request alone (logged, empty audio).
        """
        try:
            left = meta_count(meta_of(info), "left_context_size") or 0
        except PayloadError as exc:
            self._report(None, index, str(exc))
            return self._empty_audio()
        if seg.numel() % self.n_vq:
            self._report(None, index, f"{seg.numel()} codes are not a multiple of n_vq={self.n_vq}")
            return self._empty_audio()
        if seg.numel() == 0:
            return self._empty_audio()
        bad = self._codes_out_of_range([(seg, info)])
        if bad:
            self._report(None, index, bad[0])
            return self._empty_audio()
        frames = seg.numel() // self.n_vq
        if left >= frames:  # upstream returns empty audio here too; say why
            self._report(None, index, f"left_context_size {left} is not below the request's {frames} frames")
            return self._empty_audio()
        K = self._codec.config.codebook_size
        codes = seg.reshape(self.n_vq, -1).to(self._codec.device, torch.long).clamp(0, K - 1)
        wav = self._codec.decode(codes[:, None])[0].float().cpu()
        if left > 0:
            wav = wav[..., left * self._codec.config.samples_per_frame :]
        return self._shape_audio(wav)

    def _codes_out_of_range(self, batch: list[tuple[torch.Tensor, dict]]) -> dict[int, str]:
        """Rows (by batch position) whose integer codes leave ``0..codebook_size``, with the error naming the
        first such value and the range. ``codebook_size`` itself is the talker's padding code, which upstream's
        decode clamps to ``codebook_size - 1``, as this stage's steps do; anything else out of range is not a
        code. One ``aminmax`` over the batch and one device sync; each row only when the batch fails."""
        # Rows of another dtype are refused alone: by the payload checks (not integer) or by the session (an integer
        # dtype outside CODE_DTYPES, such as uint16, which aminmax does not take either).
        rows = [(i, seg) for i, (seg, _) in enumerate(batch) if seg.numel() and seg.dtype in CODE_DTYPES]
        if not rows:
            return {}
        K = self._codec.config.codebook_size
        lo, hi = torch.stack(torch.aminmax(torch.cat([seg.reshape(-1) for _, seg in rows]))).tolist()
        if lo >= 0 and hi <= K:
            return {}
        bad = {}
        for i, seg in rows:
            lo, hi = torch.stack(torch.aminmax(seg)).tolist()
            if lo < 0 or hi > K:
                bad[i] = (
                    f"code {lo if lo < 0 else hi} is outside 0..{K} (codebook_size {K}, the last the talker's "
                    "padding); the chunk is refused"
                )
        return bad

    # ------------------------------------------------------------------ streams
    def _decode_streams(self, batch: list[tuple[torch.Tensor, dict]], runner_ids: Any) -> list[torch.Tensor]:
        """One ``async_chunk`` step: every row through the session, each failing alone."""
        keys = _stream_keys(batch, runner_ids, self._mismatch_warned)
        # vLLM-Omni's generation scheduler gives a request min(its tokens, the budget left)
        # (core/sched/omni_generation_scheduler.py): a chunk can only be split in a step that used the whole
        # token budget.
        tokens = sum(seg.numel() for seg, _ in batch)
        may_split = self.token_budget is not None and tokens >= self.token_budget
        bad_codes = self._codes_out_of_range(batch)
        chunks = [
            self._payloads.row(i, seg, info, key, may_split, bad_codes.get(i))
            for i, ((seg, info), key) in enumerate(zip(batch, keys))
        ]
        self._payloads.end_with_terminal_duplicates(chunks, keys)
        for c in chunks:
            if c.error is not None:
                self._report(c.key, c.index, c.error)
            elif c.dropped is not None:
                self._report(c.key, c.index, c.dropped, outcome="this row decodes")
        requests = [ChunkRequest(c.key, c.codes, c.finished) for c in chunks if c.codes is not None]
        results = self._decode_session(requests) if requests else {}
        audios = [self._empty_audio() for _ in batch]
        for c in chunks:
            result = results.pop(c.key, None) if c.key is not None else None
            if result is not None:
                audios[c.index] = self._deliver(c, result)
        for key, result in results.items():  # streams decoded from the admission queue, not in this batch
            if result.error is not None:
                self._report(key, None, result.error, result.frames)
            if result.frames:  # with an error too: the audio decoded before its step failed
                self._held.setdefault(key, []).append(result.audio)
                self._held_frames[key] = self._held_frames.get(key, 0) + result.frames
        for c in chunks:
            if c.finished and c.codes is not None:  # the stream ended: the id may start a new one
                self._reported.discard(c.key)
                self._mismatch_warned.discard(c.key)
        return audios

    def _decode_session(self, requests: list[ChunkRequest]) -> dict[str, ChunkResult]:
        """The session's results for ``requests``. A call that raises past the session's argument checks
        (``last_call_error``: the session ended the call's streams) fails each of its requests alone with an
        error naming the exception, logged once with its traceback; anything else (a call the session refused:
        a programming error that no request caused) raises."""
        session = self._ensure_session()
        try:
            return session.decode(requests)
        except Exception as exc:
            if exc is not session.last_call_error:
                raise
            logger.error(
                "MOSS codec: a decode call of %d requests failed; each of them ends with an error", len(requests),
                exc_info=exc,
            )  # fmt: skip
            empty, why = torch.zeros(self._channels, 0), f"its decode call failed with {type(exc).__name__}: {exc}"
            return {
                r.request_id: ChunkResult(
                    empty, session.sample_rate, 0, f"request {r.request_id!r}: {why}; the stream was ended"
                )
                for r in requests
            }

    def _deliver(self, chunk: StreamChunk, result: ChunkResult) -> torch.Tensor:
        """The audio a batch row returns: anything held for its stream, then this step's (with an error, the
        audio its stream decoded before it failed)."""
        parts = self._held.pop(chunk.key, [])
        if result.error is not None:
            self._report(chunk.key, chunk.index, result.error, self._held_frames.get(chunk.key, 0) + result.frames)
        self._held_frames.pop(chunk.key, None)
        if result.frames:
            parts.append(result.audio)
        if not parts:
            return self._empty_audio()
        return self._shape_audio(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))

    def _report(
        self, key: str | None, index: int | None, error: str, frames: int = 0, outcome: str | None = None
    ) -> None:
        """Log a request's error: once per stream key (every time for a row without one). ``index`` is the
        request's batch row, None for a stream outside the batch; ``frames``: decoded frames it still returns;
        ``outcome``: what the row returns, when it is not that."""
        if key is not None:
            if key in self._reported:
                return
            self._reported.add(key)
        where = "not in this batch" if index is None else f"batch row {index}"
        if outcome is None:
            outcome = f"returning the {frames} frames decoded before it" if frames else "returning empty audio"
        logger.warning("MOSS codec request %s (%s): %s; %s", key, where, error, outcome)

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if self._session is None or now - self._stats_logged_at < self.stats_interval_s:
            return
        self._stats_logged_at = now
        _log_stats(self._session.stats())

    # ------------------------------------------------------------------ lifecycle
    def on_requests_finished(self, finished_req_ids: Iterable[str]) -> None:
        """Called by the runner for every finished request (normal, abort, disconnect): releases and resets any
        codec slot those requests still hold and drops what the stage buffered for them (split-chunk prefixes,
        undelivered audio).

        Raises:
            TypeError: ``finished_req_ids`` is a single ``str`` (or bytes) or not a collection of ids (``None``), or
                holds an id that is not a ``str`` (nothing is finished then).

        Undelivered audio is logged as an error naming the request and its frames: audio the session decoded
        from its admission queue after the request's last batch row (``docs/serving_stage.md``, "Admission
        queue").
        """
        check_id_collection(finished_req_ids, "finished_req_ids")
        ids = list(finished_req_ids)
        for rid in ids:
            if not isinstance(rid, str):  # str() of it could end another request's stream ("None", "1")
                raise TypeError(f"finished_req_ids must hold str request ids, got {rid!r}")
        for rid in ids:
            self._payloads.drop(rid)
            if self._held.pop(rid, None):
                logger.error(
                    "MOSS codec request %s finished with %d decoded frames never returned: the session decoded "
                    "them from its admission queue after the request's last batch row; dropped",
                    rid, self._held_frames.get(rid, 0),
                )  # fmt: skip
            self._held_frames.pop(rid, None)
            self._reported.discard(rid)
            self._mismatch_warned.discard(rid)
        if self._session is not None:
            self._session.on_requests_finished(ids)


def connector_chunk_frames(extra: dict[str, Any]) -> list[int]:
    """Every chunk size (frames) the talker's chunker sends under the connector ``extra``: the stage's graph frame
    sizes (``talker_chunker.chunk_schedule_of(extra).frame_sizes``).

    Raises:
        ValueError: a bad schedule, naming the key and its value (``stage_options.resolve_chunk_schedule``).
    """
    return chunk_schedule_of(extra).frame_sizes


def _stream_keys(batch: list[tuple[torch.Tensor, dict]], runner_ids: Any, warned: set[str]) -> list[str | tuple[str]]:
    """Per row the stream key, or a tuple holding the error that row gets instead (with the key when the row is
    its request's second in the batch).

    Keys are the runner's request ids; without them (an older runner, a direct call) the payload's own id;
    never the batch position, which would hand one request's decoder state to the next. A payload naming
    another request than the runner's id is logged once per key (``warned``).
    """
    if runner_ids is not None and len(runner_ids) != len(batch):
        raise RuntimeError(f"{len(runner_ids)} request_ids for {len(batch)} requests (seq_token_counts)")
    keys: list[str | tuple] = []
    seen: set[str] = set()
    for i, (_, info) in enumerate(batch):
        meta = info.get("meta")
        own = payload_id(info, meta if isinstance(meta, dict) else {})
        key = runner_ids[i] if runner_ids is not None else own
        if runner_ids is not None and not (isinstance(key, str) and key):
            # vLLM's request ids are strings; str() of anything else could merge two requests into one stream.
            keys.append((f"the runner's request id must be a non-empty str, got {key!r}",))
            continue
        if key is None:
            keys.append(("no stream id: the runner passed no request_ids and the payload names no req_id",))
            continue
        if own is not None and not same_request(key, own) and key not in warned:
            warned.add(key)
            logger.warning("MOSS codec request %s: its payload names request %s; keyed by the runner's id", key, own)
        keys.append(("request id appears twice in one batch", key) if key in seen else key)
        seen.add(key)
    return keys


def _check_codebooks(n_vq: int, config, source: str) -> None:
    if n_vq > config.num_quantizers:
        raise ValueError(f"n_vq={n_vq} exceeds the codec's {config.num_quantizers} quantizers ({source})")


def _checkpoint_codec(options: StageOptions, n_vq: int, directory: Path, device: torch.device):
    """``(decoder, dtype)``: the checkpoint's decoder on ``device`` in the precision :func:`codec_dtype_for`
    picks. ValueError when ``n_vq`` exceeds its quantizers."""
    dtype = codec_dtype_for(options.codec_dtype, load_config(directory).version, device)
    codec = load_checkpoint(directory, device=staging_device(dtype, device))
    _check_codebooks(n_vq, codec.config, str(directory))
    return codec.to(device=device, dtype=dtype).eval(), dtype


def staging_device(dtype: torch.dtype, device: torch.device) -> torch.device:
    """Where a loader serves the codec before it moves to ``device`` in ``dtype``: ``device`` itself for a bf16
    codec, so that ``CodecDecoder.to_serving`` prepares the CUDA decoder's fused layers (LayerScale folded, the
    FFN's zero bias); the CPU for a float32 one, because ``to_serving`` casts to bf16 on CUDA and the codec would
    lose its precision on the way."""
    return torch.device("cpu") if dtype == torch.float32 else torch.device(device)


def _random_codec(options: StageOptions, n_vq: int, device: torch.device) -> tuple[CodecDecoder, torch.dtype]:
    """``(decoder, dtype)`` of vLLM's dummy load format: random weights of the preset ``options.dummy_preset``
    (:func:`~.random_codec.random_decoder`, seed :data:`DUMMY_SEED`) on ``device`` in the precision
    :func:`codec_dtype_for` picks. Logs a warning that the audio is noise, and how loud it is.

    Raises:
        ValueError: ``n_vq`` exceeds the preset's quantizers (checked before any weight is drawn).
    """
    preset = options.dummy_preset
    config = preset_config(preset)
    _check_codebooks(n_vq, config, f"random {preset} weights")
    dtype = codec_dtype_for(options.codec_dtype, config.version, device)
    with torch.device("cpu"):  # vLLM builds the model under its target device; the draws are on the host
        codec = random_decoder(preset, DUMMY_SEED, staging_device(dtype, device)).to(device=device, dtype=dtype)
        codec.eval()
        codes = torch.randint(0, config.codebook_size, (n_vq, 1, 8), generator=torch.Generator().manual_seed(0))
        peak = float(codec.decode(codes.to(device))[0].abs().max())
    logger.warning(
        "MOSS codec stage under vLLM's dummy load format: serving RANDOM weights of the %s codec (seed %d), not the "
        "checkpoint %s: the audio is noise, for benchmarking the pipeline only; 8 frames of random codes peak at "
        "|sample| = %.1f%s",
        preset, DUMMY_SEED, options.codec_path, peak, ", far outside [-1, 1]" if peak > 1 else "",
    )  # fmt: skip
    return codec, dtype


def _log_loaded(stage: MossTTSCodecDecoder, source: str, device: torch.device) -> None:
    cfg = stage._codec.config
    logger.info(
        "MOSS codec decoder loaded from %s on %s: %s, %d Hz, %d channel(s), n_vq=%d, precision %s "
        "(weights, decode table and state rings; codec_dtype=%s), streams=%d, chunk sizes %s, %d step shapes",
        source, device, cfg.version, cfg.sampling_rate, cfg.number_channels, stage.n_vq,
        str(stage._dtype).removeprefix("torch."), stage.options.codec_dtype, stage.state_capacity,
        stage.graph_frame_sizes, len(stage.graph_frame_totals),
    )  # fmt: skip


def _token_counts(value: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"seq_token_counts must be a list of per-request token counts, got {type(value).__name__}")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ValueError(f"seq_token_counts must hold integers >= 0, got {v!r} in {list(value)!r}")
    return [int(v) for v in value] or None


def _log_stats(s: dict) -> None:
    logger.info(
        "MOSS codec stage: steps graph=%d eager=%d; frames decoded=%d padded=%d; padding rows=%d; waiting "
        "streams=%d (%d frames), admitted from queue=%d, longest queue wait %.3f s; clamped codes=%d, request "
        "errors=%d",
        s["steps_by_path"]["graph"], s["steps_by_path"]["eager"], s["decoded_frames"], s["padded_frames"],
        s["padding_rows"], s["waiting_streams"], s["waiting_frames"], s["admitted_from_queue"],
        s["queue_wait_s_max"], s["clamped_codes"], s["request_errors"],
    )  # fmt: skip


def _check_state_fits_share(vllm_config, device, codec, spec: StateSpec, capacity: int, graph_rows: int) -> None:
    """Fail before allocating when the decoder state exceeds this replica's memory share
    (``gpu_memory_utilization`` of the GPU; docs/serving.md, "Placing the codec stage apart")."""
    utilization = getattr(getattr(vllm_config, "cache_config", None), "gpu_memory_utilization", None)
    if device.type != "cuda" or utilization is None:
        return
    weights = sum(t.numel() * t.element_size() for t in itertools.chain(codec.parameters(), codec.buffers()))
    check_stage_state(
        max_num_seqs=capacity,
        pool_kind=spec.kind,
        bytes_per_slot=codec.config.state_bytes_per_slot(spec.dtype.itemsize),
        share=MemoryShare(float(utilization), torch.cuda.mem_get_info(device)[1]),
        reserved_bytes=weights + STEP_RESERVE_BYTES,
        graph_rows=graph_rows,
        state_budget_bytes=None if spec.paging is None else spec.paging.state_budget_bytes,
    )


def _log_graphs(runner, budget: int) -> None:
    if runner is not None:
        largest = runner.shapes[0]
        logger.info(
            "MOSS codec CUDA graphs: %d step shapes (packed frame totals 1 to %d, up to %d rows x %d frames), %d "
            "captured in %.2f GiB (budget %.2f GiB) and %.1f s",
            len(runner.shapes), largest.total_frames, largest.rows, largest.frames, len(runner.graphs),
            runner.memory_bytes / 2**30, budget / 2**30, runner.capture_seconds,
        )  # fmt: skip


def _state_spec(options: StageOptions, codec: CodecDecoder, dtype: torch.dtype) -> StateSpec:
    """The pool's spec, from the stage's options and the loaded codec (its version) in ``dtype``."""
    backend = options.attention_backend
    if backend == "triton" and not codec.config.abilities.compact_pool:
        # Upstream's triton attention replaces only v2 attention modules; v1 codecs keep SDPA there too.
        logger.info("codec_attention_backend='triton' applies to v2 codecs; this v1 codec uses 'sdpa'")
        backend = "sdpa"
    seconds = options.expected_stream_seconds
    # codec_expected_stream_seconds in code frames of this codec (12.5 frames/s for both MOSS codecs).
    frames = None if seconds is None else max(1, round(seconds * codec.config.frame_rate))
    return StateSpec.from_options(
        codec, options.pool_kind, dtype, options.ring_semantics, backend,
        state_budget_bytes=options.state_budget_bytes, expected_stream_frames=frames,
    )  # fmt: skip
