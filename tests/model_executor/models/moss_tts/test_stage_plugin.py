# SPDX-License-Identifier: Apache-2.0
"""The vLLM-Omni plugin and the Stage-1 class (needs vllm + vllm-omni; CPU is enough).

* ``load_omni_general_plugins()`` makes ``OmniModelRegistry`` resolve ``MossTTSCodecDecoder``
  to our class, in this process and in a fresh one.
* Our class has upstream's model-interface flags (vLLM reads them from upstream's class),
  plus ``requires_request_ids``, the flag vLLM-Omni's generation runner reads.
* The stage builds from a stub ``vllm_config``, loads a tiny official-format checkpoint,
  and ``forward`` batches of several streams give each request its own solo decode.

Stream keys, split and malformed payloads: ``test_stage_streams.py``; precision and chunk
schedules: ``test_stage_config.py``.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from stage_helpers import raw_info, run, vllm_config

pytestmark = [pytest.mark.vllm, pytest.mark.cpu, pytest.mark.core_model]

ARCH = "MossTTSCodecDecoder"
OURS = "vllm_omni_moss.model_executor.models.moss_tts.stage"
UPSTREAM = "vllm_omni.model_executor.models.moss_tts.modeling_moss_tts_codec"
# Class attributes the omni runner and vLLM's interface checks read.
FLAGS = (
    "input_modalities",
    "have_multimodal_outputs",
    "has_preprocess",
    "has_postprocess",
    "enable_update_additional_information",
    "requires_raw_input_tokens",
    "requires_exact_input_shape",
)


def _model_config_for_resolve():
    return SimpleNamespace(model_impl="auto", convert_type="none", runner_type="generate")


def _resolve():
    from vllm_omni.model_executor.models.registry import OmniModelRegistry
    from vllm_omni.plugins import load_omni_general_plugins

    load_omni_general_plugins()
    cls, arch = OmniModelRegistry.resolve_model_cls([ARCH], _model_config_for_resolve())
    return cls, arch


def test_plugin_registers_our_stage_in_this_process():
    from vllm_omni_moss import plugin

    cls, arch = _resolve()
    assert arch == ARCH and cls.__module__ == OURS and cls.__name__ == ARCH
    plugin.register()  # idempotent
    plugin.register()
    assert _resolve()[0] is cls


def test_plugin_module_imports_no_torch():
    code = "import sys, vllm_omni_moss.plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_plugin_registers_our_stage_in_a_fresh_process():
    code = (
        "from types import SimpleNamespace as NS\n"
        "from vllm_omni.plugins import load_omni_general_plugins\n"
        "from vllm_omni.model_executor.models.registry import OmniModelRegistry\n"
        "load_omni_general_plugins()\n"
        f"cls, _ = OmniModelRegistry.resolve_model_cls([{ARCH!r}], "
        "NS(model_impl='auto', convert_type='none', runner_type='generate'))\n"
        "print('RESOLVED', cls.__module__, cls.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"RESOLVED {OURS} {ARCH}" in out.stdout


def test_model_interface_flags_equal_upstream():
    import dataclasses
    import importlib

    from vllm.model_executor.models.registry import _ModelInfo

    ours = importlib.import_module(OURS).MossTTSCodecDecoder
    upstream = importlib.import_module(UPSTREAM).MossTTSCodecDecoder
    for flag in FLAGS:
        assert getattr(ours, flag) == getattr(upstream, flag), flag
    # Every plain flag upstream's class declares itself, not only the ones listed above.
    declared = {k for k, v in vars(upstream).items() if isinstance(v, (bool, str)) and not k.startswith("__")}
    for flag in declared:
        assert getattr(ours, flag) == getattr(upstream, flag), flag
    a, b = _ModelInfo.from_model_cls(ours), _ModelInfo.from_model_cls(upstream)
    assert dataclasses.replace(a, architecture="") == dataclasses.replace(b, architecture="")
    # Ours adds one flag; upstream's class leaves it unset (streams keyed by batch position).
    assert ours.requires_request_ids is True and getattr(upstream, "requires_request_ids", False) is False


def test_generation_runner_passes_request_ids_for_our_flag():
    import inspect

    from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner

    source = inspect.getsource(GPUGenerationModelRunner.execute_model)
    assert 'getattr(self.model, "requires_request_ids", False)' in source
    assert 'model_kwargs["request_ids"] = list(req_ids)' in source


# ----------------------------------------------------------------------------- stage


def test_stage_loads_only_the_codec_decoder(tmp_path):
    from vllm_omni_moss.model_executor.models.moss_tts.checkpoint import save_random_checkpoint
    from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    codec_dir = save_random_checkpoint(preset_config("tiny-v2"), tmp_path / "codec", seed=3)
    model = MossTTSCodecDecoder(vllm_config=vllm_config(codec_dir, 11))
    talker_weights = iter([("talker.w", torch.zeros(2))])
    loaded = model.load_weights(talker_weights)
    assert next(talker_weights, None) is None  # drained
    assert loaded == {n for n, _ in model.named_parameters()} and all(n.startswith("_codec.") for n in loaded)
    assert not any("encoder" in n for n in loaded)


def test_stage_config_is_read_like_upstream(tmp_path):
    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    eager = MossTTSCodecDecoder(vllm_config=vllm_config(tmp_path, 12, max_num_seqs=8))
    assert eager.graph_frame_totals == [] and eager.graph_frame_sizes == [1, 3] and eager.max_step_frames == 3
    assert eager.state_capacity == 8 and eager.n_vq == 12 and eager.options.codec_path == str(tmp_path)
    assert eager.options.codec_dtype == "auto"
    graphs = MossTTSCodecDecoder(vllm_config=vllm_config(tmp_path, 12, max_num_seqs=8, enforce_eager=False))
    assert graphs.graph_frame_totals == list(range(1, 8 * 3 + 1))  # frame_totals(8 slots x 3 frames): all to 64
    ids = torch.arange(5)
    assert graphs.embed_input_ids(ids).shape == (5, 1) and graphs.compute_logits(torch.zeros(1)) is None
    # Before load_weights: silence, one entry per request.
    out = graphs(input_ids=ids, runtime_additional_information=[{}, {}], seq_token_counts=[2, 3])
    assert len(out.multimodal_outputs["model_outputs"]) == 2


def _payload(rid_field: str, rid: str, finished: bool) -> dict:
    if rid_field == "req_id":
        return {"meta": {"req_id": [rid], "stream_finished": torch.tensor([finished]), "left_context_size": 0}}
    return {"request_id": rid, "meta": {"stream_finished": finished}}


@pytest.mark.parametrize("runner_ids", [True, False], ids=["runner-ids", "payload-ids"])
def test_forward_batches_give_each_request_its_solo_decode(stage, runner_ids):
    dec, n_vq = stage._codec, stage.n_vq
    K, spf, ch = dec.config.codebook_size, dec.config.samples_per_frame, dec.config.number_channels
    gen = torch.Generator().manual_seed(0)
    total = {"a": 6, "b": 7, "c": 4, "d": 5}
    codes = {r: torch.randint(0, K, (n_vq, t), generator=gen) for r, t in total.items()}
    pos = dict.fromkeys(total, 0)
    fed: dict[str, list[int]] = {r: [] for r in total}
    audio: dict[str, list[torch.Tensor]] = {r: [] for r in total}

    def forward(batch):
        segs, infos = [], []
        for rid, T, finished, field in batch:
            segs.append(codes[rid][:, pos[rid] : pos[rid] + T])
            pos[rid] += T
            infos.append(_payload(field, rid, finished))
        # The runner's ids are vLLM's internal ones: the payload's id plus a random suffix.
        ids = [f"{rid}-0123abcd" for rid, *_ in batch] if runner_ids else None
        out = stage(
            input_ids=torch.cat([s.reshape(-1) for s in segs]),
            positions=None,
            runtime_additional_information=infos,
            seq_token_counts=[s.numel() for s in segs],
            **({"request_ids": ids} if runner_ids else {}),
        )
        wavs, srs = out.multimodal_outputs["model_outputs"], out.multimodal_outputs["sr"]
        assert len(wavs) == len(batch) == len(srs)
        for (rid, T, _, _), wav, sr in zip(batch, wavs, srs):
            assert sr.dtype == torch.int32 and int(sr) == dec.config.sampling_rate
            assert wav.dtype == torch.float32 and wav.device.type == "cpu"
            assert wav.shape == ((ch, T * spf) if ch > 1 else (T * spf,))
            if T:
                fed[rid].append(T)
                audio[rid].append(wav)
        return wavs

    forward([("a", 1, False, "req_id"), ("b", 1, False, "request_id")])
    forward([("a", 3, False, "req_id"), ("b", 3, False, "request_id"), ("c", 1, False, "req_id")])
    forward(
        [
            ("a", 2, True, "req_id"),
            ("b", 3, False, "request_id"),
            ("c", 3, False, "req_id"),
            ("d", 2, False, "request_id"),
        ]
    )
    stage.on_requests_finished({"b-0123abcd" if runner_ids else "b"})  # abort
    late = forward([("b", 0, False, "request_id"), ("c", 0, True, "req_id"), ("d", 3, True, "request_id")])
    assert late[0].numel() == 0
    session = stage._session
    assert session.free_slots == stage.state_capacity and not session.live_requests

    for rid in total:
        got = torch.cat(audio[rid], dim=-1)
        n = sum(fed[rid])
        ref = dec.decode(codes[rid][:, None, :n], chunk_frames=fed[rid])[0]
        ref = ref.reshape(-1) if ch == 1 else ref
        err = (got - ref).abs().max().item()
        assert err <= 1e-5 * ref.abs().max().item(), f"{rid}: {err}"
    assert fed["b"] == [1, 3, 3] and fed["c"] == [1, 3]


def test_forward_clamps_pad_codes_and_requires_token_counts(stage):
    dec, n_vq = stage._codec, stage.n_vq
    K = dec.config.codebook_size
    codes = torch.full((n_vq, 2), K)  # the talker's pad code
    info = [_payload("req_id", "p", True)]
    with pytest.raises(RuntimeError, match="seq_token_counts"):
        stage(input_ids=codes.reshape(-1), runtime_additional_information=info)
    with pytest.raises(RuntimeError, match=r"^2 request_ids for 1 requests \(seq_token_counts\)$"):
        run(stage, [codes], info, request_ids=["p", "q"])
    wav = stage(input_ids=codes.reshape(-1), runtime_additional_information=info, seq_token_counts=[codes.numel()])
    ref = dec.decode(codes.clamp(0, K - 1)[:, None], chunk_frames=[2])[0]
    got = wav.multimodal_outputs["model_outputs"][0]
    # The 2-frame chunk runs padded to the graph frame size 3: equal up to GEMM rounding.
    assert (got - ref.reshape(got.shape)).abs().max() <= 1e-5 * ref.abs().max()
    assert stage._session.clamped_codes == codes.numel()


def test_meta_only_terminal_batch_releases_its_stream(stage):
    codes = torch.zeros(stage.n_vq, 2, dtype=torch.long)
    run(stage, [codes], [raw_info("m", 2, stage.n_vq)], request_ids=["m"])
    assert "m" in stage._session.live_requests
    out = run(stage, [torch.zeros(0)], [raw_info("m", 0, stage.n_vq, finished=True)], request_ids=["m"])
    assert out[0].numel() == 0
    assert "m" not in stage._session.live_requests and stage._session.free_slots == stage.state_capacity
