# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.fused_linear``: a projection with LayerNorm before it and GELU or the residual add
after it, in one kernel.

The reference is the unfused decoder's ops in turn. The Triton kernel runs on CPU in Triton's interpreter in
the ``TRITON_INTERPRET=1`` child of ``test_triton_interpreter_subprocess`` (float32 only, with full-precision
products); bfloat16 is checked on CUDA, against the same ops on cuBLAS.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from moss_codecs import build_decoder, cuda_kernel_test, interpreter_subprocess_test, needs_interpreter, random_codes

from vllm_omni_moss.model_executor.models.moss_tts import decoder as decoder_mod
from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS
from vllm_omni_moss.model_executor.models.moss_tts.ops import fused_linear as ops
from vllm_omni_moss.model_executor.models.moss_tts.ops.dispatch import cpu_uses_triton_interpreter

INTERPRETED = cpu_uses_triton_interpreter()
cpu = pytest.mark.cpu

#: The four projections of a layer, as the decoder calls them.
MODES = {
    "qkv": dict(norm=True),
    "out": dict(residual=True, scaled=True),
    "linear1": dict(norm=True, gelu=True),
    "linear2": dict(residual=True, scaled=True),
    "unscaled": dict(residual=True),
    "plain": dict(),
}


def _case(rows, k, n, dtype, device="cpu", seed=0, mode="plain"):
    """``(a, weight, kwargs)`` of one call; ``a`` spread like a residual stream (norm) or an activation."""
    flags = MODES[mode]
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*size, scale=1.0):
        return (scale * torch.randn(*size, generator=gen, device=device)).to(dtype)

    a = draw(*rows, k, scale=3.0 if flags.get("norm") else 1.0)
    kwargs = {}
    if flags.get("norm"):
        kwargs["norm"] = (1 + draw(k, scale=0.1), draw(k, scale=0.1), 1e-5)
    if flags.get("gelu"):
        kwargs["gelu"] = True
    if flags.get("residual"):
        kwargs["residual"] = draw(*rows, n, scale=3.0)
        if flags.get("scaled"):
            kwargs["layer_scale"] = draw(n, scale=0.1)
    return a, draw(n, k, scale=k**-0.5), kwargs


def _unfused(a, weight, norm=None, gelu=False, residual=None, layer_scale=None):
    """The decoder's ops written out independently of the op's reference."""
    if norm is not None:
        ln = torch.nn.LayerNorm(a.shape[-1], eps=norm[2]).to(a.device)
        with torch.no_grad():
            ln.weight.copy_(norm[0].float())
            ln.bias.copy_(norm[1].float())
            a = ln(a.float()).to(a.dtype)
    y = a @ weight.t()
    if gelu:
        y = F.gelu(y)
    if residual is not None:
        y = residual + (layer_scale * y if layer_scale is not None else y)
    return y


@cpu
@pytest.mark.skipif(INTERPRETED, reason="CPU runs the interpreted kernel in this process")
@pytest.mark.parametrize("mode", sorted(MODES))
def test_reference_is_the_unfused_decoder(mode):
    a, weight, kwargs = _case((2, 5), 48, 40, torch.float32, mode=mode)
    got = ops.fused_linear(a, weight, **kwargs)  # CPU: the reference
    expected = _unfused(a, weight, **kwargs)
    assert got.shape == (2, 5, 40) and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@cpu
