# SPDX-License-Identifier: Apache-2.0
"""Attention backends and ring semantics, end to end: pool choice and bad input, the session, the
stage's hf_overrides, the CLI, the ``exact`` semantics against offline decode, compile, and the H200
gates of the ``triton`` backend (determinism, bf16 accuracy, CUDA graphs, Inductor).

The kernels themselves are tested in ``test_ops_ring_attention_packed.py``; on CPU without Triton's interpreter
the ``triton`` backend runs the ops' PyTorch references, so here it must equal ``sdpa`` bit for bit.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from moss_codecs import assert_slot_state_equal, build_decoder, make_session, make_state_pool, random_codes

from vllm_omni_moss.model_executor.models.moss_tts import backends
from vllm_omni_moss.model_executor.models.moss_tts import decoder as decoder_mod
from vllm_omni_moss.model_executor.models.moss_tts.compile import compile_decode
from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS, preset_config
from vllm_omni_moss.model_executor.models.moss_tts.cuda_graph import StreamingGraphRunner
from vllm_omni_moss.model_executor.models.moss_tts.decoder import CodecDecoder, chunk_schedule
from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import StepShape
from vllm_omni_moss.model_executor.models.moss_tts.ops.dispatch import cpu_uses_triton_interpreter
from vllm_omni_moss.model_executor.models.moss_tts.serving import ChunkRequest
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_batch, decode_tensors
from vllm_omni_moss.model_executor.models.moss_tts.token_packing import pack_codes, unpack_audio
from vllm_omni_moss.testing.weights import fill_random_weights_

pytestmark = [pytest.mark.core_model]

SEMANTICS = ("upstream", "exact")
REFERENCE_DISPATCH = not cpu_uses_triton_interpreter()


def stream_pool(pool, codes, schedule):
    """Stream ``codes`` ``(n_vq, B, N)`` through ``pool`` (slots ``0..B-1``) in chunks of ``schedule``."""
    B = codes.shape[1]
    device = pool.device
    ids = torch.arange(B, device=device)
    parts = []
    for a, b in chunk_schedule(codes.shape[-1], schedule):
        lengths = torch.full((B,), b - a, device=device)
        audio, _ = decode_batch(pool, codes[:, :, a:b].to(device), lengths, ids, torch.ones_like(ids).bool())
        parts.append(audio)
    return torch.cat(parts, dim=-1)


def fresh_pool(decoder, semantics=None, backend=None, capacity=2):
    pool = make_state_pool(decoder, "compact", ring_semantics=semantics, attention_backend=backend)
    pool.initialize(capacity)
    return pool


def rel_max(got, ref):
    return ((got - ref).abs().max() / ref.abs().max()).item()


# ----------------------------------------------------------------------------- choice and bad input


@pytest.mark.cpu
def test_defaults_and_choices(ring_decoder, ring_decoder_v1):
    pool = make_state_pool(ring_decoder)
    assert (pool.attention_backend, pool.ring_semantics) == ("sdpa", "upstream")
    assert backends.default_attention_backend(torch.device("cpu")) == "sdpa"
    cuda_default = "triton" if backends.HAS_TRITON else "sdpa"
    assert backends.default_attention_backend("cuda:1") == cuda_default
    legacy = make_state_pool(ring_decoder_v1)
    assert (legacy.attention_backend, legacy.ring_semantics) == ("sdpa", "exact")
    pool = make_state_pool(ring_decoder, ring_semantics="exact", attention_backend="triton")
    assert (pool.attention_backend, pool.ring_semantics) == ("triton", "exact")
    assert backends.ATTENTION_BACKENDS == ("sdpa", "triton")


@pytest.mark.cpu
@pytest.mark.parametrize("kind", ["compact", "legacy"])
def test_unknown_backend_or_semantics_lists_the_choices(kind, ring_decoder):
    with pytest.raises(ValueError) as err:
        make_state_pool(ring_decoder, kind, attention_backend="flash")
    assert str(err.value) == "unknown attention backend 'flash'; expected one of ('sdpa', 'triton')"
    with pytest.raises(ValueError) as err:
        make_state_pool(ring_decoder, kind, ring_semantics="offline")
    assert str(err.value) == "unknown ring semantics 'offline'; expected one of ('upstream', 'exact')"


@pytest.mark.cpu
def test_legacy_pool_refuses_triton(ring_decoder_v1):
    with pytest.raises(ValueError) as err:
        make_state_pool(ring_decoder_v1, attention_backend="triton")
    assert str(err.value) == (
        "the legacy pool runs upstream's per-layer SDPA path only; attention backend 'triton' needs the "
        "compact pool (v2 codecs)"
    )


@pytest.mark.cpu
def test_triton_without_triton_fails_at_construction(monkeypatch, ring_decoder):
    monkeypatch.setattr(backends, "HAS_TRITON", False)
    with pytest.raises(RuntimeError) as err:
        make_state_pool(ring_decoder, attention_backend="triton")
    assert str(err.value) == (
        "attention backend 'triton' needs the `triton` package, which is not installed; "
        "install it or use attention backend 'sdpa'"
    )
    with pytest.raises(RuntimeError, match="needs the `triton` package"):
        make_session(ring_decoder, 2, attention_backend="triton")
    assert make_state_pool(ring_decoder).attention_backend == "sdpa"  # the default still builds


# ----------------------------------------------------------------------------- parity on CPU


@pytest.mark.cpu
@pytest.mark.skipif(not REFERENCE_DISPATCH, reason="the ops run interpreted kernels in this process")
@pytest.mark.parametrize("semantics", SEMANTICS)
def test_triton_backend_on_cpu_equals_sdpa_bitwise(semantics, ring_decoder):
    sdpa, tri = fresh_pool(ring_decoder, semantics, "sdpa", 3), fresh_pool(ring_decoder, semantics, "triton", 3)
    for step, (T, lengths) in enumerate([(3, [3, 1, 0]), (12, [12, 7, 12]), (1, [1, 0, 1]), (7, [7, 7, 2])]):
        codes = random_codes(ring_decoder, 4, T, seed=step)
        args = (torch.tensor(lengths + [T]), torch.tensor([2, 0, 1, 99]), torch.tensor([True] * 3 + [False]))
        a, _ = decode_batch(sdpa, codes, *args)
        b, _ = decode_batch(tri, codes, *args)
        assert torch.equal(a, b), f"step {step}"
        assert_slot_state_equal(sdpa, tri, range(3))
        assert not any(r[:, tri.null_slot].any() for r in tri.rings)


SCHEDULES = ([1, 15], [1, 4, 15])


def _random_schedules(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(1, 16) for _ in range(rng.randint(1, 5))] for _ in range(count)]


@pytest.mark.cpu
def test_exact_semantics_streaming_equals_offline(ring_decoder):
    """Any chunk schedule, rings of 5 and 10 tokens overrun by 15- and 30-token chunks: the compact
    pool and the fixed-width path with ``exact`` semantics equal offline decode within 1e-5."""
    codes = random_codes(ring_decoder, 2, 40, seed=21)
    offline = ring_decoder.decode(codes)
    for schedule in [*SCHEDULES, *_random_schedules(4, seed=5)]:
        pooled = stream_pool(fresh_pool(ring_decoder, "exact"), codes, schedule)
        assert rel_max(pooled, offline) <= 1e-5, f"pool, schedule {schedule}"
        fixed = ring_decoder.decode(codes, chunk_frames=schedule, ring_semantics="exact")
        assert rel_max(fixed, offline) <= 1e-5, f"fixed width, schedule {schedule}"
    # upstream semantics part from offline once the rings fill (the reason "exact" exists)
    assert rel_max(stream_pool(fresh_pool(ring_decoder, "upstream"), codes, [1, 15]), offline) > 1e-3


@pytest.mark.cpu
def test_fixed_width_semantics_are_validated(ring_decoder):
    codes = random_codes(ring_decoder, 1, 3, seed=1)
    with pytest.raises(ValueError, match=r"unknown ring semantics 'v1'; expected one of \('upstream', 'exact'\)"):
        ring_decoder.decode(codes, chunk_frames=1, ring_semantics="v1")
    with ring_decoder.streaming(1, "exact") as stream:
        assert stream.ring_semantics == "exact"


@pytest.mark.cpu
@pytest.mark.skipif(not REFERENCE_DISPATCH, reason="the ops run interpreted kernels in this process")
def test_triton_pool_step_traces_fullgraph(ring_decoder):
    """The step with the triton backend traces as one dynamic fullgraph through the ops' fake impls
    (Dynamo only; functionalisation of the ring write: test_ops_trace_fullgraph_with_fake_impls) and
    equals the eager step."""
    torch._dynamo.reset()
    eager, traced = fresh_pool(ring_decoder, None, "triton", 4), fresh_pool(ring_decoder, None, "triton", 4)
    step = compile_decode(traced, backend="eager")
    for i, (B, F) in enumerate([(2, 7), (3, 10), (4, 12)]):
        codes = random_codes(ring_decoder, B, 3, seed=i)
        valid = torch.arange(B) < B - 1 if i == 1 else torch.ones(B, dtype=torch.bool)
        lengths = torch.where(valid, 3, 0) - (torch.arange(B) == 0).long()  # row 0 one frame short
        args = (pack_codes(codes, lengths, F), lengths, torch.tensor([2, 0, 3, 1][:B]), valid, 3)
        assert torch.equal(step(*args), decode_tensors(eager, *args))
        assert_slot_state_equal(eager, traced, range(4))
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- session, stage, CLI


@pytest.mark.cpu
def test_session_passes_backend_and_semantics_to_its_pool(ring_decoder):
    session = make_session(ring_decoder, 2, attention_backend="triton", ring_semantics="exact")
    assert (session.pool.attention_backend, session.pool.ring_semantics) == ("triton", "exact")
    codes = random_codes(ring_decoder, 1, 20, seed=2)[:, 0]
    audio = []
    for a, b in chunk_schedule(20, [1, 15]):
        audio.append(session.decode([ChunkRequest("r", codes[:, a:b], b == 20)])["r"].audio)
    assert rel_max(torch.cat(audio, -1), ring_decoder.decode(codes[:, None])[0]) <= 1e-5
    with pytest.raises(ValueError, match="unknown ring semantics 'x'"):
        make_session(ring_decoder, 2, ring_semantics="x")


@pytest.mark.cpu
@pytest.mark.vllm
def test_stage_reads_backend_and_semantics_from_hf_config(tmp_path):
    from stage_helpers import build_stage, delay_info, run

    stage = build_stage(tmp_path, "tiny-v2", codec_attention_backend="triton", codec_ring_semantics="exact")
    run(stage, [torch.zeros(stage.n_vq, 2, dtype=torch.long)], [delay_info()], ["a"])
    assert (stage._session.pool.attention_backend, stage._session.pool.ring_semantics) == ("triton", "exact")
    plain = build_stage(tmp_path / "plain", "tiny-v2")
    run(plain, [torch.zeros(plain.n_vq, 2, dtype=torch.long)], [delay_info()], ["a"])
    assert (plain._session.pool.attention_backend, plain._session.pool.ring_semantics) == ("sdpa", "upstream")
    # As upstream, the triton field changes nothing for a v1 codec.
    v1 = build_stage(tmp_path / "v1", "tiny-v1", codec_attention_backend="triton")
    run(v1, [torch.zeros(v1.n_vq, 2, dtype=torch.long)], [delay_info()], ["a"])
    assert (v1._session.pool.attention_backend, v1._session.pool.ring_semantics) == ("sdpa", "exact")


@pytest.mark.cpu
@pytest.mark.vllm
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("codec_attention_backend", "flash", "codec_attention_backend must be one of 'sdpa', 'triton'; got 'flash'"),
        ("codec_ring_semantics", "v2", "codec_ring_semantics must be one of 'upstream', 'exact'; got 'v2'"),
    ],
)
def test_stage_rejects_unknown_choices_at_construction(tmp_path, field, value, message):
    from stage_helpers import vllm_config

    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    with pytest.raises(ValueError) as err:
        MossTTSCodecDecoder(vllm_config=vllm_config(tmp_path, 11, **{field: value}))
    assert str(err.value) == message


@pytest.mark.cpu
def test_cli_decode_semantics(tmp_path, capsys):
    soundfile = pytest.importorskip("soundfile")
    from vllm_omni_moss.model_executor.models.moss_tts.checkpoint import load_checkpoint
    from vllm_omni_moss.model_executor.models.moss_tts.cli import main

    assert main(["make-checkpoint", "--preset", "tiny-v2", str(tmp_path / "ck"), "--seed", "4"]) == 0
    codes = np.random.default_rng(1).integers(0, 1024, size=(12, 20))
    np.save(tmp_path / "codes.npy", codes)
    out = tmp_path / "out.wav"
    argv = ["decode", str(tmp_path / "codes.npy"), "-o", str(out), "--checkpoint", str(tmp_path / "ck")]
    assert main(argv + ["--semantics", "exact"]) == 0
    assert "(exact ring semantics)" in capsys.readouterr().out
    decoder = load_checkpoint(tmp_path / "ck")
    expected = decoder.decode(torch.from_numpy(codes)[:, None], chunk_frames=[1, 15], ring_semantics="exact")
    audio, _ = soundfile.read(out)
    assert np.array_equal(audio.astype(np.float32), expected[0].T.numpy())
    assert main(argv) == 0 and "(upstream ring semantics)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ["--semantics", "offline"])
    assert exit_info.value.code == 2
    assert "argument --semantics: invalid choice: 'offline'" in capsys.readouterr().err  # quoting varies by Python


# ----------------------------------------------------------------------------- CUDA (H200 gates)


@torch.no_grad()
def random_real_decoder(device, seed: int = 0) -> CodecDecoder:
    """The v2 codec geometry with small random float32 weights (``testing.weights.fill_random_weights_``)."""
    with torch.device("meta"):
        decoder = CodecDecoder(preset_config("v2"))
    return fill_random_weights_(decoder.to_empty(device=device), seed).eval()


def _rel_rms(got, ref):
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("semantics", SEMANTICS)
def test_cuda_bf16_triton_error_no_larger_than_sdpa(semantics):
    """Real v2 geometry, random weights, 2 streams x 10 chunks ([1, 15]): the bf16 triton backend's
    relative RMS error against the float32 sdpa path is no larger than the bf16 sdpa path's."""
    fp32 = random_real_decoder("cuda")
    bf16 = copy.deepcopy(fp32).to_serving("cuda")
    codes = random_codes(fp32, 2, 1 + 9 * 15, seed=7, n_vq=12).cuda()
    reference = stream_pool(fresh_pool(fp32, semantics, "sdpa"), codes, [1, 15])
    fp32_triton = stream_pool(fresh_pool(fp32, semantics, "triton"), codes, [1, 15])
    assert _rel_rms(fp32_triton, reference) <= 1e-3, "float32 triton vs float32 sdpa"
    sdpa_error = _rel_rms(stream_pool(fresh_pool(bf16, semantics, "sdpa"), codes, [1, 15]), reference)
    triton_error = _rel_rms(stream_pool(fresh_pool(bf16, semantics, "triton"), codes, [1, 15]), reference)
    print(f"{semantics}: bf16 relative RMS vs fp32: sdpa {sdpa_error:.3e}, triton {triton_error:.3e}")
    # "exact": both backends attend the same keys and their errors agree to four digits on the H200
    # (2.416e-2 each); 0.1% absorbs that last digit. "upstream": triton 2.4e-2 against sdpa 4.2e-2.
    assert triton_error <= 1.001 * sdpa_error, f"triton {triton_error:.4e} > sdpa {sdpa_error:.4e}"


