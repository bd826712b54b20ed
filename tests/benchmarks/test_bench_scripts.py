# SPDX-License-Identifier: Apache-2.0
"""CPU smoke tests of the codec benchmark scripts: JSON shape, integer bytes, exact v2 accounting."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
from vllm_omni_moss.model_executor.models.moss_tts.state_pool import state_bytes_for

pytestmark = [pytest.mark.cpu]

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "tts"
SLOT_BYTES_V2 = 88_678_400  # bf16 K+V rings of one v2 slot (codec-facts §D.3)
LEGACY_BANK_ROWS_V2 = 190  # 2 offsets x 92 layers + 6 group offsets


def _load(name: str):
    module_name = f"_bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _assert_int_bytes(obj, path="") -> None:
    """Every key ending in ``bytes`` (at any depth) holds an int, never a float."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key.endswith("bytes") and not isinstance(value, dict):
                assert type(value) is int, f"{path}.{key} = {value!r} is not an int"
            _assert_int_bytes(value, f"{path}.{key}")
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            _assert_int_bytes(value, f"{path}[{i}]")


def test_memory_v2_meta_accounting_is_exact(tmp_path, capsys):
    out = tmp_path / "memory.json"
    result = _load("bench_codec_memory").main(
        ["--preset", "v2", "--streams", "64,128", "--device", "cpu", "--json", str(out)]
    )
    assert json.loads(out.read_text()) == result
    assert result["preset"] == "v2" and result["accounting"] == "meta"
    assert result["slot_bytes"] == SLOT_BYTES_V2
    assert set(result["arms"]) == {"legacy", "v2"}
    assert "needs a GPU" in result["skipped"]["upstream"]
    assert result["weights"]["upstream"] == {"skipped": result["skipped"]["upstream"]}
    _assert_int_bytes(result)

    for count in (64, 128):
        legacy, v2 = result["arms"]["legacy"][str(count)], result["arms"]["v2"][str(count)]
        assert legacy["slots"] == 2 * count and v2["slots"] == count + 1
        assert legacy["ring_bytes"] == 2 * count * SLOT_BYTES_V2
        assert legacy["offset_bytes"] == LEGACY_BANK_ROWS_V2 * 2 * count * 8
        assert v2["ring_bytes"] == (count + 1) * SLOT_BYTES_V2
        assert v2["offset_bytes"] == (count + 1) * 8
        for e in (legacy, v2):
            assert e["state_bytes"] == e["predicted_bytes"] == e["ring_bytes"] + e["offset_bytes"]
    # codec-facts §D.3: C128 = 22,701,670,400 B (legacy) vs 11,439,513,600 B (V2) of rings.
    assert result["arms"]["legacy"]["128"]["state_bytes"] == 22_702_059_520
    assert result["arms"]["v2"]["128"]["state_bytes"] == 11_439_514_632
    assert result["arms"]["legacy"]["64"]["state_bytes"] == 11_351_029_760
    assert result["arms"]["v2"]["64"]["state_bytes"] == 5_764_096_520
    assert result["saving_bytes"] == {"64": 5_586_933_240, "128": 11_262_544_888}
    assert result["weights"]["ours"]["param_bytes"] > 2 * 2**30  # bf16 decoder + decode table

    printed = capsys.readouterr().out
    assert "| legacy | 128 | 256 | 21.14 |" in printed
    assert "| v2 | 128 | 129 | 10.65 |" in printed


def test_memory_tiny_presets_and_arm_selection(tmp_path):
    bench = _load("bench_codec_memory")
    result = bench.main(["--preset", "tiny-v2", "--streams", "2,3", "--device", "cpu", "--arms", "legacy,v2"])
    cfg = preset_config("tiny-v2")
    for count in (2, 3):
        assert result["arms"]["legacy"][str(count)]["state_bytes"] == state_bytes_for(cfg, 2 * count, "legacy")
        assert result["arms"]["v2"][str(count)]["state_bytes"] == state_bytes_for(cfg, count + 1, "v2")
    assert "upstream" not in result["skipped"] and "upstream" not in result["weights"]

    v1 = bench.main(["--preset", "tiny-v1", "--streams", "2", "--device", "cpu", "--json", str(tmp_path / "v1.json")])
    assert set(v1["arms"]) == {"legacy"}
    assert "v1 codec" in v1["skipped"]["v2"] and "v1 codec" in v1["skipped"]["upstream"]


def test_step_eager_cpu_smoke(tmp_path):
    out = tmp_path / "step.json"
    argv = (
        "--preset tiny-v2 --batch 1,2 --frames 3 --modes eager,graph --arms legacy,v2,upstream "
        "--repeats 2 --steps-per-round 1 --warmup 0 --device cpu"
    ).split()
    result = _load("bench_codec_step").main([*argv, "--json", str(out)])
    assert json.loads(out.read_text()) == result
    _assert_int_bytes(result)
    assert result["modes"] == ["eager"] and "needs CUDA" in result["skipped"]["graph"]
    expected_arms = ["legacy", "v2", "upstream"] if "upstream" not in result["skipped"] else ["legacy", "v2"]
    assert result["arms"] == expected_arms
    assert [(r["batch"], r["frames"]) for r in result["results"]] == [(1, 3), (2, 3)]

    cfg = preset_config("tiny-v2")  # CPU pools keep fp32 rings; capacity = max batch = 2
    assert result["state_bytes"]["legacy"] == state_bytes_for(cfg, 4, "legacy", element_size=4)
    assert result["state_bytes"]["v2"] == state_bytes_for(cfg, 3, "v2", element_size=4)
    if "upstream" in expected_arms:
        # Upstream's pool = the legacy layout (same rings and offset bank) + a shared exec mask of S bools.
        assert result["state_bytes"]["upstream"] == result["state_bytes"]["legacy"] + 4
        assert result["weights_bytes"]["upstream"] > result["weights_bytes"]["ours"]  # encoder included

    for record in result["results"]:
        entry = record["modes"]["eager"]
        assert set(entry["arms"]) == set(expected_arms) and "errors" not in entry
        for stats in entry["arms"].values():
            assert stats["n"] == 2 and len(stats["samples_ms"]) == 2
            assert 0 < stats["p10_ms"] <= stats["median_ms"] <= stats["p90_ms"]
        assert entry["ratios"]["v2/legacy"] > 0
        assert (entry["ratios"]["v2/upstream"] is None) == ("upstream" not in expected_arms)


def test_common_helpers():
    common = _load("bench_codec_step").common
    assert common.parse_int_list("1, 8,8,64") == [1, 8, 64]
    with pytest.raises(ValueError):
        common.parse_int_list("0")
    with pytest.raises(ValueError):
        common.parse_str_list("eager,warp", ("eager", "graph"))
    stats = common.summarize_ms([4.0, 1.0, 3.0, 2.0])
    assert stats["median_ms"] == 2.5 and stats["p10_ms"] == pytest.approx(1.3) and stats["samples_ms"][0] == 4.0
    codes = common.random_codes(3, 12, 2, 5, 1024, common.torch.device("cpu"), seed=1)
    assert len(codes) == 3 and all(int(c.min()) >= 1 and int(c.max()) < 1024 for c in codes)
    assert not common.torch.equal(codes[0], codes[1])
    decoder = common.random_decoder("tiny-v2", "cpu", seed=2)
    again = common.random_decoder("tiny-v2", "cpu", seed=2)
    for (name, a), (_, b) in zip(decoder.state_dict().items(), again.state_dict().items()):
        assert common.torch.equal(a, b), name
        assert common.torch.count_nonzero(a) == a.numel(), f"{name} has zeros"
