# SPDX-License-Identifier: Apache-2.0
"""Official checkpoint loading and random checkpoint writing (``checkpoint.py``)."""

from __future__ import annotations

import json
import stat

import pytest
import torch
from moss_codecs import random_codes

from vllm_omni_moss.model_executor.models.moss_tts.checkpoint import (
    FILE_MODE,
    CheckpointError,
    checkpoint_files,
    load_checkpoint,
    random_checkpoint_bytes,
    random_checkpoint_shapes,
    random_official_state_dict,
    save_random_checkpoint,
)
from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


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


def test_a_config_far_larger_than_its_tensors_is_refused_before_allocating(tmp_path, monkeypatch):
    # tiny-v2's tensors under a config of 1,024 layers of width 4,096 per group: the decoder it describes
    # (about 400 GB in fp32) is refused from its byte count alone, on the meta device.
    from vllm_omni_moss.model_executor.models.moss_tts import checkpoint

    path = save_random_checkpoint("tiny-v2", tmp_path / "ck", seed=1)
    raw = json.loads((path / "config.json").read_text())
    for spec in raw["decoder_kwargs"]:
        if "num_layers" in spec:
            spec.update(num_layers=1024, d_model=4096, dim_feedforward=4096)
    (path / "config.json").write_text(json.dumps(raw))
    built = []
    monkeypatch.setattr(checkpoint, "CodecDecoder", lambda config: built.append(torch.empty(0).device) or 1 / 0)
    with pytest.raises(ZeroDivisionError):  # the meta-device count builds it first: under torch.device("meta")
        load_checkpoint(path)
    assert str(built[0]) == "meta"
    monkeypatch.undo()
    with pytest.raises(
        CheckpointError, match=r"does not fit its config.json: the config describes a decoder of \d+ bytes"
    ):
        load_checkpoint(path)


def test_corrupt_safetensors_file(tmp_path):
    path = save_random_checkpoint("tiny-v2", tmp_path / "ck", seed=1)
    (path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_checkpoint(path)


@pytest.mark.parametrize("weight_map", [[1, 2], None, {"decoder.0.input_proj.weight": 3}])
def test_malformed_shard_index(weight_map, tmp_path):
    path = save_random_checkpoint("tiny-v2", tmp_path / "ck", seed=1, max_shard_bytes=100_000)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="corrupt shard index"):
        load_checkpoint(path)


def test_random_checkpoint_bytes_without_drawing():
    # 2,123,701,248 fp32 parameters (encoder and decoder 1,061,177,344 each, quantizer 1,346,560).
    assert random_checkpoint_bytes(preset_config("v2")) == 8_494_804_992
    cfg = preset_config("tiny-v2")
    drawn = list(random_official_state_dict(cfg))
    assert random_checkpoint_bytes(cfg) == sum(t.numel() * 4 for _, t in drawn)
    assert random_checkpoint_shapes(cfg) == [(name, tuple(t.shape)) for name, t in drawn]


def _modes(path):
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}


@pytest.mark.parametrize("max_shard_bytes", [2 * 1024**3, 300_000])
def test_written_files_are_world_readable(tmp_path, max_shard_bytes):
    path = save_random_checkpoint("tiny-v2", tmp_path / "ck", max_shard_bytes=max_shard_bytes)
    modes = _modes(path)
    assert FILE_MODE == 0o644 and set(modes.values()) == {0o644}
    assert len(modes) == (2 if max_shard_bytes > 300_000 else 9)  # config + 1 file, or config + index + 7 shards


def test_shards_respect_the_limit_and_progress_adds_up(tmp_path, monkeypatch):
    import safetensors.torch

    sizes, real = [], safetensors.torch.save_file

    def spy(tensors, filename, metadata=None):
        sizes.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", spy)
    seen = []
    path = save_random_checkpoint("tiny-v2", tmp_path / "ck", max_shard_bytes=300_000, progress=seen.append)
    total = random_checkpoint_bytes(preset_config("tiny-v2"))
    assert sum(seen) == sum(sizes) == total
    assert len(sizes) == 7 and max(sizes) <= 300_000
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{k}-of-00007.safetensors" for k in range(1, 8)]


def test_refuses_to_overwrite_a_checkpoint(tmp_path):
    path = save_random_checkpoint("tiny-v2", tmp_path / "ck", seed=1, max_shard_bytes=300_000)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(FileExistsError, match=r"ck already holds a checkpoint \(config.json, model-00001-of-00007"):
        save_random_checkpoint("tiny-v2", path, seed=2, overwrite=False)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    # By default (overwrite=True) every checkpoint file is replaced, stale shards included; other files stay.
    (path / "notes.txt").write_text("mine")
    save_random_checkpoint("tiny-v2", path, seed=2)
    assert [p.name for p in checkpoint_files(path)] == ["config.json", "model.safetensors"]
    assert (path / "notes.txt").read_text() == "mine"
    fresh = load_checkpoint(save_random_checkpoint("tiny-v2", tmp_path / "fresh", seed=2))
    assert torch.equal(load_checkpoint(path).lut, fresh.lut)


def test_empty_directory_is_not_a_checkpoint(tmp_path):
    (tmp_path / "ck").mkdir()
    assert checkpoint_files(tmp_path / "ck") == [] and checkpoint_files(tmp_path / "missing") == []
    assert (save_random_checkpoint("tiny-v2", tmp_path / "ck") / "model.safetensors").is_file()


def test_v1_projection_present_despite_matching_dims(tmp_path):
    # tiny-v1 group 0 maps 24 -> 64 channels at d_model 64: no output projection unless the checkpoint has one.
    path = save_random_checkpoint("tiny-v1", tmp_path / "ck", seed=4)
    plain = load_checkpoint(path)
    assert plain.groups[0].output_proj is None
    weight = torch.eye(64) * 0.5
    _rewrite(path, lambda t: t.update({"decoder.0.output_proj.weight": weight}))
    loaded = load_checkpoint(path)
    assert torch.equal(loaded.groups[0].output_proj.weight, weight)
    codes = random_codes(plain, 1, 3, seed=0)
    assert not torch.equal(loaded.decode(codes), plain.decode(codes))
    _rewrite(path, lambda t: t.update({"decoder.0.output_proj.weight": torch.zeros(64, 24)}))
    with pytest.raises(CheckpointError, match=r"decoder.0.output_proj.weight: shape \(64, 24\), expected \(64, 64\)"):
        load_checkpoint(path)
