# SPDX-License-Identifier: Apache-2.0
"""Tiny codecs built through the official checkpoint path, shared by the moss_tts tests."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_omni_moss.model_executor.models.moss_tts import step_metadata
from vllm_omni_moss.model_executor.models.moss_tts.checkpoint import load_checkpoint, save_random_checkpoint
from vllm_omni_moss.model_executor.models.moss_tts.config import _transformer as config_transformer
from vllm_omni_moss.model_executor.models.moss_tts.config import parse_config
from vllm_omni_moss.model_executor.models.moss_tts.ops.dispatch import (
    HAS_TRITON,
    TRITON_INTERPRET_AT_IMPORT,
    cpu_uses_triton_interpreter,
)
from vllm_omni_moss.model_executor.models.moss_tts.serving import (
    ChunkRequest,
    ChunkResult,
    CodecStreamSession,
    SessionOptions,
)
from vllm_omni_moss.model_executor.models.moss_tts.state import StateSpec, build_pool
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_batch


def _transformer(i: int, o: int) -> dict:
    spec = config_transformer(i, o, d_model=128, heads=2, layers=3, ffn=128, duration=None)
    # 1.0 instead of the checkpoints' 0.01 so attention dominates the residual
    # stream and every ring cell visibly moves the output.
    spec["layer_scale"] = 1.0
    return spec


def ring_codec_raw() -> dict:
    """Two groups at 1 and 2 tokens per frame with rings of 5 and 10 tokens (context 5 s).

    1 frame per second, mono, 8 samples per frame, head_dim 64, 3 layers per group:
    small enough for exhaustive state checks, shaped like the real decoder.
    """
    decoder = [
        _transformer(8, 16),
        {"module_type": "PatchedPretransform", "patch_size": 2},
        _transformer(8, 4),
        {"module_type": "PatchedPretransform", "patch_size": 4},
    ]
    return {
        "sampling_rate": 8,
        "downsample_rate": 8,
        "number_channels": 1,
        "causal_transformer_context_duration": 5.0,
        "decoder_kwargs": decoder,
        "quantizer_kwargs": {
            "input_dim": 8,
            "rvq_dim": 8,
            "output_dim": 8,
            "num_quantizers": 2,
            "codebook_size": 16,
            "codebook_dim": 4,
            "quantizer_type": "rlfq",
        },
    }


REPO_ROOT = Path(__file__).resolve().parents[4]


def assert_interpreted_tests_pass(test_file: str, timeout: float) -> None:
    """Run the tests of ``test_file`` whose names contain ``interpreted`` in a child pytest with
    ``TRITON_INTERPRET=1`` (Triton fixes at import whether kernels are interpreted, so this
    process cannot switch), and assert that they ran and passed, none skipped."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-m", "pytest", str(Path(test_file).resolve()), "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        argv + ["-k", "interpreted"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    # A silently skipped kernel test would pass vacuously.
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, report


def interpreter_subprocess_test(test_file: str, timeout: float):
    """The test that runs ``test_file``'s interpreted tests in a ``TRITON_INTERPRET=1`` child
    (:func:`assert_interpreted_tests_pass`); assign it to ``test_triton_interpreter_subprocess`` in that
    file. Skipped without Triton, and in a process that interprets already (the tests then run there)."""

    @pytest.mark.cpu
    @pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
    @pytest.mark.skipif(
        cpu_uses_triton_interpreter(), reason="this process interprets already; the tests below run directly"
    )
    def test_triton_interpreter_subprocess():
        assert_interpreted_tests_pass(test_file, timeout=timeout)

    return test_triton_interpreter_subprocess


#: Marks a test of an ops file that the ``TRITON_INTERPRET=1`` child of :func:`interpreter_subprocess_test`
#: runs (selected by "interpreted" in its name); a process that does not interpret skips it.
needs_interpreter = pytest.mark.skipif(
    not cpu_uses_triton_interpreter(),
    reason="runs in the TRITON_INTERPRET=1 child of test_triton_interpreter_subprocess",
)


def cuda_kernel_test(fn):
    """Mark ``fn`` as a test of compiled kernels on CUDA (marker ``cuda``): skipped without CUDA, and where
    ``TRITON_INTERPRET=1`` was set at import (the "CUDA" kernels would be interpreted, testing nothing real)."""
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(fn)
    fn = pytest.mark.skipif(TRITON_INTERPRET_AT_IMPORT, reason="kernels are interpreted here")(fn)
    return pytest.mark.cuda(fn)


