# SPDX-License-Identifier: Apache-2.0
"""Decoder geometry of MOSS Audio Tokenizer v1 and v2 codecs.

The official checkpoints ship a ``config.json`` whose ``decoder_kwargs`` list the
decoder modules in execution order: projected causal transformers ("resolution
groups") separated by weight-free ``PatchedPretransform`` upsamplers. This module
parses that file into a frozen :class:`CodecConfig`, validates it, and holds the
built-in presets.

Sources of the facts used here (explained in ``docs/codec_architecture.md``):

* v2 geometry (6 groups, rings 125/250/400/400/400/400 tokens, 48 kHz stereo,
  3840 samples per channel per frame): checkpoint ``OpenMOSS-Team/MOSS-Audio-Tokenizer-v2``,
  see ``docs/codec_architecture.md#resolution-groups``.
* v1 geometry (24 kHz mono, 1920 samples per frame, global 10 s context): the
  default ``decoder_kwargs`` of the official configuration class in
  ``OpenMOSS/MOSS-Audio-Tokenizer`` (four transformers, patches 2·2·2·240).
  vLLM-Omni 0.30.0's vendored v1 defaults list five transformers with a 3840
  product, which contradicts 1920 samples/frame; real checkpoints are always
  read from their own ``config.json``, so only the preset depends on this.
* ``context = int(round(stage_rate * context_duration))`` tokens, where the stage
  rate is the frame rate times the upsampling applied before the stage
  (``MossAudioTokenizerModel.__init__`` in vLLM-Omni 0.30.0's ``audio_tokenizer_v2.py``).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from .checks import is_count

__all__ = [
    "CODEC_ABILITIES",
    "CodecAbilities",
    "CodecConfig",
    "GroupSpec",
    "PRESETS",
    "RING_SEMANTICS",
    "check_ring_semantics",
    "load_config",
    "parse_config",
    "preset_config",
]

_SUPPORTED_QUANTIZERS = ("rlfq", "random_prefix_rlfq")

#: Ring semantics a pool can be built with: ``"upstream"`` (vLLM-Omni 0.30.0's v2 codec: write the chunk into the
#: ring, then attend over the ring) or ``"exact"`` (the v1 codec: attend over the ring before the write followed by
#: the chunk); ``step_metadata.py`` and docs/ring_semantics.md hold the rest.
RING_SEMANTICS = ("upstream", "exact")


def check_ring_semantics(ring_semantics) -> str:
    """``ring_semantics`` if it is one of :data:`RING_SEMANTICS`.

    Raises:
        ValueError: the message lists the choices.
    """
    if ring_semantics not in RING_SEMANTICS:
        raise ValueError(f"unknown ring semantics {ring_semantics!r}; expected one of {RING_SEMANTICS}")
    return ring_semantics


@dataclass(frozen=True)
class CodecAbilities:
    """What serving a codec version takes, one record per version: code asks these fields, never the version.

    Attributes:
        default_ring_semantics: how upstream's attention treats a full ring, ``"upstream"`` (v2) or
            ``"exact"`` (v1) (docs/ring_semantics.md).
        offset_rows_per_layer: rows of upstream's offset table per attention layer: 2 for v2 (attention
            offset and ring end offset), 1 for v1 (docs/memory.md).
        group_offset_rows: whether the offset table also keeps one row per resolution group (v2).
        compact_pool: whether the compact and paged pools and the Triton ring attention serve it; upstream's
            Triton attention replaces only v2 attention modules, so v1 keeps the legacy pool and SDPA.
        bf16_on_cuda: whether ``codec_dtype=auto`` runs it in bfloat16 on CUDA (upstream's ``load_weights`` in
            ``modeling_moss_tts_codec.py``: v2 decoder and decode table in bf16, v1 entirely float32).
        projections_always: whether every transformer module carries input and output projections, even
            where its width equals ``d_model`` (v2 checkpoints; v1 only where the widths differ).
        layer_param_names: a layer's (qkv, attention output, feed-forward in, feed-forward out) weight names
            in the official checkpoint.
    """

    default_ring_semantics: str
    offset_rows_per_layer: int
    group_offset_rows: bool
    compact_pool: bool
    bf16_on_cuda: bool
    projections_always: bool
    layer_param_names: tuple[str, str, str, str]


#: Every codec version this package serves; any other version fails at config load.
CODEC_ABILITIES: dict[str, CodecAbilities] = {
    "v1": CodecAbilities(
        default_ring_semantics="exact",
        offset_rows_per_layer=1,
        group_offset_rows=False,
        compact_pool=False,
        bf16_on_cuda=False,
        projections_always=False,
        layer_param_names=("self_attn.in_projs.0", "self_attn.out_projs.0", "linear1", "linear2"),
    ),
    "v2": CodecAbilities(
        default_ring_semantics="upstream",
        offset_rows_per_layer=2,
        group_offset_rows=True,
        compact_pool=True,
        bf16_on_cuda=True,
        projections_always=True,
        layer_param_names=("self_attn.in_proj", "self_attn.out_proj", "ffn.0", "ffn.2"),
    ),
}


def _version_error(version) -> ValueError:
    return _fail("version", f"expected 'v1' or 'v2', got {version!r}")


@dataclass(frozen=True)
class GroupSpec:
    """One resolution group: a projected causal transformer of the decoder.

    Attributes:
        index: position of the transformer in ``decoder_kwargs`` (the checkpoint prefix
            is ``decoder.{index}.``).
        input_dim / output_dim: channels entering / leaving the group.
        d_model, num_heads, num_layers, dim_feedforward: transformer shape.
        ring_capacity: cells of each ring of this group, in tokens: the last ``ring_capacity`` tokens
            a stream wrote. MOSS codecs size each ring to the attention window (:attr:`window`):
            ``causal_transformer_context_duration`` seconds of this group's tokens (docs/ring_semantics.md).
        tokens_per_frame: tokens of this group per code frame (product of the
            upsampling factors applied before it).
        upsample: factor of the ``PatchedPretransform`` that follows (1 if none).
        layer_scale: initial LayerScale value, or ``None`` when the layers have none.
        max_period: RoPE period.
        input_proj / output_proj: whether the group has a projection matrix. v2
            always has both; v1 omits a projection whose dims match (it may still
            be present in a checkpoint, see ``checkpoint.py``).
    """

    index: int
    input_dim: int
    output_dim: int
    d_model: int
    num_heads: int
    num_layers: int
    dim_feedforward: int
    ring_capacity: int
    tokens_per_frame: int
    upsample: int
    layer_scale: float | None
    max_period: float
    input_proj: bool
    output_proj: bool

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def window(self) -> int:
        """Positions a query attends, in tokens (``0 <= q - p < window``): the ring capacity."""
        return self.ring_capacity

    def ring_bytes(self, element_size: int) -> int:
        """Bytes of one slot's K+V ring for all layers of the group."""
        return 2 * self.num_layers * self.num_heads * self.ring_capacity * self.head_dim * element_size


