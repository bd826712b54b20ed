# SPDX-License-Identifier: Apache-2.0
"""Fidelity over long streams: each arm's bf16 audio against a float32 run of the same weights, window by window.

The question (issue 29): does the bf16 error of a streaming decode grow with stream length? Every arm streams
the same codes, ``--streams`` rows of ``--frames`` frames of uniform random codes (``n_vq`` 12, values in
``[1, codebook_size)``), in chunks of 1 frame then 15 frames (the last chunk is what remains), twice: once in
bf16 (decoder weights and rings bf16, as served) and once in float32 (the same weights cast to float32: the
same arm, the same pool, ring semantics and attention code, float32 rings). The float32 run is the reference
of that arm. Arms:

* ``v2``       - our :class:`CodecStreamSession` on the compact pool with ``ring_semantics="upstream"`` (the
  default for v2 codecs); on CUDA its default attention backend (``triton`` when installed).
* ``upstream`` - vLLM-Omni 0.30.0's own codec model and pool under upstream's Stage-1 policy
  (``upstream_stage.UpstreamStage``, as ``bench_codec_stage.py`` builds it); on CUDA its bf16 run uses the
  wheel's Triton masked attention (``upstream_stage.enable_triton_attention``), its float32 run upstream's
  SDPA (upstream uses the Triton kernel for bf16 only). Skipped, with the reason printed, without the
  wheel's files.
* ``v2-exact`` - the compact pool with ``ring_semantics="exact"``.
* ``legacy``   - the legacy (upstream-equivalent) pool, ``sdpa`` attention, upstream semantics.

Weights: random, of the ``--preset`` geometry (``common.random_weights``, bf16 values), one model for every arm:
upstream's model (``common.build_upstream_codec``) gets those tensors and decode table copied into it by
official checkpoint name, and our bf16 decoder is their float32 copy served (``CodecDecoder.to_serving``: on CUDA
LayerScale folded into the projections in float32, then rounded once to bf16), so arms differ by their code
only. ``details.fp32_vs_legacy`` checks that: each
upstream-semantics arm's float32 audio against the legacy arm's over the frames before the last chunk
(upstream pads a tail chunk to a graph's frame size and its padding writes the rings). Upstream's module
hard-codes bf16 on CUDA (autocast around every decode, bf16 rings); its float32 run replaces the module's
``torch`` name, for that run only, by a stand-in whose ``autocast`` does nothing and whose ``bfloat16`` is
``float32`` (:func:`upstream_float32`).

On CUDA our arms replay CUDA graphs (batch bucket ``--streams``, frame sizes 1 and 15), as served, and so does
upstream's driver; TF32 is off for float32 matmuls (``run.tf32``). On a CPU nothing is captured and the bf16
run casts the decoder to bf16 (the session then keeps bf16 rings).

Windows: for each mark ``m`` of ``--marks`` (default 43, 94, 171, 400, 1000, 4000 frames; marks above
``--frames`` are dropped), the window is the ``--window`` frames (default 43) ending at the mark, frames
``[m - window, m)``. A fixed width gives every window the same number of samples, so the windows' figures are
equally noisy, and each measures the error at that point of the stream rather than averaged with everything
before it; with the default width the first window is frames ``[0, 43)``. Per window::

    rel_error = ||bf16 - fp32||_2 / ||fp32||_2       (every row, channel and sample of the window; float64 sums)
    snr_db    = -20 log10(rel_error)                 (null when rel_error is 0)

(a relative error is null where the reference is silent or a run's audio is not finite; each run's
``nonfinite_samples`` counts such samples).

``cumulative_rel_error`` / ``cumulative_snr_db`` cover frames ``[0, m)`` (the figures a whole-stream comparison
of ``m`` frames gives). Targets: ``ours_never_above_upstream`` (each of our arms: its ``rel_error`` is at most
upstream's, within ``TIE_TOLERANCE``, in every window; ``ours_over_upstream_max`` gives the largest ratio) and
``growth_first_to_last`` (each arm: last window's ``rel_error`` over the first's, bound ``GROWTH_BOUND``).

``--reference repeat`` makes the reference a second bf16 run of the same arm: the figures then measure
run-to-run nondeterminism (zero for a deterministic arm).

Time: on CUDA the run prints its planned duration first (``estimate_seconds``: planning figures, not
measurements) and, after every run, the time spent and the time left at the pace so far; ``--budget-s``
skips the arms that would end past a budget (named in ``run.skipped``). An arm that fails is recorded with its
error and the others still run. Writes ``--out`` (JSON, rewritten after every arm) and the markdown table
beside it (``.md``), and prints the table last. ``--device cpu --preset tiny-v2 --frames 200`` runs in
seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import math
import os
import shlex
import sys
import tempfile
import time
import types
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402
import upstream_stage  # noqa: E402

from vllm_omni_moss.model_executor.models.moss_tts.checkpoint import official_decoder_names  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS, preset_config  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.decoder import CodecDecoder, chunk_schedule  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import frame_totals  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.serving import (  # noqa: E402
    ChunkRequest,
    CodecStreamSession,
    SessionOptions,
)
from vllm_omni_moss.model_executor.models.moss_tts.state import StateSpec  # noqa: E402

CHUNKS = (1, 15)  # frames: the first chunk, then the steady chunk size
DEFAULT_MARKS = "43,94,171,400,1000,4000"
GROWTH_BOUND = 2.0  # issue 29: an arm's last window's error at most this times its first window's
# An arm of ours is "above" upstream in a window only beyond this relative margin: where both compute the same
# (CPU), their errors differ in the fourth digit by float32 rounding alone.
TIE_TOLERANCE = 0.01


@dataclass(frozen=True)
class ArmSpec:
    """One arm: ``pool_kind`` None is upstream's model; ``ring_semantics`` None is the pool's default."""

    name: str
    pool_kind: str | None
    ring_semantics: str | None


#: In run order: if a run is cut short, v2 and upstream (the comparison of the targets) are done first.
ARMS = {
    "v2": ArmSpec("v2", "compact", "upstream"),
    "upstream": ArmSpec("upstream", None, None),
    "v2-exact": ArmSpec("v2-exact", "compact", "exact"),
    "legacy": ArmSpec("legacy", "legacy", None),
}
#: Arms that compute upstream's semantics as legacy does: their float32 audio must agree with legacy's.
UPSTREAM_SEMANTICS_ARMS = ("v2", "upstream")

# Planning figures for the printed estimate of a v2 run on an H200: a B4/T15 graph step; setup = building a
# session or stage and capturing its two graphs; compile = Triton's first compile of a run's kernels (each
# precision of an attention code: v2, v2-exact and upstream's bf16 run; legacy and upstream's float32 SDPA
# reuse kernels compiled before). Not measurements of a run.
_EST_STEP_MS = {("ours", "bfloat16"): 5.0, ("ours", "float32"): 20.0}
_EST_STEP_MS |= {("upstream", "bfloat16"): 15.0, ("upstream", "float32"): 45.0}
_EST_SETUP_S = 5.0
_EST_COMPILE_S = 15.0
_EST_COMPILING = {("v2", "bfloat16"), ("v2", "float32"), ("v2-exact", "bfloat16"), ("v2-exact", "float32")}
_EST_COMPILING |= {("upstream", "bfloat16")}
_EST_BUILD_S = 30.0  # our decoder, its float32 copy and upstream's whole model


# ------------------------------------------------------------------------------------------ arguments


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2: no usage block before it
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="bench_fidelity.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--preset", default="auto", help="codec geometry (a v2 codec); auto = v2 on CUDA, tiny-v2 on CPU")
    p.add_argument("--frames", type=int, default=4000, help="frames per stream (4000)")
    p.add_argument("--streams", type=int, default=4, help="streams decoded together, one row each (4)")
    p.add_argument("--marks", default=DEFAULT_MARKS, help=f"window ends in frames ({DEFAULT_MARKS})")
    p.add_argument("--window", type=int, default=43, help="frames per window, ending at each mark (43)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"subset of {','.join(ARMS)} (all)")
    p.add_argument(
        "--reference",
        default="float32",
        choices=("float32", "repeat"),
        help="float32: each arm's float32 run (default); repeat: a second bf16 run of the arm",
    )
    p.add_argument("--n-vq", type=int, default=12, help="codebooks per frame (MOSS-TTS-Local: 12)")
    p.add_argument("--seed", type=int, default=0, help="weights and codes")
    p.add_argument("--out", default="out/bench_fidelity/results.json", help="JSON path; the .md table beside it")
    p.add_argument(
        "--upstream-wheel",
        default=None,
        help="a vllm-omni 0.30.0 wheel: the upstream arm loads its moss_tts files (default: .whl/vllm_omni-0.30.0-*.whl "
        "when those files are not found otherwise)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no arm that would end past this many seconds at the pace so far (its figures then missing)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    if args.budget_s is not None and not (math.isfinite(args.budget_s) and args.budget_s > 0):
        p.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    if args.upstream_wheel is not None and not zipfile.is_zipfile(args.upstream_wheel):
        p.error(f"--upstream-wheel {args.upstream_wheel!r} is not a wheel (zip) file")
    for flag, value, low in (
        ("--frames", args.frames, 1),
        ("--streams", args.streams, 1),
        ("--window", args.window, 1),
    ):
        if value < low:
            p.error(f"{flag} must be >= {low}, got {value}")
    common.check_seed(p, args.seed)
    common.check_at_most(p, "--frames", args.frames, common.MAX_STREAM_FRAMES)
    common.check_at_most(p, "--streams", args.streams, common.MAX_ROWS)
    if args.preset != "auto":
        if args.preset not in PRESETS:
            p.error(f"--preset must be auto or one of {sorted(PRESETS)}, got {args.preset!r}")
        if not preset_config(args.preset).abilities.compact_pool:
            p.error(f"--preset {args.preset!r} is a v1 codec; these arms stream a v2 codec")
    try:
        marks = common.parse_int_list(args.marks)
    except ValueError as exc:
        p.error(f"--marks {args.marks!r}: {exc}")
    if marks != sorted(marks):
        p.error(f"--marks must increase, got {args.marks!r}")
    args.marks = [m for m in marks if m <= args.frames]
    if not args.marks:
        p.error(f"--frames {args.frames} is below every mark of --marks {','.join(map(str, marks))}")
    if args.window > args.marks[0]:
        p.error(f"--window {args.window} is longer than the first mark, {args.marks[0]} frames")
    try:
        args.arms = common.parse_str_list(args.arms, tuple(ARMS))
    except ValueError as exc:
        p.error(f"--arms {args.arms!r}: {exc}")
    args.arms = [a for a in ARMS if a in args.arms]  # run order
    try:
        args.device = common.resolve_device(args.device)
    except RuntimeError:
        p.error("--device cuda: torch.cuda.is_available() is False")
    if args.preset == "auto":
        args.preset = "v2" if args.device.type == "cuda" else "tiny-v2"
    common.check_n_vq(p, args.preset, args.n_vq)
    common.check_output(p, "--out", args.out)
    return args


# ------------------------------------------------------------------------------------------ windows


def frame_energies(
    test: torch.Tensor, reference: torch.Tensor, samples_per_frame: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per frame, the float64 sums of ``(test - reference)**2`` and of ``reference**2``.

    Args:
        test, reference: float32 audio ``(B, channels, frames * samples_per_frame)`` of one arm.
    Returns:
        Two float64 tensors ``(frames,)``: each frame's squared error and squared reference, summed over rows,
        channels and the frame's samples.
    """
    if test.shape != reference.shape:
        raise ValueError(f"audio shapes differ: {tuple(test.shape)} against {tuple(reference.shape)}")
    B, C, S = reference.shape
    if S % samples_per_frame:
        raise ValueError(f"{S} samples per channel are not whole frames of {samples_per_frame}")
    frames = S // samples_per_frame
    err = torch.empty(frames, dtype=torch.float64)
    ref = torch.empty(frames, dtype=torch.float64)
    block = 256  # frames per pass: float64 copies of a v2 block stay near 60 MB per row
    for a in range(0, frames, block):
        b = min(a + block, frames)
        r = reference[..., a * samples_per_frame : b * samples_per_frame].double().view(B, C, b - a, samples_per_frame)
        t = test[..., a * samples_per_frame : b * samples_per_frame].double().view(B, C, b - a, samples_per_frame)
        err[a:b] = (t - r).square().sum(dim=(0, 1, 3))
        ref[a:b] = r.square().sum(dim=(0, 1, 3))
    return err, ref


