# SPDX-License-Identifier: Apache-2.0
"""Plot ``bench_codec_step.py`` and ``bench_codec_memory.py`` JSON: step latency per arm and decoder-state GiB.

    python benchmarks/tts/plot_results.py --step benchmarks/results/h200_step.json \
        --memory benchmarks/results/h200_memory.json --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"legacy": "tab:gray", "v2": "tab:blue", "upstream": "tab:orange"}


def plot_step(path: Path, out: Path, mode: str = "graph") -> Path:
    """Grouped bars of the median step time (ms) per (B, T) for each arm, p10-p90 as error bars."""
    data = json.loads(path.read_text())
    arms = data["arms"]
    rows = [r for r in data["results"] if mode in r["modes"]]
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
        ax.bar(xs, med, width, yerr=[lo, hi], label=arm, color=COLORS.get(arm))
    ax.set_xticks(range(len(rows)), [f"B={r['batch']}\nT={r['frames']}" for r in rows])
    ax.set_ylabel(f"step time, {mode} (ms)")
    ax.set_title(f"MOSS v2 codec decode step on {data['device']} ({mode} mode, median, p10-p90)")
    ax.legend()
    fig.tight_layout()
    target = out / f"h200_step_{mode}.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def plot_memory(path: Path, out: Path) -> Path:
    """Bars of persistent decoder-state GiB per arm and stream count."""
    data = json.loads(path.read_text())
    arms = [a for a in ("legacy", "v2", "upstream") if a in data["arms"]]
    streams = sorted({int(s) for a in arms for s in data["arms"][a]})
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        vals = [data["arms"][arm].get(str(s), {}).get("state_bytes", 0) / 2**30 for s in streams]
        xs = [k + (i - (len(arms) - 1) / 2) * width for k in range(len(streams))]
        bars = ax.bar(xs, vals, width, label=arm, color=COLORS.get(arm))
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(streams)), [f"{s} streams" for s in streams])
    ax.set_ylabel("decoder state (GiB)")
    ax.set_title("Persistent codec KV state, v2 geometry, bf16")
    ax.legend()
    fig.tight_layout()
    target = out / "h200_memory.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step", type=Path, help="bench_codec_step.py JSON")
    p.add_argument("--memory", type=Path, help="bench_codec_memory.py JSON")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.step:
        for mode in ("graph", "eager"):
            print("wrote", plot_step(args.step, args.out, mode))
    if args.memory:
        print("wrote", plot_memory(args.memory, args.out))


if __name__ == "__main__":
    main()
