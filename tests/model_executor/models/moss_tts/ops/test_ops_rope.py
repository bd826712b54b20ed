# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.rope``: RoPE of a step's queries and keys as one pass.

The reference is ``step_metadata.apply_rope`` (what the sdpa backend and the CPU run). The Triton kernel
runs on CPU in Triton's interpreter in the ``TRITON_INTERPRET=1`` child of
``test_triton_interpreter_subprocess`` (float32 and float16: the interpreter's bfloat16 rounding is not the
GPU's); on CUDA every dtype must equal the reference bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from moss_codecs import compile_recorded_launch, cuda_kernel_test, interpreter_subprocess_test, needs_interpreter

from vllm_omni_moss.model_executor.models.moss_tts.ops import rope as ops
from vllm_omni_moss.model_executor.models.moss_tts.ops.dispatch import TRITON_INTERPRET_AT_IMPORT
from vllm_omni_moss.model_executor.models.moss_tts.step_metadata import apply_rope, rope_tables

cpu = pytest.mark.cpu


def _qkv(rows, tokens, heads, head_dim, dtype, device="cpu", seed=0):
    """``(3, B, H, T, Dh)`` as a decoder layer sees it: a view of the ``(B, T, 3, H, Dh)`` projection."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, tokens, 3, heads, head_dim, generator=gen, device=device).to(dtype)
    return x.permute(2, 0, 3, 1, 4)


def _tables(rows, tokens, head_dim, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    offsets = torch.randint(0, 5000, (rows,), generator=gen, device=device)
    return rope_tables(offsets, tokens, head_dim, 10000.0)


@cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_result_is_apply_rope_in_a_contiguous_tensor(dtype):
    qkv = _qkv(3, 7, 2, 16, dtype)
    cos, sin = _tables(3, 7, 16)
    out = ops.rope(qkv[:2], cos, sin)
    assert out.shape == (2, 3, 2, 7, 16) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, apply_rope(qkv[:2], cos, sin))


@cpu
@pytest.mark.parametrize(
    "args,error,message",
    [
        (([1.0], None, None), TypeError, "`x` must be a torch.Tensor, got list"),
        ((torch.zeros(2, 1, 1, 3, 4, dtype=torch.int32), None, None), ValueError, "`x` must have one of the dtypes"),
        (
            (torch.zeros(1, 3, 4), None, None),
            ValueError,
            r"`x` must have 5 dims \(P, B, H, T, Dh\), got shape \(1, 3, 4\)",
        ),
        ((torch.zeros(2, 1, 1, 3, 5), None, None), ValueError, "RoPE needs an even head dim, got Dh = 5"),
        (
            (torch.zeros(2, 2, 1, 3, 4), torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2)),
            ValueError,
            r"`cos` must have shape \(B, 1, T, Dh/2\) = \(2, 1, 3, 2\), got \(1, 1, 3, 2\)",
        ),
        (
            (torch.zeros(2, 1, 1, 3, 4), torch.zeros(1, 1, 3, 2, dtype=torch.float64), torch.zeros(1, 1, 3, 2)),
            ValueError,
            "`cos` must have dtype torch.float32, got torch.float64",
        ),
        (
            (torch.zeros(2, 1, 1, 3, 4), torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 2, 3).transpose(2, 3)),
            ValueError,
            "`cos` and `sin` must have the same strides on their B, T and Dh/2 dims",
        ),
    ],
)
def test_rejects_bad_inputs(args, error, message):
    x, cos, sin = args
    if cos is None and isinstance(x, torch.Tensor) and x.dim() == 5:
        cos = sin = torch.zeros(x.shape[1], 1, x.shape[3], x.shape[4] // 2)
    elif cos is None:
        cos = sin = torch.zeros(1, 1, 3, 2)
    with pytest.raises(error, match=f"rope: {message}"):
        ops.rope(x, cos, sin)


def _known_answers(dtype):
    """Tables of angle 0 then 90 degrees at every pair, and what they must give: ``(x[2i], x[2i+1])``
    unchanged at angle 0, ``(-x[2i+1], x[2i])`` at 90 degrees (GPT-J pairs, ``apply_rope``'s convention)."""
    x = torch.arange(1, 1 + 2 * 1 * 2 * 2 * 4, dtype=dtype).view(2, 1, 2, 2, 4)  # (P, B, H, T, Dh)
    cos = torch.tensor([[1.0, 1.0], [0.0, 0.0]]).view(1, 1, 2, 2)
    sin = torch.tensor([[0.0, 0.0], [1.0, 1.0]]).view(1, 1, 2, 2)
    pairs = x.view(2, 1, 2, 2, 2, 2)
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).view_as(x)
    expected = torch.where(torch.tensor([True, False]).view(1, 1, 1, 2, 1), x, turned)
    return x, cos, sin, expected


@cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_known_answers(dtype):
    x, cos, sin, expected = _known_answers(dtype)
    assert torch.equal(ops.rope(x, cos, sin), expected)


@cpu
@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_interpreted_known_answers(dtype):
    x, cos, sin, expected = _known_answers(dtype)
    assert torch.equal(ops.rope(x, cos, sin), expected)


@cpu
def test_tables_may_differ_in_the_stride_of_their_size_one_dim():
    # The kernel never steps along dim 1 (size 1), so its stride does not have to match.
    qkv = _qkv(2, 5, 2, 8, torch.float32)
    cos, sin = _tables(2, 5, 8)
    odd = torch.empty_strided(sin.shape, (sin.stride(0), 999, sin.stride(2), sin.stride(3)))
    odd.copy_(sin)
    assert torch.equal(ops.rope(qkv[:2], cos, odd), apply_rope(qkv[:2], cos, sin))


@cpu
def test_traces_fullgraph_with_the_fake_impl():
    def rotate(qkv, cos, sin):
        return ops.rope(qkv[:2], cos, sin).sum((-1, -2))

    compiled = torch.compile(rotate, fullgraph=True, dynamic=True, backend="aot_eager")
    for tokens in (3, 9):
        qkv = _qkv(2, tokens, 2, 8, torch.float32, seed=tokens)
        cos, sin = _tables(2, tokens, 8, seed=tokens)
        assert torch.equal(compiled(qkv, cos, sin), rotate(qkv, cos, sin))


test_triton_interpreter_subprocess = interpreter_subprocess_test(__file__, timeout=600)


@cpu
@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(3, 37, 2, 16), (2, 5, 3, 64), (1, 1, 1, 2), (2, 70, 2, 6)])
def test_kernel_interpreted_is_bitwise_apply_rope(dtype, shape):
    # Token counts below, at and above one program's 32, a head dim that is not a power of two, and
    # queries and keys together, keys alone, and a view whose pairs are not whole words.
    rows, tokens, heads, head_dim = shape
    qkv = _qkv(rows, tokens, heads, head_dim, dtype, seed=tokens)
    cos, sin = _tables(rows, tokens, head_dim, seed=tokens)
    expected = apply_rope(qkv[:2], cos, sin)
    assert torch.equal(ops.rope(qkv[:2], cos, sin), expected)
    assert torch.equal(ops.rope(qkv[1:2], cos, sin), expected[1:2])
    shifted = torch.cat((qkv.new_zeros(3, rows, heads, tokens, 1), qkv), dim=-1)[..., 1:]  # odd storage offset
    assert shifted.storage_offset() % 2 == 1
    assert torch.equal(ops.rope(shifted[:2], cos, sin), expected)
    # Tensors PyTorch counts as contiguous whose pairs are still not whole words: an odd storage offset,
    # and an odd stride on a dim of size 1.
    flat = torch.cat((qkv.new_zeros(1), qkv[:2].contiguous().view(-1)))[1:].view(2, rows, heads, tokens, head_dim)
    assert flat.is_contiguous() and flat.storage_offset() == 1
    assert torch.equal(ops.rope(flat, cos, sin), expected)
    one = qkv[1:2, :1].contiguous()
    odd = torch.empty_strided(one.shape, (one.stride(0), 7, *one.stride()[2:]), dtype=dtype)
    odd.copy_(one)
    assert odd.is_contiguous() and odd.stride(1) == 7
    assert torch.equal(ops.rope(odd, cos[:1], sin[:1]), expected[1:2, :1])