def _snr_db(rel: float | None) -> float | None:
    return None if rel is None or rel == 0.0 else -20.0 * math.log10(rel)


def _rel(err_sq: float, ref_sq: float) -> float | None:
    """``sqrt(err_sq / ref_sq)``; None for a silent reference or non-finite audio (NaN has no JSON form)."""
    if not (ref_sq > 0 and math.isfinite(err_sq) and math.isfinite(ref_sq)):
        return None
    return math.sqrt(err_sq / ref_sq)


def window_errors(err_sq: torch.Tensor, ref_sq: torch.Tensor, marks: Sequence[int], window: int) -> dict[str, Any]:
    """The figures of every window from :func:`frame_energies`' per-frame sums.

    Returns:
        ``{str(mark): {frames: [m - window, m], rel_error, snr_db, cumulative_rel_error, cumulative_snr_db}}``;
        a relative error is null where the reference is silent.
    """
    out: dict[str, Any] = {}
    for m in marks:
        if not window <= m <= err_sq.numel():
            raise ValueError(f"mark {m} needs {window} <= mark <= {err_sq.numel()} frames")
        rel = _rel(float(err_sq[m - window : m].sum()), float(ref_sq[m - window : m].sum()))
        cum = _rel(float(err_sq[:m].sum()), float(ref_sq[:m].sum()))
        out[str(m)] = {
            "frames": [m - window, m],
            "rel_error": rel,
            "snr_db": _snr_db(rel),
            "cumulative_rel_error": cum,
            "cumulative_snr_db": _snr_db(cum),
        }
    return out