@dataclass(frozen=True)
class CodecConfig:
    """Validated decoder geometry.

    Attributes:
        version: ``"v1"`` or ``"v2"``: selects ring semantics and checkpoint naming.
        sampling_rate: output rate per channel in Hz.
        downsample_rate: samples per channel per code frame.
        number_channels: output channels (2 for v2 stereo).
        channel_interleave: whether channels are interleaved in time inside the
            model (v2 stereo: L0, R0, L1, R1, ...).
        num_quantizers / codebook_size / codebook_dim / rvq_dim / latent_dim:
            residual-LFQ geometry; ``latent_dim`` is the decoder input width.
        groups: resolution groups in execution order.
        raw: the parsed ``config.json`` dict (normalised copy).
    """

    version: str
    sampling_rate: int
    downsample_rate: int
    number_channels: int
    channel_interleave: bool
    num_quantizers: int
    codebook_size: int
    codebook_dim: int
    rvq_dim: int
    latent_dim: int
    groups: tuple[GroupSpec, ...]
    raw: dict

    def __post_init__(self):
        if self.version not in CODEC_ABILITIES:
            raise _version_error(self.version)

    @property
    def abilities(self) -> CodecAbilities:
        """What serving this codec takes (:data:`CODEC_ABILITIES` of its version)."""
        return CODEC_ABILITIES[self.version]

    @property
    def interleave_factor(self) -> int:
        return self.number_channels if self.channel_interleave and self.number_channels > 1 else 1

    @property
    def frame_rate(self) -> float:
        """Code frames per second (12.5 for both official codecs)."""
        return self.sampling_rate / self.downsample_rate

    @property
    def samples_per_frame(self) -> int:
        """Output samples per channel per code frame."""
        return self.downsample_rate

    @property
    def num_layers(self) -> int:
        return sum(g.num_layers for g in self.groups)

    @property
    def group_first_layers(self) -> tuple[int, ...]:
        """Index of each group's first attention layer, layers numbered ``0..L-1`` in execution order."""
        firsts, n = [], 0
        for g in self.groups:
            firsts.append(n)
            n += g.num_layers
        return tuple(firsts)

    def state_bytes_per_slot(self, element_size: int = 2) -> int:
        """K+V ring bytes of one streaming slot (88,678,400 for v2 in bf16)."""
        return sum(g.ring_bytes(element_size) for g in self.groups)


