# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.layer_norm``: a decoder layer's LayerNorm in one pass, and the reference of a
sublayer's end.

The references are the unfused decoder's arithmetic. The Triton kernel runs on CPU in Triton's interpreter
in the ``TRITON_INTERPRET=1`` child of ``test_triton_interpreter_subprocess`` (float32 only: the
interpreter rounds float32 to bfloat16 toward zero, the GPU to nearest even); bfloat16 is checked on CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moss_codecs import cuda_kernel_test, interpreter_subprocess_test, needs_interpreter

from vllm_omni_moss.model_executor.models.moss_tts.ops import layer_norm as ops
from vllm_omni_moss.model_executor.models.moss_tts.ops.dispatch import cpu_uses_triton_interpreter

INTERPRETED = cpu_uses_triton_interpreter()
cpu = pytest.mark.cpu


def _case(shape, width, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*size, scale=1.0):
        return (scale * torch.randn(*size, generator=gen, device=device)).to(dtype)

    x, update = draw(*shape, width, scale=3.0), draw(*shape, width)
    return x, update, draw(width, scale=0.1), 1 + draw(width, scale=0.1), draw(width, scale=0.1)


def _norm(x, weight, bias, eps=1e-5):
    """PyTorch's float32 LayerNorm module on ``x``, rounded back to its dtype: written out independently."""
    norm = torch.nn.LayerNorm(x.shape[-1], eps=eps).to(x.device)
    with torch.no_grad():
        norm.weight.copy_(weight.float())
        norm.bias.copy_(bias.float())
    return norm(x.float()).to(x.dtype)


@cpu
@pytest.mark.parametrize("scaled", [True, False])
def test_residual_reference_is_the_unfused_decoder_bitwise(scaled):
    x, update, scale, weight, bias = _case((2, 7), 48, torch.float32)
    scale = scale if scaled else None
    x_out, h = ops.residual_layer_norm_reference(x, update, scale, weight, bias, 1e-5)
    expected_x = x + (scale * update if scaled else update)
    assert torch.equal(x_out, expected_x) and torch.equal(h, _norm(expected_x, weight, bias))


@cpu
@pytest.mark.skipif(INTERPRETED, reason="CPU runs the interpreted kernel in this process")
def test_layer_norm_on_cpu_is_pytorchs_float32_norm_bitwise():
    for dtype in (torch.float32, torch.bfloat16):
        x, _, _, weight, bias = _case((2, 7), 48, dtype, seed=3)
        got = ops.layer_norm(x, weight, bias, 1e-5)
        assert got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got, _norm(x, weight, bias))


@cpu
@pytest.mark.parametrize(
    "name,bad,error,message",
    [
        ("x", [1.0], TypeError, "`x` must be a torch.Tensor, got list"),
        ("x", torch.tensor(1.0), ValueError, r"`x` must have shape \(\.\.\., d\), got a 0-dim tensor"),
        (
            "x",
            torch.zeros(2, 7, 48, dtype=torch.long),
            ValueError,
            "`x` must have a floating-point dtype, got torch.int64",
        ),
        ("weight", torch.zeros(47), ValueError, r"`weight` must have shape \(48,\), got \(47,\)"),
        ("bias", [0.0], TypeError, "`bias` must be a torch.Tensor, got list"),
        ("bias", torch.zeros(48, device="meta"), ValueError, "`bias` must be on device cpu, got meta"),
    ],
)
def test_rejects_bad_inputs(name, bad, error, message):
    x, _, _, weight, bias = _case((2, 7), 48, torch.float32)
    args = {"x": x, "weight": weight, "bias": bias}
    args[name] = bad
    with pytest.raises(error, match=f"^layer_norm: {message}$"):
        ops.layer_norm(**args, eps=1e-5)


@cpu
def test_output_is_contiguous_whatever_the_input_strides():
    # A non-contiguous x, strided (d,) vectors: the values of the contiguous case, a contiguous output (the
    # fake impl promises it). Interpreted too, in the child.
    x, _, _, weight, bias = _case((3, 4), 48, torch.float32, seed=5)
    expected = ops.layer_norm(x, weight, bias, 1e-5)
    x_t = x.transpose(0, 1).contiguous().transpose(0, 1)
    weight_s = torch.stack((weight, weight)).t().contiguous()[:, 0]  # stride 2
    bias_s = torch.stack((bias, bias)).t().contiguous()[:, 1]
    assert not (x_t.is_contiguous() or weight_s.is_contiguous() or bias_s.is_contiguous())
    got = ops.layer_norm(x_t, weight_s, bias_s, 1e-5)
    assert got.is_contiguous() and torch.equal(got, expected)
    assert ops.layer_norm(x[:0], weight, bias, 1e-5).shape == (0, 4, 48)


@cpu
def test_traces_fullgraph_with_the_fake_impl():
    def layer(x, weight, bias):
        return F.gelu(ops.layer_norm(x * 2, weight, bias, 1e-5))

    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    for shape in ((3, 5), (1, 9)):
        x, _, _, weight, bias = _case(shape, 32, torch.float32, seed=shape[1])
        assert torch.equal(compiled(x, weight, bias), layer(x, weight, bias))


test_triton_interpreter_subprocess = interpreter_subprocess_test(__file__, timeout=600)


@cpu
@needs_interpreter
@pytest.mark.parametrize("width", [48, 100])
def test_kernel_interpreted_float32(width):
    x, _, _, weight, bias = _case((3, 4), width, torch.float32, seed=width)
    h = ops.layer_norm(x, weight, bias, 1e-5)
    expected = _norm(x, weight, bias)
    assert (h - expected).abs().max().item() <= 2e-6 * expected.abs().max().item()


@cuda_kernel_test
@pytest.mark.parametrize("width", [768, 1280])
def test_cuda_bfloat16_norm_is_one_rounding_of_the_float32_norm(width):
    x, _, _, weight, bias = _case((64, 480), width, torch.bfloat16, device="cuda", seed=width)
    h = ops.layer_norm(x, weight, bias, 1e-5)
    # The float32 LayerNorm of x accumulated in another order (errors of a few float32 ulps of its terms
    # (x - mean) * rstd * w and b), then one bf16 rounding (one ulp of h).
    expected = _norm(x, weight, bias)
    xf = x.float()
    centred = xf - xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centred.square().mean(-1, keepdim=True) + 1e-5)
    terms = (centred * rstd * weight.float()).abs() + bias.float().abs()
    bound = expected.float().abs() * 2.0**-7 + terms * 2.0**-16
    assert ((h.float() - expected.float()).abs() <= bound).all()
    assert (h != expected).float().mean().item() < 0.01