def _bf16_decoder_and_reference():
    """The served bf16 decoder (``to_serving``: the fused layer ops) of a random real-geometry float32 one,
    2 streams x 136 frames of codes (10 chunks of [1, 15]) on CUDA, and the float32 decoder's audio of them
    (sdpa; float32 runs the unfused references): the reference the accuracy criteria of the fused paths are
    held to."""
    fp32 = random_real_decoder("cuda")
    bf16 = copy.deepcopy(fp32).to_serving("cuda")
    codes = random_codes(fp32, 2, 1 + 9 * 15, seed=11, n_vq=12).cuda()
    return bf16, codes, stream_pool(fresh_pool(fp32, None, "sdpa"), codes, [1, 15])


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_bf16_fused_ops_error_no_larger_than_unfused(monkeypatch):
    """The accuracy criterion set for the fused layer ops (``ops/layer_norm.py``, the GEMMs' residual adds and GELU epilogue): real v2 geometry,
    2 streams x 10 chunks ([1, 15]) through the triton backend; the bf16 decoder's relative RMS error
    against the float32 reference (sdpa, unfused) is no larger with the fused ops than with their
    references (``decoder.runs_fused_ops`` answering False for it)."""
    bf16, codes, reference = _bf16_decoder_and_reference()
    fused_audio = stream_pool(fresh_pool(bf16, None, "triton"), codes, [1, 15])
    monkeypatch.setattr(decoder_mod, "runs_fused_ops", lambda decoder: False)
    unfused_audio = stream_pool(fresh_pool(bf16, None, "triton"), codes, [1, 15])
    # The paths differ: the fused kernel rounds x + scale * update once, PyTorch twice.
    assert not torch.equal(fused_audio, unfused_audio)
    fused_error, unfused_error = _rel_rms(fused_audio, reference), _rel_rms(unfused_audio, reference)
    print(f"bf16 relative RMS vs fp32: fused {fused_error:.4e}, unfused {unfused_error:.4e}")
    assert fused_error <= 1.01 * unfused_error, f"fused {fused_error:.4e} > unfused {unfused_error:.4e}"


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_bf16_ffn_row_slices_write_in_place(monkeypatch):
    """Under bf16 autocast each FFN slice's second GEMM writes its rows of the output in place
    (``torch.mm(out=)``): with every group's FFN in 7-row pieces the bf16 audio is as close to the float32
    reference as with one pass."""
    from vllm_omni_moss.model_executor.models.moss_tts import decoder as decoder_mod

    fp32 = random_real_decoder("cuda")
    bf16 = copy.deepcopy(fp32).to_serving("cuda")
    codes = random_codes(bf16, 2, 16, seed=5, n_vq=12).cuda()
    reference = stream_pool(fresh_pool(fp32, None, "sdpa"), codes, [1, 15])
    whole = stream_pool(fresh_pool(bf16, None, "triton"), codes, [1, 15])
    monkeypatch.setattr(decoder_mod, "FFN_ROW_CHUNK", 7)
    sliced = stream_pool(fresh_pool(bf16, None, "triton"), codes, [1, 15])
    # A slice written to the wrong rows, or not at all, would move the audio by its own size.
    assert _rel_rms(sliced, reference) <= 1.1 * _rel_rms(whole, reference)


