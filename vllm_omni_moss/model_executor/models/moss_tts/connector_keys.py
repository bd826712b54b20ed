# SPDX-License-Identifier: Apache-2.0
"""The connector ``extra`` keys of the chunk schedule's namespace that anyone reads: the one closed set the talker's
chunker (``talker_chunker.py``) and Stage 1 (``stage_options.py``) check a connector's ``extra`` against, both
through :func:`check_connector_keys`.

The namespace is every key whose name (lower-cased, spaces, hyphens and dots as underscores) starts with
``codec_`` or contains ``chunk`` or ``ramp``. A key of it that neither this package nor vLLM-Omni 0.30.0 reads is
refused at startup, naming the nearest known key: a misspelt schedule key (``codec_ramp``,
``initial_chunk_frames``) would otherwise be read by nobody, and the talker and the stage would run a schedule
nobody asked for. Keys outside the namespace (``connector_get_sleep_s``, ``shm_threshold_bytes``) are the
connector's own and are not checked. Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "KNOWN_CONNECTOR_KEYS",
    "REMOVED_KEYS",
    "SCHEDULE_KEYS",
    "check_connector_keys",
    "in_schedule_namespace",
    "nearest_known_key",
    "plain_key",
]

#: The connector ``extra`` keys this package reads: the chunk schedule (vLLM-Omni 0.30.0's names;
#: ``stage_options.resolve_chunk_schedule``).
SCHEDULE_KEYS = ("codec_chunk_frames", "codec_chunk_ramp", "initial_codec_chunk_frames")

#: Every key of the namespace that this package or vLLM-Omni 0.30.0 reads from a connector's ``extra``, and who
#: reads it (paths under the installed ``vllm_omni`` package; found by grepping it for ``cfg.get(``,
#: ``extra.get(``, ``extra_cfg.get(`` and ``_cfg_int(`` of such keys). This package's keys come first: a tie for
#: the nearest key goes to them. The last two are read by no code of vLLM-Omni 0.30.0 but set in the connector
#: extras of its own deploy files (``vllm_omni/deploy/*.yaml``, ``moss_tts.yaml`` among them): refusing them
#: would refuse those files.
KNOWN_CONNECTOR_KEYS: dict[str, str] = {
    "codec_chunk_frames": "this package; every chunker of stage_input_processors/ (moss_tts.py among them)",
    "codec_chunk_ramp": "this package; chunk_size_utils.parse_chunk_ramp",
    "initial_codec_chunk_frames": "this package; moss_tts.py, qwen3_tts.py, fish_speech.py and other chunkers; "
    "the MOSS codec model of models/moss_tts/",
    "codec_left_context_frames": "most chunkers of stage_input_processors/; several code2wav models",
    "codec_chunk_frames_at_begin": "stage_input_processors/voxtral_tts.py",
    "codec_right_holdback_frames": "stage_input_processors/higgs_audio_v3.py",
    "codec_token_offset": "stage_input_processors/audex.py",
    "codec_vocab_size": "stage_input_processors/audex.py, cosyvoice3.py",
    "codec_pre_lookahead_frames": "stage_input_processors/cosyvoice3.py",
    "codec_max_chunk_frames": "stage_input_processors/cosyvoice3.py",
    "codec_stream_scale_factor": "stage_input_processors/cosyvoice3.py",
    "codec_chunk_adaptive": "stage_input_processors/chunk_size_utils.py (adaptive chunk settings)",
    "codec_chunk_min_frames": "stage_input_processors/chunk_size_utils.py",
    "codec_chunk_safety_margin_ms": "stage_input_processors/chunk_size_utils.py",
    "codec_chunk_ramp_divisor": "stage_input_processors/chunk_size_utils.py",
    "codec_chunk_ramp_delta_min": "stage_input_processors/chunk_size_utils.py",
    "latent_chunk_size": "stage_input_processors/ming_tts.py",
    "initial_latent_chunk_size": "stage_input_processors/ming_tts.py",
    "fish_speech_backlog_codec_chunk_frames": "stage_input_processors/fish_speech.py",
    "fish_speech_single_initial_chunk": "stage_input_processors/fish_speech.py",
    "decoder_emit_chunk_frames": "models/audex/audex_code2wav.py",
    "codec_streaming": "read by no code (a payload meta key); set by vLLM-Omni 0.30.0's deploy files",
    "connector_get_max_wait_first_chunk": "read by no code; set by vLLM-Omni 0.30.0's deploy files",
}

#: Keys this package read once and reads no longer, each with the message that refuses it. Checked before the
#: closed set, and whatever the key's namespace, so its message says why rather than "unknown".
REMOVED_KEYS: dict[str, str] = {
    "codec_ragged_steps": (
        "codec_ragged_steps was removed: every step is ragged (packed), there is no grid step to switch from"
    ),
}


def plain_key(key: str) -> str:
    """``key`` lower-cased, its runs of spaces, hyphens and dots as one underscore: what the misspelling checks of
    connector keys and of codec options (``stage_options.check_codec_keys``) compare."""
    return re.sub(r"[\s\-.]+", "_", key.strip().lower())


#: A key at least this like one of :data:`SCHEDULE_KEYS` (``difflib`` ratio) is taken for a misspelling of it:
#: ``initial_codec_frames`` comes to 0.87 against ``initial_codec_chunk_frames``; every key of vLLM-Omni 0.30.0's
#: deploy files outside the namespace's other rules stays below 0.7 (``audiocodec_token_offset``,
#: ``ref_code_context_frames``), and so do keys of other connectors such as ``video_codec_options`` (0.44).
NEAR_MISS_RATIO = 0.85


def in_schedule_namespace(key: str) -> bool:
    """Whether ``key`` (any case and separators) starts with ``codec_``, contains ``chunk`` or ``ramp``, or is at
    least :data:`NEAR_MISS_RATIO` like a key of the chunk schedule."""
    plain = plain_key(key)
    if plain.startswith("codec_") or "chunk" in plain or "ramp" in plain:
        return True
    return bool(difflib.get_close_matches(plain, SCHEDULE_KEYS, n=1, cutoff=NEAR_MISS_RATIO))


def _words(key: str) -> str:
    return "_".join(sorted(key.split("_")))


def nearest_known_key(key: str) -> str:
    """The known key most like ``key``: the higher of two ``difflib`` ratios, of the names and of their words
    sorted (so ``codec_initial_chunk_frames`` finds ``initial_codec_chunk_frames``); a tie goes to the key listed
    first in :data:`KNOWN_CONNECTOR_KEYS`."""
    plain = plain_key(key)

    def score(name: str) -> float:
        chars = difflib.SequenceMatcher(None, plain, name).ratio()
        return max(chars, difflib.SequenceMatcher(None, _words(plain), _words(name)).ratio())

    return max(KNOWN_CONNECTOR_KEYS, key=score)  # max keeps the first of equal scores


def check_connector_keys(extra: Mapping[str, Any]) -> None:
    """Refuse a connector ``extra`` naming a removed key (:data:`REMOVED_KEYS`, checked first), or a key of the
    schedule's namespace (:func:`in_schedule_namespace`) that :data:`KNOWN_CONNECTOR_KEYS` does not list.

    Raises:
        ValueError: the removed key's message; or naming every unknown key (sorted) and the known key nearest
            to each.
    """
    for key in extra:
        if isinstance(key, str) and plain_key(key) in REMOVED_KEYS:
            raise ValueError(f"connector extra {key!r}: {REMOVED_KEYS[plain_key(key)]}")
    unknown = sorted(
        k for k in extra if isinstance(k, str) and in_schedule_namespace(k) and k not in KNOWN_CONNECTOR_KEYS
    )
    if unknown:
        named = "; ".join(f"{k!r} (did you mean {nearest_known_key(k)!r}?)" for k in unknown)
        raise ValueError(
            f"connector extra names a key neither this package nor vLLM-Omni 0.30.0 reads: {named}. "
            f"The chunk schedule's keys: {', '.join(SCHEDULE_KEYS)}"
        )
