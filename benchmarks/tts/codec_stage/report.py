# SPDX-License-Identifier: Apache-2.0
"""``results.md`` of one schedule, ``sweep.md`` of a ``--chunks`` sweep, the line printed after each run, and the
note that a CPU run prints first and puts at the top of ``results.md`` (:func:`cpu_note`)."""

from __future__ import annotations

import re
import textwrap
from typing import Any

import common

from .metrics import clean_status, key_order, run_entries, slo_status, sweep_limit

__all__ = [
    "ARM_MEANINGS",
    "cpu_note",
    "legend",
    "fmt",
    "limit_text",
    "plural",
    "progress_line",
    "results_markdown",
    "run_findings",
    "short_command",
    "sweep_markdown",
]


def cpu_note(device: str, preset: str) -> str | None:
    """What a run on the CPU shows and does not, and where the GPU figures are; None for a CUDA run.

    A CPU run is the first thing a new user runs (README, command 1): without this it reads as "no gain".
    The facts: on the CPU no arm captures CUDA graphs and ours use no Triton kernel (the reference attention),
    so upstream's pool needs no scratch slots (``N`` slots, ours ``N + 1`` with the null slot) and our chunks
    are padded to frame sizes that only graph replays pay back (``padded frames``)."""
    if device != "cpu":
        return None
    return (
        "CPU run: it checks the pipeline end to end (simulated talker traffic through every arm, playback "
        "figures, reports) and shows no speed-up by design; what it found, arm by arm and load by load, is "
        "stated at the top of results.md. What this package gains (more streams per GPU, "
        "first audio sooner, half the decoder state) comes from CUDA graphs and Triton kernels, which the CPU "
        "does not run: here upstream's pool needs no scratch slots, so its state is the smaller by our null slot, "
        "and our padding to graph frame sizes buys nothing. Figures measured on one H200: benchmarks/RESULTS.md "
        "and the table at the top of README.md."
    )


#: What each arm is, for the legend the job prints once (an arm missing here is printed by name alone).
ARM_MEANINGS = {
    "v2": "this package's session (the default pool)",
    "legacy": "the same session on the legacy pool",
    "upstream": "vLLM-Omni 0.30.0's own codec stage",
    "ideal": "no codec: audio at once, so its stalls and TTFP are the chunk schedule's and the talker's alone",
    "v2-paged": "this package's session on the paged pool",
}


def legend(arms: list[str], slo_ms: float, poisson: bool) -> str:
    """What the job's arms and figures mean, printed once before the first run (terms: docs/glossary.md)."""
    named = "; ".join(f"{arm} = {ARM_MEANINGS[arm]}" if arm in ARM_MEANINGS else arm for arm in arms)
    load = "rate=R: R requests/s arriving (Poisson)" if poisson else "C=N: N streams live at once"
    return (
        f"Legend. Arms (one configuration each, all on the same trace): {named}. Loads: {load}. Codec p50/p99: "
        "codec-added latency of a chunk, its audio out minus its last frame generated. SLO: codec p99 <= "
        f"{slo_ms:g} ms over the run (held, missed, or unknown without the figure). TTFP: a request's arrival "
        "to its first audio. Underrun: a playback stall (a request's longest); C100: the share of requests whose "
        "longest stall is at most 100 ms. audio-s/s: seconds of audio delivered per second. Talker RTF: seconds "
        "the talker takes per second of codes. More: docs/glossary.md, 'Benchmarks and serving'."
    )


def wrapped(text: str, width: int = 110) -> str:
    """``text`` wrapped for the terminal."""
    return textwrap.fill(text, width)


def short_command(command: str) -> str:
    """``command`` as a reader types it: a leading interpreter path becomes ``python`` (the path says where one
    machine keeps its venv, nothing about the run; ``run.python`` records the version)."""
    return re.sub(r"^\S*/python[0-9.]*(?=\s|$)", "python", command.strip())


