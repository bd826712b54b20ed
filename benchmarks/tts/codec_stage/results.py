# SPDX-License-Identifier: Apache-2.0
"""``results.json`` of one schedule (layout in ``bench_codec_stage.py``'s docstring), ``latencies.npz``, the
merge of ``--append``, the reports written from them, and what ``--report-only`` checks before it writes any
(:data:`RESULTS_SHAPE`, :func:`read_results`)."""

from __future__ import annotations

import datetime
import json
import shlex
import zipfile
from pathlib import Path
from typing import Any

import common
import json_shape
import numpy as np
import torch
from json_shape import ANY, BOOL, INT, NUMBER, RUN_KEY, STR, Leaf, ListOf, When, maybe

from .metrics import key_order, run_entries, slo_limits, stall_warning
from .plots import load_plot_name, plot_latency_cdf, plot_load, plot_playback, plot_state_over_time
from .report import progress_line, results_markdown
from .trace import FRAME_RATE, LENGTH_MODEL

__all__ = [
    "SAME_RUN_KEYS",
    "load_latencies",
    "merge_previous",
    "new_result",
    "RESULTS_SHAPE",
    "SWEEP_SHAPE",
    "read_results",
    "read_sweep",
    "record",
    "run_header",
    "save_latencies",
    "schedule_dir",
    "write_reports",
]

# Run settings that must agree before --append merges a new invocation into an existing results.json.
SAME_RUN_KEYS = (
    "commit",
    "device_name",
    "preset",
    "n_vq",
    "seed",
    "arrival",
    "burstiness",
    "talker_rtf",
    "warmup_seconds",
    "measure_seconds",
    "max_concurrency",
    "chunks",
    "cuda_graphs",
    "requests_per_stream",
    "length_model",
    "slo",
    "give_up_ms",
    "state_budget_gib",
    "expected_stream_seconds",
    "page_fraction",
    "time_replays",
    "trace_calls",
)


POSITIVE = Leaf("a positive number", lambda v: json_shape.NUMBER.test(v) and v > 0)
_QUANTILES = {"*": maybe(NUMBER)}
_FIGURES = {
    "codec_latency_ms": {"*": maybe(NUMBER), "p99": maybe(NUMBER)},
    "first_chunk_latency_ms": _QUANTILES,
    "audio_seconds_per_second": maybe(NUMBER),
    "steps_by_path": {"graph": INT, "eager": INT},
    "padded_frame_fraction": maybe(NUMBER),
    "peak_memory_bytes": maybe(NUMBER),
}
# Playback figures: every run since the playback table; results.md leaves them out of runs without ttfp_ms.
_PLAYBACK = {
    "ttfp_ms": _QUANTILES,
    "underrun_ms": {"*": maybe(NUMBER), "p99": maybe(NUMBER)},
    "underrun_requests?": maybe(INT),  # runs since issue 51; results.md shows "-" without it
    "continuity": _QUANTILES,
    "live_streams": _QUANTILES,
    "queued_requests": maybe(INT),
    "queue_wait_ms": _QUANTILES,
}
_DETAILS = {
    "error?": STR,
    "stopped_early?": maybe(BOOL),
    "peak_state_bytes?": maybe(NUMBER),
    "state_bytes_over_time?": maybe([ListOf(NUMBER, 2)]),
}
_SWEEP_LINES = {
    f"{name}?": maybe(NUMBER) for name in ("max_streams_at_slo", "max_rate_at_slo", "live_streams_at_max_rate")
}
_RUN = {
    "slo": {"codec_latency_p99_ms": POSITIVE},
    "frame_rate": POSITIVE,
    "talker_rtf?": POSITIVE,
    "arrival?": STR,
    "requests": {"*": ANY},
    "skipped": {"*": ANY},
}
_RUN |= dict.fromkeys(("commit", "date", "command", "preset", "device_name", "chunks", "n_vq", "cuda_graphs"), ANY)
_RUN |= dict.fromkeys(("graph_frame_sizes", "length_model"), ANY)
_POISSON = {"request_rate": ANY, "burstiness": NUMBER, "max_concurrency": ANY, "concurrency": ListOf(ANY, 1)}
_POISSON |= {"warmup_seconds": NUMBER, "measure_seconds": NUMBER}
#: What results.md and the plots read of a results.json: checked whole before ``--report-only`` writes anything.
RESULTS_SHAPE = {
    "run": (_RUN, When(lambda run: run.get("arrival") == "poisson", _POISSON, {"requests_per_stream": ANY})),
    "arms": {"*": {RUN_KEY: When(lambda f: "ttfp_ms" in f, _FIGURES | _PLAYBACK, _FIGURES)} | _SWEEP_LINES},
    "details": {"*": {RUN_KEY: _DETAILS}},
    "warnings": [ANY],
}
#: A results.json of a ``--chunks`` sweep: ``sweep.md`` reads the playback figures of every run.
_IN_SWEEP = RESULTS_SHAPE | {"arms": {"*": {RUN_KEY: _FIGURES | _PLAYBACK} | _SWEEP_LINES}}
#: ``sweep.json``: each schedule's directory is a name inside ``--out``.
SWEEP_SHAPE = {
    "commit": ANY,
    "command": ANY,
    "arrival": ANY,
    "schedules": {
        "*": Leaf("a directory name", lambda v: isinstance(v, str) and "/" not in v and v not in ("", ".", ".."))
    },
}


