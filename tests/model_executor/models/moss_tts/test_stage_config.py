# SPDX-License-Identifier: Apache-2.0
"""Stage 1 configuration: precision per codec, the connector's chunk schedule, compile adapters.

* ``codec_dtype`` (hf_overrides) picks weights, decode table and ring dtype; ``"auto"`` is
  upstream's policy (v1 float32; v2 bfloat16 on CUDA, float32 elsewhere); a bad value is
  a ValueError listing the choices (null means ``"auto"``; a non-string never does); the
  precision is in the startup log. ``n_vq`` must be an integer >= 1.
* Graph frame sizes cover the whole chunk schedule (initial, steady, ramp).
* The vLLM-decorated adapter class is built once per core adapter class.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from stage_helpers import build_stage, delay_info, run, vllm_config

pytestmark = [pytest.mark.vllm, pytest.mark.cpu, pytest.mark.core_model]

STAGE = "vllm_omni_moss.model_executor.models.moss_tts.stage"
#: The end of every closed-set refusal (connector_keys.check_connector_keys).
SCHEDULE = "The chunk schedule's keys: codec_chunk_frames, codec_chunk_ramp, initial_codec_chunk_frames"


def vllm_omni_root() -> str | None:
    """The installed vLLM-Omni package's folder (None without it)."""
    spec = importlib.util.find_spec("vllm_omni")
    return str(Path(spec.origin).parent) if spec and spec.origin else None


@pytest.fixture
def session_kwargs(monkeypatch):
    """The arguments the stage builds its session with: ``spec``, ``options`` and the keyword ``compile``."""
    from vllm_omni_moss.model_executor.models.moss_tts import stage as stage_module

    seen: dict = {}
    base = stage_module.CodecStreamSession

    class Recording(base):
        def __init__(self, decoder, spec, options, **kwargs):
            seen.update(kwargs, spec=spec, options=options)
            super().__init__(decoder, spec, options, **kwargs)

    monkeypatch.setattr(stage_module, "CodecStreamSession", Recording)
    return seen


# ----------------------------------------------------------------------------- precision


@pytest.mark.parametrize(
    ("choice", "version", "device", "expected"),
    [
        ("auto", "v1", "cuda", torch.float32),
        ("auto", "v2", "cuda", torch.bfloat16),
        ("auto", "v2", "cpu", torch.float32),
        ("auto", "v1", "cpu", torch.float32),
        ("float32", "v2", "cuda", torch.float32),
        ("bfloat16", "v1", "cuda", torch.bfloat16),
        ("bfloat16", "v2", "cpu", torch.bfloat16),
    ],
)
def test_codec_dtype_policy(choice, version, device, expected):
    from vllm_omni_moss.model_executor.models.moss_tts.stage import codec_dtype_for

    assert codec_dtype_for(choice, version, device) == expected


def test_bad_codec_dtype_is_rejected_at_construction(tmp_path):
    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    with pytest.raises(ValueError) as err:
        MossTTSCodecDecoder(vllm_config=vllm_config(tmp_path, 11, codec_dtype="fp16"))
    assert str(err.value) == "codec_dtype must be one of 'auto', 'bfloat16', 'float32'; got 'fp16'"


@pytest.mark.parametrize(("value", "shown"), [(["bfloat16"], "['bfloat16']"), (0, "0"), ("", "''"), ("BF16", "'BF16'")])
def test_codec_dtype_that_is_not_a_listed_string_is_rejected(tmp_path, value, shown):
    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    with pytest.raises(ValueError) as err:
        MossTTSCodecDecoder(vllm_config=vllm_config(tmp_path, 11, codec_dtype=value))
    assert str(err.value) == f"codec_dtype must be one of 'auto', 'bfloat16', 'float32'; got {shown}"


def test_null_codec_dtype_means_auto(tmp_path):
    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    assert MossTTSCodecDecoder(vllm_config=vllm_config(tmp_path, 11, codec_dtype=None)).options.codec_dtype == "auto"


