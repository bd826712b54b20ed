# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.ring_attention_packed``: the ring attention and write of packed rows (row ``b``'s
tokens from ``token_start[b]`` of ``(1, H, N, Dh)`` tensors), and the kernels it launches.

The reference path of one layer (what the ``"sdpa"`` backend of the compact pool does) is: gather each row's ring,
``attend_gathered_rows`` (scatter the chunk, SDPA with the step's mask), ``commit_ring`` of the touched cells. The
op must match it: outputs of valid queries within 1e-5 (float32), ring contents bit for bit. Most cases build a
step on the ``(B, H, T, Dh)`` grid and hand the op its full packing (row ``b`` from token ``b x T``, the tokens
past a row's valid ones left in place as dummies): a grid step is the packing in which every row holds ``T``
tokens. Ragged packings (rows one after another, dummies after the last) must give bitwise the full packing's
outputs and rings.

The Triton kernels run on CPU in Triton's interpreter: whether a kernel is interpreted is fixed when the module is
imported, so ``test_triton_interpreter_subprocess`` re-runs this file in a child with ``TRITON_INTERPRET=1``
selecting the ``*interpreted*`` tests, which the parent skips. To run them directly:

    TRITON_INTERPRET=1 python -m pytest tests/model_executor/models/moss_tts/ops/test_ops_ring_attention_packed.py -k interpreted
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moss_codecs import build_decoder, interpreter_subprocess_test, make_state_pool, needs_interpreter, random_codes
from moss_codecs import cuda_kernel_test as cuda

from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS
from vllm_omni_moss.model_executor.models.moss_tts.ops import commit as commit_ops
from vllm_omni_moss.model_executor.models.moss_tts.ops import ring_attention as ring_ops
from vllm_omni_moss.model_executor.models.moss_tts.ops.dispatch import (
    TRITON_INTERPRET_AT_IMPORT,
    cpu_uses_triton_interpreter,
)
from vllm_omni_moss.model_executor.models.moss_tts.ops.ring_attention_packed import (
    ring_attention_write_packed,
    ring_attention_write_packed_reference,
)
from vllm_omni_moss.model_executor.models.moss_tts.ops.ring_reference import attend_gathered_rows
from vllm_omni_moss.model_executor.models.moss_tts.ops.ring_write import ring_write_reference
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_batch
from vllm_omni_moss.model_executor.models.moss_tts.step_metadata import apply_rope, build_ring_metadata, rope_tables

INTERPRETED = cpu_uses_triton_interpreter()
SEMANTICS = ("upstream", "exact")
H, DH, C, S = 2, 16, 8, 6

cpu = pytest.mark.cpu
core = pytest.mark.core_model


# ----------------------------------------------------------------------------------------------------
# Builders: the full packing of a grid step, the reference path, the op and its launches
# ----------------------------------------------------------------------------------------------------


def full_packing(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, T, Dh)`` (or tables ``(B, 1, T, Dh/2)``) packed with every row full: ``(1, H, B x T, Dh)``."""
    B, heads, T, D = x.shape
    return x.transpose(0, 1).reshape(1, heads, B * T, D)


def full_starts(B: int, T: int, device) -> torch.Tensor:
    """``(B,)`` first token of each row of the full packing: ``b x T``."""
    return torch.arange(B, device=device) * T


@contextlib.contextmanager
def block_sizes(queries: int, keys: int):
    """Run the attention kernel with these block sizes (small blocks exercise multi-block loops)."""
    saved = ring_ops._MAX_BLOCK_QUERIES, ring_ops._BLOCK_KEYS
    ring_ops._MAX_BLOCK_QUERIES, ring_ops._BLOCK_KEYS = queries, keys
    try:
        yield
    finally:
        ring_ops._MAX_BLOCK_QUERIES, ring_ops._BLOCK_KEYS = saved


def reference_layer(ring, routed, offsets, written, q, k, v, ring_semantics):
    """The reference path of one layer on ``ring`` (mutated): gather, attend, commit the touched cells.

    ``routed``: ``(B,)`` slot ids with padding rows on the null slot. Returns ``(B, T, H, Dh)``, padding
    queries zeroed.
    """
    B, heads, T, Dh = q.shape
    rows = ring.index_select(1, routed)
    meta = build_ring_metadata(ring_ops._Window(ring.shape[3], Dh), ring_semantics, offsets, written, T)
    out = attend_gathered_rows(ring_semantics, rows, meta, q, k, v)
    commit_ops.commit_ring(rows, ring, routed, offsets, written, T)
    valid = (torch.arange(T, device=q.device) < written.view(B, 1)).view(B, 1, T, 1)
    return torch.where(valid, out, 0.0).transpose(1, 2)


#: How kernel_layer runs a layer: the op as dispatched, or its kernels launched directly with the write fused into
#: the attention kernel or after it (the launch's ``fused_write``); only the launches take RoPE tables.
LAYER_OPS = ("packed", "fused", "split")


def kernel_layer(ring, slot_ids, offsets, written, q, k, v, ring_semantics, rope=(None, None), op="packed"):
    """A grid step's full packing through the op or its launch on ``ring`` (mutated); ``rope``: the chunk's
    ``(cos, sin)`` when ``q``/``k`` are unrotated (launches only); returns ``(B, T, H, Dh)``, padding queries as
    allocated."""
    B, heads, T, Dh = q.shape
    packed = [full_packing(x) for x in (q, k, v)]
    starts = full_starts(B, T, q.device)
    if op == "packed":
        assert rope[0] is None, "the op takes rotated queries and keys"
        out = ring_attention_write_packed(*packed, ring, slot_ids, offsets, written, starts, T, ring_semantics)
    else:
        tables = [None if t is None else full_packing(t) for t in rope]
        out = ring_ops.launch_ring_attention_triton(
            *packed, ring, slot_ids, offsets, written, starts, T, ring_semantics, *tables,
            write=True, tuning={"fused_write": op == "fused"},
        )  # fmt: skip
    return out.view(B, T, heads, Dh)


def assert_outputs_close(got, ref, written, what=""):
    """Valid queries finite and within 1e-5 of the reference's peak (padding queries are the op's dummies)."""
    B, T = got.shape[:2]
    valid = torch.arange(T, device=written.device) < written.view(B, 1)  # (B, T)
    assert torch.isfinite(got[valid]).all(), what
    scale = max(ref[valid].abs().max().item(), 1e-6) if valid.any() else 1.0
    err = (got[valid] - ref[valid]).abs().max().item() if valid.any() else 0.0
    assert err <= 1e-5 * scale, f"{what}: max error {err:.2e} (peak {scale:.3f})"


@st.composite
def step_scripts(draw):
    """A pool, its history and a few steps: mixed lengths, padding rows (null slot or junk ids),
    resets, offsets past a ring wrap, chunks longer than the ring, block sizes that split loops."""
    capacity = draw(st.sampled_from([5, 8, 13]))
    live = 3
    op = draw(st.sampled_from(LAYER_OPS))
    script = {
        "capacity": capacity,
        "offsets": draw(st.lists(st.integers(0, 4 * capacity), min_size=live, max_size=live)),
        "seed": draw(st.integers(0, 2**16)),
        "blocks": draw(st.sampled_from([(64, 64), (16, 16)])),
        "rope": op != "packed" and draw(st.booleans()),
        "op": op,
        "steps": [],
    }
    for _ in range(draw(st.integers(1, 4))):
        T = draw(st.integers(1, 2 * capacity + 3))
        rows = draw(st.permutations(range(live)))[: draw(st.integers(0, live))]
        script["steps"].append(
            {
                "T": T,
                "rows": list(rows),
                "written": [draw(st.integers(0, T)) for _ in rows],
                "padding": draw(st.lists(st.sampled_from(["null", "junk"]), max_size=2)),
                "reset": draw(st.lists(st.integers(0, live - 1), max_size=1)),
            }
        )
    return script


def run_script(script, ring_semantics, heads=2, head_dim=16):
    """Drive the reference path and the op (or its launches) through one script; compare every step."""
    gen = torch.Generator().manual_seed(script["seed"])
    capacity, live = script["capacity"], len(script["offsets"])
    null = live
    ref_ring = torch.randn(2, live + 1, heads, capacity, head_dim, generator=gen)
    ref_ring[:, null] = 0
    ops_ring = ref_ring.clone()
    offsets = torch.tensor(script["offsets"] + [0])  # the null slot's offset stays 0
    for i, step in enumerate(script["steps"]):
        for slot in step["reset"]:
            for ring in (ref_ring, ops_ring):
                ring[:, slot] = 0
            offsets[slot] = 0
        T, rows = step["T"], step["rows"]
        B = len(rows) + len(step["padding"])
        if B == 0:
            continue
        routed = torch.tensor(rows + [null] * len(step["padding"]))
        junk = {"null": null, "junk": live + 99}
        kernel_ids = torch.tensor(rows + [junk[p] for p in step["padding"]])
        written = torch.tensor(step["written"] + [0] * len(step["padding"]))
        row_offsets = offsets[routed]
        q, k, v = (2 * torch.randn(B, heads, T, head_dim, generator=gen) for _ in range(3))
        rope = (None, None)
        if script.get("rope"):
            # Unrotated q/k to the kernels, which rotate them as they load them; rotated to the reference path.
            rope = rope_tables(row_offsets, T, head_dim, 10000.0)
            qk = apply_rope(torch.stack((q, k)), *rope)
            ref = reference_layer(ref_ring, routed, row_offsets, written, *qk, v, ring_semantics)
        else:
            ref = reference_layer(ref_ring, routed, row_offsets, written, q, k, v, ring_semantics)
        with block_sizes(*script["blocks"]):
            got = kernel_layer(
                ops_ring, kernel_ids, row_offsets, written, q, k, v, ring_semantics, rope, script.get("op", "packed")
            )
        assert_outputs_close(got, ref, written, f"step {i}")
        assert torch.equal(ops_ring, ref_ring), f"step {i}: ring contents differ from the reference path"
        assert not ops_ring[:, null].any(), f"step {i}: the null slot was written"
        offsets[routed[: len(rows)]] += written[: len(rows)]


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


# ----------------------------------------------------------------------------------------------------
# CPU: the references, validation, the fake impl
# ----------------------------------------------------------------------------------------------------

REFERENCE_SCRIPT = {
    "capacity": 5,
    "offsets": [0, 3, 12],
    "seed": 1,
    "blocks": (64, 64),
    "steps": [
        {"T": 12, "rows": [2, 0, 1], "written": [12, 4, 1], "padding": ["null", "junk"], "reset": []},
        {"T": 3, "rows": [1, 2], "written": [3, 0], "padding": [], "reset": [0]},
        {"T": 7, "rows": [0, 1, 2], "written": [7, 6, 5], "padding": ["null"], "reset": []},
    ],
}


@cpu
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
def test_ops_reference_dispatch_matches_the_reference_path(ring_semantics):
    # On CPU without the interpreter the op runs its PyTorch reference: the same computation, so outputs are
    # bitwise and ring contents too (ring_write_reference vs scatter + commit_ring).
    if INTERPRETED:
        pytest.skip("the op runs the interpreted kernels in this process")
    run_script(REFERENCE_SCRIPT, ring_semantics)


@cpu
@core
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
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


def _good_args():
    """Valid arguments of the op: 3 rows of up to 4 tokens, 12 packed tokens, 2 heads of 16, rings of 5 cells."""
    B, T, N, Dh = 3, 4, 12, 16
    return dict(
        q=torch.zeros(1, H, N, Dh),
        k=torch.zeros(1, H, N, Dh),
        v=torch.zeros(1, H, N, Dh),
        ring=torch.zeros(2, 4, H, 5, Dh),
        slot_ids=torch.zeros(B, dtype=torch.long),
        offsets=torch.zeros(B, dtype=torch.long),
        valid_tokens=torch.zeros(B, dtype=torch.long),
        token_start=torch.arange(B) * T,
        num_tokens=T,
        ring_semantics="upstream",
    )


BAD_ARGUMENTS = [
    ("ring", torch.zeros(4, 2, 5, 16), ValueError, "`ring` must have shape (2, S, H, C, Dh) = (2, None, None, None, None), got (4, 2, 5, 16)"),
    ("ring", [0.0], TypeError, "`ring` must be a torch.Tensor, got list"),
    ("ring", torch.zeros(2, 4, 2, 5, 16, dtype=torch.long), ValueError, "`ring` must have one of the dtypes (torch.float32, torch.bfloat16, torch.float16), got torch.int64"),
    ("ring", torch.zeros(2, 4, 2, 5, 16, dtype=torch.float64), ValueError, "`ring` must have one of the dtypes (torch.float32, torch.bfloat16, torch.float16), got torch.float64"),
    ("q", torch.zeros(2, 2, 12, 16), ValueError, "`q` must have shape (1, H, N, Dh) = (1, 2, None, 16), got (2, 2, 12, 16)"),
    ("q", torch.zeros(1, 2, 12, 8), ValueError, "`q` must have shape (1, H, N, Dh) = (1, 2, None, 16), got (1, 2, 12, 8)"),
    ("q", torch.zeros(1, 2, 12, 16, dtype=torch.long), ValueError, "`q` must have a floating-point dtype, got torch.int64"),
    ("k", torch.zeros(1, 3, 12, 16), ValueError, "`k` must have shape (1, H, N, Dh) = (1, 2, 12, 16), got (1, 3, 12, 16)"),
    ("k", torch.zeros(1, 2, 12, 16, dtype=torch.bfloat16), ValueError, "`k` must have dtype torch.float32, got torch.bfloat16"),
    ("k", [0.0], TypeError, "`k` must be a torch.Tensor, got list"),
    ("v", torch.zeros(1, 2, 11, 16), ValueError, "`v` must have shape (1, H, N, Dh) = (1, 2, 12, 16), got (1, 2, 11, 16)"),
    ("token_start", torch.zeros(3, dtype=torch.int32), ValueError, "`token_start` must have dtype torch.int64, got torch.int32"),
    ("token_start", torch.zeros(3, 1, dtype=torch.long), ValueError, "`token_start` must have shape (B,) = (None,), got (3, 1)"),
    ("slot_ids", torch.zeros(3, dtype=torch.int32), ValueError, "`slot_ids` must have dtype torch.int64, got torch.int32"),
    ("offsets", torch.zeros(2, dtype=torch.long), ValueError, "`offsets` must have shape (B,) = (3,), got (2,)"),
    ("valid_tokens", torch.zeros(3, 1, dtype=torch.long), ValueError, "`valid_tokens` must have shape (B,) = (3,), got (3, 1)"),
    ("num_tokens", 0, ValueError, "`num_tokens` must be an integer >= 1, got 0"),
    ("num_tokens", True, ValueError, "`num_tokens` must be an integer >= 1, got True"),
    ("num_tokens", 4.0, ValueError, "`num_tokens` must be an integer >= 1, got 4.0"),
    ("ring_semantics", "v2", ValueError, "unknown ring semantics 'v2'; expected one of ('upstream', 'exact')"),
    ("page_table", [0], TypeError, "`page_table` must be a tensor or None, got list"),
    ("page_table", torch.zeros(3, dtype=torch.long), ValueError, "`page_table` must be (S, pages per ring) with at least one page, got (3,)"),
    ("page_table", torch.zeros(4, 0, dtype=torch.long), ValueError, "`page_table` must be (S, pages per ring) with at least one page, got (4, 0)"),
    ("page_table", torch.zeros(2, 3), ValueError, "`page_table` must be int32 or int64, got torch.float32"),
    ("page_table", torch.zeros(2, 3, dtype=torch.long, device="meta"), ValueError, "`page_table` is on meta, the ring on cpu"),
]  # fmt: skip


@cpu
@core
@pytest.mark.parametrize("name,bad,error,message", BAD_ARGUMENTS)
def test_bad_arguments_are_refused_with_the_argument_named(name, bad, error, message):
    args = _good_args()
    ring_attention_write_packed(**args)  # the unmodified arguments are accepted
    args[name] = bad
    with pytest.raises(error) as raised:
        ring_attention_write_packed(**args)
    assert type(raised.value) is error and str(raised.value) == f"ring_attention_write_packed: {message}"


@cpu
@core
@pytest.mark.parametrize("op", [ring_attention_write_packed, ring_attention_write_packed_reference])
def test_no_packed_token_answers_an_empty_output_and_leaves_the_rings(op):
    """Rows of no valid token over ``(1, H, 0, Dh)`` tensors: an empty output in the ring dtype, from the kernels
    and from the reference alike; no ring changes."""
    q, k, v, ring, slots, offsets, valid, start = _rows(4, "cpu")
    empty = q[:, :, :0]
    rings = ring.clone()
    got = op(empty, empty, empty, rings, slots, offsets, torch.zeros_like(valid), torch.zeros_like(start), 4, "exact")
    assert got.shape == (1, 0, H, DH) and got.dtype == ring.dtype and torch.equal(rings, ring)


def _compiled_layer(q, k, v, ring, slot_ids, offsets, written, starts, T):
    out = ring_attention_write_packed(q, k, v, ring, slot_ids, offsets, written, starts, T, "upstream")
    # The op again on the ring just written: its fake impl, and the mutation seen by what follows.
    again = ring_attention_write_packed(q, k, v, ring, slot_ids, offsets + 1, written, starts, T, "exact")
    return out * 2 + again


@cpu
def test_ops_trace_fullgraph_with_fake_impls():
    # aot_eager: Dynamo, the fake impl and functionalisation of the mutated ring, without Inductor. Rows full (a
    # padding row's positions are the op's dummies, as allocated: the full rows' outputs are compared).
    compiled = torch.compile(_compiled_layer, fullgraph=True, dynamic=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(3)
    for B, T in [(3, 4), (2, 9)]:
        q, k, v = (torch.randn(1, 2, B * T, 16, generator=gen) for _ in range(3))
        ring = torch.randn(2, 4, 2, 5, 16, generator=gen)
        args = (torch.tensor([2, 0, 1][:B]), torch.tensor([7, 0, 3][:B]), torch.tensor([T, T, T][:B]))
        eager_ring, compiled_ring = ring.clone(), ring.clone()
        expected = _compiled_layer(q, k, v, eager_ring, *args, full_starts(B, T, "cpu"), T)
        got = compiled(q, k, v, compiled_ring, *args, full_starts(B, T, "cpu"), T)
        assert got.shape == (1, B * T, 2, 16)
        assert torch.equal(got, expected) and torch.equal(compiled_ring, eager_ring)


# ----------------------------------------------------------------------------------------------------
# CPU: the Triton kernels themselves, in Triton's interpreter
# ----------------------------------------------------------------------------------------------------


test_triton_interpreter_subprocess = interpreter_subprocess_test(__file__, timeout=900)


@cpu
@needs_interpreter
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=step_scripts())
def test_kernels_interpreted_match_the_reference_path(ring_semantics, script):
    run_script(script, ring_semantics)


@cpu
@needs_interpreter
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
def test_kernels_interpreted_on_wrapped_and_oversized_rows(ring_semantics):
    # A fixed script with every hard case at once, both block configurations, RoPE outside and inside.
    cases = [((64, 64), False, "packed"), ((16, 16), False, "packed"), ((16, 16), True, "split")]
    cases += [((16, 16), True, "fused"), ((16, 16), False, "split"), ((64, 64), True, "fused")]
    for blocks, rope, op in cases:
        script = {
            "capacity": 13,
            "offsets": [0, 29, 1234],
            "seed": 7,
            "blocks": blocks,
            "rope": rope,
            "op": op,
            "steps": [
                {"T": 40, "rows": [1, 2, 0], "written": [40, 27, 13], "padding": ["junk", "null"], "reset": []},
                {"T": 17, "rows": [0, 2, 1], "written": [1, 17, 16], "padding": ["null"], "reset": [2]},
                {"T": 30, "rows": [2, 1], "written": [30, 0], "padding": [], "reset": []},
            ],
        }
        run_script(script, ring_semantics)


def _ring_phase_case(ring_semantics, capacity, T, seed, heads=2, head_dim=16):
    """Rows at every phase of a ring (empty, partial, full, wrapped, past 2**31 tokens), with every kind of
    chunk length (0, 1, partial, T); returns the grid step ``(q, k, v, ring, slot_ids, offsets, written)`` and
    its RoPE tables."""
    gen = torch.Generator().manual_seed(seed)
    offsets = [0, 3, capacity - 1, capacity, 4 * capacity + 3, 3 * 2**31 + 5, 0, 7]  # one past int32
    written = [T, max(T - 1, 0), T, 1, T, min(T, 2), 0, T // 2]
    B = len(offsets)
    ring = torch.randn(2, B + 1, heads, capacity, head_dim, generator=gen)
    q, k, v = (torch.randn(B, heads, T, head_dim, generator=gen) for _ in range(3))
    slot_ids = torch.randperm(B + 1, generator=gen)[:B]
    offsets, written = torch.tensor(offsets), torch.tensor(written)
    return (q, k, v, ring, slot_ids, offsets, written), rope_tables(offsets, T, head_dim, 10000.0)


def _launch_full_packing(step, tables, ring_semantics, **launch):
    """The kernels' launch on a grid step's full packing, unrotated queries and keys with their tables; returns
    ``(B, T, H, Dh)``."""
    q, k, v, ring, slot_ids, offsets, written = step
    B, heads, T, Dh = q.shape
    packed = [full_packing(x) for x in (q, k, v, *tables)]
    out = ring_ops.launch_ring_attention_triton(
        *packed[:3], ring, slot_ids, offsets, written, full_starts(B, T, "cpu"), T, ring_semantics, *packed[3:],
        **launch,
    )  # fmt: skip
    return out.view(B, T, heads, Dh)


@cpu
@needs_interpreter
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
@pytest.mark.parametrize("capacity,T", [(8, 1), (8, 5), (8, 20), (13, 40), (40, 13), (40, 37), (40, 100)])
@pytest.mark.parametrize("block_q,block_k", [(16, 16), (32, 16), (16, 32)])
def test_kernels_interpreted_at_every_ring_phase(ring_semantics, capacity, T, block_q, block_k):
    """Each query sees exactly the keys of its window: rows at every phase of the ring, chunks shorter
    and longer than the ring (both window edges inside the chunk), query and key blocks that split
    the window anywhere; the attention alone (no write), against the reference; the rings untouched."""
    step, tables = _ring_phase_case(ring_semantics, capacity, T, seed=capacity * T + block_q)
    before = step[3].clone()
    got = _launch_full_packing(step, tables, ring_semantics, tuning=dict(block_q=block_q, block_k=block_k))
    expected = ring_ops.ring_attention_reference(*step, ring_semantics, *tables)
    assert_outputs_close(got, expected, step[6])
    assert torch.equal(step[3], before)


@cpu
@needs_interpreter
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
@pytest.mark.parametrize("capacity,T", [(8, 1), (8, 20), (13, 40), (40, 37), (40, 100)])
@pytest.mark.parametrize("fused", [True, False])
def test_attention_write_interpreted_at_every_ring_phase(ring_semantics, capacity, T, fused):
    """The attention and write, the write fused into the attention kernel (one program walking 16-query
    blocks, so rows of up to 7 blocks, the chunk longer than the ring) or after it: outputs as the
    reference's, ring contents bitwise."""
    step, tables = _ring_phase_case(ring_semantics, capacity, T, seed=capacity * T)
    ref_ring = step[3].clone()
    expected = ring_ops.ring_attention_write_reference(*step[:3], ref_ring, *step[4:], ring_semantics, *tables)
    tuning = dict(block_q=16, block_k=16, fused_write=fused)
    got = _launch_full_packing(step, tables, ring_semantics, write=True, tuning=tuning)
    assert_outputs_close(got, expected, step[6])
    assert torch.equal(step[3], ref_ring)


def _visible_cells(offset: int, written: int, capacity: int, ring_semantics: str) -> set[int]:
    """Ring cells holding a position some valid query of the row may see (independent of the kernel)."""
    visible = set()
    for t in range(written):
        q = offset + t
        for p in range(max(0, q - capacity + 1), offset):
            if ring_semantics == "upstream" and p < offset + written - capacity:
                continue
            visible.add(p % capacity)
    return visible


@cpu
@needs_interpreter
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
@pytest.mark.parametrize(
    "blocks,fused_rope,op",
    [((64, 64), False, "packed"), ((16, 16), False, "split"), ((16, 16), True, "split"), ((16, 16), True, "fused")],
)
def test_kernels_interpreted_never_read_cells_no_query_sees(ring_semantics, blocks, fused_rope, op):
    """Every ring cell no valid query may see, every unused slot, the null slot and every padding
    token of q, k and v filled with NaN: the outputs and the written cells are bitwise unchanged
    (also with the write fused into the attention kernel, over two query blocks)."""
    capacity, heads, Dh, T = 8, 2, 16, 20
    gen = torch.Generator().manual_seed(11)
    ring = torch.randn(2, 6, heads, capacity, Dh, generator=gen)
    slot_ids = torch.tensor([3, 0, 5, 2, 1, 5])  # 5 is the null slot; slot 4 is unused
    offsets = torch.tensor([0, 3, 8, 37, 5, 0])
    written = torch.tensor([20, 5, 12, 1, 0, 0])  # rows 4 (valid but empty) and 5 (padding) read nothing
    q, k, v = (torch.randn(6, heads, T, Dh, generator=gen) for _ in range(3))
    poisoned = torch.full_like(ring, float("nan"))
    for b in range(4):
        for cell in _visible_cells(int(offsets[b]), int(written[b]), capacity, ring_semantics):
            poisoned[:, slot_ids[b], :, cell] = ring[:, slot_ids[b], :, cell]
    padding = (torch.arange(T) >= written.view(-1, 1)).view(6, 1, T, 1).expand(6, heads, T, Dh)
    nan_q, nan_k, nan_v = (x.masked_fill(padding, float("nan")) for x in (q, k, v))
    rope = rope_tables(offsets, T, Dh, 10000.0) if fused_rope else (None, None)
    with block_sizes(*blocks):
        clean = kernel_layer(ring.clone(), slot_ids, offsets, written, q, k, v, ring_semantics, rope, op)
        after = poisoned.clone()
        dirty = kernel_layer(after, slot_ids, offsets, written, nan_q, nan_k, nan_v, ring_semantics, rope, op)
    valid = ~padding[:, 0, :, 0]  # (B, T)
    assert torch.equal(dirty[valid], clean[valid]) and torch.isfinite(dirty[valid]).all()
    touched = commit_ops.touched_ring_mask(offsets, written, capacity)  # (B, C)
    expected = poisoned.clone()
    ring_write_reference(k, v, expected, slot_ids, offsets, written, *rope)
    for b in range(6):
        cells = touched[b].nonzero().flatten()
        assert torch.equal(after[:, slot_ids[b], :, cells], expected[:, slot_ids[b], :, cells])
    assert torch.equal(after.isnan(), expected.isnan()), "the write touched a cell it must not"


@cpu
@needs_interpreter
@pytest.mark.parametrize("plane", [0, 1])
def test_kernels_interpreted_propagate_a_nan_the_queries_see(plane):
    # A NaN key (plane 0) or value (plane 1) in one ring cell: the queries that see it output NaN, as
    # the reference path's SDPA does; the others stay finite and match it.
    capacity, heads, Dh, T = 6, 2, 16, 5
    gen = torch.Generator().manual_seed(13)
    ring = torch.randn(2, 2, heads, capacity, Dh, generator=gen)
    ring[plane, 0, 1, 2, 3] = float("nan")  # slot 0, head 1, cell 2 = position 8, seen under both ring_semantics
    q, k, v = (torch.randn(1, heads, T, Dh, generator=gen) for _ in range(3))
    args = (torch.tensor([0]), torch.tensor([9]), torch.tensor([T]), torch.tensor([0]), T)
    for ring_semantics in SEMANTICS:
        got = ring_attention_write_packed(q, k, v, ring.clone(), *args, ring_semantics)
        expected = ring_attention_write_packed_reference(q, k, v, ring.clone(), *args, ring_semantics)
        assert torch.equal(got.isnan(), expected.isnan()) and got[0, :, 1].isnan().any(), ring_semantics
        assert not got[0, :, 0].isnan().any(), "head 0 never reads the NaN"
        finite = ~expected.isnan()
        assert (got[finite] - expected[finite]).abs().max().item() <= 1e-5 * expected[finite].abs().max().item()


@cpu
@needs_interpreter
def test_bfloat16_rings_take_the_reference_under_the_interpreter():
    # The interpreter's bfloat16 arithmetic is not the GPU's: bf16 rings run the reference even here.
    for ring_semantics in SEMANTICS:
        q, k, v, ring, slots, offsets, valid, start = _rows(7, "cpu", torch.bfloat16, seed=17)
        ref_ring = ring.clone()
        got = ring_attention_write_packed(q, k, v, ring, slots, offsets, valid, start, 7, ring_semantics)
        want = ring_attention_write_packed_reference(q, k, v, ref_ring, slots, offsets, valid, start, 7, ring_semantics)
        real = torch.zeros(q.shape[2], dtype=torch.bool)
        for s, n in zip(start.tolist(), valid.tolist()):
            real[s : s + n] = True
        assert torch.equal(got[0, real], want[0, real]) and torch.equal(ring, ref_ring)


@cpu
@needs_interpreter
def test_kernels_interpreted_follow_strides():
    # q, k and v as strided views of one (1, N, 3, H, Dh) projection, as the decoder's packed qkv projection
    # gives them; a ring that is not contiguous.
    capacity, heads, Dh, T, B = 5, 2, 16, 7, 3
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(1, B * T, 3, heads, Dh, generator=gen).permute(2, 0, 3, 1, 4)  # (3, 1, H, N, Dh)
    ring = torch.randn(2, 4, heads, capacity, Dh, generator=gen)
    ring = ring.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    assert not ring.is_contiguous() and not qkv[2].is_contiguous()
    args = (torch.tensor([1, 3, 0]), torch.tensor([4, 0, 11]), torch.tensor([7, 3, 5]), full_starts(B, T, "cpu"), T)
    for ring_semantics in SEMANTICS:
        ref_ring, work = ring.contiguous(), ring.clone()
        assert not work.is_contiguous()
        expected = ring_attention_write_packed_reference(*qkv.contiguous(), ref_ring, *args, ring_semantics)
        got = ring_attention_write_packed(*qkv, work, *args, ring_semantics)
        assert_outputs_close(got.view(B, T, heads, Dh), expected.view(B, T, heads, Dh), args[2])
        assert torch.equal(work, ref_ring)


def _check_ragged_equals_full(T: int, ring_semantics: str, device: str, dtype=torch.float32) -> None:
    """Rows packed one after another (dummies after the last) and the same rows in their full packing (row ``b``
    from ``b x T``): bitwise the same outputs at every row's valid queries and the same rings."""
    q, k, v, ring, slots, offsets, valid, start = _rows(T, device, dtype)
    ragged_ring, full_ring = ring.clone(), ring.clone()
    got = ring_attention_write_packed(q, k, v, ragged_ring, slots, offsets, valid, start, T, ring_semantics)
    grid = [_grid(x, start, valid, T) for x in (q, k, v)]
    want = kernel_layer(full_ring, slots, offsets, valid, *grid, ring_semantics)  # (B, T, H, Dh)
    assert got.shape == (1, q.shape[2], H, DH) and got.dtype == ring.dtype
    for b, (s, n) in enumerate(zip(start.tolist(), valid.tolist())):
        assert torch.equal(got[0, s : s + n], want[b, :n]), f"row {b}"
    assert torch.equal(ragged_ring, full_ring)
    assert not torch.equal(full_ring, ring)  # the step wrote


@cpu
@core
@needs_interpreter
@pytest.mark.parametrize("T", [5, 40])  # the write fused into the attention kernel, and its own kernel after it
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
def test_ragged_packing_interpreted_equals_the_full_packing(T, ring_semantics):
    _check_ragged_equals_full(T, ring_semantics, "cpu")


# ----------------------------------------------------------------------------------------------------
# Paged rings
# ----------------------------------------------------------------------------------------------------


_CUDA_MARKS = (
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(TRITON_INTERPRET_AT_IMPORT, reason="kernels are interpreted here"),
    pytest.mark.cuda,
)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA_MARKS)])
@pytest.mark.parametrize("num_tokens", [7, 25])
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_paged_rings_equal_unpaged_rings(path, ring_semantics, num_tokens, device):
    """A paged ring (pages scattered over the pool, unused pages NaN) gives bitwise the outputs and
    ring contents of the unpaged ring it maps, for the op and its reference, rows wrapping and rows longer
    than C; on CUDA the Triton kernels read and write through the page table (on CPU the kernel path runs the
    reference here, and the interpreted kernels in the test below)."""
    _check_paged_equals_unpaged(path, ring_semantics, num_tokens, device)


