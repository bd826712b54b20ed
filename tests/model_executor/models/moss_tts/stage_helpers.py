# SPDX-License-Identifier: Apache-2.0
"""Builders shared by the stage tests (need vllm + vllm-omni; CPU is enough).

* :func:`vllm_config` / :func:`build_stage`: a stub ``VllmConfig`` and a stage on a tiny
  official-format checkpoint.
* :func:`delay_info` / :func:`raw_info`: per-request runtime information as the stage
  receives it from vLLM-Omni 0.30.0's MOSS-TTS stage input processors
  (``stage_input_processors/moss_tts.py``) after the chunk transfer adapter merged the
  payload (``meta.finished`` is dropped on receipt, other ``meta`` fields persist).
* :func:`run` : one ``forward`` call from per-request code tensors.
* :func:`use_session_api`: runs the stage on main's pre-refactor session under the new
  session names until the refactored :class:`CodecStreamSession` lands (then a no-op).
"""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import torch

from vllm_omni_moss.model_executor.models.moss_tts import session as session_module


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

_NEW_PARAMETERS = {"graph_frame_sizes", "state_dtype"}


def new_session_api() -> bool:
    """Whether :class:`CodecStreamSession` has the refactored names the stage is written against."""
    params = set(inspect.signature(session_module.CodecStreamSession).parameters)
    fields = {f.name for f in dataclasses.fields(session_module.ChunkResult)}
    return _NEW_PARAMETERS <= params and "error" in fields and hasattr(session_module.CodecStreamSession, "stats")


@dataclasses.dataclass(frozen=True)
class _BridgeResult:
    audio: torch.Tensor
    sample_rate: int
    frames: int
    error: str | None = None


def _bridge_class():
    base = session_module.CodecStreamSession

    class BridgeSession(base):
        """Main's pre-refactor session under the new constructor names, result field and
        ``stats()``. Test-only; unused once the refactored session is in main."""

        def __init__(self, decoder, state_capacity, *, graph_frame_sizes=(), state_dtype=None, **kwargs):
            for name in ("max_waiting_streams", "max_waiting_frames"):
                kwargs.pop(name, None)
            super().__init__(decoder, state_capacity, graph_frames=graph_frame_sizes, **kwargs)
            self.state_dtype = state_dtype
            self._frames = 0

        def decode(self, requests):
            out = {k: _BridgeResult(r.audio, r.sample_rate, r.frames) for k, r in super().decode(requests).items()}
            self._frames += sum(r.frames for r in out.values())
            return out

        def stats(self):
            return {
                "steps_by_path": {"graph": 0, "eager": 0},
                "decoded_frames": self._frames,
                "padded_frames": 0,
                "waiting_streams": 0,
                "waiting_frames": 0,
                "admitted_from_queue": 0,
                "queue_wait_s_max": 0.0,
                "clamped_codes": self.clamped_codes,
                "request_errors": 0,
            }

    return BridgeSession


def use_session_api(monkeypatch) -> None:
    """Give the stage a session with the refactored names (the real one once main has it)."""
    if new_session_api():
        return
    from vllm_omni_moss.model_executor.models.moss_tts import stage as stage_module

    monkeypatch.setattr(stage_module, "CodecStreamSession", _bridge_class())


def error_result(result, message: str):
    """``result`` turned into a failed request's result (zero frames, ``error`` set)."""
    empty = result.audio[..., :0]
    if new_session_api():
        return session_module.ChunkResult(empty, result.sample_rate, 0, error=message)
    return _BridgeResult(empty, result.sample_rate, 0, message)