@cpu
@needs_interpreter
def test_kernel_interpreted_empty_input_launches_nothing():
    qkv = _qkv(2, 0, 2, 8, torch.float32)
    cos, sin = _tables(2, 0, 8)
    assert ops.rope(qkv[:2], cos, sin).shape == (2, 2, 2, 0, 8)


@cuda_kernel_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(128, 480, 12, 64), (128, 15, 20, 64), (3, 37, 2, 16)])
def test_cuda_is_bitwise_apply_rope(dtype, shape):
    rows, tokens, heads, head_dim = shape
    qkv = _qkv(rows, tokens, heads, head_dim, dtype, device="cuda", seed=tokens)
    cos, sin = _tables(rows, tokens, head_dim, device="cuda", seed=tokens)
    expected = apply_rope(qkv[:2], cos, sin)
    assert torch.equal(ops.rope(qkv[:2], cos, sin), expected)
    assert torch.equal(ops.rope(qkv[1:2], cos, sin), expected[1:2])


@cuda_kernel_test
def test_cuda_graph_replay_recomputes():
    qkv = _qkv(4, 30, 3, 64, torch.bfloat16, device="cuda", seed=1)
    cos, sin = _tables(4, 30, 64, device="cuda", seed=1)
    source = qkv.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.rope(source[:2], cos, sin)
    source.copy_(_qkv(4, 30, 3, 64, torch.bfloat16, device="cuda", seed=2))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, apply_rope(source[:2], cos, sin))