@pytest.fixture
def cuda_tiny_decoder(tmp_path):
    """tiny-v2 in bf16 on CUDA: its last group gets 32 tokens per frame into a 40-token ring, so every
    chunk of 2+ frames has more tokens than ring cells."""
    return build_decoder(PRESETS["tiny-v2"], tmp_path, device="cuda")


def _script_run(decoder, semantics):
    pool = fresh_pool(decoder, semantics, "triton", 4)
    audio = []
    for step, (T, lengths) in enumerate([(15, [15, 15, 3]), (1, [1, 0, 1]), (15, [15, 9, 15]), (4, [4, 4, 4])]):
        codes = random_codes(decoder, 4, T, seed=step).cuda()
        lengths = torch.tensor(lengths + [T], device="cuda")
        ids, valid = torch.tensor([0, 1, 2, 7], device="cuda"), torch.tensor([True] * 3 + [False], device="cuda")
        audio.append(decode_batch(pool, codes, lengths, ids, valid)[0])
    return audio, pool


@pytest.mark.cuda
@pytest.mark.parametrize("semantics", SEMANTICS)
def test_cuda_two_runs_bitwise_identical(semantics, cuda_tiny_decoder):
    first, pool_a = _script_run(cuda_tiny_decoder, semantics)
    second, pool_b = _script_run(cuda_tiny_decoder, semantics)
    for step, (a, b) in enumerate(zip(first, second)):
        assert torch.isfinite(a).all() and torch.equal(a, b), f"step {step}: runs differ"
    assert_slot_state_equal(pool_a, pool_b, range(4))


