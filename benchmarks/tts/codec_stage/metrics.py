# SPDX-License-Identifier: Apache-2.0
"""The figures of one run (``arms.<arm>.<key>``), its details, and the SLO lines over a sweep.

Latencies and stalls in milliseconds, rounded to 0.001 ms; shares in [0, 1]; state in bytes.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from .simulate import Run

__all__ = [
    "CONTINUITY_MS",
    "NO_STEPS",
    "STATE_TRACE_POINTS",
    "downsample_max",
    "clean_status",
    "holds_slo",
    "is_run_key",
    "live_stream_stats",
    "max_rate_at_slo",
    "max_streams_at_slo",
    "preemptions_per_stream",
    "rate_key",
    "run_entries",
    "slo_limits",
    "slo_status",
    "sweep_limit",
    "stall_warning",
    "summarize",
]

#: Most ``[seconds, bytes]`` points of ``details.state_bytes_over_time`` per arm and run.
STATE_TRACE_POINTS = 200
#: Worst-stall bounds (ms) of ``continuity.c<N>``.
CONTINUITY_MS = (50, 100, 200)
#: Arm statistics of a run that decoded nothing (a run that failed before its first step).
NO_STEPS = {"steps_by_path": {"graph": 0, "eager": 0}, "decoded_frames": 0, "padded_frames": 0}


def rate_key(rate: float) -> str:
    """The ``arms.<arm>`` key of a poisson run at ``rate`` requests/s: ``"rate=<R>"`` (``%g``)."""
    return f"rate={rate:g}"


def is_run_key(key: str) -> bool:
    """True for the key of a run (a concurrency ``"64"`` or a rate ``"rate=2"``), False for a sweep line."""
    return key.isdigit() or key.startswith("rate=")


def key_order(key: str) -> float:
    return float(key.removeprefix("rate="))


def run_entries(arm_entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The runs of one ``arms.<arm>`` entry, by key (the sweep lines left out)."""
    return {k: v for k, v in arm_entry.items() if is_run_key(k)}


def _pct(values: list[float], q: float, scale: float = 1e3) -> float | None:
    return round(float(np.percentile(np.asarray(values), q)) * scale, 3) if values else None


def live_stream_stats(trace: list[tuple[float, int]], window: tuple[float, float]) -> dict[str, float | None]:
    """``{mean, max}`` live streams over ``window`` (s): the time-weighted mean of the step function
    ``trace`` (``(time, live streams from then on)``, in time order) and its largest value in the window."""
    w0, w1 = window
    if not trace or w1 <= w0:
        return {"mean": None, "max": None}
    times = np.array([t for t, _ in trace], dtype=np.float64)
    live = np.array([n for _, n in trace], dtype=np.float64)
    starts = np.clip(times, w0, w1)
    ends = np.clip(np.append(times[1:], w1), w0, w1)
    spans = np.maximum(ends - starts, 0.0)
    inside = (ends > w0) & (starts < w1) & (spans > 0)
    mean = float((spans * live).sum() / (w1 - w0))
    return {"mean": round(mean, 3), "max": int(live[inside].max()) if inside.any() else int(live[-1])}


def _playback_figures(run: Run) -> dict[str, Any]:
    stalls = run.worst_stall
    share = {}
    for ms in CONTINUITY_MS:  # the stall bound plus float slack: a stall of exactly N ms counts as at most N
        share[f"c{ms}"] = round(float(np.mean(np.asarray(stalls) <= ms / 1e3 + 1e-9)), 4) if stalls else None
    waits = run.queue_wait
    return {
        "ttfp_ms": {f"p{q}": _pct(run.ttfp, q) for q in (50, 95, 99)},
        "underrun_ms": {f"p{q}": _pct(stalls, q) for q in (50, 99)},
        # Requests whose playback stalled at least once (worst stall above 1 ns of float slack); null without any
        # request that had audio.
        "underrun_requests": int(sum(1 for s in stalls if s > 1e-9)) if stalls else None,
        "continuity": share,
        "live_streams": live_stream_stats(run.live_trace, run.window),
        "queued_requests": int(sum(1 for w in waits if w > 1e-9)),
        "queue_wait_ms": {f"p{q}": _pct(waits, q) for q in (50, 99)},
    }


