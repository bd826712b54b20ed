# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.residual_norm``: LayerScale + residual add + LayerNorm in one pass.

The reference is the unfused decoder's arithmetic. The Triton kernel runs on CPU in Triton's interpreter
in the ``TRITON_INTERPRET=1`` child of ``test_triton_interpreter_subprocess`` (float32 only: the
interpreter rounds float32 to bfloat16 toward zero, the GPU to nearest even); bfloat16 is checked on CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moss_codecs import cuda_kernel_test, interpreter_subprocess_test, needs_interpreter

from vllm_omni_moss.model_executor.models.moss_tts.ops import residual_norm as ops
from vllm_omni_moss.model_executor.models.moss_tts.ops.dispatch import cpu_uses_triton_interpreter

INTERPRETED = cpu_uses_triton_interpreter()
cpu = pytest.mark.cpu


def _case(shape, width, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*size, scale=1.0):
        return (scale * torch.randn(*size, generator=gen, device=device)).to(dtype)

    x, update = draw(*shape, width, scale=3.0), draw(*shape, width)
    return x, update, draw(width, scale=0.1), 1 + draw(width, scale=0.1), draw(width, scale=0.1)


def _unfused(x, update, layer_scale, weight, bias, eps=1e-5):
    """The decoder before fusion, written out independently of the op's reference."""
    if layer_scale is not None:
        update = layer_scale * update
    x = x.to(update.dtype) + update
    norm = torch.nn.LayerNorm(x.shape[-1], eps=eps).to(x.device)
    with torch.no_grad():
        norm.weight.copy_(weight.float())
        norm.bias.copy_(bias.float())
    return x, norm(x.float()).to(x.dtype)


@cpu
@pytest.mark.skipif(INTERPRETED, reason="CPU runs the interpreted kernel in this process")
@pytest.mark.parametrize("scaled", [True, False])
def test_reference_is_the_unfused_decoder_bitwise(scaled):
    x, update, scale, weight, bias = _case((2, 7), 48, torch.float32)
    scale = scale if scaled else None
    got = ops.residual_layer_norm(x, update, scale, weight, bias, 1e-5)  # CPU: the reference
    expected = _unfused(x, update, scale, weight, bias)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert got[0].is_contiguous() and got[1].is_contiguous()


@cpu
@pytest.mark.parametrize(
    "name,bad,message",
    [
        ("x", torch.zeros(2, 7, 40), r"`x` must have shape \(2, 7, 48\), got \(2, 7, 40\)"),
        ("layer_scale", torch.zeros(47), r"`layer_scale` must have shape \(48,\), got \(47,\)"),
        ("weight", torch.zeros(48, dtype=torch.long), "`weight` must have a floating-point dtype, got torch.int64"),
        ("bias", [0.0], "`bias` must be a torch.Tensor, got list"),
        (
            "layer_scale",
            torch.zeros(48, dtype=torch.bfloat16),
            r"`layer_scale` must have the dtype of `update` \(torch.float32\), got torch.bfloat16",
        ),
        ("update", torch.tensor(1.0), r"`update` must have shape \(\.\.\., d\), got a 0-dim tensor"),
    ],
)
def test_rejects_bad_inputs(name, bad, message):
    args = dict(zip(("x", "update", "layer_scale", "weight", "bias"), _case((2, 7), 48, torch.float32)))
    args[name] = bad
    error = TypeError if isinstance(bad, list) else ValueError
    with pytest.raises(error, match=f"residual_layer_norm: {message}"):
        ops.residual_layer_norm(**args, eps=1e-5)