def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def plural(count: int, noun: str) -> str:
    """``"1 request"``, ``"2 requests"``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def where(key: str) -> str:
    """``"C=8"`` for a concurrency key, ``"rate=2"`` for a rate key."""
    return f"C={key}" if key.isdigit() else key


def _pair(values: dict[str, Any], keys: tuple[str, ...], spec: str = ".1f") -> str:
    return " / ".join(fmt(values.get(k), spec) for k in keys)


def progress_line(arm: str, key: str, f: dict[str, Any], d: dict[str, Any], slo_ms: float) -> str:
    if "error" in d:
        return f"{arm} {where(key)}: {d['error']}"
    lat = f["codec_latency_ms"]
    return (
        f"{arm} {where(key)}: codec p50/p99 {fmt(lat['p50'])}/{fmt(lat['p99'])} ms, "
        f"TTFP p50 {fmt(f['ttfp_ms']['p50'])} ms, C100 {fmt(f['continuity']['c100'], '.3f')}, "
        f"{fmt(f['audio_seconds_per_second'], '.2f')} audio-s/s, steps graph/eager "
        f"{f['steps_by_path']['graph']}/{f['steps_by_path']['eager']}, SLO {slo_status(f, d, slo_ms)}"
        + (" (stopped early)" if d.get("stopped_early") else "")
    )


def _load_text(key: str) -> str:
    """A run key as its load: ``"8 streams"``, ``"2.5 requests/s"``."""
    value = f"{key_order(key):g}"
    return f"{value} requests/s" if key.startswith("rate=") else f"{value} stream{'' if value == '1' else 's'}"


def limit_text(statuses: dict[str, str]) -> str:
    """The sweep line of one arm (:func:`.metrics.sweep_limit`) as text: ``"at least N"`` when every run held
    (the largest run tried is a lower bound), ``"none"`` when none did, ``"unknown (C=8: a figure is missing)"``
    when a run's status is unknown: a missing figure is never a pass."""
    kind, key = sweep_limit(statuses)
    if kind == "unknown":
        missing = ", ".join(where(k) for k, s in statuses.items() if s == "unknown")
        return f"unknown ({missing}: a figure is missing)"
    if key is None:
        return "none"
    text = f"{key_order(key):g}"
    return f"at least {text}" if kind == "at least" else text


def _statuses(result: dict[str, Any], arm: str, judge) -> dict[str, str]:
    """Run key -> ``judge(figures, details, slo)`` over the runs of ``arm``, recomputed from the figures (the
    sweep lines stored in results.json are not trusted: ``--report-only`` reads files it did not write)."""
    slo = result["run"]["slo"]["codec_latency_p99_ms"]
    details = result["details"][arm]
    return {k: judge(f, details[k], slo) for k, f in run_entries(result["arms"][arm]).items()}


def run_findings(result: dict[str, Any]) -> str:
    """What the run found, arm by arm: at which loads (streams, or requests/s under poisson arrivals) each arm
    held the SLO, missed it, or has no figure to tell."""
    parts = []
    for arm in result["arms"]:
        statuses = _statuses(result, arm, slo_status)
        said = []
        for status in ("held", "missed", "unknown"):
            keys = [k for k, s in statuses.items() if s == status]
            if keys:
                loads = [_load_text(k) for k in keys]
                unit = loads[-1].split(" ", 1)[1]
                numbers = [load.split(" ", 1)[0] for load in loads]
                joined = numbers[0] if len(numbers) == 1 else ", ".join(numbers[:-1]) + " and " + numbers[-1]
                verb = {"held": "held the SLO", "missed": "missed it", "unknown": "has no p99"}[status]
                said.append(f"{verb} at {joined} {unit}")
        if said:
            parts.append(f"{arm} " + ", ".join(said))
    return ("This run: " + "; ".join(parts) + ".") if parts else "This run: no run finished."


def _range(lat: dict[str, Any]) -> str:
    return "-" if lat.get("p10") is None else f"{fmt(lat['p10'])}-{fmt(lat.get('p90'))}"


def _status(f: dict[str, Any], d: dict[str, Any], slo: float) -> str:
    if "error" in d:
        return d["error"].split(":")[0]
    status = slo_status(f, d, slo)
    if status == "unknown":
        return "unknown (codec p99 missing)"
    return status + (" (stopped early)" if d.get("stopped_early") else "")


