# SPDX-License-Identifier: Apache-2.0
"""What a session runs with besides its decoder, its state spec and its compile factory: one frozen record,
checked and normalised once (:class:`SessionOptions`). The stage builds it from its ``StageOptions``
(``StageOptions.session_options``); the session's keyword arguments build the same record."""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_count
from ..graph_ladder import StepLadder, graph_sizes

__all__ = ["SessionOptions"]


@dataclass(frozen=True)
class SessionOptions:
    """A session's options, checked and normalised at construction.

    Attributes:
        state_capacity: live streams at most (Stage 1's ``max_num_seqs``), >= 1.
        n_vq: codebooks per frame in every chunk; None: all of the codec's (checked against the codec by the
            session).
        graph_frame_totals: the packed frame totals steps pad to and CUDA graphs are captured for (e.g.
            ``graph_ladder.frame_totals(state_capacity x max(graph_frame_sizes))``), kept distinct and ascending
            (others are dropped, :func:`~..graph_ladder.graph_sizes`); empty: every step is shaped exactly.
        graph_frame_sizes: the chunk schedule's sizes, distinct and ascending: the largest is the most frames of
            one chunk decoded in one step (every step's ``T``).
        max_step_frames: longest piece decoded in one step when no graph frame sizes are given, >= 1.
        max_waiting_streams: new streams that may wait for a slot, >= 0.
        max_waiting_frames: code frames that waiting streams may buffer in total, >= 0.
        graph_memory_bytes: device memory the CUDA graphs may take in bytes (an integer >= 0), or None for no bound.

    Raises:
        ValueError: ``state_capacity < 1``, ``max_step_frames < 1``, a negative queue bound, an ``n_vq`` that is
            not an integer (or None), or a ``graph_memory_bytes`` that is not an integer >= 0 (or None), naming the
            field and the value.
    """

    state_capacity: int
    n_vq: int | None = None
    graph_frame_totals: tuple[int, ...] = ()
    graph_frame_sizes: tuple[int, ...] = ()
    max_step_frames: int = 100
    max_waiting_streams: int = 64
    max_waiting_frames: int = 4096
    graph_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        check_count(self.state_capacity, "state_capacity", 1)
        check_count(self.max_step_frames, "max_step_frames", 1)
        check_count(self.max_waiting_streams, "max_waiting_streams", 0)
        check_count(self.max_waiting_frames, "max_waiting_frames", 0)
        # The range of n_vq is the codec's (checked by the session); its type is checked here, so that 1.5 or True
        # is refused rather than truncated by the session's int().
        if self.n_vq is not None and (isinstance(self.n_vq, bool) or not isinstance(self.n_vq, int)):
            raise ValueError(f"n_vq must be an integer or None, got {self.n_vq!r}")
        if self.graph_memory_bytes is not None:
            check_count(self.graph_memory_bytes, "graph_memory_bytes", 0)
        object.__setattr__(self, "graph_frame_totals", tuple(graph_sizes(self.graph_frame_totals)))
        object.__setattr__(self, "graph_frame_sizes", tuple(graph_sizes(self.graph_frame_sizes)))

    @property
    def uses_graphs(self) -> bool:
        """Whether graphs are asked for (frame totals and frame sizes given); they are captured on CUDA only."""
        return bool(self.graph_frame_totals) and bool(self.graph_frame_sizes)

    @property
    def step_ladder(self) -> StepLadder:
        """How the session shapes its steps (:class:`~..graph_ladder.StepLadder`): ``state_capacity`` rows at
        most, ``T`` = the largest graph frame size (``max_step_frames`` without), padded to the frame totals when
        graphs are asked for, else exact."""
        frames = self.graph_frame_sizes[-1] if self.graph_frame_sizes else self.max_step_frames
        return StepLadder(self.state_capacity, frames, self.graph_frame_totals if self.uses_graphs else ())
