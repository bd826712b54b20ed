# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.ring_attention``: attention that reads rings in place, and the ring write.

The reference path of one layer (what the ``"sdpa"`` backend of the compact pool does) is: gather each
row's ring, ``attend_gathered_rows`` (scatter the chunk, SDPA with the step's mask), ``commit_ring`` of
the touched cells. The ops must match it: outputs of valid queries within 1e-5 (float32), ring contents
bit for bit.

The Triton kernels run on CPU in Triton's interpreter, as in ``test_ops_commit.py``: whether a kernel is
interpreted is fixed when the module is imported, so ``test_triton_interpreter_subprocess`` re-runs this
file in a child with ``TRITON_INTERPRET=1`` selecting the ``*interpreted*`` tests, which the parent skips.
To run them directly:

    TRITON_INTERPRET=1 python -m pytest tests/model_executor/models/moss_tts/ops/test_ops_ring_attention.py -k interpreted
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
from vllm_omni_moss.model_executor.models.moss_tts.ops import ring_write as write_ops
from vllm_omni_moss.model_executor.models.moss_tts.ops.dispatch import (
    TRITON_INTERPRET_AT_IMPORT,
    cpu_uses_triton_interpreter,
)
from vllm_omni_moss.model_executor.models.moss_tts.ops.ring_reference import attend_gathered_rows
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_batch
from vllm_omni_moss.model_executor.models.moss_tts.step_metadata import apply_rope, build_ring_metadata, rope_tables

INTERPRETED = cpu_uses_triton_interpreter()
SEMANTICS = ("upstream", "exact")

cpu = pytest.mark.cpu


# ----------------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------------


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
    B, H, T, Dh = q.shape
    rows = ring.index_select(1, routed)
    meta = build_ring_metadata(ring_ops._Window(ring.shape[3], Dh), ring_semantics, offsets, written, T)
    out = attend_gathered_rows(ring_semantics, rows, meta, q, k, v)
    commit_ops.commit_ring(rows, ring, routed, offsets, written, T)
    valid = (torch.arange(T, device=q.device) < written.view(B, 1)).view(B, 1, T, 1)
    return torch.where(valid, out, 0.0).transpose(1, 2)


#: How kernel_layer runs a layer: ``ring_attention`` then ``ring_write``, ``ring_attention_write`` as
#: dispatched, or its kernel with the write fused into the attention kernel / after it (launch option).
LAYER_OPS = ("pair", "auto", "fused", "split")


def kernel_layer(ring, slot_ids, offsets, written, q, k, v, ring_semantics, rope=(None, None), op="pair"):
    """The ops on ``ring`` (mutated); ``rope``: the chunk's ``(cos, sin)`` when ``q``/``k`` are unrotated;
    ``op``: one of :data:`LAYER_OPS` (``"fused"`` and ``"split"`` launch the Triton kernel directly)."""
    args = (q, k, v, ring, slot_ids, offsets, written, ring_semantics, *rope)
    if op == "pair":
        out = ring_ops.ring_attention(*args)
        write_ops.ring_write(k, v, ring, slot_ids, offsets, written, *rope)
        return out
    if op == "auto":
        return ring_ops.ring_attention_write(*args)
    return ring_ops.launch_ring_attention_triton(*args, write=True, tuning={"fused_write": op == "fused"})


def assert_outputs_close(got, ref, written, what=""):
    """Valid queries within 1e-5 of the reference's peak; padding queries exactly zero."""
    B, T = got.shape[:2]
    valid = torch.arange(T) < written.view(B, 1)  # (B, T)
    assert torch.isfinite(got).all(), what
    assert not got[~valid].any(), f"{what}: padding queries must output zeros"
    scale = max(ref[valid].abs().max().item(), 1e-6) if valid.any() else 1.0
    err = (got[valid] - ref[valid]).abs().max().item() if valid.any() else 0.0
    assert err <= 1e-5 * scale, f"{what}: max error {err:.2e} (peak {scale:.3f})"


