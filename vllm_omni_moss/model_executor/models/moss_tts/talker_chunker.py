# SPDX-License-Identifier: Apache-2.0
"""Stage 0's talker-to-codec chunker for MOSS-TTS-Local: raw codec frames in, chunks on a ramp out.

A deploy file selects it for Stage 0 with the stage key ``custom_process_next_stage_input_func`` (vLLM-Omni
0.30.0 passes stage keys it does not model into ``engine_extras``, which ``_build_engine_args`` in
``config/stage_config.py`` applies over the pipeline's engine args; docs/serving.md, "Choosing a chunk
schedule"). It speaks the protocol of vLLM-Omni 0.30.0's ``talker2codec_raw_async_chunk``
(``stage_input_processors/moss_tts.py``): the same ``OmniPayloadStruct`` fields and meta keys, pad rows dropped,
a terminal-only payload when a request ends with nothing pending; without a ramp its payloads equal that
function's for the same frames. What it adds: the connector's ``codec_chunk_ramp`` (chunk ``i`` has ``ramp[i]``
frames, then ``codec_chunk_frames``; vLLM-Omni's ``parse_chunk_ramp`` and ``ramp_chunk_size``), a schedule
resolved by :func:`chunk_schedule_of`, the function Stage 1 resolves its graph frame sizes with, and per-request
checks of the frames' dtype and width.

Host cost: the frames of one call are copied to a Python list once (no loop over frames); a chunk is one
codebook-major reordering by slices, one tensor over an int64 array and two flag clones
(benchmarks/tts/bench_chunker.py; docs/serving.md states the figure: under the 5 us a frame budget).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch
from vllm_omni.data_entry_keys import CodesStruct, MetaStruct, OmniPayloadStruct
from vllm_omni.model_executor.stage_input_processors.chunk_size_utils import parse_chunk_ramp, ramp_chunk_size

from .checks import is_integer_dtype
from .stage_options import ChunkSchedule, resolve_chunk_schedule

__all__ = [
    "AUDIO_PAD_CODE",
    "ChunkerError",
    "chunk_schedule_of",
    "deploy_chunk_schedule",
    "talker2codec_ramp_async_chunk",
]

#: A code row made only of this value is a pad row, never sent (``_MOSS_AUDIO_PAD_CODE`` of vLLM-Omni 0.30.0's
#: ``stage_input_processors/moss_tts.py``).
AUDIO_PAD_CODE = 1024


#: Tensor dtypes that hold codes, read as int64 (as vLLM-Omni's raw chunker reads them); floating, complex and
#: bool frames are refused, and uint64 frames, whose codes may not fit the int64 the chunks are sent in.
_CODE_DTYPES = frozenset({torch.int64, torch.int32, torch.uint32, torch.int16, torch.uint16, torch.int8, torch.uint8})

#: The finished flag's two values; each payload field gets a clone of its own (cheaper than building a tensor from
#: a bool).
_FLAGS = {True: torch.tensor(True), False: torch.tensor(False)}


class ChunkerError(ValueError):
    """Frames a request cannot be served from; the message names the request."""


def chunk_schedule_of(extra: dict[str, Any]) -> ChunkSchedule:
    """The chunk schedule of a connector ``extra``, by vLLM-Omni's ramp rules (:func:`.stage_options.
    resolve_chunk_schedule` with ``parse_chunk_ramp``): what this chunker sends, what Stage 1 captures graphs for.

    Raises:
        ValueError: as :func:`.stage_options.resolve_chunk_schedule`, naming the key and its value.
    """
    return resolve_chunk_schedule(extra, parse_chunk_ramp)


class _Stream:
    """One request's pending codes: frame-major Python ints, ``width`` per frame."""

    __slots__ = ("codes", "error", "sent", "width")

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.width = 0  # codes per frame, fixed by the request's first frames
        self.sent = 0  # chunks sent: the index of the next one in the schedule
        self.error: str | None = None


def _schedule(transfer_manager: Any) -> ChunkSchedule:
    """The connector's schedule, resolved once per transfer manager (its config does not change)."""
    schedule = getattr(transfer_manager, "_moss_chunk_schedule", None)
    if schedule is None:
        raw = getattr(getattr(transfer_manager, "connector", None), "config", None) or {}
        extra = raw.get("extra", raw) if isinstance(raw, dict) else {}
        schedule = chunk_schedule_of(extra if isinstance(extra, dict) else {})
        transfer_manager._moss_chunk_schedule = schedule
    return schedule


def _take(stream: _Stream, frames: torch.Tensor, req_id: str) -> None:
    """Append ``frames`` (``[T, n_vq]`` or one ``[n_vq]`` frame) to ``stream``, pad rows dropped."""
    if frames.dtype not in _CODE_DTYPES:
        kind = "integer codes of at most 64 bits signed" if is_integer_dtype(frames.dtype) else "integer codes"
        raise ChunkerError(f"request {req_id}: codec frames must be {kind}, got dtype {frames.dtype}")
    if frames.ndim not in (1, 2):
        raise ChunkerError(f"request {req_id}: codec frames must be 2-D [frames, n_vq], got {tuple(frames.shape)}")
    width = frames.shape[-1]
    if stream.width and width != stream.width:
        raise ChunkerError(
            f"request {req_id}: codec frames of {width} codes after frames of {stream.width} (n_vq changed)"
        )
    try:
        rows = frames.tolist()  # a copy: the engine may reuse its tensor after the call
    except (RuntimeError, NotImplementedError):  # a sparse tensor, a meta tensor: checked only when they fail
        raise ChunkerError(
            f"request {req_id}: codec frames must be a dense tensor holding data, got layout {frames.layout} "
            f"on device {frames.device}"
        ) from None
    stream.width = width
    flat = rows if frames.ndim == 1 else rows[0] if len(rows) == 1 else list(chain.from_iterable(rows))
    if AUDIO_PAD_CODE in flat:  # some row may be all pad: filter rows in torch
        rows = frames.reshape(-1, width)
        flat = rows[rows.ne(AUDIO_PAD_CODE).any(dim=1)].reshape(-1).tolist()
    stream.codes += flat


def _payload(req_id: str, codes: torch.Tensor | None, frames: int, finished: bool) -> OmniPayloadStruct:
    """The payload of ``frames`` frames of flat codebook-major ``codes`` (None, with ``frames`` 0: the
    terminal-only payload)."""
    flag = _FLAGS[bool(finished)]
    # Two flags of their own memory, as upstream's: vLLM-Omni's NIXL connector registers the memory of every tensor
    # of a payload (connectors/nixl_connector.py), so one shared flag would be one region registered twice. The
    # terminal-only payload declares no code count: None is MetaStruct's default, which it omits.
    meta = MetaStruct(
        req_id=[req_id], left_context_size=0, codec_chunk_frames=frames, codec_left_context_frames=0,
        code_flat_numel=None if codes is None else int(codes.numel()), stream_finished=flag.clone(),
        finished=flag.clone(),
    )  # fmt: skip
    audio = None if codes is None else CodesStruct(audio=codes)
    return OmniPayloadStruct(codes=audio, meta=meta, request_id=req_id)


def _fail(transfer_manager: Any, request: Any, stream: _Stream, error: ChunkerError) -> None:
    """Mark the request failed: its pending codes are dropped and its later frames ignored (a chunk after a gap
    would be decoded as if contiguous); the failure is recorded where vLLM-Omni's scheduler reports failed sends."""
    stream.error = str(error)
    stream.codes.clear()
    record = getattr(transfer_manager, "record_send_failure", None)
    if callable(record):
        record(getattr(request, "request_id", None), f"MOSS talker chunker: {error}")


def talker2codec_ramp_async_chunk(
    transfer_manager: Any,
    multimodal_output: dict[str, Any] | None,
    request: Any,
    is_finished: bool = False,
) -> OmniPayloadStruct | None:
    """Buffer a request's new codec frames and send the next chunk of the schedule once it is complete.

    Args:
        transfer_manager: vLLM-Omni's chunk transfer adapter (or the model runner's payload transport): its
            ``connector.config`` holds the schedule keys, its ``code_prompt_token_ids[req_id]`` this request's
            state (both transports drop it when the request ends).
        multimodal_output: ``{"codes": {"audio": frames}}``, frames an integer tensor ``[T, n_vq]`` (or
            ``[n_vq]``) of the frames generated since the last call.
        request: the talker request (``external_req_id``, else ``request_id``, names the stream).
        is_finished: the request (or its segment) ended: everything pending goes out, marked finished.
    Returns:
        The next chunk (``codes.audio``: int64 ``[n_vq * frames]`` codebook-major; ``meta``: ``req_id``,
        ``codec_chunk_frames``, ``code_flat_numel``, ``stream_finished`` / ``finished``, zero left context), the
        terminal-only payload, or None while the chunk is incomplete.
    Raises:
        ValueError: a bad schedule (:func:`chunk_schedule_of`). ChunkerError: frames that are not integer (or are
            uint64), not 1-D or 2-D, of another width than the request's first frames, or that torch cannot read
            out (sparse, meta); the message names the request, which fails alone (its later frames are dropped;
            its terminal call still ends its stream).
    """
    external = getattr(request, "external_req_id", None)
    req_id = str(external if external is not None else getattr(request, "request_id", id(request)))
    schedule = _schedule(transfer_manager)
    held = transfer_manager.code_prompt_token_ids[req_id]
    if not held:
        held.append(_Stream())
    stream: _Stream = held[0]
    if stream.error is None and isinstance(multimodal_output, (dict, Mapping)):
        codes = multimodal_output.get("codes")
        frames = codes.get("audio") if codes else None
        if isinstance(frames, torch.Tensor) and frames.numel() > 0:
            try:
                _take(stream, frames, req_id)
            except ChunkerError as exc:
                _fail(transfer_manager, request, stream, exc)
                raise
    pending = len(stream.codes) // stream.width if stream.width else 0
    if pending == 0 or stream.error is not None:
        if not is_finished:
            return None
        _forget(transfer_manager, req_id)
        return _payload(req_id, None, 0, True)
    size = ramp_chunk_size(stream.sent, schedule.ramp, schedule.steady)
    if not is_finished and pending < size:
        return None
    frames_out = pending if is_finished else size
    n = frames_out * stream.width
    chunk = _codebook_major(stream.codes[:n], stream.width, frames_out)
    del stream.codes[:n]
    stream.sent += 1
    if is_finished:
        _forget(transfer_manager, req_id)
    return _payload(req_id, chunk, frames_out, is_finished)


def _codebook_major(codes: list[int], width: int, frames: int) -> torch.Tensor:
    """int64 ``[width * frames]`` codebook-major tensor of ``frames`` frame-major frames of ``width`` codes."""
    major = [0] * (width * frames)
    for k in range(width):  # a slice per codebook, not a loop over frames
        major[k * frames : (k + 1) * frames] = codes[k::width]
    # The tensor wraps an int64 array of its own (torch.frombuffer keeps the array alive): a third of the cost of
    # torch.tensor over a list of Python ints.
    return torch.frombuffer(array("q", major), dtype=torch.long)


def _forget(transfer_manager: Any, req_id: str) -> None:
    transfer_manager.code_prompt_token_ids.pop(req_id, None)
    payloads = getattr(transfer_manager, "request_payload", None)
    if isinstance(payloads, dict):
        payloads.pop(req_id, None)


def deploy_chunk_schedule(path: str) -> ChunkSchedule:
    """The one chunk schedule of a deploy file, read through vLLM-Omni's ``load_deploy_config``: the schedule of
    the connector Stage 0 sends to Stage 1 with (``output_connectors.to_stage_1``) and of the one Stage 1 receives
    from (``input_connectors.from_stage_0``).

    vLLM-Omni builds one connector spec per edge, from whichever stage names it first (Stage 0), and hands it to
    both stages (``load_omni_transfer_config``), so a file naming two connector entries of one type would have
    Stage 1 silently read Stage 0's; this check refuses such a file before it is served.

    Raises:
        ValueError: the two connectors' schedules differ (the message names both connectors and schedules), a stage
            names a connector the file does not define (as ``load_omni_transfer_config`` refuses it), or a
            schedule is bad (:func:`chunk_schedule_of`).
    """
    from vllm_omni.config.stage_config import load_deploy_config

    deploy = load_deploy_config(path)
    named = deploy.connectors or {}
    stages = {s.stage_id: s for s in deploy.stages}
    ends = (("Stage 0", 0, "output_connectors", "to_stage_1"), ("Stage 1", 1, "input_connectors", "from_stage_0"))
    found: list[tuple[str, str, ChunkSchedule]] = []
    for label, stage_id, field, key in ends:
        ref = (getattr(stages.get(stage_id), field, None) or {}).get(key)
        if isinstance(ref, str) and ref not in named:  # not a connector without keys: vLLM-Omni refuses the file
            raise ValueError(f"{path}: {label}'s connector {ref!r} is none of the file's connectors ({_names(named)})")
        spec = named.get(ref, {}) if isinstance(ref, str) else ref or {}
        found.append(
            (label, repr(ref if isinstance(ref, str) else "inline"), chunk_schedule_of(spec.get("extra") or {}))
        )
    (a, a_ref, a_schedule), (b, b_ref, b_schedule) = found
    if a_schedule != b_schedule:
        raise ValueError(
            f"{path}: {a}'s connector {a_ref} sends chunks {_describe(a_schedule)} but {b}'s connector {b_ref} "
            f"expects {_describe(b_schedule)}; vLLM-Omni would hand both stages Stage 0's: name one connector"
        )
    return a_schedule


def _names(named: Mapping[str, Any]) -> str:
    return ", ".join(map(repr, named)) or "none"


def _describe(schedule: ChunkSchedule) -> str:
    return f"{list(schedule.ramp)} then {schedule.steady}"
