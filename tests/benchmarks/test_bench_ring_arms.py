# SPDX-License-Identifier: Apache-2.0
"""CPU tests of bench_codec_step.py's ring-attention arms: ``v2-triton``, ``v2-exact`` and ``upstream-triton``
(skipped with a reason off CUDA), what an arm's step decodes, the ratios against the faster upstream arm, and the stand-in
``vllm.triton_utils`` that lets upstream's ``streaming_attention.py`` load without vLLM."""

from __future__ import annotations

import subprocess
import sys

import bench_modules
import pytest

from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
from vllm_omni_moss.model_executor.models.moss_tts.state import state_bytes_for
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_tensors
from vllm_omni_moss.model_executor.models.moss_tts.token_packing import pack_codes
from vllm_omni_moss.testing import upstream as oracle

pytestmark = [pytest.mark.cpu]

BENCH_DIR = bench_modules.BENCH_DIR


def _bench():
    return bench_modules.load("bench_codec_step")


def test_triton_arms_run_and_are_ranked_against_the_faster_upstream_arm():
    argv = "--preset tiny-v2 --batch 2 --frames 3 --modes eager --repeats 1 --steps-per-round 1 --warmup 0"
    arms = "v2,v2-triton,v2-exact,upstream,upstream-triton"
    result = _bench().main([*argv.split(), "--device", "cpu", "--arms", arms])
    upstream = "upstream" not in result["skipped"]
    assert result["skipped"]["upstream-triton"] == (
        "upstream's Triton attention runs on CUDA only (as its stage requires)"
        if upstream
        else result["skipped"]["upstream"]
    )
    assert result["arms"] == ["v2", "v2-triton", "v2-exact"] + (["upstream"] if upstream else [])
    cfg = preset_config("tiny-v2")
    for name in ("v2", "v2-triton", "v2-exact"):
        assert result["state_bytes"][name] == state_bytes_for(cfg, 3, "compact", element_size=4)
    entry = result["results"][0]["modes"]["eager"]
    assert set(entry["arms"]) == set(result["arms"]) and "errors" not in entry
    for name in ("v2", "v2-triton", "v2-exact"):
        ratio = entry["ratios"][f"{name}/upstream-best"]
        if upstream:
            expected = entry["arms"][name]["median_ms"] / entry["arms"]["upstream"]["median_ms"]
            assert ratio == round(expected, 4)
        else:
            assert ratio is None


@pytest.mark.skipif(not oracle.upstream_available(), reason="upstream 0.30.0 codec files not installed")
def test_upstream_triton_attention_loads_without_vllm():
    # A child process in which vLLM cannot be found: the stand-in module must carry the real triton.
    script = f"""
import importlib.util, sys, torch
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name == "vllm" else real(name, *a, **k)
sys.path.insert(0, {str(BENCH_DIR)!r})
spec = real("bench_codec_step")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
import triton
codec = bench.common.build_upstream_codec("tiny-v2", torch.device("cpu"), 0, 12)
count = bench._install_upstream_triton(codec)
loaded = sys.modules["_moss_upstream_streaming_attention"]
assert loaded.triton is triton, "the stand-in did not hand the file the real triton"
assert not [m for m in sys.modules if m.split(".")[0] == "vllm"], "a stand-in vllm module was left behind"
layers = [m for m in codec.model.decoder.modules() if hasattr(m, "_streaming_attention")]
assert all(m._streaming_attention is loaded.masked_attention for m in layers)
print(count, len(layers))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split()[-2:] == ["7", "7"]  # tiny-v2: 2 + 1 + 1 + 1 + 1 + 1 attention layers


@pytest.mark.parametrize(
    "name,category",
    [
        ("_ring_attention_kernel", "ring attention (ours)"),
        ("_ring_write_kernel", "ring write / commit (ours)"),
        ("_rope_kernel", "rope pass (ours)"),
        ("nvjet_tst_128x64_64x8_2x1_v_bz_coopA_TNN", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "sdpa / upstream attention"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>", "norm"),
        ("void at::native::index_elementwise_kernel<128, 4>", "gather / scatter / index"),
        ("void at::native::elementwise_kernel<128, 2>(int, direct_copy_kernel_cuda)", "copies / cat"),
        ("void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>", "gelu"),
        ("void at::native::vectorized_elementwise_kernel<4, AUnaryFunctor<MulFunctor>>", "elementwise"),
        ("void at::native::reduce_kernel<512, 1>", "reduce"),
        ("cudaMemsetAsync", "other"),
    ],
)
def test_profile_kernel_categories(name, category):
    assert _bench().kernel_category(name) == category


def test_triton_arm_decodes_the_packed_grid_as_its_pool_does():
    import torch

    from vllm_omni_moss.model_executor.models.moss_tts.state import StateSpec, build_pool

    bench = _bench()
    decoder = bench.common.random_decoder("tiny-v2", "cpu", seed=3)
    arm = bench._our_arm(decoder, "v2-triton", 2)
    reference = build_pool(decoder, StateSpec.from_options(decoder, "compact", attention_backend="triton"))
    reference.initialize(2, 2)
    try:
        pool = arm._close.__self__  # the arm closes its pool: pool.close bound to it
        assert pool.decoder is decoder and pool.spec.attention_backend == "triton"
        gen = torch.Generator().manual_seed(5)
        codes = torch.randint(0, decoder.config.codebook_size, (decoder.config.num_quantizers, 2, 3), generator=gen)
        rows = (torch.tensor([3, 2]), torch.tensor([0, 1]), torch.tensor([True, True]))
        # The arm packs the (n_vq, B, T) grid into B x T = 6 frames (5 real, 1 dummy) and returns packed audio.
        # The arm decodes the real frames bitwise as the same step on a pool of its own (a dummy's samples are
        # unspecified).
        spf = decoder.config.samples_per_frame
        got = arm.step(codes, *rows)
        want = decode_tensors(reference, pack_codes(codes, rows[0], 6), *rows, 3)
        assert got.shape == want.shape == (decoder.config.number_channels, 6 * spf)
        assert torch.equal(got[:, : 5 * spf], want[:, : 5 * spf]) and want[:, : 5 * spf].abs().max() > 0
    finally:
        arm.close()
        reference.close()
