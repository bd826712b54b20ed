# SPDX-License-Identifier: Apache-2.0
"""The multi-GPU deploy files, loaded the way vLLM-Omni 0.30.0 loads them (needs vllm + vllm-omni; CPU is enough).

Each file goes through vLLM-Omni's own deploy-config loader (``config/stage_config.py``: ``load_deploy_config``,
``base_config`` inheritance, ``merge_pipeline_deploy`` with the MOSS-TTS-Local pipeline) and its transfer-config
loader, and:

* gives Stage 1 the slots, graph ladder (``graph_ladder.frame_totals(max_num_seqs x the largest chunk size)``,
  the stage's own: vLLM's ``cudagraph_capture_sizes`` is not read) and memory share its comments state, and a state that fits that share (``deploy_sizing.check_stage_state``, as the stage checks at
  startup) within the streams one H200 held at the SLO;
* places its replicas on the GPUs its comments name (vLLM-Omni's ``split_devices_for_replicas``);
* resolves Stage 1 to this package's class in a fresh process set up as that replica's process, with the slots
  and graphs the file gives, as in the single-GPU deploy.

A deploy file whose Stage 1 slots do not fit its share fails with the message naming slots, bytes per slot and
share.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_omni_moss.model_executor.models.moss_tts.deploy_sizing import (
    STEP_RESERVE_BYTES,
    MemoryShare,
    check_stage_state,
    slots_that_fit,
)
from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import frame_totals

pytestmark = [pytest.mark.vllm, pytest.mark.cpu, pytest.mark.core_model]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DIR = ROOT / "deploy"
ARCH = "MossTTSCodecDecoder"
OURS = "vllm_omni_moss.model_executor.models.moss_tts.stage"
GIB = 2**30
H200 = round(139.8 * GIB)  # the H200's total memory the files' arithmetic uses (139.80 GiB)
SLOT = 88_678_400  # one v2 slot of bf16 rings (docs/memory.md)
WEIGHTS = 2_172_687_872  # the v2 decoder in bf16 (test_deploy_sizing.py checks it against the module)
N_VQ = 12  # MOSS-TTS Local Transformer v1.5
# The most streams the compact pool held on one H200 at the 150 ms p99 SLO under staggered and Poisson arrivals
# (measured at 0342c51, benchmarks/RESULTS.md "Serving at scale"; with all streams starting together: 256 at 1455723).
STREAMS_AT_SLO = 1024

# file -> (Stage 0 devices per replica, Stage 1 devices per replica), as the files' comments state.
LAYOUTS = {
    "moss_tts_local_2gpu.yaml": (["0"], ["1"]),
    "moss_tts_local_8gpu.yaml": (["0", "1", "2", "3", "4", "5", "6"], ["7"]),
}


def _stages(path: Path):
    """``(deploy, {stage_id: (engine_args, runtime)})`` as vLLM-Omni resolves ``path``."""
    from vllm_omni.config.stage_config import load_deploy_config, merge_pipeline_deploy
    from vllm_omni.model_executor.models.moss_tts.pipeline import MOSS_TTS_LOCAL_PIPELINE

    deploy = load_deploy_config(path)
    resolved = {}
    for stage in merge_pipeline_deploy(MOSS_TTS_LOCAL_PIPELINE, deploy):
        cfg = stage.to_omegaconf()
        resolved[stage.stage_id] = (_plain(cfg.engine_args), _plain(cfg.runtime))
    return deploy, resolved


def _schedule(path: Path):
    """The chunk schedule of ``path`` as vLLM-Omni's loader resolves it (an overlay's keys over its
    ``base_config``'s), checked to be one for both stages (``talker_chunker.deploy_chunk_schedule``)."""
    from vllm_omni_moss.model_executor.models.moss_tts.talker_chunker import deploy_chunk_schedule

    return deploy_chunk_schedule(str(path))


def _plain(node) -> dict:
    from vllm_omni.config.yaml_util import to_dict

    return to_dict(node)


def _upstream_function(relative: str, name: str):
    """One top-level function of an installed vLLM-Omni module, run from the wheel's own source. Used where the
    module's import chain needs a package the CPU lane removes (``engine/stage_init_utils.py`` reaches
    torchvision through ``config/pipeline_registry.py``); the function itself needs only builtins."""
    import vllm_omni

    source = (Path(vllm_omni.__file__).parent / relative).read_text(encoding="utf-8")
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
    namespace: dict = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), relative, "exec"), namespace)
    return namespace[name]


