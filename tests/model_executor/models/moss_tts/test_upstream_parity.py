# SPDX-License-Identifier: Apache-2.0
"""Our decoder against vLLM-Omni 0.30.0's own codec modules, with the same random weights.

Upstream builds its model from an official ``config.json``, draws random weights,
writes them as an official checkpoint; we load that checkpoint and compare audio in
fp32 on CPU: offline decode, fixed-width streaming (chunk schedules ``1,15,15,...``
and ``1,3,7,2,...`` over streams longer than every ring), and the legacy pool
against upstream's slot pool. Tolerance: max error <= 1e-5 x max |reference|.
"""

from __future__ import annotations

import copy

import pytest
import torch
from moss_codecs import make_state_pool

from vllm_omni_moss.model_executor.models.moss_tts.checkpoint import load_checkpoint
from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_batch
from vllm_omni_moss.testing import upstream as uo

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.core_model,
    pytest.mark.skipif(not uo.upstream_available(), reason="vllm-omni 0.30.0 moss_tts files or transformers missing"),
]

SCHEDULES = ([1, 15], [1, 3, 7, 2])


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.isfinite(expected).all()
    err = float((actual - expected).abs().max())
    scale = float(expected.abs().max())
    assert scale > 0
    assert err <= tol * scale, f"relative max error {err / scale:.2e} > {tol}"


def _pair(raw: dict, version: str, tmp_path, seed: int = 3):
    upstream = uo.build_upstream(copy.deepcopy(raw), version, seed=seed)
    ours = load_checkpoint(upstream.write_official_checkpoint(tmp_path / "ckpt"))
    assert ours.config.version == version
    return upstream, ours


def _codes(decoder, batch: int, frames: int, seed: int, n_vq: int = 12) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, decoder.config.codebook_size, (n_vq, batch, frames), generator=gen)


@pytest.mark.parametrize(("preset", "version"), [("tiny-v2", "v2"), ("tiny-v1", "v1")])
def test_tiny_presets_match_upstream(preset, version, tmp_path):
    upstream, ours = _pair(PRESETS[preset], version, tmp_path)
    codes = _codes(ours, 2, 24, seed=1)
    _close(ours.decode(codes), upstream.decode(codes))
    # 60 frames outlast every ring (the largest holds 10 frames).
    stream = _codes(ours, 1, 60, seed=2)
    for schedule in SCHEDULES:
        _close(ours.decode(stream, chunk_frames=schedule), upstream.stream_decode(stream, schedule))


def test_real_v2_widths_one_layer_per_group_match_upstream(tmp_path):
    raw = copy.deepcopy(PRESETS["v2"])
    for spec in raw["decoder_kwargs"] + raw["encoder_kwargs"]:
        if spec["module_type"] == "Transformer":
            spec["num_layers"] = 1
    upstream, ours = _pair(raw, "v2", tmp_path)
    assert [g.ring_capacity for g in ours.config.groups] == [125, 250, 400, 400, 400, 400]
    codes = _codes(ours, 1, 20, seed=4)
    _close(ours.decode(codes), upstream.decode(codes))
    # 130 frames outlast the 125-frame ring of the first group; 15-frame chunks put
    # 480 tokens into the last group's 400-token ring (duplicate destinations).
    stream = _codes(ours, 1, 130, seed=5)
    _close(ours.decode(stream, chunk_frames=[1, 15]), upstream.stream_decode(stream, [1, 15]))


@pytest.mark.parametrize(("preset", "version"), [("tiny-v2", "v2"), ("tiny-v1", "v1")])
def test_legacy_pool_matches_upstream_pool(preset, version, tmp_path):
    """Same script through upstream's slot pool and ours: audio of live rows within
    1e-5 and every offset in the bank equal, step by step."""
    upstream, ours = _pair(PRESETS[preset], version, tmp_path)
    theirs = upstream.pool(3, 2)
    pool = make_state_pool(ours, "legacy")
    pool.initialize(3, 2)
    for step, T in enumerate([1, 3, 3, 7, 1, 15, 2]):
        codes = _codes(ours, 4, T, seed=50 + step)
        live = [2, 0] if step % 2 else [0, 2]
        ids = torch.tensor(live + [3, 4])
        valid = torch.tensor([True, True, False, False])
        lengths = torch.where(valid, T, 0)
        a, a_len = decode_batch(pool, codes, lengths, ids, valid)
        b, b_len = theirs.step(codes, lengths, ids, valid)
        _close(a[:2], b[:2])
        assert torch.equal(a_len, b_len.to(a_len.dtype))
        assert torch.equal(pool.offset_table[:, :3], theirs.offsets()[:, :3])
        if step == 2:
            pool.reset(torch.tensor([0]))
            theirs.reset(torch.tensor([0]))
    theirs.close()
