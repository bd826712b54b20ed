# SPDX-License-Identifier: Apache-2.0
"""``config.json`` parsing, validation and presets (``config.py``)."""

from __future__ import annotations

import ast
import copy
import dataclasses
from pathlib import Path

import pytest

from vllm_omni_moss.model_executor.models.moss_tts import config as config_module
from vllm_omni_moss.model_executor.models.moss_tts.config import (
    CODEC_ABILITIES,
    PRESETS,
    load_config,
    parse_config,
    preset_config,
)
from vllm_omni_moss.model_executor.models.moss_tts.state.offsets import offset_table_rows
from vllm_omni_moss.testing import upstream as oracle_module

ROOT = Path(__file__).resolve().parents[4]

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


def test_v2_preset_geometry():
    cfg = preset_config("v2")
    assert (cfg.version, cfg.sampling_rate, cfg.number_channels, cfg.samples_per_frame) == ("v2", 48000, 2, 3840)
    assert cfg.frame_rate == 12.5 and cfg.num_layers == 92
    assert [g.ring_capacity for g in cfg.groups] == [125, 250, 400, 400, 400, 400]
    assert [g.tokens_per_frame for g in cfg.groups] == [1, 2, 4, 8, 16, 32]
    assert [(g.d_model, g.num_heads, g.num_layers) for g in cfg.groups] == [(1280, 20, 32)] + [(768, 12, 12)] * 5
    assert cfg.state_bytes_per_slot(2) == 88_678_400


def test_v1_preset_geometry():
    cfg = preset_config("v1")
    assert (cfg.version, cfg.sampling_rate, cfg.number_channels, cfg.samples_per_frame) == ("v1", 24000, 1, 1920)
    assert [g.ring_capacity for g in cfg.groups] == [125, 250, 500, 1000]  # global 10 s context
    assert [g.input_proj for g in cfg.groups] == [True, True, True, True]
    assert [g.output_proj for g in cfg.groups] == [False, False, False, True]  # identity where dims match


def test_legacy_aliases_and_mirrored_decoder():
    raw = copy.deepcopy(PRESETS["tiny-v2"])
    raw["sample_rate"] = raw.pop("sampling_rate")
    raw["num_channels"] = raw.pop("number_channels")
    raw["model_type"] = "speech_tokenizer"
    raw.pop("decoder_kwargs")
    raw["reversed_decoder_kwargs"] = True
    cfg = parse_config(raw)
    ref = preset_config("tiny-v2")
    assert cfg.groups == ref.groups and cfg.sampling_rate == 48000 and cfg.version == "v2"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("sampling_rate"), "sampling_rate: missing"),
        (lambda d: d.update(downsample_rate=1000), r"decoder_kwargs: upsampling product 7680 != .* = 2000"),
        (lambda d: d["decoder_kwargs"][0].update(norm="rms_norm"), r"decoder_kwargs\[0\].norm: only 'layer_norm'"),
        (
            lambda d: d["decoder_kwargs"][2].update(input_dimension=33),
            r"decoder_kwargs\[2\].input_dimension: expected 32",
        ),
        (lambda d: d["decoder_kwargs"][0].update(num_heads=3), r"decoder_kwargs\[0\].num_heads: d_model 64"),
        (lambda d: d["quantizer_kwargs"].update(quantizer_type="rvq"), "quantizer_kwargs.quantizer_type"),
        (lambda d: d["decoder_kwargs"][1].update(module_type="Conv"), r"decoder_kwargs\[1\].module_type"),
        (lambda d: d["decoder_kwargs"][10].update(context_duration=0.001), r"decoder_kwargs\[10\].context_duration"),
    ],
)
def test_bad_config_names_the_field(edit, message):
    raw = copy.deepcopy(PRESETS["tiny-v2"])
    edit(raw)
    with pytest.raises(ValueError, match=message):
        parse_config(raw)


def test_unknown_preset_and_missing_config(tmp_path):
    with pytest.raises(ValueError, match="unknown codec preset 'v3'; known presets: tiny-v1, tiny-v2, v1, v2"):
        preset_config("v3")
    with pytest.raises(FileNotFoundError, match="codec config not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["decoder_kwargs"][0].update(max_period=0),
            r"decoder_kwargs\[0\].max_period: expected a number > 0",
        ),
        (lambda d: d["decoder_kwargs"][0].update(context_duration=float("nan")), "expected a finite number, got nan"),
        (lambda d: d.update(number_channels="abc"), "number_channels: expected an integer in 1..65536, got 'abc'"),
        (lambda d: d.update(enable_channel_interleave="false"), "enable_channel_interleave: expected true or false"),
        (lambda d: d.update(quantizer_kwargs=[1, 2]), "quantizer_kwargs: expected a JSON object, got list"),
        (lambda d: d["decoder_kwargs"][0].update(num_layers=None), "num_layers: expected an integer in 1..1024"),
        # Absurd sizes are refused by the config, before any tensor of that size is allocated.
        (lambda d: d["decoder_kwargs"][0].update(num_layers=10**6), r"num_layers: expected an integer in 1..1024, got"),
        (
            lambda d: d["decoder_kwargs"][0].update(d_model=2**20),
            r"d_model: expected an integer in 1..65536, got 1048576",
        ),
        (
            lambda d: d["quantizer_kwargs"].update(codebook_size=10**12),
            r"codebook_size: expected an integer in 1..65536",
        ),
        (
            lambda d: d["quantizer_kwargs"].update(num_quantizers=10**7),
            r"num_quantizers: expected an integer in 1..65536",
        ),
        (
            lambda d: d["decoder_kwargs"][0].update(context_duration=1e12),
            r"context_duration: .* tokens, not in 1..1048576",
        ),
    ],
)
def test_bad_config_values_name_the_field(edit, message):
    raw = copy.deepcopy(PRESETS["tiny-v2"])
    edit(raw)
    with pytest.raises(ValueError, match=message):
        parse_config(raw)


