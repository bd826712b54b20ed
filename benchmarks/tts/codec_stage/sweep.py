# SPDX-License-Identifier: Apache-2.0
"""The sweep: every arm through every schedule and load, results written after each run."""

from __future__ import annotations

import gc
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common
import numpy as np
import torch

from .arms import arm_builder
from .cli import Load, Settings, parse_args, resolve
from .metrics import NO_STEPS, downsample_max, preemptions_per_stream, summarize
from .report import cpu_note, legend, sweep_markdown, wrapped
from .results import (
    merge_previous,
    new_result,
    read_results,
    read_sweep,
    record,
    run_header,
    save_latencies,
    schedule_dir,
    write_reports,
)
from .simulate import Run, simulate, warm_up
from .trace import FRAME_RATE, Trace, closed_loop_trace, poisson_trace

__all__ = ["main", "make_trace", "run_arm"]


@dataclass
class Schedule:
    """One chunk schedule of the sweep: its traces, results and output directory."""

    sizes: list[int]
    out: Path
    traces: dict[str, Trace]
    result: dict[str, Any] = field(default_factory=dict)
    latencies: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # arm -> key -> ms per chunk


def make_trace(settings: Settings, load: Load, sizes: list[int]) -> Trace:
    """The trace of one load: closed loop at ``load.concurrency`` (wave, staggered) or open loop at ``load.rate``."""
    args = settings.args
    if settings.poisson:
        return poisson_trace(
            load.rate, args.burstiness, args.warmup_seconds, args.measure_seconds, args.max_concurrency, args.seed
        )
    steady = sizes[-1] * args.talker_rtf / FRAME_RATE  # seconds to generate one steady chunk
    requests = load.concurrency * args.requests_per_stream
    return closed_loop_trace(args.arrival, load.concurrency, requests, steady, args.seed)


def run_arm(name: str, make_arm, trace: Trace, load: Load, sizes: list[int], settings: Settings):
    """(figures, details, raw run) of arm ``name`` on ``trace``: build, warm up, simulate, close."""
    device, cfg = settings.device, settings.cfg
    t0 = time.perf_counter()
    arm = make_arm(load.concurrency, sizes)
    try:
        warm_up(arm, load.concurrency, sizes, settings.n_vq, cfg.codebook_size)
        # What is alive once the arm is built leaves the collector's generations, as the stage does after startup
        # (stage.py); unfrozen when the arm closes.
        gc.collect()
        gc.freeze()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        setup_s = time.perf_counter() - t0
        described = {**arm.describe(), "graph_ladder": list(arm.ladder)}
        arm.reset_state_peak()
        before = arm.stats()
        label = f"{name} {load.key if settings.poisson else 'C=' + load.key}"
        run = simulate(arm, trace, sizes, cfg, settings.args, device, label, settings.n_vq)
        after = arm.stats()
        described["peak_state_bytes"] = arm.state_peak_bytes()
        peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    finally:
        gc.unfreeze()
        arm.close()
        del arm
        common.free_memory(device)
    delta = {
        "steps_by_path": {p: after["steps_by_path"][p] - before["steps_by_path"][p] for p in ("graph", "eager")},
        "decoded_frames": after["decoded_frames"] - before["decoded_frames"],
        "padded_frames": after["padded_frames"] - before["padded_frames"],
    }
    padding_rows = after.get("padding_rows", 0) - before.get("padding_rows", 0)  # our sessions count them
    figures, details = summarize(run, delta, peak)
    details["setup_seconds"] = round(setup_s, 3)
    details["padding_rows"] = padding_rows
    # Our sessions count preemptions, the host bytes of the states they saved and the seconds saving and
    # restoring took (upstream's stage never preempts).
    for key in ("preemptions", "preempted_bytes", "preemption_seconds"):
        details[key] = after.get(key, 0) - before.get(key, 0)
    details["preemption_seconds"] = round(details["preemption_seconds"], 4)
    details["session_wait_ms_max"] = round(run.longest_session_wait * 1e3, 3)
    if "streams_by_preemptions" in after:  # our sessions: the streams that ended in the run
        details["preemptions_per_stream"] = preemptions_per_stream(
            before["streams_by_preemptions"], after["streams_by_preemptions"]
        )
    details.update(described)
    details["state_bytes_over_time"] = downsample_max(run.state_trace)
    return figures, details, run


