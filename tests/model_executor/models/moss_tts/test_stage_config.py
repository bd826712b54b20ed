# SPDX-License-Identifier: Apache-2.0
"""Stage 1 configuration: the connector's chunk schedule, compile adapters.

* Graph frame sizes cover the whole chunk schedule (initial, steady, ramp).
* The vLLM-decorated adapter class is built once per core adapter class.
"""

from __future__ import annotations

import pytest
import torch
from stage_helpers import build_stage, delay_info, run, use_session_api

pytestmark = [pytest.mark.vllm, pytest.mark.cpu, pytest.mark.core_model]

STAGE = "vllm_omni_moss.model_executor.models.moss_tts.stage"


@pytest.fixture(autouse=True)
def _session_api(monkeypatch):
    use_session_api(monkeypatch)


@pytest.fixture
def session_kwargs(monkeypatch):
    """The keyword arguments the stage builds its session with."""
    from vllm_omni_moss.model_executor.models.moss_tts import stage as stage_module

    seen: dict = {}
    base = stage_module.CodecStreamSession

    class Recording(base):
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(stage_module, "CodecStreamSession", Recording)
    return seen


# ----------------------------------------------------------------------------- chunk schedule


@pytest.mark.parametrize(
    ("extra", "sizes"),
    [
        ({}, []),
        ({"initial_codec_chunk_frames": 1, "codec_chunk_frames": 15}, [1, 15]),
        ({"initial_codec_chunk_frames": 0, "codec_chunk_frames": 15}, [15]),
        ({"codec_chunk_ramp": [1, 4, 15], "codec_chunk_frames": 15}, [1, 4, 15]),
        ({"codec_chunk_ramp": "1, 4, 8", "codec_chunk_frames": 15, "initial_codec_chunk_frames": 2}, [1, 2, 4, 8, 15]),
    ],
)
def test_connector_chunk_frames_cover_the_schedule(extra, sizes):
    from vllm_omni_moss.model_executor.models.moss_tts.stage import connector_chunk_frames

    assert connector_chunk_frames(extra) == sizes


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"codec_chunk_ramp": "1, x"}, "connector extra codec_chunk_ramp must hold integer frame counts, got '1, x'"),
        ({"codec_chunk_frames": -3}, "connector extra codec_chunk_frames must hold frame counts >= 0, got -3"),
    ],
)
def test_connector_chunk_frames_reject_bad_values(extra, message):
    from vllm_omni_moss.model_executor.models.moss_tts.stage import connector_chunk_frames

    with pytest.raises(ValueError) as err:
        connector_chunk_frames(extra)
    assert str(err.value) == message


def test_ramp_sets_graph_frame_sizes_and_longest_step(tmp_path, session_kwargs):
    extra = {"codec_chunk_ramp": [1, 4, 15], "codec_chunk_frames": 15}
    stage = build_stage(tmp_path, extra=extra)
    assert stage.graph_frame_sizes == [1, 4, 15] and stage.max_step_frames == 15
    run(stage, [torch.zeros(stage.n_vq, 1)], [delay_info()], ["a"])
    assert session_kwargs["graph_frame_sizes"] == [1, 4, 15] and session_kwargs["max_step_frames"] == 15
    bare = build_stage(tmp_path, extra={})
    assert bare.graph_frame_sizes == [] and bare.max_step_frames == 100


# ----------------------------------------------------------------------------- compile adapters


def test_vllm_adapter_class_is_built_once_per_core_adapter_class(tmp_path):
    from moss_codecs import build_decoder

    from vllm_omni_moss.model_executor.models.moss_tts.compile import adapter_class_for
    from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS
    from vllm_omni_moss.model_executor.models.moss_tts.stage import _vllm_adapter_class
    from vllm_omni_moss.model_executor.models.moss_tts.state_pool import make_state_pool

    bases = [
        adapter_class_for(make_state_pool(build_decoder(PRESETS[p], tmp_path / p))) for p in ("tiny-v1", "tiny-v2")
    ]
    assert bases[0] is not bases[1]
    built = [_vllm_adapter_class(b) for b in bases]
    assert [_vllm_adapter_class(b) for b in bases] == built  # cached per base class
    for base, cls in zip(bases, built):
        assert issubclass(cls, base) and cls is not base
        assert cls.__name__ == f"Vllm{base.__name__}" and cls.__module__ == STAGE
