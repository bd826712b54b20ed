# SPDX-License-Identifier: Apache-2.0
"""Flags of the stage benchmark and their checks: every bad value is a usage error (exit 2, one line on stderr)
naming the flag and the value, raised before any arm runs or anything is written (``--out`` is created last, once
all else held)."""

from __future__ import annotations

import argparse
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common
import torch

from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS, preset_config
from vllm_omni_moss.model_executor.models.moss_tts.stage_options import DEFAULT_MAX_STEP_FRAMES

from .arms import ARMS, AUTO_ARMS, OUR_ARMS, StatePlan, state_plan
from .metrics import rate_key
from .trace import ARRIVALS

__all__ = ["DEFAULT_CONCURRENCY", "DEFAULT_RATES", "Load", "OneLineParser", "Settings", "parse_args", "resolve"]

DEFAULT_CONCURRENCY = {"cuda": "64,128,256,512", "cpu": "4,8"}
#: ``--arrival poisson`` without ``--request-rate`` (requests/s).
DEFAULT_RATES = {"cuda": "100,150,200", "cpu": "1,2,3"}
DEFAULT_REQUESTS_PER_STREAM = 17
DEFAULT_WARMUP_SECONDS, DEFAULT_MEASURE_SECONDS = 10.0, 30.0
#: Most live streams of one run (``--concurrency``, ``--max-concurrency``): ``common.MAX_ROWS``.
MAX_STREAMS = common.MAX_ROWS
#: Most requests of one run: closed loop ``concurrency x --requests-per-stream``; poisson the expected
#: ``rate x (--warmup-seconds + --measure-seconds)`` (the simulator keeps a few numbers per chunk of each).
MAX_REQUESTS = 1_000_000
#: Flags ``--report-only`` reads; any other flag given with it is refused (it would change nothing).
REPORT_ONLY_FLAGS = ("out", "report_only", "quiet")


@dataclass(frozen=True)
class Load:
    """One run of a sweep: its ``arms.<arm>`` key, the slots every arm is built with, the rate (poisson)."""

    key: str
    concurrency: int
    rate: float | None = None


