# SPDX-License-Identifier: Apache-2.0
"""``vllm-omni-moss``: make random official-format checkpoints and stream codes to a WAV file.

Examples (after ``bash scripts/install.sh``; or activate ``.venv`` and drop the prefix)::

    .venv/bin/vllm-omni-moss make-checkpoint --preset tiny-v2 /tmp/codec
    .venv/bin/vllm-omni-moss decode codes.npy -o out.wav --checkpoint /tmp/codec --chunks 1,15

Codes are integers of shape ``(n_vq, T)``: MOSS-TTS-Local emits ``n_vq = 12`` codebooks of
the v2 codec, each code in ``[0, 1024)``; ``T`` frames give ``T x 3840`` samples per channel.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]


class CliError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


#: Seeds ``--seed`` accepts: ``[0, SEED_LIMIT)`` (``torch.Generator.manual_seed`` takes 64-bit seeds).
SEED_LIMIT = 2**63
_INT64_MAX = 2**63 - 1


def _seed(text: str) -> int:
    """argparse type of ``--seed``: an integer in ``[0, 2**63)``."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63), got {text!r}")
    return value


def _load_codes(path: Path):
    """``(n_vq, T)`` int64 codes from a ``.pt``/``.pth`` tensor or (any other suffix) a ``.npy`` array.

    Arrays of any byte order are read (big-endian ones converted to native order).

    Returns:
        ``(codes, too_large)``: the codes as int64, and the largest code when it does not
        fit int64 (an unsigned 64-bit code >= 2**63; the caller reports it against the
        codebook range), else None.
    Raises:
        CliError: one line naming the file when it is missing, unreadable, not an
            integer array, not 2-D, or empty.
    """
    import numpy as np
    import torch

    from .checks import is_integer_dtype

    if not path.is_file():
        raise CliError(f"codes file not found: {path}")
    if path.suffix.lower() in (".pt", ".pth"):
        kind = ".pt tensor"
        try:
            codes = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # torch raises many types (and long multi-line messages) for foreign files
            codes = None
    else:
        kind = ".npy array"
        try:
            array = np.load(path, allow_pickle=False)
            if isinstance(array, np.ndarray) and not array.dtype.isnative:
                array = array.astype(array.dtype.newbyteorder("="))
            codes = torch.from_numpy(np.ascontiguousarray(array)) if isinstance(array, np.ndarray) else None
        except Exception:  # numpy's messages advise allow_pickle, which a codes file never needs
            codes = None
    if not isinstance(codes, torch.Tensor):
        raise CliError(f"{path} is not a valid {kind} of integer codes (expected shape (n_vq, T))")
    if codes.dim() != 2:
        raise CliError(f"{path}: codes must have shape (n_vq, T), got {tuple(codes.shape)}")
    if not is_integer_dtype(codes.dtype):
        raise CliError(f"{path}: codes must be integers, got dtype {codes.dtype}")
    if codes.shape[1] == 0:
        raise CliError(f"{path}: codes have no frames (T = 0)")
    too_large = None
    if codes.dtype == torch.uint64 and codes.numel():
        largest = int(codes.numpy().max())
        if largest > _INT64_MAX:
            too_large = largest
            codes = torch.zeros(codes.shape, dtype=torch.long)  # never decoded: the caller refuses the file
    return codes.long(), too_large


def _parse_chunks(text: str) -> list[int]:
    try:
        chunks = [int(part) for part in text.split(",")]  # an empty item ("1,,15") is refused, not skipped
    except ValueError as exc:
        raise CliError(f"--chunks must be comma-separated positive integers, got {text!r}") from exc
    if not chunks or min(chunks) < 1:
        raise CliError(f"--chunks must be comma-separated positive integers, got {text!r}")
    return chunks


def _check_preset(name: str, presets) -> None:
    if name not in presets:
        raise CliError(f"unknown preset {name!r}; choose from {', '.join(sorted(presets))}")


def _parse_device(text: str | None):
    import torch

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as exc:
        raise CliError(f"--device {text!r} is not a torch device (use cpu, cuda or cuda:N)") from exc
    if device.type not in ("cpu", "cuda"):
        raise CliError(f"--device {text!r}: only cpu and cuda devices decode")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {text!r}: this torch build or machine has no CUDA device")
    return device