def growth(windows: dict[str, Any]) -> float | None:
    """Last window's ``rel_error`` over the first's (null when the first is 0 or either is null)."""
    first, last = (windows[k]["rel_error"] for k in (next(iter(windows)), list(windows)[-1]))
    if first is None or last is None or first == 0.0:
        return None
    return last / first


def evaluate_targets(arms: dict[str, Any]) -> dict[str, Any]:
    """The targets over the arms with figures (an arm that failed has none).

    Returns:
        ``ours_over_upstream_max`` (each arm of ours: the largest ratio of its ``rel_error`` to upstream's over
        the windows), ``ours_never_above_upstream`` (that ratio at most ``1 + TIE_TOLERANCE``), both null
        without upstream's figures or where an error is null; ``growth_first_to_last`` and
        ``growth_within_bound`` (at most ``GROWTH_BOUND``) per arm; ``growth_bound``, ``tie_tolerance``.
    """
    measured = {name: entry["windows"] for name, entry in arms.items() if "windows" in entry}
    upstream = measured.get("upstream")
    ratio: dict[str, float | None] = {}
    for name, windows in measured.items():
        if name == "upstream":
            continue
        pairs = [] if upstream is None else [(w["rel_error"], upstream[m]["rel_error"]) for m, w in windows.items()]
        if not pairs or any(a is None or not b for a, b in pairs):
            ratio[name] = None
        else:
            ratio[name] = max(a / b for a, b in pairs)
    grown = {name: growth(windows) for name, windows in measured.items()}
    return {
        "ours_over_upstream_max": ratio,
        "ours_never_above_upstream": {n: None if r is None else r <= 1.0 + TIE_TOLERANCE for n, r in ratio.items()},
        "tie_tolerance": TIE_TOLERANCE,
        "growth_first_to_last": grown,
        "growth_bound": GROWTH_BOUND,
        "growth_within_bound": {name: None if g is None else g <= GROWTH_BOUND for name, g in grown.items()},
    }


