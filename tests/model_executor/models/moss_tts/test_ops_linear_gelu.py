# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.linear_gelu``: the FFN's first GEMM with the exact GELU applied in its epilogue.

The reference is the unfused decoder's ``gelu_(linear1(h))``. The Triton kernel runs on CPU in Triton's
interpreter in the ``TRITON_INTERPRET=1`` child of ``test_triton_interpreter_subprocess`` (float32 only, as
in ``test_ops_residual_norm.py``); bfloat16 and the v2 codec's FFN shapes are checked on CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moss_codecs import assert_interpreted_tests_pass

from vllm_omni_moss.model_executor.models.moss_tts.ops import commit as commit_ops
from vllm_omni_moss.model_executor.models.moss_tts.ops import linear_gelu as ops

INTERPRETED = commit_ops.cpu_uses_triton_interpreter()
cpu = pytest.mark.cpu
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child of test_triton_interpreter_subprocess"
)


def needs_cuda(test):
    for mark in (
        pytest.mark.skipif(commit_ops.TRITON_INTERPRET_AT_IMPORT, reason="kernels are interpreted here"),
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        pytest.mark.cuda,
    ):
        test = mark(test)
    return test


def _case(rows, n_out, k_in, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, k_in, generator=gen, device=device)
    weight = torch.randn(n_out, k_in, generator=gen, device=device) * k_in**-0.5
    return x.to(dtype), weight.to(dtype)


def _unfused(x, weight):
    """The decoder's FFN head before fusion, written out independently of the op's reference."""
    y = x @ weight.t()
    return (0.5 * y.float() * (1 + torch.erf(y.float() / 2**0.5))).to(y.dtype)


@cpu
@pytest.mark.skipif(INTERPRETED, reason="CPU runs the interpreted kernel in this process")
def test_reference_is_the_unfused_decoder():
    x, weight = _case(7, 48, 32)
    got = ops.linear_gelu(x.view(1, 7, 32), weight)  # CPU: the reference
    assert got.shape == (1, 7, 48) and got.is_contiguous()
    assert torch.equal(got.view(7, 48), ops.linear_gelu_reference(x, weight))
    torch.testing.assert_close(got.view(7, 48), _unfused(x, weight), rtol=1e-6, atol=1e-6)
    assert torch.equal(got.view(7, 48), F.gelu(F.linear(x, weight)))


@cpu
@pytest.mark.parametrize(
    "name,bad,error,message",
    [
        ("x", [1.0], TypeError, "`x` must be a torch.Tensor, got list"),
        ("weight", torch.zeros(48, 32, dtype=torch.long), ValueError, "`weight` must have a floating-point dtype"),
        (
            "weight",
            torch.zeros(48, 31),
            ValueError,
            r"`weight` must have shape \(n_out, 32\) for `x` of shape \(7, 32\), got \(48, 31\)",
        ),
        (
            "weight",
            torch.zeros(48, 32, dtype=torch.float64),
            ValueError,
            r"`weight` must have the dtype of `x` \(torch.float32\), got torch.float64",
        ),
        ("x", torch.tensor(1.0), ValueError, r"`x` must have shape \(\.\.\., k_in\), got a 0-dim tensor"),
        (
            "weight",
            torch.zeros(48, 32, device="meta"),
            ValueError,
            r"`weight` must be on the device of `x` \(cpu\), got meta",
        ),
    ],
)
def test_rejects_bad_inputs(name, bad, error, message):
    args = dict(zip(("x", "weight"), _case(7, 48, 32)))
    args[name] = bad
    with pytest.raises(error, match=f"linear_gelu: {message}"):
        ops.linear_gelu(**args)


@cpu
def test_rejects_unknown_launch_keys():
    with pytest.raises(ValueError, match=r"unknown launch configuration keys \['block_q'\]"):
        ops._launch_config(64, 128, 64, {"block_q": 16})


@cpu
def test_traces_fullgraph_with_the_fake_impl():
    def head(x, weight):
        return ops.linear_gelu(x, weight) * 2

    compiled = torch.compile(head, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (3, 9):
        x, weight = _case(rows, 40, 24, seed=rows)
        assert torch.equal(compiled(x, weight), head(x, weight))


@cpu
@pytest.mark.skipif(not commit_ops.HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(INTERPRETED, reason="this process interprets already; the tests below run directly")
def test_triton_interpreter_subprocess():
    assert_interpreted_tests_pass(__file__, timeout=600)


@cpu
@needs_interpreter
@pytest.mark.parametrize(
    "rows,n_out,k_in,tuning",
    [
        # Ragged rows, columns and inputs (EVEN_K off), two bands of row tiles.
        (70, 72, 40, dict(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)),
        # Even inputs, one partial row tile.
        (5, 64, 64, dict(block_m=16, block_n=32, block_k=32, group_m=8, num_warps=4, num_stages=1)),
        # The default launch configuration of a small step.
        (33, 128, 64, None),
        # The persistent TMA kernel: ragged rows and columns, more tiles than programs, flattened or not.
        (70, 72, 40, dict(kernel="tma", block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)),
        (45, 96, 48, dict(kernel="tma", block_m=16, block_n=32, block_k=16, group_m=8, flatten=True)),
    ],
)
def test_kernel_interpreted_float32(rows, n_out, k_in, tuning):
    x, weight = _case(rows, n_out, k_in, seed=rows)
    got = ops._launch_triton(x.view(1, rows, k_in), weight, tuning)
    expected = ops.linear_gelu_reference(x, weight)
    assert got.shape == (1, rows, n_out)
    torch.testing.assert_close(got.view(rows, n_out), expected, rtol=1e-5, atol=1e-5)


def _relative_rms(got, expected):
    return ((got.float() - expected).square().mean() / expected.square().mean()).sqrt().item()


@pytest.mark.parametrize(
    "rows,n_out,k_in",
    [(1, 3072, 768), (15, 5120, 1280), (960, 5120, 1280), (16384, 3072, 768), (1000, 3072, 768)],
)
@needs_cuda
def test_cuda_bfloat16_v2_shapes(rows, n_out, k_in):
    x, weight = _case(rows, n_out, k_in, torch.bfloat16, device="cuda", seed=rows)
    got = ops.linear_gelu(x, weight)
    unfused = F.gelu(F.linear(x, weight))
    exact = F.gelu(F.linear(x.double(), weight.double()))
    # Against the float64 truth, no less accurate than the unfused path (issue 9's criterion).
    assert _relative_rms(got, exact) <= 1.02 * _relative_rms(unfused, exact)
    # Against PyTorch: the GELU of a linear output that differs in accumulation order only, so at most
    # one bf16 rounding of the pre-activation apart (GELU's slope is below 1.13) plus one of the result.
    pre = F.linear(x.float(), weight.float()).abs()
    bound = (pre * 2.0**-8) * 1.13 + unfused.float().abs() * 2.0**-8 + 1e-6
    assert ((got.float() - unfused.float()).abs() <= 2 * bound).all()
    # The exact GELU, not an approximation: almost every element is bitwise PyTorch's (the tanh form
    # would move most of them).
    assert (got != unfused).float().mean().item() < 0.05


@needs_cuda
def test_cuda_float32_uses_ieee_products():
    x, weight = _case(300, 256, 192, device="cuda", seed=3)
    got = ops.linear_gelu(x, weight)
    exact = F.gelu(F.linear(x.double(), weight.double())).float()
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)