@cpu
def test_step_tables_on_cpu_are_rope_tables_and_check_their_arguments():
    offsets = torch.tensor([0, 5, 123456789])
    got = ops.step_rope_tables(offsets, 9, 64, 10000.0)
    for g, e in zip(got, rope_tables(offsets, 9, 64, 10000.0)):
        assert g.shape == (3, 1, 9, 32) and torch.equal(g, e)
    with pytest.raises(ValueError, match=r"`offsets` must be a \(B,\) int64 tensor"):
        ops.step_rope_tables(offsets.int(), 9, 64, 10000.0)
    with pytest.raises(ValueError, match="even head dim, got Dh = 63"):
        ops.step_rope_tables(offsets, 9, 63, 10000.0)


@cpu
def test_step_tables_trace_fullgraph_with_the_fake_impl():
    def tables(offsets):
        cos, sin = ops.step_rope_tables(offsets, 6, 16, 10000.0)
        return cos * 2 + sin

    compiled = torch.compile(tables, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (2, 5):
        offsets = torch.arange(rows) * 11
        assert torch.equal(compiled(offsets), tables(offsets))


@cuda_kernel_test
@pytest.mark.parametrize("rows,tokens,head_dim", [(1, 1, 64), (128, 480, 64), (7, 33, 16)])
def test_cuda_step_tables_are_bitwise_rope_tables(rows, tokens, head_dim):
    """One kernel computes what ``rope_tables``' dozen PyTorch kernels compute, bit for bit on the device,
    at small and very large positions (a stream of a day at 400 tokens/s is 3.5e7 tokens)."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    for high in (5000, 10**9):
        offsets = torch.randint(0, high, (rows,), generator=gen, device="cuda")
        got = ops.step_rope_tables(offsets, tokens, head_dim, 10000.0)
        expected = rope_tables(offsets, tokens, head_dim, 10000.0)
        for g, e in zip(got, expected):
            assert g.is_contiguous() and torch.equal(g, e), (high, (g - e).abs().max().item())


@cpu
@pytest.mark.skipif(TRITON_INTERPRET_AT_IMPORT, reason="kernels are interpreted here: the parent process compiles")
@pytest.mark.parametrize("head_dim,max_period", [(64, 10000.0), (16, 500.0)])
def test_step_tables_kernel_compiles_for_the_device(monkeypatch, head_dim, max_period):
    """The tables kernel's launch as ``step_rope_tables`` makes it on CUDA compiles for sm_90 (its float64
    arithmetic needs float64 operands; a float launch argument arrives as float32)."""
    offsets = torch.tensor([0, 5, 123456789])
    compile_recorded_launch(
        monkeypatch, ops, "_tables_kernel", lambda: ops._launch_tables(offsets, 9, head_dim, max_period)
    )


@cpu
@pytest.mark.parametrize(
    "change,error,message",
    [
        (
            dict(offsets=torch.arange(3, dtype=torch.int32)),
            ValueError,
            r"int64 tensor, got shape \(3,\) and torch.int32",
        ),
        (dict(offsets=[0, 1]), ValueError, r"int64 tensor, got list"),
        (dict(num_tokens=4.5), ValueError, r"`num_tokens` must be an int >= 0, got 4.5"),
        (dict(num_tokens=-1), ValueError, r"`num_tokens` must be an int >= 0, got -1"),
        (dict(num_tokens=True), ValueError, r"`num_tokens` must be an int >= 0, got True"),
        (dict(head_dim="8"), ValueError, r"`head_dim` must be an int, got str '8'"),
        (dict(head_dim=8.0), ValueError, r"`head_dim` must be an int, got float 8.0"),
        (dict(max_period=0.0), ValueError, r"`max_period` must be a finite number > 0, got 0.0"),
        (dict(max_period=float("inf")), ValueError, r"`max_period` must be a finite number > 0, got inf"),
    ],
)
def test_step_tables_name_a_bad_argument_and_its_limit(change, error, message):
    args = dict(offsets=torch.arange(3), num_tokens=4, head_dim=8, max_period=10000.0)
    args.update(change)
    with pytest.raises(error, match=f"step_rope_tables: .*{message}"):
        ops.step_rope_tables(**args)