def _codec_rows(result: dict[str, Any], slo: float) -> list[str]:
    rows = []
    for arm, entry in result["arms"].items():
        for key, f in run_entries(entry).items():
            d = result["details"][arm][key]
            lat, first = f["codec_latency_ms"], f["first_chunk_latency_ms"]
            peak, peak_state = f["peak_memory_bytes"], d.get("peak_state_bytes")
            requests = d.get("requests", result["run"]["requests"].get(key))
            rows.append(
                f"| {arm} | {key.removeprefix('rate=')} | {requests} | {fmt(f['audio_seconds_per_second'], '.2f')} | "
                f"{_pair(lat, ('p50', 'p95', 'p99'))} | {_range(lat)} | "
                f"{_pair(first, ('p50', 'p99'))} | {f['steps_by_path']['graph']} / {f['steps_by_path']['eager']} | "
                f"{fmt(f['padded_frame_fraction'], '.3f')} | {fmt(None if peak is None else common.gib(peak), '.2f')} "
                f"| {fmt(None if peak_state is None else common.gib(peak_state), '.4g')} | {_status(f, d, slo)} |"
            )
    return rows


def _playback_rows(result: dict[str, Any]) -> list[str]:
    rows = []
    for arm, entry in result["arms"].items():
        for key, f in run_entries(entry).items():
            if "ttfp_ms" not in f:
                continue
            rows.append(
                f"| {arm} | {key.removeprefix('rate=')} | {_pair(f['ttfp_ms'], ('p50', 'p95', 'p99'))} | "
                f"{_pair(f['underrun_ms'], ('p50', 'p99'))} | {fmt(f.get('underrun_requests'), 'd')} | "
                f"{_pair(f['continuity'], ('c50', 'c100', 'c200'), '.3f')} | "
                f"{_pair(f['live_streams'], ('mean', 'max'))} | {f['queued_requests']} | "
                f"{_pair(f['queue_wait_ms'], ('p50', 'p99'))} |"
            )
    return rows


def _preemption_rows(result: dict[str, Any]) -> list[str]:
    """Paged arms: preemptions, per stream (max / mean over the streams that ended) and the longest a chunk
    waited in the session's queue."""
    rows = []
    for arm, entry in result["arms"].items():
        if "paged" not in arm:
            continue
        for key in run_entries(entry):
            d = result["details"][arm][key]
            if "preemptions_per_stream" not in d:
                continue
            per = d["preemptions_per_stream"]
            rows.append(
                f"| {arm} | {key.removeprefix('rate=')} | {d.get('preemptions', '-')} | {fmt(per['max'], 'd')} / "
                f"{fmt(per['mean'], '.2f')} | {fmt(d.get('session_wait_ms_max'))} |"
            )
    return rows


def _header(run: dict[str, Any]) -> list[str]:
    arrival = run.get("arrival", "wave")
    if arrival == "poisson":
        load = (
            f"Open-loop arrivals at rates {run['request_rate']} requests/s (gamma gaps, burstiness "
            f"{run['burstiness']:g}), at most {run['max_concurrency']} live streams of {run['concurrency'][0]} slots; "
            f"figures over the requests arriving in the measurement window ({run['warmup_seconds']:g} s of warm-up, "
            f"then {run['measure_seconds']:g} s)."
        )
    else:
        load = (
            f"Arrival {arrival}: {run['requests_per_stream']} requests per stream (requests = concurrency x that), "
            "closed loop."
        )
    note = cpu_note(run.get("device", ""), run["preset"])
    return [
        f"# Codec stage under load: {run['preset']} codec geometry on {run['device_name']}",
        "",
        *([f"> {note}", ""] if note else []),
        f"Commit `{run['commit']}`, {run['date']}. Command: `{short_command(run['command'])}`"
        + (f" (python {run['python']})." if run.get("python") else "."),
        "",
        f"{load} Chunks {run['chunks']} (ramp, last repeated); the talker generates at "
        f"{run['frame_rate'] / run.get('talker_rtf', 1.0):g} frames/s (talker RTF {run.get('talker_rtf', 1.0):g}), "
        f"n_vq {run['n_vq']}, CUDA graphs {run['cuda_graphs']} (frame sizes {run['graph_frame_sizes']}). "
        f"Lengths: {run['length_model']}.",
        f"SLO: codec-added latency p99 <= {run['slo']['codec_latency_p99_ms']:g} ms (every chunk, the first included).",
        "",
    ]


