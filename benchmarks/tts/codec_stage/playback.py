# SPDX-License-Identifier: Apache-2.0
"""Client playback of each request: when its audio plays and how long it stalls (seconds of simulated time).

The client starts playing at its first audio's arrival and plays 12.5 frames of audio per second. A stall is
time during which all the audio received so far has been played and the next chunk has not arrived. With
``play_end`` the time the audio received so far runs out, a chunk of ``f`` frames arriving at ``t``:

* first chunk: ``play_end = t + f / 12.5``;
* later chunk, ``t > play_end``: a stall of ``t - play_end``, then ``play_end = t + f / 12.5``;
* later chunk, ``t <= play_end``: ``play_end += f / 12.5`` (no stall).

A request's worst stall is the longest of its stalls (0 when it never stalls). A request cut off by the end of
a run that was stopped early counts the stall it is in at that moment (``now - play_end`` when positive).
"""

from __future__ import annotations

import math

from .trace import FRAME_RATE

__all__ = ["STALL_EPSILON_S", "Playback"]

#: Gaps at most this long (s) are float rounding of equal times, not stalls.
STALL_EPSILON_S = 1e-9


class Playback:
    """Playback state of ``n`` requests (lists indexed by request, O(1) work per chunk)."""

    def __init__(self, n: int):
        self.first_audio = [math.nan] * n  # s, arrival of the first audio
        self.play_end = [math.nan] * n  # s, when the audio received so far has been played
        self.worst_stall = [0.0] * n  # s

    def on_audio(self, r: int, now: float, frames: int) -> None:
        """``frames`` frames of request ``r`` arrived at ``now`` (s)."""
        seconds = frames / FRAME_RATE
        if math.isnan(self.first_audio[r]):
            self.first_audio[r] = now
            self.play_end[r] = now + seconds
            return
        gap = now - self.play_end[r]
        if gap > STALL_EPSILON_S:
            self.worst_stall[r] = max(self.worst_stall[r], gap)
            self.play_end[r] = now + seconds
        else:
            self.play_end[r] += seconds

    def cut_off(self, r: int, now: float) -> None:
        """Request ``r`` gets no more audio (its run stopped at ``now``): count the stall it is in."""
        if not math.isnan(self.first_audio[r]):
            gap = now - self.play_end[r]
            if gap > STALL_EPSILON_S:
                self.worst_stall[r] = max(self.worst_stall[r], gap)
