# SPDX-License-Identifier: Apache-2.0
"""Persistent codec decoder-state memory: legacy pool vs V2 pool vs paged pool vs upstream vLLM-Omni 0.30.0.

For each stream count C (``--streams``) four arms are sized as serving sizes them when the largest
CUDA-graph batch bucket equals C:

* ``legacy``   - our legacy pool, ``initialize(C, C)``: C live slots + C scratch slots (one per padding row).
* ``v2``       - our V2 pool, ``initialize(C, C)``: C live slots + 1 null slot (scratch request ignored).
* ``v2-paged`` - our paged pool (``pool_kind="paged"``), ``initialize(C, C)`` at ``--page-fraction`` of full
  rings for every slot (1.0 by default): ``state_bytes`` is what it allocates (pages, the null page of each
  group, frame counters and page tables). It also reports the state its streams hold once each of the C
  streams has decoded F code frames, for every F of ``--context-frames`` (default 13, 54, 125, 250 frames:
  about 1 s, the main job's 4.3 s mean request, 10 s and 20 s at 12.5 frames/s), under
  ``arms.v2-paged.<C>.in_use_by_context_frames.<F>``. The streams reach F frames in the pieces of the main
  job's chunk ramp (``--chunks``, 1 then 15 frames), all C streams in each step, as ``CodecStreamSession``
  steps them; when a step is short of pages (``--page-fraction`` < 1) the run is repeated with one stream
  fewer (as if the session had preempted its youngest stream), so ``streams_held`` says how many of the C
  streams fit (C at page fraction 1.0).

  How the pages are obtained: on CUDA, by REAL DECODE STEPS (``step.decode_batch`` on random
  codes, which reserves the step's pages with ``pool.reserve`` before writing, as the session's scheduler
  does). Without a GPU the pool lives on the meta device (no values, nothing allocated) and each step
  instead calls ``pool.reserve`` with the frame counts kept on the host (so it never reads the device's
  counters): the same page
  arithmetic, ``min(ceil(F x tokens_per_frame / page_size), window / page_size)`` pages per group and slot,
  without decoding (decoding the v2 preset's C streams on a CPU would take hours). ``paged_context_bytes``
  runs either way on any real device, so the tests check one against the other on a tiny codec.
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
{...}}, ...}, "skipped": {arm: reason}}``; every byte count is an integer. The paged arm's entries add
``page_fraction``, ``page_size_tokens``, ``pages_per_group`` (allocated pages, null page included),
``page_bytes_per_group`` (one page of every layer of the group), ``ring_bytes`` (all pages) and
``in_use_by_context_frames``: per F (a decimal string), ``context_frames``, ``context_seconds``,
``streams_held``, ``pages_in_use_per_group``, ``pages_in_use_bytes`` (``pool.pages_in_use_bytes()``),
``state_in_use_bytes`` (``pool.state_in_use_bytes()``: pages plus frame counters and page tables) and
``decode_steps`` (0 when reserved without decoding). Markdown tables in GiB are printed last.
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
from vllm_omni_moss.model_executor.models.moss_tts.decoder import chunk_schedule  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.state import (  # noqa: E402
    PagedDecoderStatePool,
    PagesExhausted,
    StateSpec,
    build_pool,
    state_bytes_for,
)
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_batch  # noqa: E402

ARMS = ("legacy", "v2", "v2-paged", "upstream")
#: Our arms (pools of this package); ``v2-paged`` is the paged pool.
OUR_ARMS = ("legacy", "v2", "v2-paged")
FRAME_RATE = 12.5  # code frames per second (both MOSS codecs)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="v2", choices=sorted(PRESETS))
    parser.add_argument("--streams", default="64,128", help="comma-separated live stream counts C")
    parser.add_argument("--arms", default=",".join(ARMS), help="subset of legacy,v2,v2-paged,upstream")
    parser.add_argument(
        "--page-fraction",
        type=float,
        default=None,
        help="v2-paged: pages per group as a fraction of full rings for every slot, in (0, 1] (1.0)",
    )
    parser.add_argument(
        "--context-frames",
        default="13,54,125,250",
        help="v2-paged: code frames every stream has decoded when its held state is read (12.5 frames/s)",
    )
    parser.add_argument(
        "--chunks",
        default="1,15",
        help="v2-paged: frames per step on the way to each context: each size once, the last repeated (1,15)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="cuda: allocate for real; cpu: meta-device byte accounting only",
    )
    parser.add_argument("--n-vq", type=int, default=12, help="codebooks the serving decode table folds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.page_fraction is not None and not 0.0 < args.page_fraction <= 1.0:
        parser.error(f"--page-fraction must be in (0, 1], got {args.page_fraction}")
    args.stream_counts = common.int_list_flag(parser, "--streams", args.streams)
    args.arm_names = common.str_list_flag(parser, "--arms", args.arms, ARMS)
    if args.page_fraction is not None and "v2-paged" not in args.arm_names:
        parser.error(
            f"--page-fraction {args.page_fraction:g} applies to the v2-paged arm, not to {','.join(args.arm_names)}"
        )
    args.page_fraction = 1.0 if args.page_fraction is None else args.page_fraction
    args.context_frames = common.int_list_flag(parser, "--context-frames", args.context_frames)
    args.chunk_sizes = common.int_list_flag(parser, "--chunks", args.chunks)
    common.check_at_most(parser, "--streams", args.stream_counts, common.MAX_ROWS)
    common.check_at_most(parser, "--context-frames", args.context_frames, common.MAX_STREAM_FRAMES)
    common.check_at_most(parser, "--chunks", args.chunk_sizes, common.MAX_STEP_FRAMES)
    common.check_seed(parser, args.seed)
    common.check_n_vq(parser, args.preset, args.n_vq)
    try:
        args.device = common.resolve_device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device}: no CUDA device is available (torch.cuda.is_available() is False)")
    common.check_output(parser, "--json", args.json)
    return args


def _pool_kind_slots(arm: str, streams: int) -> tuple[int, int]:
    """(state_capacity, scratch_capacity) requested for an arm at C streams (max graph bucket = C)."""
    return streams, streams


def _add_device_bytes(entry: dict[str, Any], before: dict[str, int] | None, device: torch.device) -> None:
    """``offset_bytes`` (state minus rings) and, on CUDA, what the allocation took from the device."""
    entry["offset_bytes"] = entry["state_bytes"] - entry["ring_bytes"]
    if before is not None:
        entry.update(common.memory_delta(before, common.cuda_memory(device)))
        entry["device_used_bytes"] = common.cuda_memory(device)["device_used"]


def _measure_ours(decoder, arm: str, streams: int, device: torch.device) -> dict[str, Any]:
    capacity, scratch = _pool_kind_slots(arm, streams)
    before = common.cuda_memory(device) if device.type == "cuda" else None
    pool = build_pool(decoder, StateSpec.from_options(decoder, common.pool_kind(arm), dtype=torch.bfloat16))
    pool.initialize(capacity, scratch)
    entry: dict[str, Any] = {
        "state_capacity": capacity,
        "scratch_requested": scratch,
        "slots": int(pool.num_slots),
        "state_bytes": int(pool.state_bytes()),
        "predicted_bytes": int(state_bytes_for(decoder.config, pool.num_slots, common.pool_kind(arm))),
        "ring_bytes": int(sum(r.numel() * r.element_size() for r in pool.rings)),
    }
    _add_device_bytes(entry, before, device)
    pool.close()
    del pool
    common.free_memory(device)
    return entry


def piece_frames(frames: int, chunk_sizes: list[int]) -> list[int]:
    """Frames of each step that takes a stream from 0 to ``frames`` code frames: ``chunk_sizes`` as a chunk ramp
    whose last size repeats, the last step cut to what remains (``decoder.chunk_schedule``)."""
    return [b - a for a, b in chunk_schedule(frames, chunk_sizes)]


def paged_group_pages(pool: PagedDecoderStatePool) -> list[int]:
    """Pages allocated per group (the null page included), from the page tensors of its first layer."""
    first = [sum(g.num_layers for g in pool.config.groups[:i]) for i in range(len(pool.config.groups))]
    return [int(pool.rings[layer].shape[1]) for layer in first]


def _advance_streams(pool, held: int, pieces: list[int], n_vq: int, seed: int) -> int:
    """Take ``held`` fresh slots of ``pool`` through ``pieces`` frames per step; returns the decode steps run
    (0 on the meta device, where each step only reserves its pages). Raises ``PagesExhausted`` when short."""
    decode = pool.device.type != "meta"
    gen = torch.Generator().manual_seed(int(seed))
    slots = [pool.acquire() for _ in range(held)]
    frames, steps = 0, 0
    for piece in pieces:
        if decode:
            codes = torch.randint(0, pool.config.codebook_size, (n_vq, held, piece), generator=gen)
            decode_batch(
                pool,
                codes.to(pool.device),
                torch.full((held,), piece, dtype=torch.long, device=pool.device),
                torch.tensor(slots, dtype=torch.long, device=pool.device),
                torch.ones(held, dtype=torch.bool, device=pool.device),
            )
            steps += 1
        else:
            pool.reserve(dict.fromkeys(slots, frames + piece), strict=True)
            pool.commit_page_tables()
        frames += piece
    return steps


def paged_context_bytes(
    decoder,
    streams: int,
    context_frames: int,
    chunk_sizes: list[int],
    n_vq: int,
    page_fraction: float = 1.0,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> dict[str, Any]:
    """The state ``streams`` streams hold in a fresh paged pool once each has decoded ``context_frames`` frames.

    The pool is ``build_pool`` of ``StateSpec.from_options(decoder, "paged", dtype, page_fraction=page_fraction)`` initialised for
    ``streams`` slots; the streams take fresh slots and advance together, one step per piece of
    :func:`piece_frames`. On a real device every step is a real ``step.decode_batch`` on random
    codes (``n_vq`` codebooks), which reserves the step's pages (``pool.reserve``) as the session's scheduler
    does. On the meta device every step only reserves the pages: ``pool.reserve`` with each slot's frame count
    kept on the host. When a step is short of pages
    (``page_fraction`` < 1) the whole run starts again in a fresh pool with one stream fewer: the pages the
    other streams hold do not depend on the dropped stream, so this equals the session preempting its
    youngest stream (a meta pool cannot release a slot: releasing reads the slot's page list on the device).

    Returns:
        ``context_frames`` (frames), ``context_seconds`` (s), ``streams_held`` (streams that reached the
        context), ``pages_in_use_per_group`` (pages, from the free page counts), ``pages_in_use_bytes`` and
        ``state_in_use_bytes`` (bytes, the pool's own counts) and ``decode_steps`` (steps of the last run,
        0 on the meta device).
    """
    for held in range(streams, 0, -1):
        pool = build_pool(decoder, StateSpec.from_options(decoder, "paged", dtype=dtype, page_fraction=page_fraction))
        pool.initialize(streams, streams)
        try:
            steps = _advance_streams(pool, held, piece_frames(context_frames, chunk_sizes), n_vq, seed)
        except PagesExhausted:
            continue  # one stream fewer
        finally:
            pool_pages = paged_group_pages(pool)
            free = pool.free_page_counts()
            in_use = (int(pool.pages_in_use_bytes()), int(pool.state_in_use_bytes()))
            pool.close()
        return {
            "context_frames": int(context_frames),
            "context_seconds": round(context_frames / FRAME_RATE, 3),
            "streams_held": held,
            "pages_in_use_per_group": [p - 1 - n for p, n in zip(pool_pages, free)],
            "pages_in_use_bytes": in_use[0],
            "state_in_use_bytes": in_use[1],
            "decode_steps": steps,
        }
    raise RuntimeError(f"the paged pool cannot hold one stream of {context_frames} frames")


def _measure_paged(decoder, streams: int, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """The ``v2-paged`` arm at ``streams`` streams: allocated bytes, then the held state per context."""
    capacity, scratch = _pool_kind_slots("v2-paged", streams)
    before = common.cuda_memory(device) if device.type == "cuda" else None
    spec = StateSpec.from_options(decoder, "paged", dtype=torch.bfloat16, page_fraction=args.page_fraction)
    pool = build_pool(decoder, spec)
    pool.initialize(capacity, scratch)
    element = pool.rings[0].element_size()
    entry: dict[str, Any] = {
        "state_capacity": capacity,
        "scratch_requested": scratch,
        "slots": int(pool.num_slots),
        "state_bytes": int(pool.state_bytes()),
        "ring_bytes": int(sum(r.numel() * r.element_size() for r in pool.rings)),
        "page_fraction": pool.page_fraction,
        "page_size_tokens": int(pool.page_size),
        "pages_per_group": paged_group_pages(pool),
        "page_bytes_per_group": [
            2 * g.num_heads * pool.page_size * g.head_dim * element * g.num_layers for g in decoder.config.groups
        ],
    }
    _add_device_bytes(entry, before, device)
    pool.close()
    del pool
    common.free_memory(device)
    decode = device.type != "meta"
    entry["in_use_mode"] = "decode steps" if decode else "page reservation (meta device, no decoding)"
    entry["in_use_by_context_frames"] = {}
    for f in args.context_frames:
        entry["in_use_by_context_frames"][str(f)] = paged_context_bytes(
            decoder, streams, f, args.chunk_sizes, args.n_vq, args.page_fraction, seed=args.seed
        )
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


def _print_paged_table(result: dict[str, Any]) -> None:
    paged = result["arms"]["v2-paged"]
    compact = result["arms"].get("v2", {})
    prows = []
    for count, e in paged.items():
        for f, used in e["in_use_by_context_frames"].items():
            prows.append(
                [
                    count,
                    f,
                    f"{used['context_seconds']:.2f}",
                    used["streams_held"],
                    f"{common.gib(used['pages_in_use_bytes']):.3f}",
                    f"{common.gib(used['state_in_use_bytes']):.3f}",
                    f"{common.gib(e['state_bytes']):.2f}",
                    f"{common.gib(compact[count]['state_bytes']):.2f}" if count in compact else "-",
                ]
            )
    fraction = next(iter(paged.values()))["page_fraction"]
    mode = next(iter(paged.values()))["in_use_mode"]
    print(f"\n### v2-paged: state held after F frames per stream (page fraction {fraction:g}, {mode})\n")
    headers = [
        "streams",
        "context frames",
        "context s",
        "streams held",
        "pages in use GiB",
        "state in use GiB",
        "paged allocated GiB",
        "v2 state GiB",
    ]
    print(common.markdown_table(headers, prows))


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
    if result["arms"].get("v2-paged"):
        _print_paged_table(result)
    for arm, reason in result["skipped"].items():
        print(f"\nskipped {arm}: {reason}")


def _measure_our_arms(ours_arms: list[str], args, device, build_device, result: dict[str, Any]) -> None:
    """Our decoder's weights, then every (arm, stream count) of our pools, into ``result``."""
    streams = args.stream_counts
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
            if arm == "v2-paged":
                entry = _measure_paged(decoder, count, build_device, args)
            else:
                entry = _measure_ours(decoder, arm, count, build_device)
            result["arms"][arm][str(count)] = entry
            common.write_json(args.json, result)
    del decoder
    common.free_memory(device)


def _measure_upstream_arm(args, device, n_vq: int, result: dict[str, Any]) -> None:
    """Upstream's weights and pools at every stream count (GPU only; the reason into ``result`` otherwise)."""
    ok, reason = common.upstream_status(args.preset, device)
    if ok and device.type != "cuda":
        ok, reason = False, "needs a GPU (meta accounting covers only our pools; upstream allocates for real)"
    if not ok:
        result["skipped"]["upstream"] = reason
        result["weights"]["upstream"] = {"skipped": reason}
        return
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
    for count in args.stream_counts:
        result["arms"]["upstream"][str(count)] = _measure_upstream(codec, count, device)
        common.write_json(args.json, result)
    del codec
    common.free_memory(device)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    streams, arms, device = args.stream_counts, args.arm_names, args.device
    accounting = "cuda" if device.type == "cuda" else "meta"
    build_device = device if device.type == "cuda" else torch.device("meta")
    config = preset_config(args.preset)
    n_vq = args.n_vq  # checked against the preset's codebooks

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

    ours_arms = [a for a in arms if a in OUR_ARMS]
    for arm in ("v2", "v2-paged"):
        if not config.abilities.compact_pool and arm in ours_arms:
            pool = "V2 pool" if arm == "v2" else "paged pool"
            result["skipped"][arm] = f"preset {args.preset!r} is a {config.version} codec; the {pool} serves v2 codecs"
            ours_arms.remove(arm)
    if ours_arms:
        _measure_our_arms(ours_arms, args, device, build_device, result)
    if "upstream" in arms:
        _measure_upstream_arm(args, device, n_vq, result)

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
