# SPDX-License-Identifier: Apache-2.0
"""Streaming decode-step latency: legacy pool vs V2 pool vs upstream vLLM-Omni 0.30.0, in one process.

One step = one ``step.decode_tensors`` call on ``B`` live rows (slots ``0..B-1``, all valid, no
padding) of ``T`` code frames (for our arms the ``(n_vq, B, T)`` grid packed first, ``token_packing.pack_codes``:
every frame real, or with ``--mixed`` the frames past each row's length as dummies) with ``--n-vq`` codebooks. Arms:

* ``legacy``   - our legacy pool (``initialize(maxB, maxB)``), per-layer metadata, whole-ring write-back.
* ``v2``       - our V2 pool (``initialize(maxB, maxB)`` = maxB live + 1 null slot) with its default attention
  backend: ``triton`` on CUDA, ``sdpa`` on CPU (``backends.default_attention_backend``).
* ``upstream`` - upstream 0.30.0's v2 codec model with ``initialize_decoder_state_pool(maxB, maxB)``, its
  own ``decode_streaming_tensors``; skipped (reason in the JSON) when its files are not available.
* ``v2-sdpa``  - the V2 pool with ``attention_backend="sdpa"``: the reference path (gathered rings, SDPA).
* ``v2-triton`` - the V2 pool with ``attention_backend="triton"`` (rings read in place, ``ops/ring_attention.py``).
* ``v2-exact`` - the V2 pool with ``attention_backend="triton"`` and ``ring_semantics="exact"`` (the exact
  sliding window: a ring-plus-chunk window per query instead of the post-write ring).
* ``v2-paged`` - the paged pool (``pool_kind="paged"``, ``state.PagedDecoderStatePool``): the V2 pool's
  Triton ops reading and writing rings through page tables. Every slot holds the pages of full rings, as a
  stream past its window does; on request only (not in the default ``--arms``).
* ``upstream-triton`` - upstream's H200 configuration: another upstream model whose attention modules get
  upstream's masked Triton attention (``streaming_attention.py`` of the wheel) exactly as its stage installs
  it for ``codec_attention_backend: triton``; CUDA only. That file imports ``vllm.triton_utils``; without
  vLLM a stand-in module exposing ``triton`` and ``tl`` serves the import while it loads
  (``vllm_omni_moss.testing.upstream_files.load_streaming_attention``).

Our arms share one decoder (same weights); each upstream arm has its own randomly initialised model (upstream
keeps one pool per model). Weights and pools are built once, sized to the largest ``--batch``. Modes:

* ``eager``    - the call itself.
* ``graph``    - one plain ``torch.cuda.CUDAGraph`` per (arm, B, T) capturing the call; replays are timed.
* ``compiled`` - ``torch.compile(dynamic=False)`` of the call, then captured like ``graph``; the compile
  seconds are reported (minutes per shape on the real codec, so only when asked for).

Timing is interleaved: for each (B, T) and mode, each repeat round times every arm in turn (order rotated
per round), ``--steps-per-round`` steps each, rotating among ``--code-sets`` random non-zero code sets. On
CUDA each step is bracketed by CUDA events after a synchronize (per-step latency, host launch time
included); on CPU by ``time.perf_counter``. Per arm: median, p10/p25/p75/p90 in ms; per (B, T, mode):
``v2/legacy`` and ``v2/upstream`` median ratios from the same run, and each of our arms against the faster
upstream arm (``<arm>/upstream-best``). Peak transient memory of one eager step (``max_memory_allocated``
above the allocation before it) is reported per arm on CUDA. ``--profile`` (CUDA) adds, per arm and shape,
the kernel time of one eager step from ``torch.profiler``, summed by :data:`KERNEL_CATEGORIES`.

Usage::

    python benchmarks/tts/bench_codec_step.py --preset v2 --batch 1,8,64,128 --frames 1,15 \
        --modes eager,graph --arms legacy,v2,upstream --repeats 5 --json out/step.json

CPU with a tiny preset runs the eager mode only (graph/compiled are skipped with a reason).

Each (B, T) also gets its floor (``step_floor.py``, skipped with ``--no-floor``): the step's projection GEMMs timed
alone plus one read of its rows' ring state at the copy bandwidth measured once in the same command
(``copy_gb_s``); each result carries ``floor: {gemm_ms, state_read_ms, total_ms, copy_gb_s, state_bytes}`` and
every arm's ``step_over_floor``.

Ring fill. The pool is built once per command and its slots start at position 0; every step a command runs
(warmup, profile, timing, over all of its shapes) advances the slots it uses by ``T`` frames. So a step reads only
the positions its slots decoded so far, up to each group's window (125 frames fill the v2 codec's first group),
while the floor counts a read of the rows' whole rings: with fresh streams a short command times steps that read
less than the floor assumes. ``--context-frames N`` starts every slot at ``N`` frames decoded instead (compact-pool
arms only; ``N`` at least the longest window in frames, 125 for v2, times every step with full rings, as streams
past their first 10 s run); the JSON's ``context_frames`` records it (null: fresh streams).

``--mixed 1,2,4,6`` adds, for every ``--batch`` ``B``, a mixed step as one ragged step serves an engine call: ``B``
rows whose valid frames cycle through those lengths, ``T`` the longest, timed packed to the full ``B x T`` grid
(``<arm>``: the frames past each row's length as dummies) and packed to its real frames (``<arm>+packed``), our arms
only. Each
such record (JSON ``mixed``) carries ``chunk_cost_ms``: what its chunks cost at their own ``T`` in the full step,
``{mode: {arm: sum over rows of step(B_max, T_row) / B_max}}`` from this run's table in the same mode (present when
``--frames`` holds every mixed length), and each arm's ``over_chunk_cost``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import step_floor  # noqa: E402
import torch  # noqa: E402

from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS, preset_config  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.ops import ring_attention as ring_ops  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.state import StateSpec, build_pool  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_tensors  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.token_packing import pack_codes  # noqa: E402
from vllm_omni_moss.testing.upstream_files import load_streaming_attention  # noqa: E402

ARMS = (
    "legacy",
    "v2",
    "upstream",
    "v2-sdpa",
    "v2-triton",
    "v2-exact",
    "upstream-triton",
    "v2-paged",
)
#: Arms of the default ``--arms``.
DEFAULT_ARMS = ARMS[:-1]
#: Our arms beyond ``legacy``/``v2``: (attention backend, ring semantics) of a V2 pool.
TRITON_ARMS = {
    "v2-sdpa": ("sdpa", None),
    "v2-triton": ("triton", None),
    "v2-exact": ("triton", "exact"),
}
UPSTREAM_ARMS = ("upstream", "upstream-triton")
#: Arms on the compact pool, whose slots ``--context-frames`` can start past position 0.
COMPACT_ARMS = ("v2", *TRITON_ARMS)
MODES = ("eager", "graph", "compiled")

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Any]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset",
        default="auto",
        choices=["auto", *sorted(PRESETS)],
        help="codec geometry; auto = v2 on CUDA, tiny-v2 elsewhere (v2 on a CPU needs over 23 GiB at B128)",
    )
    parser.add_argument("--batch", default="1,8,64,128", help="comma-separated live rows B per step")
    parser.add_argument("--frames", default="1,15", help="comma-separated code frames T per step")
    parser.add_argument("--modes", default="eager,graph", help="subset of eager,graph,compiled")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"subset of {','.join(ARMS)}")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds per (B, T, mode)")
    parser.add_argument("--steps-per-round", type=int, default=2, help="timed steps per arm per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per arm before timing/capture")
    parser.add_argument("--code-sets", type=int, default=3, help="random code sets rotated between steps")
    parser.add_argument("--n-vq", type=int, default=12, help="codebooks per frame (serving uses 12)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here (rewritten after each shape)")
    parser.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the floor of each (B, T): its GEMMs alone plus one read of its ring state (step_floor.py)",
    )
    parser.add_argument(
        "--mixed",
        default=None,
        help="chunk lengths of a mixed step per --batch, e.g. 1,2,4,6 (rows cycle through them; our arms only)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="CUDA: also profile one eager step per (arm, B, T) and report kernel time by category",
    )
    parser.add_argument(
        "--context-frames",
        type=int,
        default=None,
        help="start every slot at this many frames decoded (compact-pool arms only); default: fresh streams",
    )
    args = parser.parse_args(argv)
    for name in ("repeats", "steps_per_round", "code_sets"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    args.batches, args.frames_list = common.step_shape_flags(parser, args.batch, args.frames)
    args.mix = [] if args.mixed is None else common.int_list_flag(parser, "--mixed", args.mixed)
    common.check_at_most(parser, "--mixed", args.mix, common.MAX_STEP_FRAMES)
    common.check_at_most(parser, "--code-sets", args.code_sets, 1024)
    common.check_seed(parser, args.seed)
    args.mode_names = common.str_list_flag(parser, "--modes", args.modes, MODES)
    args.arm_names = common.str_list_flag(parser, "--arms", args.arms, ARMS)
    if args.context_frames is not None:
        if args.context_frames < 0:
            parser.error(f"--context-frames must be >= 0, got {args.context_frames}")
        common.check_at_most(parser, "--context-frames", args.context_frames, common.MAX_STREAM_FRAMES)
        other = [a for a in args.arm_names if a not in COMPACT_ARMS]
        if other:
            parser.error(f"--context-frames applies to the compact-pool arms {COMPACT_ARMS} only, not {other}")
    try:
        args.device = common.resolve_device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device}: no CUDA device is available (torch.cuda.is_available() is False)")
    if args.preset == "auto":
        args.preset = "v2" if args.device.type == "cuda" else "tiny-v2"
    common.check_n_vq(parser, args.preset, args.n_vq)
    common.check_output(parser, "--json", args.json)
    return args


# ----------------------------------------------------------------------------------------- arms


class Arm:
    """One benchmarked implementation: a step function over its own persistent state."""

    def __init__(self, name: str, step: StepFn, state_bytes: int, close: Callable[[], None]):
        self.name = name
        self.step = step
        self.state_bytes = int(state_bytes)
        self._close = close

    def close(self) -> None:
        self._close()


def _start_at(pool, max_batch: int, context_frames: int | None) -> None:
    # Slots 0..max_batch-1 (the ones steps address) start at ``context_frames`` frames decoded; None or 0: fresh.
    if context_frames:
        pool.frames_decoded[:max_batch] = context_frames


def _our_step(pool) -> Callable:
    """Our step on a ``(n_vq, B, T)`` grid of codes: packed to ``total_frames`` (default ``B x T``, every grid
    frame) and decoded (``step.decode_tensors``); returns the ``(channels, F x spf)`` packed audio."""

    def step(codes, lengths, slots, valid, total_frames: int | None = None):
        _, B, T = codes.shape
        packed = pack_codes(codes, torch.where(valid, lengths, 0), B * T if total_frames is None else total_frames)
        return decode_tensors(pool, packed, lengths, slots, valid, T)

    return step


def _our_arm(decoder, kind: str, max_batch: int, context_frames: int | None = None) -> Arm:
    """One of our arms on a pool of ``max_batch`` slots; ``context_frames`` (compact pool only) starts every slot
    at that many frames decoded, so that each step reads ``min(context, window)`` positions of every ring (the
    rings' contents are whatever the pool was initialised with: time does not depend on them)."""
    if kind in TRITON_ARMS:
        backend, semantics = TRITON_ARMS[kind]
        pool = build_pool(
            decoder, StateSpec.from_options(decoder, "compact", ring_semantics=semantics, attention_backend=backend)
        )
        pool.initialize(max_batch, max_batch)
        _start_at(pool, max_batch, context_frames)
        return Arm(kind, _our_step(pool), pool.state_bytes(), pool.close)
    pool = build_pool(decoder, StateSpec.from_options(decoder, common.pool_kind(kind)))
    pool.initialize(max_batch, max_batch)
    _start_at(pool, max_batch, context_frames)
    if kind == "v2-paged":
        # Steps address slots 0..B-1 directly: give each the pages of a full ring (any context longer
        # than the longest window) so that no step needs a page and the tables are what they will be.
        longest = max(-(-g.ring_capacity // g.tokens_per_frame) for g in decoder.config.groups)
        slots = [pool.acquire() for _ in range(max_batch)]  # 0..B-1, the ids the steps address
        pool.reserve(dict.fromkeys(slots, longest), strict=True)
        pool.commit_page_tables()
    return Arm(kind, _our_step(pool), pool.state_bytes(), pool.close)


def _upstream_arm(codec: common.UpstreamCodecArm, max_batch: int, name: str = "upstream") -> Arm:
    codec.open_pool(max_batch, max_batch)
    return Arm(name, codec.step, common.upstream_state_bytes(codec.model), codec.close_pool)


def _install_upstream_triton(codec: common.UpstreamCodecArm) -> int:
    """Give every attention module of ``codec``'s decoder upstream's masked Triton attention, as upstream's
    stage does for ``codec_attention_backend: triton`` (``load_weights`` of ``modeling_moss_tts_codec.py``).
    The wheel's ``streaming_attention.py`` is loaded once per process by
    :func:`vllm_omni_moss.testing.upstream_files.load_streaming_attention` (a stand-in ``vllm.triton_utils``
    during the load where vLLM is not installed). Returns the number of modules changed."""
    attention = load_streaming_attention().masked_attention
    modules = [
        m for m in codec.model.decoder.modules() if isinstance(m, codec.module.MossAudioTokenizerMultiheadAttention)
    ]
    for module in modules:
        module._streaming_attention = attention
    return len(modules)


# ----------------------------------------------------------------------------------------- runners


class Runner:
    """Executes timed steps of one arm at one (B, T) in one mode.

    ``time_step(k)`` runs one step on code set ``k`` and returns its latency in ms.
    """

    def __init__(self, arm: Arm, inputs: dict[str, Any], device: torch.device):
        self.arm = arm
        self.inputs = inputs
        self.device = device
        self.info: dict[str, Any] = {}

    def _call(self, codes: torch.Tensor):
        i = self.inputs
        return self.arm.step(codes, i["lengths"], i["slots"], i["valid"])

    def _launch(self, k: int) -> None:
        self._call(self.inputs["codes"][k])

    def time_step(self, k: int) -> float:
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            self._launch(k)
            return (time.perf_counter() - t0) * 1e3
        self._prepare(k)
        torch.cuda.synchronize(self.device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        self._run_prepared(k)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    # Split so graph replays can stage their inputs outside the timed region.
    def _prepare(self, k: int) -> None:
        pass

    def _run_prepared(self, k: int) -> None:
        self._launch(k)

    def close(self) -> None:
        pass


class EagerRunner(Runner):
    def setup(self, warmup: int) -> None:
        for w in range(warmup):
            self._launch(w % len(self.inputs["codes"]))


class GraphRunner(Runner):
    """One CUDA graph of the step (optionally of its ``torch.compile`` version) on static inputs."""

    def __init__(self, arm: Arm, inputs: dict[str, Any], device: torch.device, compiled: bool):
        super().__init__(arm, inputs, device)
        self.compiled = compiled
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_codes = inputs["codes"][0].clone()
        self.fn: StepFn = arm.step

    def setup(self, warmup: int) -> None:
        i = self.inputs
        reserved0 = torch.cuda.memory_reserved(self.device)
        if self.compiled:
            self.fn = torch.compile(self.arm.step, dynamic=False)
            t0 = time.perf_counter()
            self.fn(self.static_codes, i["lengths"], i["slots"], i["valid"])
            torch.cuda.synchronize(self.device)
            self.info["compile_s"] = round(time.perf_counter() - t0, 3)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup)):
                self.fn(self.static_codes, i["lengths"], i["slots"], i["valid"])
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        with torch.cuda.graph(graph):
            self.outputs = self.fn(self.static_codes, i["lengths"], i["slots"], i["valid"])
        torch.cuda.synchronize(self.device)
        self.info["capture_s"] = round(time.perf_counter() - t0, 3)
        self.info["capture_reserved_delta_bytes"] = int(torch.cuda.memory_reserved(self.device) - reserved0)
        self.graph = graph

    def _prepare(self, k: int) -> None:
        self.static_codes.copy_(self.inputs["codes"][k])

    def _run_prepared(self, k: int) -> None:
        self.graph.replay()

    def _launch(self, k: int) -> None:
        self._prepare(k)
        self.graph.replay()

    def close(self) -> None:
        self.graph = None
        self.outputs = None


# ----------------------------------------------------------------------------------------- measurement


def _peak_transient_bytes(arm: Arm, inputs: dict[str, Any], device: torch.device) -> int:
    """Peak bytes allocated during one eager step above what was allocated before it (CUDA only)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = arm.step(inputs["codes"][0], inputs["lengths"], inputs["slots"], inputs["valid"])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return int(peak)


#: Kernel categories of ``--profile``, matched in this order against the lower-cased kernel name.
KERNEL_CATEGORIES = (
    ("rope pass (ours)", ("_rope_kernel", "_tables_kernel")),
    ("ring attention (ours)", ("_ring_attention_kernel",)),
    ("ring write / commit (ours)", ("_ring_write_kernel", "_commit_ring_kernel", "_commit_offsets_kernel")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul")),
    ("sdpa / upstream attention", ("flash", "fmha", "attention", "attn")),
    ("norm", ("layer_norm", "layernorm")),
    ("gather / scatter / index", ("index", "gather", "scatter")),
    ("copies / cat", ("copy", "cat_", "catarray", "concat")),
    ("gelu", ("gelu",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
    ("reduce", ("reduce",)),
)


def kernel_category(name: str) -> str:
    """The :data:`KERNEL_CATEGORIES` entry a CUDA kernel name falls in (``"other"`` if none)."""
    lowered = name.lower()
    for category, needles in KERNEL_CATEGORIES:
        if any(needle in lowered for needle in needles):
            return category
    return "other"


def _profile_step(arm: Arm, inputs: dict[str, Any], device: torch.device, steps: int = 2) -> dict[str, Any]:
    """Kernel time of one eager step of ``arm`` by :func:`kernel_category` (mean of ``steps`` steps).

    Returns ``{"kernel_ms": total, "kernels": launches per step, "categories": {name: ms}, "top": [...],
    "most_launched": [...]}`` (``top``: the 12 kernels of most time; ``most_launched``: the 16 of most launches)
    from ``torch.profiler`` (CUDA activity only).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def step() -> None:
        arm.step(inputs["codes"][0], inputs["lengths"], inputs["slots"], inputs["valid"])

    step()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
    categories: dict[str, float] = {}
    kernels: list[tuple[float, int, str]] = []
    for event in prof.key_averages():
        if event.device_type != DeviceType.CUDA:
            continue
        ms = event.self_device_time_total / 1e3 / steps
        category = kernel_category(event.key)
        categories[category] = categories.get(category, 0.0) + ms
        kernels.append((ms, event.count // steps, event.key))
    kernels.sort(reverse=True)
    return {
        "kernel_ms": round(sum(ms for ms, _, _ in kernels), 3),
        "kernels": sum(count for _, count, _ in kernels),
        "categories": {name: round(ms, 3) for name, ms in sorted(categories.items(), key=lambda kv: -kv[1])},
        "top": [{"ms": round(ms, 3), "count": count, "name": name[:120]} for ms, count, name in kernels[:12]],
        "most_launched": [
            {"count": count, "ms": round(ms, 3), "name": name[:120]}
            for ms, count, name in sorted(kernels, key=lambda k: -k[1])[:16]
        ],
    }


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if not a or not b or "median_ms" not in a or "median_ms" not in b or b["median_ms"] <= 0:
        return None
    return round(a["median_ms"] / b["median_ms"], 4)


def _ratios(a: dict[str, Any]) -> dict[str, float | None]:
    """Median ratios of one (B, T, mode): v2/legacy, v2/upstream, legacy/upstream, and each of our V2 arms
    against the faster upstream arm (``<arm>/upstream-best``)."""
    ratios = {
        "v2/legacy": _ratio(a.get("v2"), a.get("legacy")),
        "v2/upstream": _ratio(a.get("v2"), a.get("upstream")),
        "legacy/upstream": _ratio(a.get("legacy"), a.get("upstream")),
    }
    upstreams = [a[name] for name in UPSTREAM_ARMS if name in a]
    best = min(upstreams, key=lambda stats: stats["median_ms"]) if upstreams else None
    for name in ("v2", *TRITON_ARMS, "v2-paged"):
        if name in a:
            ratios[f"{name}/upstream-best"] = _ratio(a[name], best)
    return ratios


def _bench_mixed(arms: list[Arm], modes: list[str], batch: int, args, config, device, table: list) -> dict[str, Any]:
    """The mixed step of ``batch`` rows (``--mixed``): each of our arms on the grid and packed, and the cost of
    its chunks at their own ``T`` in the full step of this run's ``table`` (module docstring)."""
    lengths = [args.mix[b % len(args.mix)] for b in range(batch)]
    ours = [a for a in arms if a.name not in UPSTREAM_ARMS]
    packed = [
        Arm(f"{a.name}+packed", functools.partial(a.step, total_frames=sum(lengths)), a.state_bytes, lambda: None)
        for a in ours
    ]
    record = _bench_shape(ours + packed, modes, batch, max(lengths), args, config, device, lengths)
    record.update(mix=list(args.mix), real_frames=sum(lengths))
    full = max(args.batches)
    for mode, entry in record["modes"].items():
        cost = {r["frames"]: r["modes"].get(mode, {}).get("arms", {}) for r in table if r["batch"] == full}
        for arm in ours:
            per_row = [cost.get(t, {}).get(arm.name, {}).get("median_ms") for t in lengths]
            if None in per_row:
                continue
            chunks = sum(per_row) / full
            record.setdefault("chunk_cost_ms", {}).setdefault(mode, {})[arm.name] = round(chunks, 4)
            for name in (arm.name, f"{arm.name}+packed"):
                if name in entry["arms"]:
                    entry["arms"][name]["over_chunk_cost"] = round(entry["arms"][name]["median_ms"] / chunks, 3)
    return record


def _bench_shape(
    arms: list[Arm],
    modes: list[str],
    batch: int,
    frames: int,
    args,
    config,
    device: torch.device,
    lengths: list[int] | None = None,
) -> dict[str, Any]:
    n_vq = args.n_vq  # checked against the preset's codebooks
    inputs = {
        "codes": common.random_codes(
            args.code_sets, n_vq, batch, frames, config.codebook_size, device, args.seed + 1000 * batch + frames
        ),
        "lengths": (
            torch.full((batch,), frames, dtype=torch.long, device=device)
            if lengths is None
            else torch.tensor(lengths, dtype=torch.long, device=device)
        ),
        "slots": torch.arange(batch, dtype=torch.long, device=device),
        "valid": torch.ones(batch, dtype=torch.bool, device=device),
    }
    record: dict[str, Any] = {"batch": batch, "frames": frames, "modes": {}}
    if device.type == "cuda":
        record["peak_transient_bytes"] = {arm.name: _peak_transient_bytes(arm, inputs, device) for arm in arms}
        if args.profile:
            record["profile"] = {arm.name: _profile_step(arm, inputs, device) for arm in arms}
    for mode in modes:
        runners: dict[str, Runner] = {}
        entry: dict[str, Any] = {"arms": {}, "errors": {}}
        for arm in arms:
            runner = (
                EagerRunner(arm, inputs, device)
                if mode == "eager"
                else GraphRunner(arm, inputs, device, compiled=mode == "compiled")
            )
            try:
                runner.setup(args.warmup)
            except Exception as exc:  # noqa: BLE001 - one arm failing to capture/compile must not sink the run
                entry["errors"][arm.name] = f"{type(exc).__name__}: {exc}"[:2000]
                runner.close()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                continue
            runners[arm.name] = runner
        samples: dict[str, list[float]] = {name: [] for name in runners}
        names = list(runners)
        for r in range(args.repeats):
            order = names[r % len(names) :] + names[: r % len(names)] if names else []
            for name in order:
                for s in range(args.steps_per_round):
                    k = (r * args.steps_per_round + s) % args.code_sets
                    samples[name].append(runners[name].time_step(k))
        for name, runner in runners.items():
            entry["arms"][name] = {**common.summarize_ms(samples[name]), **runner.info}
            runner.close()
        runners.clear()
        entry["ratios"] = _ratios(entry["arms"])
        if not entry["errors"]:
            del entry["errors"]
        record["modes"][mode] = entry
        common.free_memory(device)
    return record


def _print_tables(result: dict[str, Any]) -> None:
    arms = result["arms"]
    headers = ["B", "T", "mode"] + [f"{a} ms (p10-p90)" for a in arms] + ["v2/legacy", "v2/upstream"]
    rows = []
    for rec in result["results"]:
        for mode, entry in rec["modes"].items():
            row = [rec["batch"], rec["frames"], mode]
            for a in arms:
                s = entry["arms"].get(a)
                row.append("-" if s is None else f"{s['median_ms']:.2f} ({s['p10_ms']:.2f}-{s['p90_ms']:.2f})")
            for key in ("v2/legacy", "v2/upstream"):
                v = entry["ratios"].get(key)
                row.append("-" if v is None else f"{v:.3f}")
            rows.append(row)
    print(f"\n### decode step latency, preset {result['preset']}, n_vq {result['n_vq']}, {result['device']}\n")
    print(common.markdown_table(headers, rows))
    peak_rows = [
        [rec["batch"], rec["frames"]] + [f"{common.gib(rec['peak_transient_bytes'].get(a, 0)):.3f}" for a in arms]
        for rec in result["results"]
        if "peak_transient_bytes" in rec
    ]
    if peak_rows:
        print("\n### peak transient memory of one eager step (GiB)\n")
        print(common.markdown_table(["B", "T"] + arms, peak_rows))
    floor_rows = [
        [rec["batch"], rec["frames"], mode]
        + [f"{f[k]:.3f}" for k in ("gemm_ms", "state_read_ms", "total_ms")]
        + [f"{e['arms'][a]['step_over_floor']:.3f}" if a in e["arms"] else "-" for a in arms]
        for rec in result["results"]
        if (f := rec.get("floor"))
        for mode, e in rec["modes"].items()
    ]
    if floor_rows:
        print(f"\n### floor of each step (ms; copy bandwidth {result['copy_gb_s']} GB/s) and step / floor\n")
        print(common.markdown_table(["B", "T", "mode", "GEMMs", "state read", "floor"] + arms, floor_rows))
    for rec in result["results"]:
        for arm, prof in rec.get("profile", {}).items():
            print(
                f"\n### eager kernel time by category, {arm}, B={rec['batch']} T={rec['frames']}: "
                f"{prof['kernel_ms']:.2f} ms in {prof['kernels']} kernels\n"
            )
            print(common.markdown_table(["category", "ms"], [[k, f"{v:.2f}"] for k, v in prof["categories"].items()]))
    _print_mixed(result)
    _print_compile_and_best(result)
    for key, reason in result["skipped"].items():
        print(f"\nskipped {key}: {reason}")
    for rec in result["results"]:
        for mode, entry in rec["modes"].items():
            for arm, err in entry.get("errors", {}).items():
                print(f"\nerror B={rec['batch']} T={rec['frames']} {mode} {arm}: {err.splitlines()[0][:300]}")


def _print_mixed(result: dict[str, Any]) -> None:
    rows = []
    for rec in result.get("mixed", []):
        for mode, entry in rec["modes"].items():
            for arm, s in entry["arms"].items():
                over = s.get("over_chunk_cost")
                row = [rec["batch"], rec["frames"], rec["real_frames"], mode, arm]
                row += [f"{s['median_ms']:.2f} ({s['p10_ms']:.2f}-{s['p90_ms']:.2f})", "-" if over is None else over]
                rows.append(row)
    if rows:
        mix = ",".join(map(str, result["mixed"][0]["mix"]))
        print(f"\n### mixed steps (rows of {mix} frames) and their cost over their chunks' cost in a full step\n")
        print(common.markdown_table(["B", "T", "real frames", "mode", "arm", "ms (p10-p90)", "/ chunks"], rows))


def _print_compile_and_best(result: dict[str, Any]) -> None:
    arms = result["arms"]
    compile_rows = [
        [rec["batch"], rec["frames"]]
        + [rec["modes"]["compiled"]["arms"].get(a, {}).get("compile_s", "-") for a in arms]
        for rec in result["results"]
        if "compiled" in rec["modes"]
    ]
    if compile_rows:
        print("\n### torch.compile seconds per shape\n")
        print(common.markdown_table(["B", "T"] + arms, compile_rows))
    best_keys = sorted(
        {
            k
            for rec in result["results"]
            for e in rec["modes"].values()
            for k in e["ratios"]
            if k.endswith("/upstream-best")
        }
    )
    if best_keys:
        print("\n### median ratio against the faster upstream arm\n")
        best_rows = [
            [rec["batch"], rec["frames"], mode]
            + ["-" if e["ratios"].get(k) is None else f"{e['ratios'][k]:.3f}" for k in best_keys]
            for rec in result["results"]
            for mode, e in rec["modes"].items()
        ]
        print(common.markdown_table(["B", "T", "mode", *best_keys], best_rows))


def _select(args, config, device) -> tuple[list[str], list[str], dict[str, str]]:
    """(modes, arms) that can run here, and the reason for each one skipped."""
    modes, arm_names = list(args.mode_names), list(args.arm_names)
    skipped: dict[str, str] = {}
    if device.type != "cuda":
        for mode in [m for m in modes if m != "eager"]:
            skipped[mode] = "needs CUDA (CUDA graphs)"
        modes = [m for m in modes if m == "eager"]
    for name in [a for a in ("v2", *TRITON_ARMS, "v2-paged") if a in arm_names]:
        if not config.abilities.compact_pool:
            skipped[name] = f"preset {args.preset!r} is a {config.version} codec; the V2 pool serves v2 codecs"
        elif name != "v2" and not ring_ops.HAS_TRITON:
            skipped[name] = "needs the triton package"
    for name in [a for a in UPSTREAM_ARMS if a in arm_names]:
        ok, reason = common.upstream_status(args.preset, device)
        if ok and name == "upstream-triton" and device.type != "cuda":
            ok, reason = False, "upstream's Triton attention runs on CUDA only (as its stage requires)"
        if not ok:
            skipped[name] = reason
    return modes, [a for a in arm_names if a not in skipped], skipped


def _raise_compile_limits() -> None:
    # Each (arm, B, T) is a separate static-shape compile of the same function.
    for key in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(getattr(torch._dynamo.config, key), 1024))


def _build_arms(args, arm_names: list[str], device, result: dict[str, Any], models: dict[str, Any]) -> list[Arm]:
    """Weights (into ``models``: ``ours``, ``upstream``, ``upstream-triton``) and one :class:`Arm` per name, pools
    sized to the largest batch; build seconds, weight and state bytes go into ``result``."""
    max_batch = result["pool_capacity"]
    if any(a in arm_names for a in ("legacy", "v2", *TRITON_ARMS, "v2-paged")):
        t0 = time.perf_counter()
        models["ours"] = common.random_decoder(args.preset, device, args.seed)
        result["build_s"]["ours"] = round(time.perf_counter() - t0, 3)
        result["weights_bytes"]["ours"] = common.module_bytes(models["ours"])
    for name in [a for a in UPSTREAM_ARMS if a in arm_names]:
        t0 = time.perf_counter()
        models[name] = common.build_upstream_codec(args.preset, device, args.seed, result["n_vq"])
        if name == "upstream-triton":
            result["upstream_triton_modules"] = _install_upstream_triton(models[name])
        result["build_s"][name] = round(time.perf_counter() - t0, 3)
        result["weights_bytes"][name] = models[name].total_bytes
    arms = []
    for name in arm_names:
        if name in UPSTREAM_ARMS:
            arm = _upstream_arm(models[name], max_batch, name)
        else:
            arm = _our_arm(models["ours"], name, max_batch, args.context_frames)
        arms.append(arm)
        result["state_bytes"][name] = arm.state_bytes
    return arms


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    device = args.device
    if args.profile and device.type != "cuda":
        print("bench_codec_step.py: --profile times CUDA kernels; ignored on this device", file=sys.stderr)
    config = preset_config(args.preset)
    modes, arm_names, skipped = _select(args, config, device)
    if device.type == "cuda":
        _raise_compile_limits()
    result: dict[str, Any] = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "n_vq": args.n_vq,
        "batches": args.batches,
        "frames": args.frames_list,
        "modes": modes,
        "arms": arm_names,
        "repeats": args.repeats,
        "steps_per_round": args.steps_per_round,
        "pool_capacity": max(args.batches),
        "context_frames": args.context_frames,
        "skipped": skipped,
        "weights_bytes": {},
        "build_s": {},
        "state_bytes": {},
        "results": [],
    }
    arms: list[Arm] = []
    models: dict[str, Any] = {}
    try:
        arms = _build_arms(args, arm_names, device, result, models)
        if device.type == "cuda":
            result["allocated_after_setup_bytes"] = int(torch.cuda.memory_allocated(device))
        if args.floor:
            result["copy_gb_s"] = round(step_floor.copy_bandwidth_gb_s(device), 2)
        element = models["ours"].state_dtype.itemsize if "ours" in models else 2
        for batch in args.batches:
            for frames in args.frames_list:
                t0 = time.perf_counter()
                record = _bench_shape(arms, modes, batch, frames, args, config, device)
                if args.floor:
                    record["floor"] = step_floor.step_floor(config, batch, frames, device, result["copy_gb_s"], element)
                    step_floor.with_ratios(record)
                record["wall_s"] = round(time.perf_counter() - t0, 3)
                result["results"].append(record)
                common.write_json(args.json, result)
                print(f"B={batch} T={frames}: {record['wall_s']:.1f} s", flush=True)
        for batch in args.batches if args.mix else []:
            record = _bench_mixed(arms, modes, batch, args, config, device, result["results"])
            result.setdefault("mixed", []).append(record)
            common.write_json(args.json, result)
    finally:
        for arm in arms:
            arm.close()
        del arms
        models.clear()
        common.free_memory(device)

    common.write_json(args.json, result)
    _print_tables(result)
    return result


if __name__ == "__main__":
    main()