def _schedules(settings: Settings, command: list[str]) -> list[Schedule]:
    out, sweep = Path(settings.args.out), len(settings.schedules) > 1
    schedules = []
    for sizes in settings.schedules:
        traces = {load.key: make_trace(settings, load, sizes) for load in settings.loads}
        requests = {key: trace.measured_count for key, trace in traces.items()}
        s = Schedule(sizes, schedule_dir(out, sizes, sweep), traces)
        s.result = new_result(run_header(settings, sizes, requests, command), settings.arms)
        s.result["run"]["python"] = platform.python_version()  # results.md names it instead of the venv's path
        s.latencies = {arm: {} for arm in settings.arms}
        if settings.args.append:
            try:
                s.latencies = merge_previous(s.result, s.out)
            except ValueError as exc:
                settings.error(f"--append: {exc}")
        s.out.mkdir(parents=True, exist_ok=True)
        schedules.append(s)
    return schedules


def _run_one(name: str, make_arm, s: Schedule, load: Load, settings: Settings) -> None:
    t_run = time.perf_counter()
    try:
        figures, details, run = run_arm(name, make_arm, s.traces[load.key], load, s.sizes, settings)
    except torch.cuda.OutOfMemoryError as exc:
        run = Run()
        figures, details = summarize(run, NO_STEPS, None)[0], {"error": f"OutOfMemoryError: {str(exc)[:300]}"}
        common.free_memory(settings.device)
    details["wall_seconds"] = round(time.perf_counter() - t_run, 1)  # setup, warm-up and run
    record(s.result, name, load.key, figures, details, s.out.name if s.out != Path(settings.args.out) else "")
    s.latencies[name][load.key] = np.asarray(run.codec_latency, dtype=np.float64) * 1e3
    common.write_json(s.out / "results.json", s.result)
    save_latencies(s.latencies, s.out / "latencies.npz")


def _write_sweep(settings: Settings, schedules: list[Schedule], quiet: bool = False) -> dict[str, Any]:
    """``sweep.json`` and ``sweep.md`` over ``schedules`` (printed unless ``quiet``)."""
    out = Path(settings.args.out)
    first = schedules[0].result["run"]
    sweep = {
        "commit": first["commit"],
        "date": first["date"],
        "command": first["command"],
        "arrival": settings.args.arrival,
        "schedules": {",".join(map(str, s.sizes)): s.out.name for s in schedules},
    }
    common.write_json(out / "sweep.json", sweep)
    md = sweep_markdown(sweep, {s.out.name: s.result for s in schedules})
    (out / "sweep.md").write_text(md)
    if not quiet:
        print(md)
    return {"sweep": sweep, "results": {s.out.name: s.result for s in schedules}}


def _refuse(prog: str, message: str):
    """``--report-only`` cannot use ``--out``'s files: one line naming the file (and key), exit status 2."""
    print(f"{prog}: error: --report-only: {message}", file=sys.stderr)
    raise SystemExit(2)


def _report_only(out: Path, prog: str) -> dict[str, Any]:
    """Rewrite the reports of ``out`` (and of each schedule of a sweep) from its files: every file is read and
    checked first (``results.read_results``), so that a bad one leaves every report as it was."""
    try:
        sweep = read_sweep(out) if (out / "sweep.json").is_file() else None
        directories = [out / d for d in sweep["schedules"].values()] if sweep else [out]
        loaded = [read_results(directory, in_sweep=sweep is not None) for directory in directories]
    except ValueError as exc:
        _refuse(prog, str(exc))
    try:
        for directory, (result, latencies) in zip(directories, loaded):
            write_reports(result, latencies, directory, rewrite=True)
        if sweep is not None:
            results = {d.name: result for d, (result, _) in zip(directories, loaded)}
            (out / "sweep.md").write_text(sweep_markdown(sweep, results))
    except (KeyError, TypeError, ValueError, OSError) as exc:  # a case RESULTS_SHAPE misses, a full disk
        _refuse(prog, f"cannot rewrite the reports of {out} from its files ({type(exc).__name__}: {exc})")
    return {"sweep": sweep, "results": results} if sweep is not None else loaded[0][0]