def test_non_utf8_config(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\x93\xff{}")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_config(tmp_path)


def test_v2_ring_bytes_per_group():
    # docs/memory.md: bf16 K+V per layer is 2 x heads x C x Dh x 2 bytes.
    cfg = preset_config("v2")
    per_layer = [g.ring_bytes(2) // g.num_layers for g in cfg.groups]
    assert per_layer == [640_000, 768_000, 1_228_800, 1_228_800, 1_228_800, 1_228_800]
    assert [g.head_dim for g in cfg.groups] == [64] * 6
    assert cfg.state_bytes_per_slot(2) == 32 * 640_000 + 12 * 768_000 + 48 * 1_228_800 == 88_678_400
    assert cfg.state_bytes_per_slot(4) == 2 * 88_678_400  # fp32 rings


def test_group_bookkeeping_of_tiny_v2():
    cfg = preset_config("tiny-v2")
    assert [g.index for g in cfg.groups] == [0, 2, 4, 6, 8, 10]
    assert [g.upsample for g in cfg.groups] == [2, 2, 2, 2, 2, 240]
    assert [g.ring_capacity for g in cfg.groups] == [10, 20, 32, 32, 32, 40]
    assert [(g.input_dim, g.output_dim) for g in cfg.groups] == [(24, 64), (32, 32)] + [(16, 32)] * 3 + [(16, 240)]
    assert cfg.group_first_layers == (0, 2, 3, 4, 5, 6) and cfg.num_layers == 7
    assert cfg.channel_interleave and cfg.interleave_factor == 2


def test_version_override_and_codec_version_field():
    raw = copy.deepcopy(PRESETS["tiny-v2"])
    assert parse_config(raw, "v1").version == "v1"
    raw["codec_version"] = "v1"
    cfg = parse_config(raw)
    assert cfg.version == "v1"
    # v1 drops projections whose dims match; tiny-v2's group 1 maps 32 -> 32 channels at d_model 32.
    assert (cfg.groups[1].input_proj, cfg.groups[1].output_proj) == (False, False)
    with pytest.raises(ValueError, match="invalid codec config: version: expected 'v1' or 'v2', got 'v3'"):
        parse_config(raw, "v3")


def test_each_version_has_one_record_of_abilities():
    v1, v2 = preset_config("v1"), preset_config("v2")
    assert (v1.abilities, v2.abilities) == (CODEC_ABILITIES["v1"], CODEC_ABILITIES["v2"])
    assert (v2.abilities.default_ring_semantics, v1.abilities.default_ring_semantics) == ("upstream", "exact")
    assert (v2.abilities.compact_pool, v2.abilities.bf16_on_cuda) == (True, True)
    assert (v1.abilities.compact_pool, v1.abilities.bf16_on_cuda) == (False, False)
    # docs/memory.md: 2 x 92 layers + 6 groups = 190 offset rows for v2; v1 one row per layer.
    assert offset_table_rows(v2) == 190 and offset_table_rows(v1) == v1.num_layers
    # A config of a version without a record cannot be built, parsed or not.
    with pytest.raises(ValueError, match="invalid codec config: version: expected 'v1' or 'v2', got 'v3'"):
        dataclasses.replace(v2, version="v3")


def _version_compares(path: Path) -> list[str]:
    """``x.version == "v2"``-like comparisons (an attribute named ``version`` against a string) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(n, ast.Attribute) and n.attr == "version" for n in sides)
            if named and any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in sides):
                found.append(f"{path}:{node.lineno}")
    return found


def test_no_code_compares_the_codec_version_as_a_string():
    """What a version implies is a field of ``CodecAbilities``; the upstream oracle (``testing/``) mirrors
    upstream's own version switches and is the one exception."""
    package = Path(config_module.__file__).parent  # the codec package, ops and state
    # The fork puts the oracle inside the package (moss_tts/testing/): it is left out there too.
    files = sorted(f for f in package.rglob("*.py") if "testing" not in f.relative_to(package).parts)
    benchmarks = ROOT / "benchmarks" / "tts"  # this repository's layout (a fork keeps them elsewhere)
    files += sorted(benchmarks.rglob("*.py")) if benchmarks.is_dir() else []
    assert len(files) > 40
    assert [hit for f in files for hit in _version_compares(f)] == []
    assert _version_compares(Path(oracle_module.__file__))  # negative control: the oracle does compare


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([1, 2], "invalid codec config: expected a JSON object, got list"),
        ({**PRESETS["tiny-v2"], "decoder_kwargs": []}, "decoder_kwargs: expected a non-empty list of module dicts"),
        (
            {**PRESETS["tiny-v2"], "decoder_kwargs": [], "reversed_decoder_kwargs": True, "encoder_kwargs": None},
            "reversed_decoder_kwargs: needs a non-empty encoder_kwargs list to mirror",
        ),
        (
            {**PRESETS["tiny-v2"], "number_channels": 2, "enable_channel_interleave": False},
            "multi-channel codecs without interleave are not supported",
        ),
        (
            {
                **PRESETS["tiny-v2"],
                "quantizer_kwargs": {**PRESETS["tiny-v2"]["quantizer_kwargs"], "output_dim": 7680},
                "decoder_kwargs": [{"module_type": "PatchedPretransform", "patch_size": 7680}],
            },
            "decoder_kwargs: no Transformer module",
        ),
        ({**PRESETS["tiny-v2"], "quantizer_kwargs": {"num_quantizers": 4}}, "quantizer_kwargs.codebook_size: missing"),
    ],
)
def test_malformed_top_level_fields(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_config(raw)