def compile_recorded_launch(monkeypatch, module, name: str, launch) -> None:
    """Compile for an H200 (sm_90, offline: no device needed) the launch that ``launch()`` makes of
    ``module.<name>``, with the argument types Triton's launcher would give them (a Python float is
    float32, an int int32 or int64, a tensor a pointer to its dtype)."""
    triton = pytest.importorskip("triton")
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    if "nvidia" not in backends:
        pytest.skip("Triton has no CUDA backend here")
    kernel, calls = getattr(module, name), []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((args, dict(kwargs)))

    monkeypatch.setattr(module, name, Recorder())
    launch()
    ((args, kwargs),) = calls
    signature, constants = {}, {}
    for i, param in enumerate(kernel.params):
        value = args[i] if i < len(args) else kwargs.pop(param.name)
        signature[param.name] = "constexpr" if param.is_constexpr else mangle_type(value)
        if param.is_constexpr:
            constants[param.name] = value
    triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32), options=kwargs)


def build_decoder(raw: dict, tmp_path, *, version: str | None = None, seed: int = 17, device: str = "cpu"):
    """Write a random official-format checkpoint for ``raw`` and load it back."""
    config = parse_config(copy.deepcopy(raw), version)
    raw = dict(config.raw)
    raw["codec_version"] = config.version
    path = save_random_checkpoint(parse_config(raw), tmp_path / f"ckpt-{seed}", seed=seed)
    return load_checkpoint(path, device=device)