def _fail(field: str, msg: str) -> ValueError:
    return ValueError(f"invalid codec config: {field}: {msg}")


#: Largest value of an integer geometry field (widths, heads, codebooks, patch sizes; the real v2 codec's
#: largest is 1,024): past it a config describes no codec this package serves, and building it would try to
#: allocate before the checkpoint's tensors are compared. Layers per group and sample rates have their own.
MAX_FIELD = 1 << 16
MAX_LAYERS = 1024
MAX_SAMPLING_RATE = 1 << 20
#: Largest ring, in tokens (the v2 codec's largest is 400).
MAX_RING_TOKENS = 1 << 20


def _int_field(d: dict, key: str, field: str, *, minimum: int = 1, maximum: int = MAX_FIELD) -> int:
    if key not in d:
        raise _fail(field, "missing")
    value = d[key]
    if not is_count(value, minimum) or value > maximum:
        raise _fail(field, f"expected an integer in {minimum}..{maximum}, got {value!r}")
    return value


def _finite_field(d: dict, key: str, field: str, default: float, *, positive: bool) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(field, f"expected a finite number, got {value!r}")
    if positive and value <= 0:
        raise _fail(field, f"expected a number > 0, got {value!r}")
    return float(value)


def _normalise(raw: dict) -> dict:
    """Apply the legacy key aliases of published configs to a copy of ``raw``."""
    d = copy.deepcopy(raw)
    d.pop("model_type", None)
    if "sampling_rate" not in d and "sample_rate" in d:
        d["sampling_rate"] = d.pop("sample_rate")
    if "number_channels" not in d and "num_channels" in d:
        d["number_channels"] = d.pop("num_channels")
    qk = d.get("quantizer_kwargs") or {}
    if not isinstance(qk, dict):
        raise _fail("quantizer_kwargs", f"expected a JSON object, got {type(qk).__name__}")
    qk = dict(qk)
    if "quantizer_type" not in qk and "quantizer_type" in d:
        qk["quantizer_type"] = d["quantizer_type"]
    d["quantizer_kwargs"] = qk
    if not d.get("decoder_kwargs") and d.get("reversed_decoder_kwargs"):
        encoder = d.get("encoder_kwargs")
        if not isinstance(encoder, list) or not encoder:
            raise _fail("reversed_decoder_kwargs", "needs a non-empty encoder_kwargs list to mirror")
        d["decoder_kwargs"] = _mirror(encoder)
    return d


