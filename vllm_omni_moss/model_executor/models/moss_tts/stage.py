# SPDX-License-Identifier: Apache-2.0
"""vLLM-Omni Stage 1 for MOSS-TTS: codes from Stage 0 in, waveform out.

Drop-in replacement for vLLM-Omni 0.30.0's ``MossTTSCodecDecoder`` (same constructor,
``forward`` contract, model-interface flags and architecture name; codec-facts §C).
The plugin (``vllm_omni_moss.plugin``) registers it on ``OmniModelRegistry``.
Differences in behaviour:

* Only the codec decoder is loaded (:func:`~.checkpoint.load_checkpoint`); the
  encoder is never built.
* Streaming goes through :class:`~.session.CodecStreamSession` with the default pool
  (V2 for v2 codecs: one null slot instead of one scratch slot per graph padding row).
* A meta-only terminal payload (zero frames) releases its stream's slot at once;
  late chunks of aborted streams are dropped instead of re-creating state.
* Codec attention is always this package's SDPA path; ``codec_attention_backend``
  hf overrides are accepted and ignored.

This is the only module of the package that imports vLLM / vLLM-Omni.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm_omni.model_executor.models.output_templates import OmniOutput

from .checkpoint import load_checkpoint
from .compile import DYNAMIC_ARG_DIMS, adapter_class_for
from .decoder import CodecDecoder
from .session import ChunkRequest, CodecStreamSession
from .state_pool import DecoderStatePool

__all__ = ["MossTTSCodecDecoder"]

logger = init_logger(__name__)

_DEFAULT_CODEC = "OpenMOSS-Team/MOSS-Audio-Tokenizer"
_DEFAULT_MAX_STEP_FRAMES = 100
_CHECKPOINT_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json"]


# --------------------------------------------------------------------------- compile


@functools.cache
def _vllm_adapter_class(base: type[nn.Module]) -> type[nn.Module]:
    """``support_torch_compile`` subclass of the core adapter class ``base``.

    Built once per adapter class: the decorator rewrites the class it is given (bases
    and ``__init__``), so it gets a subclass owned by this module, never the core class.
    """
    from vllm.compilation.decorators import support_torch_compile

    def __init__(self, *, pool: DecoderStatePool, vllm_config: VllmConfig, prefix: str = "") -> None:
        base.__init__(self, pool)

    name = f"Vllm{base.__name__}"
    cls = type(name, (base,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})
    return support_torch_compile(dynamic_arg_dims=DYNAMIC_ARG_DIMS)(cls)


def _vllm_compile_factory(vllm_config: VllmConfig):
    """``pool -> compiled step`` through vLLM's compiler, or None when it cannot be built.

    The session owns graph capture (it knows which slots padding rows may touch), so the
    adapter is built under a copy of the config with vLLM's own CUDA graphs off and an
    empty static forward context.
    """
    from vllm.config import CUDAGraphMode
    from vllm.config.vllm import set_current_vllm_config

    config = copy.copy(vllm_config)
    config.compilation_config = copy.copy(vllm_config.compilation_config)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    config.compilation_config.static_forward_context = {}

    def factory(pool: DecoderStatePool):
        try:
            with set_current_vllm_config(config):
                return _vllm_adapter_class(adapter_class_for(pool))(pool=pool, vllm_config=config)
        except Exception:
            logger.warning("vLLM compile adapter unavailable for the MOSS codec; plain CUDA graphs", exc_info=True)
            return None

    return factory


# --------------------------------------------------------------------------- helpers


def _meta_scalar(value: Any) -> Any:
    """First element of a list/tuple/tensor payload field (the connector wraps scalars)."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)[0].item() if value.numel() else None
    return value


def _resolve_codec_dir(path: str, download_dir: str | None) -> Path:
    """A local checkpoint directory for ``path`` (a directory or a Hugging Face repo id).

    Raises:
        FileNotFoundError: not a directory and it cannot be downloaded.
    """
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, allow_patterns=_CHECKPOINT_FILES, cache_dir=download_dir))
    except Exception as exc:
        raise FileNotFoundError(
            f"MOSS codec checkpoint {path!r} is not a directory and could not be fetched: {exc}"
        ) from exc