# ------------------------------------------------------------------------------------------ upstream


def upstream_parameter_names(decoder: CodecDecoder, model: torch.nn.Module) -> dict[str, str]:
    """Our decoder's parameter name -> the parameter of upstream's ``model`` it is loaded into, through the
    official checkpoint names (``checkpoint.official_decoder_names``) and upstream's loader rules.

    Raises:
        RuntimeError: a parameter on either side without exactly one counterpart.
    """
    loader_target_name = common.oracle.loader_target_name
    theirs = dict(model.named_parameters())
    ours = dict(decoder.named_parameters())
    mapping: dict[str, str] = {}
    for name, official in official_decoder_names(decoder.config).items():
        name = name.lstrip("?")  # optional projections (v1): present in ours or not
        if name not in ours:
            continue
        targets = sorted({t for t in (loader_target_name(n, theirs) for n in official) if t in theirs})
        if len(targets) != 1:
            raise RuntimeError(f"{name}: {len(targets)} upstream parameters for official names {official}")
        mapping[name] = targets[0]
    missing = sorted(set(ours) - set(mapping))
    decoder_params = {n for n in theirs if n.startswith("decoder.")}
    unloaded = sorted(decoder_params - set(mapping.values()))
    if missing or unloaded or len(set(mapping.values())) != len(mapping):
        raise RuntimeError(f"weights do not map one to one: ours unmatched {missing[:4]}, upstream {unloaded[:4]}")
    return mapping


@torch.no_grad()
def load_into_upstream(model: torch.nn.Module, decoder: CodecDecoder, n_vq: int, mapping: dict[str, str]) -> None:
    """Give upstream's ``model`` our ``decoder``'s weights: its decoder is cast to our weight dtype, then every
    decoder parameter and the decode table (first ``n_vq`` codebooks, and its bias) are copied from ours."""
    model.decoder.to(decoder.state_dtype)
    theirs = dict(model.named_parameters())
    for name, param in decoder.named_parameters():
        theirs[mapping[name]].copy_(param)
    quantizer = model.quantizer
    quantizer._decode_lut = decoder.lut[:n_vq].detach().clone()
    quantizer._decode_lut_bias = decoder.lut_bias.detach().clone()


class _Float32Torch(types.ModuleType):
    """What upstream's codec module sees as ``torch`` during its float32 run: ``torch`` itself, except that
    ``autocast`` does nothing and ``bfloat16`` is ``float32`` (its rings' and autocast's hard-coded dtype)."""

    bfloat16 = torch.float32

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def autocast(*args, **kwargs):
        return contextlib.nullcontext()


@contextlib.contextmanager
def upstream_float32(module: types.ModuleType) -> Iterator[None]:
    """Upstream's codec ``module`` computes in float32 inside this block (:class:`_Float32Torch`)."""
    previous = module.torch
    module.torch = _Float32Torch()
    try:
        yield
    finally:
        module.torch = previous


def set_upstream_attention(codec, triton: bool) -> int:
    """Upstream's Triton masked attention on every decoder attention module (``triton``), or none (SDPA).
    Returns the number of modules switched on."""
    attention_class = codec.module.MossAudioTokenizerMultiheadAttention
    if triton:
        return upstream_stage.enable_triton_attention(codec.model, attention_class, common.oracle.upstream_dir())
    for module in codec.model.decoder.modules():
        if isinstance(module, attention_class) and hasattr(module, "_streaming_attention"):
            del module._streaming_attention
    return 0


#: Where upstream's codec files sit inside a vllm-omni wheel.
WHEEL_MOSS_TTS = "vllm_omni/model_executor/models/moss_tts/"


def extract_upstream_wheel(wheel: str | Path, dest: str | Path) -> Path:
    """Unzip the ``moss_tts`` files of a vllm-omni wheel into ``dest``; returns their directory (what
    ``MOSS_UPSTREAM_MOSS_TTS_DIR`` names). Raises ValueError for a wheel without them."""
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.startswith(WHEEL_MOSS_TTS)]
        if not members:
            raise ValueError(f"{wheel} holds no {WHEEL_MOSS_TTS} files")
        archive.extractall(dest, members=members)
    return Path(dest) / WHEEL_MOSS_TTS


