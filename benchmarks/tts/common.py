# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the codec benchmarks: devices, random weights, the upstream arm, stats, output.

Units used throughout: bytes are exact integers (``*_bytes``), times are milliseconds (``*_ms``) unless a
name says seconds (``*_s``); GiB = 2**30 bytes and appears only in printed tables.

The upstream arm is vLLM-Omni 0.30.0's own v2 codec module, loaded by file path through
:mod:`vllm_omni_moss.testing.upstream` so that vLLM itself is never imported. Set
``MOSS_UPSTREAM_MOSS_TTS_DIR`` to an unzipped copy of the wheel's ``moss_tts`` directory where vllm-omni is
not installed.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30

if str(REPO_ROOT) not in sys.path:  # scripts run as files: make the package importable without installing
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS, preset_config  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.decoder import CodecDecoder  # noqa: E402
from vllm_omni_moss.testing import upstream as oracle  # noqa: E402
from vllm_omni_moss.testing.weights import fill_random_weights_  # noqa: E402

__all__ = [
    "GIB",
    "UpstreamCodecArm",
    "build_upstream_codec",
    "cuda_memory",
    "free_memory",
    "gib",
    "git_commit",
    "graph_launch_ms",
    "int_list_flag",
    "markdown_table",
    "module_bytes",
    "parse_int_list",
    "parse_str_list",
    "random_codes",
    "random_decoder",
    "random_weights",
    "pool_kind",
    "resolve_device",
    "run_block",
    "str_list_flag",
    "summarize_ms",
    "upstream_state_bytes",
    "upstream_status",
    "write_json",
]


# ------------------------------------------------------------------------------------------ parsing


def parse_int(text: str) -> int:
    """``" 15"`` -> ``15``: an optional sign and ASCII digits (``int`` alone also takes ``"1_5"`` and other
    scripts' digits, which a flag should refuse).

    Raises:
        ValueError: anything else, naming it.
    """
    digits = text.strip().removeprefix("-").removeprefix("+")
    if not (digits.isascii() and digits.isdigit()):
        raise ValueError(f"{text.strip()!r} is not an integer")
    return int(text)


def parse_int_list(text: str) -> list[int]:
    """``"1,8,64"`` -> ``[1, 8, 64]`` (positive integers, order kept, duplicates dropped).

    Raises:
        ValueError: an empty item (``"4,,8"``, ``"4,"``), a non-integer or a value below 1.
    """
    values: list[int] = []
    for part in text.split(","):
        if not part.strip():
            raise ValueError(f"empty item in {text!r}")
        value = parse_int(part)
        if value < 1:
            raise ValueError(f"expected positive integers, got {value} in {text!r}")
        if value not in values:
            values.append(value)
    return values


def parse_str_list(text: str, allowed: Sequence[str]) -> list[str]:
    """``"eager,graph"`` -> ``["eager", "graph"]``, each checked against ``allowed`` (no empty item)."""
    values = [p.strip() for p in text.split(",")]
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"{', '.join(repr(v) for v in bad)} not in {list(allowed)}")
    return list(dict.fromkeys(values))


def int_list_flag(parser, flag: str, text: str) -> list[int]:
    """:func:`parse_int_list` of a flag's value; a bad value is a usage error (``parser.error``, exit 2)
    naming the flag and the value."""
    try:
        return parse_int_list(text)
    except ValueError as exc:
        parser.error(f"{flag} {text!r}: {exc}")


#: Bounds of the benchmarks' size flags: past them a value is a typo, refused (exit 2) before any allocation.
MAX_ROWS = 65536  # streams, slots, batch rows (64 Ki v2 slots are 5.4 TiB of rings)
MAX_STREAM_FRAMES = 45_000  # frames of one stream: an hour of audio at 12.5 frames/s
MAX_STEP_FRAMES = 4096  # frames of one step or chunk (5.5 minutes of audio)
MAX_SEED = 2**63 - 1  # torch.manual_seed and numpy take 64-bit seeds


def check_at_most(parser, flag: str, values, maximum: int) -> None:
    """A usage error (exit 2) naming ``flag``, the first value above ``maximum`` and the bound."""
    for value in values if isinstance(values, (list, tuple)) else [values]:
        if value is not None and value > maximum:
            parser.error(f"{flag} {value}: at most {maximum}")