# --------------------------------------------------------------------------- stage


class MossTTSCodecDecoder(nn.Module):
    """Stage 1 of MOSS-TTS: ``(n_vq, T)`` codes per request -> float32 audio.

    Built by vLLM from ``vllm_config``: ``n_vq`` (fallback ``rvq``, default 16) and the
    codec checkpoint (``codec_model_name_or_path`` or ``audio_tokenizer_name_or_path``)
    from the stage hf_config; stream capacity = ``scheduler_config.max_num_seqs``;
    connector extras ``initial_codec_chunk_frames`` / ``codec_chunk_frames`` give the
    graph frame sizes and the longest step (``codec_chunk_frames`` or 100); graph batch
    buckets are ``compilation_config.cudagraph_capture_sizes`` up to ``max_num_seqs``,
    none under ``enforce_eager`` (which defaults to true when absent).
    """

    # Model-interface flags: identical to vLLM-Omni 0.30.0's class. vLLM reads them from
    # the class in its global registry (upstream's), the omni runner from this one.
    input_modalities = "audio"
    have_multimodal_outputs: bool = True
    has_preprocess: bool = False
    has_postprocess: bool = False
    enable_update_additional_information: bool = True
    requires_raw_input_tokens: bool = True
    requires_exact_input_shape: bool = True

    _OUTPUT_SAMPLE_RATE: int = 24_000

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.vllm_config = vllm_config
        model_config = vllm_config.model_config
        hf = model_config.hf_config
        self.n_vq = int(getattr(hf, "n_vq", getattr(hf, "rvq", 16)))
        self.codec_path = str(
            getattr(hf, "codec_model_name_or_path", getattr(hf, "audio_tokenizer_name_or_path", _DEFAULT_CODEC))
        )
        backend = getattr(hf, "codec_attention_backend", "sdpa")
        if backend not in ("sdpa", None):
            logger.info("codec_attention_backend=%r ignored: this codec stage always uses its own SDPA path", backend)
        scheduler = getattr(vllm_config, "scheduler_config", None)
        self.state_capacity = max(1, int(getattr(scheduler, "max_num_seqs", 1) or 1))
        initial = self._connector_int("initial_codec_chunk_frames")
        steady = self._connector_int("codec_chunk_frames")
        self.max_step_frames = steady or _DEFAULT_MAX_STEP_FRAMES
        self.graph_frames = sorted({t for t in (initial, steady) if t > 0})
        self.async_chunk = bool(getattr(model_config, "async_chunk", False))
        self.enforce_eager = bool(getattr(model_config, "enforce_eager", True))
        self.graph_batch_sizes = self._graph_batch_sizes()

        self._codec: CodecDecoder | None = None
        self._session: CodecStreamSession | None = None
        self._channels = 1
        self._sr_tensor = torch.tensor(self._OUTPUT_SAMPLE_RATE, dtype=torch.int32)

    # ------------------------------------------------------------------ config
    def _connector_int(self, name: str, default: int = 0) -> int:
        connector = getattr(self.vllm_config.model_config, "stage_connector_config", None)
        if isinstance(connector, dict):
            extra = connector.get("extra", connector)
        else:
            extra = getattr(connector, "extra", None)
        if isinstance(extra, dict) and name in extra:
            return int(extra[name])
        return default

    def _graph_batch_sizes(self) -> list[int]:
        if self.enforce_eager:
            return []
        sizes = getattr(getattr(self.vllm_config, "compilation_config", None), "cudagraph_capture_sizes", None) or []
        return sorted({int(b) for b in sizes if 0 < int(b) <= self.state_capacity})

    # ------------------------------------------------------------------ vLLM stubs
    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        """``(N,)`` ids -> ``(N, 1)`` float32 zeros: the codec has no token embedding."""
        return torch.zeros((input_ids.shape[0], 1), device=input_ids.device, dtype=torch.float32)

    def compute_logits(self, hidden_states: Any, sampling_metadata: Any = None) -> None:
        return None

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Drain ``weights`` (the talker's checkpoint; nothing here needs it) and load the
        codec decoder from its own checkpoint onto the stage device.

        Returns:
            Names of the loaded parameters as seen from this module (``_codec.*``).
        Raises:
            FileNotFoundError / CheckpointError / ValueError: from the codec checkpoint.
            ValueError: ``n_vq`` exceeds the codec's quantizers.
        """
        for _ in weights:
            pass
        device = torch.device(self.vllm_config.device_config.device)
        download_dir = getattr(getattr(self.vllm_config, "load_config", None), "download_dir", None)
        directory = _resolve_codec_dir(self.codec_path, download_dir)
        codec = load_checkpoint(directory, device=device)
        cfg = codec.config
        if self.n_vq > cfg.num_quantizers:
            raise ValueError(f"n_vq={self.n_vq} exceeds the codec's {cfg.num_quantizers} quantizers ({directory})")
        self._codec = codec
        self._channels = int(cfg.number_channels)
        self._sr_tensor = torch.tensor(int(cfg.sampling_rate), dtype=torch.int32)
        logger.info(
            "MOSS codec decoder loaded from %s on %s: %s, %d Hz, %d channel(s), n_vq=%d, streams=%d, graphs B=%s T=%s",
            directory,
            device,
            cfg.version,
            cfg.sampling_rate,
            cfg.number_channels,
            self.n_vq,
            self.state_capacity,
            self.graph_batch_sizes,
            self.graph_frames,
        )
        if self.async_chunk and self.graph_batch_sizes and self.graph_frames:
            self._ensure_session()  # compile and capture at load, not on the first request
        return {f"_codec.{name}" for name, _ in codec.named_parameters()}

    def _ensure_session(self) -> CodecStreamSession:
        if self._session is None:
            graphs = bool(self.graph_batch_sizes and self.graph_frames)
            self._session = CodecStreamSession(
                self._codec,
                self.state_capacity,
                graph_batch_sizes=self.graph_batch_sizes,
                graph_frame_sizes=self.graph_frames,
                max_step_frames=self.max_step_frames,
                n_vq=self.n_vq,
                compile=_vllm_compile_factory(self.vllm_config) if graphs else False,
            )
        return self._session

    # ------------------------------------------------------------------ decode
    def _empty_audio(self) -> torch.Tensor:
        return torch.zeros((self._channels, 0) if self._channels > 1 else (0,), dtype=torch.float32)

    def _output(self, audios: list[torch.Tensor]) -> OmniOutput:
        return OmniOutput(
            text_hidden_states=None,
            multimodal_outputs={"model_outputs": audios, "sr": [self._sr_tensor] * len(audios)},
        )

    def _shape_audio(self, wav: torch.Tensor) -> torch.Tensor:
        # Mono codecs return (samples,), multi-channel ones (channels, samples), as upstream.
        return wav.reshape(-1) if wav.shape[0] == 1 else wav

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        runtime_additional_information: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> OmniOutput:
        """Decode one batch of requests.

        Args:
            input_ids: every request's codebook-major flat codes ``[n_vq * T_i]``, concatenated.
            seq_token_counts: (kwarg, required when ``input_ids`` is non-empty) tokens per request.
            runtime_additional_information: per request dict; ``meta`` may hold
                ``stream_finished`` / ``finished``, ``left_context_size`` and ``req_id``.
        Returns:
            ``OmniOutput`` with ``multimodal_outputs["model_outputs"]``: per request float32
            CPU audio, ``(channels, samples)`` or ``(samples,)`` for mono; and ``["sr"]``:
            per request int32 scalar tensors.
        Raises:
            RuntimeError: ``seq_token_counts`` missing or longer than ``input_ids``;
                stream capacity exhausted (see :class:`CodecStreamSession`).
            TypeError / ValueError: malformed ``seq_token_counts``.
        """
        infos = list(runtime_additional_information or [{}])
        if self._codec is None:
            logger.warning("MossTTSCodecDecoder.forward before load_weights(); returning silence")
            return self._output([self._empty_audio() for _ in infos])
        if self.async_chunk and runtime_additional_information is None:
            return self._output([self._empty_audio() for _ in infos])  # profiling run
        flat = input_ids.reshape(-1) if input_ids is not None else torch.zeros(0, dtype=torch.long)
        counts = self._token_counts(kwargs.get("seq_token_counts"))
        if counts is None:
            if flat.numel() == 0:
                return self._output([self._empty_audio() for _ in infos])
            raise RuntimeError("MOSS codec needs seq_token_counts to split the concatenated codes per request")
        # Carries on with zero tokens too: a batch of meta-only terminal payloads must
        # still release its streams.
        if sum(counts) > flat.numel():
            raise RuntimeError(f"seq_token_counts {counts} sum to more than the {flat.numel()} input tokens")
        infos = (infos + [{}] * len(counts))[: len(counts)]
        audios = [self._empty_audio() for _ in counts]

        chunks: list[tuple[int, ChunkRequest]] = []
        start = 0
        for i, (n, info) in enumerate(zip(counts, infos)):
            seg = flat[start : start + n]
            start += n
            info = info if isinstance(info, dict) else {}
            meta = info.get("meta") or {}
            finished = bool(_meta_scalar(meta.get("stream_finished", meta.get("finished", False))))
            if seg.numel() % self.n_vq:
                logger.warning(
                    "MOSS codec: %d codes for request %d are not a multiple of n_vq=%d; skipped",
                    seg.numel(),
                    i,
                    self.n_vq,
                )
                continue
            codes = seg.reshape(self.n_vq, -1)
            if self.async_chunk:
                chunks.append((i, ChunkRequest(self._request_key(info, meta, i), codes, finished)))
            elif codes.shape[1]:
                audios[i] = self._decode_offline(codes, meta)

        if chunks:
            results = self._ensure_session().decode([req for _, req in chunks])
            for i, req in chunks:
                res = results[req.request_id]
                if res.frames:
                    audios[i] = self._shape_audio(res.audio)
        return self._output(audios)

    def _decode_offline(self, codes: torch.Tensor, meta: dict) -> torch.Tensor:
        """Whole-utterance decode (``async_chunk`` off), minus ``left_context_size`` frames."""
        K = self._codec.config.codebook_size
        codes = codes.to(self._codec.device, torch.long).clamp(0, K - 1)
        wav = self._codec.decode(codes[:, None])[0].float().cpu()
        left = int(_meta_scalar(meta.get("left_context_size", 0)) or 0)
        if left > 0:
            wav = wav[..., left * self._codec.config.samples_per_frame :]
        return self._shape_audio(wav)

    @staticmethod
    def _token_counts(value: Any) -> list[int] | None:
        if value is None:
            return None
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"seq_token_counts must be a list of per-request token counts, got {type(value).__name__}")
        counts = [int(v) for v in value]
        if any(c < 0 for c in counts):
            raise ValueError(f"seq_token_counts must be non-negative, got {counts}")
        return counts or None

    @staticmethod
    def _request_key(info: dict, meta: dict, index: int) -> str:
        for value in (meta.get("req_id"), info.get("request_id")):
            value = _meta_scalar(value)
            if value is not None:
                return str(value)
        return f"moss-codec-stream-{index}"

    # ------------------------------------------------------------------ lifecycle
    def on_requests_finished(self, finished_req_ids: Iterable[str]) -> None:
        """Called by the runner for every finished request (normal, abort, disconnect):
        releases and resets any codec slot those requests still hold."""
        if self._session is not None:
            self._session.on_requests_finished(finished_req_ids)
