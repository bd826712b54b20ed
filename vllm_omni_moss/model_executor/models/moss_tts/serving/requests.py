# SPDX-License-Identifier: Apache-2.0
"""What a session takes and gives back: one chunk per request id in, one result per request id out; a call's
requests checked once, at the session's entry (:func:`check_batch`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = [
    "CODE_DTYPES",
    "CheckedBatch",
    "ChunkRequest",
    "ChunkResult",
    "InvalidRequestId",
    "check_batch",
    "check_id_collection",
]

#: Integer dtypes a chunk's codes may have (they are gathered into int64 when a step stages them).
CODE_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass(frozen=True)
class ChunkRequest:
    """One request's chunk in a Stage-1 batch.

    Attributes:
        request_id: stream key (the engine's request id).
        codes: ``(n_vq, T)`` integer codes, codebook-major, on any device. ``T`` may be 0 (a meta-only
            payload; with ``finished`` it ends the stream). Values outside the codebook are clamped.
        finished: True for the stream's terminal chunk.
    """

    request_id: str
    codes: torch.Tensor
    finished: bool = False


@dataclass(frozen=True)
class ChunkResult:
    """What one ``CodecStreamSession.decode`` call produced for one request.

    Attributes:
        audio: ``(channels, frames * samples_per_frame)`` float32 on CPU (``(channels, 0)`` when nothing was
            decoded).
        sample_rate: samples per second per channel.
        frames: code frames decoded for this request in this call.
        error: why this request's chunk in this call was refused (nothing of its stream changed by it), or
            why its stream failed (a pool step of it raised: the stream ended), or None. A refused chunk of a
            stream whose earlier, buffered chunks were decoded in the same call comes back with that audio and
            the error together; so does a failed stream with the audio decoded before its step raised.
        queued: True while the stream waits for a slot (its chunk is buffered).
    """

    audio: torch.Tensor
    sample_rate: int
    frames: int
    error: str | None = None
    queued: bool = False


class InvalidRequestId:
    """The result key of a request whose id is not a non-empty ``str``: its position in the batch with the id
    itself.

    Such a request only gets an error. Its key never equals a string id nor another request's key (ids that
    compare equal, such as ``1``, ``True`` and ``1.0``, or ids that cannot key a dict, such as lists, still
    get one result each).

    Attributes:
        position: the request's index in the ``decode`` call's ``requests``.
        request_id: the id as given.
    """

    __slots__ = ("position", "request_id")

    def __init__(self, position: int, request_id: object):
        self.position, self.request_id = position, request_id

    def _identity(self) -> tuple:
        return (self.position, type(self.request_id).__qualname__, repr(self.request_id))

    def __eq__(self, other) -> bool:
        return isinstance(other, InvalidRequestId) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def __repr__(self) -> str:
        return f"InvalidRequestId({self.position}, {self.request_id!r})"


@dataclass(frozen=True, slots=True)
class CheckedBatch:
    """A ``decode`` call's requests, checked once at the session's entry (:func:`check_batch`).

    Attributes:
        keys: the result key of each request, in the call's order: its id, or an :class:`InvalidRequestId` when the
            id is not a non-empty ``str``.
        accepted: the valid requests, in order (nothing downstream checks them again).
        refused: result key -> why each invalid request cannot be taken, in order.
    """

    keys: tuple[object, ...]
    accepted: tuple[ChunkRequest, ...]
    refused: dict[object, str]


def check_batch(requests, n_vq: int) -> CheckedBatch:
    """Check a ``decode`` call's ``requests`` once, for a session of ``n_vq`` codebooks per frame: the batch as a
    whole (which raises, before anything changes) and each request (whose errors come back in ``refused``).

    Raises:
        TypeError: ``requests`` is not a sequence of :class:`ChunkRequest` (``"requests must be a sequence of
            ChunkRequest, got <type>"``, or ``"requests must hold ChunkRequest objects, got <type>"``).
        ValueError: a valid request id appears twice (``"request 'x' appears twice in one decode batch"``).
    """
    if isinstance(requests, ChunkRequest) or not isinstance(requests, Iterable):
        raise TypeError(f"requests must be a sequence of ChunkRequest, got {type(requests).__name__}")
    requests = list(requests)
    for req in requests:
        if not isinstance(req, ChunkRequest):
            raise TypeError(f"requests must hold ChunkRequest objects, got {type(req).__name__}")
    keys = [_result_key(req.request_id, i) for i, req in enumerate(requests)]
    named = [key for key in keys if isinstance(key, str)]  # valid ids only: an empty one gets its own error
    dupes = sorted(key for key, n in Counter(named).items() if n > 1)
    if dupes:
        raise ValueError(f"request {dupes[0]!r} appears twice in one decode batch")
    accepted, refused = [], {}
    for req, key in zip(requests, keys):
        error = _chunk_error(req, key, n_vq)
        if error is None:
            accepted.append(req)
        else:
            refused[key] = error
    return CheckedBatch(tuple(keys), tuple(accepted), refused)


def _result_key(request_id, position: int) -> object:
    """The key of a request's result: its id when it is a non-empty ``str``, else an :class:`InvalidRequestId`."""
    return request_id if isinstance(request_id, str) and request_id else InvalidRequestId(position, request_id)


def _chunk_error(req: ChunkRequest, key: object, n_vq: int) -> str | None:
    """Why ``req`` (result key ``key``) cannot be taken by a session of ``n_vq`` codebooks per frame, or None."""
    rid, c = req.request_id, req.codes
    if isinstance(key, InvalidRequestId):
        # Ids are matched against on_requests_finished's strings: anything else would leak a slot.
        return f"request_id must be a non-empty str, got {rid!r}"
    if not isinstance(req.finished, bool):
        return f"request {rid!r}: finished must be a bool, got {req.finished!r}"
    if isinstance(c, torch.Tensor) and (c.layout != torch.strided or c.is_nested):
        layout = "nested" if c.is_nested else c.layout
        return f"request {rid!r}: codes must be a dense (strided) tensor, got a {layout} tensor"
    if not isinstance(c, torch.Tensor) or c.dim() != 2 or c.shape[0] != n_vq:
        shape = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
        return f"request {rid!r}: codes must have shape ({n_vq}, T), got {shape}"
    if c.dtype not in CODE_DTYPES:
        return f"request {rid!r}: codes must be signed integers (or uint8), got {c.dtype}"
    if c.device.type == "meta":
        return f"request {rid!r}: codes are on the meta device"
    return None


def check_id_collection(ids, name: str) -> None:
    """Refuse ``ids`` (the argument ``name`` of an ``on_requests_finished``) unless it is a collection of ids: a
    single ``str`` (or bytes) would be iterated as characters, and ``None`` is no collection at all.

    Raises:
        TypeError: naming ``name`` and the value.
    """
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"{name} must be a collection of request ids, got the single id {ids!r}")
    if not isinstance(ids, Iterable):
        raise TypeError(f"{name} must be a collection of request ids, got {ids!r}")