def step_shape_flags(parser, batch: str, frames: str) -> tuple[list[int], list[int]]:
    """``--batch`` and ``--frames`` of a step benchmark: each parsed (:func:`int_list_flag`) and bounded
    (:data:`MAX_ROWS` rows, :data:`MAX_STEP_FRAMES` frames; :func:`check_at_most`), usage errors as those give."""
    batches = int_list_flag(parser, "--batch", batch)
    frame_counts = int_list_flag(parser, "--frames", frames)
    check_at_most(parser, "--batch", batches, MAX_ROWS)
    check_at_most(parser, "--frames", frame_counts, MAX_STEP_FRAMES)
    return batches, frame_counts


def check_n_vq(parser, preset: str, n_vq: int) -> None:
    """A usage error (exit 2) unless ``n_vq`` is in ``1..`` the codebooks of ``preset``."""
    codebooks = preset_config(preset).num_quantizers
    if not 1 <= n_vq <= codebooks:
        parser.error(f"--n-vq must be in 1..{codebooks} for preset {preset!r}, got {n_vq}")


def check_seed(parser, seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        parser.error(f"--seed must be in 0..{MAX_SEED}, got {seed}")


def str_list_flag(parser, flag: str, text: str, allowed: Sequence[str]) -> list[str]:
    """:func:`parse_str_list` of a flag's value; a bad value is a usage error (exit 2) naming the flag and value."""
    try:
        return parse_str_list(text, allowed)
    except ValueError as exc:
        parser.error(f"{flag} {text!r}: {exc}")


# ------------------------------------------------------------------------------------------ devices


def git_commit() -> str | None:
    """``$MOSS_BENCH_COMMIT`` when set (a copy of the tree whose ``.git``, if any, may be stale), else
    ``git rev-parse --short HEAD`` of the repository."""
    if os.environ.get("MOSS_BENCH_COMMIT"):
        return os.environ["MOSS_BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is not None and out.returncode == 0 and out.stdout.strip():
        return out.stdout.strip()
    return None


def run_block(preset: str, **extra: Any) -> dict[str, Any]:
    """The ``run`` block of a CUDA script's JSON: UTC date, commit (:func:`git_commit`), this process's
    command line, device name, torch version, preset, then ``extra``."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "device_name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "preset": preset,
        **extra,
    }


def graph_launch_ms(fn, launches: int, replays: int = 5) -> float:
    """Median milliseconds of one launch of ``fn`` on the current CUDA device: ``fn`` runs once, then
    ``launches`` calls are captured in one CUDA graph, replayed once untimed and ``replays`` times timed
    with CUDA events; each replay's time is divided by ``launches``."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / launches)
    return statistics.median(times)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cpu`` / ``cuda`` as given (``cuda`` must exist)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch.cuda.is_available() is False")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; expected auto, cpu or cuda")
    return device


def free_memory(device: torch.device | None = None) -> None:
    """Collect garbage and, on CUDA, return cached blocks to the driver (after a synchronize)."""
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def cuda_memory(device: torch.device) -> dict[str, int]:
    """Bytes on one CUDA device now: ``allocated`` / ``reserved`` by this process's caching allocator
    and ``device_used`` = total - free as the driver reports it (all processes and contexts)."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {
        "allocated": int(torch.cuda.memory_allocated(device)),
        "reserved": int(torch.cuda.memory_reserved(device)),
        "device_used": int(total - free),
    }


def memory_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """``{allocated,reserved,device_used}_delta_bytes`` between two :func:`cuda_memory` readings."""
    return {f"{key}_delta_bytes": int(after[key] - before[key]) for key in before}


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (each storage counted once; works on meta)."""
    seen: set[int] = set()
    total = 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor is None:
            continue
        key = id(tensor)
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return int(total)


# ------------------------------------------------------------------------------------------ our decoder


def _serving_dtype(device: torch.device) -> torch.dtype:
    # The serving policy of CodecDecoder.to_serving: bf16 on accelerators, fp32 elsewhere; meta stands for
    # a GPU in byte accounting, so it gets bf16.
    return torch.bfloat16 if device.type in ("cuda", "meta") else torch.float32


@torch.no_grad()
def random_weights(preset: str, device: torch.device | str, seed: int = 0) -> CodecDecoder:
    """A :class:`CodecDecoder` of a built-in preset with small random weights, as a checkpoint holds them
    (LayerScale not folded, not yet :meth:`~CodecDecoder.to_serving`).

    The module is built on the meta device (no initialisation work), materialised directly in the serving
    dtype (bf16 on CUDA and meta, fp32 on CPU) and filled in place from a generator on ``device``:
    matrices ``N(0, 1/fan_in)``, LayerNorm weights ``N(1, 0.1)``, every other vector ``N(0, 0.1)``, decode
    table ``N(0, 1/num_quantizers)``. On ``meta`` nothing is allocated or filled (byte accounting only).
    Values are for timing and memory only; they are not a trained codec.
    """
    device = torch.device(device)
    with torch.device("meta"):
        decoder = CodecDecoder(preset_config(preset))
    decoder = decoder.to(_serving_dtype(device))
    if device.type == "meta":
        return decoder.eval()
    return fill_random_weights_(decoder.to_empty(device=device), seed).eval()


def random_decoder(preset: str, device: torch.device | str, seed: int = 0) -> CodecDecoder:
    """:func:`random_weights` ready to serve (:meth:`~CodecDecoder.to_serving`; on ``meta`` as drawn)."""
    decoder = random_weights(preset, device, seed)
    return decoder if torch.device(device).type == "meta" else decoder.to_serving(device)


def random_codes(
    num_sets: int, n_vq: int, batch: int, frames: int, codebook_size: int, device: torch.device, seed: int
) -> list[torch.Tensor]:
    """``num_sets`` int64 code tensors ``(n_vq, batch, frames)`` drawn from ``[1, codebook_size)``.

    Zero is excluded on purpose: an all-zero input can hide unwritten outputs and time differently.
    """
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    return [
        torch.randint(1, codebook_size, (n_vq, batch, frames), generator=gen, dtype=torch.long).to(device)
        for _ in range(num_sets)
    ]


# ------------------------------------------------------------------------------------------ our pools


def pool_kind(arm: str) -> str:
    """Pool kind of one of our benchmark arms: ``"v2"`` -> ``"compact"`` (the V2 pool), ``"legacy"`` -> legacy,
    ``"v2-paged"`` -> ``"paged"``."""
    kinds = {"v2": "compact", "legacy": "legacy", "v2-paged": "paged"}
    if arm not in kinds:
        raise ValueError(f"no pool of ours is called {arm!r}; expected one of {sorted(kinds)}")
    return kinds[arm]


# ------------------------------------------------------------------------------------------ upstream


def upstream_status(preset: str, device: torch.device) -> tuple[bool, str]:
    """Whether the upstream arm can run for ``preset`` on ``device``, and why not when it cannot."""
    if PRESETS[preset]["number_channels"] < 2:
        return False, f"preset {preset!r} is a v1 codec; the upstream arm drives upstream's v2 codec module"
    if not oracle.upstream_available():
        return False, (
            f"vllm-omni {oracle.UPSTREAM_VERSION} moss_tts files or transformers not found "
            "(install the wheel with --no-deps or set MOSS_UPSTREAM_MOSS_TTS_DIR)"
        )
    return True, ""


@dataclass
class UpstreamCodecArm:
    """Upstream 0.30.0's whole v2 codec model (encoder, quantizer, decoder) placed as upstream serves it.

    Attributes: ``model`` (``MossAudioTokenizerModel``), ``module`` (the loaded upstream file),
    ``config`` (official config dict), ``decoder_bytes`` (decoder parameter bytes), ``total_bytes``
    (all parameters and buffers, encoder included, decode table included).
    """

    model: torch.nn.Module
    module: types.ModuleType
    config: dict[str, Any]
    decoder_bytes: int
    total_bytes: int

    def open_pool(self, state_capacity: int, scratch_capacity: int) -> None:
        """``initialize_decoder_state_pool(state_capacity, scratch_capacity)`` (one pool per model)."""
        with torch.no_grad():
            self.model.initialize_decoder_state_pool(int(state_capacity), int(scratch_capacity))

    def close_pool(self) -> None:
        self.model.close_decoder_state_pool()

    def step(self, codes, lengths, slot_ids, valid_rows):
        """One ``decode_streaming_tensors`` call: codes ``(n_vq, B, T)`` -> (audio, audio_lengths)."""
        with torch.no_grad():
            return self.model.decode_streaming_tensors(codes, lengths, slot_ids, valid_rows)


def build_upstream_codec(preset: str, device: torch.device, seed: int, n_vq: int) -> UpstreamCodecArm:
    """Build upstream's v2 codec from the preset's official config dict, as upstream's stage places it.

    Weights are the module's own random initialisation under ``torch.manual_seed(seed)`` (timing and
    memory only), built directly on ``device`` in fp32. On CUDA the decoder is then cast to bf16 and the
    decode table built in bf16 for ``n_vq`` codebooks, as vLLM-Omni 0.30.0's codec stage does; on CPU
    everything stays fp32.
    """
    import copy

    module = oracle.load_upstream_module("audio_tokenizer_v2")
    config_cls = oracle.load_upstream_module("configuration_moss_audio_tokenizer_v2").MossAudioTokenizerConfig
    raw = copy.deepcopy(PRESETS[preset])
    previous = torch.get_default_dtype()
    torch.manual_seed(int(seed))
    try:
        torch.set_default_dtype(torch.float32)
        with torch.device(device):
            model = module.MossAudioTokenizerModel(config_cls(**copy.deepcopy(raw)))
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    if device.type == "cuda":
        model.decoder.to(dtype=torch.bfloat16)
    build_lut = getattr(model.quantizer, "build_decode_lut", None)
    if callable(build_lut):
        build_lut(int(n_vq), dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    decoder_bytes = sum(p.numel() * p.element_size() for p in model.decoder.parameters())
    return UpstreamCodecArm(model, module, raw, int(decoder_bytes), module_bytes(model))


def upstream_state_bytes(model: torch.nn.Module) -> int:
    """Bytes of upstream's persistent streaming state: every tensor reachable from a module's
    ``_streaming_state`` (and its ring cache), the central offset bank and the shared exec mask.
    Views of one storage (upstream's offsets are rows of one bank) are counted once."""
    tensors: list[torch.Tensor] = []

    def collect(obj: Any) -> None:
        for value in vars(obj).values():
            if isinstance(value, torch.Tensor):
                tensors.append(value)

    for sub in model.modules():
        state = getattr(sub, "_streaming_state", None)
        if state is None:
            continue
        collect(state)
        kv = getattr(state, "kv_cache", None)
        if kv is not None:
            collect(kv)
    for name in ("_decoder_slot_offsets", "_streaming_exec_mask"):
        value = getattr(model, name, None)
        if isinstance(value, torch.Tensor):
            tensors.append(value)
    seen: set[tuple[str, int]] = set()
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return int(total)


# ------------------------------------------------------------------------------------------ stats/output


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    # Linear interpolation between closest ranks (numpy's default), on an already sorted list.
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))


