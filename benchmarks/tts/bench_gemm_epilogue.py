# SPDX-License-Identifier: Apache-2.0
"""Does the FFN's GELU pay as a GEMM epilogue at large steps? A Triton GEMM with the GELU in its epilogue
against cuBLAS followed by the GELU pass the decoder runs (CUDA only).

A step's FFN runs ``linear1`` under cuBLAS, then ``ops/gelu.py``'s ``gelu_`` over its ``(rows, ff)`` output
in place: a second pass that reads and writes that output once more (the "gelu" column of the step profile in
``benchmarks/RESULTS.md``). cuBLAS has no epilogue for the exact (erf) GELU, so folding it into the GEMM means
running our own GEMM. This script measures whether that wins, for the ``linear1`` shapes of each step of
``--batch`` x ``--frames`` (``bench_gemm_shapes.step_gemms``), on random bf16 operands:

* ``cublas``: ``torch.mm`` into a preallocated output; ``gelu pass``: ``gelu_`` on that output;
* ``triton``: the GEMM below alone (its own ceiling), and ``fused``: the same GEMM with the GELU applied to
  the rounded product before the store (``ops/gelu.py``'s ``gelu_f32``, rounded again: bitwise the plain
  GEMM followed by ``gelu_``, checked for every configuration, and the plain GEMM's largest difference to
  cuBLAS's output recorded), over a small grid of tile shapes, warps and pipeline depths, with pointer loads
  (``K`` a multiple of ``BLOCK_K`` only: other points are recorded as errors) and with TMA tensor descriptors.
  A point whose epilogue is not bitwise is never the best.

The Triton GEMM is a plain output-tiled kernel (``BLOCK_M x BLOCK_N`` tiles in groups of ``GROUP_M`` tile
rows, the whole of ``K`` per program, float32 accumulation); it lives here because it is a measured
candidate, not a path of the decoder. Each timing is the median of 5 replays of a CUDA graph of 5 launches.
Per step the script sums, over its ``linear1`` shapes and their calls, cuBLAS + pass against the best fused
configuration of each shape::

    python benchmarks/tts/bench_gemm_epilogue.py --preset v2 --batch 512,256 --frames 5 --json epilogue.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gemm_shapes  # noqa: E402
import common  # noqa: E402
import step_floor  # noqa: E402
import torch  # noqa: E402

from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS, preset_config  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.ops.dispatch import HAS_TRITON, tl, triton  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.ops.gelu import GELU_COEFFICIENTS, gelu_  # noqa: E402

#: Launch grid: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages).
CONFIGS = (
    (128, 256, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 4),
    (128, 128, 64, 8, 4, 4),
    (128, 128, 64, 8, 8, 4),
    (256, 128, 64, 8, 8, 3),
    (128, 128, 128, 8, 8, 3),
    (128, 256, 128, 8, 8, 2),
    (64, 256, 64, 8, 4, 4),
)
CONFIG_KEYS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")

if HAS_TRITON:
    from vllm_omni_moss.model_executor.models.moss_tts.ops.gelu import gelu_f32

    @triton.jit
    def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        # Program -> (tile row, tile column), GROUP_M tile rows at a time so neighbours share weight tiles in L2.
        tiles_n = tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * tiles_n)
        first = group * GROUP_M
        rows = min(tl.cdiv(M, BLOCK_M) - first, GROUP_M)
        within = pid % (GROUP_M * tiles_n)
        return first + within % rows, within // rows

    @triton.jit
    def _store_value(acc, dtype, GELU: tl.constexpr, C1, C2, C3, C4, C5, C6, C7, C8):
        y = acc.to(dtype)
        if GELU:
            y = gelu_f32(y.to(tl.float32), C1, C2, C3, C4, C5, C6, C7, C8).to(dtype)
        return y

    @triton.jit
    def _gemm_kernel(
        x_ptr, w_ptr, out_ptr, M, N, K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        GELU: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
        C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr,
    ):  # fmt: skip
        # out[M, N] = x[M, K] @ w[N, K]^T with pointer loads; K must be a multiple of BLOCK_K.
        tile_m, tile_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        x_at = x_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :]
        w_at = w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            acc = tl.dot(
                tl.load(x_at, mask=rows[:, None] < M, other=0.0),
                tl.trans(tl.load(w_at, mask=cols[:, None] < N, other=0.0)),
                acc,
            )
            x_at += BLOCK_K
            w_at += BLOCK_K
        y = _store_value(acc, out_ptr.dtype.element_ty, GELU, C1, C2, C3, C4, C5, C6, C7, C8)
        ok = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], y, mask=ok)

    @triton.jit
    def _gemm_tma_kernel(
        x_desc, w_desc, out_desc, M, N, K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        GELU: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
        C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr,
    ):  # fmt: skip
        # The same GEMM with TMA tensor descriptors (the copy engine loads tiles; edges are zero-filled).
        tile_m, tile_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(x_desc.load([tile_m * BLOCK_M, k]), w_desc.load([tile_n * BLOCK_N, k]).T, acc)
        y = _store_value(acc, tl.bfloat16, GELU, C1, C2, C3, C4, C5, C6, C7, C8)
        out_desc.store([tile_m * BLOCK_M, tile_n * BLOCK_N], y)


def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: tuple, gelu: bool, tma: bool) -> None:
    """``out = x @ weight.T`` (then with ``gelu`` the exact GELU) with launch ``config`` (:data:`CONFIGS`)."""
    (M, K), N = x.shape, weight.shape[0]
    block_m, block_n, block_k, group_m, warps, stages = config
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    meta = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, GELU=gelu, **GELU_COEFFICIENTS,
        num_warps=warps, num_stages=stages, enable_fp_fusion=False,
    )  # fmt: skip
    if not tma and K % block_k:
        # The pointer kernel walks K in whole blocks with no mask on K (TMA zero-fills the edge instead).
        raise ValueError(f"pointer loads need K a multiple of block_k: K = {K}, block_k = {block_k}")
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        descs = (
            TensorDescriptor.from_tensor(x, [block_m, block_k]),
            TensorDescriptor.from_tensor(weight, [block_n, block_k]),
            TensorDescriptor.from_tensor(out, [block_m, block_n]),
        )
        _gemm_tma_kernel[grid](*descs, M, N, K, **meta)
    else:
        _gemm_kernel[grid](x, weight, out, M, N, K, **meta)


def time_shape(gemm: bench_gemm_shapes.Gemm, seed: int) -> dict:
    """One ``linear1`` shape: cuBLAS, the GELU pass, and every configuration plain and fused."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(gemm.rows, gemm.k, generator=gen, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(gemm.n, gemm.k, generator=gen, device="cuda") / gemm.k**0.5).to(torch.bfloat16)
    out = torch.empty(gemm.rows, gemm.n, dtype=torch.bfloat16, device="cuda")
    plain = torch.empty_like(out)
    reference = torch.mm(x, weight.t())
    record = {
        "group": gemm.group,
        "rows": gemm.rows,
        "k": gemm.k,
        "n": gemm.n,
        "calls": gemm.calls,
        "cublas_ms": common.graph_launch_ms(lambda: torch.mm(x, weight.t(), out=out), launches=5),
        "gelu_pass_ms": common.graph_launch_ms(lambda: gelu_(out), launches=5),
        "triton": [],
    }
    for config, tma in itertools.product(CONFIGS, (False, True)):
        entry = dict(zip(CONFIG_KEYS, config), tma=tma)
        try:
            launch(x, weight, plain, config, False, tma)
            launch(x, weight, out, config, True, tma)
            entry["bitwise_plain_then_gelu"] = bool(torch.equal(out, gelu_(plain.clone())))
            entry["max_abs_vs_cublas"] = float((plain.float() - reference.float()).abs().max())
            entry["plain_ms"] = common.graph_launch_ms(lambda c=config, t=tma: launch(x, weight, plain, c, False, t), 5)
            entry["fused_ms"] = common.graph_launch_ms(lambda c=config, t=tma: launch(x, weight, out, c, True, t), 5)
        except Exception as exc:  # a configuration the device cannot launch (shared memory, registers)
            entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
        record["triton"].append(entry)
    timed = [e for e in record["triton"] if "fused_ms" in e and e["bitwise_plain_then_gelu"]]
    record["best_plain_ms"] = min((e["plain_ms"] for e in timed), default=None)
    record["best_fused_ms"] = min((e["fused_ms"] for e in timed), default=None)
    return record


