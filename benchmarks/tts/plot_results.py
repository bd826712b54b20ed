# SPDX-License-Identifier: Apache-2.0
"""Plot ``bench_codec_step.py`` and ``bench_codec_memory.py`` JSON: step latency per arm and decoder-state GiB.

    python benchmarks/tts/plot_results.py --step out/step.json --memory out/memory.json --out benchmarks/results

Files are named after the JSON's device (``h200_step_graph.png`` for an NVIDIA H200, ``cpu_memory.png`` for a
CPU run); a mode without data gets no file (a line says so). Titles name the JSON's preset; every arm has its
own colour (``plotting.arm_styles``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plotting import arm_styles, pyplot  # noqa: E402


def device_slug(device: str) -> str:
    """File-name prefix of a device name: ``"NVIDIA H200"`` -> ``"h200"``, ``"cpu"`` -> ``"cpu"``."""
    name = re.sub(r"^nvidia\s+", "", device.strip().lower())
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_") or "device"


def plot_step(path: Path, out: Path, mode: str = "graph") -> Path | None:
    """Grouped bars of the median step time (ms) per (B, T) for each arm, p10-p90 as error bars; None (no file)
    when no shape has ``mode``."""
    data = json.loads(path.read_text())
    arms = data["arms"]
    rows = [r for r in data["results"] if mode in r["modes"] and r["modes"][mode]["arms"]]
    if not rows or not arms:
        return None
    plt = pyplot()
    styles = arm_styles(arms)
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        med, lo, hi = [], [], []
        for r in rows:
            s = r["modes"][mode]["arms"].get(arm, {})
            med.append(s.get("median_ms", 0.0))
            lo.append(s.get("median_ms", 0.0) - s.get("p10_ms", 0.0))
            hi.append(s.get("p90_ms", 0.0) - s.get("median_ms", 0.0))
        xs = [k + (i - (len(arms) - 1) / 2) * width for k in range(len(rows))]
        ax.bar(xs, med, width, yerr=[lo, hi], label=arm, color=styles[arm]["color"])
    ax.set_xticks(range(len(rows)), [f"B={r['batch']}\nT={r['frames']}" for r in rows])
    ax.set_ylabel(f"step time, {mode} (ms)")
    ax.set_title(f"MOSS {data['preset']} codec decode step on {data['device']} ({mode} mode, median, p10-p90)")
    ax.legend()
    fig.tight_layout()
    target = out / f"{device_slug(data['device'])}_step_{mode}.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def plot_memory(path: Path, out: Path) -> Path | None:
    """Bars of persistent decoder-state GiB per arm and stream count; None (no file) without any arm."""
    data = json.loads(path.read_text())
    arms = [a for a in ("legacy", "v2", "v2-paged", "upstream") if data["arms"].get(a)]
    if not arms:
        return None
    plt = pyplot()
    styles = arm_styles(arms)
    streams = sorted({int(s) for a in arms for s in data["arms"][a]})
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        vals = [data["arms"][arm].get(str(s), {}).get("state_bytes", 0) / 2**30 for s in streams]
        xs = [k + (i - (len(arms) - 1) / 2) * width for k in range(len(streams))]
        bars = ax.bar(xs, vals, width, label=arm, color=styles[arm]["color"])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(streams)), [f"{s} streams" for s in streams])
    ax.set_ylabel("decoder state (GiB)")
    accounting = "meta-device accounting" if data.get("accounting") == "meta" else "allocated"
    ax.set_title(f"Persistent codec KV state, {data['preset']} geometry, bf16 ({accounting})")
    ax.legend()
    fig.tight_layout()
    target = out / f"{device_slug(data['device'])}_memory.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step", type=Path, help="bench_codec_step.py JSON")
    p.add_argument("--memory", type=Path, help="bench_codec_memory.py JSON")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    for flag, path in (("--step", args.step), ("--memory", args.memory)):
        if path is not None and not path.is_file():
            p.error(f"{flag} {str(path)!r}: no such file")
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    jobs = [
        (args.step, f"{mode} mode", lambda m=mode: plot_step(args.step, args.out, m)) for mode in ("graph", "eager")
    ]
    jobs.append((args.memory, "memory", lambda: plot_memory(args.memory, args.out)))
    for source, what, job in jobs:
        if source is None:
            continue
        target = job()
        print(f"wrote {target}" if target else f"no {what} data in {source}: no plot")
        written += [target] if target else []
    return written


if __name__ == "__main__":
    main()
