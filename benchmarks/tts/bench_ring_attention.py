# SPDX-License-Identifier: Apache-2.0
"""Sweep the launch configuration of the ring attention kernel over a codec's group shapes (CUDA only).

For every batch size ``B``, frames per step ``T`` and resolution group of the preset, one layer's ring attention
(``ops.ring_attention.launch_ring_attention_triton``, the launch of ``ring_attention_write_packed``, the op a
decoder step runs) runs on ``B`` packed rows of ``T`` frames each, every row full, over random bf16 rings that are
full (offsets far past the ring capacity), with the group's RoPE tables, for the default configuration
(``ops.ring_attention.attention_launch_config``) and for every point of the grid below. Each timing is the median
of 5 replays of a CUDA graph holding 10 launches. Each configuration's error is the relative RMS of its output
against the same kernel on float32 copies of the inputs. This is how the default configuration was chosen (``benchmarks/history/46cae21.md``, "Ring
attention launch sweep")::

    python benchmarks/tts/bench_ring_attention.py --preset v2 --batch 64,128 --frames 15,1 --json sweep.json

Grid (``--grid launch``, the default): ``block_q`` in {16, 32} below 64 tokens per row and {64, 128} from 64
tokens, ``block_k`` in {64, 128}, ``num_warps`` in {4, 8}, ``num_stages`` in {2, 3}, ``pv`` in {"tf32", "low"};
for ``T = 1`` only ``block_k = 64`` and two stages. ``--grid deep`` is the grid for bandwidth-bound steps
(a few frames per row, many rows): ``block_q`` as above, ``block_k`` in {32, 64, 128}, ``num_warps`` in
{4, 8}, ``num_stages`` in {2, 3, 4}, ``pv`` "low" only (the faster one in every shape of the launch sweep).
``--grid default`` times the default configuration only, and prints each shape's time summed over the
group's layers and the step's total.

Every timing also reports the bytes the launch must move (:func:`moved_bytes`: the ring cells its queries may
see, once; the chunk's queries, keys and values read, the output written; with ``--write`` the chunk's cells
written too) and the rate that gives,
``gb_s``; the JSON's ``run.copy_gb_s`` is the device-to-device copy rate measured at the start of the same
command (``step_floor.copy_bandwidth_gb_s``, bytes read plus written), the rate the step table's floor
assumes for reading ring state.

``--write`` times the attention and the ring write (the launch ``ring_attention_write_packed`` makes: the write
fused into the attention kernel for rows of at most 32 tokens, else the write kernel after it) instead of the
attention alone; every launch then stores the same chunk into the same cells, which no query of a launch reads
under the v2 codec's "upstream" semantics. ``--prerotated`` passes no RoPE tables, so the kernels
rotate nothing (as the decoder launches them since RoPE became a pass of its own, ``ops/rope.py``): the
difference to a run with tables is what rotating queries and keys inside the kernels
costs (``benchmarks/history/2983f94.md``, Run AE).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import step_floor  # noqa: E402
import torch  # noqa: E402

from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS, preset_config  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.ops import ring_attention as ring_ops  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.step_metadata import (  # noqa: E402
    rope_tables,
)

GRID = [
    dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st, pv=pv)
    for bq, bk, w, st, pv in itertools.product((16, 32, 64, 128), (64, 128), (4, 8), (2, 3), ("tf32", "low"))
]
DEEP_GRID = [
    dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st, pv="low")
    for bq, bk, w, st in itertools.product((16, 32, 64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
]
GRIDS = {"launch": GRID, "deep": DEEP_GRID, "default": []}


def _in_grid(config: dict, num_tokens: int, frames: int) -> bool:
    """Whether a point of the launch grid applies to rows of ``num_tokens`` tokens at ``frames`` frames."""
    if (num_tokens >= 64) != (config["block_q"] >= 64):
        return False
    return frames != 1 or (config["num_stages"] == 2 and config["block_k"] == 64)


def moved_bytes(
    batch: int, heads: int, capacity: int, head_dim: int, num_tokens: int, write: bool, semantics: str = "upstream"
) -> int:
    """Bytes one bf16 launch on full rings must move at least: the ring cells its queries may see, each read once
    (under ``"upstream"`` the ``max(C - T, 0)`` positions the post-write ring still holds, under ``"exact"`` the
    ``C - 1`` before the first query; ``ops/ring_attention.py``), the chunk's queries, keys and values read, the
    output written, and with ``write`` the kept chunk tokens' keys and values written into the ring."""
    per_token = heads * head_dim * 2  # one token's vector over all heads, bf16
    cells = max(capacity - num_tokens, 0) if semantics == "upstream" else capacity - 1
    ring = 2 * batch * cells * per_token
    chunk = 4 * batch * num_tokens * per_token  # q, k, v read; out written
    stored = 2 * batch * min(num_tokens, capacity) * per_token if write else 0
    return ring + chunk + stored


