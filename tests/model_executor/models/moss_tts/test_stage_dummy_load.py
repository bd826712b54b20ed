# SPDX-License-Identifier: Apache-2.0
"""Serving without the codec checkpoint: vLLM's dummy load format (needs vllm + vllm-omni; CPU is enough).

* Under ``load_config.load_format == "dummy"`` vLLM builds the model, lets its ``DummyModelLoader`` fill every
  tensor of the module tree with noise and never calls ``load_weights``. The stage then serves a random codec
  of the preset ``codec_dummy_preset`` (default v2): the decoder of ``save_random_checkpoint(preset, seed=0)``,
  untouched by the dummy loader, and warns that its audio is noise.
* A preset that does not exist, or more codebooks than it has, fails at construction.
"""

from __future__ import annotations

import logging

import pytest
import torch
from stage_helpers import build_stage, raw_info, run, vllm_config

pytestmark = [pytest.mark.vllm, pytest.mark.cpu, pytest.mark.core_model]

STAGE = "vllm_omni_moss.model_executor.models.moss_tts.stage"


def _dummy_config(tmp_path, n_vq: int, **fields):
    from vllm.config.load import LoadConfig

    config = vllm_config(tmp_path / "no-checkpoint-here", n_vq, **fields)
    config.load_config = LoadConfig(load_format="dummy")
    return config


def _load_like_vllm(config, device: str = "cpu"):
    """The stage as vLLM's dummy loader hands it to the runner (``model_loader/base_loader.py``,
    ``load_model``): built under the model dtype and the target device, then ``DummyModelLoader.load_weights``."""
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    loader = get_model_loader(config.load_config)
    with set_default_torch_dtype(torch.bfloat16):
        with torch.device(device):
            model = MossTTSCodecDecoder(vllm_config=config)
        loader.load_weights(model, config.model_config)
    return model.eval()


def _stream(stage, codes: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """``codes (n_vq, T)`` through ``forward`` as one raw stream in ``chunks``; the audio joined."""
    out, at = [], 0
    for i, t in enumerate(chunks):
        last = i == len(chunks) - 1
        info = raw_info("r", t, stage.n_vq, finished=last)
        out.append(run(stage, [codes[:, at : at + t]], [info], ["r"])[0])
        at += t
    return torch.cat(out, dim=-1)


@pytest.mark.parametrize("preset", ["tiny-v2", "tiny-v1"])
def test_dummy_load_format_serves_the_random_codec_of_the_preset(tmp_path, caplog, preset):
    n_vq = 11
    with caplog.at_level(logging.INFO, logger=STAGE):
        stage = _load_like_vllm(_dummy_config(tmp_path, n_vq, codec_dummy_preset=preset))
    # What the stage logged; the reference below logs too, and where the stage's logger is vLLM's (the fork,
    # under vLLM's INFO level) caplog would record that as well.
    records = list(caplog.records)
    reference = build_stage(tmp_path, preset, seed=0, n_vq=n_vq)  # loaded from the written random checkpoint
    got, want = stage._codec.state_dict(), reference._codec.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert {t.dtype for t in got.values()} == {torch.float32}
    assert not list(stage.parameters())  # out of the tree the dummy loader fills with noise

    codes = torch.randint(0, 1024, (n_vq, 7), generator=torch.Generator().manual_seed(5))
    audio = _stream(stage, codes, [1, 3, 3])
    assert audio.shape[-1] == 7 * stage._codec.config.samples_per_frame
    assert torch.equal(audio, _stream(reference, codes, [1, 3, 3]))
    assert stage._session.free_slots == stage.state_capacity

    (warning,) = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    peak = float(
        stage._codec.decode(torch.randint(0, 1024, (n_vq, 1, 8), generator=torch.Generator().manual_seed(0)))[0]
        .abs()
        .max()
    )
    assert peak > 1
    assert warning == (
        f"MOSS codec stage under vLLM's dummy load format: serving RANDOM weights of the {preset} codec (seed 0), "
        f"not the checkpoint {tmp_path / 'no-checkpoint-here'}: the audio is noise, for benchmarking the pipeline "
        f"only; 8 frames of random codes peak at |sample| = {peak:.1f}, far outside [-1, 1]"
    )
    loaded = [r.getMessage() for r in records if r.getMessage().startswith("MOSS codec decoder loaded")]
    assert loaded == [
        f"MOSS codec decoder loaded from random {preset} weights on cpu: {preset[-2:]}, "
        f"{stage._codec.config.sampling_rate} Hz, {stage._channels} channel(s), n_vq=11, precision float32 "
        "(weights, decode table and state rings; codec_dtype=auto), streams=4, chunk sizes [1, 3], 0 step shapes"
    ]


def test_dummy_load_format_defaults_to_the_v2_geometry(tmp_path):
    from vllm_omni_moss.model_executor.models.moss_tts.stage_options import StageOptions

    assert StageOptions.from_vllm_config(_dummy_config(tmp_path, 12)).dummy_preset == "v2"
    picked = StageOptions.from_vllm_config(_dummy_config(tmp_path, 12, codec_dummy_preset="v1"))
    assert picked.dummy_preset == "v1"
    # Under any other load format the checkpoint is read; the preset is still checked.
    assert StageOptions.from_vllm_config(vllm_config(tmp_path, 12, codec_dummy_preset="v1")).dummy_preset is None


@pytest.mark.parametrize("dummy", [True, False], ids=["dummy", "auto"])
def test_a_preset_that_does_not_exist_fails_at_startup(tmp_path, dummy):
    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    config = (_dummy_config if dummy else vllm_config)(tmp_path, 12, codec_dummy_preset="v3")
    with pytest.raises(ValueError) as err:
        MossTTSCodecDecoder(vllm_config=config)
    assert str(err.value) == "codec_dummy_preset must be one of 'tiny-v1', 'tiny-v2', 'v1', 'v2'; got 'v3'"


def test_more_codebooks_than_the_preset_has_fail_before_any_weight_is_drawn(tmp_path, monkeypatch):
    from vllm_omni_moss.model_executor.models.moss_tts import stage as stage_module

    monkeypatch.setattr(stage_module, "random_decoder", None)  # drawing would fail with a TypeError
    with pytest.raises(ValueError) as err:
        stage_module.MossTTSCodecDecoder(vllm_config=_dummy_config(tmp_path, 13, codec_dummy_preset="tiny-v2"))
    assert str(err.value) == "n_vq=13 exceeds the codec's 12 quantizers (random tiny-v2 weights)"


@pytest.mark.parametrize("preset", ["tiny-v2", "tiny-v1"])
def test_random_decoder_equals_the_written_random_checkpoint_whatever_the_torch_defaults(tmp_path, preset):
    from vllm_omni_moss.model_executor.models.moss_tts.checkpoint import load_checkpoint, save_random_checkpoint
    from vllm_omni_moss.model_executor.models.moss_tts.random_codec import random_decoder

    want = load_checkpoint(save_random_checkpoint(preset, tmp_path / preset, seed=7)).state_dict()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            got = random_decoder(preset, seed=7).state_dict()
    finally:
        torch.set_default_dtype(previous)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].device.type == "cpu" and torch.equal(got[name], tensor), name


