# SPDX-License-Identifier: Apache-2.0
"""The official MOSS-Audio-Tokenizer format at toy widths: tiny ``config.json`` dicts and checkpoint names.

Import-light: the standard library only. :func:`tiny_v2_config` / :func:`tiny_v1_config` give official-format
configurations upstream's codec files build; :func:`official_name` maps upstream's parameter names to the
official checkpoint keys and :func:`loader_target_name` applies upstream 0.30.0's loader rules to a key.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["TINY_LATENT_DIM", "loader_target_name", "official_name", "tiny_v1_config", "tiny_v2_config"]

# ---------------------------------------------------------------------------------------------
# Tiny official-format configurations
# ---------------------------------------------------------------------------------------------


def _transformer_spec(
    input_dimension: int,
    output_dimension: int,
    *,
    d_model: int = 32,
    num_heads: int = 2,
    num_layers: int = 1,
    dim_feedforward: int = 64,
    context_duration: float | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "module_type": "Transformer",
        "input_dimension": input_dimension,
        "output_dimension": output_dimension,
        "d_model": d_model,
        "num_heads": num_heads,
        "num_layers": num_layers,
        "dim_feedforward": dim_feedforward,
        "causal": True,
        "norm": "layer_norm",
        "positional_embedding": "rope",
        "max_period": 10000,
        "gating": "none",
        "layer_scale": 0.01,
        "conv_layout": True,
    }
    if context_duration is not None:
        spec["context_duration"] = context_duration
    return spec


def _patch(size: int) -> dict[str, Any]:
    return {"module_type": "PatchedPretransform", "patch_size": size}


def _quantizer_kwargs(latent_dim: int) -> dict[str, Any]:
    # latent_dim != rvq_dim so that the outer weight-normalised projections exist, as in the real
    # checkpoints (768 vs 512); equal dims would make upstream substitute Identity for them.
    return {
        "input_dim": latent_dim,
        "rvq_dim": 16,
        "output_dim": latent_dim,
        "num_quantizers": 4,
        "codebook_size": 16,
        "codebook_dim": 4,
        "quantizer_type": "rlfq",
    }


TINY_LATENT_DIM = 24
"""Decoder input width (= quantizer input/output dim) of the tiny presets (768 in the real codecs)."""


def tiny_v2_config(context_durations: tuple[float, ...] = (0.8, 0.8, 0.4, 0.2, 0.1, 0.05)) -> dict[str, Any]:
    """Official-format ``config.json`` dict with the v2 structure at toy widths.

    48 kHz stereo interleaved (96 kHz internal), downsample 3840 per channel (12.5 Hz frames),
    six decoder transformers (d_model 32, 2 heads of 16, FFN 64; 2 layers in the first, 1 in the
    others) separated by patches 2, 2, 2, 2, 2, 240. ``context_durations`` are the per-module
    windows in seconds in decoder order; the default gives rings of 10, 20, 20, 20, 20, 20 tokens
    at stage rates 12.5, 25, 50, 100, 200, 400 Hz. Note the last stage emits 32 tokens per frame,
    so with the default every streaming chunk is larger than its 20-token ring.
    """
    if len(context_durations) != 6:
        raise ValueError("tiny v2 has six decoder transformers")
    d = TINY_LATENT_DIM
    c = context_durations
    decoder = [
        _transformer_spec(d, 32, num_layers=2, context_duration=c[0]),
        _patch(2),
        _transformer_spec(16, 32, context_duration=c[1]),
        _patch(2),
        _transformer_spec(16, 32, context_duration=c[2]),
        _patch(2),
        _transformer_spec(16, 32, context_duration=c[3]),
        _patch(2),
        _transformer_spec(16, 32, context_duration=c[4]),
        _patch(2),
        _transformer_spec(16, 240, context_duration=c[5]),
        _patch(240),
    ]
    # Mirror image: the encoder must end at the decoder's starting rate or upstream refuses to build.
    encoder = [
        _patch(240),
        _transformer_spec(240, 16, context_duration=c[5]),
        _patch(2),
        _transformer_spec(32, 16, context_duration=c[4]),
        _patch(2),
        _transformer_spec(32, 16, context_duration=c[3]),
        _patch(2),
        _transformer_spec(32, 16, context_duration=c[2]),
        _patch(2),
        _transformer_spec(32, 16, context_duration=c[1]),
        _patch(2),
        _transformer_spec(32, d, num_layers=2, context_duration=c[0]),
    ]
    return {
        "model_type": "moss-audio-tokenizer",
        "sampling_rate": 48000,
        "downsample_rate": 3840,
        "number_channels": 2,
        "enable_channel_interleave": True,
        "causal_transformer_context_duration": 10.0,
        "encoder_kwargs": encoder,
        "decoder_kwargs": decoder,
        "quantizer_type": "rlfq",
        "quantizer_kwargs": _quantizer_kwargs(d),
    }


def tiny_v1_config(context_duration: float = 0.8) -> dict[str, Any]:
    """Official-format ``config.json`` dict with the v1 structure at toy widths.

    24 kHz mono, downsample 1920 (12.5 Hz frames), four decoder transformers (d_model 32, 2 heads,
    FFN 64; 2 layers in the first) separated by patches 2, 2, 2, 240, one global
    ``causal_transformer_context_duration`` (default 0.8 s: rings of 10, 20, 40, 80 tokens at
    12.5, 25, 50, 100 Hz). Widths follow upstream's v1 default layout, so decoder stages whose
    output width equals d_model and encoder stages whose input width equals d_model have no
    projection tensor (upstream v1 builds Identity there).
    """
    d = TINY_LATENT_DIM
    decoder = [
        _transformer_spec(d, 32, num_layers=2),
        _patch(2),
        _transformer_spec(16, 32),
        _patch(2),
        _transformer_spec(16, 32),
        _patch(2),
        _transformer_spec(16, 240),
        _patch(240),
    ]
    encoder = [
        _patch(240),
        _transformer_spec(240, 16),
        _patch(2),
        _transformer_spec(32, 16),
        _patch(2),
        _transformer_spec(32, 16),
        _patch(2),
        _transformer_spec(32, d, num_layers=2),
    ]
    return {
        "model_type": "moss-audio-tokenizer",
        "sampling_rate": 24000,
        "downsample_rate": 1920,
        "number_channels": 1,
        "enable_channel_interleave": True,
        "causal_transformer_context_duration": context_duration,
        "encoder_kwargs": encoder,
        "decoder_kwargs": decoder,
        "quantizer_type": "rlfq",
        "quantizer_kwargs": _quantizer_kwargs(d),
    }


# ---------------------------------------------------------------------------------------------
# Official checkpoint naming
# ---------------------------------------------------------------------------------------------

_STAGE = r"(?P<stage>(?:encoder|decoder)\.\d+)"
_LAYER = _STAGE + r"\.transformer\.layers\.(?P<layer>\d+)"

# Upstream parameter name -> official checkpoint name, per codec version. Quantizer parameters
# (weight-norm g/v, biases, codebooks) are named identically on both sides and pass through.
_TO_OFFICIAL: dict[str, list[tuple[re.Pattern[str], str]]] = {
    "v1": [
        (re.compile(_STAGE + r"\.in_proj\.weight$"), r"\g<stage>.input_proj.weight"),
        (re.compile(_STAGE + r"\.out_proj\.weight$"), r"\g<stage>.output_proj.weight"),
        (
            re.compile(_LAYER + r"\.attn\.in_proj\.weight$"),
            r"\g<stage>.transformer.layers.\g<layer>.self_attn.in_projs.0.weight",
        ),
        (
            re.compile(_LAYER + r"\.attn\.out_proj\.weight$"),
            r"\g<stage>.transformer.layers.\g<layer>.self_attn.out_projs.0.weight",
        ),
        (re.compile(_LAYER + r"\.ff1\.weight$"), r"\g<stage>.transformer.layers.\g<layer>.linear1.weight"),
        (re.compile(_LAYER + r"\.ff2\.weight$"), r"\g<stage>.transformer.layers.\g<layer>.linear2.weight"),
        (re.compile(_LAYER + r"\.ls1\.scale$"), r"\g<stage>.transformer.layers.\g<layer>.layer_scale_1.scale"),
        (re.compile(_LAYER + r"\.ls2\.scale$"), r"\g<stage>.transformer.layers.\g<layer>.layer_scale_2.scale"),
        (re.compile(_LAYER + r"\.norm[12]\.(?:weight|bias)$"), r"\g<0>"),
        (re.compile(r"^quantizer\..+$"), r"\g<0>"),
    ],
    "v2": [
        (re.compile(_STAGE + r"\.(?:input|output)_proj\.weight$"), r"\g<0>"),
        (
            re.compile(_LAYER + r"\.self_attn\.in_projs\.0\.weight$"),
            r"\g<stage>.transformer.layers.\g<layer>.self_attn.in_proj.weight",
        ),
        (
            re.compile(_LAYER + r"\.self_attn\.out_projs\.0\.weight$"),
            r"\g<stage>.transformer.layers.\g<layer>.self_attn.out_proj.weight",
        ),
        (re.compile(_LAYER + r"\.linear1\.weight$"), r"\g<stage>.transformer.layers.\g<layer>.ffn.0.weight"),
        (re.compile(_LAYER + r"\.linear2\.weight$"), r"\g<stage>.transformer.layers.\g<layer>.ffn.2.weight"),
        (re.compile(_LAYER + r"\.layer_scale_[12]\.scale$"), r"\g<0>"),
        (re.compile(_LAYER + r"\.norm[12]\.(?:weight|bias)$"), r"\g<0>"),
        (re.compile(r"^quantizer\..+$"), r"\g<0>"),
    ],
}

# The name rewriting upstream's stage loader applies to a checkpoint key that is not already an
# exact parameter name: the FIRST (substring -> replacement) pair whose substring occurs wins and
# is applied once. One ordered table serves both codec versions; it is restated here (not
# imported: its module needs vLLM) so a checkpoint we write is accepted exactly as upstream would.
_LOADER_RULES: tuple[tuple[str, str], ...] = (
    (".self_attn.in_projs.0.", ".attn.in_proj."),
    (".self_attn.out_projs.0.", ".attn.out_proj."),
    (".linear1.", ".ff1."),
    (".linear2.", ".ff2."),
    (".self_attn.in_proj.", ".self_attn.in_projs.0."),
    (".self_attn.out_proj.", ".self_attn.out_projs.0."),
    (".ffn.0.", ".linear1."),
    (".ffn.2.", ".linear2."),
    (".layer_scale_1.", ".ls1."),
    (".layer_scale_2.", ".ls2."),
    (".input_proj.", ".in_proj."),
    (".output_proj.", ".out_proj."),
)


def official_name(upstream_name: str, version: str) -> str:
    """Official checkpoint key for one of upstream's parameter names (``version`` "v1"/"v2")."""
    for pattern, replacement in _TO_OFFICIAL[version]:
        match = pattern.match(upstream_name)
        if match is not None:
            return match.expand(replacement)
    raise KeyError(f"no official name known for upstream {version} parameter {upstream_name!r}")


def loader_target_name(checkpoint_name: str, parameter_names: set[str] | dict[str, Any]) -> str:
    """Parameter a checkpoint key lands in under upstream 0.30.0's codec loader rules.

    Exact parameter names win; otherwise the first matching rewrite rule is applied. The result
    may still be absent from ``parameter_names``: upstream then rejects the checkpoint.
    """
    if checkpoint_name in parameter_names:
        return checkpoint_name
    for source, target in _LOADER_RULES:
        if source in checkpoint_name:
            return checkpoint_name.replace(source, target)
    return checkpoint_name
