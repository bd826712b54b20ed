# SPDX-License-Identifier: Apache-2.0
"""Official MOSS Audio Tokenizer checkpoints: load the decoder, write random ones.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or a
sharded ``model.safetensors.index.json``. Only decoder and quantizer-decode tensors
are read; encoder tensors (and the quantizer's encode-side projections) are skipped
by name, never materialised.

Official tensor names (codec-facts §A.10):

* decoder transformer ``decoder.{i}.``: ``input_proj.weight``, ``output_proj.weight``,
  ``transformer.layers.{j}.{norm1,norm2}.{weight,bias}``, attention
  ``self_attn.in_proj.weight`` / ``self_attn.out_proj.weight`` (v2) or
  ``self_attn.in_projs.0.weight`` / ``self_attn.out_projs.0.weight`` (v1), FFN
  ``ffn.0.weight`` / ``ffn.2.weight`` (v2) or ``linear1.weight`` / ``linear2.weight`` (v1),
  ``layer_scale_{1,2}.scale``. Either spelling is accepted for either version.
* quantizer: ``quantizer.output_proj`` and ``quantizer.quantizers.{k}.out_proj``
  weight-normalised 1x1 convolutions stored as ``parametrizations.weight.original0``
  (g, ``[out, 1, 1]``) and ``original1`` (v, ``[out, in, 1]``) plus ``bias``;
  ``quantizer.quantizers.{k}.codebook.weight`` ``[codebook_size, codebook_dim]``.
  Weight norm is folded (``W = g * v / ||v||`` per output row) and every codebook is
  folded into one decode table ``lut[k] = W_o (W_k codebook_k + b_k)`` (float64 math).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .config import CodecConfig, load_config, preset_config
from .decoder import CodecDecoder

__all__ = [
    "CheckpointError",
    "load_checkpoint",
    "official_decoder_names",
    "random_official_state_dict",
    "save_random_checkpoint",
]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint is missing tensors, has unexpected or mis-shaped ones, or is unreadable."""


# Our parameter suffix -> accepted official suffixes under ``transformer.layers.{j}.``.
_LAYER_ALIASES = {
    "norm1.weight": ("norm1.weight",),
    "norm1.bias": ("norm1.bias",),
    "norm2.weight": ("norm2.weight",),
    "norm2.bias": ("norm2.bias",),
    "in_proj.weight": ("self_attn.in_proj.weight", "self_attn.in_projs.0.weight"),
    "out_proj.weight": ("self_attn.out_proj.weight", "self_attn.out_projs.0.weight"),
    "linear1.weight": ("ffn.0.weight", "linear1.weight"),
    "linear2.weight": ("ffn.2.weight", "linear2.weight"),
    "layer_scale_1": ("layer_scale_1.scale",),
    "layer_scale_2": ("layer_scale_2.scale",),
}
_V2_SPELLING = {"in_proj.weight": 0, "out_proj.weight": 0, "linear1.weight": 0, "linear2.weight": 0}
_V1_SPELLING = {"in_proj.weight": 1, "out_proj.weight": 1, "linear1.weight": 1, "linear2.weight": 1}


def official_decoder_names(config: CodecConfig, *, optional_projections: bool = True) -> dict[str, tuple[str, ...]]:
    """Map each decoder parameter of :class:`CodecDecoder` to its accepted official names.

    With ``optional_projections`` (v1 only), projections whose dims match are listed
    under keys prefixed ``?`` - loaded when present, identity otherwise.
    """
    out: dict[str, tuple[str, ...]] = {}
    for g, spec in enumerate(config.groups):
        src = f"decoder.{spec.index}."
        for proj, present in (("input_proj", spec.input_proj), ("output_proj", spec.output_proj)):
            key = f"groups.{g}.{proj}.weight"
            if present:
                out[key] = (f"{src}{proj}.weight",)
            elif optional_projections:
                out["?" + key] = (f"{src}{proj}.weight",)
        for j in range(spec.num_layers):
            for ours, names in _LAYER_ALIASES.items():
                if ours.startswith("layer_scale") and spec.layer_scale is None:
                    continue
                out[f"groups.{g}.layers.{j}.{ours}"] = tuple(f"{src}transformer.layers.{j}.{n}" for n in names)
    return out


def _weight_norm_names(prefix: str) -> tuple[str, ...]:
    return (
        f"{prefix}.parametrizations.weight.original0",
        f"{prefix}.parametrizations.weight.original1",
        f"{prefix}.weight_g",
        f"{prefix}.weight_v",
        f"{prefix}.weight",
        f"{prefix}.bias",
    )