def read_results(directory: Path, in_sweep: bool = False) -> tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """``directory``'s results.json and latencies.npz, checked for everything the reports read.

    Returns:
        ``(results, latencies)``: latencies arm -> run key -> ms per chunk (float64, finite), as
        :func:`load_latencies`.
    Raises:
        ValueError: one line naming the file and the key: a missing, truncated or foreign file, a key that
            :data:`RESULTS_SHAPE` needs missing, ``null`` or of another type, ``NaN`` anywhere, a run of
            ``arms`` without its ``details``, a missing latencies.npz, or an array of it that is not finite ms
            of a run.
    """
    path = directory / "results.json"
    result = json_shape.load(path, _IN_SWEEP if in_sweep else RESULTS_SHAPE)
    for arm, entry in result["arms"].items():
        if arm not in result["details"]:
            raise ValueError(f"{path}: details.{arm} is missing (arms.{arm} has runs)")
        for key in (k for k in entry if RUN_KEY.matches(k)):
            if key not in result["details"][arm]:
                raise ValueError(f"{path}: details.{arm}.{key} is missing (arms.{arm}.{key} is a run)")
    npz = directory / "latencies.npz"
    if not npz.is_file():  # the latency CDF is drawn from it: without it there is no report to rewrite
        raise ValueError(f"{npz} does not exist")
    if not zipfile.is_zipfile(npz):  # numpy would try it as a pickle and say so
        raise ValueError(f"{npz} is not readable: not an .npz (zip) archive")
    try:
        latencies = load_latencies(directory)
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"{npz} is not readable: {exc}") from None
    for arm, per_key in latencies.items():
        for key, values in per_key.items():
            name = f"{directory / 'latencies.npz'}: {arm}/{key}"
            if values.ndim != 1 or values.dtype.kind not in "fiu" or not np.isfinite(values).all():
                raise ValueError(f"{name} is not a list of finite latencies (ms)")
    return result, latencies


def read_sweep(out: Path) -> dict[str, Any]:
    """``out``'s sweep.json, checked (:data:`SWEEP_SHAPE`); ValueError with one line naming the file and key."""
    return json_shape.load(out / "sweep.json", SWEEP_SHAPE)


def schedule_dir(out: Path, sizes: list[int], sweep: bool) -> Path:
    """``out`` itself for one schedule; ``out/chunks_1_4_15`` for schedule ``1,4,15`` of a sweep."""
    return out / ("chunks_" + "_".join(str(s) for s in sizes)) if sweep else out


def run_header(settings, sizes: list[int], requests: dict[str, int], command: list[str]) -> dict[str, Any]:
    args, device = settings.args, settings.device
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit, command_line = common.git_commit(), shlex.join(command)
    poisson = settings.poisson
    return {
        "date": date,
        "commit": commit,
        "command": command_line,
        "invocations": [{"date": date, "commit": commit, "command": command_line}],
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "preset": settings.preset,
        "n_vq": settings.n_vq,
        "seed": args.seed,
        "arrival": args.arrival,
        "burstiness": args.burstiness if poisson else None,
        "talker_rtf": args.talker_rtf,
        "request_rate": [load.rate for load in settings.loads] if poisson else None,
        "max_concurrency": args.max_concurrency if poisson else None,
        "warmup_seconds": args.warmup_seconds if poisson else None,
        "measure_seconds": args.measure_seconds if poisson else None,
        "chunks": sizes,
        "cuda_graphs": device.type == "cuda" and not args.eager,
        "graph_frame_sizes": sorted(set(sizes)),
        "concurrency": sorted({load.concurrency for load in settings.loads}),
        "keys": [load.key for load in settings.loads],
        "requests_per_stream": None if poisson else args.requests_per_stream,
        "requests": requests,
        "length_model": LENGTH_MODEL,
        "frame_rate": FRAME_RATE,
        "slo": {"codec_latency_p99_ms": args.slo_ms},
        "give_up_ms": args.give_up_ms,
        # Settings that change what our arms run or how they are timed.
        "state_budget_gib": args.state_budget_gib,
        "expected_stream_seconds": args.expected_stream_seconds,
        "page_fraction": args.page_fraction,
        "time_replays": args.time_replays,
        "trace_calls": args.trace_calls,
        "skipped": settings.skipped,
    }


