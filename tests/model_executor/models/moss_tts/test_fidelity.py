# SPDX-License-Identifier: Apache-2.0
"""Fidelity of bf16 streaming over a stream's length (issue 29), on CUDA: the real v2 geometry with random
weights, streamed through :class:`CodecStreamSession` with CUDA graphs in chunks of 1 then 15 frames, in bf16
(as served) and in float32 (the same weights cast up). Per window of 43 frames the relative error
``||bf16 - fp32|| / ||fp32||`` stays within a bound set by bf16's precision and does not grow along the stream.
``benchmarks/tts/bench_fidelity.py`` measures the same over 4,000 frames and against upstream's codec."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from moss_codecs import cuda_kernel_test, make_session

from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
from vllm_omni_moss.model_executor.models.moss_tts.decoder import CodecDecoder, chunk_schedule
from vllm_omni_moss.model_executor.models.moss_tts.serving import ChunkRequest
from vllm_omni_moss.testing.weights import fill_random_weights_

pytestmark = [pytest.mark.core_model]

FRAMES = 1 + 20 * 15  # 21 whole chunks: no tail
MARKS = (43, 94, 171, FRAMES)
WINDOW = 43
# 92 attention layers each round the residual stream to bf16 (relative spacing 2**-8); independent roundings add
# in quadrature, sqrt(92) x 2**-8 = 3.7e-2. Twice that bounds a correct decode, and is still far below the
# relative error of O(1) that a wrong key, position or ring cell gives.
ERROR_BOUND = 2 * math.sqrt(92) * 2.0**-8
GROWTH_BOUND = 2.0


@torch.no_grad()
def _decoders() -> tuple[CodecDecoder, CodecDecoder]:
    with torch.device("meta"):
        decoder = CodecDecoder(preset_config("v2"))
    bf16 = fill_random_weights_(decoder.to_empty(device="cuda"), seed=3).to_serving("cuda")
    return bf16, copy.deepcopy(bf16).to(torch.float32)


def _stream(decoder: CodecDecoder, codes: torch.Tensor, semantics: str) -> torch.Tensor:
    """``codes`` int64 ``(n_vq, B, FRAMES)`` on CPU -> float32 audio ``(B, channels, FRAMES * spf)``."""
    B = codes.shape[1]
    session = make_session(
        decoder,
        B,
        ring_semantics=semantics,
        graph_frame_totals=(B, 15 * B),  # every call: B rows of 1 frame, then of 15
        graph_frame_sizes=(1, 15),
        max_step_frames=15,
        n_vq=codes.shape[0],
    )
    parts = [[] for _ in range(B)]
    try:
        assert session.runner is not None and len(session.runner.graphs) == 2
        for a, b in chunk_schedule(FRAMES, [1, 15]):
            results = session.decode([ChunkRequest(f"r{i}", codes[:, i, a:b], b == FRAMES) for i in range(B)])
            for i in range(B):
                parts[i].append(results[f"r{i}"].audio)
        assert session.stats()["steps_by_path"] == {"graph": len(chunk_schedule(FRAMES, [1, 15])), "eager": 0}
    finally:
        session.close()
    return torch.stack([torch.cat(p, dim=-1) for p in parts])


def _window_errors(test: torch.Tensor, reference: torch.Tensor, spf: int) -> list[float]:
    errors = []
    for m in MARKS:
        a, b = (m - WINDOW) * spf, m * spf
        ref = reference[..., a:b].double()
        errors.append(((test[..., a:b].double() - ref).norm() / ref.norm()).item())
    return errors


@cuda_kernel_test
@pytest.mark.parametrize("semantics", ["upstream", pytest.param("exact", marks=pytest.mark.slow)])
def test_cuda_bf16_window_errors_stay_bounded_and_do_not_grow(semantics):
    torch.backends.cuda.matmul.allow_tf32 = False
    bf16, fp32 = _decoders()
    cfg = bf16.config
    codes = torch.randint(1, cfg.codebook_size, (12, 2, FRAMES), generator=torch.Generator().manual_seed(5))
    test = _stream(bf16, codes, semantics)
    reference = _stream(fp32, codes, semantics)
    errors = _window_errors(test, reference, cfg.samples_per_frame)
    print(f"{semantics}: bf16 relative error per window ending at {MARKS}: " + ", ".join(f"{e:.3e}" for e in errors))
    assert all(0 < e < ERROR_BOUND for e in errors), errors
    assert errors[-1] <= GROWTH_BOUND * errors[0], f"grew {errors[-1] / errors[0]:.2f}x from the first window"