@pytest.mark.parametrize(
    ("value", "shown"), [(0, "0"), (-1, "-1"), (1.5, "1.5"), (12.0, "12.0"), ("12", "'12'"), (True, "True")]
)
def test_n_vq_must_be_an_integer_of_at_least_one(tmp_path, value, shown):
    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    with pytest.raises(ValueError) as err:
        MossTTSCodecDecoder(vllm_config=vllm_config(tmp_path, value))
    assert str(err.value) == f"n_vq must be an integer >= 1 (codebooks per frame); got {shown}"


# ----------------------------------------------------------------------------- state pool


def test_state_budget_picks_the_paged_pool_with_the_pages_it_pays_for(tmp_path, session_kwargs):
    """``codec_state_budget_gib`` reaches the session in bytes and the paged pool holds exactly the
    pages that budget buys (the same fraction of full rings per group, rounded down, plus a null page)."""
    budget_gib = 0.0002
    stage = build_stage(tmp_path, "tiny-v2", codec_state_budget_gib=budget_gib, max_num_seqs=8)
    run(stage, [torch.zeros(stage.n_vq, 1)], [delay_info()], ["a"])
    budget = int(budget_gib * 2**30)
    spec = session_kwargs["spec"]  # the budget, no kind: the spec picks the paged pool
    assert spec.paging.state_budget_bytes == budget and spec.kind == "paged"
    pool = stage._session.pool
    assert pool.kind == "paged"
    groups = stage._codec.config.groups
    page_bytes = [2 * g.num_heads * pool.page_size * g.head_dim * 4 * g.num_layers for g in groups]  # fp32 rings
    per_ring = [g.ring_capacity // pool.page_size for g in groups]
    fraction = (budget - sum(page_bytes)) / (8 * sum(n * b for n, b in zip(per_ring, page_bytes)))
    assert 0 < fraction < 1 and pool.page_fraction == pytest.approx(fraction)
    want = [int(fraction * 8 * n) + 1 for n in per_ring]
    firsts = [sum(g.num_layers for g in groups[:i]) for i in range(len(groups))]
    assert [pool.rings[i].shape[1] for i in firsts] == want
    assert sum(n * b for n, b in zip(want, page_bytes)) <= budget


def test_expected_stream_seconds_reach_the_session_in_frames(tmp_path, session_kwargs):
    stage = build_stage(tmp_path, "tiny-v2", codec_state_budget_gib=0.0002, codec_expected_stream_seconds=4.3)
    run(stage, [torch.zeros(stage.n_vq, 1)], [delay_info()], ["a"])
    assert session_kwargs["spec"].paging.expected_stream_frames == 54  # round(4.3 s x 12.5 frames/s)
    assert stage._session.pool.expected_stream_frames == 54


def test_pool_kind_reaches_the_session(tmp_path, session_kwargs):
    stage = build_stage(tmp_path, "tiny-v2", codec_pool_kind="paged")
    run(stage, [torch.zeros(stage.n_vq, 1)], [delay_info()], ["a"])
    assert session_kwargs["spec"].kind == "paged" and stage._session.pool.kind == "paged"
    assert stage._session.pool.page_fraction == 1.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(codec_pool_kind="pages"), "codec_pool_kind must be one of 'compact', 'legacy', 'paged'; got 'pages'"),
        (dict(codec_state_budget_gib=0), "codec_state_budget_gib must be a finite number of GiB > 0, got 0"),
        (dict(codec_state_budget_gib="40"), "codec_state_budget_gib must be a finite number of GiB > 0, got '40'"),
        (dict(codec_state_budget_gib=True), "codec_state_budget_gib must be a finite number of GiB > 0, got True"),
        (
            dict(codec_state_budget_gib=float("inf")),
            "codec_state_budget_gib must be a finite number of GiB > 0, got inf",
        ),
        (dict(codec_state_budget_gib=1e-12), "codec_state_budget_gib 1e-12 is less than one byte"),
        (
            dict(codec_expected_stream_seconds=4.3),
            "codec_expected_stream_seconds splits a state budget: set codec_state_budget_gib too",
        ),
        (
            dict(codec_state_budget_gib=40, codec_expected_stream_seconds=0),
            "codec_expected_stream_seconds must be a finite number of seconds > 0, got 0",
        ),
        (
            dict(codec_state_budget_gib=40, codec_pool_kind="compact"),
            "codec_state_budget_gib needs the paged pool; codec_pool_kind is 'compact'",
        ),
    ],
)
def test_bad_pool_fields_are_rejected_at_construction(tmp_path, fields, message):
    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    with pytest.raises(ValueError) as err:
        MossTTSCodecDecoder(vllm_config=vllm_config(tmp_path, 11, **fields))
    assert str(err.value) == message