@pytest.mark.parametrize(
    "change,error,message",
    [
        (dict(a=[1.0]), TypeError, "`a` must be a torch.Tensor, got list"),
        (
            dict(a=torch.zeros(3, 48, dtype=torch.float64)),
            ValueError,
            r"`a` must have .* got shape \(3, 48\) and torch.float64",
        ),
        (dict(weight=torch.zeros(40, 47)), ValueError, r"`weight` must have shape \(40, 48\), got \(40, 47\)"),
        (dict(weight=torch.zeros(40)), ValueError, "`weight` must be a 2-D"),
        (dict(weight=torch.zeros(40, 48, dtype=torch.float16)), ValueError, "`weight` must have dtype torch.float32"),
        (dict(norm=(torch.zeros(48), torch.zeros(47), 1e-5)), ValueError, r"`norm bias` must have shape \(48,\)"),
        (dict(norm=[torch.zeros(48), torch.zeros(48), 1e-5]), TypeError, "`norm` must be a .* triple"),
        (dict(residual=torch.zeros(3, 41)), ValueError, r"`residual` must have shape \(3, 40\), got \(3, 41\)"),
        (dict(residual=torch.zeros(3, 40), gelu=True), ValueError, "`gelu` and `residual` cannot both be set"),
        (dict(layer_scale=torch.zeros(40)), ValueError, "`layer_scale` needs `residual`"),
        (dict(residual=torch.zeros(3, 40), layer_scale=torch.zeros(39)), ValueError, r"`layer_scale` must have shape"),
        (
            dict(rope=(torch.zeros(3, 4), torch.zeros(3, 4))),
            TypeError,
            r"`rope` must be a \(cos, sin, head_dim\) triple",
        ),
        (dict(rope=(torch.zeros(3, 4), torch.zeros(3, 4), 7)), ValueError, "`rope` head_dim must be even"),
        (dict(rope=(torch.zeros(3, 4), torch.zeros(3, 4), 8), gelu=True), ValueError, "`rope` cannot be set with"),
        (dict(rope=(torch.zeros(3, 5), torch.zeros(3, 4), 8)), ValueError, r"`rope cos` must be a float32 \(3, 4\)"),
        (dict(rope=(torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.float64), 8)), ValueError, "`rope sin` must be"),
    ],
)
def test_rejects_bad_inputs(change, error, message):
    args = dict(a=torch.zeros(3, 48), weight=torch.zeros(24 if "rope" in change else 40, 48))
    args.update(change)
    with pytest.raises(error, match=f"fused_linear: {message}"):
        ops.fused_linear(**args)


@cpu
def test_traces_fullgraph_with_the_fake_impl():
    def layer(a, weight, norm_weight, norm_bias, residual, scale):
        x = ops.fused_linear(a, weight, norm=(norm_weight, norm_bias, 1e-5))
        return ops.fused_linear(a, weight, residual=x, layer_scale=scale) * 2

    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (3, 7):
        a, weight, kwargs = _case((rows,), 32, 32, torch.float32, seed=rows, mode="qkv")
        args = (a, weight, *kwargs["norm"][:2], a, torch.full((32,), 0.5))
        assert torch.equal(compiled(*args), layer(*args))


test_triton_interpreter_subprocess = interpreter_subprocess_test(__file__, timeout=900)


@cpu
@needs_interpreter
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("shape", [((1,), 48, 40), ((3, 7), 160, 72), ((70,), 96, 24)])
def test_kernel_interpreted_float32(mode, shape):
    # One row, several row tiles (70 > 64) and widths that no block divides.
    rows, k, n = shape
    a, weight, kwargs = _case(rows, k, n, torch.float32, seed=k + n, mode=mode)
    got = ops.fused_linear(a, weight, **kwargs)
    expected = ops.fused_linear_reference(a, weight, **kwargs)
    assert got.shape == expected.shape and got.is_contiguous()
    assert (got - expected).abs().max().item() <= 2e-6 * max(expected.abs().max().item(), 1.0)


@cpu
@needs_interpreter
@pytest.mark.parametrize("mode", ["qkv", "linear2"])
def test_interpreted_nan_stays_in_its_row(mode):
    a, weight, kwargs = _case((5,), 64, 40, torch.float32, seed=3, mode=mode)
    clean = ops.fused_linear(a, weight, **kwargs)
    a[2, 7] = float("nan")
    got = ops.fused_linear(a, weight, **kwargs)
    assert torch.isnan(got[2]).all()
    others = [0, 1, 3, 4]
    assert torch.equal(got[others], clean[others])


@cpu
@needs_interpreter
def test_interpreted_decoder_layers_match_the_unfused_layers(tmp_path):
    """A group's layers on the op (``_run_layers`` with ``fused_rows``) against the same layers through
    ``F.linear`` and the separate glue ops, float32, over the offline attention."""
    decoder = build_decoder(PRESETS["tiny-v2"], tmp_path)
    codes = random_codes(decoder, 2, 3, seed=4)
    plan = decoder_mod.StepPlan(decoder_mod.group_steps(decoder.config, 3, None), decoder_mod.OfflineAttention())
    with torch.no_grad():
        x = decoder.groups[0].input_proj(decoder_mod.embed_codes(decoder, codes))
        rows = x.shape[0] * x.shape[1]
        unfused = decoder_mod._run_layers(decoder.groups[0], [x.clone()], plan.groups[0], plan.attention, False)
        fused = decoder_mod._run_layers(
            decoder.groups[0], [x.clone()], plan.groups[0], plan.attention, False, fused_rows=rows
        )
        above = decoder_mod._run_layers(
            decoder.groups[0], [x.clone()], plan.groups[0], plan.attention, False, fused_rows=rows - 1
        )
    assert torch.equal(above, unfused), "a group of more rows than fused_rows keeps the unfused path"
    assert not torch.equal(fused, unfused)
    assert (fused - unfused).abs().max().item() <= 1e-5 * unfused.abs().max().item()


