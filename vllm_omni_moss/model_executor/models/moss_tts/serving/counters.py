# SPDX-License-Identifier: Apache-2.0
"""The counters a session reports (``CodecStreamSession.stats``), shared by its scheduler and step runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SessionCounters"]


@dataclass
class SessionCounters:
    """Counts since the session was built.

    Attributes:
        steps_graph / steps_eager: pool steps by path.
        decoded_frames: real frames decoded; padded_frames: padding frames of real rows in steps.
        padding_rows: rows a CUDA-graph replay carried beyond its step's rows (its shape's rows minus them).
        admitted_from_queue: streams that got a slot after waiting; queue_wait_s_max: the longest wait (s).
        preemptions: streams whose state was saved to the host to free pages; preempted_bytes: the host bytes
            of those saved states; preemption_s: host seconds spent saving and restoring them (the device copies
            included: both wait for them); streams_by_preemptions: streams that ended (terminal chunk, finish or
            refusal), counted by how many times each was preempted.
        request_errors: chunks refused, and streams failed by a step that raised.
        clamped_codes: codes clamped into the codebook, counted so far on the host.
        clamped_on_device: counts of steps whose codes were on the device, not read yet (a lazy sum).
    """

    steps_graph: int = 0
    steps_eager: int = 0
    decoded_frames: int = 0
    padded_frames: int = 0
    padding_rows: int = 0
    admitted_from_queue: int = 0
    preemptions: int = 0
    preempted_bytes: int = 0
    preemption_s: float = 0.0
    streams_by_preemptions: dict[int, int] = field(default_factory=dict)
    queue_wait_s_max: float = 0.0
    request_errors: int = 0
    clamped_codes: int = 0
    clamped_on_device: torch.Tensor | None = None

    def count_admitted(self, waited_s: float) -> None:
        """Count a stream admitted from the admission queue after waiting ``waited_s`` seconds."""
        self.admitted_from_queue += 1
        self.queue_wait_s_max = max(self.queue_wait_s_max, waited_s)

    def count_ended(self, preemptions: int) -> None:
        """Count a stream that ended, preempted ``preemptions`` times."""
        self.streams_by_preemptions[preemptions] = self.streams_by_preemptions.get(preemptions, 0) + 1

    def stats(self, waiting_streams: int, waiting_frames: int, clamped_codes: int) -> dict[str, object]:
        """The counters as ``CodecStreamSession.stats`` reports them, with the streams and frames waiting for a
        slot now and the codes clamped so far (the session reads them)."""
        return {
            "steps_by_path": {"graph": self.steps_graph, "eager": self.steps_eager},
            "decoded_frames": self.decoded_frames,
            "padded_frames": self.padded_frames,
            "padding_rows": self.padding_rows,
            "waiting_streams": waiting_streams,
            "waiting_frames": waiting_frames,
            "admitted_from_queue": self.admitted_from_queue,
            "preemptions": self.preemptions,
            "preempted_bytes": self.preempted_bytes,
            "preemption_seconds": self.preemption_s,
            "streams_by_preemptions": dict(sorted(self.streams_by_preemptions.items())),
            "queue_wait_s_max": self.queue_wait_s_max,
            "clamped_codes": clamped_codes,
            "request_errors": self.request_errors,
        }
