# SPDX-License-Identifier: Apache-2.0
"""Config parsing, checkpoint loading, offline and fixed-width decode, CLI."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from moss_codecs import random_codes

from vllm_omni_moss.model_executor.models.moss_tts import attention as attention_mod
from vllm_omni_moss.model_executor.models.moss_tts.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_random_checkpoint,
)
from vllm_omni_moss.model_executor.models.moss_tts.cli import main
from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS, load_config, parse_config, preset_config
from vllm_omni_moss.model_executor.models.moss_tts.decoder import chunk_schedule

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]

soundfile = pytest.importorskip("soundfile")  # the GPU machine has no soundfile; CI does


# ----------------------------------------------------------------------------- config


def test_v2_preset_geometry():
    cfg = preset_config("v2")
    assert (cfg.version, cfg.sampling_rate, cfg.number_channels, cfg.samples_per_frame) == ("v2", 48000, 2, 3840)
    assert cfg.frame_rate == 12.5 and cfg.num_layers == 92
    assert [g.context for g in cfg.groups] == [125, 250, 400, 400, 400, 400]
    assert [g.tokens_per_frame for g in cfg.groups] == [1, 2, 4, 8, 16, 32]
    assert [(g.d_model, g.num_heads, g.num_layers) for g in cfg.groups] == [(1280, 20, 32)] + [(768, 12, 12)] * 5
    assert cfg.state_bytes_per_slot(2) == 88_678_400


def test_v1_preset_geometry():
    cfg = preset_config("v1")
    assert (cfg.version, cfg.sampling_rate, cfg.number_channels, cfg.samples_per_frame) == ("v1", 24000, 1, 1920)
    assert [g.context for g in cfg.groups] == [125, 250, 500, 1000]  # global 10 s context
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


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_roundtrip_single_and_sharded(tmp_path):
    single = load_checkpoint(save_random_checkpoint("tiny-v2", tmp_path / "a", seed=5))
    sharded_dir = save_random_checkpoint("tiny-v2", tmp_path / "b", seed=5, max_shard_bytes=100_000)
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    sharded = load_checkpoint(sharded_dir)
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name
    other = load_checkpoint(save_random_checkpoint("tiny-v2", tmp_path / "c", seed=6))
    assert not torch.equal(single.lut, other.lut)


def test_encoder_tensors_are_never_read(tmp_path, monkeypatch):
    path = save_random_checkpoint("tiny-v2", tmp_path / "ck", seed=1)
    from safetensors import safe_open

    read = []
    real = safe_open

    class Spy:
        def __init__(self, *a, **k):
            self._h = real(*a, **k)

        def keys(self):
            return self._h.keys()

        def get_tensor(self, name):
            read.append(name)
            return self._h.get_tensor(name)

    monkeypatch.setattr("safetensors.safe_open", Spy)
    load_checkpoint(path)
    assert read and not [n for n in read if n.startswith("encoder.") or ".in_proj." in n and "quantizer" in n]


def _rewrite(path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("decoder.0.transformer.layers.1.ffn.2.weight"),
            "missing decoder.0.transformer.layers.1.ffn.2.weight",
        ),
        (lambda t: t.update({"decoder.0.extra.weight": torch.zeros(1)}), "unexpected tensors: decoder.0.extra.weight"),
        (
            lambda t: t.update({"decoder.2.input_proj.weight": torch.zeros(3, 3)}),
            r"decoder.2.input_proj.weight: shape \(3, 3\), expected \(32, 32\)",
        ),
        (lambda t: t.pop("quantizer.quantizers.3.codebook.weight"), "missing quantizer.quantizers.3.codebook.weight"),
        (
            lambda t: t.update({"decoder.0.transformer.layers.0.linear1.weight": torch.zeros(256, 64)}),
            "duplicate spellings for one tensor",
        ),
        # Non-finite weights; a zero weight-norm direction divides 0 by 0.
        (lambda t: t["decoder.0.transformer.layers.0.norm1.weight"].fill_(float("nan")), "non-finite values"),
        (lambda t: t["quantizer.quantizers.2.codebook.weight"].fill_(float("inf")), "decode table is not finite"),
        (
            lambda t: t["quantizer.quantizers.0.out_proj.parametrizations.weight.original1"][0].zero_(),
            "decode table is not finite",
        ),
    ],
)
def test_bad_checkpoint_lists_the_problem(edit, message, tmp_path):
    path = save_random_checkpoint("tiny-v2", tmp_path / "ck", seed=1)
    _rewrite(path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)


def test_corrupt_safetensors_file(tmp_path):
    path = save_random_checkpoint("tiny-v2", tmp_path / "ck", seed=1)
    (path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_checkpoint(path)


# ----------------------------------------------------------------------------- decode


def test_output_shape_and_dtype(tiny_decoder):
    cfg = tiny_decoder.config
    audio = tiny_decoder.decode(random_codes(tiny_decoder, 2, 5, seed=1))
    assert audio.dtype == torch.float32
    assert audio.shape == (2, cfg.number_channels, 5 * cfg.samples_per_frame)


def test_offline_blocking_equals_one_block(tiny_decoder, monkeypatch):
    codes = random_codes(tiny_decoder, 1, 12, seed=2)
    whole = tiny_decoder.decode(codes)
    monkeypatch.setattr(attention_mod, "OFFLINE_QUERY_BLOCK", 7)  # many blocks, windows straddling them
    blocked = tiny_decoder.decode(codes)
    assert (blocked - whole).abs().max() <= 1e-5 * whole.abs().max()


def test_v1_streaming_equals_offline(ring_decoder_v1):
    codes = random_codes(ring_decoder_v1, 2, 30, seed=3)
    offline = ring_decoder_v1.decode(codes)
    for schedule in ([1, 15], [1, 3, 7, 2], 4):
        streamed = ring_decoder_v1.decode(codes, chunk_frames=schedule)
        assert (streamed - offline).abs().max() <= 1e-5 * offline.abs().max()


def test_v2_streaming_equals_offline_until_the_rings_fill(ring_decoder):
    # Rings of 5 and 10 tokens hold 5 frames: before they fill nothing is evicted, so
    # v2 streaming is exact; afterwards early queries of a chunk lose keys (upstream's
    # write-then-attend semantics), so the outputs part.
    codes = random_codes(ring_decoder, 1, 20, seed=4)
    offline = ring_decoder.decode(codes)
    head = ring_decoder.decode(codes[:, :, :5], chunk_frames=[1, 2, 2])
    assert (head - offline[..., : head.shape[-1]]).abs().max() <= 1e-5 * offline.abs().max()
    assert (ring_decoder.decode(codes, chunk_frames=7) - offline).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("codes", "message"),
    [
        (torch.zeros(2, 3, dtype=torch.long), r"codes must have shape \(n_vq, B, T\), got shape \(2, 3\)"),
        (torch.zeros(2, 1, 3), r"codes must be a signed integer \(or uint8\) tensor"),
        (torch.full((2, 1, 3), 16), r"code 16 is outside the codebook range \[0, 15\]"),
        (torch.zeros(3, 1, 3, dtype=torch.long), "codes have n_vq=3 codebooks; this codec has 1..2"),
    ],
)
def test_decode_rejects_bad_codes(codes, message, ring_decoder):
    with pytest.raises(ValueError, match=message):
        ring_decoder.decode(codes)


def test_closed_stream_and_schedule_errors(ring_decoder):
    with ring_decoder.streaming(1) as stream:
        with pytest.raises(ValueError, match="chunk has batch 2, the stream was opened for 1"):
            stream.decode(random_codes(ring_decoder, 2, 1, seed=1))
    with pytest.raises(RuntimeError, match="stream is closed"):
        stream.decode(random_codes(ring_decoder, 1, 1, seed=1))
    assert chunk_schedule(35, [1, 15]) == [(0, 1), (1, 16), (16, 31), (31, 35)]
    assert chunk_schedule(16, [1, 3, 7, 2]) == [(0, 1), (1, 4), (4, 11), (11, 13), (13, 16)]
    with pytest.raises(ValueError, match="chunk schedule must be positive integers"):
        chunk_schedule(5, [1, 0])


# ----------------------------------------------------------------------------- CLI


def test_cli_make_checkpoint_and_decode_v2(tmp_path, capsys):
    assert main(["make-checkpoint", "--preset", "tiny-v2", str(tmp_path / "ck"), "--seed", "3"]) == 0
    codes = np.random.default_rng(0).integers(0, 1024, size=(12, 18))
    np.save(tmp_path / "codes.npy", codes)
    out = tmp_path / "out.wav"
    assert main(["decode", str(tmp_path / "codes.npy"), "-o", str(out), "--checkpoint", str(tmp_path / "ck")]) == 0
    audio, rate = soundfile.read(out)
    assert rate == 48000 and audio.shape == (18 * 3840, 2)
    printed = capsys.readouterr().out
    assert "decoded 18 frames in 3 chunks" in printed and "real-time factor" in printed
    decoder = load_checkpoint(tmp_path / "ck")
    expected = decoder.decode(torch.from_numpy(codes)[:, None], chunk_frames=[1, 15])[0].T.numpy()
    assert np.array_equal(audio.astype(np.float32), expected)


def test_cli_errors(tmp_path, capsys):
    np.save(tmp_path / "bad.npy", np.zeros((12, 3, 4), dtype=np.int64))
    assert main(["decode", str(tmp_path / "bad.npy"), "-o", str(tmp_path / "x.wav")]) == 2
    assert "codes must have shape (n_vq, T), got (12, 3, 4)" in capsys.readouterr().err
    np.save(tmp_path / "big.npy", np.full((12, 3), 5000))
    assert main(["decode", str(tmp_path / "big.npy"), "-o", str(tmp_path / "x.wav")]) == 2
    err = capsys.readouterr().err
    assert "RANDOM weights" in err and "code 5000 is outside the codebook range [0, 1023]" in err
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text(json.dumps(PRESETS["tiny-v2"]))
    np.save(tmp_path / "ok.npy", np.zeros((12, 3), dtype=np.int64))
    assert (
        main(["decode", str(tmp_path / "ok.npy"), "-o", str(tmp_path / "x.wav"), "--checkpoint", str(tmp_path / "ck")])
        == 2
    )
    assert "no model.safetensors" in capsys.readouterr().err
    assert main(["decode", str(tmp_path / "ok.npy"), "-o", "x.wav", "--chunks", "1,a"]) == 2
    assert "--chunks must be comma-separated positive integers" in capsys.readouterr().err


# ----------------------------------------------------------------------------- hostile input (review findings)


@pytest.mark.parametrize("weight_map", [[1, 2], None, {"decoder.0.input_proj.weight": 3}])
def test_malformed_shard_index(weight_map, tmp_path):
    path = save_random_checkpoint("tiny-v2", tmp_path / "ck", seed=1, max_shard_bytes=100_000)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="corrupt shard index"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["decoder_kwargs"][0].update(max_period=0),
            r"decoder_kwargs\[0\].max_period: expected a number > 0",
        ),
        (lambda d: d["decoder_kwargs"][0].update(context_duration=float("nan")), "expected a finite number, got nan"),
        (lambda d: d.update(number_channels="abc"), "number_channels: expected an integer >= 1, got 'abc'"),
        (lambda d: d.update(enable_channel_interleave="false"), "enable_channel_interleave: expected true or false"),
        (lambda d: d.update(quantizer_kwargs=[1, 2]), "quantizer_kwargs: expected a JSON object, got list"),
        (lambda d: d["decoder_kwargs"][0].update(num_layers=None), "num_layers: expected an integer >= 1"),
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


def test_empty_and_odd_codes_and_schedules(ring_decoder):
    with pytest.raises(ValueError, match=r"T >= 1 frames, got shape \(2, 1, 0\)"):
        ring_decoder.decode(torch.zeros(2, 1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"T >= 1 frames"):
        ring_decoder.decode(torch.zeros(2, 1, 0, dtype=torch.long), chunk_frames=[1, 15])
    with pytest.raises(ValueError, match="signed integer"):
        ring_decoder.decode(torch.zeros(2, 1, 3, dtype=torch.complex64))
    codes = random_codes(ring_decoder, 1, 6, seed=1)
    assert torch.equal(ring_decoder.decode(codes, chunk_frames=np.int64(2)), ring_decoder.decode(codes, chunk_frames=2))
    with pytest.raises(ValueError, match="chunk schedule must be an int or a list of ints, got 1.5"):
        ring_decoder.decode(codes, chunk_frames=1.5)


def test_cli_rejects_bad_output_device_and_preset_before_decoding(tmp_path, capsys):
    np.save(tmp_path / "ok.npy", np.zeros((12, 3), dtype=np.int64))
    codes = str(tmp_path / "ok.npy")
    cases = [
        (["-o", str(tmp_path / "x.mp3")], "must be a .wav file path"),
        (["-o", str(tmp_path)], "must be a .wav file path"),
        (["-o", "/proc/x.wav"], "cannot write /proc/x.wav"),
        (["-o", str(tmp_path / "x.wav"), "--preset", "bogus"], "unknown preset 'bogus'"),
        (["-o", str(tmp_path / "x.wav"), "--device", "nonsense"], "is not a torch device"),
        (["-o", str(tmp_path / "x.wav"), "--device", "meta"], "only cpu and cuda devices decode"),
    ]
    for extra, message in cases:
        assert main(["decode", codes, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra
    np.save(tmp_path / "c.npy", np.zeros((12, 3), dtype=np.complex64))
    assert main(["decode", str(tmp_path / "c.npy"), "-o", str(tmp_path / "x.wav")]) == 2
    assert "codes must be integers, got dtype torch.complex64" in capsys.readouterr().err
