# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.gelu``: the FFN's exact GELU in place.

The reference is PyTorch's ``aten.gelu_``. The Triton kernel runs on CPU in Triton's interpreter in the
``TRITON_INTERPRET=1`` child of ``test_triton_interpreter_subprocess`` (float32 only, as for the other
ops); bfloat16, float16 and float32 are compared with PyTorch's CUDA kernel on CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moss_codecs import assert_interpreted_tests_pass

from vllm_omni_moss.model_executor.models.moss_tts.ops import commit as commit_ops
from vllm_omni_moss.model_executor.models.moss_tts.ops import gelu as ops

INTERPRETED = commit_ops.cpu_uses_triton_interpreter()
cpu = pytest.mark.cpu
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child of test_triton_interpreter_subprocess"
)
no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
interpreted_here = pytest.mark.skipif(commit_ops.TRITON_INTERPRET_AT_IMPORT, reason="kernels are interpreted here")


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


@cpu
@pytest.mark.skipif(not commit_ops.HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(INTERPRETED, reason="this process interprets already; the tests below run directly")
def test_triton_interpreter_subprocess():
    assert_interpreted_tests_pass(__file__, timeout=600)


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
    # The interpreter's erf is the host's, not libdevice's, and less exact: measured |error| <= 4.2e-7 |x|
    # over 600k draws (1 + erf(x) cancels for negative x, so the bound is relative to x, not to GELU(x)).
    assert ((y - expected).abs() <= 1e-6 * x.abs()).all()
    if x.numel():
        assert y.view(-1)[:3].tolist() == [0.0, 0.0, 40.0]


@pytest.mark.cuda
@no_cuda
@interpreted_here
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(16384, 3072), (1920, 5120), (3, 1001)])
def test_cuda_equals_pytorch_gelu(dtype, shape):
    x = _draw(shape, dtype, device="cuda", seed=shape[-1])
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e-30, -60.0], dtype=dtype)
    expected = torch.ops.aten.gelu_(x.clone())
    y = ops.gelu_(x.clone())
    differ = (y != expected).sum().item()
    assert differ == 0, f"{differ} of {y.numel()} elements differ from aten.gelu_"


@pytest.mark.cuda
@no_cuda
@interpreted_here
def test_cuda_graph_replay_recomputes():
    x = _draw((64, 3072), torch.bfloat16, device="cuda", seed=2)
    buffer = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.gelu_(buffer)
    buffer.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(buffer, torch.ops.aten.gelu_(x.clone()))
