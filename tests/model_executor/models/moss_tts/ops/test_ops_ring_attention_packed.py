# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.ring_attention_packed``: the ring attention and write of packed rows (row ``b``'s
tokens from ``token_start[b]`` of ``(1, H, N, Dh)`` tensors). The kernels in their packed mode must give, at each
row's valid queries, bit for bit the output of the same kernels on the ``(B, H, T, Dh)`` grid of the same rows,
and bit for bit the same rings; the reference (grid gather, reference op, scatter) within float32 rounding.
The kernels run interpreted on CPU (``TRITON_INTERPRET=1``, as ``scripts/test.sh`` sets it) and compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from moss_codecs import cuda_kernel_test as cuda
from moss_codecs import needs_interpreter

from vllm_omni_moss.model_executor.models.moss_tts.ops import ring_attention as ring_ops
from vllm_omni_moss.model_executor.models.moss_tts.ops.ring_attention_packed import (
    ring_attention_write_packed,
    ring_attention_write_packed_reference,
)

pytestmark = [pytest.mark.core_model]

H, DH, C, S = 2, 16, 8, 6


def _rows(T: int, device: str, dtype=torch.float32, seed: int = 0):
    """Five rows of up to ``T`` tokens (a full row, one token, a padding row, ...) packed one after another with
    three dummy tokens after them; slots, offsets (one past a whole ring) and rings of ``S`` slots."""
    gen = torch.Generator().manual_seed(seed)
    valid = torch.tensor([T, 1, 0, max(T - 2, 1), min(3, T)])
    start = torch.cumsum(valid, 0) - valid
    N = int(valid.sum()) + 3
    q, k, v = (torch.randn(1, H, N, DH, generator=gen).to(device, dtype) for _ in range(3))
    ring = torch.randn(2, S, H, C, DH, generator=gen).to(device, dtype)
    rows = [torch.tensor(x, device=device) for x in ([0, 2, 5, 3, 1], [3, 0, 0, 17, 9])]
    return q, k, v, ring, *rows, valid.to(device), start.to(device)


def _grid(x: torch.Tensor, start: torch.Tensor, valid: torch.Tensor, T: int) -> torch.Tensor:
    """The ``(B, H, T, Dh)`` grid of packed ``x`` ``(1, H, N, Dh)``: each row's valid tokens, zero past them."""
    out = x.new_zeros(start.shape[0], x.shape[1], T, x.shape[3])
    for b, (s, n) in enumerate(zip(start.tolist(), valid.tolist())):
        out[b, :, :n] = x[0, :, s : s + n]
    return out


def _check_packed_equals_grid(T: int, ring_semantics: str, device: str, dtype=torch.float32) -> None:
    q, k, v, ring, slots, offsets, valid, start = _rows(T, device, dtype)
    packed_ring, grid_ring = ring.clone(), ring.clone()
    got = ring_attention_write_packed(q, k, v, packed_ring, slots, offsets, valid, start, T, ring_semantics)
    grid = [_grid(x, start, valid, T) for x in (q, k, v)]
    want = ring_ops.ring_attention_write(*grid, grid_ring, slots, offsets, valid, ring_semantics)  # (B, T, H, Dh)
    assert got.shape == (1, q.shape[2], H, DH) and got.dtype == ring.dtype
    for b, (s, n) in enumerate(zip(start.tolist(), valid.tolist())):
        assert torch.equal(got[0, s : s + n], want[b, :n]), f"row {b}"
    assert torch.equal(packed_ring, grid_ring)
    assert not torch.equal(grid_ring, ring)  # the step wrote


@needs_interpreter
@pytest.mark.cpu
@pytest.mark.parametrize("T", [5, 40])  # the write fused into the attention kernel, and its own kernel after it
@pytest.mark.parametrize("ring_semantics", ["upstream", "exact"])
def test_packed_kernels_interpreted_equal_the_grid_kernels(T, ring_semantics):
    _check_packed_equals_grid(T, ring_semantics, "cpu")