@st.composite
def step_scripts(draw):
    """A pool, its history and a few steps: mixed lengths, padding rows (null slot or junk ids),
    resets, offsets past a ring wrap, chunks longer than the ring, block sizes that split loops."""
    capacity = draw(st.sampled_from([5, 8, 13]))
    live = 3
    script = {
        "capacity": capacity,
        "offsets": draw(st.lists(st.integers(0, 4 * capacity), min_size=live, max_size=live)),
        "seed": draw(st.integers(0, 2**16)),
        "blocks": draw(st.sampled_from([(64, 64), (16, 16)])),
        "rope": draw(st.booleans()),
        "op": draw(st.sampled_from(LAYER_OPS)),
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
    """Drive the reference path and the ops through one script; compare every step."""
    gen = torch.Generator().manual_seed(script["seed"])
    C, live = script["capacity"], len(script["offsets"])
    null = live
    ref_ring = torch.randn(2, live + 1, heads, C, head_dim, generator=gen)
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
            # Unrotated q/k to the ops, which rotate them in the kernels; rotated to the reference path.
            rope = rope_tables(row_offsets, T, head_dim, 10000.0)
            ref = reference_layer(
                ref_ring, routed, row_offsets, written, *apply_rope(torch.stack((q, k)), *rope), v, ring_semantics
            )
        else:
            ref = reference_layer(ref_ring, routed, row_offsets, written, q, k, v, ring_semantics)
        with block_sizes(*script["blocks"]):
            got = kernel_layer(
                ops_ring, kernel_ids, row_offsets, written, q, k, v, ring_semantics, rope, script.get("op", "pair")
            )
        assert_outputs_close(got, ref, written, f"step {i}")
        assert torch.equal(ops_ring, ref_ring), f"step {i}: ring contents differ from the reference path"
        assert not ops_ring[:, null].any(), f"step {i}: the null slot was written"
        offsets[routed[: len(rows)]] += written[: len(rows)]


# ----------------------------------------------------------------------------------------------------
# CPU: references and validation
# ----------------------------------------------------------------------------------------------------


@cpu
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
def test_ops_reference_dispatch_matches_the_reference_path(ring_semantics):
    # On CPU without the interpreter the ops run their PyTorch references: the same computation, so
    # outputs are bitwise and ring contents too (ring_write_reference vs scatter + commit_ring).
    if INTERPRETED:
        pytest.skip("the ops run the interpreted kernels in this process")
    script = {
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
    run_script(script, ring_semantics)
    run_script({**script, "op": "auto"}, ring_semantics)  # ring_attention_write's references, in turn


@cpu
def test_ring_write_keeps_the_last_capacity_tokens_of_each_row():
    C, T = 4, 10
    ring = torch.full((2, 3, 1, C, 1), -1.0)
    k = torch.arange(20.0).view(2, 1, T, 1)
    v = -k
    # Row 0: 10 tokens from offset 6 -> tokens 6..9 at positions 12..15 -> cells 0..3.
    # Row 1: 3 tokens from offset 1 -> positions 1..3 -> cells 1..3. Row 2 (padding, junk slot id).
    write_ops.ring_write_reference(
        torch.cat([k, torch.zeros(1, 1, T, 1)]),
        torch.cat([v, torch.zeros(1, 1, T, 1)]),
        ring,
        torch.tensor([2, 0, 99]),
        torch.tensor([6, 1, 0]),
        torch.tensor([10, 3, 0]),
    )
    assert ring[0, 2, 0, :, 0].tolist() == [6.0, 7.0, 8.0, 9.0]
    assert ring[1, 2, 0, :, 0].tolist() == [-6.0, -7.0, -8.0, -9.0]
    assert ring[0, 0, 0, :, 0].tolist() == [-1.0, 10.0, 11.0, 12.0]
    assert ring[:, 1].eq(-1).all()


def _good_args():
    B, H, T, C, Dh = 3, 2, 4, 5, 16
    return dict(
        q=torch.zeros(B, H, T, Dh),
        k=torch.zeros(B, H, T, Dh),
        v=torch.zeros(B, H, T, Dh),
        ring=torch.zeros(2, 4, H, C, Dh),
        slot_ids=torch.zeros(B, dtype=torch.long),
        offsets=torch.zeros(B, dtype=torch.long),
        valid_tokens=torch.zeros(B, dtype=torch.long),
    )


@cpu
@pytest.mark.parametrize(
    "name,bad,message",
    [
        ("ring", torch.zeros(4, 2, 5, 16), r"`ring` must have shape \(2, S, H, C, Dh\)"),
        ("ring", torch.zeros(2, 4, 2, 5, 16, dtype=torch.long), "`ring` must have one of the dtypes"),
        (
            "ring",
            torch.zeros(2, 4, 2, 5, 16, dtype=torch.float64),
            r"`ring` must have one of the dtypes \(torch.float32, torch.bfloat16, torch.float16\), got torch.float64",
        ),
        ("k", torch.zeros(3, 3, 4, 16), r"`k` must have shape \(B, H, T, Dh\) = \(None, 2, None, 16\)"),
        ("k", torch.zeros(3, 2, 4, 16, dtype=torch.bfloat16), "`k` must have dtype torch.float32"),
        ("v", torch.zeros(3, 2, 5, 16), r"`v` must have shape \(B, H, T, Dh\) = \(3, 2, 4, 16\), got \(3, 2, 5, 16\)"),
        ("slot_ids", torch.zeros(3, dtype=torch.int32), "`slot_ids` must have dtype torch.int64"),
        ("offsets", torch.zeros(2, dtype=torch.long), r"`offsets` must have shape \(B,\)"),
        ("valid_tokens", torch.zeros(3, 1, dtype=torch.long), r"`valid_tokens` must have shape \(B,\)"),
        ("q", torch.zeros(3, 2, 4, 8), r"`q` must have shape \(B, H, T, Dh\) = \(3, 2, 4, 16\)"),
        ("q", torch.zeros(3, 2, 4, 16, dtype=torch.long), "`q` must have a floating-point dtype"),
    ],
)
def test_ops_reject_bad_inputs(name, bad, message):
    args = _good_args()
    ring_ops.ring_attention(**args, ring_semantics="upstream")  # the unmodified arguments are accepted
    args[name] = bad
    with pytest.raises(ValueError, match=f"ring_attention: {message}"):
        ring_ops.ring_attention(**args, ring_semantics="upstream")
    with pytest.raises(ValueError, match=f"ring_attention_write: {message}"):
        ring_ops.ring_attention_write(**args, ring_semantics="upstream")
    if name != "q":
        del args["q"]
        with pytest.raises(ValueError, match=f"ring_write: {message}"):
            write_ops.ring_write(**args)


@cpu
@pytest.mark.parametrize(
    "cos,sin,message",
    [
        (torch.zeros(3, 1, 4, 8), None, "`cos` and `sin` must be given together"),
        (
            torch.zeros(3, 1, 4, 16),
            torch.zeros(3, 1, 4, 16),
            r"`cos` must have shape \(B, 1, T, Dh/2\) = \(3, 1, 4, 8\)",
        ),
        (torch.zeros(3, 1, 4, 8), torch.zeros(3, 1, 4, 8, dtype=torch.float64), "`sin` must have dtype torch.float32"),
        (
            torch.zeros(3, 1, 8, 4).transpose(2, 3),
            torch.zeros(3, 1, 4, 8),
            r"`cos` and `sin` must have the same strides, got \(32, 32, 1, 4\) and \(32, 32, 8, 1\)",
        ),
    ],
)
def test_ops_reject_bad_rope_tables(cos, sin, message):
    args = _good_args()
    ring_ops.ring_attention(**args, ring_semantics="exact", cos=torch.zeros(3, 1, 4, 8), sin=torch.zeros(3, 1, 4, 8))
    with pytest.raises(ValueError, match=f"ring_attention: {message}"):
        ring_ops.ring_attention(**args, ring_semantics="exact", cos=cos, sin=sin)
    with pytest.raises(ValueError, match=f"ring_attention_write: {message}"):
        ring_ops.ring_attention_write(**args, ring_semantics="exact", cos=cos, sin=sin)
    del args["q"]
    with pytest.raises(ValueError, match=f"ring_write: {message}"):
        write_ops.ring_write(**args, cos=cos, sin=sin)


@cpu
@pytest.mark.parametrize("rope", [False, True])
def test_ops_handle_an_empty_chunk(rope):
    # T = 0 (a direct caller's empty step): an empty output, the rings untouched; reference and kernel alike.
    q = torch.zeros(2, 2, 0, 16)
    ring = torch.randn(2, 3, 2, 5, 16)
    ids, offsets, written = torch.tensor([0, 1]), torch.tensor([4, 9]), torch.tensor([0, 0])
    tables = rope_tables(offsets, 0, 16, 10000.0) if rope else (None, None)
    assert tables[0] is None or tables[0].shape == (2, 1, 0, 8)
    out = ring_ops.ring_attention(q, q, q, ring, ids, offsets, written, "upstream", *tables)
    assert out.shape == (2, 0, 2, 16)
    before = ring.clone()
    write_ops.ring_write(q, q, ring, ids, offsets, written, *tables)
    assert torch.equal(ring, before)
    out = ring_ops.ring_attention_write(q, q, q, ring, ids, offsets, written, "exact", *tables)
    assert out.shape == (2, 0, 2, 16) and torch.equal(ring, before)


@cpu
def test_ring_attention_rejects_unknown_semantics():
    with pytest.raises(
        ValueError, match=r"ring_attention: unknown ring semantics 'v2'; expected one of \('upstream', 'exact'\)"
    ):
        ring_ops.ring_attention(**_good_args(), ring_semantics="v2")
    with pytest.raises(ValueError, match=r"ring_attention_write: unknown ring semantics 'v2'"):
        ring_ops.ring_attention_write(**_good_args(), ring_semantics="v2")
    with pytest.raises(TypeError, match="ring_attention: `k` must be a torch.Tensor, got list"):
        ring_ops.ring_attention(**{**_good_args(), "k": [0.0]}, ring_semantics="exact")


def _compiled_layer(q, k, v, ring, slot_ids, offsets, written):
    out = ring_ops.ring_attention(q, k, v, ring, slot_ids, offsets, written, "upstream")
    write_ops.ring_write(k, v, ring, slot_ids, offsets, written)
    # The fused op on the ring just written: its fake impl, and the mutation seen by what follows.
    again = ring_ops.ring_attention_write(q, k, v, ring, slot_ids, offsets + 1, written, "exact")
    return out * 2 + again


@cpu
def test_ops_trace_fullgraph_with_fake_impls():
    # aot_eager: Dynamo, the fake impls and functionalisation of the mutated ring, without Inductor.
    compiled = torch.compile(_compiled_layer, fullgraph=True, dynamic=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(3)
    for B, T in [(3, 4), (2, 9)]:
        q, k, v = (torch.randn(B, 2, T, 16, generator=gen) for _ in range(3))
        ring = torch.randn(2, 4, 2, 5, 16, generator=gen)
        args = (torch.tensor([2, 0, 1][:B]), torch.tensor([7, 0, 3][:B]), torch.tensor([T, 1, 0][:B]))
        eager_ring, compiled_ring = ring.clone(), ring.clone()
        expected = _compiled_layer(q, k, v, eager_ring, *args)
        got = compiled(q, k, v, compiled_ring, *args)
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
    cases = [((64, 64), False, "pair"), ((16, 16), False, "pair"), ((16, 16), True, "pair")]
    cases += [((16, 16), True, "fused"), ((16, 16), False, "split"), ((64, 64), True, "auto")]
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


def _ring_phase_case(ring_semantics, capacity, T, seed, dtype=torch.float32, device="cpu", heads=2, head_dim=16):
    """Rows at every phase of a ring (empty, partial, full, wrapped, past 2**31 tokens), with every kind of
    chunk length (0, 1, partial, T); returns the ops' arguments."""
    gen = torch.Generator(device=device).manual_seed(seed)
    offsets = [0, 3, capacity - 1, capacity, 4 * capacity + 3, 3 * 2**31 + 5, 0, 7]  # one past int32
    written = [T, max(T - 1, 0), T, 1, T, min(T, 2), 0, T // 2]
    B = len(offsets)
    ring = torch.randn(2, B + 1, heads, capacity, head_dim, generator=gen, device=device).to(dtype)
    q, k, v = (torch.randn(B, heads, T, head_dim, generator=gen, device=device).to(dtype) for _ in range(3))
    slot_ids = torch.randperm(B + 1, generator=gen, device=device)[:B]
    offsets, written = (torch.tensor(x, device=device) for x in (offsets, written))
    return q, k, v, ring, slot_ids, offsets, written, ring_semantics, *rope_tables(offsets, T, head_dim, 10000.0)


@cpu
@needs_interpreter
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
@pytest.mark.parametrize("capacity,T", [(8, 1), (8, 5), (8, 20), (13, 40), (40, 13), (40, 37), (40, 100)])
@pytest.mark.parametrize("block_q,block_k", [(16, 16), (32, 16), (16, 32)])
def test_kernels_interpreted_at_every_ring_phase(ring_semantics, capacity, T, block_q, block_k):
    """Each query sees exactly the keys of its window: rows at every phase of the ring, chunks shorter
    and longer than the ring (both window edges inside the chunk), query and key blocks that split
    the window anywhere; against the reference."""
    args = _ring_phase_case(ring_semantics, capacity, T, seed=capacity * T + block_q)
    got = ring_ops.launch_ring_attention_triton(*args, tuning=dict(block_q=block_q, block_k=block_k))
    assert_outputs_close(got, ring_ops.ring_attention_reference(*args).float(), args[6])


@cpu
@needs_interpreter
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
@pytest.mark.parametrize("capacity,T", [(8, 1), (8, 20), (13, 40), (40, 37), (40, 100)])
@pytest.mark.parametrize("fused", [True, False])
def test_attention_write_interpreted_at_every_ring_phase(ring_semantics, capacity, T, fused):
    """ring_attention_write, its write fused into the attention kernel (one program walking 16-query
    blocks, so rows of up to 7 blocks, the chunk longer than the ring) or after it: outputs as the
    reference's, ring contents bitwise."""
    args = list(_ring_phase_case(ring_semantics, capacity, T, seed=capacity * T))
    ref_ring = args[3].clone()
    expected = ring_ops.ring_attention_write_reference(*args[:3], ref_ring, *args[4:])
    tuning = dict(block_q=16, block_k=16, fused_write=fused)
    got = ring_ops.launch_ring_attention_triton(*args, write=True, tuning=tuning)
    assert_outputs_close(got, expected.float(), args[6])
    assert torch.equal(args[3], ref_ring)


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
    [((64, 64), False, "pair"), ((16, 16), False, "pair"), ((16, 16), True, "pair"), ((16, 16), True, "fused")],
)
def test_kernels_interpreted_never_read_cells_no_query_sees(ring_semantics, blocks, fused_rope, op):
    """Every ring cell no valid query may see, every unused slot, the null slot and every padding
    token of q, k and v filled with NaN: the outputs and the written cells are bitwise unchanged
    (also with the write fused into the attention kernel, over two query blocks)."""
    C, H, Dh, T = 8, 2, 16, 20
    gen = torch.Generator().manual_seed(11)
    ring = torch.randn(2, 6, H, C, Dh, generator=gen)
    slot_ids = torch.tensor([3, 0, 5, 2, 1, 5])  # 5 is the null slot; slot 4 is unused
    offsets = torch.tensor([0, 3, 8, 37, 5, 0])
    written = torch.tensor([20, 5, 12, 1, 0, 0])  # rows 4 (valid but empty) and 5 (padding) read nothing
    q, k, v = (torch.randn(6, H, T, Dh, generator=gen) for _ in range(3))
    poisoned = torch.full_like(ring, float("nan"))
    for b in range(4):
        for cell in _visible_cells(int(offsets[b]), int(written[b]), C, ring_semantics):
            poisoned[:, slot_ids[b], :, cell] = ring[:, slot_ids[b], :, cell]
    padding = (torch.arange(T) >= written.view(-1, 1)).view(6, 1, T, 1).expand(6, H, T, Dh)
    nan_q, nan_k, nan_v = (x.masked_fill(padding, float("nan")) for x in (q, k, v))
    rope = rope_tables(offsets, T, Dh, 10000.0) if fused_rope else (None, None)
    with block_sizes(*blocks):
        clean = kernel_layer(ring.clone(), slot_ids, offsets, written, q, k, v, ring_semantics, rope, op)
        after = poisoned.clone()
        dirty = kernel_layer(after, slot_ids, offsets, written, nan_q, nan_k, nan_v, ring_semantics, rope, op)
    assert torch.equal(dirty, clean) and torch.isfinite(dirty).all()
    touched = commit_ops.touched_ring_mask(offsets, written, C)  # (B, C)
    expected = poisoned.clone()
    write_ops.ring_write_reference(k, v, expected, slot_ids, offsets, written, *rope)
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
    C, H, Dh, T = 6, 2, 16, 5
    gen = torch.Generator().manual_seed(13)
    ring = torch.randn(2, 2, H, C, Dh, generator=gen)
    ring[plane, 0, 1, 2, 3] = float("nan")  # slot 0, head 1, cell 2 = position 8, seen under both ring_semantics
    q, k, v = (torch.randn(1, H, T, Dh, generator=gen) for _ in range(3))
    args = (ring, torch.tensor([0]), torch.tensor([9]), torch.tensor([T]))
    for ring_semantics in SEMANTICS:
        got = ring_ops.ring_attention(q, k, v, *args, ring_semantics)
        expected = ring_ops.ring_attention_reference(q, k, v, *args, ring_semantics)
        assert torch.equal(got.isnan(), expected.isnan()) and got[0, :, 1].isnan().any(), ring_semantics
        assert not got[0, :, 0].isnan().any(), "head 0 never reads the NaN"
        finite = ~expected.isnan()
        assert (got[finite] - expected[finite]).abs().max().item() <= 1e-5 * expected[finite].abs().max().item()


@cpu
@needs_interpreter
def test_bfloat16_rings_take_the_reference_under_the_interpreter():
    # The interpreter's bfloat16 arithmetic is not the GPU's: bf16 rings run the reference even here.
    gen = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(2, 2, 7, 16, generator=gen).bfloat16() for _ in range(3))
    ring = torch.randn(2, 3, 2, 5, 16, generator=gen).bfloat16()
    args = (torch.tensor([2, 0]), torch.tensor([3, 11]), torch.tensor([7, 4]))
    rope = rope_tables(args[1], 7, 16, 10000.0)
    for ring_semantics in SEMANTICS:
        got = ring_ops.ring_attention(q, k, v, ring, *args, ring_semantics, *rope)
        assert torch.equal(got, ring_ops.ring_attention_reference(q, k, v, ring, *args, ring_semantics, *rope))
    expected = ring.clone()
    write_ops.ring_write(k, v, ring, *args, *rope)
    write_ops.ring_write_reference(k, v, expected, *args, *rope)
    assert torch.equal(ring, expected)


@cpu
@needs_interpreter
def test_kernels_interpreted_follow_strides():
    # q and k as views of one (2, B, H, T, Dh) tensor, v a strided view of a (B, T, 3, H, Dh) projection.
    C, H, Dh, T, B = 5, 2, 16, 7, 3
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(B, T, 3, H, Dh, generator=gen).permute(2, 0, 3, 1, 4)  # (3, B, H, T, Dh), not contiguous
    ring = torch.randn(2, 4, H, C, Dh, generator=gen).permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    assert not ring.is_contiguous() and not qkv[2].is_contiguous()
    args = (torch.tensor([1, 3, 0]), torch.tensor([4, 0, 11]), torch.tensor([7, 3, 5]))
    ref_ring = ring.contiguous()
    for ring_semantics in SEMANTICS:
        expected = ring_ops.ring_attention_reference(qkv[0], qkv[1], qkv[2], ref_ring, *args, ring_semantics)
        got = ring_ops.ring_attention(qkv[0], qkv[1], qkv[2], ring, *args, ring_semantics)
        assert_outputs_close(got, expected, args[2])
    write_ops.ring_write(qkv[1], qkv[2], ring, *args)
    write_ops.ring_write_reference(qkv[1], qkv[2], ref_ring, *args)
    assert torch.equal(ring, ref_ring)


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
# CUDA: compiled kernels (the lead's H200 gates)
# ----------------------------------------------------------------------------------------------------


def _cuda_case(B, H, T, C, Dh, dtype, seed, offsets, written):
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    ring = torch.randn(2, B + 2, H, C, Dh, generator=gen, device=device).to(dtype)
    q, k, v = (torch.randn(B, H, T, Dh, generator=gen, device=device).to(dtype) for _ in range(3))
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
@pytest.mark.parametrize("fused_rope", [False, True])
@pytest.mark.parametrize("op", ["pair", "fused", "split"])
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
def test_cuda_attention_write_bfloat16_equals_the_two_ops(ring_semantics, T, C):
    """ring_attention_write (as dispatched, write fused, write after) in bf16 at the v2 groups' shapes of a
    15-frame step, RoPE in the kernels: bitwise ring_attention then ring_write, outputs and rings."""
    written = [T, T - 1, T, 0, 1, T // 2, T, 17 % (T + 1)]
    case = _cuda_case(8, 12, T, C, 64, torch.bfloat16, 5, [0, 397, 1234, 5, 80, 400, 9, 3], written)
    q, k, v, ring, slot_ids, offsets, valid_tokens = case
    rope = rope_tables(offsets, T, 64, 10000.0)
    want_ring = ring.clone()
    want = kernel_layer(want_ring, slot_ids, offsets, valid_tokens, q, k, v, ring_semantics, rope, "pair")
    for op in ("auto", "fused", "split"):
        work = ring.clone()
        got = kernel_layer(work, slot_ids, offsets, valid_tokens, q, k, v, ring_semantics, rope, op)
        assert torch.equal(got, want), f"{op}: outputs differ"
        assert torch.equal(work, want_ring), f"{op}: rings differ"


@cuda
@pytest.mark.parametrize("ring_semantics", SEMANTICS)
def test_cuda_kernels_bfloat16_within_rounding_and_deterministic(ring_semantics):
    q, k, v, ring, slot_ids, offsets, valid_tokens = _cuda_case(
        8, 12, 480, 400, 64, torch.bfloat16, 1, [0, 397, 1234, 5, 80, 400, 9, 3], [480, 401, 399, 0, 1, 200, 480, 17]
    )
    runs = []
    for _ in range(2):
        work = ring.clone()
        runs.append((kernel_layer(work, slot_ids, offsets, valid_tokens, q, k, v, ring_semantics), work))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), "two runs differ"
    host = [t.cpu() for t in (slot_ids, offsets, valid_tokens)]
    floats = [t.cpu().float() for t in (q, k, v, ring)]
    expected = ring_ops.ring_attention_reference(*floats, *host, ring_semantics)
    got = runs[0][0].cpu().float()
    rel = ((got - expected).norm() / expected.norm()).item()
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
        assert torch.equal(out, expected) and torch.equal(work, expected_ring)


@cuda
def test_cuda_ring_attention_addresses_beyond_int32():
    device = torch.device("cuda")
    num_slots, H, C, Dh = 1100, 16, 1024, 64
    assert 2 * num_slots * H * C * Dh > 2**31
    ring = torch.zeros(2, num_slots, H, C, Dh, dtype=torch.bfloat16, device=device)
    ring[:, num_slots - 1] = torch.randn(2, H, C, Dh, device=device).to(torch.bfloat16)
    q, k, v = (torch.randn(1, H, 4, Dh, device=device).to(torch.bfloat16) for _ in range(3))
    args = (torch.tensor([num_slots - 1], device=device), torch.tensor([5000], device=device))
    written = torch.tensor([4], device=device)
    got = ring_ops.ring_attention(q, k, v, ring, *args, written, "exact")
    floats = [x.cpu().float() for x in (q, k, v, ring[:, num_slots - 1 :])]
    host = (torch.tensor([0]), torch.tensor([5000]), torch.tensor([4]))  # the one slot is slot 0 of the copy
    expected = ring_ops.ring_attention_reference(*floats, *host, "exact")
    assert ((got.cpu().float() - expected).norm() / expected.norm()).item() <= 1e-2
    write_ops.ring_write(k, v, ring, *args, written)
    cells = (5000 + torch.arange(4, device=device)) % C
    assert torch.equal(ring[0, num_slots - 1, :, cells], k[0]) and torch.equal(ring[1, num_slots - 1, :, cells], v[0])


@cuda
def test_cuda_tiny_codec_triton_pool_equals_sdpa_pool(tmp_path):
    decoder = build_decoder(PRESETS["tiny-v2"], tmp_path, device="cuda").float()
    codes = random_codes(decoder, 1, 40, seed=3)
    for ring_semantics in SEMANTICS:
        ref = _pool_stream(decoder, codes, [1, 15], ring_semantics, "sdpa")
        got = _pool_stream(decoder, codes, [1, 15], ring_semantics, "triton")
        assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_launch_configuration_follows_the_step_size_and_refuses_unknown_keys():
    pick = ring_ops.attention_launch_config
    cases = [(1, 16, 2), (16, 16, 2), (17, 32, 3), (32, 32, 3), (33, 64, 3), (64, 64, 3), (65, 128, 3), (480, 128, 3)]
    for tokens, block_q, stages in cases:
        expected = dict(block_q=block_q, block_k=64, num_warps=4, num_stages=stages, pv="low", fused_write=tokens <= 32)
        assert pick(tokens, torch.bfloat16) == expected, tokens
        assert pick(tokens, torch.bfloat16, row_heads=128 * 12) == expected, tokens
        assert pick(tokens, torch.float16)["pv"] == "low"
    # Fewer than 256 programs of 128 queries: 64-query blocks (one row of 12 heads at 480 tokens: 48).
    assert pick(480, torch.bfloat16, row_heads=12)["block_q"] == 64
    assert pick(120, torch.bfloat16, row_heads=16 * 12)["block_q"] == 64  # 192 programs
    assert pick(120, torch.bfloat16, row_heads=32 * 12)["block_q"] == 128  # 384
    assert pick(240, torch.bfloat16, row_heads=11 * 12)["block_q"] == 128  # 264
    assert pick(15, torch.float32) == dict(
        block_q=16, block_k=64, num_warps=4, num_stages=2, pv="ieee", fused_write=True
    )
    assert pick(480, torch.float32)["block_q"] == 64 and not pick(480, torch.float32)["fused_write"]
    assert ring_ops._launch_config(30, torch.bfloat16, {"num_warps": 8})["num_warps"] == 8
    assert ring_ops._launch_config(480, torch.bfloat16, {"fused_write": True})["fused_write"] is True
    with pytest.raises(ValueError, match=r"unknown launch configuration keys \['blockq'\]"):
        ring_ops._launch_config(30, torch.bfloat16, {"blockq": 16})


_CUDA_MARKS = (
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(TRITON_INTERPRET_AT_IMPORT, reason="kernels are interpreted here"),
    pytest.mark.cuda,
)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA_MARKS)])
@pytest.mark.parametrize("num_tokens", [7, 25])
@pytest.mark.parametrize("ring_semantics", ["upstream", "exact"])
@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_paged_rings_equal_unpaged_rings(path, ring_semantics, num_tokens, device):
    """A paged ring (pages scattered over the pool, unused pages NaN) gives bitwise the outputs and
    ring contents of the unpaged ring it maps, for both ops, rows wrapping and rows longer than C;
    on CUDA the Triton kernels read and write through the page table (on CPU the kernel path runs the
    reference here, and the interpreted kernels in the test below)."""
    _check_paged_equals_unpaged(path, ring_semantics, num_tokens, device)