# ----------------------------------------------------------------------------- codec_* keys


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(codec_state_budget_gb=40), "'codec_state_budget_gb' (the closest known one is 'codec_state_budget_gib')"),
        (dict(codec_pool_kinds="paged"), "'codec_pool_kinds' (the closest known one is 'codec_pool_kind')"),
        (dict(codec_ring_semantic="exact"), "'codec_ring_semantic' (the closest known one is 'codec_ring_semantics')"),
        (
            dict(codec_ring_semantic="exact", codec_dtpye="float32", codec_dtype="auto"),
            "'codec_dtpye' (the closest known one is 'codec_dtype'), "
            "'codec_ring_semantic' (the closest known one is 'codec_ring_semantics')",
        ),
        # Another case is another field, read by nobody.
        (dict(Codec_dtype="float32"), "'Codec_dtype' (the closest known one is 'codec_dtype')"),
        (dict(CODEC_POOL_KIND="paged"), "'CODEC_POOL_KIND' (the closest known one is 'codec_pool_kind')"),
        # So is another separator.
        ({"codec-dtype": "float32"}, "'codec-dtype' (the closest known one is 'codec_dtype')"),
        ({"Codec Pool-Kind": "paged"}, "'Codec Pool-Kind' (the closest known one is 'codec_pool_kind')"),
        # A name starting with "codec" but not "codec_", and a one-letter slip of a known name.
        (dict(codecs_dtype="float32"), "'codecs_dtype' (the closest known one is 'codec_dtype')"),
        (dict(codecdtype="float32"), "'codecdtype' (the closest known one is 'codec_dtype')"),
        (dict(kodec_pool_kind="paged"), "'kodec_pool_kind' (the closest known one is 'codec_pool_kind')"),
    ],
)
def test_unknown_codec_option_is_refused_naming_the_closest_known_one(tmp_path, fields, named):
    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    with pytest.raises(ValueError) as err:
        MossTTSCodecDecoder(vllm_config=vllm_config(tmp_path, 11, **fields))
    assert str(err.value) == f"unknown codec option in the stage's hf_config (hf_overrides): {named}"


def test_codec_options_are_checked_on_upstreams_config_class_with_hf_overrides(tmp_path):
    """vLLM applies ``hf_overrides`` with ``PretrainedConfig.update``; upstream's config class carries
    ``codec_model_name_or_path`` itself (``configuration_moss_tts.py``)."""
    from vllm_omni.model_executor.models.moss_tts.configuration_moss_tts import MossTTSDelayConfig

    from vllm_omni_moss.model_executor.models.moss_tts.stage_options import StageOptions

    def options(overrides: dict) -> StageOptions:
        config = vllm_config(tmp_path, 11)
        hf = MossTTSDelayConfig(n_vq=12, codec_model_name_or_path=str(tmp_path))
        hf.update(overrides)
        config.model_config.hf_config = hf
        return StageOptions.from_vllm_config(config)

    assert options({"codec_pool_kind": "paged", "codec_attention_backend": "sdpa"}).pool_kind == "paged"
    with pytest.raises(ValueError) as err:
        options({"codec_pool_kindd": "paged"})
    assert str(err.value) == (
        "unknown codec option in the stage's hf_config (hf_overrides): "
        "'codec_pool_kindd' (the closest known one is 'codec_pool_kind')"
    )