@cuda
@pytest.mark.parametrize("T", [1, 6, 48])
@pytest.mark.parametrize("ring_semantics", ["upstream", "exact"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_kernels_equal_the_grid_kernels_on_cuda(T, ring_semantics, dtype):
    _check_packed_equals_grid(T, ring_semantics, "cuda", dtype)


@pytest.mark.cpu
@pytest.mark.parametrize("ring_semantics", ["upstream", "exact"])
def test_the_reference_gathers_computes_and_scatters_as_the_grid_reference(ring_semantics):
    """The reference equals the grid reference at every row's valid queries, zeros elsewhere, same rings."""
    T = 7
    q, k, v, ring, slots, offsets, valid, start = _rows(T, "cpu", seed=3)
    packed_ring, grid_ring = ring.clone(), ring.clone()
    got = ring_attention_write_packed_reference(q, k, v, packed_ring, slots, offsets, valid, start, T, ring_semantics)
    grid = [_grid(x, start, valid, T) for x in (q, k, v)]
    want = ring_ops.ring_attention_write_reference(*grid, grid_ring, slots, offsets, valid, ring_semantics)
    real = torch.zeros(q.shape[2], dtype=torch.bool)
    for b, (s, n) in enumerate(zip(start.tolist(), valid.tolist())):
        assert torch.equal(got[0, s : s + n], want[b, :n]), f"row {b}"
        real[s : s + n] = True
    assert not got[0, ~real].any() and torch.equal(packed_ring, grid_ring)


@pytest.mark.cpu
def test_bad_arguments_are_refused_with_the_argument_named():
    q, k, v, ring, slots, offsets, valid, start = _rows(4, "cpu")
    args = (q, k, v, ring, slots, offsets, valid, start, 4, "upstream")

    def refused(i, value):
        bad = list(args)
        bad[i] = value
        with pytest.raises((ValueError, TypeError)) as err:
            ring_attention_write_packed(*bad)
        return str(err.value)

    assert refused(0, q[0]) == (
        f"ring_attention_write_packed: `q` must have shape (1, H, N, Dh) = (1, {H}, None, {DH}), got {tuple(q[0].shape)}"
    )
    assert refused(2, v[..., :-1]).startswith("ring_attention_write_packed: `v` must have shape (1, H, N, Dh)")
    assert (
        refused(7, start.int())
        == "ring_attention_write_packed: `token_start` must have dtype torch.int64, got torch.int32"
    )
    assert refused(6, valid[:2]).startswith("ring_attention_write_packed: `valid_tokens` must have shape (B,) = (5,)")
    assert refused(8, 0) == "ring_attention_write_packed: `num_tokens` must be an integer >= 1, got 0"
    assert refused(9, "fast") == (
        "ring_attention_write_packed: unknown ring semantics 'fast'; expected one of ('upstream', 'exact')"
    )
    assert refused(3, "ring") == "ring_attention_write_packed: `ring` must be a torch.Tensor, got str"


@pytest.mark.cpu
@pytest.mark.parametrize("op", [ring_attention_write_packed, ring_attention_write_packed_reference])
def test_no_packed_token_answers_an_empty_output_and_leaves_the_rings(op):
    """Rows of no valid token over ``(1, H, 0, Dh)`` tensors: an empty output in the ring dtype, from the kernels
    (as the grid op answers a ``T = 0`` step) and from the reference alike; no ring changes."""
    q, k, v, ring, slots, offsets, valid, start = _rows(4, "cpu")
    empty = q[:, :, :0]
    rings = ring.clone()
    got = op(empty, empty, empty, rings, slots, offsets, torch.zeros_like(valid), torch.zeros_like(start), 4, "exact")
    assert got.shape == (1, 0, H, DH) and got.dtype == ring.dtype and torch.equal(rings, ring)
