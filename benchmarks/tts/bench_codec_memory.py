# SPDX-License-Identifier: Apache-2.0
"""Persistent codec decoder-state memory: legacy pool vs V2 pool vs upstream vLLM-Omni 0.30.0.

For each stream count C (``--streams``) three arms are sized as serving sizes them when the largest
CUDA-graph batch bucket equals C:

* ``legacy``   - our legacy pool, ``initialize(C, C)``: C live slots + C scratch slots (one per padding row).
* ``v2``       - our V2 pool, ``initialize(C, C)``: C live slots + 1 null slot (scratch request ignored).
* ``upstream`` - upstream 0.30.0's ``initialize_decoder_state_pool(C, C)`` on its own codec model; only
  with a GPU and the upstream files available (otherwise skipped, with the reason in the JSON).

On CUDA every arm is allocated for real and reported as ``state_bytes`` (from the pool's own tensors) plus
the caching allocator's ``allocated``/``reserved`` deltas and the driver's device-used delta
(``torch.cuda.mem_get_info``). Weights are measured too: our decoder-only load vs upstream's full codec
(encoder and quantizer included), as allocated bytes after building. Without a GPU the same shapes are
accounted on the meta device (bf16 rings, nothing allocated).

Usage::

    python benchmarks/tts/bench_codec_memory.py --preset v2 --streams 64,128 --json out/memory.json

JSON: ``{"preset", "device", "accounting", "slot_bytes", "weights": {...}, "arms": {"legacy": {"64":
{...}}, ...}, "skipped": {arm: reason}}``; every byte count is an integer. A markdown table in GiB is
printed last.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS, preset_config  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.state_pool import make_state_pool, state_bytes_for  # noqa: E402

ARMS = ("legacy", "v2", "upstream")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="v2", choices=sorted(PRESETS))
    parser.add_argument("--streams", default="64,128", help="comma-separated live stream counts C")
    parser.add_argument("--arms", default=",".join(ARMS), help="subset of legacy,v2,upstream")
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="cuda: allocate for real; cpu: meta-device byte accounting only",
    )
    parser.add_argument("--n-vq", type=int, default=12, help="codebooks the serving decode table folds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    return parser.parse_args(argv)


def _pool_kind_slots(arm: str, streams: int) -> tuple[int, int]:
    """(state_capacity, scratch_capacity) requested for an arm at C streams (max graph bucket = C)."""
    return streams, streams


def _measure_ours(decoder, arm: str, streams: int, device: torch.device) -> dict[str, Any]:
    capacity, scratch = _pool_kind_slots(arm, streams)
    before = common.cuda_memory(device) if device.type == "cuda" else None
    pool = make_state_pool(decoder, common.pool_kind(arm), dtype=torch.bfloat16)
    pool.initialize(capacity, scratch)
    entry: dict[str, Any] = {
        "state_capacity": capacity,
        "scratch_requested": scratch,
        "slots": int(pool.num_slots),
        "state_bytes": int(pool.state_bytes()),
        "predicted_bytes": int(state_bytes_for(decoder.config, pool.num_slots, common.pool_kind(arm))),
        "ring_bytes": int(sum(r.numel() * r.element_size() for r in pool.rings)),
    }
    entry["offset_bytes"] = entry["state_bytes"] - entry["ring_bytes"]
    if before is not None:
        entry.update(common.memory_delta(before, common.cuda_memory(device)))
        entry["device_used_bytes"] = common.cuda_memory(device)["device_used"]
    pool.close()
    del pool
    common.free_memory(device)
    return entry


def _measure_upstream(codec: common.UpstreamCodecArm, streams: int, device: torch.device) -> dict[str, Any]:
    capacity, scratch = _pool_kind_slots("upstream", streams)
    before = common.cuda_memory(device)
    codec.open_pool(capacity, scratch)
    entry: dict[str, Any] = {
        "state_capacity": capacity,
        "scratch_requested": scratch,
        "slots": capacity + scratch,
        "state_bytes": common.upstream_state_bytes(codec.model),
    }
    offsets = getattr(codec.model, "_decoder_slot_offsets", None)
    entry["offset_bytes"] = int(offsets.numel() * offsets.element_size()) if offsets is not None else 0
    entry.update(common.memory_delta(before, common.cuda_memory(device)))
    entry["device_used_bytes"] = common.cuda_memory(device)["device_used"]
    codec.close_pool()
    common.free_memory(device)
    return entry


def _print_table(result: dict[str, Any]) -> None:
    rows = []
    for arm, per_count in result["arms"].items():
        for count, e in per_count.items():
            row = [arm, count, e["slots"], f"{common.gib(e['state_bytes']):.2f}"]
            if "allocated_delta_bytes" in e:
                row += [
                    f"{common.gib(e['allocated_delta_bytes']):.2f}",
                    f"{common.gib(e['reserved_delta_bytes']):.2f}",
                    f"{common.gib(e['device_used_delta_bytes']):.2f}",
                ]
            else:
                row += ["-", "-", "-"]
            rows.append(row)
    headers = ["arm", "streams", "slots", "state GiB", "allocated Δ GiB", "reserved Δ GiB", "device used Δ GiB"]
    print(f"\n### decoder state, preset {result['preset']} ({result['accounting']})\n")
    print(common.markdown_table(headers, rows))
    w = result["weights"]
    wrows = []
    for name, e in w.items():
        if "skipped" in e:
            wrows.append([name, "-", "-", e["skipped"]])
            continue
        measured = e.get("allocated_bytes")
        wrows.append(
            [
                name,
                f"{common.gib(e['param_bytes']):.3f}",
                "-" if measured is None else f"{common.gib(measured):.3f}",
                e.get("note", ""),
            ]
        )
    print("\n### weights\n")
    print(common.markdown_table(["model", "parameter+buffer GiB", "allocated GiB", "note"], wrows))
    for arm, reason in result["skipped"].items():
        print(f"\nskipped {arm}: {reason}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    streams = common.parse_int_list(args.streams)
    arms = common.parse_str_list(args.arms, ARMS)
    device = common.resolve_device(args.device)
    accounting = "cuda" if device.type == "cuda" else "meta"
    build_device = device if device.type == "cuda" else torch.device("meta")
    config = preset_config(args.preset)
    n_vq = min(args.n_vq, config.num_quantizers)

    result: dict[str, Any] = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "accounting": accounting,
        "torch": torch.__version__,
        "streams": streams,
        "slot_bytes": int(config.state_bytes_per_slot(2)),
        "weights": {},
        "arms": {},
        "skipped": {},
    }

    ours_arms = [a for a in arms if a in ("legacy", "v2")]
    if config.version != "v2" and "v2" in ours_arms:
        result["skipped"]["v2"] = f"preset {args.preset!r} is a {config.version} codec; the V2 pool serves v2 codecs"
        ours_arms.remove("v2")
    if ours_arms:
        common.free_memory(device)
        before = common.cuda_memory(device) if device.type == "cuda" else None
        t0 = time.perf_counter()
        decoder = common.random_decoder(args.preset, build_device, args.seed)
        weights: dict[str, Any] = {
            "param_bytes": common.module_bytes(decoder),
            "note": "decoder only (bf16 weights + bf16 decode table)",
        }
        if before is not None:
            weights.update(common.memory_delta(before, common.cuda_memory(device)))
            weights["allocated_bytes"] = weights["allocated_delta_bytes"]
            weights["build_s"] = round(time.perf_counter() - t0, 3)
        result["weights"]["ours"] = weights
        for arm in ours_arms:
            result["arms"][arm] = {}
            for count in streams:
                result["arms"][arm][str(count)] = _measure_ours(decoder, arm, count, build_device)
                common.write_json(args.json, result)
        del decoder
        common.free_memory(device)

    if "upstream" in arms:
        ok, reason = common.upstream_status(args.preset, device)
        if ok and device.type != "cuda":
            ok, reason = False, "needs a GPU (meta accounting covers only our pools; upstream allocates for real)"
        if not ok:
            result["skipped"]["upstream"] = reason
            result["weights"]["upstream"] = {"skipped": reason}
        else:
            before = common.cuda_memory(device)
            t0 = time.perf_counter()
            codec = common.build_upstream_codec(args.preset, device, args.seed, n_vq)
            delta = common.memory_delta(before, common.cuda_memory(device))
            result["weights"]["upstream"] = {
                "param_bytes": codec.total_bytes,
                "decoder_param_bytes": codec.decoder_bytes,
                "allocated_bytes": delta["allocated_delta_bytes"],
                **delta,
                "build_s": round(time.perf_counter() - t0, 3),
                "note": "full codec: fp32 encoder + fp32 quantizer + bf16 decoder + bf16 decode table",
            }
            result["arms"]["upstream"] = {}
            for count in streams:
                result["arms"]["upstream"][str(count)] = _measure_upstream(codec, count, device)
                common.write_json(args.json, result)
            del codec
            common.free_memory(device)

    if "legacy" in result["arms"] and "v2" in result["arms"]:
        result["saving_bytes"] = {
            str(c): result["arms"]["legacy"][str(c)]["state_bytes"] - result["arms"]["v2"][str(c)]["state_bytes"]
            for c in streams
        }
    common.write_json(args.json, result)
    _print_table(result)
    return result


if __name__ == "__main__":
    main()
