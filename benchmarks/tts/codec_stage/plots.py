# SPDX-License-Identifier: Apache-2.0
"""The plots of one schedule's results, for every arrival model (x: concurrency, or request rate for poisson).

* ``latency_cdf.png``: per arm (``ideal`` left out: its codec adds nothing) the CDF of codec-added latency.
* ``concurrency.png`` (``request_rate.png`` for poisson): audio seconds per second and codec p50/p99.
* ``playback.png``: TTFP p50/p99, worst stall (underrun) p50/p99 (both y axes from 0) and continuity (C100, band
  C50 to C200, y from 0 to 1).
* ``state_over_time.png``: decoder state in use against the simulated clock, one panel per run, in the largest
  binary unit (GiB, MiB or KiB) that the figure's largest peak fills; each arm its own line style and markers, so
  that arms holding the same state (legacy and upstream on a CPU) stay visible.

Each arm has one style in every figure (``plotting.arm_styles``); the ideal arm's lines are dashed. A log axis is
labelled at 1, 2 and 5 times each power of ten (every integer step on a range under one decade), and the x axis at
every measured concurrency or rate. Legends sit below their panels (``layout="constrained"`` keeps labels apart).
When no request of any arm has a stall of at most 200 ms, the continuity panel says why (the chunk schedule).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
from plotting import arm_styles, log_axis, pyplot

from .metrics import key_order, run_entries
from .report import plural, where

__all__ = [
    "continuity_note",
    "load_plot_name",
    "plot_latency_cdf",
    "plot_load",
    "plot_playback",
    "plot_state_over_time",
    "state_unit",
]

#: Binary units of the state plot, largest first: (bytes per unit, name).
STATE_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
#: Line styles of the state plot's arms, in turn: lines that coincide stay told apart.
STATE_LINESTYLES = ("-", "--", "-.", ":")


def load_plot_name(result: dict[str, Any]) -> str:
    return "request_rate.png" if result["run"].get("arrival") == "poisson" else "concurrency.png"


def _keys(result: dict[str, Any]) -> list[str]:
    keys = {k for entry in result["arms"].values() for k in run_entries(entry)}
    return sorted(keys, key=key_order)


def _requests(result: dict[str, Any], key: str) -> int | str:
    return result["run"]["requests"].get(key, "?")


def _title(result: dict[str, Any]) -> str:
    run = result["run"]
    return (
        f"{run['preset']} codec geometry on {run['device_name']}, arrival {run.get('arrival', 'wave')}, "
        f"chunks {run['chunks']}, talker RTF {run.get('talker_rtf', 1.0):g}"
    )


def _x_axis(ax, result: dict[str, Any]) -> None:
    xs = [key_order(k) for k in _keys(result)]
    if xs and max(xs) >= 4 * min(xs):
        ax.set_xscale("log", base=2)
        log_axis(ax.xaxis)
    if xs:
        # Every measured load labelled, nothing else (a log axis would otherwise label powers of two only).
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.set_xticks([], minor=True)
    poisson = result["run"].get("arrival") == "poisson"
    ax.set_xlabel("request rate (requests/s)" if poisson else "concurrency (live streams)")
    ax.grid(alpha=0.3)


def _series(entry: dict[str, Any], *path: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for key, figures in sorted(run_entries(entry).items(), key=lambda kv: key_order(kv[0])):
        value: Any = figures
        for name in path:
            value = value.get(name) if isinstance(value, dict) else None
        xs.append(key_order(key))
        ys.append(np.nan if value is None else float(value))
    return xs, ys


def _label_log_axis(axis, low: float, high: float) -> None:
    """Labels on a log ``axis`` whose data span ``[low, high]`` (> 0): at 1, 2 and 5 x 10^k, or at every integer
    multiple of 10^k when the span is under one decade, so that at least two labels show."""
    from matplotlib.ticker import LogLocator

    log_axis(axis)
    subs = (1.0, 2.0, 5.0) if high >= 10 * low else tuple(float(s) for s in range(1, 10))
    axis.set_major_locator(LogLocator(base=10, subs=subs))


def _positive_span(*series: list[float]) -> tuple[float, float] | None:
    values = [v for s in series for v in s if v is not None and np.isfinite(v) and v > 0]
    return (min(values), max(values)) if values else None


def _legend_below(ax, columns: int = 2) -> None:
    """The legend of ``ax`` under it, outside the data (constrained layout makes room)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=columns, frameon=False)


def _figure(plt, columns: int, width: float, height: float = 4.6):
    return plt.subplots(1, columns, figsize=(width * columns, height), squeeze=False, layout="constrained")