@pytest.mark.cuda
def test_cuda_graph_replay_of_the_triton_step_equals_eager(cuda_tiny_decoder):
    dec = cuda_tiny_decoder
    eager, graphed = fresh_pool(dec, None, "triton", 4), fresh_pool(dec, None, "triton", 4)
    shapes = [StepShape(2, 15, 2), StepShape(4, 15, 4), StepShape(4, 15, 24), StepShape(4, 15, 60)]
    runner = StreamingGraphRunner(graphed, shapes, n_vq=dec.config.num_quantizers)
    runner.capture()
    assert not runner.failures and len(runner.graphs) == 4
    cases = [(15, [0, 1], 60), (1, [2, 0, 1], 4), (7, [3, 1, 0, 2], 60), (15, [2], 24), (1, [1, 3], 2)]
    for step, (T, live, total) in enumerate(cases):
        B = len(live)
        codes = random_codes(dec, B, T, seed=30 + step).cuda()
        ids = torch.tensor(live, device="cuda")
        got = runner.decode(codes, torch.full((B,), T, device="cuda"), ids)
        shape = next(s for s in shapes if s.total_frames == total)
        lengths = torch.zeros(shape.rows, dtype=torch.long, device="cuda")
        lengths[:B] = T
        slots = eager.padding_slot_ids(shape.rows).clone()
        slots[:B] = ids
        valid = torch.arange(shape.rows, device="cuda") < B
        audio = decode_tensors(eager, pack_codes(codes, lengths[:B], total), lengths, slots, valid, 15)
        ref = unpack_audio(audio, lengths[:B], T, dec.config.samples_per_frame)
        assert torch.equal(got, ref), f"step {step}: replay differs from eager"
        assert_slot_state_equal(eager, graphed, range(4))


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_inductor_compiles_the_triton_step(cuda_tiny_decoder):
    torch._dynamo.reset()
    dec = cuda_tiny_decoder
    eager, compiled = fresh_pool(dec, None, "triton", 4), fresh_pool(dec, None, "triton", 4)
    step = compile_decode(compiled)
    for i, (B, F) in enumerate([(4, 60), (2, 30), (3, 24)]):  # F holds the 26, 16 and 23 real frames
        codes = random_codes(dec, B, 15, seed=60 + i).cuda()
        lengths = torch.tensor([15, 1, 7, 3][:B], device="cuda")
        args = (
            pack_codes(codes, lengths, F),
            lengths,
            torch.arange(B, device="cuda"),
            torch.ones(B, device="cuda").bool(),
            15,
        )
        # The real frames come first in the packing; a dummy frame's samples are unspecified (its attention
        # output is whatever its buffer held), so only the real ones are compared.
        real = int(lengths.sum()) * dec.config.samples_per_frame
        ref = decode_tensors(eager, *args)[:, :real]
        got = step(*args)[:, :real]
        assert torch.isfinite(got).all() and _rel_rms(got, ref) <= 2.5e-2, f"step {i}"
        assert torch.equal(eager.frames_decoded, compiled.frames_decoded)
    torch._dynamo.reset()


