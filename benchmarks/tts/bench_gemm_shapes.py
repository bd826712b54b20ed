# SPDX-License-Identifier: Apache-2.0
"""Time each projection GEMM of one decoder step alone, as cuBLAS runs it (CUDA only).

A decoder step of ``B`` rows and ``T`` frames runs, per resolution group (``docs/codec_architecture.md``),
``M = B x T x tokens_per_frame`` token rows through the group's input projection, then per layer the QKV
projection ``d -> 3d``, the attention output projection ``d -> d`` and the FFN ``d -> ff -> d`` (in slices of
``decoder.FFN_ROW_CHUNK`` rows, as ``decoder._feed_forward`` runs it outside ``torch.compile``; compiled, the
FFN is one pass), then the output projection. This
script lists those GEMMs from the preset's geometry (:func:`step_gemms`), times each shape with
``torch.nn.functional.linear`` on random bf16 operands (median of 5 replays of a CUDA graph of 20 launches),
and reports TFLOP/s and each group's and the step's summed GEMM time. It answers how far a step's GEMMs
are from what cuBLAS does with the same shapes in isolation::

    python benchmarks/tts/bench_gemm_shapes.py --preset v2 --batch 64,128 --frames 15 --json gemm.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

from vllm_omni_moss.model_executor.models.moss_tts import decoder  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS, CodecConfig, preset_config  # noqa: E402


@dataclass(frozen=True)
class Gemm:
    """One GEMM shape of a step: ``(rows, k) x (k, n)``, run ``calls`` times a step."""

    group: int
    name: str
    rows: int
    k: int
    n: int
    calls: int

    @property
    def flops(self) -> int:
        """Floating-point operations of all ``calls`` (2 per multiply-add)."""
        return 2 * self.rows * self.k * self.n * self.calls


def step_gemms(config: CodecConfig, batch: int, frames: int, ffn_rows: int | None = None) -> list[Gemm]:
    """The projection GEMMs of one step of ``batch`` rows and ``frames`` frames, in execution order per group.

    ``ffn_rows``: rows of one FFN slice (default ``decoder.FFN_ROW_CHUNK``). Shapes of equal size are merged
    into one entry with its number of calls.
    """
    ffn_rows = ffn_rows or decoder.FFN_ROW_CHUNK
    gemms = []
    for index, group in enumerate(config.groups):
        rows, d, ff, layers = (
            batch * frames * group.tokens_per_frame,
            group.d_model,
            group.dim_feedforward,
            group.num_layers,
        )
        if group.input_proj:
            gemms.append(Gemm(index, "input_proj", rows, group.input_dim, d, 1))
        gemms.append(Gemm(index, "qkv", rows, d, 3 * d, layers))
        gemms.append(Gemm(index, "out_proj", rows, d, d, layers))
        slices = [min(ffn_rows, rows - start) for start in range(0, rows, ffn_rows)] if rows > ffn_rows else [rows]
        for size in sorted(set(slices), reverse=True):
            count = slices.count(size) * layers
            gemms.append(Gemm(index, "linear1", size, d, ff, count))
            gemms.append(Gemm(index, "linear2", size, ff, d, count))
        if group.output_proj:
            gemms.append(Gemm(index, "output_proj", rows, d, group.output_dim, 1))
    return gemms


def time_gemm(gemm: Gemm, seed: int) -> float:
    """Milliseconds of one ``(rows, k) x (k, n)`` bf16 ``linear`` on the current CUDA device."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(gemm.rows, gemm.k, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(gemm.n, gemm.k, generator=gen, device="cuda").to(torch.bfloat16)
    return common.graph_launch_ms(lambda: torch.nn.functional.linear(x, w), launches=20)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="v2", choices=sorted(PRESETS), help="codec geometry (v2)")
    p.add_argument("--batch", default="64,128", help="comma-separated streams per step, B (64,128)")
    p.add_argument("--frames", default="15", help="comma-separated frames per step, T (15)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random operands")
    p.add_argument("--json", type=Path, help='write {"run": ..., "records": [...]} here (rewritten after each shape)')
    args = p.parse_args(argv)
    batches = common.int_list_flag(p, "--batch", args.batch)
    frame_counts = common.int_list_flag(p, "--frames", args.frames)
    if not torch.cuda.is_available():
        p.error("this script times cuBLAS GEMMs on a CUDA device; none is available")
    common.check_output(p, "--json", args.json)
    config = preset_config(args.preset)
    run = common.run_block(args.preset, ffn_row_chunk=decoder.FFN_ROW_CHUNK)
    records = []
    for batch, frames in itertools.product(batches, frame_counts):
        step_ms, step_flops = 0.0, 0
        for index, group in itertools.groupby(step_gemms(config, batch, frames), key=lambda g: g.group):
            group_ms, group_flops = 0.0, 0
            for gemm in group:
                ms = time_gemm(gemm, args.seed)
                tflops = gemm.flops / gemm.calls / ms / 1e9  # one launch
                records.append(dict(asdict(gemm), batch=batch, frames=frames, ms=ms, tflops=tflops))
                group_ms += ms * gemm.calls
                group_flops += gemm.flops
                print(
                    f"B{batch} T{frames} group {index} {gemm.name:11s} {gemm.rows:6d} x {gemm.k:4d} x {gemm.n:4d} "
                    f"(x{gemm.calls}): {ms * 1e3:7.1f} us, {tflops:4.0f} TFLOP/s",
                    flush=True,
                )
            print(
                f"B{batch} T{frames} group {index}: {group_ms:.2f} ms a step, {group_flops / group_ms / 1e9:.0f} TFLOP/s"
            )
            step_ms += group_ms
            step_flops += group_flops
        print(
            f"B{batch} T{frames} step: {step_ms:.2f} ms of GEMMs, {step_flops / step_ms / 1e9:.0f} TFLOP/s", flush=True
        )
        records.append(dict(batch=batch, frames=frames, step_ms=step_ms, step_tflop=step_flops / 1e12))
        if args.json:
            common.write_json(args.json, {"run": run, "records": records})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