def test_every_codec_key_is_accepted_and_only_they_can_be_read(tmp_path):
    from types import SimpleNamespace

    from vllm_omni_moss.model_executor.models.moss_tts.stage_options import CODEC_KEYS, StageOptions, _CodecFields

    values = dict(
        codec_dtype="float32", codec_attention_backend="sdpa", codec_ring_semantics="exact", codec_pool_kind="paged",
        codec_state_budget_gib=2.0, codec_expected_stream_seconds=4.0, codec_graph_memory_gib=1.0,
        codec_dummy_preset="v1",
    )  # fmt: skip
    assert set(values) | {"codec_model_name_or_path"} == set(CODEC_KEYS)
    got = StageOptions.from_vllm_config(vllm_config(tmp_path, 11, **values))
    assert (got.codec_path, got.codec_dtype, got.attention_backend, got.ring_semantics, got.pool_kind) == (
        str(tmp_path), "float32", "sdpa", "exact", "paged"
    )  # fmt: skip
    assert (got.state_budget_bytes, got.expected_stream_seconds, got.graph_memory_bytes) == (2 << 30, 4.0, 1 << 30)
    assert got.dummy_preset is None  # read only under vLLM's dummy load format (test_stage_dummy_load.py)
    fields = _CodecFields(SimpleNamespace(codec_dtype="auto", codec_bogus=1))
    assert fields.codec_dtype == "auto" and getattr(fields, "codec_pool_kind", None) is None
    with pytest.raises(KeyError, match="'codec_bogus' is read from the hf_config but CODEC_KEYS does not list it"):
        getattr(fields, "codec_bogus", None)


def test_state_budget_too_small_for_one_stream_fails_at_load_naming_the_minimum(tmp_path):
    # Without graphs (enforce_eager) the session is otherwise built on the first batch: a budget makes the
    # stage build it at load, so a bad budget fails the deployment, not every request.
    with pytest.raises(
        ValueError,
        match=r"a state budget of 1073 bytes holds no stream: one stream's full rings "
        r"plus the null pages need \d+ bytes",
    ):
        build_stage(tmp_path, "tiny-v2", codec_state_budget_gib=1e-6)


@pytest.mark.parametrize("preset", ["tiny-v1", "tiny-v2"])
def test_auto_precision_on_cpu_is_float32_and_logged(tmp_path, caplog, session_kwargs, preset):
    with caplog.at_level(logging.INFO, logger=STAGE):
        stage = build_stage(tmp_path, preset)
    assert {p.dtype for p in stage._codec.parameters()} == {torch.float32}
    assert stage._codec.lut.dtype == torch.float32
    run(stage, [torch.zeros(stage.n_vq, 1)], [delay_info()], ["a"])
    assert session_kwargs["spec"].dtype == torch.float32
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MOSS codec decoder loaded")]
    assert "precision float32 (weights, decode table and state rings; codec_dtype=auto)" in line