@cpu
@needs_interpreter
@pytest.mark.parametrize("rows,heads,head_dim", [((1,), 2, 16), ((3, 5), 3, 8), ((70,), 1, 32)])
def test_interpreted_rope_is_the_rope_pass_on_the_kernels_product(rows, heads, head_dim):
    """RoPE in the epilogue rotates exactly what ``ops/rope.py`` rotates: bitwise the rope reference on the
    kernel's own product (queries and keys turned, values untouched), and close to the unfused reference."""
    from vllm_omni_moss.model_executor.models.moss_tts.ops.rope import rope_reference
    from vllm_omni_moss.model_executor.models.moss_tts.step_metadata import rope_tables

    d = heads * head_dim
    a, weight, kwargs = _case(rows, d, 3 * d, torch.float32, seed=d, mode="qkv")
    count = a.numel() // d
    cos, sin = rope_tables(torch.arange(count) * 7, 1, head_dim, 10000.0)
    rope = (cos.view(count, -1), sin.view(count, -1), head_dim)
    got = ops.fused_linear(a, weight, rope=rope, **kwargs)
    plain = ops.fused_linear(a, weight, **kwargs).reshape(count, 1, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    turned = rope_reference(plain[:2], cos, sin)  # (2, count, heads, 1, head_dim)
    flat = got.reshape(count, 3, heads, head_dim)
    assert torch.equal(flat[:, :2], turned.squeeze(3).permute(1, 0, 2, 3))
    assert torch.equal(flat[:, 2], plain[2].squeeze(2))
    expected = ops.fused_linear_reference(a, weight, rope=rope, **kwargs)
    assert (got - expected).abs().max().item() <= 2e-6 * expected.abs().max().item()


@cpu
@needs_interpreter
@pytest.mark.parametrize("kind", ["compact", "paged"])
@pytest.mark.parametrize("packed", [False, True])
def test_interpreted_pool_steps_on_the_op_match_the_unfused_steps(kind, packed, ring_decoder, monkeypatch):
    """Steps of the triton backend with every group on the op (RoPE in the QKV projection, queries and keys
    handed over rotated) against the same steps through ``F.linear`` and the separate passes: audio and rings
    within float32 rounding, on the grid and on packed tokens."""
    from vllm_omni_moss.model_executor.models.moss_tts.state import make_state_pool
    from vllm_omni_moss.model_executor.models.moss_tts.step import decode_tensors

    pools = [make_state_pool(ring_decoder, kind, attention_backend="triton") for _ in range(2)]
    for pool in pools:
        pool.initialize(3, 3)
        for _ in range(3):
            pool.acquire()
        if kind == "paged":
            pool.reserve(dict.fromkeys(range(3), 64), strict=True)
            pool.commit_page_tables()
    real_layers, real_op = decoder_mod._run_layers, ops.fused_linear
    rotations = []

    def on_the_op(*args, **kwargs):
        return real_layers(*args[:7], fused_rows=1 << 20)

    def spy(*args, **kwargs):
        rotations.append(kwargs.get("rope") is not None)
        return real_op(*args, **kwargs)

    slots = torch.arange(3)
    for step, frames in enumerate([[1, 3, 2], [3, 3, 1], [2, 0, 3]]):
        valid_frames, valid = torch.tensor(frames), torch.tensor([True, True, step != 1])
        codes = random_codes(ring_decoder, 3, 3, seed=step)
        total = int(valid_frames[valid].sum()) if packed else None
        want, _ = decode_tensors(pools[0], codes, valid_frames, slots, valid, total_frames=total)
        with monkeypatch.context() as mp:
            mp.setattr(decoder_mod, "_run_layers", on_the_op)
            mp.setattr(decoder_mod, "fused_linear", spy)
            got, _ = decode_tensors(pools[1], codes, valid_frames, slots, valid, total_frames=total)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), step
    layers = sum(len(g.layers) for g in ring_decoder.groups)
    assert rotations.count(True) == 3 * layers, "each layer's QKV projection rotates"
    for slot in range(3):
        a, b = pools[0].slot_state(slot), pools[1].slot_state(slot)
        assert torch.equal(a["layer_offsets"], b["layer_offsets"])
        for x, y in zip(a["rings"], b["rings"]):
            assert (x - y).abs().max().item() <= 1e-5 * max(x.abs().max().item(), 1.0)