def random_codes(decoder, batch: int, frames: int, seed: int, n_vq: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    cfg = decoder.config
    n_vq = n_vq or cfg.num_quantizers
    return torch.randint(0, cfg.codebook_size, (n_vq, batch, frames), generator=gen)


def stream_codes(decoder, frames: int, seed: int) -> torch.Tensor:
    """Random codes of one stream, ``(n_vq, frames)`` int64: row 0 of :func:`random_codes`."""
    return random_codes(decoder, 1, frames, seed)[:, 0]  # (n_vq, T)


def make_state_pool(decoder, *args, **options):
    """The pool of loose options, as a session or a stage builds it: ``build_pool(decoder,
    StateSpec.from_options(decoder, *args, **options))`` (kind, dtype, ring semantics, attention backend, page
    fraction, state budget, expected stream frames); not yet initialised."""
    return build_pool(decoder, StateSpec.from_options(decoder, *args, **options))


def step_valid_rows(pool, codes: torch.Tensor, valid_frames: list[int], slots: list[int]):
    """One validated step over ``pool`` in which every row is valid (``step.decode_batch``): ``codes``
    ``(n_vq, B, T)``, ``valid_frames`` the valid frames of each row, ``slots`` the slot of each row (``B`` ints
    each). Returns ``(audio (B, channels, T * samples_per_frame), audio_lengths (B,))``."""
    B = codes.shape[1]
    return decode_batch(pool, codes, torch.tensor(valid_frames), torch.tensor(slots), torch.ones(B, dtype=torch.bool))


def initialized_state_pool(decoder, kind: str):
    """A pool of ``kind`` for ``decoder``, initialised with 3 live slots and 2 scratch slots."""
    pool = make_state_pool(decoder, kind)
    pool.initialize(3, 2)
    return pool


def step_every_row(pool, slots: list[int], frames: int, seed: int) -> torch.Tensor:
    """One step of ``frames`` random frames for each live slot of ``slots``, every row valid; returns the audio."""
    codes = random_codes(pool.decoder, len(slots), frames, seed=seed)
    B = len(slots)
    audio, _ = decode_batch(pool, codes, torch.full((B,), frames), torch.tensor(slots), torch.ones(B, dtype=torch.bool))
    return audio


def slot_bits(pool, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copies of slot ``slot``'s ring in every layer, and of the pool's offset tensors."""
    return [ring[:, slot].clone() for ring in pool.rings], [t.clone() for t in pool.offset_tensors()]


def acquire_all(pool) -> None:
    """Acquire every live slot of ``pool`` (``restore_slot`` writes slots in use only)."""
    for _ in range(pool.state_capacity):
        pool.acquire()


#: Live slots of the pools :func:`compact_and_paged_pools` makes.
PAGED_TEST_CAPACITY = 3


def compact_and_paged_pools(decoder, **paged):
    """A compact pool (Triton attention backend) and a paged pool (``paged``: its loose options) of
    ``decoder``, each initialised with :data:`PAGED_TEST_CAPACITY` slots, all of them acquired."""
    compact = make_state_pool(decoder, "compact", attention_backend="triton")
    compact.initialize(PAGED_TEST_CAPACITY)
    pool = make_state_pool(decoder, "paged", **paged)
    pool.initialize(PAGED_TEST_CAPACITY)
    for p in (compact, pool):
        assert [p.acquire() for _ in range(PAGED_TEST_CAPACITY)] == list(range(PAGED_TEST_CAPACITY))
    return compact, pool


def count_ring_metadata_builds(monkeypatch) -> list[int]:
    """Record the token count of every ``step_metadata.build_ring_metadata`` call from now on."""
    calls = []
    real = step_metadata.build_ring_metadata

    def spy(*args, **kwargs):
        calls.append(args[4])
        return real(*args, **kwargs)

    monkeypatch.setattr(step_metadata, "build_ring_metadata", spy)
    return calls


def solo_decode(decoder, codes: torch.Tensor, schedule: list[int]) -> torch.Tensor:
    """Reference: ``(channels, T * spf)`` of one stream fed in chunks of ``schedule`` frames."""
    assert sum(schedule) == codes.shape[1]
    return decoder.decode(codes[:, None], chunk_frames=schedule)[0]


def assert_close_to_solo(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """``got`` is float32 CPU audio of ``ref``'s shape within 1e-5 of ``ref``'s peak."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    err = (got - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), f"{what}: max error {err}"


def make_session(
    decoder,
    state_capacity: int | None = None,
    *,
    compile=False,
    state_spec: StateSpec | None = None,
    pool_kind: str | None = None,
    state_dtype: torch.dtype | None = None,
    attention_backend: str | None = None,
    ring_semantics: str | None = None,
    page_fraction: float | None = None,
    state_budget_bytes: int | None = None,
    expected_stream_frames: int | None = None,
    **options,
) -> CodecStreamSession:
    """A session of ``decoder`` from loose options: the pool's (``StateSpec.from_options``, or ``state_spec``) and
    the session's (:class:`SessionOptions` fields: ``graph_frame_totals``, ``max_step_frames``, ``n_vq``, ...)."""
    spec = state_spec or StateSpec.from_options(
        decoder, kind=pool_kind, dtype=state_dtype, ring_semantics=ring_semantics,
        attention_backend=attention_backend, page_fraction=page_fraction, state_budget_bytes=state_budget_bytes,
        expected_stream_frames=expected_stream_frames,
    )  # fmt: skip
    return CodecStreamSession(decoder, spec, SessionOptions(state_capacity, **options), compile=compile)


def count_steps(session, monkeypatch) -> list[tuple[int, int, int]]:
    """Record ``(rows, T, packed frames)`` of every eager pool step of ``session``."""
    steps = []
    real = session.step_runner.eager_step

    def spy(codes, lengths, slot_ids, valid, frames):
        steps.append((lengths.shape[0], frames, codes.shape[1]))
        return real(codes, lengths, slot_ids, valid, frames)

    monkeypatch.setattr(session.step_runner, "eager_step", spy)
    return steps


class ChunkDriver:
    """Feeds whole code sequences to a session in scripted chunks and keeps the audio."""

    def __init__(self, session, decoder):
        self.session, self.decoder = session, decoder
        self.codes: dict[str, torch.Tensor] = {}
        self.pos: dict[str, int] = {}
        self.schedule: dict[str, list[int]] = {}
        self.audio: dict[str, list[torch.Tensor]] = {}

    def add(self, rid: str, frames: int, seed: int) -> None:
        self.codes[rid] = stream_codes(self.decoder, frames, seed)
        self.pos[rid], self.schedule[rid], self.audio[rid] = 0, [], []

    def step(self, chunks: list[tuple[str, int, bool]]) -> dict[str, ChunkResult]:
        reqs = []
        for rid, T, finished in chunks:
            p = self.pos[rid]
            reqs.append(ChunkRequest(rid, self.codes[rid][:, p : p + T], finished))
            self.pos[rid] = p + T
            step = self.session.max_piece_frames
            self.schedule[rid] += [min(step, T - k) for k in range(0, T, step)]  # the session splits long chunks
        out = self.session.decode(reqs)
        assert set(out) == {rid for rid, _, _ in chunks}
        for rid, T, _ in chunks:
            res = out[rid]
            assert res.frames == T and res.sample_rate == self.decoder.config.sampling_rate
            assert res.audio.shape == (self.decoder.config.number_channels, T * self.decoder.config.samples_per_frame)
            self.audio[rid].append(res.audio)
        return out

    def check(self, rid: str) -> None:
        assert self.pos[rid] == self.codes[rid].shape[1], f"{rid} not fully fed"
        got = torch.cat(self.audio[rid], dim=-1)
        assert_close_to_solo(got, solo_decode(self.decoder, self.codes[rid], self.schedule[rid]), rid)


def assert_slot_state_equal(a, b, slots) -> None:
    """Offsets and every ring of each slot in ``slots`` are bit-identical between pools ``a`` and ``b``."""
    for s in slots:
        x, y = a.slot_state(s), b.slot_state(s)
        assert torch.equal(x["layer_offsets"], y["layer_offsets"]), f"slot {s} offsets differ"
        for li, (p, q) in enumerate(zip(x["rings"], y["rings"])):
            assert torch.equal(p, q), f"slot {s} layer {li} ring differs"