def test_codec_dtype_override_casts_weights_table_and_rings(tmp_path, caplog, session_kwargs):
    with caplog.at_level(logging.INFO, logger=STAGE):
        stage = build_stage(tmp_path, "tiny-v2", codec_dtype="bfloat16")
    assert {p.dtype for p in stage._codec.parameters()} == {torch.bfloat16}
    assert stage._codec.lut.dtype == torch.bfloat16
    wav = run(stage, [torch.ones(stage.n_vq, 2)], [delay_info()], ["a"])[0]
    assert session_kwargs["spec"].dtype == torch.bfloat16
    assert wav.dtype == torch.float32 and wav.shape[-1] == 2 * stage._codec.config.samples_per_frame
    assert any(
        "precision bfloat16 (weights, decode table and state rings; codec_dtype=bfloat16)" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize("preset", ["tiny-v1", "tiny-v2"])
def test_float32_codec_keeps_its_checkpoint_values_under_vllms_default_dtype(tmp_path, preset):
    """vLLM calls load_weights under ``set_default_torch_dtype(model_config.dtype)`` (model_loader/base_loader.py),
    bfloat16 for MOSS-TTS checkpoints: the float32 codec must still hold the checkpoint's float32 values."""
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_omni_moss.model_executor.models.moss_tts.checkpoint import save_random_checkpoint
    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    codec_dir = save_random_checkpoint(preset, tmp_path / preset, seed=0)

    def loaded():
        stage = MossTTSCodecDecoder(vllm_config=vllm_config(codec_dir, 11))
        stage.load_weights(iter([]))
        return stage._codec.state_dict()

    want = loaded()
    with set_default_torch_dtype(torch.bfloat16):
        got = loaded()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name


@pytest.mark.cuda
@pytest.mark.parametrize(("preset", "dtype"), [("tiny-v1", torch.float32), ("tiny-v2", torch.bfloat16)])
def test_auto_precision_on_cuda_follows_upstream(tmp_path, session_kwargs, preset, dtype):
    stage = build_stage(tmp_path, preset, device="cuda")
    assert {p.dtype for p in stage._codec.parameters()} == {dtype} and stage._codec.lut.dtype == dtype
    assert stage._codec.device.type == "cuda"
    run(stage, [torch.zeros(stage.n_vq, 1)], [delay_info()], ["a"])
    assert session_kwargs["spec"].dtype == dtype


# ----------------------------------------------------------------------------- chunk schedule


@pytest.mark.parametrize(
    ("extra", "sizes"),
    [
        ({}, [15]),  # vLLM-Omni's talker sends 15-frame chunks without a steady size
        ({"initial_codec_chunk_frames": 1, "codec_chunk_frames": 15}, [1, 15]),
        ({"initial_codec_chunk_frames": 0, "codec_chunk_frames": 15}, [15]),
        ({"codec_chunk_ramp": [1, 4, 15], "codec_chunk_frames": 15}, [1, 4, 15]),
        ({"codec_chunk_ramp": "1, 4, 8", "codec_chunk_frames": 15}, [1, 4, 8, 15]),
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
        ({"codec_chunk_frames": [3, 4]}, "connector extra codec_chunk_frames must be one frame count, got [3, 4]"),
        (
            {"initial_codec_chunk_frames": "1,2", "codec_chunk_frames": 6},
            "connector extra initial_codec_chunk_frames must be one frame count, got '1,2'",
        ),
        (
            {"codec_chunk_frame": 6},
            "connector extra names a key neither this package nor vLLM-Omni 0.30.0 reads: 'codec_chunk_frame' "
            "(did you mean 'codec_chunk_frames'?). " + SCHEDULE,
        ),
        (
            {"codec_chunk_ramps": [1, 2, 4], "codec_chunk_frames": 6},
            "connector extra names a key neither this package nor vLLM-Omni 0.30.0 reads: 'codec_chunk_ramps' "
            "(did you mean 'codec_chunk_ramp'?). " + SCHEDULE,
        ),
        (  # YAML and command lines spell options with hyphens
            {"codec-chunk-frames": 6},
            "connector extra names a key neither this package nor vLLM-Omni 0.30.0 reads: 'codec-chunk-frames' "
            "(did you mean 'codec_chunk_frames'?). " + SCHEDULE,
        ),
        (
            {"Codec-Chunk-Ramp": [1, 2]},
            "connector extra names a key neither this package nor vLLM-Omni 0.30.0 reads: 'Codec-Chunk-Ramp' "
            "(did you mean 'codec_chunk_ramp'?). " + SCHEDULE,
        ),
        (
            {"initial codec chunk frames": 1},
            "connector extra names a key neither this package nor vLLM-Omni 0.30.0 reads: "
            "'initial codec chunk frames' (did you mean 'initial_codec_chunk_frames'?). " + SCHEDULE,
        ),
        (
            {"Initial_Codec_Chunk_Frames": 1},
            "connector extra names a key neither this package nor vLLM-Omni 0.30.0 reads: "
            "'Initial_Codec_Chunk_Frames' (did you mean 'initial_codec_chunk_frames'?). " + SCHEDULE,
        ),
        (  # issue 51: these three started on "[] then 15" without a word (the difflib ratio was below 0.92)
            {"codec_initial_chunk_frames": 1, "codec_chunk_frames": 6},
            "connector extra names a key neither this package nor vLLM-Omni 0.30.0 reads: "
            "'codec_initial_chunk_frames' (did you mean 'initial_codec_chunk_frames'?). " + SCHEDULE,
        ),
        (
            {"initial_chunk_frames": 1, "codec_chunk_frames": 6},
            "connector extra names a key neither this package nor vLLM-Omni 0.30.0 reads: "
            "'initial_chunk_frames' (did you mean 'initial_codec_chunk_frames'?). " + SCHEDULE,
        ),
        (
            {"codec_ramp": [1, 2, 4], "codec_chunk_frames": 6},
            "connector extra names a key neither this package nor vLLM-Omni 0.30.0 reads: 'codec_ramp' "
            "(did you mean 'codec_chunk_ramp'?). " + SCHEDULE,
        ),
        (  # every unknown key is named, sorted
            {"codec_ramp": [1, 2], "initial_chunk_frames": 1, "codec_chunk_frames": 6},
            "connector extra names a key neither this package nor vLLM-Omni 0.30.0 reads: 'codec_ramp' "
            "(did you mean 'codec_chunk_ramp'?); 'initial_chunk_frames' (did you mean "
            "'initial_codec_chunk_frames'?). " + SCHEDULE,
        ),
        (  # a codec_* key of no reader: an hf_overrides field put in the connector is read by nobody there
            {"codec_language_id": 1, "codec_chunk_frames": 6},
            "connector extra names a key neither this package nor vLLM-Omni 0.30.0 reads: 'codec_language_id' "
            "(did you mean 'codec_streaming'?). " + SCHEDULE,
        ),
        (  # a removed key is refused with its own message, before the closed set's
            {"codec_ragged_steps": True, "codec_ramp": [1, 2]},
            "connector extra 'codec_ragged_steps': codec_ragged_steps was removed: every step is ragged (packed), "
            "there is no grid step to switch from",
        ),
    ],
)
def test_connector_chunk_frames_reject_bad_values(extra, message):
    from vllm_omni_moss.model_executor.models.moss_tts.stage import connector_chunk_frames

    with pytest.raises(ValueError) as err:
        connector_chunk_frames(extra)
    assert str(err.value) == message


def test_every_known_connector_key_is_accepted_and_outside_keys_are_not_checked():
    """The closed set: every key vLLM-Omni 0.30.0 reads from a connector's extra (or sets in its own deploy files)
    passes, and so does any key outside the schedule's namespace (neither ``codec_*`` nor naming a chunk or ramp)."""
    from vllm_omni_moss.model_executor.models.moss_tts.connector_keys import KNOWN_CONNECTOR_KEYS
    from vllm_omni_moss.model_executor.models.moss_tts.stage import connector_chunk_frames

    others = dict.fromkeys(set(KNOWN_CONNECTOR_KEYS) - {"codec_chunk_ramp", "initial_codec_chunk_frames"}, 1)
    outside = {"connector_get_sleep_s": 0.005, "video_codec_options": {}, "pretrained_codec_model": "x"}
    assert connector_chunk_frames({**others, **outside, "codec_chunk_frames": 6}) == [6]


@pytest.mark.parametrize("key", ["initial_codec_frames", "initial_codec_chnk_frames", "initial_codec_chunck_frames"])
def test_a_near_miss_of_a_known_connector_key_is_refused_naming_it(key):
    """A key that names no chunk and does not start with ``codec_`` is still checked when it is a near miss of a
    known key: left unread, the 1-frame first chunk it meant to set would silently go."""
    from vllm_omni_moss.model_executor.models.moss_tts.connector_keys import check_connector_keys

    with pytest.raises(ValueError) as err:
        check_connector_keys({key: 1, "codec_chunk_frames": 6})
    assert str(err.value).startswith(
        f"connector extra names a key neither this package nor vLLM-Omni 0.30.0 reads: {key!r} "
        "(did you mean 'initial_codec_chunk_frames'?)."
    )


@pytest.mark.parametrize(
    "path",
    sorted(glob.glob(str(Path(vllm_omni_root()) / "deploy" / "*.yaml"))) if vllm_omni_root() else [],
)
def test_vllm_omnis_own_deploy_files_pass_the_connector_key_check(path):
    """Every connector extra of vLLM-Omni 0.30.0's shipped deploy files passes: the closed set misses no key it
    sets."""
    import yaml

    from vllm_omni_moss.model_executor.models.moss_tts.connector_keys import check_connector_keys

    extras = [c.get("extra") or {} for c in (yaml.safe_load(Path(path).read_text()).get("connectors") or {}).values()]
    for extra in extras:
        check_connector_keys(extra)


@pytest.mark.parametrize(("value", "shown"), [(0, "0"), (-2, "-2"), (2.0, "2.0"), ("8", "'8'"), (True, "True")])
def test_a_slot_count_that_is_not_a_positive_integer_fails_at_construction(tmp_path, value, shown):
    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    with pytest.raises(ValueError) as err:
        MossTTSCodecDecoder(vllm_config=vllm_config(tmp_path, 11, max_num_seqs=value))
    assert str(err.value) == (
        f"scheduler_config.max_num_seqs must be an integer >= 1 (the codec stage's slot count), got {shown}"
    )


def test_ramp_sets_graph_frame_sizes_and_longest_step(tmp_path, session_kwargs):
    extra = {"codec_chunk_ramp": [1, 4, 15], "codec_chunk_frames": 15}
    stage = build_stage(tmp_path, extra=extra)
    assert stage.graph_frame_sizes == [1, 4, 15] and stage.max_step_frames == 15
    run(stage, [torch.zeros(stage.n_vq, 1)], [delay_info()], ["a"])
    options = session_kwargs["options"]  # one record, built once from the stage's options
    assert options == stage.options.session_options() and stage._session.options is options
    assert options.graph_frame_sizes == (1, 4, 15) and options.max_step_frames == 15
    assert (options.max_waiting_streams, options.max_waiting_frames) == (
        stage.state_capacity,
        stage.state_capacity * 1024,
    )
    bare = build_stage(tmp_path, extra={})  # the talker's default: 15-frame chunks
    assert bare.graph_frame_sizes == [15] and bare.max_step_frames == 15


# ----------------------------------------------------------------------------- compile adapters


def test_vllm_adapter_class_is_built_once_per_core_adapter_class(tmp_path):
    from moss_codecs import build_decoder, make_state_pool

    from vllm_omni_moss.model_executor.models.moss_tts.compile import adapter_class_for
    from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS
    from vllm_omni_moss.model_executor.models.moss_tts.vllm_compile import vllm_adapter_class as _vllm_adapter_class

    bases = [
        adapter_class_for(make_state_pool(build_decoder(PRESETS[p], tmp_path / p))) for p in ("tiny-v1", "tiny-v2")
    ]
    assert bases[0] is not bases[1]
    built = [_vllm_adapter_class(b) for b in bases]
    assert [_vllm_adapter_class(b) for b in bases] == built  # cached per base class
    for base, cls in zip(bases, built):
        assert issubclass(cls, base) and cls is not base
        assert cls.__name__ == f"Vllm{base.__name__}" and cls.__module__ == STAGE.rsplit(".", 1)[0] + ".vllm_compile"


# ----------------------------------------------------------------------------- deploy files


DEPLOY_FILES = ["moss_tts_local_c64.yaml", "moss_tts_local_c128.yaml", "moss_tts_local_h200.yaml"]
DEPLOY_DIR = Path(__file__).resolve().parents[4] / "deploy"
# The fork form (scripts/build_fork.sh) carries these tests into a tree without this repository's deploy files.
needs_deploy_files = pytest.mark.skipif(
    not (DEPLOY_DIR / DEPLOY_FILES[-1]).exists(), reason="this tree has no vllm-omni-moss deploy/ files"
)


@needs_deploy_files
@pytest.mark.parametrize("name", DEPLOY_FILES)
def test_deploy_files_name_a_codec_dtype_and_a_token_budget_for_full_batches(name):

    import yaml

    from vllm_omni_moss.model_executor.models.moss_tts.stage import CODEC_DTYPES, connector_chunk_frames

    deploy = yaml.safe_load((DEPLOY_DIR / name).read_text())
    (codec,) = [s for s in deploy["stages"] if s["stage_id"] == 1]
    assert codec["hf_overrides"]["codec_dtype"] in CODEC_DTYPES
    chunk = max(connector_chunk_frames(deploy["connectors"]["shm"]["extra"]))
    n_vq = 12  # MOSS-TTS Local Transformer v1.5, the model these files serve
    assert codec["max_num_batched_tokens"] >= codec["max_num_seqs"] * n_vq * chunk  # docs/serving_stage.md


@needs_deploy_files
@pytest.mark.parametrize("name", DEPLOY_FILES)
def test_deploy_files_capture_a_graph_for_every_batch(name):

    import yaml

    deploy = yaml.safe_load((DEPLOY_DIR / name).read_text())
    (codec,) = [s for s in deploy["stages"] if s["stage_id"] == 1]
    sizes = codec["compilation_config"]["cudagraph_capture_sizes"]
    assert sizes == sorted(sizes) and sizes[0] == 1 and sizes[-1] == codec["max_num_seqs"]
    assert codec["enforce_eager"] is False


@needs_deploy_files
def test_h200_deploy_file_fits_stage_1_state_in_its_share():
    """The arithmetic stated in deploy/moss_tts_local_h200.yaml (docs/memory.md)."""

    import yaml

    from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
    from vllm_omni_moss.model_executor.models.moss_tts.state import state_bytes_for

    deploy = yaml.safe_load((DEPLOY_DIR / "moss_tts_local_h200.yaml").read_text())
    (codec,) = [s for s in deploy["stages"] if s["stage_id"] == 1]
    share = codec["gpu_memory_utilization"] * 139.8 * 2**30
    weights, graphs = 2.1 * 2**30, 4 * 2**30
    cfg = preset_config("v2")
    ours = state_bytes_for(cfg, codec["max_num_seqs"] + 1, "compact")
    assert ours + weights + graphs <= share
    assert (
        state_bytes_for(cfg, 433, "compact") + weights + graphs
        <= share
        < state_bytes_for(cfg, 434, "compact") + weights + graphs
    )
    # Upstream's 256 streams on 2 x 256 slots do not fit the same share.
    assert state_bytes_for(cfg, 512, "legacy") > share


def test_the_stage_captures_the_graph_ladder_of_its_slots(tmp_path):
    """The step shapes' packed frame totals follow the package's ladder up to max_num_seqs x the largest chunk
    size (vLLM's cudagraph_capture_sizes is not read; none under enforce_eager), and the graph-memory budget
    comes from codec_graph_memory_gib (default 24 GiB)."""
    from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import StepLadder, frame_totals
    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    stage = MossTTSCodecDecoder(vllm_config=vllm_config(tmp_path, 11, max_num_seqs=300, enforce_eager=False))
    totals = stage.graph_frame_totals
    assert stage.graph_frame_sizes == [1, 3] and totals == frame_totals(300 * 3) and totals[-1] == 900
    assert totals[:64] == list(range(1, 65)) and totals[64:68] == [66, 68, 70, 72]  # then at most 1/32 apart
    assert stage.options.session_options().step_ladder == StepLadder(300, 3, tuple(totals))
    eager = MossTTSCodecDecoder(vllm_config=vllm_config(tmp_path, 11, max_num_seqs=300))
    assert eager.graph_frame_totals == [] and eager.options.session_options().step_ladder == StepLadder(300, 3)
    assert stage.options.graph_memory_bytes == 24 * 2**30
    sized = vllm_config(tmp_path, 11, max_num_seqs=300, enforce_eager=False, codec_graph_memory_gib=1.5)
    assert MossTTSCodecDecoder(vllm_config=sized).options.graph_memory_bytes == 3 * 2**29
    with pytest.raises(ValueError) as err:
        MossTTSCodecDecoder(vllm_config=vllm_config(tmp_path, 11, codec_graph_memory_gib=0))
    assert str(err.value) == "codec_graph_memory_gib must be a finite number of GiB > 0, got 0"


def test_the_removed_codec_ragged_steps_is_refused_at_startup_whatever_its_value(tmp_path):
    """Every step is ragged now: naming codec_ragged_steps (true or false) is a startup error saying it was
    removed, never a silent no-op; the key is no longer a known codec option."""
    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder
    from vllm_omni_moss.model_executor.models.moss_tts.stage_options import CODEC_KEYS, StageOptions

    assert "codec_ragged_steps" not in CODEC_KEYS
    for value in (True, False, "true"):
        for build in (StageOptions.from_vllm_config, lambda c: MossTTSCodecDecoder(vllm_config=c)):
            with pytest.raises(ValueError) as err:
                build(vllm_config(tmp_path, 11, codec_ragged_steps=value))
            assert str(err.value) == (
                "codec option 'codec_ragged_steps' in the stage's hf_config (hf_overrides) was removed: every step "
                'is ragged now (one packed step per round, docs/serving.md "Steps"); there is no other step layout '
                "to choose; delete it from the deploy file"
            )