def summarize(run: Run, stats: dict[str, Any], peak: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the exact-key figures of ``arms.<arm>.<key>``, the run's details)."""
    decoded, padded = int(stats["decoded_frames"]), int(stats["padded_frames"])
    span = run.window[1] - run.window[0] if run.window[1] > run.window[0] else run.serving_s
    figures = {
        "audio_seconds_per_second": round(run.audio_s / span, 4) if span > 0 else None,
        "codec_latency_ms": {f"p{q}": _pct(run.codec_latency, q) for q in (10, 50, 90, 95, 99)},
        "first_chunk_latency_ms": {f"p{q}": _pct(run.first_latency, q) for q in (50, 99)},
        **_playback_figures(run),
        "steps_by_path": {path: int(stats["steps_by_path"][path]) for path in ("graph", "eager")},
        "padded_frame_fraction": round(padded / (decoded + padded), 6) if decoded + padded else 0.0,
        "peak_memory_bytes": peak,
    }
    walls = run.step_wall
    details = {
        "requests": run.requests,
        "finished_requests": run.finished_requests,
        "chunks": len(run.codec_latency),
        "steps": len(walls),
        "stopped_early": run.stopped_early,
        "serving_seconds": round(run.serving_s, 4),
        "window_seconds": [round(run.window[0], 4), round(run.window[1], 4)],
        "codec_busy_seconds": round(sum(walls), 4),
        "audio_seconds": round(run.audio_s, 4),
        "decoded_frames": decoded,
        "padded_frames": padded,
        "step_ms": {"p50": _pct(walls, 50), "p99": _pct(walls, 99), "max": round(max(walls, default=0.0) * 1e3, 3)},
    }
    if walls:
        _slowest_step(run, details)
    return figures, details


def _collector(run: Run, details: dict[str, Any]) -> None:
    # Python's garbage collector, per decode call: inside it (the session pauses collection there) and between the
    # previous call and it (counted on the simulated clock, docs/serving.md "Steps").
    if run.step_gc:
        details["collector_ms"] = {
            "in_call_max": round(max(run.step_gc) * 1e3, 3),
            "in_call_sum": round(sum(run.step_gc) * 1e3, 3),
            "between_calls_max": round(max(run.step_gc_between) * 1e3, 3),
            "between_calls_sum": round(sum(run.step_gc_between) * 1e3, 3),
        }


def _slowest_step(run: Run, details: dict[str, Any]) -> None:
    _collector(run, details)
    walls = run.step_wall
    slowest = int(np.argmax(walls))
    if slowest < len(run.step_chunks):
        details["slowest_step"] = {"chunks": run.step_chunks[slowest], "max_frames": run.step_frames[slowest]}
    if run.step_replay and len(run.step_replay) == len(walls):
        # Per decode call: graph replay time and the host time around it (call wall minus replay).
        host = [w - r for w, r in zip(walls, run.step_replay)]
        details["replay_ms"] = {"p50": _pct(run.step_replay, 50), "p99": _pct(run.step_replay, 99)}
        details["host_ms"] = {"p50": _pct(host, 50), "p99": _pct(host, 99)}
        # Where the busy seconds went: replays (device time of the steps) and the host time around them.
        details["replay_seconds"] = round(float(sum(run.step_replay)), 4)
        details["host_seconds"] = round(float(sum(host)), 4)
        details["slowest_step"]["replay_ms"] = round(run.step_replay[slowest] * 1e3, 3)
    if run.step_trace and len(run.step_trace) == len(walls):
        traces = [asdict(t) for t in run.step_trace]
        phases = [k for k, v in traces[0].items() if k.endswith("_ms")]
        details["call_trace_ms"] = {
            k: {
                **{f"p{q}": _pct([t[k] for t in traces], q, 1.0) for q in (50, 99)},
                "sum": round(float(sum(t[k] for t in traces)), 3),
            }
            for k in phases
        }
        details["slowest_step"]["trace"] = {
            k: round(v, 3) if k.endswith("_ms") else v for k, v in traces[slowest].items()
        }
        timed = run.step_replay if run.step_replay and len(run.step_replay) == len(walls) else walls
        basis = "replay" if timed is run.step_replay else "wall"
        details["step_cost"] = step_cost(timed, [t["steps"] for t in traces], run.step_decoded, basis)


def step_cost(seconds: list[float], steps: list[int], frames: list[int], basis: str) -> dict[str, Any]:
    """Each decode call's time split into a fixed cost per pool step and a cost per decoded frame, by least
    squares over the calls: ``ms of call i = fixed_ms_per_step x steps[i] + ms_per_frame x frames[i]``.

    Args:
        seconds: time of each call (``basis``: ``"replay"``, the graph replays' device time, or ``"wall"``).
        steps: pool steps each call ran; frames: code frames of the chunks each call was sent (padding frames
            excluded; a chunk that waits for a slot is decoded by a later call).
    Returns:
        ``calls``, ``steps_per_call`` (mean), ``basis`` and, when the calls vary enough to separate the two
        costs (at least 3 calls, steps and frames not proportional), ``fixed_ms_per_step`` and
        ``ms_per_frame``; otherwise those two are None.
    """
    calls = len(seconds)
    out: dict[str, Any] = {
        "calls": calls,
        "steps_per_call": round(float(np.mean(steps)), 4) if calls else None,
        "basis": basis,
        "fixed_ms_per_step": None,
        "ms_per_frame": None,
    }
    a = np.array([steps, frames], dtype=np.float64).T
    if calls >= 3 and np.linalg.matrix_rank(a) == 2:
        (fixed, per_frame), *_ = np.linalg.lstsq(a, np.array(seconds, dtype=np.float64) * 1e3, rcond=None)
        out["fixed_ms_per_step"], out["ms_per_frame"] = round(float(fixed), 4), round(float(per_frame), 5)
    return out


def preemptions_per_stream(before: dict[int, int], after: dict[int, int]) -> dict[str, float | int | None]:
    """``{max, mean}`` preemptions per stream over the streams that ended between two readings of a session's
    ``stats()["streams_by_preemptions"]`` (``{preemptions: streams}``); Nones when no stream ended."""
    ended = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
    streams = sum(ended.values())
    if not streams:
        return {"max": None, "mean": None}
    return {"max": int(max(ended)), "mean": round(sum(k * n for k, n in ended.items()) / streams, 4)}


def downsample_max(points: list[tuple[float, int]], limit: int = STATE_TRACE_POINTS) -> list[list[float | int]]:
    """At most ``limit`` ``[seconds, bytes]`` pairs from ``points`` (in time order): the points are split into
    ``min(len(points), limit)`` runs of consecutive points (sizes differ by at most one) and each run gives
    its point of largest bytes (the first such), so the maximum, and the time it was reached, are kept."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    n = len(points)
    buckets = min(n, limit)
    out: list[list[float | int]] = []
    for i in range(buckets):
        run = points[i * n // buckets : (i + 1) * n // buckets]
        seconds, value = max(run, key=lambda point: point[1])
        out.append([round(float(seconds), 4), int(value)])
    return out


def slo_status(figures: dict[str, Any], details: dict[str, Any], slo_ms: float) -> str:
    """``"held"`` (``codec_latency_ms.p99 <= slo_ms`` over a whole run), ``"missed"`` (a larger p99, or a run
    stopped early or failed, whatever its p99) or ``"unknown"`` (a complete run without a p99: a missing figure
    is never a pass)."""
    if details.get("stopped_early") or "error" in details:
        return "missed"
    p99 = figures.get("codec_latency_ms", {}).get("p99")
    if p99 is None:
        return "unknown"
    return "held" if p99 <= slo_ms else "missed"


def holds_slo(figures: dict[str, Any], details: dict[str, Any], slo_ms: float) -> bool:
    """:func:`slo_status` is ``"held"``."""
    return slo_status(figures, details, slo_ms) == "held"


def clean_status(figures: dict[str, Any], details: dict[str, Any], slo_ms: float) -> str:
    """``"held"`` when the run holds the SLO and no request's playback stalled (``underrun_requests`` 0),
    ``"missed"`` when either fails (a worst-stall quantile above 0 tells a stall without the count),
    ``"unknown"`` when neither fails and a figure is missing (a results file older than ``underrun_requests``)."""
    slo = slo_status(figures, details, slo_ms)
    underruns = figures.get("underrun_requests")
    stalls = figures.get("underrun_ms", {})
    stalled = any((stalls.get(q) or 0) > 0 for q in ("p50", "p99"))  # a worst stall above 0: some request stalled
    if slo == "missed" or stalled or (underruns is not None and underruns > 0):
        return "missed"
    return "unknown" if slo == "unknown" or underruns is None else "held"


def sweep_limit(statuses: dict[str, str]) -> tuple[str, str | None]:
    """The sweep line of one arm over its runs' statuses (run key -> held, missed or unknown):
    ``("unknown", None)`` when any run is unknown, ``("none", None)`` when none held, else ``("at least",
    key)`` when every run held (the largest load tried is a lower bound) or ``("exactly", key)``: the largest
    load that held."""
    if any(s == "unknown" for s in statuses.values()):
        return "unknown", None
    held = [k for k, s in statuses.items() if s == "held"]
    if not held:
        return "none", None
    best = max(held, key=key_order)
    return ("at least" if len(held) == len(statuses) else "exactly"), best


def max_streams_at_slo(
    per_concurrency: dict[str, dict[str, Any]], details: dict[str, dict[str, Any]], slo_ms: float
) -> int | None:
    """Largest swept concurrency (keys are decimal strings) that holds the SLO; None when none does."""
    held = [int(c) for c, figures in per_concurrency.items() if holds_slo(figures, details[c], slo_ms)]
    return max(held) if held else None


def max_rate_at_slo(
    per_rate: dict[str, dict[str, Any]], details: dict[str, dict[str, Any]], slo_ms: float
) -> tuple[float | None, float | None]:
    """(largest swept rate, requests/s, that holds the SLO; that run's ``live_streams.mean``); Nones when none
    does. Keys are ``"rate=<R>"``."""
    held = [k for k, figures in per_rate.items() if holds_slo(figures, details[k], slo_ms)]
    if not held:
        return None, None
    best = max(held, key=key_order)
    return key_order(best), per_rate[best]["live_streams"]["mean"]


def slo_limits(per_key: dict[str, dict[str, Any]], details: dict[str, dict[str, Any]], slo_ms: float, poisson: bool):
    """The sweep lines of one arm: ``max_streams_at_slo`` (wave, staggered) or ``max_rate_at_slo`` and
    ``live_streams_at_max_rate`` (poisson), and ``slo_held_by_every_run`` (the limit is then a lower bound)."""
    every = bool(per_key) and all(holds_slo(f, details[k], slo_ms) for k, f in per_key.items())
    if poisson:
        rate, live = max_rate_at_slo(per_key, details, slo_ms)
        return {"max_rate_at_slo": rate, "live_streams_at_max_rate": live, "slo_held_by_every_run": every}
    return {"max_streams_at_slo": max_streams_at_slo(per_key, details, slo_ms), "slo_held_by_every_run": every}


def stall_warning(arm: str, key: str | int, details: dict[str, Any]) -> str | None:
    """A warning when the step-time max exceeds 10x its p50, naming the slowest step's batch: a stall of the
    machine when that batch is small, a burst of chunks decoded in one step when it is large."""
    step = details["step_ms"]
    if not (step["p50"] and step["max"] > 10 * step["p50"]):
        return None
    where = f"C={key}" if str(key).isdigit() else str(key)
    warning = f"warning: {arm} {where}: step time max {step['max']:.1f} ms > 10x its p50 {step['p50']:.1f} ms"
    slowest = details.get("slowest_step")
    if slowest is None:
        return warning + " (a stall of the machine, not the codec, is the likely cause)"
    chunks = f"{slowest['chunks']} chunk{'' if slowest['chunks'] == 1 else 's'}"
    frames = f"{slowest['max_frames']} frame{'' if slowest['max_frames'] == 1 else 's'}"
    return (
        f"{warning}; that step decoded {chunks} of up to {frames} "
        "(a burst of chunks when that is most of the live streams, a stall of the machine when it is a few)"
    )