def _ms(value: float | None) -> str:
    return "n/a (no configuration ran)" if value is None else f"{value:.3f} ms"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="v2", choices=sorted(PRESETS), help="codec geometry (v2)")
    p.add_argument("--batch", default="512,256", help="comma-separated batch sizes (512,256)")
    p.add_argument("--frames", default="5", help="comma-separated frames per step (5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random operands")
    p.add_argument("--json", type=Path, help="write the results here (rewritten after each step)")
    args = p.parse_args(argv)
    batches, frame_counts = common.step_shape_flags(p, args.batch, args.frames)
    common.check_seed(p, args.seed)
    if not torch.cuda.is_available() or not HAS_TRITON:
        p.error("this script times Triton and cuBLAS GEMMs on a CUDA device; none is available")
    common.check_output(p, "--json", args.json)
    config = preset_config(args.preset)
    run = common.run_block(args.preset)
    run["copy_gb_s"] = round(step_floor.copy_bandwidth_gb_s(torch.device("cuda")), 1)
    steps = []
    for batch, frames in itertools.product(batches, frame_counts):
        shapes = [g for g in bench_gemm_shapes.step_gemms(config, batch, frames) if g.name == "linear1"]
        records = [time_shape(g, args.seed) for g in shapes]
        unfused = sum(r["calls"] * (r["cublas_ms"] + r["gelu_pass_ms"]) for r in records)
        # A shape no configuration ran leaves the fused total unknown, not smaller.
        timed_all = all(r["best_fused_ms"] is not None for r in records)
        fused = sum(r["calls"] * r["best_fused_ms"] for r in records) if timed_all else None
        steps.append(dict(batch=batch, frames=frames, shapes=records, cublas_and_pass_ms=unfused, fused_ms=fused))
        common.write_json(args.json, {"run": run, "steps": steps})
        for r in records:
            print(
                f"B{batch} T{frames} group {r['group']} linear1 {r['rows']}x{r['k']}->{r['n']} x{r['calls']}: "
                f"cuBLAS {r['cublas_ms']:.3f} + GELU pass {r['gelu_pass_ms']:.3f} ms; Triton {_ms(r['best_plain_ms'])}, "
                f"Triton + GELU epilogue {_ms(r['best_fused_ms'])}",
                flush=True,
            )
        print(f"B{batch} T{frames} step: cuBLAS + pass {unfused:.2f} ms, fused {_ms(fused)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
