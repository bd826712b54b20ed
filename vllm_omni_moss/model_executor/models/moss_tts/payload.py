# SPDX-License-Identifier: Apache-2.0
"""The connector's payload protocol: one batch row of an ``async_chunk`` step -> one chunk for the session.

Each Stage-1 batch row carries a request's flat codebook-major codes and a payload dict whose ``meta`` may hold
``stream_finished`` / ``finished``, ``req_id``, ``codec_chunk_frames`` / ``code_flat_numel`` (the chunk's
declared size) and ``is_segment_finished`` (docs/serving_stage.md). :class:`PayloadAssembler` turns a row
into a :class:`StreamChunk`: the chunk's ``(n_vq, T)`` codes, or nothing yet when the engine's token budget
split the chunk across steps (its prefix is kept until the rest arrives), or an error for that row alone.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from .checks import is_integer_dtype

__all__ = ["PayloadAssembler", "PayloadError", "StreamChunk", "meta_count", "meta_of", "payload_id", "same_request"]


class PayloadError(ValueError):
    """A malformed payload field; its message is that request's logged error."""


def _meta_scalar(value: Any) -> Any:
    """First element of a list/tuple/tensor payload field (the connector wraps scalars)."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)[0].item() if value.numel() else None
    return value


def meta_of(info: dict) -> dict:
    """The payload's ``meta`` dict (``{}`` when absent or null).

    Raises:
        PayloadError: ``meta`` is something other than a dict.
    """
    meta = info.get("meta")
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise PayloadError(f"payload meta must be a dict, got {type(meta).__name__}")
    return meta


def meta_count(meta: dict, name: str) -> int | None:
    """``meta[name]`` as a count >= 0 (frames or codes); None when absent or empty.

    Integers and integral finite floats (a scalar, or the first element of a list / tuple / tensor) are
    accepted.

    Raises:
        PayloadError: anything else (a string, NaN, infinity, a fraction, a negative number); the message names
            the field and the value.
    """
    raw = meta.get(name)
    value = _meta_scalar(raw)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():  # False for NaN and infinities
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise PayloadError(f"payload meta.{name} must be an integer >= 0, got {raw!r}")
    return int(value)


def meta_flag(meta: dict, *names: str) -> bool:
    """The first of ``names`` present in ``meta`` as a bool (False when none is, or it is None/empty): a
    bool, or an integer 0 or 1 (a wrapped or tensor scalar included).

    Raises:
        PayloadError: any other value (``"false"``, ``2``, NaN ...), named: reading it as truthy would end a
        stream its sender did not end.
    """
    for name in names:
        if name in meta:
            value = _meta_scalar(meta[name])
            if value is None:
                return False
            if type(value).__name__ == "bool_":  # numpy's bool
                value = bool(value)
            if isinstance(value, bool) or (isinstance(value, numbers.Integral) and value in (0, 1)):
                return bool(value)
            raise PayloadError(f"payload meta.{name} must be a bool, got {meta[name]!r}")
    return False


def _empty_codes(n_vq: int) -> torch.Tensor:
    """A zero-frame chunk: int64 whatever the dtype of the row it replaces."""
    return torch.zeros(n_vq, 0, dtype=torch.long)


def payload_id(info: dict, meta: dict) -> str | None:
    """The stream id a payload names itself (``meta.req_id``, else ``request_id``), or None."""
    for value in (meta.get("req_id"), info.get("request_id")):
        value = _meta_scalar(value)
        if value is not None:
            return str(value)
    return None


def same_request(runner_id: str, own_id: str) -> bool:
    """Whether the runner's request id belongs to the payload's own id: vLLM's internal id is the external one
    plus "-" and 8 random characters (vllm/v1/engine/input_processor.py, assign_request_id); payloads carry
    the external one."""
    return runner_id == own_id or runner_id.startswith(own_id + "-")


@dataclass
class StreamChunk:
    """One batch row of an ``async_chunk`` step, ready for the session (or not).

    Attributes:
        index: batch position.
        key: stream key; None when the row has no usable id.
        codes: ``(n_vq, T)`` codes; None: nothing to hand to the session this step.
        finished: the row is its stream's terminal payload.
        error: why the row fails (logged once for its request), or None.
        dropped: why an earlier, incomplete chunk of the stream was dropped while this row's chunk is taken
            (logged like an error), or None.
    """

    index: int
    key: str | None
    codes: torch.Tensor | None
    finished: bool
    error: str | None = None
    dropped: str | None = None


class PayloadAssembler:
    """Rows -> chunks for one stage, keeping the prefixes of chunks the token budget split.

    Args:
        n_vq: codebooks per frame.

    Attributes:
        partial: stream key -> (the flat codes of a split chunk received so far, the stage's own copy; the
            codes its payload declares).
    """

    def __init__(self, n_vq: int):
        self.n_vq = n_vq
        self.partial: dict[str, tuple[torch.Tensor, int]] = {}

    def row(
        self,
        index: int,
        seg: torch.Tensor,
        info: dict,
        key: str | tuple,
        may_split: bool,
        codes_error: str | None = None,
    ) -> StreamChunk:
        """The chunk of batch row ``index``: flat codes ``seg`` (a view of the engine's input buffer), payload
        ``info``, stream ``key`` (or a tuple ``(error,)`` / ``(error, request id)`` holding the row's error);
        ``may_split``: the step used the whole token budget, so a chunk can be split across it and the next;
        ``codes_error``: why the row's codes cannot be decoded (the caller checks their values), or None. A
        row with an error in ``key`` hands no codes to the session (its ``key`` names the request, if any); a
        row with ``codes_error`` fails like a malformed payload (a terminal one still ends its stream)."""
        refused = isinstance(key, tuple)
        named = (key[1] if len(key) == 2 else None) if refused else key
        try:
            meta = meta_of(info)
            finished = meta_flag(meta, "stream_finished", "finished")
            # The connector turns a segment end without new codes into one `[0]` token
            # (distributed/omni_connectors/transfer_adapter/chunk_transfer_adapter.py).
            segment_end = meta_flag(meta, "is_segment_finished")
        except PayloadError as exc:  # no terminal flag can be read: the stream is left as it was
            return StreamChunk(index, named, None, False, key[0] if refused else str(exc))
        if refused:
            return StreamChunk(index, named, None, finished, key[0])
        if codes_error is not None:  # the whole chunk goes, with any buffered first part of it
            self.partial.pop(key, None)
            codes, error, dropped = None, codes_error, None
        else:
            codes, error, dropped = self._assemble(key, seg, meta, finished, segment_end, may_split)
        if error is not None:
            # A terminal payload still ends its stream: a zero-frame terminal chunk.
            codes = _empty_codes(self.n_vq) if finished else None
        return StreamChunk(index, key, codes, finished, error, dropped)

    def _declared_numel(self, meta: dict) -> int | None:
        """The chunk's size as its payload declares it, in codes, or None.

        ``codec_chunk_frames * n_vq`` when the payload names its frame count, else ``code_flat_numel``. Frames
        win because the connector merges each payload's ``meta`` into the previous one and a payload that omits
        a field inherits the old value: the raw processor's terminal placeholder declares
        ``codec_chunk_frames=0`` but omits ``code_flat_numel`` (``stage_input_processors/moss_tts.py``).

        Raises:
            PayloadError: the field it reads is not an integer >= 0 (:func:`meta_count`).
        """
        frames = meta_count(meta, "codec_chunk_frames")
        if frames is not None:
            return frames * self.n_vq
        return meta_count(meta, "code_flat_numel")

    def _assemble(self, key, seg, meta, finished, segment_end, may_split) -> tuple:
        """``((n_vq, T) codes or None while a split chunk is incomplete, error or None, dropped or None)``:
        ``dropped`` says why a buffered prefix of the stream was dropped while this row decodes (when the row
        fails too, that reason leads its error).

        A chunk with fewer codes than declared is buffered as split only in a step that used the whole token
        budget (``may_split``): in any other step no rest can follow it, so it is refused alone, terminal or
        not (a terminal one still ends its stream, by the caller). A buffered prefix whose next row does not
        complete it is handled by :meth:`_pending_prefix`.
        """
        if not is_integer_dtype(seg.dtype):
            self.partial.pop(key, None)
            return None, f"input_ids must be integer codes, got dtype {seg.dtype}", None
        try:
            declared = self._declared_numel(meta)
        except PayloadError as exc:
            self.partial.pop(key, None)
            return None, str(exc), None
        pending, dropped = self._pending_prefix(key, seg, declared)
        codes, error = self._complete(key, seg, pending, declared, finished, segment_end, may_split)
        if dropped is None:
            return codes, error, None
        return (codes, None, dropped) if error is None else (None, f"{dropped}; {error}", None)

    def _complete(self, key, seg, pending, declared, finished, segment_end, may_split):
        """:meth:`_assemble` once the row's buffered prefix (``pending``, or None) is known."""
        tokens = seg if pending is None else torch.cat([pending, seg])
        n = tokens.numel()
        single = n == 1 and pending is None
        # Meta-only payload or the connector's one-token `[0]` boundary placeholder: a single token where the
        # payload declares no codes, a segment end, or a terminal payload declaring no size. A terminal payload
        # that declares a chunk is not one: its single token is the first of a chunk the token budget split.
        placeholder = self.n_vq > 1 and (segment_end or (finished and declared is None))
        if n == 0 or (single and (declared == 0 or placeholder)):
            return _empty_codes(self.n_vq), None
        if declared is not None:
            if declared % self.n_vq:
                return None, f"the payload declares {declared} codes, not a multiple of n_vq={self.n_vq}"
            if n < declared:
                if not may_split:
                    terminal = "terminal " if finished else ""
                    return None, (
                        f"the {terminal}payload declares {declared} codes but {n} arrived in a step that left "
                        "token budget unused (not a split chunk); the incomplete chunk is dropped"
                    )
                # The token budget split the chunk: keep a copy of what came (``seg`` is a view of the engine's
                # input buffer, which it rewrites before the next step) and wait for the rest.
                self.partial[key] = (tokens if pending is not None else tokens.clone(), declared)
                return None, None
            if n > declared:
                return None, f"{n} codes exceed the {declared} the payload declares"
        if n % self.n_vq:
            return None, f"{n} codes are not a multiple of n_vq={self.n_vq}"
        return tokens.reshape(self.n_vq, -1), None

    def _pending_prefix(self, key, seg: torch.Tensor, declared: int | None) -> tuple[torch.Tensor | None, str | None]:
        """``(the buffered first part of a split chunk of key that seg continues, or None; why a buffered part
        was dropped, or None)``.

        The rest of a split chunk comes with the same payload (the connector replaces a request's tokens and
        merges its metadata only when a new chunk arrives), so it declares the same size and fits in it. A row
        that does not is the stream's next chunk: the buffered part was a chunk short of its declared size
        whose rest never comes: it is dropped, with the reason, and the row is taken alone.
        """
        entry = self.partial.pop(key, None)
        if entry is None:
            return None, None
        prefix, prefix_declared = entry
        if declared == prefix_declared and prefix.numel() + seg.numel() <= declared:
            return prefix, None
        return None, (
            f"the stream's previous chunk declares {prefix_declared} codes but only {prefix.numel()} arrived "
            "before its next chunk (a short chunk, not a split one); it is dropped"
        )

    def drop(self, key: str) -> None:
        """Forget the split prefix of ``key`` (its request ended)."""
        self.partial.pop(key, None)

    def end_with_terminal_duplicates(self, chunks: list[StreamChunk], keys: list[str | tuple]) -> None:
        """A row refused as its request's second row in the batch (its key ``(error, request_id)``) still ends
        the stream when it is terminal: the request's first row becomes its terminal chunk, in place (the
        duplicate's codes are refused and logged; an incomplete split chunk of the first row is dropped)."""
        first = {key: c for c, key in zip(chunks, keys) if isinstance(key, str)}
        for c, key in zip(chunks, keys):
            if not (isinstance(key, tuple) and len(key) == 2 and c.finished):
                continue
            kept = first[key[1]]
            kept.finished = True
            if kept.codes is None:  # a split prefix, or an error: the stream still ends in this call
                if kept.error is None:
                    kept.error = "its terminal row came twice in one batch; the incomplete chunk is dropped"
                    self.drop(kept.key)
                kept.codes = _empty_codes(self.n_vq)