def sweep_shape(group, batch: int, frames: int, semantics: str, seed: int, grid=GRID, write=False, rope=True) -> dict:
    """One group shape, ``batch`` packed rows of ``frames`` frames each: the default configuration and every point
    of ``grid`` that applies, timed and compared (``write``: time the attention and the ring write; ``rope``: pass
    the group's RoPE tables)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads, capacity, head_dim = group.num_heads, group.ring_capacity, group.head_dim
    num_tokens = frames * group.tokens_per_frame

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    cache = randn(2, batch, heads, capacity, head_dim)
    total = batch * num_tokens  # every row full: row b's tokens from b x T
    q, k, v = (randn(1, heads, total, head_dim) for _ in range(3))
    slots = torch.randperm(batch, generator=gen, device="cuda")
    offsets = torch.full((batch,), 123457 * group.tokens_per_frame, dtype=torch.long, device="cuda")
    written = torch.full((batch,), num_tokens, dtype=torch.long, device="cuda")
    starts = torch.arange(batch, device="cuda") * num_tokens
    cos, sin = (None, None)
    if rope:  # the rows' (B, 1, T, Dh/2) tables, packed as the rows are
        cos, sin = (t.reshape(1, 1, total, -1) for t in rope_tables(offsets, num_tokens, head_dim, group.max_period))
    args = (slots, offsets, written, starts, num_tokens, semantics, cos, sin)
    ref = ring_ops.launch_ring_attention_triton(q.float(), k.float(), v.float(), cache.float(), *args).float()

    def run(tuning):
        return ring_ops.launch_ring_attention_triton(q, k, v, cache, *args, write=write, tuning=tuning)

    def rel_rms(out):
        return float((out.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())

    default = ring_ops.attention_launch_config(num_tokens, torch.bfloat16, batch * heads)
    nbytes = moved_bytes(batch, heads, capacity, head_dim, num_tokens, write, semantics)

    def timed(ms, out):
        return dict(ms=ms, gb_s=round(nbytes / (ms * 1e-3) / 1e9, 1), rel_rms=rel_rms(out))

    record = {
        "batch": batch,
        "frames": frames,
        "tokens": num_tokens,
        "heads": heads,
        "capacity": capacity,
        "layers": group.num_layers,
        "write": write,
        "rope": rope,
        "bytes": nbytes,
        "default": dict(default, **timed(common.graph_launch_ms(lambda: run(None), launches=10), run(None))),
        "grid": [],
    }
    for config in grid:
        if not _in_grid(config, num_tokens, frames):
            continue
        try:
            out = run(config)
            ms = common.graph_launch_ms(lambda config=config: run(config), launches=10)
        except Exception as exc:  # a configuration the device cannot launch (shared memory, registers)
            record["grid"].append(dict(config, error=f"{type(exc).__name__}: {exc}"[:200]))
            continue
        record["grid"].append(dict(config, **timed(ms, out)))
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="v2", choices=sorted(PRESETS), help="codec geometry (v2)")
    p.add_argument("--batch", default="64,128", help="comma-separated batch sizes (64,128)")
    p.add_argument("--frames", default="15,1", help="comma-separated frames per step (15,1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random rings, queries, keys and values")
    p.add_argument(
        "--grid",
        choices=tuple(GRIDS),
        default="launch",
        help="launch (the default): the launch grid; deep: the grid for bandwidth-bound steps; default: the default only",
    )
    p.add_argument(
        "--write", action="store_true", help="time the attention and the ring write, not the attention alone"
    )
    p.add_argument("--prerotated", action="store_true", help="no RoPE tables: the kernels rotate nothing")
    p.add_argument("--json", type=Path, help='write {"run": ..., "records": [...]} here (rewritten after each shape)')
    args = p.parse_args(argv)
    batches, frame_counts = common.step_shape_flags(p, args.batch, args.frames)
    common.check_seed(p, args.seed)
    if not torch.cuda.is_available():
        p.error("this script times Triton kernels on a CUDA device; none is available")
    common.check_output(p, "--json", args.json)
    config = preset_config(args.preset)
    semantics = config.abilities.default_ring_semantics
    run = common.run_block(args.preset, semantics=semantics)
    run["copy_gb_s"] = round(step_floor.copy_bandwidth_gb_s(torch.device("cuda")), 1)
    print(f"device-to-device copy: {run['copy_gb_s']:.0f} GB/s (bytes read plus written)", flush=True)
    records = []
    grid = GRIDS[args.grid]
    for batch, frames in itertools.product(batches, frame_counts):
        step_ms = 0.0
        for index, group in enumerate(config.groups):
            rec = sweep_shape(group, batch, frames, semantics, args.seed, grid, args.write, not args.prerotated)
            rec["group"] = index
            records.append(rec)
            default_ms = rec["default"]["ms"]
            step_ms += default_ms * group.num_layers
            line = (
                f"B{batch} T{frames} group {index} ({rec['tokens']} tokens, ring {rec['capacity']}): "
                f"default {default_ms * 1e3:.1f} us, {rec['default']['gb_s']:.0f} GB/s "
                f"({default_ms * group.num_layers:.2f} ms over {group.num_layers} layers)"
            )
            timed = [g for g in rec["grid"] if "ms" in g]
            if timed:
                best = min(timed, key=lambda g: g["ms"])
                knobs = {k: best[k] for k in ("block_q", "block_k", "num_warps", "num_stages", "pv")}
                line += f", best {best['ms'] * 1e3:.1f} us, {best['gb_s']:.0f} GB/s {knobs}"
                if best["ms"] > default_ms:  # the grid may not hold the default's block (64 queries below 64 tokens)
                    line += " (the default is faster)"
            print(line, flush=True)
            common.write_json(args.json, {"run": run, "records": records})
        print(f"B{batch} T{frames} step: {step_ms:.2f} ms with the default configuration", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
