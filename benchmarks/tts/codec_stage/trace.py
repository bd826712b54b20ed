# SPDX-License-Identifier: Apache-2.0
"""The request trace of one run: request lengths, arrival times, chunk schedules and codes.

Every arm of a run sees the same trace: the lengths and arrivals are drawn from ``--seed`` and the codes of
request ``r`` are the ``r``-th draw of one generator seeded with it, made when the request starts (requests
start in index order under every arrival model, so the codes do not depend on the arm). Times are seconds of
simulated time; lengths and chunk bounds are code frames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from vllm_omni_moss.model_executor.models.moss_tts.decoder import chunk_schedule

__all__ = [
    "ARRIVALS",
    "FRAME_RATE",
    "LENGTH_MODEL",
    "CodeSource",
    "Trace",
    "closed_loop_trace",
    "poisson_trace",
    "ramp_schedule",
    "request_lengths",
]

FRAME_RATE = 12.5  # code frames per second of audio (both MOSS codecs)
ARRIVALS = ("wave", "staggered", "poisson")
LENGTH_MODEL = "lognormal(median 4.0 s, sigma 0.45), clipped to 13..256 frames (synthetic, Seed-TTS-EN-like)"


def ramp_schedule(total_frames: int, sizes: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` chunks of a stream: ``sizes`` as a chunk ramp whose last size repeats, the last chunk cut.

    ``--chunks a,b,c`` is what the talker's chunker sends for ``codec_chunk_ramp: [a, b, c]`` and
    ``codec_chunk_frames: c``: the core's ``decoder.chunk_schedule`` (vLLM-Omni's ``ramp_chunk_size`` rule).
    """
    return chunk_schedule(total_frames, sizes)


def request_lengths(n: int, seed: int) -> np.ndarray:
    """Frames per request from the documented synthetic distribution."""
    rng = np.random.default_rng(seed)
    seconds = rng.lognormal(mean=math.log(4.0), sigma=0.45, size=n)
    return np.clip(np.round(seconds * FRAME_RATE), 13, 256).astype(int)


@dataclass(frozen=True)
class Trace:
    """The requests of one run, in start order.

    Attributes:
        lengths: ``(n,)`` frames per request.
        arrivals: ``(n,)`` arrival times (s); NaN for a closed-loop request, which arrives when it starts
            (when a live stream ends and it is next in line).
        measured: ``(n,)`` bool, the requests the figures count.
        limit: live streams at most; later arrivals wait in a FIFO queue.
        window: the measurement window ``(start, end)`` in seconds, or None for the whole run.
        seed: the seed of the codes (:class:`CodeSource`).
    """

    lengths: np.ndarray
    arrivals: np.ndarray
    measured: np.ndarray
    limit: int
    window: tuple[float, float] | None
    seed: int

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def measured_count(self) -> int:
        return int(self.measured.sum())


class CodeSource:
    """Codes of each request, int64 ``(n_vq, lengths[r])`` on CPU, uniform in ``[0, codebook_size)``.

    Drawn in request order from one generator seeded with ``trace.seed``, so that request ``r`` gets the
    same codes in every arm; only the codes of requests not yet :meth:`drop`-ped are kept.
    """

    def __init__(self, trace: Trace, n_vq: int, codebook_size: int):
        self._lengths = trace.lengths
        self._shape = (int(n_vq), int(codebook_size))
        self._gen = torch.Generator().manual_seed(int(trace.seed))
        self._next = 0
        self._kept: dict[int, torch.Tensor] = {}

    def take(self, r: int) -> torch.Tensor:
        n_vq, codebook_size = self._shape
        while self._next <= r:
            frames = int(self._lengths[self._next])
            self._kept[self._next] = torch.randint(0, codebook_size, (n_vq, frames), generator=self._gen)
            self._next += 1
        return self._kept[r]

    def drop(self, r: int) -> None:
        self._kept.pop(r, None)


def closed_loop_trace(arrival: str, concurrency: int, requests: int, steady_seconds: float, seed: int) -> Trace:
    """``wave`` or ``staggered``: ``requests`` requests, at most ``concurrency`` live, every one measured.

    ``wave``: the first ``concurrency`` requests arrive at 0. ``staggered``: request ``i < concurrency``
    arrives at ``i * steady_seconds / concurrency`` (spread over one steady chunk's generation time). Both:
    every later request is closed loop (it starts when a live stream ends).
    """
    lengths = request_lengths(requests, seed)
    arrivals = np.full(requests, np.nan)
    first = min(concurrency, requests)
    if arrival == "wave":
        arrivals[:first] = 0.0
    elif arrival == "staggered":
        arrivals[:first] = np.arange(first) * (steady_seconds / concurrency)
    else:
        raise ValueError(f"closed-loop arrival must be wave or staggered, got {arrival!r}")
    return Trace(lengths, arrivals, np.ones(requests, dtype=bool), int(concurrency), None, int(seed))


def poisson_arrivals(rate: float, burstiness: float, horizon: float, seed: int) -> np.ndarray:
    """Open-loop arrival times (s) in ``[0, horizon)``: the first at 0, then gaps drawn from a gamma
    distribution of shape ``burstiness`` and mean ``1 / rate`` (s); shape 1 is a Poisson process."""
    rng = np.random.default_rng([int(seed), 1])  # a stream of its own: the lengths keep theirs
    scale = 1.0 / (rate * burstiness)
    times: list[np.ndarray] = []
    last = 0.0
    block = max(16, int(rate * horizon * 1.2) + 16)
    while last < horizon:
        gaps = rng.gamma(shape=burstiness, scale=scale, size=block)
        chunk = last + np.cumsum(gaps)
        times.append(chunk)
        last = float(chunk[-1])
    arrivals = np.concatenate([[0.0], *times])
    return arrivals[arrivals < horizon]


def poisson_trace(rate: float, burstiness: float, warmup: float, measure: float, limit: int, seed: int) -> Trace:
    """``poisson``: arrivals at ``rate`` requests/s until ``warmup + measure`` seconds, at most ``limit``
    live; the requests arriving in ``[warmup, warmup + measure)`` are measured."""
    arrivals = poisson_arrivals(rate, burstiness, warmup + measure, seed)
    measured = arrivals >= warmup
    lengths = request_lengths(len(arrivals), seed)
    return Trace(lengths, arrivals, measured, int(limit), (float(warmup), float(warmup + measure)), int(seed))