@needs_interpreter
@pytest.mark.parametrize("num_tokens", [7, 25])
@pytest.mark.parametrize("ring_semantics", ["upstream", "exact"])
def test_paged_kernels_interpreted_equal_unpaged_rings(ring_semantics, num_tokens):
    """The same check through the interpreted Triton kernels (float32): pages of 5 cells, a page size
    that is not a power of two, as the kernels' compile-time ``PAGE_SIZE``."""
    _check_paged_equals_unpaged("kernel", ring_semantics, num_tokens, "cpu")


def _check_paged_equals_unpaged(path, ring_semantics, num_tokens, device):
    attend = ring_ops.ring_attention if path == "kernel" else ring_ops.ring_attention_reference
    write = write_ops.ring_write if path == "kernel" else write_ops.ring_write_reference
    gen = torch.Generator().manual_seed(11)
    S, H, Dh, page_size, n = 4, 2, 16, 5, 4  # rings of 20 cells in 4 pages of 5
    num_pages = S * n + 3
    unpaged = torch.randn(2, S, H, n * page_size, Dh, generator=gen).to(device)
    table = torch.randperm(num_pages, generator=gen)[: S * n].view(S, n).to(device)
    paged = torch.full((2, num_pages, H, page_size, Dh), float("nan"), device=device)
    paged[:, table] = unpaged.view(2, S, H, n, page_size, Dh).permute(0, 1, 3, 2, 4, 5)
    unused = sorted(set(range(num_pages)) - set(table.flatten().tolist()))
    B, T = 3, num_tokens
    q, k, v = (torch.randn(B, H, T, Dh, generator=gen).to(device) for _ in range(3))
    slot_ids = torch.tensor([2, 0, 3], device=device)
    offsets = torch.tensor([3, 13, 57], device=device)
    valid_tokens = torch.tensor([T, 0, T - 2], device=device)
    cos, sin = rope_tables(offsets, T, Dh, 10000.0)
    args = (slot_ids, offsets, valid_tokens)
    want = attend(q, k, v, unpaged, *args, ring_semantics, cos, sin)
    got = attend(q, k, v, paged, *args, ring_semantics, cos, sin, page_table=table)
    assert torch.equal(got, want)
    write(k, v, unpaged, *args, cos, sin)
    write(k, v, paged, *args, cos, sin, page_table=table)
    mapped = paged[:, table].permute(0, 1, 3, 2, 4, 5).reshape(unpaged.shape)
    assert torch.equal(mapped, unpaged)
    assert paged[:, unused].isnan().all()


def test_page_table_is_checked_at_the_op_boundary():
    ring = torch.zeros(2, 6, 1, 4, 8)
    k = torch.zeros(1, 1, 2, 8)
    ids = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"`page_table` must be int32 or int64, got torch.float32"):
        write_ops.ring_write(k, k, ring, ids, ids, ids, page_table=torch.zeros(2, 3))
    with pytest.raises(
        ValueError, match=r"`page_table` must be \(S, pages per ring\) with at least one page, got \(3,\)"
    ):
        ring_ops.ring_attention(k, k, k, ring, ids, ids, ids, "exact", page_table=torch.zeros(3, dtype=torch.long))
