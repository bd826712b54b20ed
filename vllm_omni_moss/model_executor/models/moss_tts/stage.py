# SPDX-License-Identifier: Apache-2.0
"""vLLM-Omni Stage 1 for MOSS-TTS: codes from Stage 0 in, waveform out.

Drop-in replacement for vLLM-Omni 0.30.0's ``MossTTSCodecDecoder``
(``vllm_omni/model_executor/models/moss_tts/modeling_moss_tts_codec.py``): same
constructor, ``forward`` contract and architecture name, upstream's model-interface
flags plus ``requires_request_ids``. It is registered on ``OmniModelRegistry`` under
``MossTTSCodecDecoder`` (by this package's plugin entry point, or by the registry entry of the fork form). Differences in behaviour (details in ``docs/serving_stage.md``):

* Only the codec decoder is loaded (:func:`~.checkpoint.load_checkpoint`); the
  encoder is never built.
* Streams are keyed by the runner's request ids (the strings ``on_requests_finished``
  receives), never by batch position; the payload's own id is a logged cross-check.
* A request fails alone: a malformed payload, a missing stream id or a session error
  is logged once for that request, which gets empty audio; the others decode. A
  terminal payload always ends its stream and frees its slot, even when malformed.
* A chunk the engine's token budget split across steps is buffered until the size its
  payload declares is complete.
* Precision per codec as upstream (v1 in float32, v2 in bfloat16 on CUDA), overridable
  with ``hf_overrides: {codec_dtype: ...}``.
* Codec attention: ``hf_overrides: {codec_attention_backend: sdpa | triton}`` (upstream's
  field; ``triton`` reads the rings in place, ``ops/ring_attention.py``) and
  ``codec_ring_semantics: upstream | exact`` pick the pool's attention backend (v1 codecs
  keep ``sdpa``, as upstream) and ring semantics; unset, the pool's defaults.

This is the only module of the package that imports vLLM / vLLM-Omni.
"""

from __future__ import annotations

import copy
import functools
import itertools
import numbers
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm_omni.model_executor.models.output_templates import OmniOutput

from .attention import ATTENTION_BACKENDS
from .checkpoint import load_checkpoint
from .compile import DYNAMIC_ARG_DIMS, adapter_class_for
from .config import load_config
from .decoder import CodecDecoder
from .session import ChunkRequest, ChunkResult, CodecStreamSession
from .state_pool import POOL_KINDS, DecoderStatePool
from .step_metadata import RING_SEMANTICS

__all__ = ["CODEC_DTYPES", "MossTTSCodecDecoder", "codec_dtype_for", "connector_chunk_frames"]

logger = init_logger(__name__)

_DEFAULT_CODEC = "OpenMOSS-Team/MOSS-Audio-Tokenizer"
_DEFAULT_MAX_STEP_FRAMES = 100
_CHECKPOINT_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json"]

#: ``hf_overrides`` ``codec_dtype`` values: ``"auto"`` is upstream's policy (:func:`codec_dtype_for`).
CODEC_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32}


# --------------------------------------------------------------------------- config


def codec_dtype_for(choice: str, version: str, device: torch.device | str) -> torch.dtype:
    """Dtype of the codec's weights, decode table and state rings.

    Args:
        choice: ``"auto"``, ``"bfloat16"`` or ``"float32"`` (``hf_overrides`` ``codec_dtype``).
        version: codec version, ``"v1"`` or ``"v2"`` (``CodecConfig.version``).
        device: the stage device.
    Returns:
        For ``"auto"``, upstream's policy (``load_weights`` of vLLM-Omni 0.30.0's
        ``modeling_moss_tts_codec.py``): v1 codecs entirely float32 (their quantizer emits
        float32); v2 codecs bfloat16 on CUDA (decoder and decode table), float32 elsewhere.
        Otherwise the named dtype.
    Raises:
        ValueError: ``choice`` is not one of :data:`CODEC_DTYPES` (the message lists them).
    """
    dtype = CODEC_DTYPES[_codec_dtype_choice(choice)]
    if dtype is not None:
        return dtype
    return torch.bfloat16 if version == "v2" and torch.device(device).type == "cuda" else torch.float32


