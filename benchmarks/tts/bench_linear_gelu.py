# SPDX-License-Identifier: Apache-2.0
"""Time the fused FFN head (``ops.linear_gelu``) against cuBLAS + GELU over a codec's FFN shapes (CUDA only).

For every batch size ``B``, frames per step ``T`` and resolution group of the preset, the FFN's first GEMM
sees ``B * T * tokens_per_frame`` token rows, in slices of at most ``decoder.FFN_ROW_CHUNK`` rows. Each
distinct ``(rows, dim_feedforward, d_model)`` is timed four ways on random bf16 inputs:

* ``unfused``: ``gelu_(F.linear(x, w))``, the decoder's path before fusion (cuBLAS, then the GELU kernel);
* ``linear``: ``F.linear`` alone (the GEMM the fusion competes with);
* ``fused``: :func:`linear_gelu` with its default launch configuration;
* every point of the grid below, through the kernel's ``tuning`` argument.

Each timing is the median of 5 replays of a CUDA graph holding 10 launches. Per step shape the report
sums ``unfused`` and ``fused`` over the step's FFN calls (layers x slices): what fusion saves a step.
This is how the default configuration was chosen (``benchmarks/RESULTS.md``, "Fused GELU sweep")::

    python benchmarks/tts/bench_linear_gelu.py --preset v2 --batch 1,64,128 --frames 1,15 --json sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS, preset_config  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.decoder import FFN_ROW_CHUNK  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.ops import linear_gelu as ops  # noqa: E402

#: Launch configurations tried for steps of more than 64 rows (the persistent TMA kernel, large tiles) and
#: of at most 64 (the pointer kernel, 16-row tiles).
GRID = (
    [
        dict(kernel="tma", block_m=128, block_n=bn, block_k=64, group_m=8, num_warps=w, num_stages=st, flatten=fl)
        for bn, w, st, fl in itertools.product((128, 256), (4, 8), (3, 4), (True, False))
    ]
    + [
        dict(kernel="tma", block_m=64, block_n=bn, block_k=64, group_m=8, num_warps=4, num_stages=4, flatten=True)
        for bn in (128, 256)
    ]
    + [
        dict(kernel="pointer", block_m=16, block_n=bn, block_k=bk, group_m=8, num_warps=4, num_stages=st, flatten=False)
        for bn, bk, st in itertools.product((64, 128), (64, 128), (3, 4))
    ]
)


def _graph_ms(fn, launches: int = 10, replays: int = 5) -> float:
    """Median milliseconds of one launch of ``fn``, from CUDA-graph replays of ``launches`` launches."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / launches)
    return statistics.median(times)


def _in_grid(config: dict, rows: int) -> bool:
    # Small row counts try small row tiles only, large ones large tiles only.
    return (config["block_m"] == 16) == (rows <= 64)


def ffn_calls(config, batch: int, frames: int) -> list[tuple[int, int, int, int]]:
    """``(rows, n_out, k_in, calls)`` of one step's FFN heads: the slices of every group, times its layers."""
    calls: dict[tuple[int, int, int], int] = {}
    for group in config.groups:
        rows = batch * frames * group.tokens_per_frame
        for start in range(0, rows, FFN_ROW_CHUNK):
            key = (min(FFN_ROW_CHUNK, rows - start), group.dim_feedforward, group.d_model)
            calls[key] = calls.get(key, 0) + group.num_layers
    return [(*key, n) for key, n in calls.items()]


def sweep_shape(rows: int, n_out: int, k_in: int, seed: int, grid: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k_in, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(n_out, k_in, generator=gen, device="cuda") * k_in**-0.5).bfloat16()
    exact = F.gelu(F.linear(x.double(), w.double()))

    def rel_rms(out):
        return float((out.double() - exact).square().mean().sqrt() / exact.square().mean().sqrt())

    record = {
        "rows": rows,
        "n_out": n_out,
        "k_in": k_in,
        "unfused_ms": _graph_ms(lambda: torch.ops.aten.gelu_(F.linear(x, w))),
        "linear_ms": _graph_ms(lambda: F.linear(x, w)),
        "unfused_rel_rms": rel_rms(F.gelu(F.linear(x, w))),
        "default": dict(ops.linear_gelu_launch_config(rows, n_out, k_in)),
        "grid": [],
    }
    record["default"].update(ms=_graph_ms(lambda: ops.linear_gelu(x, w)), rel_rms=rel_rms(ops.linear_gelu(x, w)))
    for config in GRID if grid else ():
        if not _in_grid(config, rows):
            continue
        try:
            out = ops._launch_triton(x, w, config)
            ms = _graph_ms(lambda config=config: ops._launch_triton(x, w, config))
        except Exception as exc:  # a configuration the device cannot launch (shared memory, registers)
            record["grid"].append(dict(config, error=f"{type(exc).__name__}: {exc}"[:200]))
            continue
        record["grid"].append(dict(config, ms=ms, rel_rms=rel_rms(out)))
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="v2", choices=sorted(PRESETS))
    p.add_argument("--batch", default="1,64,128", help="comma-separated batch sizes (1,64,128)")
    p.add_argument("--frames", default="1,15", help="comma-separated frames per step (1,15)")
    p.add_argument("--no-grid", action="store_true", help="time the default configuration only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write every record here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("the sweep times Triton kernels on a CUDA device; none is available")
    config = preset_config(args.preset)
    shapes: dict[tuple[int, int, int], dict] = {}
    steps = []
    for batch, frames in itertools.product(common.parse_int_list(args.batch), common.parse_int_list(args.frames)):
        calls = ffn_calls(config, batch, frames)
        for rows, n_out, k_in, _ in calls:
            if (rows, n_out, k_in) not in shapes:
                shapes[(rows, n_out, k_in)] = rec = sweep_shape(rows, n_out, k_in, args.seed, not args.no_grid)
                timed = [g for g in rec["grid"] if "ms" in g]
                best = min(timed, key=lambda g: g["ms"]) if timed else None
                rec["best"] = best
                print(
                    f"rows {rows:6d} n {n_out} k {k_in}: unfused {rec['unfused_ms'] * 1e3:8.1f} us, linear "
                    f"{rec['linear_ms'] * 1e3:8.1f}, fused {rec['default']['ms'] * 1e3:8.1f}"
                    + (f", best {best['ms'] * 1e3:8.1f} { ({k: best[k] for k in ops.LAUNCH_KEYS}) }" if best else ""),
                    flush=True,
                )
        unfused = sum(shapes[c[:3]]["unfused_ms"] * c[3] for c in calls)
        fused = sum(shapes[c[:3]]["default"]["ms"] * c[3] for c in calls)
        best = sum((shapes[c[:3]]["best"] or shapes[c[:3]]["default"])["ms"] * c[3] for c in calls)
        steps.append(dict(batch=batch, frames=frames, unfused_ms=unfused, fused_ms=fused, best_ms=best))
    print(
        common.markdown_table(
            ["B", "T", "unfused FFN heads ms", "fused (default) ms", "fused (best of grid) ms"],
            [
                [s["batch"], s["frames"], f"{s['unfused_ms']:.2f}", f"{s['fused_ms']:.2f}", f"{s['best_ms']:.2f}"]
                for s in steps
            ],
        )
    )
    common.write_json(args.json, {"preset": args.preset, "shapes": list(shapes.values()), "steps": steps})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