def _codec_state_check(engine_args: dict, device_bytes: int = H200) -> None:
    """``check_stage_state`` fed by a loaded Stage 1, as the stage feeds it at startup (compact pool: v2 codec,
    no ``codec_pool_kind`` or budget in these files)."""
    hf = engine_args.get("hf_overrides") or {}
    budget = hf.get("codec_state_budget_gib")
    check_stage_state(
        max_num_seqs=engine_args["max_num_seqs"],
        pool_kind=hf.get("codec_pool_kind") or "compact",
        bytes_per_slot=SLOT,
        share=MemoryShare(engine_args["gpu_memory_utilization"], device_bytes),
        reserved_bytes=WEIGHTS + STEP_RESERVE_BYTES,
        graph_rows=max(engine_args["compilation_config"]["cudagraph_capture_sizes"]),
        state_budget_bytes=None if budget is None else int(budget * GIB),
    )


CHUNKER = "vllm_omni_moss.model_executor.models.moss_tts.talker_chunker.talker2codec_ramp_async_chunk"


@pytest.mark.parametrize("name", sorted(p.name for p in DEPLOY_DIR.glob("*.yaml")))
def test_deploy_schedule_is_one_ramp_for_the_talker_chunker_and_the_stage_graphs(name):
    """Every file sends the ramp 1, 1, 2, 4, 6 then 6 frames from this package's chunker (vLLM-Omni's reads no
    ramp), selected through ``engine_extras``, and Stage 1 captures exactly the sizes it sends. At talker RTF 0.5
    (40 ms a frame) chunk ``i`` is out at ``40 cum(i)`` ms and playback needs it at ``40 s0 + 80 cum(i - 1)`` ms:
    the slack the files' comments state."""
    import importlib

    path = DEPLOY_DIR / name
    schedule = _schedule(path)
    assert (schedule.ramp, schedule.steady) == ((1, 1, 2, 4, 6), 6)
    _, stages = _stages(path)
    talker, codec = stages[0][0], stages[1][0]
    assert talker["custom_process_next_stage_input_func"] == CHUNKER
    module, func = CHUNKER.rsplit(".", 1)
    assert callable(getattr(importlib.import_module(module), func))
    assert _replica_process(path, "0")["frames"] == schedule.frame_sizes == [1, 2, 4, 6]
    cum = [sum(schedule.size(k) for k in range(i + 1)) for i in range(6)]
    slack = [40 * schedule.size(0) + 80 * cum[i - 1] - 40 * cum[i] for i in range(1, 6)]
    assert slack == [40, 40, 40, 120, 360]
    stall = sum(max(0, 80 * (schedule.size(i) - schedule.size(i - 1))) for i in range(1, 6))  # RTF 1.0
    assert stall == 400
    text = path.read_text(encoding="utf-8")
    assert "base_config" in text or ("40, 40, 40, 120 and 360 ms" in text and "stalls 400 ms" in text)
    assert codec["max_num_batched_tokens"] >= codec["max_num_seqs"] * N_VQ * schedule.steady


def test_deploy_file_whose_stages_name_two_schedules_fails_naming_both(tmp_path):
    bad = tmp_path / "two_schedules.yaml"
    bad.write_text(
        f"base_config: {DEPLOY_DIR / 'moss_tts_local_2gpu.yaml'}\n"
        "connectors:\n"
        "  shm_codec:\n"
        "    name: SharedMemoryConnector\n"
        "    extra: {codec_chunk_ramp: [1, 4], codec_chunk_frames: 8}\n"
        "stages:\n"
        "  - stage_id: 1\n"
        "    input_connectors: {from_stage_0: shm_codec}\n",
        encoding="utf-8",
    )
    with pytest.raises(ValueError) as err:
        _schedule(bad)
    assert str(err.value) == (
        f"{bad}: Stage 0's connector 'shm' sends chunks [1, 1, 2, 4, 6] then 6 but Stage 1's connector 'shm_codec' "
        "expects [1, 4] then 8; vLLM-Omni would hand both stages Stage 0's: name one connector"
    )