@pytest.mark.cuda
def test_cuda_fused_path_keeps_a_nan_in_its_row(cuda_tiny_decoder):
    """Bad state on the fused path (a served bf16 decoder, triton backend): slot 1's rings filled with NaN after two clean steps. The next step's audio is
    NaN in row 1 only; rows 0 and 2 and every slot but 1 are bitwise those of the same step on clean rings."""
    dec = cuda_tiny_decoder
    assert decoder_mod.runs_fused_ops(dec)
    clean, dirty = fresh_pool(dec, None, "triton", 3), fresh_pool(dec, None, "triton", 3)
    ids = torch.arange(3, device="cuda")
    live = torch.ones(3, dtype=torch.bool, device="cuda")
    for i, T in enumerate((3, 2, 2)):
        codes = random_codes(dec, 3, T, seed=70 + i).cuda()
        lengths = torch.full((3,), T, device="cuda")
        if i == 2:
            for ring in dirty.rings:
                ring[:, 1] = float("nan")
        a, _ = decode_batch(clean, codes, lengths, ids, live)
        b, _ = decode_batch(dirty, codes, lengths, ids, live)
    assert torch.isfinite(a).all() and b[1].isnan().any()
    assert torch.equal(b[0], a[0]) and torch.equal(b[2], a[2])
    assert_slot_state_equal(clean, dirty, [0, 2])