def new_result(header: dict[str, Any], arms: list[str]) -> dict[str, Any]:
    return {"run": header, "arms": {arm: {} for arm in arms}, "details": {arm: {} for arm in arms}, "warnings": []}


def _sorted(entries: dict[str, Any]) -> dict[str, Any]:
    return dict(sorted(entries.items(), key=lambda kv: key_order(kv[0])))


def record(result: dict[str, Any], arm: str, key: str, figures, details, label: str = "") -> None:
    """Put one run's figures and details into ``result`` (keys in increasing order), update the SLO lines,
    print its line and any stall warning (prefixed ``[label]``, the schedule's directory in a sweep)."""
    run = result["run"]
    slo_ms = run["slo"]["codec_latency_p99_ms"]
    per_key = _sorted({**run_entries(result["arms"][arm]), key: figures})
    result["details"][arm] = _sorted({**result["details"][arm], key: details})
    limits = slo_limits(per_key, result["details"][arm], slo_ms, run["arrival"] == "poisson")
    result["arms"][arm] = {**per_key, **limits}
    warning = stall_warning(arm, key, details) if "step_ms" in details else None
    prefix = f"[{label}] " if label else ""
    if warning:
        print(prefix + warning)
        result["warnings"].append(warning)
    print(prefix + progress_line(arm, key, figures, details, slo_ms), flush=True)


def merge_previous(result: dict[str, Any], out: Path) -> dict[str, dict[str, np.ndarray]]:
    """``--append``: fold ``out``'s results.json (same settings and commit) into ``result``, in place.

    Returns the stored latencies (``latencies.npz``) of the previous invocations: arm -> key -> ms.
    Raises:
        ValueError: no previous results, or settings that differ (named in the message).
    """
    path = out / "results.json"
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    previous = json.loads(path.read_text())
    run, old = result["run"], previous["run"]
    same = SAME_RUN_KEYS + (("concurrency",) if run["arrival"] == "poisson" else ())
    differ = [k for k in same if old.get(k) != run[k]]
    if differ:
        raise ValueError(
            f"{path} was made with other settings: " + ", ".join(f"{k} {old.get(k)!r} != {run[k]!r}" for k in differ)
        )
    run["invocations"] = old["invocations"] + run["invocations"]
    run["concurrency"] = sorted(set(old["concurrency"]) | set(run["concurrency"]))
    if run["request_rate"] is not None:
        run["request_rate"] = sorted(set(old["request_rate"]) | set(run["request_rate"]))
    run["keys"] = sorted(set(old["keys"]) | set(run["keys"]), key=key_order)
    run["requests"] = _sorted({**old["requests"], **run["requests"]})
    run["skipped"] = {**old["skipped"], **run["skipped"]}
    arms = list(dict.fromkeys([*previous["arms"], *result["arms"]]))
    result["arms"] = {arm: previous["arms"].get(arm, {}) for arm in arms}
    result["details"] = {arm: previous["details"].get(arm, {}) for arm in arms}
    result["warnings"] = previous["warnings"]
    return {arm: {} for arm in arms} | load_latencies(out)


def load_latencies(out: Path) -> dict[str, dict[str, np.ndarray]]:
    stored: dict[str, dict[str, np.ndarray]] = {}
    if (out / "latencies.npz").is_file():
        with np.load(out / "latencies.npz") as data:
            for name in data.files:
                arm, slash, key = name.partition("/")
                if not slash or not RUN_KEY.matches(key):
                    raise ValueError(f"array {name!r} is not named <arm>/<run key>")
                stored.setdefault(arm, {})[key] = data[name]
    return stored


def save_latencies(latencies: dict[str, dict[str, np.ndarray]], path: Path) -> None:
    arrays = {f"{arm}/{key}": values for arm, per_key in latencies.items() for key, values in per_key.items()}
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def write_reports(
    result: dict[str, Any], latencies: dict[str, dict[str, np.ndarray]], out: Path, rewrite: bool = False
) -> None:
    """``results.md`` (also printed) and the four plots of one schedule into ``out``; ``rewrite``
    (``--report-only``): only these are written, and the closing line says so."""
    md = results_markdown(result)
    (out / "results.md").write_text(md)
    plot_latency_cdf(result, latencies, out / "latency_cdf.png")
    plot_load(result, out / load_plot_name(result))
    plot_playback(result, out / "playback.png")
    plot_state_over_time(result, out / "state_over_time.png")
    print(md)
    plots = f"latency_cdf.png, {load_plot_name(result)}, playback.png, state_over_time.png"
    if rewrite:
        print(f"rewrote {out}/results.md, {plots} from results.json and latencies.npz")
    else:
        print(f"wrote {out}/results.json, results.md, latencies.npz, {plots}")