@pytest.mark.parametrize("ends", [("to_stage_1",), ("from_stage_0",), ("to_stage_1", "from_stage_0")])
def test_deploy_file_naming_a_connector_it_does_not_define_fails_naming_it(tmp_path, ends):
    """The check read an undefined name as a connector without keys: 15-frame chunks, so a misspelt name on one
    stage was reported as two schedules, and on both stages it passed with a schedule nobody set (vLLM-Omni's
    ``load_omni_transfer_config`` refuses such a file when serving it)."""
    text = (DEPLOY_DIR / "moss_tts_local_h200.yaml").read_text(encoding="utf-8")
    for end in ends:
        assert f"{end}: shm\n" in text
        text = text.replace(f"{end}: shm\n", f"{end}: shmm\n")
    bad = tmp_path / "undefined.yaml"
    bad.write_text(text, encoding="utf-8")
    label = "Stage 0" if ends[0] == "to_stage_1" else "Stage 1"
    with pytest.raises(ValueError) as err:
        _schedule(bad)
    assert str(err.value) == f"{bad}: {label}'s connector 'shmm' is none of the file's connectors ('shm')"


def test_deploy_file_with_a_misspelt_schedule_key_fails_naming_it(tmp_path):
    """A misspelt key would be read by nobody: both stages would run 15-frame chunks, without the ramp."""
    bad = tmp_path / "misspelt.yaml"
    bad.write_text(
        f"base_config: {DEPLOY_DIR / 'moss_tts_local_2gpu.yaml'}\n"
        "connectors:\n"
        "  shm:\n"
        "    name: SharedMemoryConnector\n"
        "    extra: {codec_chunk_ramps: [1, 1, 2, 4, 6], codec_chunk_frames: 6}\n",
        encoding="utf-8",
    )
    with pytest.raises(ValueError) as err:
        _schedule(bad)
    assert str(err.value) == (
        "connector extra names a key neither this package nor vLLM-Omni 0.30.0 reads: 'codec_chunk_ramps' "
        "(did you mean 'codec_chunk_ramp'?). The chunk schedule's keys: codec_chunk_frames, codec_chunk_ramp, "
        "initial_codec_chunk_frames"
    )


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_deploy_file_gives_stage_1_the_slots_ladder_and_memory_its_comments_state(name):
    path = DEPLOY_DIR / name
    _, stages = _stages(path)
    codec, runtime = stages[1]
    n = codec["max_num_seqs"]
    assert codec["model_arch"] == ARCH and codec["enforce_eager"] is False
    _assert_capture_sizes_end_at_the_slots(codec)
    # vLLM keeps only capture sizes <= max_num_batched_tokens (vllm/config/vllm.py, _set_cudagraph_sizes).
    schedule = _schedule(path)
    assert codec["max_num_batched_tokens"] >= n * N_VQ * schedule.steady  # full batches of steady chunks
    assert codec["max_num_batched_tokens"] >= max(codec["compilation_config"]["cudagraph_capture_sizes"])
    # The stage's own ladder: packed frame totals up to the slots x the largest chunk size.
    largest = max(schedule.frame_sizes)
    totals = frame_totals(n * largest)
    share = MemoryShare(codec["gpu_memory_utilization"], H200)
    slots, state = n + 1, (n + 1) * SLOT
    fit = slots_that_fit(SLOT, share, WEIGHTS + STEP_RESERVE_BYTES)
    _codec_state_check(codec)
    assert slots <= fit and n <= STREAMS_AT_SLO
    # The header states these figures; the overlay file states the ones it inherits.
    text = path.read_text(encoding="utf-8")
    for stated in (
        f"{slots:,} slots x {SLOT:,} B = {state:,} B",
        f"{state / GIB:.2f} GiB",
        f"{codec['gpu_memory_utilization']:.2f} x 139.80 GiB = {share.bytes / GIB:.2f} GiB"
        if "base_config" in text
        else f"gpu_memory_utilization {codec['gpu_memory_utilization']:.2f} of 139.80 GiB",
        f"{share.bytes / GIB:.2f} GiB",
        f"{fit:,} slots",
        f"graph_ladder.frame_totals({n} x {largest})",
        f"{len(totals)} packed frame totals",
        f"1 to {totals[-1]:,}",
        "0342c51",
        "0702d10",
    ):
        assert stated in text, stated
    assert runtime["num_replicas"] == 1


