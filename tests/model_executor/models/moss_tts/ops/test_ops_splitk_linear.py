# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.splitk_linear``: a small step's projection as one split-K kernel.

The reference is ``torch.nn.functional.linear``. The Triton kernel runs on CPU in Triton's interpreter in the
``TRITON_INTERPRET=1`` child of ``test_triton_interpreter_subprocess`` (float32: the interpreter's bfloat16 is
not the GPU's), where it must match the reference to float32 accumulation error, leave its counters at zero
and repeat bit for bit; on CUDA bfloat16 it must stay within cuBLAS's own distance from a float64 product.
"""

from __future__ import annotations

import pytest
import torch
from moss_codecs import compile_recorded_launch, cuda_kernel_test, interpreter_subprocess_test, needs_interpreter

from vllm_omni_moss.model_executor.models.moss_tts.ops import dispatch
from vllm_omni_moss.model_executor.models.moss_tts.ops import splitk_linear as ops
from vllm_omni_moss.model_executor.models.moss_tts.ops.dispatch import TRITON_INTERPRET_AT_IMPORT
from vllm_omni_moss.model_executor.models.moss_tts.ops.gelu import gelu_

cpu = pytest.mark.cpu


def _operands(rows, out_features, in_features, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen, device=device).to(dtype)
    w = (torch.randn(out_features, in_features, generator=gen, device=device) * in_features**-0.5).to(dtype)
    return x, w


@cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_runs_the_reference_bitwise(monkeypatch, dtype):
    # Also under TRITON_INTERPRET=1, where CPU float32 would otherwise run the interpreted kernel.
    monkeypatch.setattr(dispatch, "ALLOW_CPU_TRITON_INTERPRETER", False)
    x, w = _operands(5, 24, 40, dtype)
    assert torch.equal(ops.splitk_linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(ops.splitk_linear(x, w, gelu=True), torch.ops.aten.gelu_(torch.nn.functional.linear(x, w)))


@cpu
def test_rejects_a_gelu_flag_that_is_not_a_bool():
    x, w = _operands(2, 4, 8)
    with pytest.raises(TypeError, match=r"^splitk_linear: `gelu` must be a bool, got int$"):
        ops.splitk_linear(x, w, gelu=1)


@cpu
@pytest.mark.parametrize(
    "x,w,error,message",
    [
        ([[1.0]], torch.ones(2, 1), TypeError, r"splitk_linear: `x` must be a torch.Tensor, got list"),
        (torch.ones(3), torch.ones(2, 3), ValueError, r"`x` must have shape \(M, K\) = \(None, None\), got \(3,\)"),
        (
            torch.ones(2, 3),
            torch.ones(4, 5),
            ValueError,
            r"`weight` must have shape \(N, K\) = \(None, 3\), got \(4, 5\)",
        ),
        (
            torch.ones(2, 3),
            torch.ones(4, 3, dtype=torch.float64),
            ValueError,
            r"`weight` must have dtype torch.float32",
        ),
        (
            torch.ones(2, 3, dtype=torch.float64),
            torch.ones(4, 3, dtype=torch.float64),
            ValueError,
            r"`x` must have one of the dtypes .*, got torch.float64",
        ),
        (torch.ones(33, 3), torch.ones(4, 3), ValueError, r"`x` has 33 rows; the kernel takes at most 32"),
        (torch.ones(3, 2).t(), torch.ones(4, 3), ValueError, r"`x` must be contiguous, got strides \(1, 2\)"),
        (torch.ones(2, 3), torch.ones(3, 4).t(), ValueError, r"`weight` must be contiguous, got strides \(1, 4\)"),
    ],
)
def test_rejects_bad_inputs_naming_the_argument_and_limit(x, w, error, message):
    with pytest.raises(error, match=message):
        ops.splitk_linear(x, w)


@cpu
def test_launch_config_fills_the_device_within_k():
    for rows, n, k in [(1, 3840, 1280), (32, 1280, 5120), (1, 768, 768), (4, 2304, 768)]:
        config = ops.splitk_launch_config(rows, n, k)
        assert set(config) == {"splits", "block_n", "block_k", "num_warps", "num_stages"}
        assert config["splits"] * config["block_k"] <= k, config
        assert -(-n // config["block_n"]) <= 4096


@cpu
def test_launch_without_splits_takes_any_number_of_column_tiles(monkeypatch):
    """The counters serve only launches of several splits: one of a single split (every launch of more
    than 4096 column tiles: ``splitk_launch_config`` splits ``K`` only below 256 tiles) launches whatever ``N``."""
    grids = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: grids.append((grid, kwargs["SPLITS"]))

    monkeypatch.setattr(ops, "_splitk_kernel", Recorder())
    x, w = torch.ones(2, 4), torch.ones(64 * 4097, 4)
    config = ops.splitk_launch_config(2, w.shape[0], 4)
    ops._launch_triton(x, w, torch.empty(2, w.shape[0]), config)
    assert grids == [((4097, 1), 1)]
    with pytest.raises(ValueError, match=r"^splitk_linear: 4097 column tiles exceed the 4096 counters$"):
        ops._launch_triton(x, w, torch.empty(2, w.shape[0]), dict(config, splits=2))


@cpu
@pytest.mark.parametrize(
    "x_shape,w_shape,message",
    [
        ((32, 2**26), (8, 2**26), r"`x` has 2147483648 elements"),
        ((32, 8), (2**26, 8), r"the output has 2147483648 elements"),
    ],
)
def test_rejects_sizes_past_the_kernels_int32_offsets(x_shape, w_shape, message):
    x, w = torch.empty(x_shape, device="meta"), torch.empty(w_shape, device="meta")
    with pytest.raises(ValueError, match=message + r"; the kernel's int32 offsets take at most 2147483647$"):
        ops.splitk_linear(x, w)


@cpu
def test_traces_fullgraph_with_the_fake_impl():
    def project(x, w):
        return ops.splitk_linear(x, w) * 2 + ops.splitk_linear(x, w, gelu=True)

    compiled = torch.compile(project, fullgraph=True, dynamic=False, backend="aot_eager")
    x, w = _operands(3, 16, 24)
    assert torch.equal(compiled(x, w), project(x, w))


@cpu
@pytest.mark.skipif(TRITON_INTERPRET_AT_IMPORT, reason="kernels are interpreted here: the parent process compiles")
@pytest.mark.parametrize("rows,n,k,gelu", [(1, 3840, 1280, False), (32, 1280, 5120, False), (17, 768, 768, True)])
def test_kernel_compiles_for_the_device(monkeypatch, rows, n, k, gelu):
    """The kernel's bfloat16 launch as the op makes it on CUDA (its atomics and ordered sum, the GELU
    epilogue) compiles for sm_90."""
    x, w = _operands(rows, n, k, torch.bfloat16)
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    config = ops.splitk_launch_config(rows, n, k)
    compile_recorded_launch(monkeypatch, ops, "_splitk_kernel", lambda: ops._launch_triton(x, w, out, config, gelu))


@cpu
def test_first_launch_inside_a_capture_is_refused(monkeypatch):
    # Counters created inside a capture would be zeroed only when that graph replays (module docstring).
    device = torch.device("cuda", 7)
    monkeypatch.setattr(ops, "_COUNTERS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"the first launch on cuda:7 runs inside CUDA graph capture"):
        ops._counters(device)
    existing = torch.zeros(4, dtype=torch.int32)
    ops._COUNTERS[device] = existing
    assert ops._counters(device) is existing


test_triton_interpreter_subprocess = interpreter_subprocess_test(__file__, timeout=600)


@cpu
@needs_interpreter
@pytest.mark.parametrize("rows,n,k", [(1, 70, 300), (5, 64, 256), (16, 40, 500), (17, 33, 130), (32, 96, 64)])
@pytest.mark.parametrize("splits", [1, 3, 4])
def test_kernel_interpreted_matches_linear_and_resets_its_counters(rows, n, k, splits):
    # Rows below, at and above one 16-row block, column and K tails, one split and several, a K shorter
    # than the splits' blocks (empty splits).
    x, w = _operands(rows, n, k, seed=rows + n)
    config = dict(splits=splits, block_n=32, block_k=64, num_warps=4, num_stages=2)
    out = torch.empty(rows, n)
    ops._launch_triton(x, w, out, config)
    expected = x.double() @ w.double().t()
    assert torch.allclose(out.double(), expected, rtol=0, atol=1e-5 * k**0.5), (out.double() - expected).abs().max()
    assert not ops._counters(x.device).any()
    again = torch.empty(rows, n)
    ops._launch_triton(x, w, again, config)
    assert torch.equal(out, again)


@cpu
@needs_interpreter
@pytest.mark.parametrize("rows,n,k,splits", [(1, 70, 300, 1), (17, 33, 130, 3), (32, 96, 64, 4)])
def test_kernel_interpreted_gelu_epilogue_is_the_gemm_then_the_gelu_pass(rows, n, k, splits):
    # Inputs scaled so that the products cover GELU's whole range, the cancelling tail below -3 included.
    x, w = _operands(rows, n, k, seed=rows)
    x = x * 4
    config = dict(splits=splits, block_n=32, block_k=64, num_warps=4, num_stages=2)
    fused, plain = torch.empty(rows, n), torch.empty(rows, n)
    ops._launch_triton(x, w, fused, config, gelu=True)
    ops._launch_triton(x, w, plain, config)
    assert plain.min() < -3 and plain.max() > 3
    assert torch.equal(fused, gelu_(plain))
    assert not ops._counters(x.device).any()


@cpu
@needs_interpreter
def test_kernel_interpreted_through_the_op():
    x, w = _operands(9, 50, 200)
    got = ops.splitk_linear(x, w)
    assert got.shape == (9, 50) and got.dtype == torch.float32
    assert torch.allclose(got, torch.nn.functional.linear(x, w), rtol=0, atol=1e-5)


@cuda_kernel_test
@pytest.mark.parametrize("rows", [1, 4, 16, 32])
@pytest.mark.parametrize("n,k", [(3840, 1280), (1280, 5120), (768, 768), (3072, 768)])
def test_cuda_bf16_error_no_larger_than_cublas(rows, n, k):
    x, w = _operands(rows, n, k, torch.bfloat16, device="cuda", seed=rows)
    exact = x.double() @ w.double().t()
    got = ops.splitk_linear(x, w)
    cublas = torch.nn.functional.linear(x, w)
    # One bfloat16 rounding of a float32 sum: both are within half an ulp plus float32 accumulation noise.
    bound = (cublas.double() - exact).abs().max().item() * 1.01 + 1e-6
    assert (got.double() - exact).abs().max().item() <= max(bound, exact.abs().max().item() * 2.0**-8)
    assert torch.equal(got, ops.splitk_linear(x, w)), "repeated launches must agree bit for bit"
    assert not ops._counters(x.device).any()


@cuda_kernel_test
@pytest.mark.parametrize("rows", [1, 4, 16, 32])
@pytest.mark.parametrize("n,k", [(5120, 1280), (3072, 768)])
def test_cuda_bf16_gelu_epilogue_is_bitwise_the_gelu_pass(rows, n, k):
    x, w = _operands(rows, n, k, torch.bfloat16, device="cuda", seed=rows)
    x = x * 4
    plain = ops.splitk_linear(x, w)
    assert plain.min() < -3 and plain.max() > 3
    assert torch.equal(ops.splitk_linear(x, w, gelu=True), gelu_(plain))


@cuda_kernel_test
def test_cuda_graph_replay_recomputes():
    x, w = _operands(8, 1280, 5120, torch.bfloat16, device="cuda")
    static = x.clone()
    ops.splitk_linear(static, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.splitk_linear(static, w)
    for seed in (1, 2):
        fresh, _ = _operands(8, 1280, 5120, torch.bfloat16, device="cuda", seed=seed)
        static.copy_(fresh)
        graph.replay()
        assert torch.equal(out, ops.splitk_linear(fresh, w))


@cuda_kernel_test
def test_cuda_graphs_share_the_counters_in_any_replay_order():
    x, w = _operands(4, 3840, 1280, torch.bfloat16, device="cuda")
    ops.splitk_linear(x, w)  # the first launch, eager: the counters exist and are zero
    graphs, outputs = [], []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs.append(ops.splitk_linear(x, w))
        graphs.append(graph)
    expected = ops.splitk_linear(x, w)
    for index in (1, 0, 1):
        outputs[index].zero_()
        graphs[index].replay()
        assert torch.equal(outputs[index], expected)
    assert not ops._counters(x.device).any()