def _use_upstream_wheel(args) -> None:
    """Point the oracle at ``--upstream-wheel``'s files, or at ``.whl/``'s wheel when none are found."""
    wheel = args.upstream_wheel
    if wheel is None and "upstream" in args.arms and common.oracle.upstream_dir() is None:
        wheel = next(iter(sorted((common.REPO_ROOT / ".whl").glob("vllm_omni-0.30.0-*.whl"))), None)
    if wheel is None:
        return
    directory = extract_upstream_wheel(wheel, tempfile.mkdtemp(prefix="moss_upstream_"))
    os.environ["MOSS_UPSTREAM_MOSS_TTS_DIR"] = str(directory)
    print(f"upstream's files: {directory} (from {wheel})")


# ------------------------------------------------------------------------------------------ streaming


def stream(
    decode: Callable[[list[upstream_stage.StageChunk]], dict[str, torch.Tensor]],
    codes: torch.Tensor,
    samples_per_frame: int,
    label: str,
    quiet: bool,
) -> torch.Tensor:
    """Stream ``codes`` int64 ``(n_vq, B, frames)`` (CPU) as ``B`` requests in chunks of :data:`CHUNKS`, every
    request's chunk in the same ``decode`` call; returns float32 audio ``(B, channels, frames * spf)`` on CPU."""
    B, frames = codes.shape[1], codes.shape[2]
    schedule = chunk_schedule(frames, list(CHUNKS))
    parts: list[list[torch.Tensor]] = [[] for _ in range(B)]
    report = len(schedule) // 4 if len(schedule) >= 100 else 0  # progress of long runs only
    t0 = time.perf_counter()
    for k, (a, b) in enumerate(schedule):
        last = b == frames
        audio = decode([upstream_stage.StageChunk(f"s{i}", codes[:, i, a:b], last) for i in range(B)])
        for i in range(B):
            wav = audio[f"s{i}"]
            if wav.dim() != 2 or wav.shape[-1] != (b - a) * samples_per_frame:
                raise AssertionError(f"{label}: chunk {k} of stream {i} came back as {tuple(wav.shape)}")
            parts[i].append(wav)
        if not quiet and report and (k + 1) % report == 0 and k + 1 < len(schedule):
            print(f"  {label}: {k + 1}/{len(schedule)} chunks, {time.perf_counter() - t0:.1f} s", flush=True)
    return torch.stack([torch.cat(p, dim=-1) for p in parts])


def _session_decode(session: CodecStreamSession):
    def decode(chunks):
        results = session.decode([ChunkRequest(c.request_id, c.codes, c.finished) for c in chunks])
        for rid, result in results.items():
            if result.error is not None or result.queued:
                raise RuntimeError(f"{rid}: the session did not decode the chunk ({result.error or 'queued'})")
        return {rid: result.audio for rid, result in results.items()}

    return decode


def run_ours(spec: ArmSpec, decoder: CodecDecoder, codes: torch.Tensor, args, label: str) -> tuple[torch.Tensor, dict]:
    """One run of one of our arms: (audio, details)."""
    graphs = args.device.type == "cuda"
    t0 = time.perf_counter()
    session = CodecStreamSession(
        decoder,
        StateSpec.from_options(decoder, kind=spec.pool_kind, ring_semantics=spec.ring_semantics),
        SessionOptions(
            codes.shape[1],
            n_vq=args.n_vq,
            graph_frame_totals=tuple(frame_totals(codes.shape[1] * max(CHUNKS))) if graphs else (),
            graph_frame_sizes=tuple(CHUNKS),
            max_step_frames=max(CHUNKS),
        ),
    )
    try:
        setup = time.perf_counter() - t0
        pool = session.pool
        details = {
            "pool_kind": spec.pool_kind,
            "ring_semantics": pool.ring_semantics,
            "attention_backend": pool.attention_backend,
            "state_dtype": str(decoder.state_dtype).removeprefix("torch."),
            "graphs": len(session.runner.graphs) if session.runner is not None else 0,
        }
        t1 = time.perf_counter()
        audio = stream(_session_decode(session), codes, session.samples_per_frame, label, args.quiet)
        details["steps_by_path"] = session.stats()["steps_by_path"]
    finally:
        session.close()
    details |= {"setup_seconds": round(setup, 3), "stream_seconds": round(time.perf_counter() - t1, 3)}
    return audio, details


def run_upstream(codec, codes: torch.Tensor, args, precision: str, label: str) -> tuple[torch.Tensor, dict]:
    """One run of upstream's arm (its weights already in ``precision``): (audio, details)."""
    cuda = args.device.type == "cuda"
    switched = set_upstream_attention(codec, triton=cuda and precision == "bfloat16")
    scope = upstream_float32(codec.module) if precision == "float32" else contextlib.nullcontext()
    with scope:
        t0 = time.perf_counter()
        stage = upstream_stage.UpstreamStage(
            codec.model,
            codes.shape[1],
            graph_batch_sizes=(codes.shape[1],) if cuda else (),
            graph_frame_sizes=CHUNKS,
            n_vq=args.n_vq,
            max_step_frames=max(CHUNKS),
            samples_per_frame=int(codec.config["downsample_rate"]),
        )
        try:
            setup = time.perf_counter() - t0
            ring = next(
                (m._streaming_state.kv_cache.cache for m in codec.model.decoder.modules() if _has_ring(m)), None
            )
            details = {
                "attention": "triton" if switched else "sdpa",
                "state_dtype": None if ring is None else str(ring.dtype).removeprefix("torch."),
                "graphs": len(stage.graphs),
                "graph_failures": {f"{b}x{t}": err for (b, t), err in stage.graph_failures.items()},
            }
            t1 = time.perf_counter()
            audio = stream(stage.decode, codes, stage.samples_per_frame, label, args.quiet)
            details["steps_by_path"] = stage.stats()["steps_by_path"]
        finally:
            stage.close()
    details |= {"setup_seconds": round(setup, 3), "stream_seconds": round(time.perf_counter() - t1, 3)}
    return audio, details


