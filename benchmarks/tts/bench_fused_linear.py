# SPDX-License-Identifier: Apache-2.0
"""A decoder layer's projections on few token rows: cuBLAS plus the glue passes against ``ops/fused_linear.py``.

For each resolution-group width of the codec (``--preset``; v2: d_model 1280 with FFN 5120, and 768 with 3072)
and each ``--rows`` count, one CUDA graph replays the projections of ``--layers`` layers with distinct weights
(so each layer reads its weights from memory, as a step does, not from the L2 cache):

* ``cublas`` - what the decoder runs without the op: ``residual_layer_norm`` (``ops/residual_norm.py``), the QKV
  projection, the out-projection, ``residual_layer_norm``, ``linear1``, ``gelu_`` (``ops/gelu.py``), ``linear2``
  (cuBLAS through ``F.linear``). The attention is left out: both arms take the same fixed input there.
* ``fused`` - the four :func:`~vllm_omni_moss.model_executor.models.moss_tts.ops.fused_linear.fused_linear` calls
  of ``decoder._run_layers_fused_linear`` with the launch table's configuration.
* ``floor`` - the layer's weight bytes at the device-to-device copy bandwidth measured in the same command
  (``step_floor.copy_bandwidth_gb_s``): no projection of few rows can read its weights faster.

With ``--sweep`` each projection kind is also timed alone (a graph of one launch per layer) under every
configuration of :data:`SWEEP` and the fastest is reported beside the launch table's choice.

Usage::

    python benchmarks/tts/bench_fused_linear.py --rows 1,2,4,8,16,32,64,128 --sweep --json out/fused_linear.json

Prints one line per (width, rows); the JSON holds the same records (milliseconds per layer) and the sweep.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import step_floor  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS, preset_config  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.ops import fused_linear as fl  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.ops.gelu import gelu_  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.ops.residual_norm import residual_layer_norm  # noqa: E402

#: Launch configurations of ``--sweep``: block sizes, then warps and pipeline stages.
SWEEP = [
    {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s}
    for n, k, w, s in itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 4))
]


def _layers(d: int, ff: int, count: int, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    def draw(*shape, scale):
        return (scale * torch.randn(*shape, generator=gen, device="cuda")).to(torch.bfloat16)

    return [
        {
            "in": draw(3 * d, d, scale=d**-0.5), "out": draw(d, d, scale=d**-0.5),
            "w1": draw(ff, d, scale=d**-0.5), "w2": draw(d, ff, scale=ff**-0.5),
            "n1w": 1 + draw(d, scale=0.1), "n1b": draw(d, scale=0.1), "n2w": 1 + draw(d, scale=0.1),
            "n2b": draw(d, scale=0.1), "ls1": draw(d, scale=0.01), "ls2": draw(d, scale=0.01),
        }
        for _ in range(count)
    ]  # fmt: skip


def _cublas_layers(layers, x, attn):
    # The decoder's unfused-projection path of _run_layers from one residual add + norm to the next.
    update = torch.zeros_like(x)
    for p in layers:
        x, h = residual_layer_norm(x, update, p["ls2"], p["n1w"], p["n1b"], 1e-5)
        F.linear(h, p["in"])
        update = F.linear(attn, p["out"])
        x, h = residual_layer_norm(x, update, p["ls1"], p["n2w"], p["n2b"], 1e-5)
        update = F.linear(gelu_(F.linear(h, p["w1"])), p["w2"])
    return x


def _fused_layers(layers, x, attn):
    for p in layers:
        fl.fused_linear(x, p["in"], norm=(p["n1w"], p["n1b"], 1e-5))
        x = fl.fused_linear(attn, p["out"], residual=x, layer_scale=p["ls1"])
        hidden = fl.fused_linear(x, p["w1"], norm=(p["n2w"], p["n2b"], 1e-5), gelu=True)
        x = fl.fused_linear(hidden, p["w2"], residual=x, layer_scale=p["ls2"])
    return x


def _kind_calls(layers, x, attn, hidden):
    """Each projection kind as the layer calls it: name -> (weight key, launch arguments but the weight)."""
    return {
        "qkv+norm": ("in", lambda p: (x, p["in"], (p["n1w"], p["n1b"], 1e-5), False, None, None)),
        "out+residual": ("out", lambda p: (attn, p["out"], None, False, x, p["ls1"])),
        "linear1+norm+gelu": ("w1", lambda p: (x, p["w1"], (p["n2w"], p["n2b"], 1e-5), True, None, None)),
        "linear2+residual": ("w2", lambda p: (hidden, p["w2"], None, False, x, p["ls2"])),
    }


def _launches(layers, args, config=None):
    # One launch per layer: the kernel with the launch arguments of args(layer).
    for p in layers:
        fl.launch_fused_linear(*args(p), config=config)


def _cublas_gemms(layers, args, key):
    for p in layers:
        F.linear(args(p)[0], p[key])


def _sweep(layers, x, attn, hidden, rows: int) -> dict:
    out = {}
    n = len(layers)
    for kind, (key, args) in _kind_calls(layers, x, attn, hidden).items():
        N, K = layers[0][key].shape
        default = fl.launch_config(rows, N, K)
        ms_default = common.graph_launch_ms(functools.partial(_launches, layers, args), 1)
        best = None
        for config in SWEEP:
            config = {"BLOCK_M": default["BLOCK_M"], **config}
            ms = common.graph_launch_ms(functools.partial(_launches, layers, args, config), 1)
            if best is None or ms < best[0]:
                best = (ms, config)
        cublas = common.graph_launch_ms(functools.partial(_cublas_gemms, layers, args, key), 1)
        out[kind] = {
            "N": N, "K": K, "default": default, "default_ms": round(ms_default / n, 5),
            "best": best[1], "best_ms": round(best[0] / n, 5), "cublas_gemm_ms": round(cublas / n, 5),
        }  # fmt: skip
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="v2", choices=sorted(PRESETS), help="codec geometry (v2)")
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128", help="comma-separated token rows")
    p.add_argument("--layers", type=int, default=8, help="layers with distinct weights per graph")
    p.add_argument("--sweep", action="store_true", help="also sweep launch configurations per projection kind")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA")
    config = preset_config(args.preset)
    widths = sorted({(g.d_model, g.dim_feedforward) for g in config.groups}, reverse=True)
    copy_gb_s = step_floor.copy_bandwidth_gb_s(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = {"run": common.run_block(args.preset, layers=args.layers), "copy_gb_s": round(copy_gb_s, 1), "records": []}
    for d, ff in widths:
        layers = _layers(d, ff, args.layers, gen)
        weight_bytes = sum(layers[0][k].numel() * 2 for k in ("in", "out", "w1", "w2"))
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, d, generator=gen, device="cuda").to(torch.bfloat16)
            attn = torch.randn(rows, d, generator=gen, device="cuda").to(torch.bfloat16)
            hidden = torch.randn(rows, ff, generator=gen, device="cuda").to(torch.bfloat16)
            n = len(layers)
            cublas = common.graph_launch_ms(functools.partial(_cublas_layers, layers, x, attn), 1) / n
            fused = common.graph_launch_ms(functools.partial(_fused_layers, layers, x, attn), 1) / n
            record = {
                "d_model": d, "ffn": ff, "rows": rows, "cublas_ms": round(cublas, 5), "fused_ms": round(fused, 5),
                "floor_ms": round(weight_bytes / (copy_gb_s * 1e9) * 1e3, 5),
            }  # fmt: skip
            if args.sweep:
                record["sweep"] = _sweep(layers, x, attn, hidden, rows)
            report["records"].append(record)
            print(
                f"d {d} ffn {ff} rows {rows:4d}: layer cublas+glue {cublas * 1e3:7.1f} us, fused {fused * 1e3:7.1f} us,"
                f" weight floor {record['floor_ms'] * 1e3:6.1f} us",
                flush=True,
            )
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