def _codec_dtype_choice(choice: Any) -> str:
    """``choice`` if it is a string naming a :data:`CODEC_DTYPES` entry; ValueError listing them otherwise."""
    if not isinstance(choice, str) or choice not in CODEC_DTYPES:
        raise ValueError(f"codec_dtype must be one of {', '.join(map(repr, CODEC_DTYPES))}; got {choice!r}")
    return choice


def _codebook_count(value: Any) -> int:
    """``value`` (hf_config ``n_vq``, else ``rvq``) if it is an integer >= 1; ValueError otherwise.

    Floats are refused, not truncated, and so are bools.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"n_vq must be an integer >= 1 (codebooks per frame); got {value!r}")
    return int(value)


def _hf_choice(hf: Any, name: str, choices: tuple[str, ...]) -> str | None:
    """The hf_config field ``name`` if set (None when absent or null); ValueError listing ``choices`` otherwise."""
    value = getattr(hf, name, None)
    if value is not None and value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def _hf_positive(hf: Any, name: str, unit: str) -> float | None:
    """The hf_config field ``name`` as a finite number > 0 of ``unit`` (None when absent or null)."""
    value = getattr(hf, name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite number of {unit} > 0, got {value!r}")
    return float(value)


def _state_budget_bytes(hf: Any) -> int | None:
    """``codec_state_budget_gib`` of the hf_config in bytes (None when absent or null)."""
    gib = _hf_positive(hf, "codec_state_budget_gib", "GiB")
    if gib is None:
        return None
    budget = int(gib * 2**30)
    if budget < 1:
        raise ValueError(f"codec_state_budget_gib {hf.codec_state_budget_gib!r} is less than one byte")
    return budget


def _positive_frames(name: str, value: Any) -> list[int]:
    """``value`` (an int, a list of ints or a comma-separated string) as a list of frame counts >= 0."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    try:
        frames = [int(str(v).strip()) for v in items]
    except ValueError:
        raise ValueError(f"connector extra {name} must hold integer frame counts, got {value!r}") from None
    if any(f < 0 for f in frames):
        raise ValueError(f"connector extra {name} must hold frame counts >= 0, got {value!r}")
    return frames


def connector_chunk_frames(extra: dict[str, Any]) -> list[int]:
    """Every chunk size (frames) Stage 0 may send under the connector's chunk schedule.

    Reads the connector ``extra`` fields vLLM-Omni 0.30.0 uses for codec chunking:
    ``initial_codec_chunk_frames`` (first chunk), ``codec_chunk_frames`` (steady chunks)
    and ``codec_chunk_ramp`` (a list, or a comma-separated string, of per-chunk sizes for
    the first chunks, e.g. ``[1, 4, 15]``; see ``stage_input_processors/chunk_size_utils.py``).
    The union is returned so that a ramp an upstream processor ignores still leaves
    graphs for the sizes it does send. A terminal chunk may be shorter than any of them.

    Returns:
        Sorted distinct sizes ``> 0``; empty when the connector names none.
    Raises:
        ValueError: a field holds a non-integer or negative frame count.
    """
    sizes: set[int] = set()
    for name in ("initial_codec_chunk_frames", "codec_chunk_frames", "codec_chunk_ramp"):
        sizes.update(_positive_frames(name, extra.get(name)))
    return sorted(s for s in sizes if s > 0)


# --------------------------------------------------------------------------- compile


@functools.cache
def _vllm_adapter_class(base: type[nn.Module]) -> type[nn.Module]:
    """``support_torch_compile`` subclass of the core adapter class ``base``.

    Built once per base class (:func:`~.compile.adapter_class_for` picks it for a pool):
    the decorator rewrites the class it is given (bases and ``__init__``), so it gets a
    subclass owned by this module, never the core class.
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


# --------------------------------------------------------------------------- payloads


def _meta_scalar(value: Any) -> Any:
    """First element of a list/tuple/tensor payload field (the connector wraps scalars)."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)[0].item() if value.numel() else None
    return value


class _PayloadError(ValueError):
    """A malformed payload field; its message is that request's logged error."""