def _quantizer_names(config: CodecConfig) -> list[str]:
    """Quantizer prefixes whose tensors feed the decode table (None-able projections included)."""
    prefixes = []
    if config.rvq_dim != config.latent_dim:
        prefixes.append("quantizer.output_proj")
    for k in range(config.num_quantizers):
        if config.rvq_dim != config.codebook_dim:
            prefixes.append(f"quantizer.quantizers.{k}.out_proj")
    return prefixes


def _is_skipped(name: str) -> bool:
    """Encoder-side tensors: never read for decoding."""
    return (
        name.startswith("encoder.")
        or name.startswith("quantizer.input_proj.")
        or (name.startswith("quantizer.quantizers.") and ".in_proj." in name)
    )


class _TensorSource:
    """Lazy access to the tensors of a checkpoint directory (single file or sharded)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self._open = safe_open
        index = directory / _INDEX
        single = directory / _SINGLE
        self.where: dict[str, Path] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"corrupt shard index {index}: {exc!r}") from exc
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise CheckpointError(f"corrupt shard index {index}: weight_map must map tensor names to shard files")
            for name, shard in weight_map.items():
                path = directory / shard
                if not path.is_file():
                    raise CheckpointError(f"shard {shard} named by {index} for tensor {name} does not exist")
                self.where[name] = path
        elif single.is_file():
            for name in self._keys(single):
                self.where[name] = single
        else:
            raise CheckpointError(f"no {_SINGLE} or {_INDEX} in {directory}")
        self._handles: dict[Path, object] = {}

    def _keys(self, path: Path) -> list[str]:
        return list(self._handle(path).keys())

    def _handle(self, path: Path):
        if not hasattr(self, "_handles"):
            self._handles = {}
        if path not in self._handles:
            try:
                self._handles[path] = self._open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"cannot read {path}: {exc}") from exc
        return self._handles[path]

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handle(self.where[name]).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor {name} from {self.where[name]}: {exc}") from exc


def _fold_weight_norm(src: _TensorSource, prefix: str, problems: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Effective 2-D weight ``[out, in]`` and bias ``[out]`` (float64) of a 1x1 convolution."""
    names = src.where
    g_name, v_name = f"{prefix}.parametrizations.weight.original0", f"{prefix}.parametrizations.weight.original1"
    if g_name not in names and f"{prefix}.weight_g" in names:
        g_name, v_name = f"{prefix}.weight_g", f"{prefix}.weight_v"
    if g_name in names and v_name in names:
        g, v = src.get(g_name).double(), src.get(v_name).double()
        if v.dim() != 3 or v.shape[-1] != 1 or g.shape != (v.shape[0], 1, 1):
            problems.append(
                f"{prefix}: weight-norm g {tuple(g.shape)} / v {tuple(v.shape)} are not [out,1,1] / [out,in,1]"
            )
            return torch.zeros(0), torch.zeros(0)
        weight = g * v / v.norm(dim=(1, 2), keepdim=True)
    elif f"{prefix}.weight" in names:
        weight = src.get(f"{prefix}.weight").double()
    else:
        problems.append(f"missing {prefix} weight (parametrizations.weight.original0/1, weight_g/v or weight)")
        return torch.zeros(0), torch.zeros(0)
    bias_name = f"{prefix}.bias"
    if bias_name not in names:
        problems.append(f"missing {bias_name}")
        return torch.zeros(0), torch.zeros(0)
    weight = weight.reshape(weight.shape[0], -1)
    return weight, src.get(bias_name).double()