def _has_ring(module: torch.nn.Module) -> bool:
    state = getattr(module, "_streaming_state", None)
    return getattr(state, "kv_cache", None) is not None


# ------------------------------------------------------------------------------------------ estimate


def estimate_seconds(args) -> dict[str, float] | None:
    """Planned seconds per (arm, precision) run and in all, for the v2 geometry on CUDA (None otherwise)."""
    if args.device.type != "cuda" or args.preset != "v2":
        return None
    steps = len(chunk_schedule(args.frames, list(CHUNKS)))
    precisions = ("bfloat16", "bfloat16") if args.reference == "repeat" else ("bfloat16", "float32")
    runs: dict[str, float] = {}
    for arm in args.arms:
        family = "upstream" if arm == "upstream" else "ours"
        for i, precision in enumerate(precisions):
            compile_s = _EST_COMPILE_S if i == 0 or args.reference == "float32" else 0.0
            compile_s *= (arm, precision) in _EST_COMPILING
            runs[f"{arm}/{i}"] = _EST_SETUP_S + compile_s + steps * _EST_STEP_MS[(family, precision)] / 1e3
    return {"runs": runs, "total": _EST_BUILD_S + sum(runs.values())}


# ------------------------------------------------------------------------------------------ report


def _fmt_err(w: dict[str, Any]) -> str:
    rel, snr = w["rel_error"], w["snr_db"]
    if rel is None:
        return "-"
    return f"{rel:.2e} ({'exact' if snr is None else f'{snr:.1f} dB'})"


def results_markdown(result: dict[str, Any]) -> str:
    run, arms, targets = result["run"], result["arms"], result["targets"]
    reference = (
        "a float32 run of the same arm" if run["reference"] == "float32" else "a second bf16 run of the same arm"
    )
    marks = [str(m) for m in run["marks"]]
    lines = [
        f"# Fidelity over long streams: {run['preset']} on {run['device_name']}",
        "",
        f"Commit `{run['commit']}`, {run['date']}. Command: `{run['command']}`.",
        "",
        f"{run['streams']} streams x {run['frames']} frames of uniform random codes (n_vq {run['n_vq']}), chunks "
        f"{run['chunks'][0]} then {run['chunks'][1]}; bf16 audio against {reference}. Relative error "
        f"||bf16 - ref|| / ||ref|| (SNR) over the {run['window_frames']} frames ending at each mark.",
        "",
        "| arm | "
        + " | ".join(f"frames {int(m) - run['window_frames']}-{m}" for m in marks)
        + " | growth last/first |",
        "|---|" + "---|" * (len(marks) + 1),
    ]
    for name, entry in arms.items():
        if "windows" not in entry:
            lines.append(
                f"| {name} | "
                + " | ".join("-" for _ in marks)
                + f" | failed: {entry['error'][:80].replace('|', '/')} |"
            )
            continue
        g = targets["growth_first_to_last"].get(name)
        cells = [_fmt_err(entry["windows"][m]) for m in marks]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'-' if g is None else f'{g:.2f}x'} |")
    lines += [
        "",
        f"Targets (growth bound {targets['growth_bound']:g}x; above upstream = more than "
        f"{1 + targets['tie_tolerance']:g}x its error):",
    ]
    for name, ok in targets["ours_never_above_upstream"].items():
        ratio = targets["ours_over_upstream_max"][name]
        verdict = (
            "undefined (no upstream figures, or an upstream error of 0)" if ok is None else ("yes" if ok else "NO")
        )
        if ratio is not None:
            verdict += f" (at most {ratio:.3f}x upstream's error)"
        lines.append(f"- {name} never above upstream in any window: {verdict}")
    for name, ok in targets["growth_within_bound"].items():
        g = targets["growth_first_to_last"][name]
        verdict = "undefined" if ok is None else (f"{g:.2f}x, " + ("within the bound" if ok else "ABOVE the bound"))
        lines.append(f"- {name} growth from the first window to the last: {verdict}")
    up = targets["growth_first_to_last"].get("upstream")
    ours = [g for n, g in targets["growth_first_to_last"].items() if n != "upstream" and g is not None]
    if up is not None and ours and up > max(ours):
        lines.append(f"- upstream's error grows more than any of ours: {up:.2f}x against at most {max(ours):.2f}x")
    agreement = result["details"].get("fp32_vs_legacy", {})
    if agreement:
        lines += [
            "",
            "Float32 runs against legacy's float32 run (frames before the last chunk): "
            + ", ".join(f"{name} {'-' if rel is None else f'{rel:.1e}'}" for name, rel in agreement.items()),
        ]
    for name, reason in run["skipped"].items():
        lines += ["", f"Skipped arm `{name}`: {reason}"]
    return "\n".join(lines) + "\n"