def _open_wav(path: Path, sample_rate: int, channels: int):
    """Open the output before decoding, so a bad path fails fast instead of after the work."""
    import soundfile

    if path.suffix.lower() != ".wav":
        raise CliError(f"output {path} must end in .wav")
    if path.is_dir():
        raise CliError(f"output {path} is a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return soundfile.SoundFile(str(path), "w", sample_rate, channels, subtype="FLOAT", format="WAV")
    except (OSError, RuntimeError, soundfile.LibsndfileError) as exc:
        raise CliError(f"cannot write {path}: {exc}") from exc


def _format_bytes(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _cmd_make_checkpoint(args) -> int:
    from tqdm import tqdm

    from .checkpoint import checkpoint_files, random_checkpoint_bytes, save_random_checkpoint
    from .config import PRESETS, preset_config

    _check_preset(args.preset, PRESETS)
    if not args.directory.strip():
        raise CliError("make-checkpoint needs a directory to write, got an empty path")
    directory = Path(args.directory)
    existing = checkpoint_files(directory)
    if existing and not args.force:
        raise CliError(f"{directory} already holds a checkpoint ({existing[0].name}, ...); pass --force to replace it")
    config = preset_config(args.preset)
    total = random_checkpoint_bytes(config)
    print(
        f"writing a random {args.preset} checkpoint (seed {args.seed}) to {directory}: "
        f"{total:,} bytes ({_format_bytes(total)}) of fp32 tensors"
    )
    staging = None
    try:
        # Written into a scratch directory beside the target and swapped in only once complete,
        # so a failed or interrupted run leaves an existing checkpoint as it was.
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".partial", dir=directory.parent))
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="make-checkpoint") as bar:
            save_random_checkpoint(config, staging, seed=args.seed, progress=bar.update)
        _swap_in(staging, directory)
    except OSError as exc:
        raise CliError(f"cannot write a checkpoint to {directory}: {exc}") from exc
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    written = sum(p.stat().st_size for p in checkpoint_files(directory))
    print(f"wrote {len(checkpoint_files(directory))} files ({_format_bytes(written)}) to {directory}")
    return 0


def _swap_in(staging: Path, directory: Path) -> None:
    """Move the checkpoint files of ``staging`` into ``directory`` (created), each replacing its old
    version in one rename, ``config.json`` last; then remove old checkpoint files the new one lacks
    (shards of a different count). Other files in ``directory`` stay.

    Raises:
        OSError: ``directory`` cannot be created or a file cannot be moved.
    """
    from .checkpoint import checkpoint_files

    directory.mkdir(exist_ok=True)
    old = checkpoint_files(directory)
    new = sorted(checkpoint_files(staging), key=lambda p: p.name == "config.json")
    for path in new:
        os.replace(path, directory / path.name)
    names = {p.name for p in new}
    for path in old:
        if path.name not in names:
            path.unlink()