@pytest.mark.parametrize("path", sorted(DEPLOY_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_deploy_file_gives_vllm_capture_sizes_up_to_its_slots_and_fits_stage_1_state(path):
    _, stages = _stages(path)
    codec = stages[1][0]
    _assert_capture_sizes_end_at_the_slots(codec)
    _codec_state_check(codec)


def _assert_capture_sizes_end_at_the_slots(codec: dict) -> None:
    """vLLM's ``cudagraph_capture_sizes`` of Stage 1, as written (the stage does not read them: it shapes its steps
    by its own ladder): distinct, ascending from 1, ending at ``max_num_seqs``."""
    sizes = codec["compilation_config"]["cudagraph_capture_sizes"]
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == codec["max_num_seqs"], sizes


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_deploy_file_places_replicas_where_its_comments_say(name):
    split = _upstream_function("engine/stage_init_utils.py", "split_devices_for_replicas")
    _, stages = _stages(DEPLOY_DIR / name)
    for stage_id, want in enumerate(LAYOUTS[name]):
        engine_args, runtime = stages[stage_id]
        # One device per replica: no tensor, data or pipeline parallelism (get_stage_devices_per_replica).
        assert not {"tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"} & set(engine_args)
        assert runtime["num_replicas"] == len(want)
        assert split(runtime["devices"], runtime["num_replicas"], 1, stage_id) == want


def test_8gpu_deploy_file_feeds_one_codec_replica_all_talker_streams():
    _, stages = _stages(DEPLOY_DIR / "moss_tts_local_8gpu.yaml")
    (talker, talker_rt), (codec, codec_rt) = stages[0], stages[1]
    streams = talker_rt["num_replicas"] * talker["max_num_seqs"]
    assert streams == 896 and codec_rt["num_replicas"] == 1
    assert streams <= codec["max_num_seqs"] <= STREAMS_AT_SLO
    text = (DEPLOY_DIR / "moss_tts_local_8gpu.yaml").read_text(encoding="utf-8")
    assert f"7 talker replicas x max_num_seqs {talker['max_num_seqs']} = {streams} live streams" in text
    # Inherited from the 2-GPU file through base_config: the same Stage 1 apart from its device.
    _, base = _stages(DEPLOY_DIR / "moss_tts_local_2gpu.yaml")
    assert {k: v for k, v in codec.items() if k != "devices"} == {k: v for k, v in base[1][0].items() if k != "devices"}
    # At the 2-GPU file's 256 talker streams per GPU, seven talkers would not fit one codec GPU.
    with pytest.raises(ValueError, match=r"^Stage 1 max_num_seqs=1792 needs 1793 slots x 88678400 bytes"):
        _codec_state_check(dict(codec, max_num_seqs=7 * base[0][0]["max_num_seqs"]))


def test_deploy_file_whose_stage_1_slots_exceed_its_share_fails_naming_slots_bytes_and_share(tmp_path):
    # An overlay, as a user would write one, on the 2-GPU file: 2048 codec slots on the same 90% share.
    bad = tmp_path / "too_many_codec_slots.yaml"
    bad.write_text(
        f"base_config: {DEPLOY_DIR / 'moss_tts_local_2gpu.yaml'}\n"
        "stages:\n"
        "  - stage_id: 1\n"
        "    max_num_seqs: 2048\n"
        "    compilation_config:\n      cudagraph_capture_sizes: [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]\n",
        encoding="utf-8",
    )
    _, stages = _stages(bad)
    codec = stages[1][0]
    assert codec["max_num_seqs"] == 2048 and codec["gpu_memory_utilization"] == 0.9
    with pytest.raises(ValueError) as err:
        _codec_state_check(codec)
    assert str(err.value) == (
        "Stage 1 max_num_seqs=2048 needs 2049 slots x 88678400 bytes = 181702041600 bytes (169.22 GiB) of decoder "
        "state, but its memory share (gpu_memory_utilization 0.9 of 139.80 GiB = 125.82 GiB), less 6.02 GiB for "
        "the codec weights, CUDA graphs and step activations, holds 1450 slots: lower max_num_seqs or raise "
        "gpu_memory_utilization"
    )


# A replica process: vLLM-Omni narrows CUDA_VISIBLE_DEVICES to the replica's devices (entrypoints/stage_utils.py,
# set_stage_devices) and loads the general plugins before building the model (engine/arg_utils.py and
# worker/mixins.py: load_omni_general_plugins). The model is then resolved by its architecture and built from the
# stage's engine arguments and connector spec (engine/arg_utils.py, create_model_config).
_REPLICA = r"""
import json, os, sys
from types import SimpleNamespace as NS
import torch
from vllm_omni.config.stage_config import load_deploy_config, merge_pipeline_deploy, resolve_deploy_yaml
from vllm_omni.config.yaml_util import to_dict
from vllm_omni.distributed.omni_connectors.utils.initialization import get_stage_connector_config, load_omni_transfer_config
from vllm_omni.model_executor.models.moss_tts.pipeline import MOSS_TTS_LOCAL_PIPELINE
from vllm_omni.model_executor.models.registry import OmniModelRegistry
from vllm_omni.plugins import load_omni_general_plugins

path = sys.argv[1]
(codec,) = [s for s in merge_pipeline_deploy(MOSS_TTS_LOCAL_PIPELINE, load_deploy_config(path)) if s.stage_id == 1]
args = to_dict(codec.to_omegaconf().engine_args)
transfer = load_omni_transfer_config(config_dict=resolve_deploy_yaml(path))
(spec,) = [c["spec"] for c in get_stage_connector_config(transfer, 1).values()]
load_omni_general_plugins()
cls, arch = OmniModelRegistry.resolve_model_cls(
    [args["model_arch"]], NS(model_impl="auto", convert_type="none", runner_type="generate")
)
vllm_config = NS(
    model_config=NS(
        hf_config=NS(n_vq=12, **(args.get("hf_overrides") or {})),
        async_chunk=args["async_chunk"],
        enforce_eager=args["enforce_eager"],
        stage_connector_config={"name": spec["name"], "extra": dict(spec["extra"], stage_id=1)},
    ),
    scheduler_config=NS(max_num_seqs=args["max_num_seqs"], max_num_batched_tokens=args["max_num_batched_tokens"]),
    compilation_config=NS(cudagraph_capture_sizes=args["compilation_config"]["cudagraph_capture_sizes"]),
    device_config=NS(device=torch.device("cpu")),
    load_config=NS(download_dir=None),
)
stage = cls(vllm_config=vllm_config)
print("REPLICA " + json.dumps({
    "cls": f"{cls.__module__}:{cls.__name__}", "arch": arch, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "slots": stage.state_capacity, "totals": stage.graph_frame_totals, "frames": stage.graph_frame_sizes,
    "tokens": stage.token_budget,
}))
"""


def _replica_process(path: Path, devices: str) -> dict:
    from vllm_omni.entrypoints.stage_utils import resolve_stage_physical_devices

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    env["CUDA_VISIBLE_DEVICES"] = resolve_stage_physical_devices(1, devices, visible_baseline=None)
    out = subprocess.run(
        [sys.executable, "-c", _REPLICA, str(path)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("REPLICA ")]
    return json.loads(line.removeprefix("REPLICA "))


@pytest.mark.parametrize(
    ("name", "codec_devices"),
    [("moss_tts_local_h200.yaml", "0"), ("moss_tts_local_2gpu.yaml", "1"), ("moss_tts_local_8gpu.yaml", "7")],
)
def test_plugin_resolves_stage_1_in_a_replica_process_as_in_the_single_gpu_deploy_file(name, codec_devices):
    """The single-GPU file is the reference: every file's codec replica gets this package's class, on its own GPU,
    with the slots, graph ladder (``frame_totals(slots x the largest chunk size)``), frame sizes and token budget its
    file gives."""
    got = _replica_process(DEPLOY_DIR / name, codec_devices)
    _, stages = _stages(DEPLOY_DIR / name)
    n = stages[1][0]["max_num_seqs"]
    frame_sizes = _schedule(DEPLOY_DIR / name).frame_sizes
    assert got == {
        "cls": f"{OURS}:{ARCH}",
        "arch": ARCH,
        "visible": codec_devices,
        "slots": n,
        "totals": frame_totals(n * max(frame_sizes)),
        "frames": frame_sizes,
        "tokens": stages[1][0]["max_num_batched_tokens"],
    }