@dataclass
class Settings:
    """The checked flags of one invocation (``args`` keeps the raw namespace, defaults resolved)."""

    args: argparse.Namespace
    parser: argparse.ArgumentParser
    device: torch.device
    preset: str
    cfg: Any
    n_vq: int
    schedules: list[list[int]]
    loads: list[Load]
    arms: list[str]
    skipped: dict[str, str]
    plans: dict[tuple[str, int], StatePlan] = field(default_factory=dict)

    @property
    def poisson(self) -> bool:
        return self.args.arrival == "poisson"

    def error(self, message: str):
        self.parser.error(message)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr, exit status 2: the message (which names the
    flag and the value) and a pointer to ``--help``, without argparse's usage block before it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="auto", help="codec geometry; auto = v2 on CUDA, tiny-v2 on CPU")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--arms", default="auto", help=f"subset of {','.join(ARMS)} (default: {','.join(AUTO_ARMS)})")
    p.add_argument("--arrival", default="wave", choices=ARRIVALS, help="arrival model (wave)")
    p.add_argument(
        "--concurrency", default="auto", help="live streams per run (CPU 4,8); poisson: one value, the slots"
    )
    p.add_argument("--requests-per-stream", type=int, default=None, help="wave, staggered: requests = C x this (17)")
    p.add_argument(
        "--request-rate",
        default=None,
        help="poisson: requests/s, a list swept like --concurrency (CPU 1,2,3; CUDA 100,150,200)",
    )
    p.add_argument("--burstiness", type=float, default=None, help="poisson: gamma shape of the gaps (1.0 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="poisson: live streams at most (--concurrency)")
    p.add_argument("--warmup-seconds", type=float, default=None, help="poisson: simulated s left out first (10)")
    p.add_argument("--measure-seconds", type=float, default=None, help="poisson: simulated s of arrivals counted (30)")
    p.add_argument("--talker-rtf", type=float, default=0.5, help="talker s per s of codes (0.5 = 25 frames/s)")
    p.add_argument(
        "--chunks",
        action="append",
        default=None,
        help=f"chunk ramp(s) in frames, the last size repeated (1,15; sizes <= {DEFAULT_MAX_STEP_FRAMES}); ';' or repeat",
    )
    p.add_argument("--n-vq", type=int, default=12, help="codebooks per frame (MOSS-TTS-Local: 12)")
    p.add_argument("--slo-ms", type=float, default=150.0, help="codec-added latency p99 bound (150 ms)")
    p.add_argument(
        "--give-up-ms", type=float, default=5000.0, help="stop a run once a chunk or request waits this long"
    )
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (every arm)")
    p.add_argument("--state-budget-gib", type=float, default=None, help="our arms' decoder state memory (slots/pages)")
    p.add_argument("--expected-stream-seconds", type=float, default=None, help="v2-paged budget split by fill")
    p.add_argument("--page-fraction", type=float, default=None, help="v2-paged: pages as a fraction of full rings (1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/bench_codec_stage", help="output directory (out/bench_codec_stage)")
    p.add_argument("--append", action="store_true", help="add these runs to --out's results (same commit, settings)")
    p.add_argument("--report-only", action="store_true", help="run nothing: rewrite reports and plots from --out")
    p.add_argument(
        "--quiet", action="store_true", help="no progress bars (they are off anyway when stderr is not a terminal)"
    )
    p.add_argument("--time-replays", action="store_true", help="CUDA, our arms: time graph replays between syncs")
    p.add_argument("--trace-calls", action="store_true", help="our arms: each decode call's host time by phase")


def parse_args(argv: list[str] | None, description: str) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """Parse ``argv``; with ``--report-only`` any run flag given too is a usage error naming it."""
    p = OneLineParser(prog="bench_codec_stage.py", description=description)
    _flags(p)
    args = p.parse_args(argv)
    if args.report_only:
        given = [
            f"--{k.replace('_', '-')}"
            for k, v in vars(args).items()
            if k not in REPORT_ONLY_FLAGS and v != p.get_default(k)
        ]
        if given:
            p.error(f"--report-only rewrites the reports of --out and runs nothing: {', '.join(given)} has no effect")
    return args, p


def _positive(p, flag: str, value, *, allow_zero: bool = False) -> None:
    ok = value is not None and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if value is not None and not ok:
        p.error(f"{flag} must be a {'non-negative' if allow_zero else 'positive'} number, got {value}")


def _check_numbers(args, p) -> None:
    for flag in ("--requests-per-stream", "--n-vq", "--max-concurrency"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    common.check_seed(p, args.seed)
    if args.preset != "auto" and args.preset not in PRESETS:
        p.error(f"--preset must be auto or one of {sorted(PRESETS)}, got {args.preset!r}")
    if args.page_fraction is not None and not 0.0 < args.page_fraction <= 1.0:
        p.error(f"--page-fraction must be in (0, 1], got {args.page_fraction}")
    for flag in ("--state-budget-gib", "--expected-stream-seconds", "--slo-ms", "--talker-rtf", "--burstiness"):
        _positive(p, flag, getattr(args, flag[2:].replace("-", "_")))
    _positive(p, "--warmup-seconds", args.warmup_seconds, allow_zero=True)
    _positive(p, "--measure-seconds", args.measure_seconds)
    _positive(p, "--give-up-ms", args.give_up_ms)
    if args.give_up_ms <= args.slo_ms:
        p.error(
            f"--give-up-ms {args.give_up_ms:g} must exceed --slo-ms {args.slo_ms:g} (a run is only stopped once it missed)"
        )
    if args.expected_stream_seconds is not None and args.state_budget_gib is None:
        p.error(
            f"--expected-stream-seconds {args.expected_stream_seconds:g} splits a state budget: give --state-budget-gib"
        )


def _check_arrival(args, p) -> None:
    """Flags of one arrival model given with another are refused (they would do nothing)."""
    poisson_only = ("--request-rate", "--burstiness", "--max-concurrency", "--warmup-seconds", "--measure-seconds")
    given = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in poisson_only}
    if args.arrival != "poisson":
        for flag, value in given.items():
            if value is not None:
                p.error(f"{flag} {value} applies to --arrival poisson, not --arrival {args.arrival}")
        args.requests_per_stream = args.requests_per_stream or DEFAULT_REQUESTS_PER_STREAM
        return
    if args.requests_per_stream is not None:
        p.error(f"--requests-per-stream {args.requests_per_stream} applies to closed-loop arrivals, not poisson")
    args.burstiness = 1.0 if args.burstiness is None else args.burstiness
    args.warmup_seconds = DEFAULT_WARMUP_SECONDS if args.warmup_seconds is None else args.warmup_seconds
    args.measure_seconds = DEFAULT_MEASURE_SECONDS if args.measure_seconds is None else args.measure_seconds


def parse_float_list(text: str) -> list[float]:
    """``"1,2.5"`` -> ``[1.0, 2.5]`` (positive finite numbers, order kept, duplicates dropped, no empty item)."""
    values: list[float] = []
    for part in text.split(","):
        if not part.strip():
            raise ValueError(f"empty item in {text!r}")
        value = float(part)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"expected positive numbers, got {part.strip()!r}")
        if value not in values:
            values.append(value)
    return values