@needs_interpreter
@pytest.mark.parametrize("num_tokens", [7, 25])
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
def test_paged_kernels_interpreted_equal_unpaged_rings(ring_semantics, num_tokens):
    """The same check through the interpreted Triton kernels (float32): pages of 5 cells, a page size
    that is not a power of two, as the kernels' compile-time ``PAGE_SIZE``."""
    _check_paged_equals_unpaged("kernel", ring_semantics, num_tokens, "cpu")


def _check_paged_equals_unpaged(path, ring_semantics, num_tokens, device):
    op = ring_attention_write_packed if path == "kernel" else ring_attention_write_packed_reference
    gen = torch.Generator().manual_seed(11)
    slots, heads, Dh, page_size, n = 4, 2, 16, 5, 4  # rings of 20 cells in 4 pages of 5
    num_pages = slots * n + 3
    unpaged = torch.randn(2, slots, heads, n * page_size, Dh, generator=gen).to(device)
    before = unpaged.clone()
    table = torch.randperm(num_pages, generator=gen)[: slots * n].view(slots, n).to(device)
    paged = torch.full((2, num_pages, heads, page_size, Dh), float("nan"), device=device)
    paged[:, table] = unpaged.view(2, slots, heads, n, page_size, Dh).permute(0, 1, 3, 2, 4, 5)
    unused = sorted(set(range(num_pages)) - set(table.flatten().tolist()))
    B, T = 3, num_tokens
    q, k, v = (torch.randn(1, heads, B * T, Dh, generator=gen).to(device) for _ in range(3))
    slot_ids = torch.tensor([2, 0, 3], device=device)
    offsets = torch.tensor([3, 13, 57], device=device)
    valid_tokens = torch.tensor([T, 0, T - 2], device=device)
    args = (slot_ids, offsets, valid_tokens, full_starts(B, T, device), T, ring_semantics)
    want = op(q, k, v, unpaged, *args).view(B, T, heads, Dh)
    got = op(q, k, v, paged, *args, page_table=table).view(B, T, heads, Dh)
    valid = torch.arange(T, device=device) < valid_tokens.view(B, 1)
    assert torch.equal(got[valid], want[valid])
    mapped = paged[:, table].permute(0, 1, 3, 2, 4, 5).reshape(unpaged.shape)
    assert torch.equal(mapped, unpaged) and not torch.equal(unpaged, before)  # the step wrote
    assert paged[:, unused].isnan().all()


