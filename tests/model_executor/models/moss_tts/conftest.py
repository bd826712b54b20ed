# SPDX-License-Identifier: Apache-2.0
"""Fixtures: tiny codecs loaded through the official checkpoint path (see ``moss_codecs.py``), and a stage on
one (``stage_helpers.py``; needs vllm + vllm-omni)."""

from __future__ import annotations

import pytest
from moss_codecs import build_decoder, ring_codec_raw
from stage_helpers import build_stage

from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS


@pytest.fixture
def ring_decoder(tmp_path):
    """The rings-of-5-and-10 codec with v2 ring semantics, fp32 on CPU."""
    return build_decoder(ring_codec_raw(), tmp_path, version="v2")


@pytest.fixture
def ring_decoder_v1(tmp_path):
    """The same geometry with v1 (exact) ring semantics."""
    return build_decoder(ring_codec_raw(), tmp_path, version="v1")


@pytest.fixture(params=["tiny-v2", "tiny-v1"])
def tiny_decoder(request, tmp_path):
    """Each tiny preset, loaded through its official-format checkpoint."""
    return build_decoder(PRESETS[request.param], tmp_path)


@pytest.fixture
def stage(tmp_path):
    """A stage on the tiny v2 checkpoint (:func:`stage_helpers.build_stage` defaults)."""
    return build_stage(tmp_path)