def _save(fig, plt, path: Path) -> None:
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_cdf(result: dict[str, Any], latencies: dict[str, dict[str, np.ndarray]], path: Path) -> None:
    """One panel per arm: the CDF of codec-added latency (ms) per run, p50 and p99 marked."""
    plt = pyplot()
    arms = [a for a in latencies if a != "ideal" and any(len(v) for v in latencies[a].values())]
    fig, axes = _figure(plt, max(1, len(arms)), 5.2)
    slo = result["run"]["slo"]["codec_latency_p99_ms"]
    for ax, arm in zip(axes[0], arms):
        runs = sorted(latencies[arm].items(), key=lambda kv: key_order(kv[0]))
        for i, (key, values) in enumerate(runs):
            if not len(values):
                continue
            ms = np.sort(values)
            label = f"{where(key)}, {plural(_requests(result, key), 'request')}"
            (line,) = ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), drawstyle="steps-post", label=label)
            for q, marker in ((50, "o"), (99, "^")):
                x = float(np.percentile(ms, q))
                ax.plot([x], [q / 100], marker=marker, color=line.get_color(), linestyle="none")
                # One label row per curve: close percentiles stay readable.
                ax.annotate(
                    f"p{q} {x:.0f}",
                    (x, q / 100),
                    textcoords="offset points",
                    xytext=(4, -10 - 9 * i),
                    fontsize=7,
                    color=line.get_color(),
                )
        ax.axvline(slo, color="tab:red", linestyle="--", linewidth=0.8, label=f"SLO p99 {slo:g} ms")
        ax.set_xscale("log")
        span = _positive_span([slo], *[list(v) for _, v in runs])
        if span:
            _label_log_axis(ax.xaxis, *span)
        ax.set_xlabel("codec-added latency per chunk (ms, log)")
        ax.set_ylabel("fraction of chunks")
        ax.set_title(f"{arm}: {', '.join(where(k) for k, _ in runs)}", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{_title(result)} (o = p50, ^ = p99)", fontsize=9)
    _save(fig, plt, path)


def plot_load(result: dict[str, Any], path: Path) -> None:
    """Audio seconds per second and codec-added latency p50/p99 against concurrency or rate, one style per arm."""
    plt = pyplot()
    fig, ((left, right),) = _figure(plt, 2, 5.6, 4.8)
    styles = arm_styles(result["arms"])
    latencies: list[list[float]] = []
    for arm, entry in result["arms"].items():
        left.plot(*_series(entry, "audio_seconds_per_second"), label=arm, **styles[arm])
        if arm == "ideal":
            continue  # its codec adds nothing: no point on a log axis
        for q, alpha in (("p50", 0.45), ("p99", 1.0)):
            xs, ys = _series(entry, "codec_latency_ms", q)
            right.plot(xs, ys, alpha=alpha, label=f"{arm} {q}", **styles[arm])
            latencies.append(ys)
    if result["run"].get("arrival") != "poisson":
        cs = [key_order(k) for k in _keys(result)]
        rtf = result["run"].get("talker_rtf", 1.0)
        cap = [c / rtf for c in cs]  # each live stream's talker makes 1 / RTF s of audio per s
        left.plot(cs, cap, color="gray", linestyle=":", linewidth=0.8, label="C / talker RTF (the talker's cap)")
    slo = result["run"]["slo"]["codec_latency_p99_ms"]
    right.axhline(slo, color="tab:red", linestyle="--", linewidth=0.8, label=f"SLO p99 {slo:g} ms")
    right.set_yscale("log")
    _label_log_axis(right.yaxis, *(_positive_span([slo], *latencies) or (slo, slo)))
    for ax in (left, right):
        _x_axis(ax, result)
        _legend_below(ax, 3)
    left.set_ylabel("audio seconds per second")
    right.set_ylabel("codec-added latency (ms, log; faint: p50)")
    requests = ", ".join(f"{where(k)}: {n}" for k, n in result["run"]["requests"].items())
    left.set_title(f"throughput (requests: {requests})", fontsize=9)
    right.set_title("codec-added latency", fontsize=9)
    fig.suptitle(_title(result), fontsize=9)
    _save(fig, plt, path)


def continuity_note(result: dict[str, Any]) -> str | None:
    """Why the continuity panel is flat at zero, when it is (no request of any arm stalls at most 200 ms, every
    run measured): the chunk schedule stalls by itself, as the ideal arm (no codec) shows. None otherwise."""
    runs = [f for entry in result["arms"].values() for f in run_entries(entry).values() if "continuity" in f]
    if not runs or any(f["continuity"].get("c200") != 0 for f in runs):
        return None
    chunks = ",".join(str(c) for c in result["run"]["chunks"])
    ideal = [f["underrun_ms"]["p50"] for f in run_entries(result["arms"].get("ideal", {})).values()]
    if ideal and None not in ideal:
        cause = f"the ideal arm (no codec) stalls {min(ideal):.0f} ms too: the chunk schedule {chunks} stalls by itself"
    else:
        cause = f"run the ideal arm to see whether the chunk schedule {chunks} stalls by itself"
    text = f"Every request stalls over 200 ms; {cause} (docs/serving.md, 'Choosing a chunk schedule')."
    return textwrap.fill(text, 46)


def _continuity_band(cont, entry: dict[str, Any], style: dict[str, Any]) -> None:
    xs, c50 = _series(entry, "continuity", "c50")
    cont.fill_between(xs, c50, _series(entry, "continuity", "c200")[1], color=style["color"], alpha=0.12, linewidth=0)


def plot_playback(result: dict[str, Any], path: Path) -> None:
    """TTFP, worst stall per request and continuity against concurrency or rate, one style per arm; a note on
    the continuity panel when it is flat at zero (:func:`continuity_note`)."""
    plt = pyplot()
    fig, ((ttfp, stall, cont),) = _figure(plt, 3, 5.0, 5.0)
    styles = arm_styles(result["arms"])
    for arm, entry in result["arms"].items():
        style = styles[arm]
        for q, alpha in (("p50", 0.45), ("p99", 1.0)):
            ttfp.plot(*_series(entry, "ttfp_ms", q), alpha=alpha, label=f"{arm} {q}", **style)
            stall.plot(*_series(entry, "underrun_ms", q), alpha=alpha, label=f"{arm} {q}", **style)
        cont.plot(*_series(entry, "continuity", "c100"), label=f"{arm} C100", **style)
        _continuity_band(cont, entry, style)
    ttfp.set_ylabel("TTFP: first audio - arrival (ms; faint: p50)")
    stall.set_ylabel("worst stall per request (ms; faint: p50)")
    cont.set_ylabel("share of requests (C100; band: C50 to C200)")
    cont.set_ylim(-0.02, 1.02)
    # From zero: a y axis zoomed to the data made differences of 1 to 4 % fill the panel.
    ttfp.set_ylim(bottom=0)
    stall.set_ylim(bottom=0)
    note = continuity_note(result)
    if note:
        box = {"boxstyle": "round", "facecolor": "white", "edgecolor": "0.6"}
        cont.text(0.5, 0.5, note, transform=cont.transAxes, ha="center", va="center", fontsize=8, bbox=box)
    for ax in (ttfp, stall, cont):
        _x_axis(ax, result)
        _legend_below(ax, 2)
    ttfp.set_title("time to first audio", fontsize=9)
    stall.set_title("underrun (worst stall)", fontsize=9)
    cont.set_title("continuity: worst stall <= 50 / 100 / 200 ms", fontsize=9)
    fig.suptitle(_title(result), fontsize=9)
    _save(fig, plt, path)


def state_unit(peak_bytes: float) -> tuple[int, str]:
    """(bytes per unit, name): the largest of GiB, MiB and KiB that ``peak_bytes`` fills at least once (KiB
    below 1 KiB), so that the state plot's figures have three significant digits, not leading zeros."""
    for scale, name in STATE_UNITS:
        if peak_bytes >= scale:
            return scale, name
    return STATE_UNITS[-1]


def _state_traces(result: dict[str, Any], key: str) -> list[tuple[str, list, int]]:
    """(arm, [seconds, bytes] points, peak bytes) of run ``key`` for every arm that holds state (not ideal)."""
    traces = []
    for arm, per_key in result["details"].items():
        trace = per_key.get(key, {}).get("state_bytes_over_time")
        if trace and arm != "ideal":
            traces.append((arm, trace, per_key[key].get("peak_state_bytes", max(b for _, b in trace))))
    return traces


def plot_state_over_time(result: dict[str, Any], path: Path) -> None:
    """Decoder state in use against the simulated clock (s): one panel per run, one line per arm
    (``details.<arm>.<key>.state_bytes_over_time``; runs without it and the ideal arm are left out), in the unit
    :func:`state_unit` picks for the figure's largest peak."""
    plt = pyplot()
    keys = _keys(result)
    fig, axes = _figure(plt, max(1, len(keys)), 5.2, 4.4)
    styles = arm_styles(result["details"])
    panels = {key: _state_traces(result, key) for key in keys}
    scale, unit = state_unit(max((peak for traces in panels.values() for *_, peak in traces), default=0))
    for ax, key in zip(axes[0], keys):
        for i, (arm, trace, peak) in enumerate(panels[key]):
            # Staggered markers and one line style per arm: equal states (lines on top of each other) stay visible.
            every = max(1, len(trace) // 6)
            style = {**styles[arm], "linestyle": STATE_LINESTYLES[i % len(STATE_LINESTYLES)]}
            ax.plot(
                [t for t, _ in trace],
                [b / scale for _, b in trace],
                drawstyle="steps-post",
                markevery=(i * every // max(1, len(panels[key])), every),
                label=f"{arm} (peak {peak / scale:.3g} {unit})",
                **style,
            )
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel(f"decoder state in use ({unit})")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{where(key)}, {plural(_requests(result, key), 'request')}", fontsize=9)
        _legend_below(ax, 2)
        ax.grid(alpha=0.3)
    fig.suptitle(f"decoder state in use: {_title(result)}", fontsize=9)
    _save(fig, plt, path)