# ----------------------------------------------------------------------------------------------------
# CPU, interpreted: whole decoder steps through the compact pool's "triton" backend
# ----------------------------------------------------------------------------------------------------

POOL_SCRIPT = [  # (T, lengths of rows on slots 0, 1, 2; None = not in the step), reset after step 1
    (3, [3, 1, None]),
    (12, [12, 0, 7]),
    (1, [None, 1, 1]),
    (7, [5, 7, 7]),
]


@cpu
@needs_interpreter
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
def test_pool_interpreted_triton_backend_matches_sdpa(ring_semantics, ring_decoder):
    """Rings of 5 and 10 tokens, chunks of up to 24 tokens, padding rows, a reset: audio within 1e-5,
    offsets equal, the first layer's ring bitwise (later layers' keys depend on earlier outputs)."""
    sdpa = make_state_pool(ring_decoder, "compact", ring_semantics=ring_semantics, attention_backend="sdpa")
    tri = make_state_pool(ring_decoder, "compact", ring_semantics=ring_semantics, attention_backend="triton")
    for pool in (sdpa, tri):
        pool.initialize(3)
    for step, (T, lengths) in enumerate(POOL_SCRIPT):
        rows = [s for s, n in enumerate(lengths) if n is not None]
        B = len(rows) + 1  # one padding row
        codes = random_codes(ring_decoder, B, T, seed=50 + step)
        args = (
            torch.tensor([lengths[s] for s in rows] + [T]),
            torch.tensor(rows + [-1]),
            torch.tensor([True] * len(rows) + [False]),
        )
        a, a_len = decode_batch(sdpa, codes, *args)
        b, b_len = decode_batch(tri, codes, *args)
        assert torch.equal(a_len, b_len)
        scale = a.abs().max().item()
        assert (a - b).abs().max().item() <= 1e-5 * scale, f"step {step}: audio differs"
        assert torch.equal(sdpa.frames_decoded, tri.frames_decoded)
        assert torch.equal(sdpa.rings[0], tri.rings[0]), f"step {step}: first layer's ring differs"
        for layer, (x, y) in enumerate(zip(sdpa.rings, tri.rings)):
            assert (x - y).abs().max().item() <= 1e-5 * max(x.abs().max().item(), 1e-6), f"layer {layer}"
        assert not any(r[:, tri.null_slot].any() for r in tri.rings)
        if step == 1:
            sdpa.reset([0])
            tri.reset([0])


