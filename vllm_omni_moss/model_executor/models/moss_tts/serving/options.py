# SPDX-License-Identifier: Apache-2.0
"""What a session runs with besides its decoder, its state spec and its compile factory: one frozen record,
checked and normalised once (:class:`SessionOptions`). The stage builds it from its ``StageOptions``
(``StageOptions.session_options``); the session's keyword arguments build the same record."""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_count
from ..graph_ladder import graph_sizes

__all__ = ["SessionOptions"]


@dataclass(frozen=True)
class SessionOptions:
    """A session's options, checked and normalised at construction.

    Attributes:
        state_capacity: live streams at most (Stage 1's ``max_num_seqs``), >= 1.
        n_vq: codebooks per frame in every chunk; None: all of the codec's (checked against the codec by the
            session).
        graph_batch_sizes: CUDA-graph batch buckets, kept distinct, ascending and within ``1..state_capacity``
            (others are dropped, :func:`~..graph_ladder.graph_sizes`).
        graph_frame_sizes: CUDA-graph frame sizes (the chunk schedule's sizes), distinct and ascending.
        max_step_frames: longest piece decoded in one step when no graph frame sizes are given, >= 1.
        max_waiting_streams: new streams that may wait for a slot, >= 0.
        max_waiting_frames: code frames that waiting streams may buffer in total, >= 0.
        graph_memory_bytes: device memory the CUDA graphs may take in bytes (an integer >= 0), or None for no bound.
        ragged_steps: one step per round of a call, its rows of any valid frames up to the step's frame size
            and every op but the attention on their packed tokens (docs/serving.md, "Ragged steps"); False: one
            step per frame size present.

    Raises:
        ValueError: ``state_capacity < 1``, ``max_step_frames < 1``, a negative queue bound, an ``n_vq`` that is
            not an integer (or None), a ``graph_memory_bytes`` that is not an integer >= 0 (or None), or a
            ``ragged_steps`` that is not a bool, naming the field and the value.
    """

    state_capacity: int
    n_vq: int | None = None
    graph_batch_sizes: tuple[int, ...] = ()
    graph_frame_sizes: tuple[int, ...] = ()
    max_step_frames: int = 100
    max_waiting_streams: int = 64
    max_waiting_frames: int = 4096
    graph_memory_bytes: int | None = None
    ragged_steps: bool = False

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
        if not isinstance(self.ragged_steps, bool):
            raise ValueError(f"ragged_steps must be True or False, got {self.ragged_steps!r}")
        batch = tuple(graph_sizes(self.graph_batch_sizes, self.state_capacity))
        object.__setattr__(self, "graph_batch_sizes", batch)
        object.__setattr__(self, "graph_frame_sizes", tuple(graph_sizes(self.graph_frame_sizes)))

    @property
    def uses_graphs(self) -> bool:
        """Whether graphs are asked for (both size lists non-empty); they are captured on CUDA devices only."""
        return bool(self.graph_batch_sizes) and bool(self.graph_frame_sizes)