def host_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def host_load(before: tuple[float, ...], after: tuple[float, ...], cores: int) -> tuple[dict[str, Any], str | None]:
    """``run.host_load`` (``os.getloadavg()`` before the first run and after the reports) and the warning of a
    busy host: a 1-minute load average above ``cores - 0.5`` before the runs, or above ``cores + 0.5`` after
    them (this job's own process counts about 1 there), means other work shared the cores and the timings."""
    busy = before[0] > cores - 0.5 or after[0] > cores + 0.5
    record = {"cores": cores, "before": [round(v, 2) for v in before], "after": [round(v, 2) for v in after]}
    record["busy"] = busy
    if not busy:
        return record, None
    return record, (
        f"the host was busy: 1-minute load average {before[0]:.2f} before the runs and {after[0]:.2f} after, on "
        f"{cores} cores (busy above {cores - 0.5:g} before, {cores + 0.5:g} after): other work shared the cores, "
        "so step times and every latency may be slower than this machine's"
    )


def main(argv: list[str] | None, description: str, started: float | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the results of the one schedule, or for a ``--chunks`` sweep
    ``{"sweep": sweep.json, "results": {directory: results}}``. ``started``: ``time.perf_counter()`` at the
    process start (the script's first line), from which ``wall_seconds`` counts; now when not given."""
    started = time.perf_counter() if started is None else started
    load_before = os.getloadavg()
    command = [sys.executable, "benchmarks/tts/bench_codec_stage.py", *(sys.argv[1:] if argv is None else argv)]
    args, parser = parse_args(argv, description)
    if args.report_only:
        return _report_only(Path(args.out), parser.prog)
    settings = resolve(args, parser)
    note = cpu_note(settings.device.type, settings.preset)
    if note:
        print(wrapped(note) + "\n", flush=True)
    print(wrapped(legend(settings.arms, args.slo_ms, settings.poisson)) + "\n", flush=True)
    if settings.device.type == "cpu":
        torch.set_num_threads(1)  # tiny kernels: a second intra-op thread only adds contention
    for arm, reason in settings.skipped.items():
        print(f"skipped arm {arm}: {reason}")
    schedules = _schedules(settings, command)
    models: dict[str, Any] = {}
    # `ideal` takes no device time: it runs first, so that a command cut short by its time limit still has the
    # schedule's own stalls for every schedule. The tables keep the order of --arms (new_result made the keys).
    for name in sorted(settings.arms, key=lambda arm: arm != "ideal"):
        for s in schedules:
            make_arm = arm_builder(name, settings, models)
            for load in settings.loads:
                _run_one(name, make_arm, s, load, settings)
                if len(schedules) > 1:  # the sweep's summary of what has run so far, rewritten after each run
                    _write_sweep(settings, schedules, quiet=True)
    models.clear()
    common.free_memory(settings.device)
    load, warning = host_load(load_before, os.getloadavg(), host_cores())
    if warning:
        print("warning: " + warning)
    for s in schedules:
        s.result["run"]["host_load"] = load
        s.result["warnings"] += [warning] if warning else []
        write_reports(s.result, s.latencies, s.out)
    # From the process start (imports, set-up) through the reports: the wall time a reader waits.
    for s in schedules:
        s.result["run"]["invocations"][-1]["wall_seconds"] = round(time.perf_counter() - started, 1)
        common.write_json(s.out / "results.json", s.result)
    if len(schedules) == 1:
        return schedules[0].result
    return _write_sweep(settings, schedules)