def _mirror(modules: list[dict]) -> list[dict]:
    """The modules in reverse order with each transformer's input and output dims swapped.

    Turns an encoder list into its decoder (``reversed_decoder_kwargs``) and back (presets).
    """
    out = []
    for spec in reversed(modules):
        spec = dict(spec)
        if spec.get("module_type") == "Transformer":
            spec["input_dimension"], spec["output_dimension"] = spec["output_dimension"], spec["input_dimension"]
        out.append(spec)
    return out


def parse_config(raw: dict, version: str | None = None) -> CodecConfig:
    """Parse an official ``config.json`` dict.

    Args:
        raw: the JSON object of the checkpoint's ``config.json``.
        version: ``"v1"`` or ``"v2"``; taken from ``codec_version`` in ``raw``, else
            detected from ``number_channels`` when ``None`` (two or more channels
            means v2, as ``MossTTSCodecDecoder._build_codec`` decides in vLLM-Omni 0.30.0).

    Raises:
        ValueError: naming the field, for missing or inconsistent geometry, wrong
            value types or unsupported module options.
    """
    try:
        return _parse(raw, version)
    except ValueError:
        raise
    except (TypeError, KeyError, AttributeError, OverflowError, RecursionError) as exc:
        raise ValueError(f"invalid codec config: malformed value ({type(exc).__name__}: {exc})") from exc


@dataclass(frozen=True)
class _Header:
    """Top-level fields of ``config.json`` that the groups depend on."""

    version: str
    sampling_rate: int
    downsample_rate: int
    channels: int
    interleave_factor: int
    default_duration: float


def _parse(raw: dict, version: str | None) -> CodecConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"invalid codec config: expected a JSON object, got {type(raw).__name__}")
    d = _normalise(raw)
    header = _parse_header(d, version)
    num_quantizers, codebook_size, codebook_dim, rvq_dim, latent_dim = _parse_quantizer(d["quantizer_kwargs"])
    modules = d.get("decoder_kwargs")
    if not isinstance(modules, list) or not modules:
        raise _fail("decoder_kwargs", "expected a non-empty list of module dicts")
    groups = _parse_groups(modules, header, latent_dim)
    return CodecConfig(
        version=header.version,
        sampling_rate=header.sampling_rate,
        downsample_rate=header.downsample_rate,
        number_channels=header.channels,
        channel_interleave=header.interleave_factor > 1,
        num_quantizers=num_quantizers,
        codebook_size=codebook_size,
        codebook_dim=codebook_dim,
        rvq_dim=rvq_dim,
        latent_dim=latent_dim,
        groups=groups,
        raw=d,
    )


def _parse_header(d: dict, version: str | None) -> _Header:
    """Rates, channels, interleave, codec version and the default context duration."""
    sampling_rate = _int_field(d, "sampling_rate", "sampling_rate", maximum=MAX_SAMPLING_RATE)
    downsample_rate = _int_field(d, "downsample_rate", "downsample_rate", maximum=MAX_SAMPLING_RATE)
    d.setdefault("number_channels", 1)
    channels = _int_field(d, "number_channels", "number_channels")
    interleave = d.get("enable_channel_interleave", True)
    if not isinstance(interleave, bool):
        raise _fail("enable_channel_interleave", f"expected true or false, got {interleave!r}")
    # vLLM-Omni 0.30.0 picks its v2 class for codecs with two or more channels.
    version = version or d.get("codec_version") or ("v2" if channels >= 2 else "v1")
    if version not in CODEC_ABILITIES:
        raise _version_error(version)
    if channels > 1 and not interleave:
        raise _fail("enable_channel_interleave", "multi-channel codecs without interleave are not supported")
    key = "causal_transformer_context_duration"
    return _Header(
        version=version,
        sampling_rate=sampling_rate,
        downsample_rate=downsample_rate,
        channels=channels,
        interleave_factor=channels if channels > 1 else 1,
        default_duration=_finite_field(d, key, key, 10.0, positive=True),
    )