def _run_block(args, command: str, skipped: dict[str, str], estimate) -> dict[str, Any]:
    extra = {
        "device": str(args.device),
        "frames": args.frames,
        "streams": args.streams,
        "chunks": list(CHUNKS),
        "marks": args.marks,
        "window_frames": args.window,
        "arms": args.arms,
        "reference": args.reference,
        "n_vq": args.n_vq,
        "seed": args.seed,
        "cuda_graphs": args.device.type == "cuda",
        "graph_frame_totals": frame_totals(args.streams * max(CHUNKS)) if args.device.type == "cuda" else [],
        "graph_frame_sizes": list(CHUNKS),
        "tf32": False if args.device.type == "cuda" else None,
        "estimated_seconds": None if estimate is None else round(estimate["total"], 1),
        "upstream_files": None if common.oracle.upstream_dir() is None else str(common.oracle.upstream_dir()),
        "skipped": skipped,
    }
    if args.device.type == "cuda":
        return common.run_block(args.preset, **extra) | {"command": command}
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": common.git_commit(),
        "command": command,
        "device_name": "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        **extra,
    }


# ------------------------------------------------------------------------------------------ driver


@dataclass
class Inputs:
    """What every arm streams: our decoders by precision (the bf16 one served: on CUDA its LayerScale folded into
    the projections), the weights upstream loads by precision (as drawn, unfolded), the codes, and upstream's
    model once built."""

    decoders: dict[str, CodecDecoder]
    upstream_weights: dict[str, CodecDecoder]
    codes: torch.Tensor  # (n_vq, streams, frames) int64, CPU
    codec: Any = None  # common.UpstreamCodecArm with our weights, built for the first upstream run
    mapping: dict[str, str] | None = None


