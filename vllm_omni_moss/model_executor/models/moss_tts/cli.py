# SPDX-License-Identifier: Apache-2.0
"""``vllm-omni-moss``: make random official-format checkpoints and stream codes to a WAV file.

Examples::

    vllm-omni-moss make-checkpoint --preset tiny-v2 /tmp/codec
    vllm-omni-moss decode codes.npy -o out.wav --checkpoint /tmp/codec --chunks 1,15
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["main"]


class CliError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


def _load_codes(path: Path):
    import numpy as np
    import torch

    if not path.is_file():
        raise CliError(f"codes file not found: {path}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            array = np.load(path, allow_pickle=False)
            codes = torch.from_numpy(np.ascontiguousarray(array))
        elif suffix in (".pt", ".pth"):
            codes = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raise CliError(f"unsupported codes file {path.name}: expected .npy or .pt")
    except CliError:
        raise
    except Exception as exc:
        raise CliError(f"cannot read codes from {path}: {exc}") from exc
    if not isinstance(codes, torch.Tensor):
        raise CliError(f"{path} holds a {type(codes).__name__}, expected one integer tensor of shape (n_vq, T)")
    if codes.dim() != 2:
        raise CliError(f"{path}: codes must have shape (n_vq, T), got {tuple(codes.shape)}")
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise CliError(f"{path}: codes must be integers, got dtype {codes.dtype}")
    if codes.shape[1] == 0:
        raise CliError(f"{path}: codes have no frames (T = 0)")
    return codes.long()


def _parse_chunks(text: str) -> list[int]:
    try:
        chunks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise CliError(f"--chunks must be comma-separated positive integers, got {text!r}") from exc
    if not chunks or min(chunks) < 1:
        raise CliError(f"--chunks must be comma-separated positive integers, got {text!r}")
    return chunks


def _cmd_make_checkpoint(args) -> int:
    from .checkpoint import save_random_checkpoint
    from .config import PRESETS

    if args.preset not in PRESETS:
        raise CliError(f"unknown preset {args.preset!r}; choose from {', '.join(sorted(PRESETS))}")
    out = save_random_checkpoint(args.preset, args.directory, seed=args.seed)
    size = sum(p.stat().st_size for p in out.iterdir()) / 2**20
    print(f"wrote random {args.preset} checkpoint (seed {args.seed}, {size:.1f} MiB) to {out}")
    return 0


def _cmd_decode(args) -> int:
    import soundfile
    import torch

    from .checkpoint import CheckpointError, load_checkpoint, save_random_checkpoint
    from .decoder import chunk_schedule

    codes = _load_codes(Path(args.codes))
    chunks = _parse_chunks(args.chunks)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.checkpoint:
        try:
            decoder = load_checkpoint(args.checkpoint, device=device)
        except (CheckpointError, ValueError, FileNotFoundError) as exc:
            raise CliError(str(exc)) from exc
        source = f"checkpoint {args.checkpoint}"
    else:
        import tempfile

        print(
            f"note: no --checkpoint given: using RANDOM weights (preset {args.preset}, seed {args.seed}); "
            "the audio is noise, useful only to exercise the pipeline",
            file=sys.stderr,
        )
        with tempfile.TemporaryDirectory() as tmp:
            decoder = load_checkpoint(save_random_checkpoint(args.preset, tmp, seed=args.seed), device=device)
        source = f"random {args.preset} weights"
    cfg = decoder.config
    try:
        decoder.validate_codes(codes[:, None])
    except ValueError as exc:
        raise CliError(f"{args.codes}: {exc}") from exc
    codes = codes[:, None].to(device)
    frames = codes.shape[-1]
    spans = chunk_schedule(frames, chunks)
    start = time.perf_counter()
    parts = []
    with decoder.streaming(1) as stream:
        for a, b in spans:
            parts.append(stream.decode(codes[:, :, a:b]).cpu())
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    audio = torch.cat(parts, dim=-1)[0]  # (channels, samples)
    expected = frames * cfg.samples_per_frame
    assert audio.shape == (cfg.number_channels, expected), audio.shape
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(str(out), audio.T.numpy(), cfg.sampling_rate, subtype="FLOAT")
    seconds = expected / cfg.sampling_rate
    print(f"decoded {frames} frames in {len(spans)} chunks with {source} on {device}")
    print(
        f"wrote {out}: {seconds:.2f} s of audio, {cfg.sampling_rate} Hz, {cfg.number_channels} channel(s), "
        f"{expected} samples per channel; decode took {elapsed:.2f} s (real-time factor {elapsed / seconds:.3f})"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .config import PRESETS

    presets = ", ".join(sorted(PRESETS))
    parser = argparse.ArgumentParser(prog="vllm-omni-moss", description="MOSS-TTS codec decoder tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-checkpoint", help="write a random checkpoint in the official format")
    make.add_argument("directory", help="output directory (config.json + model.safetensors)")
    make.add_argument("--preset", required=True, help=f"codec geometry: {presets}")
    make.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    make.set_defaults(func=_cmd_make_checkpoint)
    dec = sub.add_parser("decode", help="stream codes through the fixed-width decoder and write a WAV")
    dec.add_argument("codes", help="integer codes of shape (n_vq, T) in a .npy or .pt file")
    dec.add_argument("-o", "--output", required=True, help="output WAV path (32-bit float samples)")
    src = dec.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="official checkpoint directory (config.json + safetensors)")
    src.add_argument(
        "--preset", default="tiny-v2", help=f"random weights of this geometry when no checkpoint: {presets}"
    )
    dec.add_argument("--seed", type=int, default=0, help="seed of the random weights (with --preset)")
    dec.add_argument(
        "--chunks",
        default="1,15",
        help="chunk schedule in frames: first chunk, then steady chunks "
        "repeated (default 1,15: 80 ms, then 1.2 s per chunk)",
    )
    dec.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    dec.set_defaults(func=_cmd_decode)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as exc:
        print(f"vllm-omni-moss: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