def _parse_quantizer(qk: dict) -> tuple[int, int, int, int, int]:
    """``(num_quantizers, codebook_size, codebook_dim, rvq_dim, latent_dim)`` of ``quantizer_kwargs``."""
    qtype = qk.get("quantizer_type", "rlfq")
    if qtype not in _SUPPORTED_QUANTIZERS:
        raise _fail("quantizer_kwargs.quantizer_type", f"expected one of {_SUPPORTED_QUANTIZERS}, got {qtype!r}")
    keys = ("num_quantizers", "codebook_size", "codebook_dim", "rvq_dim", "output_dim")
    n, size, dim, rvq, latent = (_int_field(qk, k, f"quantizer_kwargs.{k}") for k in keys)
    return n, size, dim, rvq, latent


def _first_stage_rate(modules: list[dict], header: _Header) -> float:
    """Tokens per second entering the first decoder module, after checking the upsampling product.

    Starts from the interleaved sample rate and undoes the upsamplers in reverse, as
    the encoder does, so the float rate matches vLLM-Omni's bit for bit.
    """
    patches = []
    for i, spec in enumerate(modules):
        mtype = spec.get("module_type") if isinstance(spec, dict) else None
        if mtype == "PatchedPretransform":
            patches.append(_int_field(spec, "patch_size", f"decoder_kwargs[{i}].patch_size"))
        elif mtype != "Transformer":
            raise _fail(
                f"decoder_kwargs[{i}].module_type", f"expected 'Transformer' or 'PatchedPretransform', got {mtype!r}"
            )
    hop = header.downsample_rate * header.interleave_factor
    if math.prod(patches) != hop:
        raise _fail(
            "decoder_kwargs",
            f"upsampling product {math.prod(patches)} != downsample_rate x interleaved channels = {hop}",
        )
    rate = float(header.sampling_rate * header.interleave_factor)
    for p in reversed(patches):
        rate /= p
    return rate


def _parse_groups(modules: list[dict], header: _Header, latent_dim: int) -> tuple[GroupSpec, ...]:
    """Walk the decoder modules in order, tracking width, token rate and tokens per frame."""
    rate = _first_stage_rate(modules, header)
    groups: list[GroupSpec] = []
    tokens_per_frame, width = 1, latent_dim
    for i, spec in enumerate(modules):
        if spec["module_type"] == "PatchedPretransform":
            p = spec["patch_size"]
            if width % p:
                raise _fail(f"decoder_kwargs[{i}].patch_size", f"{p} does not divide the {width} incoming channels")
            if groups and groups[-1].upsample == 1 and groups[-1].index == i - 1:
                groups[-1] = replace(groups[-1], upsample=p)
            width, tokens_per_frame, rate = width // p, tokens_per_frame * p, rate * p
            continue
        group = _parse_transformer(spec, i, width, rate, tokens_per_frame, header)
        groups.append(group)
        width = group.output_dim
    if not groups:
        raise _fail("decoder_kwargs", "no Transformer module")
    if width != 1:
        raise _fail("decoder_kwargs", f"the last module must leave 1 channel per interleaved sample, leaves {width}")
    return tuple(groups)