@cpu
def test_decoder_takes_the_op_only_for_small_groups_of_its_dtype(tmp_path):
    decoder = build_decoder(PRESETS["tiny-v2"], tmp_path)
    group = decoder.groups[0]
    width = group.layers[0].in_proj.in_features
    x = torch.zeros(2, 3, width)
    assert decoder_mod._takes_fused_linear(group, x, 6)
    assert not decoder_mod._takes_fused_linear(group, x, 5)
    assert not decoder_mod._takes_fused_linear(group, x, 0)
    assert not decoder_mod._takes_fused_linear(group, x.double(), 64), "float64 is not a kernel dtype"
    assert not decoder_mod._takes_fused_linear(group, x.half(), 64), "weights of another dtype"
    assert decoder.fused_linear_rows == ops.FUSED_LINEAR_MAX_ROWS


@cuda_kernel_test
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("rows,k,n", [(1, 1280, 3840), (16, 768, 3072), (48, 3072, 768), (64, 1280, 1280)])
def test_cuda_bfloat16_within_a_gemm_rounding_of_cublas(mode, rows, k, n):
    """bf16 on the device against the same ops on cuBLAS: the products differ only in summation order, so
    each output is within a bf16 step of the larger of the two (plus what LayerNorm's float32 sum order and
    the residual's single rounding move); the norm, GELU and residual roundings are the same."""
    a, weight, kwargs = _case((rows,), k, n, torch.bfloat16, device="cuda", seed=rows + k, mode=mode)
    got = ops.fused_linear(a, weight, **kwargs)
    expected = ops.fused_linear_reference(a, weight, **kwargs)
    scale = torch.maximum(got.float().abs(), expected.float().abs())
    residual = kwargs.get("residual")
    slack = 2.0**-7 * scale + (2.0**-8 * residual.float().abs() if residual is not None else 0) + 1e-3
    assert ((got.float() - expected.float()).abs() <= slack).all()
    assert (got != expected).float().mean().item() < 0.2
    # A replay of the same launch is bitwise the same (no split of K, no atomics).
    assert torch.equal(ops.fused_linear(a, weight, **kwargs), got)


@cuda_kernel_test
def test_cuda_nan_stays_in_its_row():
    a, weight, kwargs = _case((5,), 1280, 1280, torch.bfloat16, device="cuda", seed=2, mode="linear2")
    clean = ops.fused_linear(a, weight, **kwargs)
    a[3, 100] = float("nan")
    got = ops.fused_linear(a, weight, **kwargs)
    assert torch.isnan(got[3]).all()
    assert torch.equal(got[[0, 1, 2, 4]], clean[[0, 1, 2, 4]])


@cuda_kernel_test
def test_cuda_decoder_step_error_no_larger_than_cublas(tmp_path):
    """A tiny-v2 bf16 decoder streaming one frame per step (every group within ``fused_rows``) against its
    float32 copy: the error with the op is at most 1.1x the error with every projection on cuBLAS."""
    fp32 = build_decoder(PRESETS["tiny-v2"], tmp_path, device="cuda")
    fp32.fused_glue = False
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    bf16.fused_glue = True
    cublas = copy.copy(bf16)
    cublas.fused_linear_rows = 0
    codes = random_codes(fp32, 2, 12, seed=9).cuda()
    reference = fp32.decode(codes, chunk_frames=1)
    fused_audio, cublas_audio = bf16.decode(codes, chunk_frames=1), cublas.decode(codes, chunk_frames=1)
    assert not torch.equal(fused_audio, cublas_audio), "the flag switches paths"

    def rel_rms(x):
        return ((x - reference).square().mean().sqrt() / reference.square().mean().sqrt()).item()

    print(f"bf16 relative RMS vs fp32: fused_linear {rel_rms(fused_audio):.4e}, cuBLAS {rel_rms(cublas_audio):.4e}")
    assert rel_rms(fused_audio) <= 1.1 * rel_rms(cublas_audio)