def summarize_ms(samples_ms: Iterable[float]) -> dict[str, Any]:
    """Median, p10/p25/p75/p90, min/max of step times in ms, plus the raw samples."""
    raw = [float(v) for v in samples_ms]
    values = sorted(raw)
    if not values:
        raise ValueError("no samples")
    return {
        "median_ms": float(statistics.median(values)),
        "p10_ms": _quantile(values, 0.10),
        "p25_ms": _quantile(values, 0.25),
        "p75_ms": _quantile(values, 0.75),
        "p90_ms": _quantile(values, 0.90),
        "min_ms": values[0],
        "max_ms": values[-1],
        "n": len(values),
        "samples_ms": [round(v, 4) for v in raw],
    }


def gib(num_bytes: int | float) -> float:
    return float(num_bytes) / GIB


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table (cells converted with ``str``)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def check_output(parser, flag: str, path: str | Path | None) -> None:
    """Make sure an output file can be written before any work: creates its directory and writes a probe
    file there (removed again). A usage error (exit 2) naming ``flag`` and ``path`` otherwise."""
    if not path:
        return
    target = Path(path)
    if target.is_dir():
        parser.error(f"{flag} {str(path)!r}: is a directory, not a file")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target.parent):
            pass
    except OSError as exc:
        parser.error(f"{flag} {str(path)!r}: cannot write there ({exc.strerror or exc})")


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON (atomically: a reader never sees half a file)."""
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    tmp.replace(target)
