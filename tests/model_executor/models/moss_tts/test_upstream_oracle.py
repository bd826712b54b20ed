# SPDX-License-Identifier: Apache-2.0
"""Self-test of the upstream (vllm-omni 0.30.0) codec oracle: naming, loading, decode semantics."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vllm_omni_moss.testing import upstream as uo  # noqa: E402

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(not uo.upstream_available(), reason="vllm-omni 0.30.0 moss_tts files or transformers missing"),
]

VERSIONS = ("v1", "v2")


def _config(version: str, **kwargs) -> dict:
    return uo.tiny_v1_config(**kwargs) if version == "v1" else uo.tiny_v2_config(**kwargs)


def _codes(codec: uo.UpstreamCodec, batch: int, frames: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, codec.codebook_size, (codec.num_quantizers, batch, frames), generator=gen)


def _assert_close_to_peak(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    # Error relative to the signal's peak: outputs reach |x| ~ 20, where fp32 reassociation between
    # differently shaped attention calls leaves ~1e-6 relative noise.
    assert actual.shape == expected.shape
    scale = max(1.0, float(expected.abs().max()))
    err = float((actual - expected).abs().max())
    assert err <= tol * scale, f"max error {err} > {tol} * {scale}"


@pytest.fixture(scope="module", params=VERSIONS)
def codec(request) -> uo.UpstreamCodec:
    return uo.build_upstream(_config(request.param), request.param, seed=1)


def test_chunk_schedule() -> None:
    assert uo._chunk_schedule([1, 15], 40) == [1, 15, 15, 9]
    assert uo._chunk_schedule([1, 3, 7, 2], 20) == [1, 3, 7, 2, 2, 2, 2, 1]
    assert uo._chunk_schedule([4], 10) == [4, 4, 2]
    assert uo._chunk_schedule([1000], 5) == [5]


@pytest.mark.parametrize("version", VERSIONS)
def test_seed_is_deterministic(version: str) -> None:
    cfg = _config(version)
    a = uo.build_upstream(cfg, version, seed=5).official_state_dict()
    b = uo.build_upstream(cfg, version, seed=5).official_state_dict()
    c = uo.build_upstream(cfg, version, seed=6).official_state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(not torch.equal(a[k], c[k]) for k in a)
    scales = [v for k, v in a.items() if k.endswith(".scale")]
    assert scales and all(float(s.min()) >= 0.3 for s in scales)


def test_decode_shapes(codec: uo.UpstreamCodec) -> None:
    codes = _codes(codec, batch=2, frames=3)
    audio = codec.decode(codes)
    assert audio.dtype == torch.float32
    assert audio.shape == (2, codec.channels, 3 * codec.downsample_rate)
    assert bool(audio.isfinite().all())
    # Each row is decoded independently of its batch neighbours.
    _assert_close_to_peak(codec.decode(codes[:, 1:]), audio[1:])


def test_official_names(codec: uo.UpstreamCodec) -> None:
    sd = codec.official_state_dict()
    layer = "decoder.0.transformer.layers.0."
    if codec.version == "v2":
        expected = ["self_attn.in_proj.weight", "self_attn.out_proj.weight", "ffn.0.weight", "ffn.2.weight"]
        assert "decoder.0.output_proj.weight" in sd
    else:
        expected = ["self_attn.in_projs.0.weight", "self_attn.out_projs.0.weight", "linear1.weight", "linear2.weight"]
        # Upstream v1 uses Identity where widths match, so the checkpoint has no tensor there.
        assert "decoder.0.output_proj.weight" not in sd
        assert "decoder.6.output_proj.weight" in sd
    expected += ["layer_scale_1.scale", "layer_scale_2.scale", "norm1.weight", "norm1.bias", "norm2.weight"]
    for suffix in expected:
        assert layer + suffix in sd
    assert "decoder.0.input_proj.weight" in sd
    assert sd["quantizer.output_proj.parametrizations.weight.original0"].shape == (uo.TINY_LATENT_DIM, 1, 1)
    assert sd["quantizer.quantizers.3.out_proj.parametrizations.weight.original1"].shape == (16, 4, 1)
    assert sd["quantizer.quantizers.0.codebook.weight"].shape == (16, 4)
    params = dict(codec.model.named_parameters())
    for key in sd:
        target = uo.loader_target_name(key, params)
        assert target in params and uo.official_name(target, codec.version) == key


def test_official_round_trip(codec: uo.UpstreamCodec, tmp_path: Path) -> None:
    codes = _codes(codec, batch=2, frames=2, seed=3)
    reference = codec.decode(codes)
    other = uo.build_upstream(codec.config, codec.version, seed=2)
    assert not torch.allclose(other.decode(codes), reference)
    other.load_official_state_dict(codec.official_state_dict())
    assert torch.equal(other.decode(codes), reference)

    reloaded = uo.load_official_checkpoint(codec.write_official_checkpoint(tmp_path / codec.version))
    assert reloaded.version == codec.version
    assert torch.equal(reloaded.decode(codes), reference)


def test_loader_rejects_incomplete(codec: uo.UpstreamCodec) -> None:
    sd = codec.official_state_dict()
    sd.pop("decoder.0.input_proj.weight")
    with pytest.raises(RuntimeError, match="not in checkpoint"):
        uo.build_upstream(codec.config, codec.version).load_official_state_dict(sd)


@torch.no_grad()
def test_decode_depends_on_every_decoding_weight(codec: uo.UpstreamCodec) -> None:
    codes = _codes(codec, batch=1, frames=2, seed=4)
    base = codec.decode(codes)
    # Encoder and quantizer in-projections only serve encoding.
    encode_only = ("encoder.", "quantizer.input_proj.")
    for name, param in codec.model.named_parameters():
        if name.startswith(encode_only) or (".quantizers." in name and ".in_proj." in name):
            continue
        saved = param.detach().clone()
        param.mul_(1.5).add_(0.05)
        codec._refresh_lut()
        try:
            assert not torch.allclose(codec.decode(codes), base, rtol=0, atol=1e-6), name
        finally:
            param.copy_(saved)
            codec._refresh_lut()
    assert torch.equal(codec.decode(codes), base)


def test_single_chunk_stream_matches_offline_v1() -> None:
    codec = uo.build_upstream(uo.tiny_v1_config(), "v1", seed=7)
    codes = _codes(codec, batch=1, frames=5, seed=5)
    offline = codec.decode(codes)
    _assert_close_to_peak(codec.stream_decode(codes, [1000]), offline)
    # The v1 ring attends over [cache | chunk], so any schedule matches offline decode.
    _assert_close_to_peak(codec.stream_decode(codes, [1, 2]), offline)


def test_stream_matches_offline_v2_when_rings_hold_everything() -> None:
    # 10 s windows give rings of 125..4000 tokens: no write-before-attend eviction for 5 frames.
    codec = uo.build_upstream(uo.tiny_v2_config(context_durations=(10.0,) * 6), "v2", seed=7)
    codes = _codes(codec, batch=1, frames=5, seed=5)
    offline = codec.decode(codes)
    _assert_close_to_peak(codec.stream_decode(codes, [1000]), offline)
    _assert_close_to_peak(codec.stream_decode(codes, [1, 2]), offline)


def test_v2_fixed_width_stream_equals_pool_path() -> None:
    # With the default tiny rings the last stage's 20-token ring is smaller than one frame's 32
    # tokens, so streaming departs from offline decode; the two upstream streaming paths agree.
    codec = uo.build_upstream(uo.tiny_v2_config(), "v2", seed=8)
    codes = _codes(codec, batch=1, frames=6, seed=6)
    streamed = codec.stream_decode(codes, [2, 1, 3])
    assert streamed.shape == (1, 2, 6 * codec.downsample_rate)
    assert bool(streamed.isfinite().all())
    assert not torch.allclose(streamed, codec.decode(codes), atol=1e-3)
    pieces, start = [], 0
    with codec.pool(3, 1) as pool:
        for width in (2, 1, 3):
            audio, lengths = pool.step(
                codes[:, :, start : start + width], torch.tensor([width]), torch.tensor([2]), torch.tensor([True])
            )
            assert int(lengths[0]) == width * codec.downsample_rate
            pieces.append(audio)
            start += width
    assert torch.equal(torch.cat(pieces, dim=-1), streamed)


def test_pool_state_views(codec: uo.UpstreamCodec) -> None:
    n_attn = len(codec.attention_modules())
    n_groups = sum(1 for m in codec.config["decoder_kwargs"] if m["module_type"] == "Transformer")
    codes = _codes(codec, batch=2, frames=2, seed=9)
    with codec.pool(3, 1) as pool:
        rings = pool.kv_rings()
        assert len(rings) == n_attn
        assert all(r.dim() == 5 and r.shape[:3] == (2, 4, 2) and r.shape[4] == 16 for r in rings)
        rows = pool.offset_rows()
        assert pool.offsets().shape == (len(rows), 4)
        assert len(rows) == (n_attn if codec.version == "v1" else 2 * n_attn + n_groups)
        audio, lengths = pool.step(codes, torch.tensor([2, 2]), torch.tensor([1, 3]), torch.tensor([True, False]))
        assert audio.shape == (2, codec.channels, 2 * codec.downsample_rate)
        assert lengths.tolist() == [2 * codec.downsample_rate] * 2
        offsets = pool.offsets()
        assert bool((offsets[:, 1] > 0).all())
        assert bool((offsets[:, [0, 2, 3]] == 0).all())
        pool.reset([1])
        assert bool((pool.offsets() == 0).all())