def _parse_transformer(
    spec: dict, i: int, width: int, rate: float, tokens_per_frame: int, header: _Header
) -> GroupSpec:
    """One ``Transformer`` entry of ``decoder_kwargs`` (at index ``i``) as a :class:`GroupSpec`.

    ``width`` is the channel count reaching the module and ``rate`` its token rate in
    tokens per second; the ring capacity is ``round(rate * context_duration)`` as in
    ``MossAudioTokenizerModel.__init__`` of vLLM-Omni 0.30.0.
    """
    f = f"decoder_kwargs[{i}]"
    for key, expected in (("norm", "layer_norm"), ("positional_embedding", "rope"), ("gating", "none")):
        if spec.get(key, expected) != expected:
            raise _fail(f"{f}.{key}", f"only {expected!r} is supported, got {spec[key]!r}")
    if not spec.get("causal", True):
        raise _fail(f"{f}.causal", "the streaming decoder needs causal transformers")
    in_dim = _int_field(spec, "input_dimension", f"{f}.input_dimension")
    out_dim = _int_field(spec, "output_dimension", f"{f}.output_dimension")
    d_model = _int_field(spec, "d_model", f"{f}.d_model")
    heads = _int_field(spec, "num_heads", f"{f}.num_heads")
    if d_model % heads or (d_model // heads) % 2:
        raise _fail(f"{f}.num_heads", f"d_model {d_model} must split into {heads} heads of even size")
    if in_dim != width:
        raise _fail(f"{f}.input_dimension", f"expected {width} (channels reaching this module), got {in_dim}")
    duration = _finite_field(spec, "context_duration", f"{f}.context_duration", header.default_duration, positive=True)
    context = int(round(rate * duration))
    if not 1 <= context <= MAX_RING_TOKENS:
        raise _fail(
            f"{f}.context_duration",
            f"{duration} s at {rate} tokens/s gives a context of {context} tokens, not in 1..{MAX_RING_TOKENS}",
        )
    layer_scale = None
    if spec.get("layer_scale") is not None:
        layer_scale = _finite_field(spec, "layer_scale", f"{f}.layer_scale", 0.0, positive=False)
    projections_always = CODEC_ABILITIES[header.version].projections_always
    return GroupSpec(
        index=i,
        input_dim=in_dim,
        output_dim=out_dim,
        d_model=d_model,
        num_heads=heads,
        num_layers=_int_field(spec, "num_layers", f"{f}.num_layers", maximum=MAX_LAYERS),
        dim_feedforward=_int_field(spec, "dim_feedforward", f"{f}.dim_feedforward"),
        ring_capacity=context,
        tokens_per_frame=tokens_per_frame,
        upsample=1,
        layer_scale=layer_scale,
        max_period=_finite_field(spec, "max_period", f"{f}.max_period", 10000.0, positive=True),
        input_proj=projections_always or in_dim != d_model,
        output_proj=projections_always or out_dim != d_model,
    )


def load_config(path: str | Path, version: str | None = None) -> CodecConfig:
    """Read ``config.json`` (a file, or a checkpoint directory holding one).

    Raises:
        FileNotFoundError: no config file at ``path``.
        ValueError: the file is not valid JSON or the geometry is invalid.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"codec config not found: {p}")
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"invalid codec config: {p} is not valid JSON ({exc})") from exc
    return parse_config(raw, version)


# ----------------------------------------------------------------------------- presets


def _transformer(
    in_dim: int, out_dim: int, d_model: int, heads: int, layers: int, ffn: int, duration: float | None
) -> dict:
    spec = {
        "module_type": "Transformer",
        "input_dimension": in_dim,
        "output_dimension": out_dim,
        "d_model": d_model,
        "num_heads": heads,
        "num_layers": layers,
        "dim_feedforward": ffn,
        "causal": True,
        "norm": "layer_norm",
        "positional_embedding": "rope",
        "max_period": 10000,
        "gating": "none",
        "layer_scale": 0.01,
        "conv_layout": True,
    }
    if duration is not None:
        spec["context_duration"] = duration
    return spec


def _patch(size: int) -> dict:
    return {"module_type": "PatchedPretransform", "patch_size": size}


def _codec(
    *,
    sampling_rate: int,
    downsample_rate: int,
    channels: int,
    decoder: list[dict],
    latent: int,
    rvq: int,
    quantizers: int,
    codebook: int,
    codebook_dim: int,
    duration: float,
) -> dict:
    return {
        "model_type": "moss-audio-tokenizer",
        "sampling_rate": sampling_rate,
        "downsample_rate": downsample_rate,
        "number_channels": channels,
        "enable_channel_interleave": True,
        "causal_transformer_context_duration": duration,
        "encoder_kwargs": _mirror(decoder),
        "decoder_kwargs": decoder,
        "quantizer_type": "rlfq",
        "quantizer_kwargs": {
            "input_dim": latent,
            "rvq_dim": rvq,
            "output_dim": latent,
            "num_quantizers": quantizers,
            "codebook_size": codebook,
            "codebook_dim": codebook_dim,
            "quantizer_type": "rlfq",
        },
    }


def _v2(d1: int, d: int, heads1: int, heads: int, layers1: int, layers: int, latent: int, durations) -> list[dict]:
    half1, half = d1 // 2, d // 2
    return [
        _transformer(latent, d1, d1, heads1, layers1, 4 * d1, durations[0]),
        _patch(2),
        _transformer(half1, d, d, heads, layers, 4 * d, durations[1]),
        _patch(2),
        _transformer(half, d, d, heads, layers, 4 * d, durations[2]),
        _patch(2),
        _transformer(half, d, d, heads, layers, 4 * d, durations[3]),
        _patch(2),
        _transformer(half, d, d, heads, layers, 4 * d, durations[4]),
        _patch(2),
        _transformer(half, 240, d, heads, layers, 4 * d, durations[5]),
        _patch(240),
    ]


def _v1(d1: int, d: int, heads1: int, heads: int, layers1: int, layers: int, latent: int) -> list[dict]:
    half1, half = d1 // 2, d // 2
    return [
        _transformer(latent, d1, d1, heads1, layers1, 4 * d1, None),
        _patch(2),
        _transformer(half1, d, d, heads, layers, 4 * d, None),
        _patch(2),
        _transformer(half, d, d, heads, layers, 4 * d, None),
        _patch(2),
        _transformer(half, 240, d, heads, layers, 4 * d, None),
        _patch(240),
    ]


# Quantizer and context settings shared by the real (v1, v2) and by the tiny presets.
_REAL_QUANTIZER = dict(latent=768, rvq=512, quantizers=32, codebook=1024, codebook_dim=8, duration=10.0)
_TINY_QUANTIZER = dict(latent=24, rvq=16, quantizers=12, codebook=1024, codebook_dim=8, duration=0.8)

PRESETS: dict[str, dict] = {
    # MOSS-Audio-Tokenizer-v2: 92 layers, rings 125/250/400/400/400/400
    # (docs/codec_architecture.md#resolution-groups).
    "v2": _codec(
        sampling_rate=48000,
        downsample_rate=3840,
        channels=2,
        decoder=_v2(1280, 768, 20, 12, 32, 12, 768, (10.0, 10.0, 8.0, 4.0, 2.0, 1.0)),
        **_REAL_QUANTIZER,
    ),
    # MOSS-Audio-Tokenizer (v1): official configuration-class defaults.
    "v1": _codec(
        sampling_rate=24000,
        downsample_rate=1920,
        channels=1,
        decoder=_v1(1280, 768, 20, 12, 32, 12, 768),
        **_REAL_QUANTIZER,
    ),
    # Same structure, small widths, one or two layers per group. Rings of 10, 20,
    # 32, 32, 32 and 40 tokens (10 down to 1.25 frames) wrap within a
    # second of audio; as in v2, a 1-frame chunk fits every ring and the latent
    # width differs from the RVQ width, so the quantizer's output projection exists.
    "tiny-v2": _codec(
        sampling_rate=48000,
        downsample_rate=3840,
        channels=2,
        decoder=_v2(64, 32, 4, 2, 2, 1, 24, (0.8, 0.8, 0.64, 0.32, 0.16, 0.1)),
        **_TINY_QUANTIZER,
    ),
    "tiny-v1": _codec(
        sampling_rate=24000,
        downsample_rate=1920,
        channels=1,
        decoder=_v1(64, 32, 4, 2, 2, 1, 24),
        **_TINY_QUANTIZER,
    ),
}


def preset_config(name: str) -> CodecConfig:
    """The :class:`CodecConfig` of a built-in preset (``v2``, ``v1``, ``tiny-v2``, ``tiny-v1``).

    Raises:
        ValueError: unknown preset name (the message lists the known ones).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown codec preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return parse_config(copy.deepcopy(PRESETS[name]))
