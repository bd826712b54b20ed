# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.gelu``: the FFN's exact GELU in place.

The reference is PyTorch's ``aten.gelu_`` (what CPU runs). The Triton kernel, with its own float32 ``erf``,
runs on CPU in Triton's interpreter in the ``TRITON_INTERPRET=1`` child of
``test_triton_interpreter_subprocess`` (float32 only, as for the other ops); on CUDA bfloat16, float16 and
float32 results are held to the exact GELU (float64) and compared with PyTorch's CUDA kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moss_codecs import cuda_kernel_test, interpreter_subprocess_test, needs_interpreter

from vllm_omni_moss.model_executor.models.moss_tts.ops import gelu as ops
from vllm_omni_moss.model_executor.models.moss_tts.ops.dispatch import cpu_uses_triton_interpreter

INTERPRETED = cpu_uses_triton_interpreter()
cpu = pytest.mark.cpu


def _draw(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    # FFN activations before the GELU: mostly within a few units, with tails on both sides.
    return (3.0 * torch.randn(*shape, generator=gen, device=device)).to(dtype)


@cpu
@pytest.mark.skipif(INTERPRETED, reason="CPU runs the interpreted kernel in this process")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_is_pytorch_exact_gelu_in_place(dtype):
    x = _draw((5, 33), dtype)
    expected = F.gelu(x, approximate="none")
    y = x.clone()
    pointer = y.data_ptr()
    out = ops.gelu_(y)
    assert out is y and out.data_ptr() == pointer
    assert torch.equal(y, expected)


@cpu
@pytest.mark.parametrize(
    "bad,error,message",
    [
        ([1.0], TypeError, "`x` must be a torch.Tensor, got list"),
        (torch.zeros(4, dtype=torch.int32), ValueError, r"`x` must have one of the dtypes .*, got torch.int32"),
        (
            torch.zeros(4, 6).t(),
            ValueError,
            r"`x` must be contiguous \(the kernel walks it flat\), got strides \(1, 6\)",
        ),
    ],
)
def test_rejects_bad_inputs(bad, error, message):
    with pytest.raises(error, match=f"gelu_: {message}"):
        ops.gelu_(bad)


@cpu
def test_erf_polynomial_is_within_its_documented_error():
    """The kernel's erf, ``sign(z) * (1 - 2 ** (s * q(s)))`` with ``s = min(|z| / 4, 1)`` and the float32
    coefficients of ``_ERFC_LOG2``, evaluated as the kernel does (float32 Horner steps each rounded once, as
    fused multiply-adds round) with an exact exp2: within 1.15e-7 of float64 erf over 2**21 points of
    [0, 4.5] (the module docstring's "about 1.1e-7"), exactly 0 at 0 and 1 from |z| = 4 up."""
    z = torch.linspace(0.0, 4.5, 2**21, dtype=torch.float64).float()
    s = torch.clamp(z.abs() * 0.25, max=1.0)
    coefficients = ops._ERFC_LOG2
    p = torch.full_like(s, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        p = (p.double() * s.double() + c).float()  # one rounding per step, as an fma
    erf = (1.0 - torch.exp2((p * s).double()).float()).float()
    err = (erf.double() - torch.erf(z.double())).abs()
    assert err.max().item() <= 1.15e-7, f"max erf error {err.max().item():.3e}"
    assert erf[0].item() == 0.0 and (erf[z >= 4.0] == 1.0).all()


@cpu
def test_rejected_input_is_left_unchanged():
    x = torch.arange(24.0).view(4, 6).t()
    before = x.clone()
    with pytest.raises(ValueError):
        ops.gelu_(x)
    assert torch.equal(x, before)


@cpu
def test_traces_fullgraph_with_the_fake_impl():
    def ffn(x, w):
        hidden = x @ w
        ops.gelu_(hidden)
        return hidden.sum(-1)

    compiled = torch.compile(ffn, fullgraph=True, dynamic=True, backend="aot_eager")
    w = _draw((8, 12), torch.float32, seed=1)
    for rows in (3, 7):
        x = _draw((rows, 8), torch.float32, seed=rows)
        assert torch.equal(compiled(x, w), ffn(x, w))


test_triton_interpreter_subprocess = interpreter_subprocess_test(__file__, timeout=600)


@cpu
@needs_interpreter
@pytest.mark.parametrize("shape", [(3, 7), (2, 4096), (5000,), (0, 5)])
def test_kernel_interpreted_float32(shape):
    # Sizes below, at and above one program's block, and an empty tensor (no launch).
    x = _draw(shape, torch.float32, seed=sum(shape))
    if x.numel():
        x.view(-1)[:3] = torch.tensor([0.0, -0.0, 40.0])
    expected = F.gelu(x, approximate="none")
    y = x.clone()
    assert ops.gelu_(y) is y
    # The kernel's erf against the host's (1 + erf(x) cancels for negative x, so the bound is relative to
    # x, not to GELU(x)).
    assert ((y - expected).abs() <= 1e-6 * x.abs()).all()
    if x.numel():
        assert y.view(-1)[:3].tolist() == [0.0, 0.0, 40.0]


def _exact_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU in float64 on the host (the value the dtype's rounding should approach)."""
    x = x.double().cpu()
    return 0.5 * x * (1.0 + torch.erf(x / 2**0.5))


@cuda_kernel_test
def test_cuda_every_bfloat16_value_is_as_exact_as_pytorch():
    """Every finite bfloat16 input: the kernel's GELU rounds to the correctly rounded exact value at
    least as often as ``aten.gelu_`` does, and from x = -3 up (where ``1 + erf`` does not cancel) it is
    never more than one bfloat16 step away from it (float64 emulation: no step at all)."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x)].cuda()
    exact = _exact_gelu(x).to(torch.bfloat16)
    ours = ops.gelu_(x.clone()).cpu()
    aten = torch.ops.aten.gelu_(x.clone()).cpu()
    ours_off, aten_off = (ours != exact).sum().item(), (aten != exact).sum().item()
    assert ours_off <= aten_off, f"{ours_off} values off the rounded exact GELU, aten.gelu_ {aten_off}"
    steps = (ours.view(torch.int16).int() - exact.view(torch.int16).int()).abs()
    above = x.cpu().float() >= -3.0
    assert (steps[above] <= 1).all(), f"{int((steps[above] > 1).sum())} values from x = -3 up off by > 1 step"


@cuda_kernel_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [pytest.param((16384, 3072), marks=pytest.mark.slow), (1920, 5120), (3, 1001)])
def test_cuda_within_float32_erf_error_of_the_exact_gelu(dtype, shape):
    """FFN-like draws and edge values: within 2e-7 |x| (the float32 formula's error: erf's, and the
    rounding of 1 + erf where it cancels, halved by the 0.5, with margin) plus the dtype's rounding of
    the exact GELU (one relative step, or the smallest subnormal)."""
    x = _draw(shape, dtype, device="cuda", seed=shape[-1])
    x.view(-1)[:6] = torch.tensor([0.0, -0.0, 1e-30, -60.0, 60.0, -3.0], dtype=dtype)
    exact = _exact_gelu(x)
    info = torch.finfo(dtype)
    bound = 2e-7 * x.double().cpu().abs() + info.eps * exact.abs() + info.tiny * info.eps
    y = ops.gelu_(x.clone())
    excess = (y.double().cpu() - exact).abs() - bound
    assert (excess <= 0).all(), f"worst excess {excess.max().item():.3e}"
    # GELU(+-0) = 0, GELU(60) = 60 exactly (erf rounds to 1); GELU(1e-30) = 5e-31 where the dtype holds it.
    assert y.view(-1)[:2].tolist() == [0.0, 0.0] and y.view(-1)[4].item() == 60.0
    assert y.view(-1)[2].item() == (0.5 * x.view(-1)[2]).item()


@cuda_kernel_test
def test_cuda_graph_replay_recomputes():
    x = _draw((64, 3072), torch.bfloat16, device="cuda", seed=2)
    buffer = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.gelu_(buffer)
    buffer.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(buffer, ops.gelu_(x.clone()))
