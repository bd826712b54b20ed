# SPDX-License-Identifier: Apache-2.0
"""The plots of one schedule's results, for every arrival model (x: concurrency, or request rate for poisson).

* ``latency_cdf.png``: per arm (``ideal`` left out: its codec adds nothing) the CDF of codec-added latency.
* ``concurrency.png`` (``request_rate.png`` for poisson): audio seconds per second and codec p50/p99.
* ``playback.png``: TTFP p50/p99, worst stall (underrun) p50/p99 and continuity (C100, band C50 to C200).
* ``state_over_time.png``: decoder state in use against the simulated clock, one panel per run.

Each arm has one style in every figure (``plotting.arm_styles``); the ideal arm's lines are dashed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import common
import numpy as np
from plotting import arm_styles, log_axis, pyplot

from .metrics import key_order, run_entries
from .report import plural, where

__all__ = ["load_plot_name", "plot_latency_cdf", "plot_load", "plot_playback", "plot_state_over_time"]


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
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
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


def _save(fig, plt, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_cdf(result: dict[str, Any], latencies: dict[str, dict[str, np.ndarray]], path: Path) -> None:
    """One panel per arm: the CDF of codec-added latency (ms) per run, p50 and p99 marked."""
    plt = pyplot()
    arms = [a for a in latencies if a != "ideal" and any(len(v) for v in latencies[a].values())]
    fig, axes = plt.subplots(1, max(1, len(arms)), figsize=(5.2 * max(1, len(arms)), 4.0), squeeze=False)
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
        log_axis(ax.xaxis)
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
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4.0))
    styles = arm_styles(result["arms"])
    for arm, entry in result["arms"].items():
        left.plot(*_series(entry, "audio_seconds_per_second"), label=arm, **styles[arm])
        if arm == "ideal":
            continue  # its codec adds nothing: no point on a log axis
        for q, alpha in (("p50", 0.45), ("p99", 1.0)):
            right.plot(*_series(entry, "codec_latency_ms", q), alpha=alpha, label=f"{arm} {q}", **styles[arm])
    if result["run"].get("arrival") != "poisson":
        cs = [key_order(k) for k in _keys(result)]
        rtf = result["run"].get("talker_rtf", 1.0)
        cap = [c / rtf for c in cs]  # each live stream's talker makes 1 / RTF s of audio per s
        left.plot(cs, cap, color="gray", linestyle=":", linewidth=0.8, label="C / talker RTF (the talker's cap)")
    slo = result["run"]["slo"]["codec_latency_p99_ms"]
    right.axhline(slo, color="tab:red", linestyle="--", linewidth=0.8, label=f"SLO p99 {slo:g} ms")
    right.set_yscale("log")
    log_axis(right.yaxis)
    for ax in (left, right):
        _x_axis(ax, result)
        ax.legend(fontsize=7)
    left.set_ylabel("audio seconds per second")
    right.set_ylabel("codec-added latency (ms, log; faint: p50)")
    requests = ", ".join(f"{where(k)}: {n}" for k, n in result["run"]["requests"].items())
    left.set_title(f"throughput (requests: {requests})", fontsize=9)
    right.set_title("codec-added latency", fontsize=9)
    fig.suptitle(_title(result), fontsize=9)
    _save(fig, plt, path)


def plot_playback(result: dict[str, Any], path: Path) -> None:
    """TTFP, worst stall per request and continuity against concurrency or rate, one style per arm."""
    plt = pyplot()
    fig, (ttfp, stall, cont) = plt.subplots(1, 3, figsize=(15.0, 4.0))
    styles = arm_styles(result["arms"])
    for arm, entry in result["arms"].items():
        style = styles[arm]
        for q, alpha in (("p50", 0.45), ("p99", 1.0)):
            ttfp.plot(*_series(entry, "ttfp_ms", q), alpha=alpha, label=f"{arm} {q}", **style)
            stall.plot(*_series(entry, "underrun_ms", q), alpha=alpha, label=f"{arm} {q}", **style)
        xs, c100 = _series(entry, "continuity", "c100")
        cont.plot(xs, c100, label=f"{arm} C100", **style)
        cont.fill_between(
            xs,
            _series(entry, "continuity", "c50")[1],
            _series(entry, "continuity", "c200")[1],
            color=style["color"],
            alpha=0.12,
            linewidth=0,
        )
    ttfp.set_ylabel("TTFP: first audio - arrival (ms; faint: p50)")
    stall.set_ylabel("worst stall per request (ms; faint: p50)")
    cont.set_ylabel("share of requests (C100; band: C50 to C200)")
    cont.set_ylim(-0.02, 1.02)
    for ax in (ttfp, stall, cont):
        _x_axis(ax, result)
        ax.legend(fontsize=7)
    ttfp.set_title("time to first audio", fontsize=9)
    stall.set_title("underrun (worst stall)", fontsize=9)
    cont.set_title("continuity: worst stall <= 50 / 100 / 200 ms", fontsize=9)
    fig.suptitle(_title(result), fontsize=9)
    _save(fig, plt, path)


def plot_state_over_time(result: dict[str, Any], path: Path) -> None:
    """Decoder state in use (GiB) against the simulated clock (s): one panel per run, one line per arm
    (``details.<arm>.<key>.state_bytes_over_time``; runs without it and the ideal arm are left out)."""
    plt = pyplot()
    keys = _keys(result)
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(5.2 * max(1, len(keys)), 4.0), squeeze=False)
    styles = arm_styles(result["details"])
    for ax, key in zip(axes[0], keys):
        for arm, per_key in result["details"].items():
            trace = per_key.get(key, {}).get("state_bytes_over_time")
            if not trace or arm == "ideal":
                continue
            peak = common.gib(per_key[key].get("peak_state_bytes", max(b for _, b in trace)))
            style = {**styles[arm], "marker": None}
            ax.plot(
                [t for t, _ in trace],
                [common.gib(b) for _, b in trace],
                drawstyle="steps-post",
                label=f"{arm} (peak {peak:.3g} GiB)",
                **style,
            )
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("decoder state in use (GiB)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{where(key)}, {plural(_requests(result, key), 'request')}", fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3)
    fig.suptitle(f"decoder state in use: {_title(result)}", fontsize=9)
    _save(fig, plt, path)