@cpu
@needs_interpreter
def test_pool_interpreted_exact_streaming_equals_offline(ring_decoder):
    codes = random_codes(ring_decoder, 1, 32, seed=8)
    offline = ring_decoder.decode(codes)
    for schedule in ([1, 15], [1, 4, 15], [2, 9, 1, 6]):
        audio = _pool_stream(ring_decoder, codes, schedule, "exact", "triton")
        err = (audio - offline).abs().max().item()
        assert err <= 1e-5 * offline.abs().max().item(), f"schedule {schedule}: {err:.2e}"


def _pool_stream(decoder, codes, schedule, ring_semantics, backend):
    """Stream ``codes`` ``(n_vq, 1, N)`` through a compact pool in chunks of ``schedule`` (cyclic after the first)."""
    from vllm_omni_moss.model_executor.models.moss_tts.decoder import chunk_schedule

    pool = make_state_pool(decoder, "compact", ring_semantics=ring_semantics, attention_backend=backend)
    pool.initialize(1)
    parts = []
    for a, b in chunk_schedule(codes.shape[-1], schedule):
        chunk = codes[:, :, a:b].to(decoder.device)
        ones = torch.ones(1, dtype=torch.long, device=decoder.device)
        audio, _ = decode_batch(pool, chunk, ones * (b - a), ones * 0, ones.bool())
        parts.append(audio)
    return torch.cat(parts, dim=-1)