def parse_schedules(texts: list[str]) -> list[list[int]]:
    """Chunk ramps from ``--chunks`` values: each value may hold several ramps separated by ``;``."""
    schedules: list[list[int]] = []
    for text in texts:
        for part in text.split(";"):
            sizes = [common.parse_int(v) for v in part.split(",")]  # ValueError on an empty item or a non-integer
            if min(sizes) < 1:
                raise ValueError(f"chunk sizes must be >= 1 frame, got {part.strip()!r}")
            if sizes not in schedules:
                schedules.append(sizes)
    return schedules


def _loads(args, p, device: torch.device) -> list[Load]:
    text = DEFAULT_CONCURRENCY[device.type] if args.concurrency == "auto" else args.concurrency
    try:
        concurrencies = common.parse_int_list(text)
    except ValueError as exc:
        p.error(f"--concurrency {args.concurrency!r}: {exc}")
    if max(concurrencies) > MAX_STREAMS:
        p.error(f"--concurrency {args.concurrency!r}: at most {MAX_STREAMS} streams per run, got {max(concurrencies)}")
    if args.arrival != "poisson":
        requests = max(concurrencies) * args.requests_per_stream
        if requests > MAX_REQUESTS:
            p.error(
                f"--concurrency {max(concurrencies)} x --requests-per-stream {args.requests_per_stream} = "
                f"{requests} requests: at most {MAX_REQUESTS} per run"
            )
        return [Load(str(c), c) for c in concurrencies]
    if args.concurrency == "auto":
        concurrencies = [max(concurrencies)]
    if len(concurrencies) != 1:
        p.error(f"--concurrency {args.concurrency!r}: poisson takes one value (the slots of every arm)")
    slots = concurrencies[0]
    args.max_concurrency = slots if args.max_concurrency is None else args.max_concurrency
    if args.max_concurrency > slots:
        p.error(f"--max-concurrency {args.max_concurrency} exceeds --concurrency {slots} (the arms' slots)")
    rates = args.request_rate or DEFAULT_RATES[device.type]
    try:
        values = parse_float_list(rates)
    except ValueError as exc:
        p.error(f"--request-rate {rates!r}: {exc}")
    horizon = args.warmup_seconds + args.measure_seconds
    if max(values) * horizon > MAX_REQUESTS:
        p.error(
            f"--request-rate {max(values):g} x (--warmup-seconds {args.warmup_seconds:g} + --measure-seconds "
            f"{args.measure_seconds:g}) = {max(values) * horizon:.0f} requests expected: at most {MAX_REQUESTS} per run"
        )
    keys = dict.fromkeys(rate_key(r) for r in values)
    return [Load(k, slots, float(k.removeprefix("rate="))) for k in keys]