@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["tiny-v2", "tiny-v1"])
def test_dummy_load_format_on_cuda_captures_graphs_and_decodes_like_the_checkpoint(tmp_path, preset):
    """Built under vLLM's CUDA target device: graphs captured at construction, audio equal to the stage that
    loads the written random checkpoint."""
    fields = dict(device="cuda", enforce_eager=False, codec_dummy_preset=preset)
    stage = _load_like_vllm(_dummy_config(tmp_path, 11, **fields), device="cuda")
    assert stage._session is not None and stage._session.runner is not None
    reference = build_stage(tmp_path, preset, seed=0, n_vq=11, device="cuda", enforce_eager=False)
    codes = torch.randint(0, 1024, (11, 7), generator=torch.Generator().manual_seed(5))
    assert torch.equal(_stream(stage, codes, [1, 3, 3]), _stream(reference, codes, [1, 3, 3]))


def test_both_loaders_serve_a_bf16_codec_on_its_device(monkeypatch):
    """``staging_device``: a bf16 codec is served where it runs (``to_serving`` then folds LayerScale and makes
    the fused layers' zero bias on CUDA), a float32 one on the CPU (``to_serving`` would cast it to bf16 on
    CUDA); the dummy load format's random codec goes through it as the checkpoint loader does."""
    from vllm_omni_moss.model_executor.models.moss_tts import stage as stage_mod

    cuda = torch.device("cuda")
    assert stage_mod.staging_device(torch.bfloat16, cuda) == cuda
    assert stage_mod.staging_device(torch.float32, cuda) == torch.device("cpu")
    asked = []
    real = stage_mod.staging_device
    monkeypatch.setattr(
        stage_mod, "staging_device", lambda dtype, device: asked.append((dtype, device)) or real(dtype, device)
    )
    options = type("Options", (), {"dummy_preset": "tiny-v2", "codec_dtype": "bfloat16", "codec_path": None})()
    codec, dtype = stage_mod._random_codec(options, 4, torch.device("cpu"))
    assert asked == [(torch.bfloat16, torch.device("cpu"))] and dtype == torch.bfloat16
    assert codec.state_dtype == torch.bfloat16