def _build_lut(config: CodecConfig, src: _TensorSource, problems: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    K, cd, rvq, latent = config.codebook_size, config.codebook_dim, config.rvq_dim, config.latent_dim
    if rvq != latent:
        w_o, b_o = _fold_weight_norm(src, "quantizer.output_proj", problems)
        if w_o.numel() and w_o.shape != (latent, rvq):
            problems.append(f"quantizer.output_proj: shape {tuple(w_o.shape)}, expected {(latent, rvq)}")
    else:
        w_o, b_o = torch.eye(latent, dtype=torch.float64), torch.zeros(latent, dtype=torch.float64)
    lut = torch.zeros(config.num_quantizers, K, latent, dtype=torch.float64)
    for k in range(config.num_quantizers):
        name = f"quantizer.quantizers.{k}.codebook.weight"
        if name not in src.where:
            problems.append(f"missing {name}")
            continue
        book = src.get(name).double()
        if book.shape != (K, cd):
            problems.append(f"{name}: shape {tuple(book.shape)}, expected {(K, cd)}")
            continue
        if rvq != cd:
            w_k, b_k = _fold_weight_norm(src, f"quantizer.quantizers.{k}.out_proj", problems)
            if not w_k.numel():
                continue
            if w_k.shape != (rvq, cd):
                problems.append(f"quantizer.quantizers.{k}.out_proj: shape {tuple(w_k.shape)}, expected {(rvq, cd)}")
                continue
            book = book @ w_k.T + b_k
        if w_o.numel() and w_o.shape == (latent, rvq):
            lut[k] = book @ w_o.T
    return lut, b_o if b_o.numel() == latent else torch.zeros(latent, dtype=torch.float64)


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu", version: str | None = None) -> CodecDecoder:
    """Load the decoder of an official checkpoint directory.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` (or a shard index).
        device: target device; on CUDA weights become bf16 (upstream's serving policy).
        version: force ``"v1"``/``"v2"``; detected from the config when ``None``.
    Returns:
        A :class:`CodecDecoder` in eval mode.
    Raises:
        FileNotFoundError: no ``config.json``.
        CheckpointError: missing, unexpected or mis-shaped tensors (all listed), or an
            unreadable/corrupt file.
        ValueError: invalid ``config.json``.
    """
    directory = Path(path)
    config = load_config(directory, version)
    src = _TensorSource(directory)
    decoder = CodecDecoder(config)
    params = dict(decoder.named_parameters())
    problems: list[str] = []
    used: set[str] = set()
    for ours, names in official_decoder_names(config).items():
        optional = ours.startswith("?")
        ours = ours.lstrip("?")
        found = [n for n in names if n in src.where]
        used.update(found)
        if len(found) > 1:
            problems.append(f"duplicate spellings for one tensor: {', '.join(found)}")
            continue
        if not found:
            if not optional:
                problems.append(f"missing {names[0]}")
            continue
        tensor = src.get(found[0])
        if optional:
            g = int(ours.split(".")[1])
            spec = config.groups[g]
            proj = torch.nn.Linear(1, 1, bias=False)
            shape = (spec.d_model, spec.input_dim) if ".input_proj." in ours else (spec.output_dim, spec.d_model)
            if tuple(tensor.shape) != shape:
                problems.append(f"{found[0]}: shape {tuple(tensor.shape)}, expected {shape}")
                continue
            proj.weight = torch.nn.Parameter(tensor.float().clone())
            setattr(decoder.groups[g], ours.split(".")[2], proj)
            continue
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            problems.append(f"{found[0]}: non-finite values (NaN or Inf)")
            continue
        target = params[ours]
        if tuple(tensor.shape) != tuple(target.shape):
            problems.append(f"{found[0]}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            continue
        with torch.no_grad():
            target.copy_(tensor)
    lut, bias = _build_lut(config, src, problems)
    # Catches NaN/Inf codebooks or projections and all-zero weight-norm directions (0/0).
    if not problems and not (torch.isfinite(lut).all() and torch.isfinite(bias).all()):
        problems.append(
            "quantizer decode table is not finite: NaN/Inf in a codebook or projection, or a zero weight-norm v row"
        )
    quantizer_used = {f"quantizer.quantizers.{k}.codebook.weight" for k in range(config.num_quantizers)}
    for prefix in _quantizer_names(config):
        quantizer_used.update(_weight_norm_names(prefix))
    unexpected = sorted(n for n in src.where if n not in used and n not in quantizer_used and not _is_skipped(n))
    if unexpected:
        shown = ", ".join(unexpected[:20]) + (f" (+{len(unexpected) - 20} more)" if len(unexpected) > 20 else "")
        problems.append(f"unexpected tensors: {shown}")
    if problems:
        raise CheckpointError(f"checkpoint {directory} does not fit its config.json:\n  - " + "\n  - ".join(problems))
    with torch.no_grad():
        decoder.lut.copy_(lut.float())
        decoder.lut_bias.copy_(bias.float())
    return decoder.to_serving(device)


# --------------------------------------------------------------------------- writing


def _conv_wn(gen: torch.Generator, out_dim: int, in_dim: int, prefix: str) -> dict[str, torch.Tensor]:
    v = torch.randn(out_dim, in_dim, 1, generator=gen)
    g = v.norm(dim=(1, 2), keepdim=True) * (1.0 + 0.1 * torch.randn(out_dim, 1, 1, generator=gen)) / math.sqrt(in_dim)
    return {
        f"{prefix}.parametrizations.weight.original0": g,
        f"{prefix}.parametrizations.weight.original1": v,
        f"{prefix}.bias": 0.02 * torch.randn(out_dim, generator=gen),
    }


def _transformer_tensors(gen, spec: dict, prefix: str, version: str, proj_always: bool) -> dict[str, torch.Tensor]:
    d, ff = spec["d_model"], spec["dim_feedforward"]
    i, o = spec["input_dimension"], spec["output_dimension"]
    t: dict[str, torch.Tensor] = {}

    def lin(out_dim, in_dim):
        return torch.randn(out_dim, in_dim, generator=gen) / math.sqrt(in_dim)

    if proj_always or i != d:
        t[f"{prefix}.input_proj.weight"] = lin(d, i)
    if proj_always or o != d:
        t[f"{prefix}.output_proj.weight"] = lin(o, d)
    names = ("self_attn.in_proj", "self_attn.out_proj", "ffn.0", "ffn.2")
    if version == "v1":
        names = ("self_attn.in_projs.0", "self_attn.out_projs.0", "linear1", "linear2")
    for j in range(spec["num_layers"]):
        p = f"{prefix}.transformer.layers.{j}."
        for n in ("norm1", "norm2"):
            t[p + n + ".weight"] = 1.0 + 0.1 * torch.randn(d, generator=gen)
            t[p + n + ".bias"] = 0.1 * torch.randn(d, generator=gen)
        t[p + names[0] + ".weight"] = lin(3 * d, d)
        t[p + names[1] + ".weight"] = lin(d, d)
        t[p + names[2] + ".weight"] = lin(ff, d)
        t[p + names[3] + ".weight"] = lin(d, ff)
        if spec.get("layer_scale") is not None:
            scale = float(spec["layer_scale"])
            t[p + "layer_scale_1.scale"] = scale * (1.0 + 0.1 * torch.randn(d, generator=gen))
            t[p + "layer_scale_2.scale"] = scale * (1.0 + 0.1 * torch.randn(d, generator=gen))
    return t


def random_official_state_dict(config: CodecConfig, seed: int = 0):
    """Yield ``(name, tensor)`` of a random fp32 checkpoint in official naming.

    Includes encoder tensors and the quantizer's encode-side projections, so loaders
    exercise skipping them. Deterministic for a given ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)
    raw = config.raw
    proj_always = config.version == "v2"
    for i, spec in enumerate(raw.get("encoder_kwargs") or []):
        if spec.get("module_type") == "Transformer":
            yield from _transformer_tensors(gen, spec, f"encoder.{i}", config.version, proj_always).items()
    qk = raw["quantizer_kwargs"]
    latent_in = qk.get("input_dim", config.latent_dim)
    if latent_in != config.rvq_dim:
        yield from _conv_wn(gen, config.rvq_dim, latent_in, "quantizer.input_proj").items()
    if config.rvq_dim != config.latent_dim:
        yield from _conv_wn(gen, config.latent_dim, config.rvq_dim, "quantizer.output_proj").items()
    for k in range(config.num_quantizers):
        p = f"quantizer.quantizers.{k}"
        if config.rvq_dim != config.codebook_dim:
            yield from _conv_wn(gen, config.codebook_dim, config.rvq_dim, f"{p}.in_proj").items()
            yield from _conv_wn(gen, config.rvq_dim, config.codebook_dim, f"{p}.out_proj").items()
        yield f"{p}.codebook.weight", torch.randn(config.codebook_size, config.codebook_dim, generator=gen)
    for spec in config.groups:
        module = raw["decoder_kwargs"][spec.index]
        yield from _transformer_tensors(gen, module, f"decoder.{spec.index}", config.version, proj_always).items()


def save_random_checkpoint(
    preset: str | CodecConfig,
    path: str | Path,
    seed: int = 0,
    max_shard_bytes: int = 2 * 1024**3,
) -> Path:
    """Write a random checkpoint in the official format to directory ``path``.

    Args:
        preset: a preset name (``v2``, ``v1``, ``tiny-v2``, ``tiny-v1``) or a config.
        path: output directory (created).
        seed: RNG seed.
        max_shard_bytes: above this total size tensors are split into
            ``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``.
    Returns:
        The directory.
    """
    from safetensors.torch import save_file

    config = preset_config(preset) if isinstance(preset, str) else preset
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in random_official_state_dict(config, seed):
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    raw = dict(config.raw)
    raw.setdefault("model_type", "moss-audio-tokenizer")
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for stale in list(out.glob("model*.safetensors")) + [out / _INDEX]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(out / _SINGLE), metadata={"format": "pt"})
        return out
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (out / _INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
    return out