def _select_arms(args, p, cfg, device) -> tuple[list[str], dict[str, str]]:
    try:
        names = list(AUTO_ARMS) if args.arms == "auto" else common.parse_str_list(args.arms, ARMS)
    except ValueError as exc:
        p.error(f"--arms {args.arms!r}: {exc}")
    skipped: dict[str, str] = {}
    for name in ("v2", "v2-paged"):
        if name in names and not cfg.abilities.compact_pool:
            skipped[name] = f"preset {args.preset!r} is a {cfg.version} codec; the compact pool serves v2 codecs"
    if "upstream" in names:
        ok, reason = common.upstream_status(args.preset, device)
        directory = common.oracle.upstream_dir()
        if ok and device.type == "cuda" and not (directory / "streaming_attention.py").is_file():
            ok, reason = False, f"{directory}/streaming_attention.py (the triton attention backend) not found"
        if not ok:
            skipped["upstream"] = reason
    if args.page_fraction is not None and "v2-paged" not in names:
        p.error(f"--page-fraction {args.page_fraction:g} applies to the v2-paged arm, not to {','.join(names)}")
    args.page_fraction = 1.0 if args.page_fraction is None else args.page_fraction
    arms = [a for a in names if a not in skipped]
    if not arms:
        p.error(f"--arms {args.arms!r}: no arm left to run ({'; '.join(f'{a}: {r}' for a, r in skipped.items())})")
    return arms, skipped


def _plans(s: Settings) -> None:
    """Every (our arm, concurrency) state plan, checked on a meta-device twin of the decoder (nothing allocated)."""
    ours = [a for a in s.arms if a in OUR_ARMS]
    if not ours:
        return
    meta = common.random_decoder(s.preset, "meta")
    dtype = torch.bfloat16 if s.device.type == "cuda" else torch.float32  # the serving dtype of the rings
    graphs = s.device.type == "cuda" and not s.args.eager
    for name in ours:
        for c in sorted({load.concurrency for load in s.loads}):
            try:
                s.plans[(name, c)] = state_plan(
                    name,
                    c,
                    meta_decoder=meta,
                    state_dtype=dtype,
                    graphs=graphs,
                    budget_gib=s.args.state_budget_gib,
                    page_fraction=s.args.page_fraction,
                    expected_stream_seconds=s.args.expected_stream_seconds,
                )
            except ValueError as exc:
                flag = "--state-budget-gib" if s.args.state_budget_gib is not None else "--page-fraction"
                value = s.args.state_budget_gib if s.args.state_budget_gib is not None else s.args.page_fraction
                s.error(f"{flag} {value:g} for {name} at {c} streams: {exc}")


def _check_out(out: Path, p) -> None:
    """Create ``out`` and write a probe file in it (the last check: nothing is written before it)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        p.error(f"--out {str(out)!r}: cannot write there ({exc.strerror or exc})")


def resolve(args: argparse.Namespace, p: argparse.ArgumentParser) -> Settings:
    """Check every flag (exit 2 on the first bad one) and resolve the defaults that depend on the device."""
    _check_numbers(args, p)
    _check_arrival(args, p)
    try:
        device = common.resolve_device(args.device)
    except RuntimeError:
        p.error(f"--device {args.device}: no CUDA device is available (torch.cuda.is_available() is False)")
    preset = ("v2" if device.type == "cuda" else "tiny-v2") if args.preset == "auto" else args.preset
    args.preset = preset
    cfg = preset_config(preset)
    if args.n_vq > cfg.num_quantizers:
        p.error(f"--n-vq {args.n_vq} exceeds the codec's {cfg.num_quantizers} codebooks")
    try:
        schedules = parse_schedules(args.chunks or ["1,15"])
    except ValueError as exc:
        p.error(f"--chunks {';'.join(args.chunks or [])!r}: {exc}")
    # The stage's own chunk limit: a connector schedule with a larger size fails Stage 1 at startup.
    common.check_at_most(p, "--chunks", [max(s) for s in schedules], DEFAULT_MAX_STEP_FRAMES)
    loads = _loads(args, p, device)
    arms, skipped = _select_arms(args, p, cfg, device)
    settings = Settings(args, p, device, preset, cfg, args.n_vq, schedules, loads, arms, skipped)
    _plans(settings)
    _check_out(Path(args.out), p)
    return settings
