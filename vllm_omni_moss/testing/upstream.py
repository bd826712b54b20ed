# SPDX-License-Identifier: Apache-2.0
"""Upstream vLLM-Omni 0.30.0 MOSS audio-tokenizer codecs, run as a CPU/fp32 numerical oracle.

Import-light on purpose: importing this module imports torch and the standard library only, never vLLM,
vLLM-Omni or our codec package. It drives upstream's own codec files (``audio_tokenizer.py`` = v1,
``audio_tokenizer_v2.py`` + its configuration = v2), loaded by file path on first use
(:mod:`.upstream_files`); ``transformers`` is imported only then. The official format at toy widths (tiny
configurations, checkpoint names) lives in :mod:`.upstream_format`; both modules' public names are
re-exported here. The parity tests and the benchmarks' upstream arm both use it (``from vllm_omni_moss.testing
import upstream``).

Typical use in a comparison test::

    ref = build_upstream(tiny_v2_config(), "v2", seed=3)
    ref.write_official_checkpoint(tmp_path)          # load this into our decoder
    audio = ref.decode(codes)                        # (B, channels, T * downsample_rate)

Conventions shared by every public function here:

* codes are int64 ``(n_vq, B, T)``; ``T`` counts code frames (12.5 Hz for both official codecs);
* audio is float32 ``(B, channels, T * downsample_rate)``: samples per channel, already
  de-interleaved for the stereo v2 codec, amplitude in the model's raw output units (no clipping);
* everything runs on CPU in float32; upstream's CUDA-only BF16 policy is never entered.

Set ``MOSS_UPSTREAM_MOSS_TTS_DIR`` to a directory holding upstream's ``moss_tts`` files to use a copy
that is not installed as a package (e.g. an unzipped wheel on a machine without vLLM).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .upstream_files import (
    UPSTREAM_VERSION,
    load_streaming_attention,
    load_upstream_module,
    upstream_available,
    upstream_dir,
)
from .upstream_format import (
    TINY_LATENT_DIM,
    loader_target_name,
    official_name,
    tiny_v1_config,
    tiny_v2_config,
)

_VERSIONS = ("v1", "v2")


# Deterministic randomisation
# ---------------------------------------------------------------------------------------------


def _init_value(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """Random fp32 value for one parameter, scaled so every weight moves the output."""

    def normal(std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=gen, dtype=torch.float32) * (high - low) + low

    leaf = name.rsplit(".", 2)
    if name.endswith("parametrizations.weight.original0"):
        # Weight-norm magnitude g: row norm of the effective weight, kept O(1) and positive.
        return uniform(0.5, 1.5)
    if name.endswith("parametrizations.weight.original1"):
        # Weight-norm direction v: only its per-row direction matters.
        return normal()
    if name.endswith("codebook.weight"):
        return normal()
    if leaf[-1] == "scale":
        # LayerScale: far from the 0.01 init so the attention/FFN branches dominate the residual.
        return uniform(0.3, 1.0)
    if re.search(r"\.norm[12]\.weight$", name):
        return normal(0.1, 1.0)
    if re.search(r"\.norm[12]\.bias$", name) or (name.startswith("quantizer.") and leaf[-1] == "bias"):
        return normal(0.1)
    if leaf[-1] == "weight" and len(shape) == 2:
        # nn.Linear [out, in]: unit-variance outputs for unit-variance inputs.
        return normal(1.0 / math.sqrt(shape[1]))
    raise KeyError(f"no randomisation rule for parameter {name!r} of shape {tuple(shape)}")


@torch.no_grad()
def _randomize_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    # Sorted names make the draw order independent of module registration order.
    params = dict(model.named_parameters())
    for name in sorted(params):
        param = params[name]
        param.copy_(_init_value(name, param.shape, gen))


# ---------------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _fp32_default() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _chunk_schedule(chunks: list[int], total: int) -> list[int]:
    """Chunk widths (frames) covering ``total``: ``chunks`` as a ramp whose last width repeats (``decoder.
    chunk_schedule``, the rule of the talker's chunker)."""
    if not chunks or any(int(c) <= 0 for c in chunks):
        raise ValueError(f"chunk widths must be positive, got {chunks}")
    from vllm_omni_moss.model_executor.models.moss_tts.decoder import chunk_schedule

    return [b - a for a, b in chunk_schedule(total, [int(c) for c in chunks])]


class UpstreamCodec:
    """One upstream codec model (v1 or v2), fp32 on CPU, eval mode, with randomised weights.

    Attributes: ``model`` (upstream's ``MossAudioTokenizerModel``), ``module`` (the loaded upstream
    file), ``version``, ``config`` (the official config dict), ``channels``, ``downsample_rate``
    (samples per channel per code frame), ``num_quantizers``, ``codebook_size``.
    """

    def __init__(self, model: torch.nn.Module, module: types.ModuleType, config: dict[str, Any], version: str):
        self.model = model
        self.module = module
        self.version = version
        self.config = copy.deepcopy(config)
        self.channels = int(config.get("number_channels") or 1)
        self.downsample_rate = int(config["downsample_rate"])
        self.num_quantizers = int(config["quantizer_kwargs"]["num_quantizers"])
        self.codebook_size = int(config["quantizer_kwargs"]["codebook_size"])
        self._open_pool: UpstreamPool | None = None
        self._lut_quantizers = self.num_quantizers

    # ---- weights ------------------------------------------------------------------------------

    def official_state_dict(self) -> dict[str, torch.Tensor]:
        """All encoder, quantizer and decoder weights under official checkpoint names.

        Values are contiguous fp32 CPU copies. Weight-normalised convolutions appear as
        ``<conv>.parametrizations.weight.original0`` (g, ``[out, 1, 1]``), ``original1``
        (v, ``[out, in, 1]``) and ``<conv>.bias`` (``[out]``).
        """
        out: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            key = official_name(name, self.version)
            if key in out:
                raise RuntimeError(f"two upstream parameters map to official name {key!r}")
            out[key] = param.detach().to(device="cpu", dtype=torch.float32).clone().contiguous()
        return out

    @torch.no_grad()
    def load_official_state_dict(self, state_dict: dict[str, torch.Tensor]) -> set[str]:
        """Load official-named weights with upstream 0.30.0's loader rules; returns upstream names.

        Like upstream, an unknown key, a shape mismatch or a parameter left unloaded is an error.
        The v2 decode LUT is a cache derived from the quantizer weights and is rebuilt afterwards.
        """
        params = dict(self.model.named_parameters())
        loaded: set[str] = set()
        problems: list[str] = []
        for key, tensor in state_dict.items():
            target = loader_target_name(key, params)
            if target not in params:
                problems.append(f"unmatched checkpoint key {key!r}")
                continue
            if tuple(params[target].shape) != tuple(tensor.shape):
                problems.append(f"shape of {key!r} {tuple(tensor.shape)} != {tuple(params[target].shape)}")
                continue
            params[target].copy_(tensor.to(params[target].dtype))
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        problems.extend(f"parameter {name!r} not in checkpoint" for name in missing)
        if problems:
            raise RuntimeError("official state dict does not fit upstream's codec: " + "; ".join(problems[:8]))
        self._refresh_lut()
        return loaded

    def write_official_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (fp32, official names) into ``path``."""
        from safetensors.torch import save_file

        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        save_file(self.official_state_dict(), str(directory / "model.safetensors"))
        return directory

    def _refresh_lut(self) -> None:
        quantizer = self.model.quantizer
        if self.version == "v2" and callable(getattr(quantizer, "build_decode_lut", None)):
            # Serving builds this fp32 table on CPU after loading; it must follow any weight change.
            quantizer.build_decode_lut(self._lut_quantizers, dtype=torch.float32)

    # ---- decoding -----------------------------------------------------------------------------

    def _check_codes(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dim() != 3:
            raise ValueError(f"codes must be (n_vq, B, T), got shape {tuple(codes.shape)}")
        if not 0 < codes.shape[0] <= self.num_quantizers:
            raise ValueError(f"n_vq must be in [1, {self.num_quantizers}], got {codes.shape[0]}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ValueError(f"codes must lie in [0, {self.codebook_size})")
        return codes.to(device="cpu", dtype=torch.long)

    def _ensure_idle(self) -> None:
        if self._open_pool is not None:
            raise RuntimeError("close the open decoder state pool first (upstream keeps one streaming state)")

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Upstream's offline whole-sequence decode.

        Args:
            codes: int64 ``(n_vq, B, T)``, values in ``[0, codebook_size)``.
        Returns:
            float32 ``(B, channels, T * downsample_rate)``. Every row is decoded over its full T
            (upstream's lengths only scale the returned lengths; nothing is masked).
        """
        self._ensure_idle()
        codes = self._check_codes(codes)
        lengths = torch.full((codes.shape[1],), codes.shape[2], dtype=torch.long)
        if self.version == "v2":
            audio, _ = self.model._decode_frame_tensors(codes, lengths)
        else:
            audio, _ = self.model._decode_tensors(codes, lengths)
        return audio.float()

    @torch.no_grad()
    def stream_decode(self, codes: torch.Tensor, chunks: list[int]) -> torch.Tensor:
        """Upstream's single-stream chunked decode, concatenated.

        Args:
            codes: int64 ``(n_vq, 1, T)``.
            chunks: chunk widths in frames: ``chunks[0]`` first, then ``chunks[1:]`` repeated
                cyclically (``[c]`` alone repeats ``c``); the last chunk is cut to what remains.
        Returns:
            float32 ``(1, channels, T * downsample_rate)``; each chunk contributes exactly
            ``width * downsample_rate`` samples per channel.

        v2 runs upstream's fixed-width path (``decoder_streaming(batch_size=1)`` then
        ``_decode_frame`` per chunk): its ring is written before attending, so a chunk longer than
        a stage's ring differs from offline decode. v1 runs its slot pool (one slot, always
        valid), which attends over ring + chunk and matches offline decode for any schedule.
        """
        self._ensure_idle()
        codes = self._check_codes(codes)
        if codes.shape[1] != 1:
            raise ValueError("stream_decode takes a single stream: codes must be (n_vq, 1, T)")
        widths = _chunk_schedule(chunks, codes.shape[2])
        pieces: list[torch.Tensor] = []
        if self.version == "v2":
            with self.model.decoder_streaming(batch_size=1):
                start = 0
                for width in widths:
                    out = self.model._decode_frame(codes[:, :, start : start + width])
                    pieces.append(out.audio.float())
                    start += width
        else:
            pool = self.pool(1, 0)
            try:
                slot = torch.zeros(1, dtype=torch.long)
                valid = torch.ones(1, dtype=torch.bool)
                start = 0
                for width in widths:
                    audio, _ = pool.step(codes[:, :, start : start + width], torch.tensor([width]), slot, valid)
                    pieces.append(audio)
                    start += width
            finally:
                pool.close()
        if not pieces:
            return torch.zeros(1, self.channels, 0)
        return torch.cat(pieces, dim=-1)

    def pool(self, state_capacity: int, scratch_capacity: int = 0) -> UpstreamPool:
        """Open upstream's decoder state pool with ``state_capacity + scratch_capacity`` slots."""
        self._ensure_idle()
        pool = UpstreamPool(self, int(state_capacity), int(scratch_capacity))
        self._open_pool = pool
        return pool

    def attention_modules(self) -> list[tuple[str, torch.nn.Module]]:
        """Decoder attention modules with their names, in execution order."""
        cls = self.module._Attention if self.version == "v1" else self.module.MossAudioTokenizerMultiheadAttention
        return [(name, m) for name, m in self.model.decoder.named_modules(prefix="decoder") if isinstance(m, cls)]


class UpstreamPool:
    """Upstream's persistent decoder state pool (``initialize_decoder_state_pool``) for one codec.

    ``S = state_capacity + scratch_capacity`` slots. Use as a context manager or call ``close()``.
    """

    def __init__(self, codec: UpstreamCodec, state_capacity: int, scratch_capacity: int):
        self._codec = codec
        self.state_capacity = state_capacity
        self.scratch_capacity = scratch_capacity
        self.slots = state_capacity + scratch_capacity
        self._closed = False
        with torch.no_grad():
            codec.model.initialize_decoder_state_pool(state_capacity, scratch_capacity)
        self._attentions = codec.attention_modules()

    def __enter__(self) -> UpstreamPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _live(self) -> None:
        if self._closed:
            raise RuntimeError("decoder state pool is closed")

    @torch.no_grad()
    def step(
        self,
        codes: torch.Tensor,
        lengths: torch.Tensor,
        slot_ids: torch.Tensor,
        valid_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One ``decode_streaming_batch`` call.

        Args:
            codes: int64 ``(n_vq, B, T)``; row b runs on slot ``slot_ids[b]``.
            lengths: int64 ``(B,)`` code frames per row; only scales the returned lengths.
            slot_ids: int64 ``(B,)`` distinct slots in ``[0, S)``.
            valid_rows: bool ``(B,)``; invalid rows still compute (and write their ring rows)
                but do not advance their offsets.
        Returns:
            ``audio`` float32 ``(B, channels, T * downsample_rate)`` and ``audio_lengths`` int64
            ``(B,)`` = ``lengths * downsample_rate``.
        """
        self._live()
        codes = self._codec._check_codes(codes)
        out = self._codec.model.decode_streaming_batch(
            codes,
            lengths.to(dtype=torch.long),
            slot_ids.to(dtype=torch.long),
            valid_rows.to(dtype=torch.bool),
        )
        return out.audio.float(), out.audio_lengths

    def reset(self, slot_ids: torch.Tensor | list[int]) -> None:
        """Upstream slot reset: zero every offset of these slots (KV buffers are left as they are)."""
        self._live()
        self._codec.model.reset_decoder_state_slots(torch.as_tensor(slot_ids, dtype=torch.long))

    def close(self) -> None:
        """Drop all streaming state (idempotent)."""
        if self._closed:
            return
        self._codec.model.close_decoder_state_pool()
        self._closed = True
        if self._codec._open_pool is self:
            self._codec._open_pool = None

    def kv_rings(self) -> list[torch.Tensor]:
        """Live ring caches, one per decoder attention layer in execution order.

        Each is upstream's own tensor (clone it for a snapshot): fp32 ``(2, S, H, C, Dh)``, plane 0 =
        rotated keys, plane 1 = values; ring index of absolute position p is ``p mod C``.
        """
        self._live()
        return [module._streaming_state.kv_cache.cache for _, module in self._attentions]

    def offsets(self) -> torch.Tensor:
        """Upstream's live offset bank, int64 ``(R, S)``; row meanings from ``offset_rows()``."""
        self._live()
        return self._codec.model._decoder_slot_offsets

    def offset_rows(self) -> list[str]:
        """Label of each offset-bank row, e.g. ``"decoder.0.transformer.layers.1.self_attn:end_offset"``.

        v1 has one row per attention layer (``<attention>:offsets``). v2 (0.30.0) has, per
        attention layer, its ``offset`` then its ring ``end_offset``, and after each transformer
        group's layers the group's ``offsets`` row.
        """
        self._live()
        bank = self.offsets()
        pointers = {bank[row].data_ptr(): row for row in range(bank.shape[0])}
        labels: list[str | None] = [None] * bank.shape[0]
        for name, module in self._codec.model.decoder.named_modules(prefix="decoder"):
            state = getattr(module, "_streaming_state", None)
            if state is None:
                continue
            owners = [(state, "offset"), (state, "offsets"), (getattr(state, "kv_cache", None), "end_offset")]
            for owner, field in owners:
                tensor = getattr(owner, field, None) if owner is not None else None
                if isinstance(tensor, torch.Tensor) and tensor.data_ptr() in pointers:
                    labels[pointers[tensor.data_ptr()]] = f"{name}:{field}"
        if any(label is None for label in labels):
            raise RuntimeError("could not attribute every offset-bank row to a streaming state")
        return [str(label) for label in labels]


def build_upstream(
    config: dict[str, Any],
    version: str,
    seed: int = 0,
    *,
    lut_quantizers: int | None = None,
) -> UpstreamCodec:
    """Build upstream's codec from an official ``config.json`` dict with seeded random weights.

    Args:
        config: official MOSS-Audio-Tokenizer config dict (not modified).
        version: ``"v1"`` (``audio_tokenizer.py``) or ``"v2"`` (``audio_tokenizer_v2.py``).
        seed: every parameter is redrawn from this seed: Linear ``N(0, 1/fan_in)``, LayerNorm
            weight ``1 + 0.1 N`` and bias ``0.1 N``, LayerScale ``U(0.3, 1)``, codebooks ``N(0, 1)``,
            weight-norm ``g ~ U(0.5, 1.5)``, ``v ~ N(0, 1)``, conv bias ``0.1 N``.
        lut_quantizers: v2 only; quantizers folded into the decode LUT (serving uses the talker's
            n_vq; default all). Codes with more quantizers than this fall back to the unfolded path.
    Returns:
        An :class:`UpstreamCodec` in eval mode, fp32, CPU.
    """
    if version not in _VERSIONS:
        raise ValueError(f"version must be one of {_VERSIONS}, got {version!r}")
    cfg = copy.deepcopy(config)
    if version == "v2":
        module = load_upstream_module("audio_tokenizer_v2")
        config_cls = load_upstream_module("configuration_moss_audio_tokenizer_v2").MossAudioTokenizerConfig
    else:
        module = load_upstream_module("audio_tokenizer")
        config_cls = module.MossAudioTokenizerConfig

    channels = int(cfg.get("number_channels") or 1)
    interleave = cfg.get("enable_channel_interleave", True) is not False
    upsample = math.prod(
        int(m["patch_size"]) for m in cfg["decoder_kwargs"] if m["module_type"] == "PatchedPretransform"
    )
    expected = int(cfg["downsample_rate"]) * (channels if interleave and channels > 1 else 1)
    if upsample != expected:
        # v1 does not check this itself and would silently build a codec with the wrong hop.
        raise ValueError(f"decoder patches multiply to {upsample}, expected {expected} samples per frame")

    with _fp32_default(), torch.device("cpu"):
        model = module.MossAudioTokenizerModel(config_cls(**copy.deepcopy(cfg)))
    model.eval()
    _randomize_(model, seed)
    codec = UpstreamCodec(model, module, cfg, version)
    codec._lut_quantizers = int(lut_quantizers or codec.num_quantizers)
    codec._refresh_lut()
    return codec


def load_official_checkpoint(path: str | os.PathLike[str], version: str | None = None) -> UpstreamCodec:
    """Build an upstream codec from a directory with ``config.json`` + ``model.safetensors``.

    ``version`` defaults to upstream's own rule: v2 when ``number_channels >= 2``.
    """
    from safetensors.torch import load_file

    directory = Path(path)
    config = json.loads((directory / "config.json").read_text())
    if version is None:
        version = "v2" if int(config.get("number_channels") or 1) >= 2 else "v1"
    codec = build_upstream(config, version, seed=0)
    codec.load_official_state_dict(load_file(str(directory / "model.safetensors")))
    return codec


__all__ = [
    "TINY_LATENT_DIM",
    "UPSTREAM_VERSION",
    "load_streaming_attention",
    "UpstreamCodec",
    "UpstreamPool",
    "build_upstream",
    "load_official_checkpoint",
    "load_upstream_module",
    "loader_target_name",
    "official_name",
    "tiny_v1_config",
    "tiny_v2_config",
    "upstream_available",
    "upstream_dir",
]
