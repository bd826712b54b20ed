# SPDX-License-Identifier: Apache-2.0
"""Main job: the MOSS-TTS codec stage under serving load.

Drives the real :class:`CodecStreamSession` (state pool, CUDA graphs on a GPU) the
way vLLM-Omni's Stage 1 sees traffic: ``--requests`` streams, at most
``--concurrency`` live at once; each stream's talker emits code frames at 12.5
frames/s and the stage receives them in chunks of 1 frame, then 15 frames (then
the tail). A simulated clock advances by the measured wall time of every codec
step, so latencies include queueing behind slower steps.

Request lengths are SYNTHETIC: log-normal with a median of 4.0 s and sigma 0.45,
clipped to 1.04-20.48 s (13-256 frames), chosen to resemble the target durations
of the Seed-TTS test-en set used in vLLM-Omni's MOSS-TTS benchmarks (output length
256 frames). Codes are uniform random; with random weights the WAVs are noise.

Reports audio seconds per second of serving time, codec compute throughput,
first-chunk latency, per-chunk latency p50/p95/p99 and peak memory; writes
``results.json``, ``results.md``, ``latency.png`` and a few WAVs into ``--out``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import random_decoder, resolve_device  # noqa: E402

from vllm_omni_moss.model_executor.models.moss_tts.decoder import chunk_schedule  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.session import ChunkRequest, CodecStreamSession  # noqa: E402

FRAME_RATE = 12.5  # code frames per second (both MOSS codecs)
LENGTH_MODEL = "lognormal(median 4.0 s, sigma 0.45), clipped to 13..256 frames (synthetic, Seed-TTS-EN-like)"


def request_lengths(n: int, seed: int) -> np.ndarray:
    """Frames per request from the documented synthetic distribution."""
    rng = np.random.default_rng(seed)
    seconds = rng.lognormal(mean=math.log(4.0), sigma=0.45, size=n)
    return np.clip(np.round(seconds * FRAME_RATE), 13, 256).astype(int)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0, "mean": 0.0}
    arr = np.asarray(values)
    return {
        "p50": float(np.percentile(arr, 50)),
        "p95": float(np.percentile(arr, 95)),
        "p99": float(np.percentile(arr, 99)),
        "mean": float(arr.mean()),
    }


def _peak_memory(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        return {
            "cuda_max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
            "cuda_max_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        }
    return {"process_max_rss_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}


def simulate(args, device: torch.device) -> dict:
    from tqdm import tqdm

    decoder = random_decoder(args.preset, device, seed=args.seed)
    cfg = decoder.config
    buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 256) if b <= args.concurrency]
    if args.concurrency not in buckets:
        buckets.append(args.concurrency)
    graphs = device.type == "cuda" and not args.eager
    t0 = time.perf_counter()
    session = CodecStreamSession(
        decoder,
        args.concurrency,
        pool_kind=args.pool,
        graph_batch_sizes=buckets if graphs else (),
        graph_frames=(args.first_chunk, args.chunk) if graphs else (),
        n_vq=args.n_vq,
    )
    # Warm up outside the clock, as a serving stage does before taking traffic: first
    # calls pay one-time costs (allocator growth, kernel selection, Triton JIT).
    warm_codes = torch.randint(0, cfg.codebook_size, (args.n_vq, args.first_chunk + args.chunk), generator=None)
    for frames in (args.first_chunk, args.chunk):
        batch = [ChunkRequest(f"warmup-{i}", warm_codes[:, :frames]) for i in range(args.concurrency)]
        session.decode(batch)
    session.on_requests_finished([f"warmup-{i}" for i in range(args.concurrency)])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    setup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    lengths = request_lengths(args.requests, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    waiting = list(range(args.requests))
    ready: list[tuple[float, int, int]] = []  # (ready time, request, chunk index) min-heap
    chunks: dict[int, list[tuple[int, int]]] = {}
    codes: dict[int, torch.Tensor] = {}
    start_time: dict[int, float] = {}
    first_latency: list[float] = []
    step_ms: list[float] = []
    chunk_latency: list[float] = []
    wav_parts: dict[int, list[torch.Tensor]] = {i: [] for i in range(min(args.wavs, args.requests))}
    live = 0
    clock = 0.0
    busy = 0.0
    steps = 0
    audio_seconds = 0.0

    def admit(now: float) -> None:
        nonlocal live
        while waiting and live < args.concurrency:
            r = waiting.pop(0)
            live += 1
            frames = int(lengths[r])
            chunks[r] = chunk_schedule(frames, [args.first_chunk, args.chunk])
            codes[r] = torch.randint(0, cfg.codebook_size, (args.n_vq, frames), generator=gen)
            start_time[r] = now
            # Chunk k is ready when its last frame has been generated at 12.5 frames/s.
            heapq.heappush(ready, (now + chunks[r][0][1] / FRAME_RATE, r, 0))

    admit(0.0)
    bar = tqdm(total=args.requests, desc=f"codec stage ({args.preset}, {device.type})", unit="req", disable=args.quiet)
    while ready:
        if ready[0][0] > clock:
            clock = ready[0][0]  # idle until the next chunk is generated
        batch = []
        taken = set()
        while ready and ready[0][0] <= clock:
            item = heapq.heappop(ready)
            if item[1] in taken:  # one chunk per request per step; later ones wait
                batch.append(None)
                heapq.heappush(ready, item)
                break
            taken.add(item[1])
            batch.append(item)
        batch = [b for b in batch if b is not None]
        requests = []
        for _, r, k in batch:
            a, b = chunks[r][k]
            requests.append(ChunkRequest(f"req-{r}", codes[r][:, a:b], finished=k == len(chunks[r]) - 1))
        t = time.perf_counter()
        results = session.decode(requests)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t
        step_ms.append(wall * 1e3)
        busy += wall
        clock += wall
        steps += 1
        for ready_at, r, k in batch:
            result = results[f"req-{r}"]
            expected = (chunks[r][k][1] - chunks[r][k][0]) * cfg.samples_per_frame
            if result.audio.shape != (cfg.number_channels, expected):
                raise AssertionError(f"req-{r} chunk {k}: audio {tuple(result.audio.shape)}, expected {expected}")
            audio_seconds += expected / cfg.sampling_rate
            chunk_latency.append(clock - ready_at)
            if k == 0:
                first_latency.append(clock - start_time[r])
            if r in wav_parts:
                wav_parts[r].append(result.audio)
            if k + 1 < len(chunks[r]):
                heapq.heappush(ready, (start_time[r] + chunks[r][k + 1][1] / FRAME_RATE, r, k + 1))
            else:
                live -= 1
                bar.update(1)
        admit(clock)
    bar.close()
    cuda_graphs = sorted(session.runner.graphs) if session.runner is not None else []
    graph_failures = dict(session.runner.failures) if session.runner is not None else {}
    state_bytes = session.pool.state_bytes()
    session.close()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wavs = []
    for r, parts in wav_parts.items():
        import soundfile  # only when WAVs are asked for: the GPU image has no soundfile

        path = out / f"request-{r}.wav"
        soundfile.write(str(path), torch.cat(parts, dim=-1).T.numpy(), cfg.sampling_rate, subtype="FLOAT")
        wavs.append(path.name)
    return {
        "preset": args.preset,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "pool": session.pool.kind,
        "cuda_graphs": bool(cuda_graphs),
        "cuda_graph_keys": [list(k) for k in cuda_graphs],
        "cuda_graph_failures": {str(k): v for k, v in graph_failures.items()},
        "requests": args.requests,
        "concurrency": args.concurrency,
        "chunks_frames": [args.first_chunk, args.chunk],
        "n_vq": args.n_vq,
        "length_model": LENGTH_MODEL,
        "mean_request_seconds": float(lengths.mean() / FRAME_RATE),
        "setup_seconds": setup_s,
        "steps": steps,
        "serving_seconds": clock,
        "codec_busy_seconds": busy,
        "audio_seconds": audio_seconds,
        "audio_seconds_per_second": audio_seconds / clock,
        "codec_audio_seconds_per_busy_second": audio_seconds / busy,
        "first_chunk_latency_ms": {k: v * 1e3 for k, v in _percentiles(first_latency).items()},
        "chunk_latency_ms": {k: v * 1e3 for k, v in _percentiles(chunk_latency).items()},
        "step_ms": {**_percentiles(step_ms), "max": max(step_ms)},
        "peak_memory": _peak_memory(device),
        "state_bytes": state_bytes,
        "wavs": wavs,
        "_latencies": {"chunk_ms": [v * 1e3 for v in chunk_latency], "first_ms": [v * 1e3 for v in first_latency]},
    }


def write_reports(result: dict, out: Path) -> None:
    lat = result.pop("_latencies")
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    c, f, st = result["chunk_latency_ms"], result["first_chunk_latency_ms"], result["step_ms"]
    lines = [
        f"# Codec stage under load: {result['preset']} on {result['device_name']}",
        "",
        f"{result['requests']} requests, concurrency {result['concurrency']}, chunks {result['chunks_frames']} frames, "
        f"pool `{result['pool']}`, CUDA graphs {result['cuda_graphs']}. Lengths: {result['length_model']}.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| audio seconds per serving second | {result['audio_seconds_per_second']:.2f} |",
        f"| codec audio seconds per busy second | {result['codec_audio_seconds_per_busy_second']:.2f} |",
        f"| first-chunk latency p50 / p95 / p99 (ms) | {f['p50']:.1f} / {f['p95']:.1f} / {f['p99']:.1f} |",
        f"| chunk latency p50 / p95 / p99 (ms) | {c['p50']:.1f} / {c['p95']:.1f} / {c['p99']:.1f} |",
        f"| codec steps | {result['steps']} |",
        f"| step time p50 / p99 / max (ms) | {st['p50']:.1f} / {st['p99']:.1f} / {st['max']:.1f} |",
        f"| serving time simulated (s) | {result['serving_seconds']:.1f} |",
        f"| peak memory | {', '.join(f'{k} {v / 2**30:.2f} GiB' for k, v in result['peak_memory'].items())} |",
    ]
    lines += [
        "",
        "Latencies follow a simulated clock that advances by each step's measured wall time, so a machine",
        "stall (another process on a shared CPU) delays every waiting chunk; a step-time max far above p99",
        "points at such a stall rather than at the codec.",
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].hist(lat["chunk_ms"], bins=60, color="tab:blue")
    axes[0].set_xlabel("chunk latency (ms)")
    axes[0].set_ylabel("chunks")
    axes[0].set_title("per-chunk latency")
    axes[1].hist(lat["first_ms"], bins=60, color="tab:orange")
    axes[1].set_xlabel("first-chunk latency (ms, incl. 80 ms of generation)")
    axes[1].set_title("time to first audio")
    fig.suptitle(f"{result['preset']} on {result['device_name']}: {result['audio_seconds_per_second']:.1f} audio-s/s")
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="auto", help="codec geometry; auto = v2 on CUDA, tiny-v2 on CPU")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda")
    p.add_argument("--requests", type=int, default=1088, help="requests in the run (default 1088)")
    p.add_argument("--concurrency", type=int, default=64, help="live streams at most (default 64)")
    p.add_argument("--first-chunk", type=int, default=1, help="frames in the first chunk (default 1)")
    p.add_argument("--chunk", type=int, default=15, help="frames in steady chunks (default 15)")
    p.add_argument("--n-vq", type=int, default=12, help="codebooks per frame (MOSS-TTS-Local: 12)")
    p.add_argument("--pool", default=None, choices=["v2", "legacy"], help="state pool (default: V2 for v2 codecs)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--wavs", type=int, default=3, help="requests saved as WAV (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/bench_codec_stage", help="output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    for name in ("requests", "concurrency", "first_chunk", "chunk", "n_vq"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    device = resolve_device(args.device)
    if args.preset == "auto":
        args.preset = "v2" if device.type == "cuda" else "tiny-v2"
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    result = simulate(args, device)
    out = Path(args.out)
    write_reports(result, out)
    print((out / "results.md").read_text())
    print(f"wrote {out}/results.json, results.md, latency.png and {len(result['wavs'])} WAVs")
    return result


if __name__ == "__main__":
    main()
