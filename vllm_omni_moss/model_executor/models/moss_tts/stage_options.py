# SPDX-License-Identifier: Apache-2.0
"""Stage 1's options, read once from the vLLM config it is built with: the frozen :class:`StageOptions`.

Sources (docs/serving_stage.md): the stage's ``hf_config`` (``hf_overrides`` in a deploy file) for the codec
(``n_vq``, the checkpoint, ``codec_dtype``, ``codec_attention_backend``, ``codec_ring_semantics``,
``codec_pool_kind``, ``codec_state_budget_gib``, ``codec_expected_stream_seconds``, ``codec_dummy_preset``; the
full list is :data:`CODEC_KEYS`), the scheduler config for the slot count (``max_num_seqs``) and the token budget,
the connector's ``extra`` for the chunk schedule, the model config for ``async_chunk`` and ``enforce_eager``, and
the load config for vLLM's dummy load format. Every value is checked here; the stage never
re-reads or re-validates one. Nothing here imports vLLM: the config is read by attribute.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .backends import ATTENTION_BACKENDS
from .config import CODEC_ABILITIES, PRESETS, RING_SEMANTICS
from .connector_keys import check_connector_keys, plain_key
from .decoder import chunk_frames_at
from .graph_ladder import frame_totals
from .serving.options import SessionOptions
from .state import POOL_KINDS

__all__ = [
    "CODEC_DTYPES",
    "CODEC_KEYS",
    "ChunkSchedule",
    "StageOptions",
    "check_codec_keys",
    "codec_dtype_for",
    "connector_chunk_frames",
    "resolve_chunk_schedule",
]

DEFAULT_CODEC = "OpenMOSS-Team/MOSS-Audio-Tokenizer"
DEFAULT_MAX_STEP_FRAMES = 100
#: Device memory the codec's CUDA graphs may take unless ``codec_graph_memory_gib`` says otherwise: the graphs
#: of 2,048 slots fit it (docs/memory.md, "CUDA graphs").
DEFAULT_GRAPH_MEMORY_GIB = 24.0

#: ``hf_overrides`` ``codec_dtype`` values: ``"auto"`` is upstream's policy (:func:`codec_dtype_for`).
CODEC_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32}


def codec_dtype_for(choice: str, version: str, device: torch.device | str) -> torch.dtype:
    """Dtype of the codec's weights, decode table and state rings.

    Args:
        choice: ``"auto"``, ``"bfloat16"`` or ``"float32"`` (``hf_overrides`` ``codec_dtype``).
        version: codec version, ``"v1"`` or ``"v2"`` (``CodecConfig.version``).
        device: the stage device.
    Returns:
        For ``"auto"``, upstream's policy (``load_weights`` of vLLM-Omni 0.30.0's
        ``modeling_moss_tts_codec.py``): v1 codecs entirely float32 (their quantizer emits float32); v2 codecs
        bfloat16 on CUDA (decoder and decode table), float32 elsewhere. Otherwise the named dtype.
    Raises:
        ValueError: ``choice`` is not one of :data:`CODEC_DTYPES` (the message lists them).
    """
    dtype = CODEC_DTYPES[codec_dtype_choice(choice)]
    if dtype is not None:
        return dtype
    bf16 = CODEC_ABILITIES[version].bf16_on_cuda and torch.device(device).type == "cuda"
    return torch.bfloat16 if bf16 else torch.float32


def codec_dtype_choice(choice: Any) -> str:
    """``choice`` if it is a string naming a :data:`CODEC_DTYPES` entry; ValueError listing them otherwise."""
    if not isinstance(choice, str) or choice not in CODEC_DTYPES:
        raise ValueError(f"codec_dtype must be one of {', '.join(map(repr, CODEC_DTYPES))}; got {choice!r}")
    return choice


#: Every ``codec_*`` field of the stage's hf_config (``hf_overrides`` included) the stage knows, and what it sets.
#: The one list of them: :meth:`StageOptions.from_vllm_config` reads these fields through :class:`_CodecFields`,
#: which refuses a name missing here, and :func:`check_codec_keys` refuses any other ``codec_*`` field.
CODEC_KEYS: dict[str, str] = {
    "codec_model_name_or_path": "the codec checkpoint (upstream's field: models/moss_tts/configuration_moss_tts.py)",
    "codec_dtype": "precision of the codec's weights, decode table and state rings",
    "codec_attention_backend": "the pool's attention backend (upstream's field: modeling_moss_tts_codec.py)",
    "codec_ring_semantics": "the pool's ring semantics",
    "codec_pool_kind": "the decoder state pool",
    "codec_state_budget_gib": "GiB of ring pages of the paged pool",
    "codec_expected_stream_seconds": "the stream length that splits the state budget over the groups",
    "codec_graph_memory_gib": "GiB the codec's CUDA graphs may take",
    "codec_dummy_preset": "the geometry of the random codec served under vLLM's dummy load format",
}
#: ``codec_*`` fields the stage read once and no longer does, with why: naming one is a startup error that says it
#: was removed, never a silent no-op.
REMOVED_CODEC_KEYS: dict[str, str] = {
    "codec_ragged_steps": 'every step is ragged now (one packed step per round, docs/serving.md "Steps"); '
    "there is no other step layout to choose",
}
#: The codec served under vLLM's dummy load format unless ``codec_dummy_preset`` names another preset.
DEFAULT_DUMMY_PRESET = "v2"


#: A field of the hf_config at least this like a codec option (``difflib`` ratio of the plain names) is taken
#: for a misspelling of it. The fields of upstream's MOSS-TTS config class come to at most 0.70 (``_name_or_path``
#: against ``codec_model_name_or_path``), a one-letter slip to 0.93 and more.
NEAR_MISS_RATIO = 0.85


def check_codec_keys(hf: Any) -> None:
    """Refuse a field of ``hf`` (the stage's hf_config) that looks like a codec option but :data:`CODEC_KEYS` does
    not list it: a name starting with ``codec`` (any case and separators: ``codecs_dtype``), or one at least
    :data:`NEAR_MISS_RATIO` like a known option (``kodec_pool_kind``). A misspelt option would otherwise leave its
    default in force without a word; the model's own fields are none of these.

    The fields are those of ``vars(hf)``: a transformers ``PretrainedConfig`` keeps every field, those set by
    ``hf_overrides`` included, as an instance attribute.

    Raises:
        ValueError: naming a removed field (:data:`REMOVED_CODEC_KEYS`) and why it was removed, or every unknown
            field and the known one closest to it (``difflib``).
    """
    fields = getattr(hf, "__dict__", {})
    removed = sorted(k for k in fields if plain_key(k) in REMOVED_CODEC_KEYS)
    if removed:
        key = removed[0]
        raise ValueError(
            f"codec option {key!r} in the stage's hf_config (hf_overrides) was removed: "
            f"{REMOVED_CODEC_KEYS[plain_key(key)]}; delete it from the deploy file"
        )
    # Any case and separator: hf_config fields are exact names, so `Codec_dtype` or `codec-dtype` would be a
    # field of its own, unread.
    unknown = sorted(k for k in fields if k not in CODEC_KEYS and _looks_like_a_codec_option(plain_key(k)))
    if unknown:
        closest = {k: difflib.get_close_matches(plain_key(k), CODEC_KEYS, n=1, cutoff=0.0)[0] for k in unknown}
        named = [f"{k!r} (the closest known one is {near!r})" for k, near in closest.items()]
        raise ValueError(f"unknown codec option in the stage's hf_config (hf_overrides): {', '.join(named)}")


def _looks_like_a_codec_option(plain: str) -> bool:
    return plain.startswith("codec") or bool(difflib.get_close_matches(plain, CODEC_KEYS, n=1, cutoff=NEAR_MISS_RATIO))


class _CodecFields:
    """The ``codec_*`` fields of an hf_config, read as attributes (an unset field is absent, as on the config);
    reading a name :data:`CODEC_KEYS` does not list raises KeyError, so no reader can miss the table."""

    def __init__(self, hf: Any) -> None:
        self._hf = hf

    def __getattr__(self, name: str) -> Any:
        if name not in CODEC_KEYS:
            raise KeyError(f"{name!r} is read from the hf_config but CODEC_KEYS does not list it")
        return getattr(self._hf, name)


def _codebook_count(value: Any) -> int:
    """``value`` (hf_config ``n_vq``, else ``rvq``) if it is an integer >= 1; floats and bools are refused."""
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


#: Steady chunk frames of vLLM-Omni 0.30.0's MOSS talker when ``codec_chunk_frames`` is absent or 0
#: (``int(cfg.get("codec_chunk_frames", 15) or 15)`` in ``stage_input_processors/moss_tts.py``).
TALKER_DEFAULT_STEADY_FRAMES = 15

#: ``(extra, steady) -> ramp or None``: vLLM-Omni's ``parse_chunk_ramp`` (``chunk_size_utils.py``), passed in by
#: the modules that import vLLM-Omni (this one does not).
RampParser = Callable[[dict, int], "list[int] | None"]


@dataclass(frozen=True)
class ChunkSchedule:
    """The chunk sizes the talker's chunker sends: chunk ``i`` has ``ramp[i]`` frames, then ``steady`` each
    (:func:`~.decoder.chunk_frames_at`). A terminal chunk may be shorter, or longer when the talker handed
    several frames in its last call.

    Attributes:
        ramp: frames of the first chunks (``codec_chunk_ramp``, or ``(initial_codec_chunk_frames,)``, or empty).
        steady: frames of every later chunk (``codec_chunk_frames``).
    """

    ramp: tuple[int, ...]
    steady: int

    def size(self, index: int) -> int:
        """Frames of chunk ``index`` (0-based)."""
        return chunk_frames_at(index, self.ramp, self.steady)

    @property
    def frame_sizes(self) -> list[int]:
        """Every size the chunker sends, sorted and distinct: the stage's graph frame sizes."""
        return sorted({*self.ramp, self.steady})


def _frame_count(extra: dict[str, Any], name: str) -> int:
    """``extra[name]`` as one frame count >= 0 (0 when absent or null).

    Raises:
        ValueError: not one integer >= 0 (a list or a comma-separated string of several counts included),
            naming the key and its value.
    """
    frames = _positive_frames(name, extra.get(name)) or [0]
    if len(frames) != 1:
        raise ValueError(f"connector extra {name} must be one frame count, got {extra[name]!r}")
    return frames[0]


def resolve_chunk_schedule(
    extra: dict[str, Any], parse_ramp: RampParser | None, max_frames: int = DEFAULT_MAX_STEP_FRAMES
) -> ChunkSchedule:
    """The chunk schedule of a connector ``extra``, resolved by the talker's rules; the one resolution Stage 0's
    chunker (``talker_chunker.py``) and Stage 1 (graph frame sizes) share.

    * ``codec_chunk_frames``: the steady size; absent or 0 means :data:`TALKER_DEFAULT_STEADY_FRAMES`, as
      vLLM-Omni 0.30.0's talker reads it.
    * ``codec_chunk_ramp``: sizes of the first chunks, read by ``parse_ramp`` (vLLM-Omni's ``parse_chunk_ramp``:
      a list or a comma-separated string of >= 2 sizes >= 1).
    * ``initial_codec_chunk_frames`` (without a ramp): the first chunk; 0 or absent: none; larger than the
      steady size: the steady size (vLLM-Omni clamps it).

    Raises:
        ValueError: a non-integer or negative frame count (as :func:`connector_chunk_frames` always did); a ramp
            ``parse_ramp`` refuses (empty, one size, a size < 1), or a ramp without ``parse_ramp``; a ramp
            together with ``initial_codec_chunk_frames`` (vLLM-Omni's chunkers read one or the other); a size
            above ``max_frames`` (each message names the key and its value); a removed key, or a key of the
            schedule's namespace that neither this package nor vLLM-Omni 0.30.0 reads
            (:func:`.connector_keys.check_connector_keys`, naming the key and the nearest known one).
    """
    check_connector_keys(extra)
    steady = _frame_count(extra, "codec_chunk_frames") or TALKER_DEFAULT_STEADY_FRAMES
    initial = min(_frame_count(extra, "initial_codec_chunk_frames"), steady)
    raw = extra.get("codec_chunk_ramp")
    if raw is None:
        schedule = ChunkSchedule((initial,) if initial else (), steady)
    else:
        _positive_frames("codec_chunk_ramp", raw)  # the integer and sign checks and messages of every key
        ramp = parse_ramp(extra, steady) if parse_ramp is not None else None
        if not ramp:
            reason = "needs vLLM-Omni's parse_chunk_ramp" if parse_ramp is None else "must hold >= 2 sizes >= 1"
            raise ValueError(f"connector extra codec_chunk_ramp {reason} (vLLM-Omni's rule), got {raw!r}")
        if extra.get("initial_codec_chunk_frames"):
            raise ValueError(
                f"connector extra sets both codec_chunk_ramp {raw!r} and initial_codec_chunk_frames "
                f"{extra['initial_codec_chunk_frames']!r}: the ramp's first size is the first chunk; drop one"
            )
        schedule = ChunkSchedule(tuple(int(x) for x in ramp), steady)
    # The initial size is clamped to the steady one: only the steady size and a ramp can pass the limit.
    for name, sizes in (("codec_chunk_frames", (steady,)), ("codec_chunk_ramp", schedule.ramp)):
        if max(sizes, default=0) > max_frames:
            raise ValueError(
                f"connector extra {name} {extra[name]!r} exceeds the stage's chunk limit of {max_frames} frames"
            )
    return schedule


def connector_chunk_frames(extra: dict[str, Any], parse_ramp: RampParser | None = None) -> list[int]:
    """Every chunk size (frames) Stage 0's chunker sends under the connector's schedule:
    ``resolve_chunk_schedule(extra, parse_ramp).frame_sizes``.

    Raises:
        ValueError: as :func:`resolve_chunk_schedule`.
    """
    return resolve_chunk_schedule(extra, parse_ramp).frame_sizes


def _slot_count(max_num_seqs: Any) -> int:
    """The stage's slot count from the scheduler's ``max_num_seqs`` (1 without a scheduler config, as in
    direct calls).

    Raises:
        ValueError: a ``max_num_seqs`` that is not an integer >= 1, naming it.
    """
    if max_num_seqs is None:
        return 1
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(
            f"scheduler_config.max_num_seqs must be an integer >= 1 (the codec stage's slot count), got {max_num_seqs!r}"
        )
    return max_num_seqs


def _connector_extra(model_config) -> dict[str, Any]:
    connector = getattr(model_config, "stage_connector_config", None)
    extra = connector.get("extra", connector) if isinstance(connector, dict) else getattr(connector, "extra", None)
    return extra if isinstance(extra, dict) else {}


#: Code frames a waiting stream may buffer on average before the admission queue refuses chunks (82 s of codes;
#: 96 bytes a frame of 12 int64 codes).
WAITING_FRAMES_PER_SLOT = 1024


@dataclass(frozen=True)
class StageOptions:
    """Everything the stage reads from its config, checked (:meth:`from_vllm_config`).

    Attributes:
        n_vq: codebooks per frame (``n_vq``, else ``rvq``, default 16).
        codec_path: the codec checkpoint (``codec_model_name_or_path`` or ``audio_tokenizer_name_or_path``).
        codec_dtype: a :data:`CODEC_DTYPES` key (null means ``"auto"``).
        attention_backend / ring_semantics / pool_kind: the pool's, or None for the pool's defaults.
        state_budget_bytes: bytes of ring pages (``codec_state_budget_gib``; picks the paged pool), or None.
        expected_stream_seconds: split that budget by the groups' fill over a stream this long, or None.
        state_capacity: codec slots (``max_num_seqs``).
        token_budget: tokens one engine step may schedule (vLLM's ``max_num_scheduled_tokens``, else
            ``max_num_batched_tokens``), None without a scheduler config.
        graph_frame_sizes: every chunk size the talker's chunker sends (:func:`connector_chunk_frames`).
        max_step_frames: the longest step without graphs: the largest of those sizes.
        async_chunk / enforce_eager: the model config's (``enforce_eager`` defaults to true when absent).
        graph_frame_totals: the packed frame totals of the stage's step shapes and CUDA graphs,
            ``graph_ladder.frame_totals(state_capacity x the largest chunk size)``; none under ``enforce_eager``.
            vLLM's ``cudagraph_capture_sizes`` is not read.
        graph_memory_bytes: device memory the codec's graphs may take (``codec_graph_memory_gib``, default
            :data:`DEFAULT_GRAPH_MEMORY_GIB`).
        dummy_preset: under vLLM's dummy load format (``load_config.load_format == "dummy"``), the preset
            (``config.PRESETS``) whose random weights the stage serves instead of the checkpoint
            (``codec_dummy_preset``, default :data:`DEFAULT_DUMMY_PRESET`); None under any other load format.
    """

    n_vq: int
    codec_path: str
    codec_dtype: str
    attention_backend: str | None
    ring_semantics: str | None
    pool_kind: str | None
    state_budget_bytes: int | None
    expected_stream_seconds: float | None
    state_capacity: int
    token_budget: int | None
    graph_frame_sizes: list[int]
    max_step_frames: int
    async_chunk: bool
    enforce_eager: bool
    graph_frame_totals: list[int]
    graph_memory_bytes: int
    dummy_preset: str | None = None

    @classmethod
    def from_vllm_config(cls, vllm_config, parse_ramp: RampParser | None = None) -> StageOptions:
        """The options of the stage built with ``vllm_config``; ``parse_ramp``: vLLM-Omni's ``parse_chunk_ramp``
        (needed when the connector sets ``codec_chunk_ramp``).

        Raises:
            ValueError: bad ``n_vq`` (not an integer >= 1), ``codec_dtype``, ``codec_attention_backend``,
                ``codec_ring_semantics``, ``codec_pool_kind``, ``codec_state_budget_gib`` (not a number > 0, or
                given with a pool kind other than ``"paged"``), ``codec_expected_stream_seconds`` (without a
                budget), ``codec_dummy_preset`` (not a preset name), a removed field (``codec_ragged_steps``), or the
                connector's chunk schedule
                (:func:`resolve_chunk_schedule`); a ``codec_*`` field :data:`CODEC_KEYS` does not list
                (:func:`check_codec_keys`).
        """
        model_config = vllm_config.model_config
        config = model_config.hf_config
        check_codec_keys(config)
        hf = _CodecFields(config)  # codec_* fields: read only through the CODEC_KEYS table
        n_vq = _codebook_count(getattr(config, "n_vq", getattr(config, "rvq", 16)))
        codec_path = str(
            getattr(hf, "codec_model_name_or_path", getattr(config, "audio_tokenizer_name_or_path", DEFAULT_CODEC))
        )
        dtype_choice = getattr(hf, "codec_dtype", None)
        codec_dtype = "auto" if dtype_choice is None else codec_dtype_choice(dtype_choice)
        backend = _hf_choice(hf, "codec_attention_backend", ATTENTION_BACKENDS)
        semantics = _hf_choice(hf, "codec_ring_semantics", RING_SEMANTICS)
        pool_kind = _hf_choice(hf, "codec_pool_kind", POOL_KINDS)
        budget = _state_budget_bytes(hf)
        seconds = _hf_positive(hf, "codec_expected_stream_seconds", "seconds")
        if seconds is not None and budget is None:
            raise ValueError("codec_expected_stream_seconds splits a state budget: set codec_state_budget_gib too")
        if budget is not None and pool_kind not in (None, "paged"):
            raise ValueError(f"codec_state_budget_gib needs the paged pool; codec_pool_kind is {pool_kind!r}")
        scheduler = getattr(vllm_config, "scheduler_config", None)
        capacity = _slot_count(getattr(scheduler, "max_num_seqs", None))
        tokens = getattr(scheduler, "max_num_scheduled_tokens", None) or getattr(
            scheduler, "max_num_batched_tokens", None
        )
        frame_sizes = connector_chunk_frames(_connector_extra(model_config), parse_ramp)
        enforce_eager = bool(getattr(model_config, "enforce_eager", True))
        dummy_preset = _hf_choice(hf, "codec_dummy_preset", tuple(sorted(PRESETS))) or DEFAULT_DUMMY_PRESET
        dummy = getattr(getattr(vllm_config, "load_config", None), "load_format", None) == "dummy"
        return cls(
            n_vq, codec_path, codec_dtype, backend, semantics, pool_kind, budget, seconds, capacity,
            int(tokens) if tokens else None, frame_sizes, max(frame_sizes, default=DEFAULT_MAX_STEP_FRAMES),
            bool(getattr(model_config, "async_chunk", False)), enforce_eager,
            [] if enforce_eager else frame_totals(capacity * max(frame_sizes, default=DEFAULT_MAX_STEP_FRAMES)),
            int((_hf_positive(hf, "codec_graph_memory_gib", "GiB") or DEFAULT_GRAPH_MEMORY_GIB) * 2**30),
            dummy_preset if dummy else None,
        )  # fmt: skip

    def session_options(self) -> SessionOptions:
        """The stage's session options, built once: its slots, codebooks, graph sizes, longest step and graph
        memory; the admission queue takes every slot's stream (the engine sends at most ``max_num_seqs``, so
        none is ever refused for the queue's size) and :data:`WAITING_FRAMES_PER_SLOT` frames a slot."""
        return SessionOptions(
            state_capacity=self.state_capacity, n_vq=self.n_vq, graph_frame_totals=tuple(self.graph_frame_totals),
            graph_frame_sizes=tuple(self.graph_frame_sizes), max_step_frames=self.max_step_frames,
            max_waiting_streams=self.state_capacity, max_waiting_frames=self.state_capacity * WAITING_FRAMES_PER_SLOT,
            graph_memory_bytes=self.graph_memory_bytes,
        )  # fmt: skip
