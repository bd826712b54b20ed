# SPDX-License-Identifier: Apache-2.0
"""Builders shared by the stage tests (need vllm + vllm-omni; CPU is enough).

* :func:`vllm_config` / :func:`build_stage`: a stub ``VllmConfig`` and a stage on a tiny
  official-format checkpoint.
* :func:`delay_info` / :func:`raw_info`: per-request runtime information as the stage
  receives it from vLLM-Omni 0.30.0's MOSS-TTS stage input processors
  (``stage_input_processors/moss_tts.py``) after the chunk transfer adapter merged the
  payload (``meta.finished`` is dropped on receipt, other ``meta`` fields persist).
* :func:`run` : one ``forward`` call from per-request code tensors.
* :func:`error_result`: a session result turned into a refused request's result.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_omni_moss.model_executor.models.moss_tts.serving import ChunkResult


def vllm_config(
    codec_dir,
    n_vq: int,
    *,
    max_num_seqs: int = 4,
    enforce_eager: bool = True,
    async_chunk: bool = True,
    extra: dict | None = None,
    device: str = "cpu",
    **hf_fields,
):
    """A stub ``VllmConfig`` with the fields the stage reads."""
    if extra is None:
        extra = {"initial_codec_chunk_frames": 1, "codec_chunk_frames": 3}
    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(n_vq=n_vq, codec_model_name_or_path=str(codec_dir), **hf_fields),
            async_chunk=async_chunk,
            enforce_eager=enforce_eager,
            stage_connector_config={"extra": extra},
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=[1, 2, 4, 8, 16]),
        device_config=SimpleNamespace(device=torch.device(device)),
        load_config=SimpleNamespace(download_dir=None),
    )


def build_stage(tmp_path, preset: str = "tiny-v2", *, seed: int = 3, n_vq: int | None = None, **config):
    """A loaded stage on a random ``preset`` checkpoint; ``n_vq`` defaults to one codebook
    fewer than the codec has (like MOSS-TTS Local)."""
    from vllm_omni_moss.model_executor.models.moss_tts.checkpoint import save_random_checkpoint
    from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    cfg = preset_config(preset)
    codec_dir = save_random_checkpoint(cfg, tmp_path / f"codec-{preset}-{seed}", seed=seed)
    n_vq = max(1, cfg.num_quantizers - 1) if n_vq is None else n_vq
    model = MossTTSCodecDecoder(vllm_config=vllm_config(codec_dir, n_vq, **config))
    model.load_weights(iter([("talker.w", torch.zeros(2))]))
    return model


def delay_info() -> dict:
    """The delay processor's payload (MOSS-TTS, TTSD, VoiceGenerator, SoundEffect): no id,
    and its ``finished`` flag is dropped by the connector on receipt."""
    return {"meta": {"left_context_size": 0, "is_segment_finished": torch.tensor(False)}}


def raw_info(
    rid: str,
    frames: int,
    n_vq: int,
    *,
    finished: bool = False,
    segment_end: bool = False,
    previous: dict | None = None,
) -> dict:
    """The raw processor's payload (Local, Realtime) for a ``frames``-frame chunk, merged
    into ``previous`` like the connector does. ``frames == 0`` is its terminal placeholder,
    which declares ``codec_chunk_frames=0`` and omits ``code_flat_numel``."""
    meta = {
        "req_id": [rid],
        "left_context_size": 0,
        "codec_chunk_frames": frames,
        "codec_left_context_frames": 0,
        "stream_finished": torch.tensor(finished),
        "is_segment_finished": torch.tensor(segment_end),
    }
    if frames:
        meta["code_flat_numel"] = frames * n_vq
    merged = dict((previous or {}).get("meta", {}))
    merged.update(meta)
    return {"meta": merged, "request_id": rid}


def run(stage, segments: list[torch.Tensor], infos: list[dict], request_ids: list[str] | None = None):
    """One ``forward`` over per-request codes (any shape; flattened codebook-major)."""
    flat = [s.reshape(-1).long() for s in segments]
    kwargs = {"seq_token_counts": [f.numel() for f in flat]}
    if request_ids is not None:
        kwargs["request_ids"] = list(request_ids)
    ids = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.long)
    out = stage(input_ids=ids, positions=None, runtime_additional_information=infos, **kwargs)
    return out.multimodal_outputs["model_outputs"]


def fresh_decode(stage, codes: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """``codes (n_vq, T)`` decoded as a new stream in ``chunks``, shaped like the stage's audio."""
    ref = stage._codec.decode(codes[:, None].clamp(0, stage._codec.config.codebook_size - 1), chunk_frames=chunks)[0]
    return ref.reshape(-1) if ref.shape[0] == 1 else ref


# ----------------------------------------------------------------------------- session bridge


def error_result(result, message: str):
    """``result`` turned into a failed request's result (zero frames, ``error`` set)."""
    return ChunkResult(result.audio[..., :0], result.sample_rate, 0, error=message)
