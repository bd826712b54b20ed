# SPDX-License-Identifier: Apache-2.0
"""Offline and fixed-width decode (config, checkpoint and CLI tests live in their own files)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from moss_codecs import count_ring_metadata_builds as _count_builds
from moss_codecs import random_codes

from vllm_omni_moss.model_executor.models.moss_tts import attention as attention_mod
from vllm_omni_moss.model_executor.models.moss_tts.decoder import chunk_schedule

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]

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
    assert chunk_schedule(16, [1, 3, 7, 2]) == [(0, 1), (1, 4), (4, 11), (11, 13), (13, 15), (15, 16)]
    with pytest.raises(ValueError, match="chunk schedule must be positive integers"):
        chunk_schedule(5, [1, 0])


# ----------------------------------------------------------------------------- hostile input (review findings)


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


def test_ffn_in_row_slices_equals_one_pass(tiny_decoder, monkeypatch):
    from vllm_omni_moss.model_executor.models.moss_tts import decoder as decoder_mod

    codes = random_codes(tiny_decoder, 3, 40, seed=4)
    whole = tiny_decoder.decode(codes)
    monkeypatch.setattr(decoder_mod, "FFN_ROW_CHUNK", 7)  # every group's FFN runs in several slices
    sliced = tiny_decoder.decode(codes)
    assert (sliced - whole).abs().max().item() <= 1e-5 * whole.abs().max().item()


def test_sliced_ffn_keeps_autograd_and_writes_in_place_without_it(tiny_decoder, monkeypatch):
    """The in-place write of each slice (``torch.mm(out=)``) has no autograd formula: with gradients on,
    the sliced FFN computes each slice and copies it (and stays differentiable); under ``no_grad`` it
    writes in place. Both equal the one-pass FFN."""
    from vllm_omni_moss.model_executor.models.moss_tts import decoder as decoder_mod

    layer = tiny_decoder.groups[0].layers[0]
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(2, 9, layer.linear1.in_features, generator=gen)
    with torch.no_grad():
        whole = decoder_mod._feed_forward(layer, h)
    monkeypatch.setattr(decoder_mod, "FFN_ROW_CHUNK", 4)  # 18 rows: slices of 4, 4, 4, 4 and 2
    with torch.no_grad():
        in_place = decoder_mod._feed_forward(layer, h)
    torch.testing.assert_close(in_place, whole, rtol=1e-6, atol=1e-6)
    h_grad = h.clone().requires_grad_()
    copied = decoder_mod._feed_forward(layer, h_grad)
    torch.testing.assert_close(copied.detach(), whole, rtol=1e-6, atol=1e-6)
    copied.sum().backward()
    assert h_grad.grad is not None and h_grad.grad.abs().sum() > 0


def _served_on_cpu(decoder):
    """A copy of ``decoder`` laid out as ``to_serving`` lays out a CUDA decoder (``prepare_fused_layers``), on the
    CPU (CPU decoding never asks for this layout; the tests run the fused path's Python on it, with the CPU's
    kernels)."""
    served = copy.deepcopy(decoder)
    served.prepare_fused_layers()
    return served


def test_fold_layer_scale_keeps_the_function_and_drops_the_scales(tiny_decoder):
    """``diag(s) W``: the folded decoder decodes what the unfolded one does (float32, within its rounding)
    and holds no LayerScale; folding again changes nothing."""
    codes = random_codes(tiny_decoder, 2, 6, seed=8)
    expected = tiny_decoder.decode(codes)
    folded = copy.deepcopy(tiny_decoder)
    folded.fold_layer_scale()
    assert all(layer.layer_scale_1 is None and layer.layer_scale_2 is None for g in folded.groups for layer in g.layers)
    layer, ref_layer = folded.groups[0].layers[0], tiny_decoder.groups[0].layers[0]
    assert torch.equal(layer.out_proj.weight, ref_layer.layer_scale_1[:, None] * ref_layer.out_proj.weight)
    assert torch.equal(layer.linear2.weight, ref_layer.layer_scale_2[:, None] * ref_layer.linear2.weight)
    weights = [p.clone() for p in folded.parameters()]
    folded.fold_layer_scale()
    assert all(torch.equal(a, b) for a, b in zip(weights, folded.parameters()))
    got = folded.decode(codes)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("rows_per_slice", [None, 4])
def test_fused_layers_compute_the_reference_layers(tiny_decoder, monkeypatch, rows_per_slice):
    """``_run_layers(fused=True)`` on a served layout (in-place ``addmm_`` residuals, the LayerNorm op, the
    FFN's first GEMM through ``torch._addmm_activation``, on CPU its exact GELU) gives the reference layers'
    output within float32 rounding, whole and with the FFN in 4-row slices; each of its ops runs once per
    sublayer: two norms and one epilogue GEMM a layer, no reference op."""
    from vllm_omni_moss.model_executor.models.moss_tts import decoder as decoder_mod

    if rows_per_slice is not None:
        monkeypatch.setattr(decoder_mod, "FFN_ROW_CHUNK", rows_per_slice)
    served = _served_on_cpu(tiny_decoder)
    calls = {"norm": 0, "reference": 0, "epilogue": 0}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    codes = random_codes(tiny_decoder, 1, 9, seed=2)
    plan = decoder_mod.StepPlan(decoder_mod.group_steps(tiny_decoder.config, 9, None), decoder_mod.OfflineAttention())
    with torch.no_grad():
        x = tiny_decoder.groups[0].input_proj(decoder_mod.embed_codes(tiny_decoder, codes))
        expected = decoder_mod._run_layers(tiny_decoder.groups[0], [x.clone()], plan.groups[0], plan.attention, False)
        monkeypatch.setattr(decoder_mod, "layer_norm", spy("norm", decoder_mod.layer_norm))
        monkeypatch.setattr(
            decoder_mod, "residual_layer_norm_reference", spy("reference", decoder_mod.residual_layer_norm_reference)
        )
        monkeypatch.setattr(torch, "_addmm_activation", spy("epilogue", torch._addmm_activation))
        got = decoder_mod._run_layers(served.groups[0], [x.clone()], plan.groups[0], plan.attention, True)
    layers = tiny_decoder.config.groups[0].num_layers
    slices = 1 if rows_per_slice is None else -(-9 // rows_per_slice)
    assert calls == {"norm": 2 * layers, "reference": 0, "epilogue": layers * slices}
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_cpu_decoders_run_the_references_and_cuda_bf16_needs_to_serving(tiny_decoder):
    """``runs_fused_ops``: never on CPU (float32 or bf16). ``check_served`` refuses a decoder whose LayerScale
    is not folded or that lacks the FFN zero bias, naming what to call; the served layout passes."""
    from vllm_omni_moss.model_executor.models.moss_tts import decoder as decoder_mod

    assert not decoder_mod.runs_fused_ops(tiny_decoder)
    assert not decoder_mod.runs_fused_ops(copy.deepcopy(tiny_decoder).to(torch.bfloat16))
    message = r"^a bf16 decoder on CUDA runs the fused layer ops, which read weights CodecDecoder.to_serving\('cuda'\)"
    with pytest.raises(RuntimeError, match=message):
        decoder_mod.check_served(tiny_decoder)
    folded = copy.deepcopy(tiny_decoder)
    folded.fold_layer_scale()
    with pytest.raises(RuntimeError, match=message):
        decoder_mod.check_served(folded)
    decoder_mod.check_served(_served_on_cpu(tiny_decoder))


def test_fixed_width_streaming_keeps_independent_per_layer_state(monkeypatch, ring_decoder):
    calls = _count_builds(monkeypatch)
    with ring_decoder.streaming(1) as stream:
        stream.decode(random_codes(ring_decoder, 1, 2, seed=2))
        state = stream.state
        assert len(state.offsets) == 6 and len({id(t) for t in state.offsets}) == 6
        assert [int(t) for t in state.offsets] == [2, 2, 2, 4, 4, 4]
    assert calls == [2, 2, 2, 4, 4, 4]


def test_check_served_refuses_either_unfolded_scale_and_float64_folds_in_float64(tiny_decoder):
    """A layer whose second LayerScale alone is left is refused too; folding float64 weights multiplies in
    float64 (bitwise ``s[:, None] * W``), not through float32."""
    from vllm_omni_moss.model_executor.models.moss_tts import decoder as decoder_mod

    served = _served_on_cpu(tiny_decoder)
    served.groups[0].layers[0].layer_scale_2 = torch.nn.Parameter(torch.ones(tiny_decoder.config.groups[0].d_model))
    with pytest.raises(RuntimeError, match=r"^a bf16 decoder on CUDA runs the fused layer ops"):
        decoder_mod.check_served(served)
    wide = copy.deepcopy(tiny_decoder).double()
    layer = wide.groups[0].layers[0]
    expected = layer.layer_scale_1.detach()[:, None] * layer.out_proj.weight.detach()
    wide.fold_layer_scale()
    assert torch.equal(wide.groups[0].layers[0].out_proj.weight, expected)
