# SPDX-License-Identifier: Apache-2.0
"""Seconds from a cold process to a codec session ready to serve: imports, checkpoint load, graph capture.

Run it as a fresh process (it is the measurement): it loads the decoder of a checkpoint directory the way
the stage does (``checkpoint.load_checkpoint``, bf16 on CUDA), builds a :class:`CodecStreamSession` with a CUDA
graph for every step shape of its ladder, and decodes one chunk per slot. Each phase is timed on the wall clock,
with a device synchronisation at its end. The defaults are the stage-1 settings of
``deploy/moss_tts_local_h200.yaml`` with upstream's chunks of 1 and 15 frames (384 slots; the stage's ladder
``graph_ladder.frame_totals(384 x 15)``).
A second run in a new process measures a restart: Triton's on-disk kernel cache (``~/.triton/cache``) and the
operating system's file cache then hold what the first run compiled and read::

    vllm-omni-moss make-checkpoint --preset v2 /tmp/codec-v2            # 7.91 GiB of random fp32 weights
    python benchmarks/tts/bench_codec_startup.py --checkpoint /tmp/codec-v2 --json startup.json

The "process start to import" figure is measured from the process's start time as the kernel records it
(``/proc/self/stat``, Linux only; omitted elsewhere).
"""

from __future__ import annotations

import time

_T0 = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

from vllm_omni_moss.model_executor.models.moss_tts.checkpoint import load_checkpoint  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import frame_totals  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.serving import (  # noqa: E402
    ChunkRequest,
    CodecStreamSession,
    SessionOptions,
)
from vllm_omni_moss.model_executor.models.moss_tts.state import StateSpec  # noqa: E402


def _process_start_seconds_ago() -> float | None:
    """Seconds between this process's start (``/proc/self/stat`` field 22) and the script's first line."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return _T0 - (boot + start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _parse(argv) -> tuple[argparse.Namespace, list[int], list[int], torch.device]:
    """(flags, graph frame totals, graph frame sizes, device); a bad flag is a usage error (exit 2) naming it."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--capacity", type=int, default=384, help="live streams (slots) of the session (384)")
    p.add_argument(
        "--graph-frame-totals",
        default=None,
        help="packed frame totals of the step shapes (the stage's: frame_totals(--capacity x the largest frame size))",
    )
    p.add_argument("--graph-frame-sizes", default="1,15", help="CUDA-graph frame sizes (1,15)")
    p.add_argument("--json", type=Path, help="write the phases here")
    args = p.parse_args(argv)
    if args.capacity < 1:
        p.error(f"--capacity {args.capacity}: must be >= 1")
    common.check_at_most(p, "--capacity", args.capacity, common.MAX_ROWS)
    frame_sizes = common.int_list_flag(p, "--graph-frame-sizes", args.graph_frame_sizes)
    if args.graph_frame_totals is None:
        totals = frame_totals(args.capacity * max(frame_sizes))
    else:
        totals = common.int_list_flag(p, "--graph-frame-totals", args.graph_frame_totals)
    if not (args.checkpoint / "config.json").is_file():
        what = "no such directory" if not args.checkpoint.is_dir() else "no config.json in it"
        p.error(f"--checkpoint {str(args.checkpoint)!r}: {what} (make one with vllm-omni-moss make-checkpoint)")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        p.error(f"--device {args.device!r}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device is available")
    common.check_output(p, "--json", args.json)
    return args, totals, frame_sizes, device


def main(argv=None) -> int:
    args, totals, frame_sizes, device = _parse(argv)

    def sync() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.time()

    phases: dict[str, float] = {}
    before_import = _process_start_seconds_ago()
    if before_import is not None:
        phases["process start to script"] = before_import
    start = sync()
    phases["imports (torch, package)"] = start - _T0

    def lap(name: str) -> None:
        nonlocal start
        now = sync()
        phases[name], start = now - start, now

    decoder = load_checkpoint(args.checkpoint, device=device)
    lap("load checkpoint")
    options = SessionOptions(args.capacity, graph_frame_totals=tuple(totals), graph_frame_sizes=tuple(frame_sizes))
    session = CodecStreamSession(decoder, StateSpec.from_options(decoder), options)
    lap("session (pool, graph capture)")
    rows = args.capacity
    n_vq = session.n_vq
    codes = torch.randint(0, decoder.config.codebook_size, (n_vq, rows, max(frame_sizes)))
    session.decode([ChunkRequest(f"r{i}", codes[:, i], True) for i in range(rows)])
    lap("first step (every slot)")
    total = time.time() - _T0 + (before_import or 0.0)
    stats = session.stats()
    graphs = len(session.runner.graphs) if session.runner is not None else 0
    session.close()
    record = {
        "checkpoint": str(args.checkpoint),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "capacity": args.capacity,
        "graph_frame_totals": totals,
        "graph_frame_sizes": frame_sizes,
        "graphs": graphs,
        "steps_by_path": stats.get("steps_by_path"),
        "phases_s": {k: round(v, 3) for k, v in phases.items()},
        "total_s": round(total, 3),
    }
    for name, seconds in phases.items():
        print(f"{name:32s} {seconds:8.2f} s")
    print(f"{'total':32s} {total:8.2f} s ({graphs} CUDA graphs, first step by path {stats.get('steps_by_path')})")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