def _meta_of(info: dict) -> dict:
    """The payload's ``meta`` dict (``{}`` when absent or null).

    Raises:
        _PayloadError: ``meta`` is something other than a dict.
    """
    meta = info.get("meta")
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise _PayloadError(f"payload meta must be a dict, got {type(meta).__name__}")
    return meta


def _meta_count(meta: dict, name: str) -> int | None:
    """``meta[name]`` as a count >= 0 (frames or codes); None when absent or empty.

    Integers and integral finite floats (a scalar, or the first element of a
    list / tuple / tensor) are accepted.

    Raises:
        _PayloadError: anything else (a string, NaN, infinity, a fraction, a negative
            number); the message names the field and the value.
    """
    raw = meta.get(name)
    value = _meta_scalar(raw)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():  # False for NaN and infinities
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise _PayloadError(f"payload meta.{name} must be an integer >= 0, got {raw!r}")
    return int(value)


def _meta_flag(meta: dict, *names: str) -> bool:
    """The first of ``names`` present in ``meta``, as a bool (False when none is)."""
    for name in names:
        if name in meta:
            return bool(_meta_scalar(meta[name]))
    return False


def _placeholder(meta: dict) -> bool:
    # The connector turns a segment end without new codes into one `[0]` token
    # (distributed/omni_connectors/transfer_adapter/chunk_transfer_adapter.py).
    return _meta_flag(meta, "is_segment_finished")


def _payload_id(info: dict, meta: dict) -> str | None:
    """The stream id a payload names itself (``meta.req_id``, else ``request_id``), or None."""
    for value in (meta.get("req_id"), info.get("request_id")):
        value = _meta_scalar(value)
        if value is not None:
            return str(value)
    return None


def _same_request(runner_id: str, payload_id: str) -> bool:
    # vLLM's internal id is the external one plus "-" and 8 random characters
    # (vllm/v1/engine/input_processor.py, assign_request_id); payloads carry the external one.
    return runner_id == payload_id or runner_id.startswith(payload_id + "-")