def run_arm(name: str, inputs: Inputs, args, clock) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Both runs of one arm: (its ``arms.<name>`` entry so far, ``{"runs": {precision: details}}``, and the two
    runs' float32 audio ``[test, reference]``, each ``(streams, channels, frames * spf)`` on CPU)."""
    spec = ARMS[name]
    if spec.pool_kind is None and inputs.codec is None:
        inputs.codec = common.build_upstream_codec(args.preset, args.device, args.seed, args.n_vq)
        inputs.mapping = upstream_parameter_names(inputs.upstream_weights["bfloat16"], inputs.codec.model)
    precisions = ["bfloat16", "bfloat16"] if args.reference == "repeat" else ["bfloat16", "float32"]
    audios, runs = [], {}
    for i, precision in enumerate(precisions):
        key = "repeat" if i and args.reference == "repeat" else precision
        label = f"{name} {key}"
        if spec.pool_kind is None:
            load_into_upstream(inputs.codec.model, inputs.upstream_weights[precision], args.n_vq, inputs.mapping)
            audio, details = run_upstream(inputs.codec, inputs.codes, args, precision, label)
        else:
            audio, details = run_ours(spec, inputs.decoders[precision], inputs.codes, args, label)
        details["nonfinite_samples"] = int((~torch.isfinite(audio)).sum())
        audios.append(audio)
        runs[key] = details
        common.free_memory(args.device)
        clock.done(f"{name}/{i}", label, details)
    return {"runs": runs}, audios


class Clock:
    """Progress lines after each run: time so far and, with an estimate, the time left at the pace so far."""

    def __init__(self, estimate: dict[str, Any] | None, quiet: bool):
        self.start = time.perf_counter()
        self.estimate = estimate
        self.quiet = quiet
        self.planned = _EST_BUILD_S  # planned seconds of the work done so far

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def projected(self, arm: str, arm_seconds: list[float]) -> float | None:
        """Seconds ``arm``'s two runs should take: its planned figure at the pace so far (with an estimate),
        else the mean of the arms measured so far (None before the first)."""
        if self.estimate is not None:
            planned = sum(v for k, v in self.estimate["runs"].items() if k.split("/")[0] == arm)
            return planned * self.elapsed() / self.planned
        return sum(arm_seconds) / len(arm_seconds) if arm_seconds else None

    def done(self, key: str, label: str, details: dict[str, Any]) -> None:
        if self.estimate is not None:
            self.planned += self.estimate["runs"].get(key, 0.0)
        if self.quiet:
            return
        steps = details["steps_by_path"]
        line = (
            f"{label}: setup {details['setup_seconds']:.1f} s, streaming {details['stream_seconds']:.1f} s, "
            f"steps graph/eager {steps['graph']}/{steps['eager']}; {self.elapsed():.0f} s so far"
        )
        if self.estimate is not None:
            left = (self.estimate["total"] - self.planned) * self.elapsed() / self.planned
            line += f", about {left:.0f} s left"
        print(line, flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    command = shlex.join(
        [sys.executable, "benchmarks/tts/bench_fidelity.py", *(sys.argv[1:] if argv is None else argv)]
    )
    args = _parse(argv)
    device = args.device
    skipped: dict[str, str] = {}
    try:
        _use_upstream_wheel(args)
    except ValueError as exc:
        print(f"bench_fidelity.py: error: --upstream-wheel: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if "upstream" in args.arms:
        ok, reason = common.upstream_status(args.preset, device)
        directory = common.oracle.upstream_dir()
        if ok and device.type == "cuda" and not (directory / "streaming_attention.py").is_file():
            ok, reason = False, f"{directory}/streaming_attention.py (upstream's Triton attention) not found"
        if not ok:
            skipped["upstream"] = reason
            print(f"skipped arm upstream: {reason}")
    args.arms = [a for a in args.arms if a not in skipped]
    if not args.arms:
        print(f"bench_fidelity.py: error: no arm left to run (upstream: {skipped['upstream']})", file=sys.stderr)
        raise SystemExit(2)
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny kernels: a second intra-op thread only adds contention
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    out = Path(args.out)
    estimate = estimate_seconds(args)
    cfg = preset_config(args.preset)
    calls = len(chunk_schedule(args.frames, list(CHUNKS)))
    print(
        f"{args.preset} on {device}: {len(args.arms)} arms x 2 runs of {args.streams} streams x {args.frames} "
        f"frames ({calls} decode calls each)"
        + ("" if estimate is None else f"; planned {estimate['total']:.0f} s in all"),
        flush=True,
    )
    result: dict[str, Any] = {
        "run": _run_block(args, command, skipped, estimate),
        "arms": {},
        "targets": evaluate_targets({}),
        "details": {"fp32_vs_legacy": {}},
    }
    clock = Clock(estimate, args.quiet)
    # One model for every arm: bf16 values as drawn. The float32 runs hold them cast up exactly; ours in bf16 is
    # that float32 copy served (on CUDA: LayerScale folded in float32, then one rounding to bf16).
    drawn = common.random_weights(args.preset, device, seed=args.seed).to(torch.bfloat16)
    fp32 = copy.deepcopy(drawn).to(torch.float32)
    bf16 = copy.deepcopy(fp32).to_serving(device) if device.type == "cuda" else drawn
    codes = common.random_codes(
        1, args.n_vq, args.streams, args.frames, cfg.codebook_size, torch.device("cpu"), args.seed
    )
    inputs = Inputs({"bfloat16": bf16, "float32": fp32}, {"bfloat16": drawn, "float32": fp32}, codes[0])
    keep_fp32 = args.reference == "float32" and "legacy" in args.arms
    fp32_audio: dict[str, torch.Tensor] = {}
    arm_seconds: list[float] = []
    for name in args.arms:
        projected = clock.projected(name, arm_seconds)
        if args.budget_s is not None and projected is not None and clock.elapsed() + projected > args.budget_s:
            reason = (
                f"--budget-s {args.budget_s:g}: {clock.elapsed():.0f} s spent and this arm would take about "
                f"{projected:.0f} s more"
            )
            print(f"skipped arm {name}: {reason}", flush=True)
            result["run"]["skipped"][name] = reason
            continue
        t_arm = clock.elapsed()
        try:
            entry, audios = run_arm(name, inputs, args, clock)
        except Exception as exc:  # noqa: BLE001 - one arm's failure must not lose the others' figures
            message = f"{type(exc).__name__}: {exc}"[:500]
            print(f"{name}: FAILED: {message}", flush=True)
            result["arms"][name] = {"error": message}
            common.free_memory(device)
            continue
        arm_seconds.append(clock.elapsed() - t_arm)
        err_sq, ref_sq = frame_energies(audios[0], audios[1], cfg.samples_per_frame)
        entry["windows"] = window_errors(err_sq, ref_sq, args.marks, args.window)
        result["arms"][name] = entry
        if keep_fp32 and name in (*UPSTREAM_SEMANTICS_ARMS, "legacy"):
            fp32_audio[name] = audios[1]
        del audios
        _agreement(result, fp32_audio, args.frames, cfg.samples_per_frame)
        result["targets"] = evaluate_targets(result["arms"])
        result["run"]["wall_seconds"] = round(clock.elapsed(), 1)
        common.write_json(out, result)
    result["run"]["wall_seconds"] = round(clock.elapsed(), 1)
    common.write_json(out, result)
    md = results_markdown(result)
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out} and {out.with_suffix('.md')} in {clock.elapsed():.1f} s")
    return result


def _agreement(result: dict[str, Any], fp32_audio: dict[str, torch.Tensor], frames: int, spf: int) -> None:
    """``details.fp32_vs_legacy``: each upstream-semantics arm's float32 audio against legacy's, relative error
    over the frames before the last chunk (upstream pads its tail chunk and the padding writes the rings)."""
    legacy = fp32_audio.get("legacy")
    if legacy is None:
        return
    last_start = chunk_schedule(frames, list(CHUNKS))[-1][0]
    if last_start == 0:
        return
    for name in UPSTREAM_SEMANTICS_ARMS:
        if name in fp32_audio:
            err_sq, ref_sq = frame_energies(
                fp32_audio[name][..., : last_start * spf], legacy[..., : last_start * spf], spf
            )
            result["details"]["fp32_vs_legacy"][name] = _rel(float(err_sq.sum()), float(ref_sq.sum()))


if __name__ == "__main__":
    main()