def _host_load_text(run: dict[str, Any]) -> str:
    """`` Host load ...`` from ``run.host_load`` (empty for a file older than it)."""
    load = run.get("host_load")
    if not isinstance(load, dict) or not load.get("before") or not load.get("after"):
        return ""
    return (
        f" Host load average (1 / 5 / 15 min) {' / '.join(f'{v:.2f}' for v in load['before'])} before the runs, "
        f"{' / '.join(f'{v:.2f}' for v in load['after'])} after, on {load['cores']} cores"
        + (" (busy: figures may be slow)." if load.get("busy") else ".")
    )


def results_markdown(result: dict[str, Any]) -> str:
    run = result["run"]
    slo = run["slo"]["codec_latency_p99_ms"]
    poisson = run.get("arrival") == "poisson"
    col = "rate req/s" if poisson else "C"
    lines = (
        _header(run)
        + [run_findings(result) + _host_load_text(run), ""]
        + [
            f"| arm | {col} | requests | audio-s/s | codec p50 / p95 / p99 ms | codec p10-p90 ms | first chunk p50 / p99 ms "
            "| steps graph / eager | padded frames | peak GiB | peak state GiB | SLO |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            *_codec_rows(result, slo),
        ]
    )
    playback = _playback_rows(result)
    if playback:
        lines += [
            "",
            f"| arm | {col} | TTFP p50 / p95 / p99 ms | underrun p50 / p99 ms | requests with an underrun "
            "| C50 / C100 / C200 | live streams mean / max | queued | queue wait p50 / p99 ms |",
            "|---|---|---|---|---|---|---|---|---|",
            *playback,
        ]
    preemption = _preemption_rows(result)
    if preemption:
        lines += [
            "",
            f"| arm | {col} | preemptions | per stream max / mean | longest session wait ms |",
            "|---|---|---|---|---|",
            *preemption,
        ]
    unit = "rate (req/s)" if poisson else "streams"
    lines += [
        "",
        f"| arm | max {unit} at SLO | max {unit} at SLO with no underrun |"
        + (" live streams at the max rate |" if poisson else ""),
        "|---|---|---|" + ("---|" if poisson else ""),
    ]
    for arm in result["arms"]:
        slo_line = _statuses(result, arm, slo_status)
        row = f"| {arm} | {limit_text(slo_line)} | {limit_text(_statuses(result, arm, clean_status))} |"
        if poisson:
            _, best = sweep_limit(slo_line)
            live = None if best is None else result["arms"][arm][best]["live_streams"]["mean"]
            row += f" {fmt(live)} |"
        lines.append(row)
    for arm, reason in run["skipped"].items():
        lines += ["", f"Skipped arm `{arm}`: {reason}"]
    lines += [""] + [f"- {w}" for w in result["warnings"]]
    return "\n".join(lines).rstrip() + "\n"


def sweep_markdown(sweep: dict[str, Any], results: dict[str, dict[str, Any]]) -> str:
    """One table over every schedule of a ``--chunks`` sweep: per schedule, arm and run, the playback and
    codec headline figures (``results`` maps each schedule's directory to its results)."""
    lines = [
        f"# Chunk schedules: {sweep['arrival']} arrival, commit `{sweep['commit']}`",
        "",
        f"Command: `{short_command(sweep['command'])}`. One directory per schedule: "
        f"{', '.join(sweep['schedules'].values())}.",
        "",
        "| chunks | arm | run | TTFP p50 / p99 ms | underrun p99 ms | C50 / C100 / C200 | codec p99 ms | SLO |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for chunks, directory in sweep["schedules"].items():
        result = results.get(directory)
        if result is None:
            lines.append(f"| {chunks} | - | - | - | - | - | - | not run |")
            continue
        slo = result["run"]["slo"]["codec_latency_p99_ms"]
        for arm, entry in result["arms"].items():
            for key, f in run_entries(entry).items():
                d = result["details"][arm][key]
                lines.append(
                    f"| {chunks} | {arm} | {where(key)} | {_pair(f['ttfp_ms'], ('p50', 'p99'))} | "
                    f"{fmt(f['underrun_ms']['p99'])} | {_pair(f['continuity'], ('c50', 'c100', 'c200'), '.3f')} | "
                    f"{fmt(f['codec_latency_ms']['p99'])} | {_status(f, d, slo)} |"
                )
    return "\n".join(lines) + "\n"
