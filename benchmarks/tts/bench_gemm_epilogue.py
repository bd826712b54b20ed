# SPDX-License-Identifier: Apache-2.0
"""The FFN's first projection with its GELU, per step shape: the GEMM's own GELU epilogue against a GEMM followed
by the exact GELU pass (CUDA only).

A served decoder (bf16 on CUDA) computes ``GELU(linear1(h))`` as one cuBLASLt GEMM whose epilogue applies the
GELU (``torch._addmm_activation(zero_bias, h, W.t(), use_gelu=True)``: the tanh form, in float32 on the
accumulator, then one rounding to bf16; ``decoder._add_feed_forward_``). The reference decoder runs the GEMM,
rounds its output to bf16 and applies the exact (erf) GELU in place. For the ``linear1`` shapes of each step of
``--batch`` x ``--frames`` (``bench_gemm_shapes.step_gemms``), on random bf16 operands (``h ~ N(0, 1)``,
``W ~ N(0, 1/k)``), this script times

* ``mm_ms``: ``torch.mm`` into a preallocated output, and ``gelu_pass_ms``: ``aten.gelu_`` on it in place;
* ``epilogue_ms``: ``torch._addmm_activation`` with a zero bias;

each the median of 5 replays of a CUDA graph of 5 launches, and reports each path's error against the exact
GELU of the float32 product (``rms_error``, ``max_error``: over every element, absolute). Per step it sums the
shapes over their calls::

    python benchmarks/tts/bench_gemm_epilogue.py --preset v2 --batch 512,64 --frames 5 --json epilogue.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gemm_shapes  # noqa: E402
import common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS, preset_config  # noqa: E402


def _errors(got: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    diff = got.float() - exact
    return {"rms_error": float(diff.square().mean().sqrt()), "max_error": float(diff.abs().max())}


def time_shape(gemm: bench_gemm_shapes.Gemm, seed: int) -> dict:
    """One ``linear1`` shape: the GEMM, the GELU pass after it, the GEMM with the GELU epilogue, and the errors
    of both paths against the exact GELU of the float32 product."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(gemm.rows, gemm.k, generator=gen, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(gemm.n, gemm.k, generator=gen, device="cuda") / gemm.k**0.5).to(torch.bfloat16)
    zero_bias = torch.zeros(gemm.n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(gemm.rows, gemm.n, dtype=torch.bfloat16, device="cuda")
    exact = F.gelu(x.float() @ weight.float().t())
    reference = torch.ops.aten.gelu_(torch.mm(x, weight.t()))
    epilogue = torch._addmm_activation(zero_bias, x, weight.t(), use_gelu=True)
    return {
        "group": gemm.group,
        "rows": gemm.rows,
        "k": gemm.k,
        "n": gemm.n,
        "calls": gemm.calls,
        "mm_ms": common.graph_launch_ms(lambda: torch.mm(x, weight.t(), out=out), launches=5),
        "gelu_pass_ms": common.graph_launch_ms(lambda: torch.ops.aten.gelu_(out), launches=5),
        "epilogue_ms": common.graph_launch_ms(
            lambda: torch._addmm_activation(zero_bias, x, weight.t(), use_gelu=True), launches=5
        ),
        "mm_then_gelu": _errors(reference, exact),
        "epilogue": _errors(epilogue, exact),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="v2", choices=sorted(PRESETS), help="codec geometry (v2)")
    p.add_argument("--batch", default="512,64", help="comma-separated batch sizes (512,64)")
    p.add_argument("--frames", default="5", help="comma-separated frames per step (5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random operands")
    p.add_argument("--json", type=Path, help="write the results here (rewritten after each step)")
    args = p.parse_args(argv)
    batches, frame_counts = common.step_shape_flags(p, args.batch, args.frames)
    common.check_seed(p, args.seed)
    if not torch.cuda.is_available():
        p.error("this script times cuBLAS GEMMs on a CUDA device; none is available")
    common.check_output(p, "--json", args.json)
    config = preset_config(args.preset)
    run = common.run_block(args.preset)
    steps = []
    for batch, frames in itertools.product(batches, frame_counts):
        shapes = [g for g in bench_gemm_shapes.step_gemms(config, batch, frames) if g.name == "linear1"]
        records = [time_shape(g, args.seed) for g in shapes]
        two_pass = sum(r["calls"] * (r["mm_ms"] + r["gelu_pass_ms"]) for r in records)
        epilogue = sum(r["calls"] * r["epilogue_ms"] for r in records)
        steps.append(dict(batch=batch, frames=frames, shapes=records, mm_and_pass_ms=two_pass, epilogue_ms=epilogue))
        common.write_json(args.json, {"run": run, "steps": steps})
        for r in records:
            print(
                f"B{batch} T{frames} group {r['group']} linear1 {r['rows']}x{r['k']}->{r['n']} x{r['calls']}: "
                f"mm {r['mm_ms']:.3f} + GELU pass {r['gelu_pass_ms']:.3f} ms (rms {r['mm_then_gelu']['rms_error']:.2e}); "
                f"epilogue {r['epilogue_ms']:.3f} ms (rms {r['epilogue']['rms_error']:.2e})",
                flush=True,
            )
        print(f"B{batch} T{frames} step: mm + pass {two_pass:.2f} ms, epilogue {epilogue:.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