@dataclass
class _StreamChunk:
    """One batch row of an ``async_chunk`` step, ready for the session (or not)."""

    index: int  # batch position
    key: str | None  # stream key; None when the row has no usable id
    codes: torch.Tensor | None  # (n_vq, T); None: nothing to hand to the session this step
    finished: bool
    error: str | None = None


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

    Built by vLLM from ``vllm_config``: ``n_vq`` (fallback ``rvq``, default 16), the codec
    checkpoint (``codec_model_name_or_path`` or ``audio_tokenizer_name_or_path``) and
    ``codec_dtype`` (:data:`CODEC_DTYPES`, default ``"auto"``), ``codec_attention_backend``
    (``attention.ATTENTION_BACKENDS``) and ``codec_ring_semantics``
    (``step_metadata.RING_SEMANTICS``; both default to the pool's), ``codec_pool_kind``
    (``state_pool.POOL_KINDS``; default compact for v2 codecs, legacy for v1) and
    ``codec_state_budget_gib`` (GiB of ring pages; picks the paged pool) and
    ``codec_expected_stream_seconds`` (split that budget by the groups' fill over a stream this long)
    from the stage hf_config;
    stream capacity = ``scheduler_config.max_num_seqs``; the connector's chunk schedule
    (:func:`connector_chunk_frames`) gives the graph frame sizes and the longest step (its
    largest size, or 100); graph batch buckets are ``compilation_config.cudagraph_capture_sizes``
    up to ``max_num_seqs``, none under ``enforce_eager`` (which defaults to true when absent).

    Raises:
        ValueError: bad ``n_vq`` (not an integer >= 1), ``codec_dtype`` (not one of
            :data:`CODEC_DTYPES`; null means ``"auto"``), ``codec_attention_backend``,
            ``codec_ring_semantics``, ``codec_pool_kind``, ``codec_state_budget_gib`` (not a number
            > 0, or given with a pool kind other than ``"paged"``) or connector chunk sizes. A budget
            too small for one stream fails when the decoder state is built, naming the minimum.
    """

    # Model-interface flags: upstream's, read by vLLM from the class in its global registry
    # (upstream's) and by the omni runner from this one; plus requires_request_ids, which
    # makes vLLM-Omni's generation runner pass `request_ids` to forward
    # (vllm_omni/worker/gpu_generation_model_runner.py).
    input_modalities = "audio"
    have_multimodal_outputs: bool = True
    has_preprocess: bool = False
    has_postprocess: bool = False
    enable_update_additional_information: bool = True
    requires_raw_input_tokens: bool = True
    requires_exact_input_shape: bool = True
    requires_request_ids: bool = True

    _OUTPUT_SAMPLE_RATE: int = 24_000
    #: Seconds between two session statistics lines in the log.
    STATS_INTERVAL_S: float = 30.0

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.vllm_config = vllm_config
        model_config = vllm_config.model_config
        hf = model_config.hf_config
        self.n_vq = _codebook_count(getattr(hf, "n_vq", getattr(hf, "rvq", 16)))
        self.codec_path = str(
            getattr(hf, "codec_model_name_or_path", getattr(hf, "audio_tokenizer_name_or_path", _DEFAULT_CODEC))
        )
        dtype_choice = getattr(hf, "codec_dtype", None)
        self.codec_dtype = "auto" if dtype_choice is None else _codec_dtype_choice(dtype_choice)
        self.codec_attention_backend = _hf_choice(hf, "codec_attention_backend", ATTENTION_BACKENDS)
        self.codec_ring_semantics = _hf_choice(hf, "codec_ring_semantics", RING_SEMANTICS)
        self.codec_pool_kind = _hf_choice(hf, "codec_pool_kind", POOL_KINDS)
        self.codec_state_budget_bytes = _state_budget_bytes(hf)
        self.codec_expected_stream_seconds = _hf_positive(hf, "codec_expected_stream_seconds", "seconds")
        if self.codec_expected_stream_seconds is not None and self.codec_state_budget_bytes is None:
            raise ValueError("codec_expected_stream_seconds splits a state budget: set codec_state_budget_gib too")
        if self.codec_state_budget_bytes is not None and self.codec_pool_kind not in (None, "paged"):
            raise ValueError(
                f"codec_state_budget_gib needs the paged pool; codec_pool_kind is {self.codec_pool_kind!r}"
            )
        scheduler = getattr(vllm_config, "scheduler_config", None)
        self.state_capacity = max(1, int(getattr(scheduler, "max_num_seqs", 1) or 1))
        # Tokens one engine step may schedule (vLLM's Scheduler: max_num_scheduled_tokens, else
        # max_num_batched_tokens); None without a scheduler config (direct calls).
        budget = getattr(scheduler, "max_num_scheduled_tokens", None) or getattr(
            scheduler, "max_num_batched_tokens", None
        )
        self.token_budget = int(budget) if budget else None
        self.graph_frame_sizes = connector_chunk_frames(self._connector_extra())
        self.max_step_frames = max(self.graph_frame_sizes, default=_DEFAULT_MAX_STEP_FRAMES)
        self.async_chunk = bool(getattr(model_config, "async_chunk", False))
        self.enforce_eager = bool(getattr(model_config, "enforce_eager", True))
        self.graph_batch_sizes = self._graph_batch_sizes()
        self.stats_interval_s = self.STATS_INTERVAL_S

        self._codec: CodecDecoder | None = None
        self._dtype = torch.float32
        self._session: CodecStreamSession | None = None
        self._channels = 1
        self._sr_tensor = torch.tensor(self._OUTPUT_SAMPLE_RATE, dtype=torch.int32)
        self._partial: dict[str, torch.Tensor] = {}  # stream key -> buffered prefix of a split chunk
        self._held: dict[str, list[torch.Tensor]] = {}  # stream key -> audio decoded while it was not batched
        self._held_frames: dict[str, int] = {}  # stream key -> frames of that audio
        self._reported: set[str] = set()  # stream keys whose error was logged
        self._mismatch_warned: set[str] = set()  # stream keys whose payload names another request
        self._stats_logged_at = time.monotonic()

    # ------------------------------------------------------------------ config
    def _connector_extra(self) -> dict[str, Any]:
        connector = getattr(self.vllm_config.model_config, "stage_connector_config", None)
        if isinstance(connector, dict):
            extra = connector.get("extra", connector)
        else:
            extra = getattr(connector, "extra", None)
        return extra if isinstance(extra, dict) else {}

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
        codec decoder from its own checkpoint onto the stage device, in the dtype of
        :func:`codec_dtype_for`.

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
        codec = self._load_codec(directory, device)
        cfg = codec.config
        if self.n_vq > cfg.num_quantizers:
            raise ValueError(f"n_vq={self.n_vq} exceeds the codec's {cfg.num_quantizers} quantizers ({directory})")
        self._codec = codec
        self._channels = int(cfg.number_channels)
        self._sr_tensor = torch.tensor(int(cfg.sampling_rate), dtype=torch.int32)
        logger.info(
            "MOSS codec decoder loaded from %s on %s: %s, %d Hz, %d channel(s), n_vq=%d, precision %s "
            "(weights, decode table and state rings; codec_dtype=%s), streams=%d, graphs B=%s T=%s",
            directory,
            device,
            cfg.version,
            cfg.sampling_rate,
            cfg.number_channels,
            self.n_vq,
            str(self._dtype).removeprefix("torch."),
            self.codec_dtype,
            self.state_capacity,
            self.graph_batch_sizes,
            self.graph_frame_sizes,
        )
        if self.async_chunk and self.graph_batch_sizes and self.graph_frame_sizes:
            self._ensure_session()  # compile and capture at load, not on the first request
        elif self.codec_state_budget_bytes is not None:
            self._ensure_session()  # a budget too small for one stream fails at load, not on every batch
        return {f"_codec.{name}" for name, _ in codec.named_parameters()}

    def _load_codec(self, directory: Path, device: torch.device) -> CodecDecoder:
        """The decoder on ``device`` in the precision :func:`codec_dtype_for` picks (kept in ``_dtype``)."""
        self._dtype = codec_dtype_for(self.codec_dtype, load_config(directory).version, device)
        # load_checkpoint casts to bfloat16 on CUDA: a float32 codec is read on the CPU
        # and moved, so no precision is lost on the way.
        staging = torch.device("cpu") if self._dtype == torch.float32 else device
        codec = load_checkpoint(directory, device=staging)
        return codec.to(device=device, dtype=self._dtype).eval()

    def _expected_stream_frames(self) -> int | None:
        # codec_expected_stream_seconds in code frames of this codec (12.5 frames/s for both MOSS codecs).
        seconds = self.codec_expected_stream_seconds
        return None if seconds is None else max(1, round(seconds * self._codec.config.frame_rate))

    def _ensure_session(self) -> CodecStreamSession:
        if self._session is None:
            graphs = bool(self.graph_batch_sizes and self.graph_frame_sizes)
            backend = self.codec_attention_backend
            if backend == "triton" and self._codec.config.version != "v2":
                # Upstream's triton attention replaces only v2 attention modules; v1 codecs keep SDPA there too.
                logger.info("codec_attention_backend='triton' applies to v2 codecs; this v1 codec uses 'sdpa'")
                backend = "sdpa"
            self._session = CodecStreamSession(
                self._codec,
                self.state_capacity,
                graph_batch_sizes=self.graph_batch_sizes,
                graph_frame_sizes=self.graph_frame_sizes,
                max_step_frames=self.max_step_frames,
                n_vq=self.n_vq,
                compile=_vllm_compile_factory(self.vllm_config) if graphs else False,
                state_dtype=self._dtype,
                attention_backend=backend,
                ring_semantics=self.codec_ring_semantics,
                pool_kind=self.codec_pool_kind,
                state_budget_bytes=self.codec_state_budget_bytes,
                expected_stream_frames=self._expected_stream_frames(),
            )
        return self._session

    # ------------------------------------------------------------------ output
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

    # ------------------------------------------------------------------ decode
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
            request_ids: (kwarg) the runner's request id per request: the stream keys.
            runtime_additional_information: per request dict; ``meta`` may hold
                ``stream_finished`` / ``finished``, ``req_id``, ``codec_chunk_frames`` /
                ``code_flat_numel`` (the chunk's declared size), ``is_segment_finished``
                and ``left_context_size`` (see ``docs/serving_stage.md``).
        Returns:
            ``OmniOutput`` with ``multimodal_outputs["model_outputs"]``: per request float32
            CPU audio, ``(channels, samples)`` or ``(samples,)`` for mono, empty for a
            request that failed (logged) or has nothing to decode yet; and ``["sr"]``:
            per request int32 scalar tensors.
        Raises:
            RuntimeError: ``seq_token_counts`` missing or longer than ``input_ids``, or
                ``request_ids`` of another length than ``seq_token_counts``.
            TypeError / ValueError: malformed ``seq_token_counts``.
        """
        infos = list(runtime_additional_information or [{}])
        if self._codec is None:
            logger.warning("MossTTSCodecDecoder.forward before load_weights(); returning silence")
            return self._output([self._empty_audio() for _ in infos])
        if self.async_chunk and runtime_additional_information is None:
            return self._output([self._empty_audio() for _ in infos])  # profiling run
        batch = self._split_batch(input_ids, kwargs.get("seq_token_counts"), infos)
        if batch is None:
            return self._output([self._empty_audio() for _ in infos])
        if not self.async_chunk:
            return self._output([self._decode_offline(i, seg, info) for i, (seg, info) in enumerate(batch)])
        audios = self._decode_streams(batch, kwargs.get("request_ids"))
        self._maybe_log_stats()
        return self._output(audios)

    def _split_batch(
        self, input_ids: torch.Tensor | None, counts_value: Any, infos: list[Any]
    ) -> list[tuple[torch.Tensor, dict]] | None:
        """Per request ``(flat codes, info dict)``; None when there is nothing to split."""
        flat = input_ids.reshape(-1) if input_ids is not None else torch.zeros(0, dtype=torch.long)
        counts = self._token_counts(counts_value)
        if counts is None:
            if flat.numel() == 0:
                return None
            raise RuntimeError("MOSS codec needs seq_token_counts to split the concatenated codes per request")
        # Carries on with zero tokens too: a batch of meta-only terminal payloads must
        # still release its streams.
        if sum(counts) > flat.numel():
            raise RuntimeError(f"seq_token_counts {counts} sum to more than the {flat.numel()} input tokens")
        infos = (infos + [{}] * len(counts))[: len(counts)]
        bounds = list(itertools.accumulate(counts, initial=0))
        return [(flat[a:b], info if isinstance(info, dict) else {}) for a, b, info in zip(bounds, bounds[1:], infos)]

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

    def _decode_offline(self, index: int, seg: torch.Tensor, info: dict) -> torch.Tensor:
        """Whole-utterance decode (``async_chunk`` off), minus ``left_context_size`` frames.

        A malformed ``meta`` or ``left_context_size`` fails that request alone (logged, empty audio).
        """
        try:
            left = _meta_count(_meta_of(info), "left_context_size") or 0
        except _PayloadError as exc:
            self._report(None, index, str(exc))
            return self._empty_audio()
        if seg.numel() % self.n_vq:
            self._report(None, index, f"{seg.numel()} codes are not a multiple of n_vq={self.n_vq}")
            return self._empty_audio()
        if seg.numel() == 0:
            return self._empty_audio()
        K = self._codec.config.codebook_size
        codes = seg.reshape(self.n_vq, -1).to(self._codec.device, torch.long).clamp(0, K - 1)
        wav = self._codec.decode(codes[:, None])[0].float().cpu()
        if left > 0:
            wav = wav[..., left * self._codec.config.samples_per_frame :]
        return self._shape_audio(wav)

    # ------------------------------------------------------------------ streams
    def _decode_streams(self, batch: list[tuple[torch.Tensor, dict]], runner_ids: Any) -> list[torch.Tensor]:
        """One ``async_chunk`` step: every row through the session, each failing alone."""
        keys = self._stream_keys(batch, runner_ids)
        # vLLM-Omni's generation scheduler gives a request min(its tokens, the budget left)
        # (core/sched/omni_generation_scheduler.py): a chunk can only be split in a step that
        # used the whole token budget.
        tokens = sum(seg.numel() for seg, _ in batch)
        may_split = self.token_budget is not None and tokens >= self.token_budget
        chunks = [
            self._stream_chunk(i, seg, info, key, may_split) for i, ((seg, info), key) in enumerate(zip(batch, keys))
        ]
        for c in chunks:
            if c.error is not None:
                self._report(c.key, c.index, c.error)
        requests = [ChunkRequest(c.key, c.codes, c.finished) for c in chunks if c.codes is not None]
        results = self._ensure_session().decode(requests) if requests else {}
        audios = [self._empty_audio() for _ in batch]
        for c in chunks:
            result = results.pop(c.key, None) if c.key is not None else None
            if result is not None:
                audios[c.index] = self._deliver(c, result)
        for key, result in results.items():  # streams decoded from the admission queue, not in this batch
            if result.error is not None:
                self._report(key, None, result.error)
            elif result.frames:
                self._held.setdefault(key, []).append(result.audio)
                self._held_frames[key] = self._held_frames.get(key, 0) + result.frames
        for c in chunks:
            if c.finished and c.codes is not None:
                self._reported.discard(c.key)  # the stream ended: the id may start a new one
        return audios

    def _stream_keys(self, batch: list[tuple[torch.Tensor, dict]], runner_ids: Any) -> list[str | tuple[str]]:
        """Per row the stream key, or a 1-tuple holding the error that row gets instead.

        Keys are the runner's request ids; without them (an older runner, a direct call)
        the payload's own id; never the batch position, which would hand one request's
        decoder state to the next.
        """
        if runner_ids is not None and len(runner_ids) != len(batch):
            raise RuntimeError(f"{len(runner_ids)} request_ids for {len(batch)} requests (seq_token_counts)")
        keys: list[str | tuple[str]] = []
        for i, (_, info) in enumerate(batch):
            meta = info.get("meta")
            own = _payload_id(info, meta if isinstance(meta, dict) else {})
            key = str(runner_ids[i]) if runner_ids is not None else own
            if key is None:
                keys.append(("no stream id: the runner passed no request_ids and the payload names no req_id",))
                continue
            if own is not None and not _same_request(key, own) and key not in self._mismatch_warned:
                self._mismatch_warned.add(key)
                logger.warning(
                    "MOSS codec request %s: its payload names request %s; keyed by the runner's id", key, own
                )
            keys.append(("request id appears twice in one batch",) if key in keys else key)
        return keys

    def _stream_chunk(
        self, index: int, seg: torch.Tensor, info: dict, key: str | tuple[str], may_split: bool
    ) -> _StreamChunk:
        try:
            meta = _meta_of(info)
        except _PayloadError as exc:  # no terminal flag can be read: the stream is left as it was
            return _StreamChunk(index, None if isinstance(key, tuple) else key, None, False, str(exc))
        finished = _meta_flag(meta, "stream_finished", "finished")
        if isinstance(key, tuple):
            return _StreamChunk(index, None, None, finished, key[0])
        codes, error = self._assemble(key, seg, meta, finished, may_split)
        if error is not None:
            # A terminal payload still ends its stream: a zero-frame terminal chunk.
            codes = seg.new_zeros(self.n_vq, 0) if finished else None
        return _StreamChunk(index, key, codes, finished, error)

    def _declared_numel(self, meta: dict) -> int | None:
        """The chunk's size as its payload declares it, in codes, or None.

        ``codec_chunk_frames * n_vq`` when the payload names its frame count, else
        ``code_flat_numel``. Frames win because the connector merges each payload's
        ``meta`` into the previous one and a payload that omits a field inherits the old
        value: the raw processor's terminal placeholder declares ``codec_chunk_frames=0``
        but omits ``code_flat_numel`` (``stage_input_processors/moss_tts.py``).

        Raises:
            _PayloadError: the field it reads is not an integer >= 0 (:func:`_meta_count`).
        """
        frames = _meta_count(meta, "codec_chunk_frames")
        if frames is not None:
            return frames * self.n_vq
        return _meta_count(meta, "code_flat_numel")

    def _assemble(
        self, key: str, seg: torch.Tensor, meta: dict, finished: bool, may_split: bool
    ) -> tuple[torch.Tensor | None, str | None]:
        """``((n_vq, T) codes or None while a split chunk is incomplete, error or None)``.

        A chunk with fewer codes than declared is buffered as split, except a terminal one
        in a step that did not use the whole token budget (``may_split`` false): no rest
        can follow it, so it is refused (the caller still ends the stream).
        """
        pending = self._partial.pop(key, None)
        tokens = seg if pending is None else torch.cat([pending, seg])
        try:
            declared = self._declared_numel(meta)
        except _PayloadError as exc:
            return None, str(exc)
        n = tokens.numel()
        single = n == 1 and pending is None
        if n == 0 or (single and (declared == 0 or (self.n_vq > 1 and (finished or _placeholder(meta))))):
            # Meta-only payload or the connector's one-token `[0]` boundary placeholder.
            return seg.new_zeros(self.n_vq, 0), None
        if declared is not None:
            if declared % self.n_vq:
                return None, f"the payload declares {declared} codes, not a multiple of n_vq={self.n_vq}"
            if n < declared:
                if finished and not may_split:
                    return None, (
                        f"the terminal payload declares {declared} codes but {n} arrived in a step that left "
                        "token budget unused (not a split chunk); the incomplete chunk is dropped"
                    )
                self._partial[key] = tokens  # the token budget split the chunk: wait for the rest
                return None, None
            if n > declared:
                return None, f"{n} codes exceed the {declared} the payload declares"
        if n % self.n_vq:
            return None, f"{n} codes are not a multiple of n_vq={self.n_vq}"
        return tokens.reshape(self.n_vq, -1), None

    def _deliver(self, chunk: _StreamChunk, result: ChunkResult) -> torch.Tensor:
        """The audio a batch row returns: anything held for its stream, then this step's."""
        if result.error is not None:
            self._report(chunk.key, chunk.index, result.error)
        parts = self._held.pop(chunk.key, [])
        self._held_frames.pop(chunk.key, None)
        if result.error is None and result.frames:
            parts.append(result.audio)
        if not parts:
            return self._empty_audio()
        return self._shape_audio(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))

    def _report(self, key: str | None, index: int | None, error: str) -> None:
        """Log a request's error: once per stream key (every time for a row without one).

        ``index`` is the request's batch row, None for a stream outside the batch.
        """
        if key is not None:
            if key in self._reported:
                return
            self._reported.add(key)
        where = "not in this batch" if index is None else f"batch row {index}"
        logger.warning("MOSS codec request %s (%s): %s; returning empty audio", key, where, error)

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if self._session is None or now - self._stats_logged_at < self.stats_interval_s:
            return
        self._stats_logged_at = now
        s = self._session.stats()
        logger.info(
            "MOSS codec stage: steps graph=%d eager=%d; frames decoded=%d padded=%d; waiting streams=%d "
            "(%d frames), admitted from queue=%d, longest queue wait %.3f s; clamped codes=%d, request errors=%d",
            s["steps_by_path"]["graph"],
            s["steps_by_path"]["eager"],
            s["decoded_frames"],
            s["padded_frames"],
            s["waiting_streams"],
            s["waiting_frames"],
            s["admitted_from_queue"],
            s["queue_wait_s_max"],
            s["clamped_codes"],
            s["request_errors"],
        )

    # ------------------------------------------------------------------ lifecycle
    def on_requests_finished(self, finished_req_ids: Iterable[str]) -> None:
        """Called by the runner for every finished request (normal, abort, disconnect):
        releases and resets any codec slot those requests still hold and drops what the
        stage buffered for them (split-chunk prefixes, undelivered audio).

        Undelivered audio is logged as an error naming the request and its frames: audio
        the session decoded from its admission queue after the request's last batch row
        (``docs/serving_stage.md``, "Admission queue").
        """
        ids = [str(rid) for rid in finished_req_ids]
        for rid in ids:
            self._partial.pop(rid, None)
            if self._held.pop(rid, None):
                logger.error(
                    "MOSS codec request %s finished with %d decoded frames never returned: the session decoded "
                    "them from its admission queue after the request's last batch row; dropped",
                    rid,
                    self._held_frames.get(rid, 0),
                )
            self._held_frames.pop(rid, None)
            self._reported.discard(rid)
            self._mismatch_warned.discard(rid)
        if self._session is not None:
            self._session.on_requests_finished(ids)
