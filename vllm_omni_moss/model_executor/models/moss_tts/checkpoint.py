# SPDX-License-Identifier: Apache-2.0
"""Official MOSS Audio Tokenizer checkpoints: load the decoder, write random ones.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or a
sharded ``model.safetensors.index.json``. Only decoder and quantizer-decode tensors
are read; encoder tensors (and the quantizer's encode-side projections) are skipped
by name, never materialised.

The tensor names, the weight-norm folding and the decode table are described in
``docs/checkpoint.md`` (facts taken from ``MossTTSCodecDecoder.load_weights`` and
``MossAudioTokenizerResidualLFQ.build_decode_lut`` of vLLM-Omni 0.30.0).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import CodecAbilities, CodecConfig, load_config, preset_config
from .decoder import CodecDecoder

__all__ = [
    "FILE_MODE",
    "CheckpointError",
    "checkpoint_files",
    "decoder_from_tensors",
    "load_checkpoint",
    "official_decoder_names",
    "random_checkpoint_bytes",
    "random_checkpoint_shapes",
    "random_official_state_dict",
    "resolve_checkpoint_dir",
    "save_random_checkpoint",
]

#: What :func:`resolve_checkpoint_dir` fetches of a Hugging Face repository.
CHECKPOINT_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json"]


def resolve_checkpoint_dir(path: str, download_dir: str | None = None) -> Path:
    """A local checkpoint directory for ``path`` (a directory, or a Hugging Face repo id fetched into the
    cache ``download_dir``).

    Raises:
        FileNotFoundError: not a directory and it cannot be downloaded.
    """
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, allow_patterns=CHECKPOINT_FILES, cache_dir=download_dir))
    except Exception as exc:
        raise FileNotFoundError(
            f"MOSS codec checkpoint {path!r} is not a directory and could not be fetched: {exc}"
        ) from exc


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


def is_skipped(name: str) -> bool:
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
        self._handles: dict[Path, object] = {}
        #: tensor name -> file holding it
        self.where: dict[str, Path] = {}
        index = directory / _INDEX
        single = directory / _SINGLE
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

    def _keys(self, path: Path) -> list[str]:
        return list(self._handle(path).keys())

    def _handle(self, path: Path):
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
    _check_size(config, src, directory)
    return decoder_from_tensors(config, src, f"checkpoint {directory}", device)


def decoder_from_tensors(config: CodecConfig, src, origin: str, device: torch.device | str) -> CodecDecoder:
    """The decoder of ``config`` from official-named tensors: ``src.where`` holds their names, ``src.get(name)``
    returns one (a checkpoint's ``_TensorSource``, or tensors in memory). ``origin`` names them in errors.

    Raises:
        CheckpointError: as :func:`load_checkpoint`.
    """
    # float32 whatever the default dtype (vLLM loads weights under the model's, often bfloat16): the tensors are
    # copied into these parameters, so a bfloat16 default would round a float32 codec.
    decoder = CodecDecoder(config).float()
    problems: list[str] = []
    used = _load_decoder_weights(decoder, src, problems)
    lut, bias = _build_lut(config, src, problems)
    # Catches NaN/Inf codebooks or projections and all-zero weight-norm directions (0/0).
    if not problems and not (torch.isfinite(lut).all() and torch.isfinite(bias).all()):
        problems.append(
            "quantizer decode table is not finite: NaN/Inf in a codebook or projection, or a zero weight-norm v row"
        )
    _check_unexpected(config, src, used, problems)
    if problems:
        raise CheckpointError(f"{origin} does not fit its config.json:\n  - " + "\n  - ".join(problems))
    with torch.no_grad():
        decoder.lut.copy_(lut.float())
        decoder.lut_bias.copy_(bias.float())
    return decoder.to_serving(device)


def _check_size(config, src: _TensorSource, directory: Path) -> None:
    """Refuse a ``config.json`` whose decoder could not come from these files, before allocating it: its
    fp32 weights and decode table (counted on the meta device) must fit in twice the bytes of the
    checkpoint's tensor files (bf16 files hold half) plus 64 MiB (a decode table larger than its codebooks)."""
    with torch.device("meta"):
        meta = CodecDecoder(config)
    need = 4 * sum(t.numel() for t in [*meta.parameters(), *meta.buffers()])
    have = sum(f.stat().st_size for f in set(src.where.values()))
    if need > 2 * have + (64 << 20):
        raise CheckpointError(
            f"checkpoint {directory} does not fit its config.json: the config describes a decoder of {need} bytes "
            f"in float32, but the checkpoint's tensor files hold {have} bytes"
        )


def _load_decoder_weights(decoder: CodecDecoder, src: _TensorSource, problems: list[str]) -> set[str]:
    """Copy every decoder transformer tensor into ``decoder``; return the official names read.

    Problems (missing, duplicated, mis-shaped or non-finite tensors) are appended to ``problems``.
    """
    params = dict(decoder.named_parameters())
    used: set[str] = set()
    for ours, names in official_decoder_names(decoder.config).items():
        optional = ours.startswith("?")
        ours = ours.lstrip("?")
        found = [n for n in names if n in src.where]
        used.update(found)
        if len(found) > 1:
            problems.append(f"duplicate spellings for one tensor: {', '.join(found)}")
        elif not found:
            if not optional:
                problems.append(f"missing {names[0]}")
        elif optional:
            _load_optional_projection(decoder, ours, found[0], src.get(found[0]), problems)
        else:
            _copy_checked(params[ours], found[0], src.get(found[0]), problems)
    return used


def _copy_checked(target: torch.Tensor, name: str, tensor: torch.Tensor, problems: list[str]) -> None:
    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
        problems.append(f"{name}: non-finite values (NaN or Inf)")
    elif tuple(tensor.shape) != tuple(target.shape):
        problems.append(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    else:
        with torch.no_grad():
            target.copy_(tensor)


def _load_optional_projection(
    decoder: CodecDecoder, ours: str, name: str, tensor: torch.Tensor, problems: list[str]
) -> None:
    """Install a v1 projection whose dims match (identity by default) because the checkpoint has one.

    ``ours`` is ``groups.{g}.input_proj.weight`` or ``groups.{g}.output_proj.weight``.
    """
    _, g, attr, _ = ours.split(".")
    spec = decoder.config.groups[int(g)]
    shape = (spec.d_model, spec.input_dim) if attr == "input_proj" else (spec.output_dim, spec.d_model)
    if tuple(tensor.shape) != shape:
        problems.append(f"{name}: shape {tuple(tensor.shape)}, expected {shape}")
        return
    proj = torch.nn.Linear(shape[1], shape[0], bias=False)
    proj.weight = torch.nn.Parameter(tensor.float().clone())
    setattr(decoder.groups[int(g)], attr, proj)


def _check_unexpected(config: CodecConfig, src: _TensorSource, used: set[str], problems: list[str]) -> None:
    """Report checkpoint tensors that are neither decoder, decode-table nor skipped encoder tensors."""
    quantizer_used = {f"quantizer.quantizers.{k}.codebook.weight" for k in range(config.num_quantizers)}
    for prefix in _quantizer_names(config):
        quantizer_used.update(_weight_norm_names(prefix))
    unexpected = sorted(n for n in src.where if n not in used and n not in quantizer_used and not is_skipped(n))
    if unexpected:
        shown = ", ".join(unexpected[:20]) + (f" (+{len(unexpected) - 20} more)" if len(unexpected) > 20 else "")
        problems.append(f"unexpected tensors: {shown}")


# --------------------------------------------------------------------------- writing

#: Permission bits of every file :func:`save_random_checkpoint` writes: readable by everyone,
#: like a downloaded checkpoint (safetensors alone creates owner-only files).
FILE_MODE = 0o644


@dataclass(frozen=True)
class _Draw:
    """Tensors drawn together from the RNG, in checkpoint order: their shapes and how to draw them."""

    shapes: dict[str, tuple[int, ...]]
    draw: Callable[[torch.Generator], dict[str, torch.Tensor]]


def _one(name: str, shape: tuple[int, ...], make: Callable[[torch.Generator], torch.Tensor]) -> _Draw:
    return _Draw({name: shape}, lambda gen: {name: make(gen)})


def _linear(name: str, out_dim: int, in_dim: int) -> _Draw:
    return _one(name, (out_dim, in_dim), lambda gen: torch.randn(out_dim, in_dim, generator=gen) / math.sqrt(in_dim))


def _weight_norm_conv(out_dim: int, in_dim: int, prefix: str) -> _Draw:
    """A weight-normalised 1x1 convolution: g ``[out, 1, 1]``, v ``[out, in, 1]``, bias ``[out]``."""
    g_name, v_name = f"{prefix}.parametrizations.weight.original0", f"{prefix}.parametrizations.weight.original1"

    def draw(gen: torch.Generator) -> dict[str, torch.Tensor]:
        v = torch.randn(out_dim, in_dim, 1, generator=gen)
        jitter = 1.0 + 0.1 * torch.randn(out_dim, 1, 1, generator=gen)
        g = v.norm(dim=(1, 2), keepdim=True) * jitter / math.sqrt(in_dim)
        return {g_name: g, v_name: v, f"{prefix}.bias": 0.02 * torch.randn(out_dim, generator=gen)}

    return _Draw({g_name: (out_dim, 1, 1), v_name: (out_dim, in_dim, 1), f"{prefix}.bias": (out_dim,)}, draw)


def _transformer_draws(spec: dict, prefix: str, abilities: CodecAbilities) -> Iterator[_Draw]:
    """Tensors of one ``Transformer`` module entry, named as the official checkpoint of the codec spells them."""
    proj_always = abilities.projections_always
    d, ff = spec["d_model"], spec["dim_feedforward"]
    i, o = spec["input_dimension"], spec["output_dimension"]
    if proj_always or i != d:
        yield _linear(f"{prefix}.input_proj.weight", d, i)
    if proj_always or o != d:
        yield _linear(f"{prefix}.output_proj.weight", o, d)
    names = abilities.layer_param_names
    scale = spec.get("layer_scale")
    for j in range(spec["num_layers"]):
        p = f"{prefix}.transformer.layers.{j}."
        for n in ("norm1", "norm2"):
            yield _one(f"{p}{n}.weight", (d,), lambda gen: 1.0 + 0.1 * torch.randn(d, generator=gen))
            yield _one(f"{p}{n}.bias", (d,), lambda gen: 0.1 * torch.randn(d, generator=gen))
        for name, (rows, cols) in zip(names, ((3 * d, d), (d, d), (ff, d), (d, ff))):
            yield _linear(f"{p}{name}.weight", rows, cols)
        if scale is not None:
            for n in ("layer_scale_1", "layer_scale_2"):
                yield _one(
                    f"{p}{n}.scale", (d,), lambda gen: float(scale) * (1.0 + 0.1 * torch.randn(d, generator=gen))
                )


def _random_draws(config: CodecConfig) -> Iterator[_Draw]:
    """Every tensor of a random official checkpoint of ``config``, encoder included, in writing order."""
    raw = config.raw
    for i, spec in enumerate(raw.get("encoder_kwargs") or []):
        if spec.get("module_type") == "Transformer":
            yield from _transformer_draws(spec, f"encoder.{i}", config.abilities)
    latent_in = raw["quantizer_kwargs"].get("input_dim", config.latent_dim)
    if latent_in != config.rvq_dim:
        yield _weight_norm_conv(config.rvq_dim, latent_in, "quantizer.input_proj")
    if config.rvq_dim != config.latent_dim:
        yield _weight_norm_conv(config.latent_dim, config.rvq_dim, "quantizer.output_proj")
    book = (config.codebook_size, config.codebook_dim)
    for k in range(config.num_quantizers):
        p = f"quantizer.quantizers.{k}"
        if config.rvq_dim != config.codebook_dim:
            yield _weight_norm_conv(config.codebook_dim, config.rvq_dim, f"{p}.in_proj")
            yield _weight_norm_conv(config.rvq_dim, config.codebook_dim, f"{p}.out_proj")
        yield _one(f"{p}.codebook.weight", book, lambda gen: torch.randn(*book, generator=gen))
    for spec in config.groups:
        module = raw["decoder_kwargs"][spec.index]
        yield from _transformer_draws(module, f"decoder.{spec.index}", config.abilities)


def random_official_state_dict(config: CodecConfig, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` of a random fp32 checkpoint in official naming.

    Includes encoder tensors and the quantizer's encode-side projections, so loaders
    exercise skipping them. Deterministic for a given ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)
    for item in _random_draws(config):
        yield from item.draw(gen).items()


def random_checkpoint_shapes(config: CodecConfig) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every tensor of a random checkpoint of ``config``, in writing order,
    without drawing a tensor (all fp32)."""
    return [(name, shape) for item in _random_draws(config) for name, shape in item.shapes.items()]


def random_checkpoint_bytes(config: CodecConfig) -> int:
    """Bytes of fp32 tensor data in a random checkpoint of ``config`` (encoder included), computed
    from shapes without drawing a tensor: 8,494,804,992 for the ``v2`` preset."""
    return sum(4 * math.prod(shape) for _, shape in random_checkpoint_shapes(config))


def _shard_plan(draws: list[_Draw], max_shard_bytes: int) -> dict[str, int]:
    """Tensor name -> shard index: tensors fill a shard in order until the next would pass the limit."""
    plan: dict[str, int] = {}
    shard, size, count = 0, 0, 0
    for item in draws:
        for name, shape in item.shapes.items():
            nbytes = 4 * math.prod(shape)
            if count and size + nbytes > max_shard_bytes:
                shard, size, count = shard + 1, 0, 0
            plan[name] = shard
            size, count = size + nbytes, count + 1
    return plan


def _write_file(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    path.chmod(FILE_MODE)


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(FILE_MODE)


def _write_shards(
    draws: list[_Draw], plan: dict[str, int], paths: list[Path], seed: int, progress: Callable[[int], object] | None
) -> None:
    """Draw the tensors in order and write each shard as soon as its last tensor is drawn."""
    gen = torch.Generator().manual_seed(seed)
    shard, tensors = 0, {}
    for item in draws:
        for name, tensor in item.draw(gen).items():
            if plan[name] != shard:
                _save_shard(tensors, paths[shard])
                shard, tensors = plan[name], {}
            tensors[name] = tensor.contiguous()
            if progress is not None:
                progress(tensor.numel() * tensor.element_size())
    _save_shard(tensors, paths[shard])


def checkpoint_files(path: str | Path) -> list[Path]:
    """The checkpoint files (``config.json``, ``model*.safetensors``, shard index) already in ``path``."""
    out = Path(path)
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if p.name in ("config.json", _INDEX) or p.match("model*.safetensors"))


def save_random_checkpoint(
    preset: str | CodecConfig,
    path: str | Path,
    seed: int = 0,
    max_shard_bytes: int = 2 * 1024**3,
    *,
    overwrite: bool = True,
    progress: Callable[[int], object] | None = None,
) -> Path:
    """Write a random checkpoint in the official format to directory ``path``.

    Tensors are drawn shard by shard and each shard is written as soon as it is full,
    so at most one shard (``max_shard_bytes``) of tensors is in memory. Every file gets
    mode :data:`FILE_MODE` (0644).

    Args:
        preset: a preset name (``v2``, ``v1``, ``tiny-v2``, ``tiny-v1``) or a config.
        path: output directory (created).
        seed: RNG seed.
        max_shard_bytes: above this total size tensors are split into
            ``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``.
        overwrite: replace the checkpoint files already in ``path`` (the default, which test
            fixtures rely on); ``False`` refuses, as ``vllm-omni-moss make-checkpoint`` does
            without ``--force``.
        progress: called with the byte count of each tensor as it is drawn (e.g. a tqdm
            bar's ``update``); the counts add up to :func:`random_checkpoint_bytes`.
    Returns:
        The directory.
    Raises:
        FileExistsError: ``path`` already holds checkpoint files (:func:`checkpoint_files`)
            and ``overwrite`` is false; nothing is written.
        ValueError: unknown preset name.
        OSError: the directory or a file cannot be written.
    """
    config = preset_config(preset) if isinstance(preset, str) else preset
    out = Path(path)
    existing = checkpoint_files(out)
    if existing and not overwrite:
        names = ", ".join(p.name for p in existing[:3]) + (", ..." if len(existing) > 3 else "")
        raise FileExistsError(f"{out} already holds a checkpoint ({names}); refusing to overwrite it")
    out.mkdir(parents=True, exist_ok=True)
    for stale in existing:
        stale.unlink()
    raw = dict(config.raw)
    raw.setdefault("model_type", "moss-audio-tokenizer")
    _write_file(out / "config.json", json.dumps(raw, indent=2) + "\n")
    draws = list(_random_draws(config))
    plan = _shard_plan(draws, max_shard_bytes)
    count = max(plan.values()) + 1
    files = [_SINGLE] if count == 1 else [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
    _write_shards(draws, plan, [out / f for f in files], seed, progress)
    if count > 1:
        weight_map = {name: files[k] for name, k in plan.items()}
        _write_file(out / _INDEX, json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
    return out