def _load_decoder(args, device):
    """The decoder of ``--checkpoint``, or random weights of ``--preset``, and a phrase naming it."""
    import tempfile

    from .checkpoint import CheckpointError, load_checkpoint, save_random_checkpoint
    from .config import PRESETS

    if args.checkpoint:
        try:
            return load_checkpoint(args.checkpoint, device=device), f"checkpoint {args.checkpoint}"
        except (CheckpointError, ValueError, FileNotFoundError, OSError) as exc:
            raise CliError(str(exc)) from exc
    _check_preset(args.preset, PRESETS)
    print(
        f"note: no --checkpoint given: using RANDOM weights (preset {args.preset}, seed {args.seed}); "
        "the audio is noise, useful only to exercise the pipeline",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory() as tmp:
        decoder = load_checkpoint(save_random_checkpoint(args.preset, tmp, seed=args.seed), device=device)
    return decoder, f"random {args.preset} weights"


def _codec_config(args):
    """The config of ``--checkpoint`` (its ``config.json`` only) or of ``--preset``: what the codes and the
    output are checked against before any weight is read."""
    from .config import PRESETS, load_config, preset_config

    if args.checkpoint:
        try:
            return load_config(args.checkpoint)
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise CliError(str(exc)) from exc
    _check_preset(args.preset, PRESETS)
    return preset_config(args.preset)


def _cmd_decode(args) -> int:
    import torch

    from .decoder import chunk_schedule, validate_codes

    codes, too_large = _load_codes(Path(args.codes))
    chunks = _parse_chunks(args.chunks)
    device = _parse_device(args.device)
    out = Path(args.output)
    if out.suffix.lower() != ".wav" or out.is_dir():
        raise CliError(f"output {out} must be a .wav file path")
    cfg = _codec_config(args)
    if too_large is not None:
        raise CliError(f"{args.codes}: code {too_large} is outside the codebook range [0, {cfg.codebook_size - 1}]")
    try:
        validate_codes(cfg, codes[:, None])
    except ValueError as exc:
        raise CliError(f"{args.codes}: {exc}") from exc
    wav = _open_wav(out, cfg.sampling_rate, cfg.number_channels)  # a bad output path fails before the load
    try:
        decoder, source = _load_decoder(args, device)
    except BaseException:
        wav.close()
        out.unlink(missing_ok=True)
        raise
    codes = codes[:, None].to(device)
    num_frames = codes.shape[-1]
    spans = chunk_schedule(num_frames, chunks)
    written, peak = 0, 0.0
    with wav:
        start = time.perf_counter()
        with decoder.streaming(1, args.semantics) as stream:
            for a, b in spans:
                audio = stream.decode(codes[:, :, a:b])[0].cpu()  # (channels, samples)
                wav.write(audio.T.numpy())
                written += audio.shape[-1]
                peak = max(peak, float(audio.abs().max())) if audio.numel() else peak
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    expected = num_frames * cfg.samples_per_frame
    assert written == expected, (written, expected)
    seconds = expected / cfg.sampling_rate
    print(
        f"decoded {num_frames} frames in {len(spans)} chunks with {source} on {device} "
        f"({stream.ring_semantics} ring semantics)"
    )
    print(
        f"wrote {out}: {seconds:.2f} s of audio, {cfg.sampling_rate} Hz, {cfg.number_channels} channel(s), "
        f"{expected} samples per channel, peak |sample| {peak:.3g}; decode took {elapsed:.2f} s "
        f"(real-time factor {elapsed / seconds:.3f})"
    )
    if peak > 1 and not args.checkpoint:
        print(
            f"note: the audio peaks at |sample| = {peak:.3g}, outside [-1, 1]: random weights are not a trained "
            "codec, and a player clips what the float WAV holds",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .config import PRESETS, RING_SEMANTICS

    presets = ", ".join(sorted(PRESETS))
    parser = argparse.ArgumentParser(prog="vllm-omni-moss", description="MOSS-TTS codec decoder tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-checkpoint", help="write a random checkpoint in the official format")
    make.add_argument("directory", help="output directory (config.json + model.safetensors)")
    make.add_argument("--preset", required=True, help=f"codec geometry: {presets}")
    make.add_argument("--seed", type=_seed, default=0, help="random seed in [0, 2**63) (default 0)")
    make.add_argument("--force", action="store_true", help="replace a checkpoint already in the directory")
    make.set_defaults(func=_cmd_make_checkpoint)
    dec = sub.add_parser("decode", help="stream codes through the fixed-width decoder and write a WAV")
    dec.add_argument(
        "codes",
        help="integer codes of shape (n_vq, T) in a .npy (numpy.save) or .pt file; "
        "MOSS-TTS-Local with the v2 codec: n_vq = 12, codes in [0, 1024)",
    )
    dec.add_argument("-o", "--output", required=True, help="output WAV path (32-bit float samples)")
    src = dec.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="official checkpoint directory (config.json + safetensors)")
    src.add_argument(
        "--preset", default="tiny-v2", help=f"random weights of this geometry when no checkpoint: {presets}"
    )
    dec.add_argument("--seed", type=_seed, default=0, help="seed of the random weights (with --preset), in [0, 2**63)")
    dec.add_argument(
        "--chunks",
        default="1,15",
        help="chunk ramp in frames, the last size repeated, as the talker sends codec_chunk_ramp "
        "(default 1,15: 80 ms, then 1.2 s per chunk)",
    )
    dec.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    dec.add_argument(
        "--semantics",
        choices=RING_SEMANTICS,
        default=None,
        help="ring semantics of the streaming decode: upstream (vLLM-Omni's v2 behaviour: each chunk is written "
        "before it is attended) or exact (every chunk schedule equals offline decode); default: upstream's for "
        "the codec version (upstream for v2, exact for v1)",
    )
    dec.set_defaults(func=_cmd_decode)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as exc:
        print(f"vllm-omni-moss: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the system refuses (too long, no permission, ...) wherever it is first used
        where = f" {exc.filename}" if exc.filename else ""
        print(f"vllm-omni-moss: error:{where}: {exc.strerror or exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