@cpu
@pytest.mark.parametrize("scaled", [True, False])
def test_outputs_are_contiguous_whatever_the_input_strides(scaled):
    # Non-contiguous x and update, strided and broadcast (d,) vectors: the values of the contiguous
    # case, contiguous outputs (the fake impl promises them). Interpreted too, in the child.
    x, update, scale, weight, bias = _case((3, 4), 48, torch.float32, seed=5)
    expected = ops.residual_layer_norm(x, update, scale if scaled else None, weight, bias, 1e-5)
    x_t = x.transpose(0, 1).contiguous().transpose(0, 1)
    update_t = update.transpose(0, 1).contiguous().transpose(0, 1)
    weight_s = torch.stack((weight, weight)).t().contiguous()[:, 0]  # stride 2
    scale_s = torch.stack((scale, scale)).t().contiguous()[:, 1] if scaled else None
    bias_b = torch.stack((bias, bias)).t().contiguous()[:, 0]
    assert not (x_t.is_contiguous() or weight_s.is_contiguous() or bias_b.is_contiguous())
    got = ops.residual_layer_norm(x_t, update_t, scale_s, weight_s, bias_b, 1e-5)
    for g, e in zip(got, expected):
        assert g.is_contiguous() and torch.equal(g, e)
    one = ops.residual_layer_norm(x, update, torch.full((1,), 0.5).expand(48), weight, bias, 1e-5)
    assert torch.equal(one[0], x + 0.5 * update)


@cpu
def test_traces_fullgraph_with_the_fake_impl():
    def layer(x, update, scale, weight, bias):
        x, h = ops.residual_layer_norm(x, update, scale, weight, bias, 1e-5)
        return x * 2, F.gelu(h)

    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    for shape in ((3, 5), (1, 9)):
        args = _case(shape, 32, torch.float32, seed=shape[1])
        expected = layer(*args)
        got = compiled(*args)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


test_triton_interpreter_subprocess = interpreter_subprocess_test(__file__, timeout=600)


@cpu
@needs_interpreter
@pytest.mark.parametrize("width", [48, 100])
@pytest.mark.parametrize("scaled", [True, False])
def test_kernel_interpreted_float32(width, scaled):
    x, update, scale, weight, bias = _case((3, 4), width, torch.float32, seed=width)
    scale = scale if scaled else None
    x_out, h = ops.residual_layer_norm(x, update, scale, weight, bias, 1e-5)
    expected_x, expected_h = _unfused(x, update, scale, weight, bias)
    assert torch.equal(x_out, expected_x), "the residual stream must be bitwise the unfused one"
    assert (h - expected_h).abs().max().item() <= 2e-6 * expected_h.abs().max().item()


@cuda_kernel_test
@pytest.mark.parametrize("width", [768, 1280])
def test_cuda_bfloat16_one_rounding_residual_and_norm(width):
    x, update, scale, weight, bias = _case((64, 480), width, torch.bfloat16, device="cuda", seed=width)
    x_out, h = ops.residual_layer_norm(x, update, scale, weight, bias, 1e-5)
    # The compiled kernel rounds x + scale * update once (the product stays float32; measured on the
    # H200: bitwise this, and 3.4% of elements one bf16 ulp from PyTorch's twice-rounded x + (s * u)).
    once = (x.float() + scale.float() * update.float()).bfloat16()
    assert torch.equal(x_out, once)
    # Against PyTorch: at most the product's rounding (half a bf16 ulp of |s * u|) plus one ulp of the sum.
    unfused_x, _ = _unfused(x, update, scale, weight, bias)
    product = (scale.float() * update.float()).abs()
    result = torch.maximum(x_out.float().abs(), unfused_x.float().abs())
    assert ((x_out.float() - unfused_x.float()).abs() <= product * 2.0**-8 + result * 2.0**-7).all()
    # Unscaled, one rounding is all there is: bitwise PyTorch's.
    assert torch.equal(ops.residual_layer_norm(x, update, None, weight, bias, 1e-5)[0], x + update)
    # h: the float32 LayerNorm of x_out accumulated in another order (errors of a few float32 ulps of
    # its terms (x - mean) * rstd * w and b), then one bf16 rounding (one ulp of h).
    _, expected_h = _unfused(x_out, torch.zeros_like(update), None, weight, bias)
    xf = x_out.float()
    centred = xf - xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centred.square().mean(-1, keepdim=True) + 1e-5)
    terms = (centred * rstd * weight.float()).abs() + bias.float().abs()
    bound = expected_h.float().abs() * 2.0**-7 + terms * 2.0**-16
    assert ((h.float() - expected_h.float()).abs() <= bound).all()
    assert (h != expected_h).float().mean().item() < 0.01