# ----------------------------------------------------------------------------------------------------
# CUDA: compiled kernels
# ----------------------------------------------------------------------------------------------------


def _cuda_case(B, heads, T, capacity, Dh, dtype, seed, offsets, written):
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    ring = torch.randn(2, B + 2, heads, capacity, Dh, generator=gen, device=device).to(dtype)
    q, k, v = (torch.randn(B, heads, T, Dh, generator=gen, device=device).to(dtype) for _ in range(3))
    slot_ids = torch.randperm(B + 1, device=device)[:B]
    return q, k, v, ring, slot_ids, torch.tensor(offsets, device=device), torch.tensor(written, device=device)


@cuda
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
@pytest.mark.parametrize(
    "T,C,written",
    [
        pytest.param(15, 125, [15, 7, 0, 1], marks=pytest.mark.slow),
        (480, 400, [480, 401, 399, 0]),
        pytest.param(1, 400, [1, 1, 0, 1], marks=pytest.mark.slow),
        pytest.param(60, 250, [60, 3, 60, 59], marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize(
    "fused_rope,op", [(False, "packed"), (False, "fused"), (False, "split"), (True, "fused"), (True, "split")]
)
def test_cuda_kernels_match_reference_float32(ring_semantics, T, C, written, fused_rope, op):
    # The reference path runs on the CPU copies: CPU SDPA is the documented oracle (a query that sees
    # no key gives zeros there), and copied ring cells are bitwise the same on either device. With
    # fused_rope the kernels rotate q and k themselves: the ring must still be bitwise the CPU's.
    args = _cuda_case(4, 12, T, C, 64, torch.float32, T + C, [0, 397, 1234, 5], written)
    q, k, v, ring, slot_ids, offsets, valid_tokens = args
    ref_ring = ring.cpu()
    host = [t.cpu() for t in (slot_ids, offsets, valid_tokens, q, k, v)]
    rope = (None, None)
    if fused_rope:
        rope = rope_tables(offsets, T, 64, 10000.0)
        host[3:5] = apply_rope(torch.stack(host[3:5]), *(t.cpu() for t in rope))
    expected = reference_layer(ref_ring, *host, ring_semantics)
    got = kernel_layer(ring, slot_ids, offsets, valid_tokens, q, k, v, ring_semantics, rope, op)
    assert_outputs_close(got.cpu(), expected, valid_tokens.cpu())
    assert torch.equal(ring.cpu(), ref_ring)


@cuda
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
@pytest.mark.parametrize(
    "T,C",
    [
        (15, 125),
        pytest.param(30, 250, marks=pytest.mark.slow),
        pytest.param(60, 400, marks=pytest.mark.slow),
        pytest.param(120, 400, marks=pytest.mark.slow),
        (480, 400),
    ],
)
def test_cuda_attention_write_bfloat16_fused_equals_split(ring_semantics, T, C):
    """The write fused into the attention kernel and the write kernel after it, in bf16 at the v2 groups' shapes
    of a 15-frame step, RoPE in the kernels: bitwise the same outputs and rings; and the op as dispatched on
    rotated inputs bitwise the split launch on them."""
    written = [T, T - 1, T, 0, 1, T // 2, T, 17 % (T + 1)]
    case = _cuda_case(8, 12, T, C, 64, torch.bfloat16, 5, [0, 397, 1234, 5, 80, 400, 9, 3], written)
    q, k, v, ring, slot_ids, offsets, valid_tokens = case
    valid = torch.arange(T, device="cuda") < valid_tokens.view(-1, 1)
    for rope in (rope_tables(offsets, T, 64, 10000.0), (None, None)):
        want_ring = ring.clone()
        want = kernel_layer(want_ring, slot_ids, offsets, valid_tokens, q, k, v, ring_semantics, rope, "split")
        for op in ("fused", "packed") if rope[0] is None else ("fused",):
            work = ring.clone()
            got = kernel_layer(work, slot_ids, offsets, valid_tokens, q, k, v, ring_semantics, rope, op)
            assert torch.equal(got[valid], want[valid]), f"{op}: outputs differ"
            assert torch.equal(work, want_ring), f"{op}: rings differ"


@cuda
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
def test_cuda_kernels_bfloat16_within_rounding_and_deterministic(ring_semantics):
    q, k, v, ring, slot_ids, offsets, valid_tokens = _cuda_case(
        8, 12, 480, 400, 64, torch.bfloat16, 1, [0, 397, 1234, 5, 80, 400, 9, 3], [480, 401, 399, 0, 1, 200, 480, 17]
    )
    valid = (torch.arange(480) < valid_tokens.cpu().view(-1, 1)).view(8, 480, 1, 1)
    runs = []
    for _ in range(2):
        work = ring.clone()
        out = kernel_layer(work, slot_ids, offsets, valid_tokens, q, k, v, ring_semantics).cpu().float()
        runs.append((torch.where(valid, out, 0.0), work))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), "two runs differ"
    host = [t.cpu() for t in (slot_ids, offsets, valid_tokens)]
    floats = [t.cpu().float() for t in (q, k, v, ring)]
    expected = ring_ops.ring_attention_reference(*floats, *host, ring_semantics)
    rel = ((runs[0][0] - expected).norm() / expected.norm()).item()
    assert rel <= 1e-2, f"bf16 kernel vs fp32 reference: relative L2 {rel:.2e}"


@cuda
def test_cuda_kernels_capture_in_a_graph():
    q, k, v, ring, slot_ids, offsets, valid_tokens = _cuda_case(
        4, 12, 15, 125, 64, torch.bfloat16, 2, [0, 3, 130, 7], [15, 2, 0, 9]
    )
    static = [t.clone() for t in (q, k, v, slot_ids, offsets, valid_tokens)]
    work = ring.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernel_layer(work.clone(), *[static[i] for i in (3, 4, 5)], *static[:3], "upstream")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel_layer(work, *[static[i] for i in (3, 4, 5)], *static[:3], "upstream")
    for seed in range(3):
        new = _cuda_case(4, 12, 15, 125, 64, torch.bfloat16, 10 + seed, [seed, 7, 400, 13], [15, 0, 15, 1 + seed])
        for dst, src in zip(static, (*new[:3], *new[4:])):
            dst.copy_(src)
        work.copy_(new[3])
        graph.replay()
        expected_ring = new[3].clone()
        expected = kernel_layer(expected_ring, *new[4:], *new[:3], "upstream")
        valid = torch.arange(15, device="cuda") < new[6].view(-1, 1)
        assert torch.equal(out[valid], expected[valid]) and torch.equal(work, expected_ring)


@cuda
def test_cuda_ring_attention_addresses_beyond_int32():
    device = torch.device("cuda")
    num_slots, heads, capacity, Dh = 1100, 16, 1024, 64
    assert 2 * num_slots * heads * capacity * Dh > 2**31
    ring = torch.zeros(2, num_slots, heads, capacity, Dh, dtype=torch.bfloat16, device=device)
    ring[:, num_slots - 1] = torch.randn(2, heads, capacity, Dh, device=device).to(torch.bfloat16)
    q, k, v = (torch.randn(1, heads, 4, Dh, device=device).to(torch.bfloat16) for _ in range(3))
    floats = [x.cpu().float() for x in (q, k, v, ring[:, num_slots - 1 :])]
    args = (torch.tensor([num_slots - 1], device=device), torch.tensor([5000], device=device))
    written, start = torch.tensor([4], device=device), torch.tensor([0], device=device)
    got = ring_attention_write_packed(q, k, v, ring, *args, written, start, 4, "exact")
    host = (torch.tensor([0]), torch.tensor([5000]), torch.tensor([4]))  # the one slot is slot 0 of the copy
    expected = ring_ops.ring_attention_reference(*floats, *host, "exact")
    assert ((got.cpu().float() - expected).norm() / expected.norm()).item() <= 1e-2
    cells = (5000 + torch.arange(4, device=device)) % capacity
    assert torch.equal(ring[0, num_slots - 1, :, cells], k[0]) and torch.equal(ring[1, num_slots - 1, :, cells], v[0])


@cuda
def test_cuda_tiny_codec_triton_pool_equals_sdpa_pool(tmp_path):
    decoder = build_decoder(PRESETS["tiny-v2"], tmp_path, device="cuda").float()
    codes = random_codes(decoder, 1, 40, seed=3)
    for ring_semantics in SEMANTICS:
        ref = _pool_stream(decoder, codes, [1, 15], ring_semantics, "sdpa")
        got = _pool_stream(decoder, codes, [1, 15], ring_semantics, "triton")
        assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@cuda
@pytest.mark.parametrize("T", [1, 6, 48])
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_packing_equals_the_full_packing_on_cuda(T, ring_semantics, dtype):
    _check_ragged_equals_full(T, ring_semantics, "cuda", dtype)
