# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the codec benchmark scripts: JSON shape, integer bytes, exact v2 accounting, the stage bench's
figures and SLO, and the upstream arm's driver against upstream's own pool."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
from vllm_omni_moss.model_executor.models.moss_tts.state_pool import state_bytes_for

pytestmark = [pytest.mark.cpu]

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "tts"
SLOT_BYTES_V2 = 88_678_400  # bf16 K+V rings of one v2 slot (docs/memory.md)
LEGACY_BANK_ROWS_V2 = 190  # 2 offsets x 92 layers + 6 group offsets (docs/memory.md)


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
    assert set(result["arms"]) == {"legacy", "v2", "v2-paged"}
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
    # docs/memory.md: C128 = 22,701,670,400 B (legacy) vs 11,439,513,600 B (V2) of rings.
    assert result["arms"]["legacy"]["128"]["state_bytes"] == 22_702_059_520
    assert result["arms"]["v2"]["128"]["state_bytes"] == 11_439_514_632
    assert result["arms"]["legacy"]["64"]["state_bytes"] == 11_351_029_760
    assert result["arms"]["v2"]["64"]["state_bytes"] == 5_764_096_520
    assert result["saving_bytes"] == {"64": 5_586_933_240, "128": 11_262_544_888}
    assert result["weights"]["ours"]["param_bytes"] > 2 * 2**30  # bf16 decoder + decode table

    printed = capsys.readouterr().out
    assert "| legacy | 128 | 256 | 21.14 |" in printed
    assert "| v2 | 128 | 129 | 10.65 |" in printed


PAGE_SIZE_V2 = 25  # tokens per page: the greatest common divisor of the v2 windows 125, 250, 400 (docs/memory.md)


def _paged_held_bytes(cfg, frames: int, page_size: int, element_size: int) -> int:
    """Bytes of the pages one stream holds after ``frames`` frames, from the page arithmetic of docs/memory.md:
    per group ceil(frames x tokens_per_frame / page_size) pages, at most window / page_size, of
    2 x heads x page_size x head_dim elements in every layer."""
    total = 0
    for g in cfg.groups:
        pages = min(-(-frames * g.tokens_per_frame // page_size), g.context // page_size)
        total += pages * 2 * g.num_heads * page_size * g.head_dim * element_size * g.num_layers
    return total


def test_memory_paged_arm_allocates_full_rings_and_holds_the_context_pages(capsys):
    result = _load("bench_codec_memory").main(["--preset", "v2", "--streams", "64,128", "--device", "cpu"])
    cfg = preset_config("v2")
    null_pages = sum(2 * g.num_heads * PAGE_SIZE_V2 * g.head_dim * 2 * g.num_layers for g in cfg.groups)
    assert null_pages == 8_704_000  # one page of every v2 layer in bf16
    for count in (64, 128):
        paged, v2 = result["arms"]["v2-paged"][str(count)], result["arms"]["v2"][str(count)]
        assert paged["slots"] == v2["slots"] == count + 1 and paged["page_fraction"] == 1.0
        assert paged["page_size_tokens"] == PAGE_SIZE_V2
        assert paged["pages_per_group"] == [count * n + 1 for n in (5, 10, 16, 16, 16, 16)]
        # Page fraction 1.0: pages for full rings of every live slot plus one null page per group, where the
        # compact pool keeps a whole null slot.
        assert (
            paged["ring_bytes"] == v2["ring_bytes"] - SLOT_BYTES_V2 + null_pages == count * SLOT_BYTES_V2 + null_pages
        )
        # Offsets: one frame counter per slot and one page table entry per slot and ring page.
        assert paged["offset_bytes"] == (count + 1) * 8 * (1 + 5 + 10 + 4 * 16)
        assert paged["state_bytes"] == paged["ring_bytes"] + paged["offset_bytes"]
        assert paged["in_use_mode"].startswith("page reservation")
        assert list(paged["in_use_by_context_frames"]) == ["13", "54", "125", "250"]
        for frames, used in paged["in_use_by_context_frames"].items():
            f = int(frames)
            assert used["context_frames"] == f and used["context_seconds"] == f / 12.5
            assert used["streams_held"] == count and used["decode_steps"] == 0
            expected = count * _paged_held_bytes(cfg, f, PAGE_SIZE_V2, 2)
            assert used["pages_in_use_bytes"] == expected
            assert used["state_in_use_bytes"] == expected + paged["offset_bytes"]
            pages = [min(-(-f * g.tokens_per_frame // PAGE_SIZE_V2), g.context // PAGE_SIZE_V2) for g in cfg.groups]
            assert used["pages_in_use_per_group"] == [count * n for n in pages]
        # From 10 s on (every ring full) the streams hold exactly a compact pool's live slots.
        assert paged["in_use_by_context_frames"]["125"]["pages_in_use_bytes"] == count * SLOT_BYTES_V2
    # 1.04 s: 36,352,000 bytes per stream, 41% of a slot (docs/memory.md: group 0 holds one page of five).
    assert result["arms"]["v2-paged"]["64"]["in_use_by_context_frames"]["13"]["pages_in_use_bytes"] == 64 * 36_352_000
    # docs/memory.md quotes the bytes one stream holds.
    docs = (BENCH_DIR.parents[1] / "docs" / "memory.md").read_text()
    for frames in ("13", "54", "125"):
        used = result["arms"]["v2-paged"]["64"]["in_use_by_context_frames"][frames]
        held = used["pages_in_use_bytes"] // 64
        pages = ", ".join(str(n // 64) for n in used["pages_in_use_per_group"])
        assert f"| {frames} | {used['context_seconds']:g} | {pages} | {held:,} B ({held / 2**20:.2f} MiB) | " in docs
    assert f"one null page per group ({null_pages:,} bytes" in docs
    printed = capsys.readouterr().out
    assert "### v2-paged: state held after F frames per stream (page fraction 1" in printed
    assert "| 64 | 13 | 1.04 | 64 | 2.167 |" in printed


def test_memory_paged_decode_steps_hold_what_the_reservation_predicts():
    """On a real device the paged arm decodes; on meta it only reserves pages. Both hold the same pages,
    those of the page arithmetic, and a page fraction below 1 holds as many streams as the pages fit."""
    bench = _load("bench_codec_memory")
    common, torch = bench.common, bench.torch
    cfg = preset_config("tiny-v2")
    page = 2  # gcd of the tiny-v2 windows 10, 20, 32, 32, 32, 40
    real, meta = common.random_decoder("tiny-v2", "cpu"), common.random_decoder("tiny-v2", "meta")
    for frames in (1, 3, 7, 20):
        decoded = bench.paged_context_bytes(real, 3, frames, [1, 4], 12, dtype=torch.float32)
        reserved = bench.paged_context_bytes(meta, 3, frames, [1, 4], 12, dtype=torch.float32)
        assert decoded["decode_steps"] == len(bench.piece_frames(frames, [1, 4])) and reserved["decode_steps"] == 0
        assert {**decoded, "decode_steps": 0} == reserved
        assert decoded["streams_held"] == 3
        assert decoded["pages_in_use_bytes"] == 3 * _paged_held_bytes(cfg, frames, page, 4)
    # Half the pages: group 5 (32 tokens per frame, window 40 = 20 pages) has ceil(0.5 x 3 x 20) = 30 pages,
    # and one frame already takes 16 of them: one stream fits.
    short = bench.paged_context_bytes(real, 3, 3, [1, 4], 12, page_fraction=0.5, dtype=torch.float32)
    assert short["streams_held"] == 1
    assert short["pages_in_use_bytes"] == _paged_held_bytes(cfg, 3, page, 4)
    assert bench.piece_frames(20, [1, 4]) == [1, 4, 4, 4, 4, 3] and bench.piece_frames(1, [1, 15]) == [1]


def test_memory_tiny_presets_and_arm_selection(tmp_path):
    bench = _load("bench_codec_memory")
    result = bench.main(["--preset", "tiny-v2", "--streams", "2,3", "--device", "cpu", "--arms", "legacy,v2"])
    cfg = preset_config("tiny-v2")
    for count in (2, 3):
        assert result["arms"]["legacy"][str(count)]["state_bytes"] == state_bytes_for(cfg, 2 * count, "legacy")
        assert result["arms"]["v2"][str(count)]["state_bytes"] == state_bytes_for(cfg, count + 1, "compact")
    assert "upstream" not in result["skipped"] and "upstream" not in result["weights"]

    v1 = bench.main(["--preset", "tiny-v1", "--streams", "2", "--device", "cpu", "--json", str(tmp_path / "v1.json")])
    assert set(v1["arms"]) == {"legacy"}
    assert "v1 codec" in v1["skipped"]["v2"] and "v1 codec" in v1["skipped"]["upstream"]
    assert "v1 codec" in v1["skipped"]["v2-paged"]


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
    assert result["state_bytes"]["v2"] == state_bytes_for(cfg, 3, "compact", element_size=4)
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


@pytest.mark.parametrize("preset, batch, frames", [("v2", 128, 15), ("v2", 64, 1), ("v1", 8, 15)])
def test_gemm_shapes_are_every_projection_of_a_step(preset, batch, frames):
    # The listed GEMMs multiply every token row of each group by every projection weight of the decoder
    # (checked against the module's own weights), and the FFN slices cover the rows exactly.
    from vllm_omni_moss.model_executor.models.moss_tts.decoder import FFN_ROW_CHUNK, CodecDecoder

    bench = _load("bench_gemm_shapes")
    cfg = preset_config(preset)
    with torch.device("meta"):
        decoder = CodecDecoder(cfg)
    gemms = bench.step_gemms(cfg, batch, frames)
    for index, (spec, weights) in enumerate(zip(cfg.groups, decoder.groups)):
        rows = batch * frames * spec.tokens_per_frame
        mine = [g for g in gemms if g.group == index]
        params = sum(m.weight.numel() for m in weights.modules() if isinstance(m, torch.nn.Linear))
        assert sum(g.flops for g in mine) == 2 * rows * params
        for name in ("linear1", "linear2"):
            slices = [g for g in mine if g.name == name]
            assert sum(g.rows * g.calls for g in slices) == rows * spec.num_layers
            assert max(g.rows for g in slices) == min(rows, FFN_ROW_CHUNK)
    g5 = [(g.name, g.rows, g.calls) for g in gemms if g.group == 5 and g.name == "linear1"]
    if (preset, batch, frames) == ("v2", 128, 15):  # 61440 rows: one slice of at most 65536
        assert g5 == [("linear1", 61440, 12)]
        sliced = bench.step_gemms(cfg, batch, frames, ffn_rows=16384)  # three slices of 16384, one of 12288
        assert [(g.rows, g.calls) for g in sliced if g.group == 5 and g.name == "linear1"] == [(16384, 36), (12288, 12)]
    whole = [g for g in bench.step_gemms(cfg, batch, frames, ffn_rows=1 << 30) if g.name == "linear1"]
    assert [(g.rows, g.calls) for g in whole] == [
        (batch * frames * s.tokens_per_frame, s.num_layers) for s in cfg.groups
    ]


@pytest.mark.parametrize(
    "name, argv, message",
    [
        ("bench_gemm_shapes", [], "this script times cuBLAS GEMMs on a CUDA device; none is available"),
        (
            "bench_ring_attention",
            ["--grid", "default", "--write", "--prerotated"],
            "this script times Triton kernels on a CUDA device; none is available",
        ),
    ],
)
def test_cuda_only_benchmarks_refuse_a_machine_without_cuda(name, argv, message, monkeypatch, tmp_path, capsys):
    # Usage error (exit 2) naming the missing device, and no JSON written.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as exc:
        _load(name).main([*argv, "--json", str(out)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_common_helpers():
    common = _load("bench_codec_step").common
    assert common.parse_int_list("1, 8,8,64") == [1, 8, 64]
    for text, message in (("0", "expected positive integers"), ("4,,8", "empty item"), ("4,", "empty item"),
                          ("x", "'x' is not an integer"), ("", "empty item")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            common.parse_int_list(text)
    assert common.parse_str_list("graph, eager,graph", ("eager", "graph")) == ["graph", "eager"]
    for text in ("eager,warp", "eager,,graph", ""):
        with pytest.raises(ValueError, match=r"not in \['eager', 'graph'\]"):
            common.parse_str_list(text, ("eager", "graph"))
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


# ------------------------------------------------------------------------------------------ stage bench

FIGURE_KEYS = {
    "audio_seconds_per_second",
    "codec_latency_ms",
    "first_chunk_latency_ms",
    "steps_by_path",
    "padded_frame_fraction",
    "peak_memory_bytes",
}


def test_stage_cpu_tiny_trace(tmp_path, capsys):
    bench = _load("bench_codec_stage")
    argv = "--device cpu --preset tiny-v2 --concurrency 2,3 --requests-per-stream 2 --chunks 1,4,15 --quiet"
    result = bench.main([*argv.split(), "--out", str(tmp_path)])
    assert json.loads((tmp_path / "results.json").read_text()) == result
    for name in ("results.md", "latency_cdf.png", "concurrency.png", "state_over_time.png"):
        assert (tmp_path / name).stat().st_size > 0, name

    upstream_ok = bench.common.upstream_status("tiny-v2", bench.torch.device("cpu"))[0]
    arms = ["v2", "legacy", "upstream"] if upstream_ok else ["v2", "legacy"]
    assert list(result["arms"]) == arms
    assert ("upstream" in result["run"]["skipped"]) == (not upstream_ok)
    run = result["run"]
    assert run["preset"] == "tiny-v2" and run["device"] == "cpu" and run["cuda_graphs"] is False
    assert run["requests"] == {"2": 4, "3": 6} and run["chunks"] == [1, 4, 15]
    assert run["graph_frame_sizes"] == [1, 4, 15] and run["graph_batch_sizes"]["3"] == [1, 2, 3]
    assert run["command"].endswith(argv + f" --out {tmp_path}") and run["date"].endswith("+00:00")

    trace_frames = {}
    for arm in arms:
        entry = result["arms"][arm]
        assert list(entry) == ["2", "3", "max_streams_at_slo"]
        held = []
        for c in ("2", "3"):
            figures, details = entry[c], result["details"][arm][c]
            assert set(figures) == FIGURE_KEYS
            assert set(figures["codec_latency_ms"]) == {"p50", "p95", "p99"}
            assert set(figures["first_chunk_latency_ms"]) == {"p50", "p99"}
            assert figures["steps_by_path"]["graph"] == 0  # no graphs on CPU
            padded, decoded = details["padded_frames"], details["decoded_frames"]
            assert figures["padded_frame_fraction"] == round(padded / (decoded + padded), 6)
            assert 0.0 <= figures["padded_frame_fraction"] < 1.0
            if arm == "upstream":
                # Upstream without graphs: one step per distinct chunk length, every row at its own length.
                assert figures["steps_by_path"]["eager"] >= details["steps"] > 0 and padded == 0
            else:
                # Ours: one step per decode call, every chunk padded to the step's graph frame size.
                assert figures["steps_by_path"]["eager"] == details["steps"] > 0 and padded > 0
            assert figures["peak_memory_bytes"] is None
            lat = figures["codec_latency_ms"]
            assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"]
            # First-chunk latency includes generating the 1-frame first chunk: 80 ms.
            assert 80.0 < figures["first_chunk_latency_ms"]["p50"] <= figures["first_chunk_latency_ms"]["p99"]
            assert not details["stopped_early"] and details["finished_requests"] == run["requests"][c]
            # Slots: compact pool N + 1 (the null slot); legacy and upstream have no scratch slots without graphs.
            assert details["slots"] == int(c) + (arm == "v2") and details["graphs"] == 0
            assert details["peak_state_bytes"] == details["state_bytes"]  # full rings for every slot
            # State over time: one point per decode call (fewer than 200 here), flat at the full rings.
            trace = details["state_bytes_over_time"]
            assert len(trace) == details["steps"] <= 200
            assert all(b == details["state_bytes"] for _, b in trace)
            seconds = [t for t, _ in trace]
            assert seconds == sorted(seconds) and 0 < seconds[0] and seconds[-1] <= details["serving_seconds"]
            if lat["p99"] <= 150.0:
                held.append(int(c))
            trace_frames.setdefault(c, set()).add(details["decoded_frames"])
            aps = figures["audio_seconds_per_second"]
            assert aps == pytest.approx(details["audio_seconds"] / details["serving_seconds"], rel=1e-3)
            assert 0 < aps <= int(c)  # at most C live streams producing 1 s of audio per second each
        assert entry["max_streams_at_slo"] == (max(held) if held else None)
    # One trace per concurrency: every arm decoded exactly the same frames.
    assert all(len(frames) == 1 for frames in trace_frames.values())
    assert trace_frames["2"] != trace_frames["3"]
    printed = capsys.readouterr().out
    assert "| arm | C | requests | audio-s/s |" in printed and "| v2 | 2 | 4 |" in printed
    assert "| peak GiB | peak state GiB | SLO |" in printed
    peak_v2 = result["details"]["v2"]["3"]["peak_state_bytes"] / 2**30
    assert f"| - | {peak_v2:.4g} | " in (tmp_path / "results.md").read_text()


def test_stage_paged_arm_reports_the_state_its_streams_hold(tmp_path):
    bench = _load("bench_codec_stage")
    argv = "--device cpu --preset tiny-v2 --arms v2,v2-paged --concurrency 3 --requests-per-stream 2 --quiet --give-up-ms 600000"
    result = bench.main([*argv.split(), "--out", str(tmp_path)])
    v2, paged = result["details"]["v2"]["3"], result["details"]["v2-paged"]["3"]
    assert v2["decoded_frames"] == paged["decoded_frames"]
    assert v2["peak_state_bytes"] == v2["state_bytes"]
    # Pages only for the context streams reach (tiny-v2 windows of a few seconds fill within the trace).
    assert 0 < paged["peak_state_bytes"] < v2["peak_state_bytes"]
    # The held state rises and falls with the streams' contexts; the trace keeps its peak.
    trace = paged["state_bytes_over_time"]
    assert len(trace) <= 200 and max(b for _, b in trace) == paged["peak_state_bytes"]
    assert min(b for _, b in trace) < paged["peak_state_bytes"] < paged["state_bytes"]
    assert (tmp_path / "state_over_time.png").stat().st_size > 0


def test_stage_state_over_time_keeps_every_bucket_maximum():
    bench = _load("bench_codec_stage")
    points = [(0.1 * i, (i * 37) % 101) for i in range(1000)]
    points[613] = (61.3, 500)  # the peak, inside a bucket
    kept = bench.downsample_max(points)
    assert len(kept) == bench.STATE_TRACE_POINTS == 200
    assert max(b for _, b in kept) == 500 and [61.3, 500] in kept
    for i, (seconds, value) in enumerate(kept):  # 1000 points: buckets of exactly 5
        bucket = points[5 * i : 5 * i + 5]
        assert value == max(b for _, b in bucket) and (seconds, value) in [(round(t, 4), b) for t, b in bucket]
    assert bench.downsample_max(points[:3]) == [[0.0, 0], [0.1, 37], [0.2, 74]]
    assert bench.downsample_max([]) == []
    assert len(bench.downsample_max(points[:401])) == 200  # buckets of 2 or 3 points


def test_stage_paged_arm_short_of_pages_preempts_and_still_decodes_every_frame(tmp_path):
    bench = _load("bench_codec_stage")
    argv = (
        "--device cpu --preset tiny-v2 --arms v2,v2-paged --concurrency 4 --requests-per-stream 2 --quiet "
        "--page-fraction 0.45 --give-up-ms 600000"
    )
    result = bench.main([*argv.split(), "--out", str(tmp_path)])
    v2, paged = result["details"]["v2"]["4"], result["details"]["v2-paged"]["4"]
    assert paged["preemptions"] > 0 and v2["preemptions"] == 0
    assert not paged["stopped_early"] and paged["finished_requests"] == v2["finished_requests"] == 8
    assert paged["decoded_frames"] == v2["decoded_frames"]
    assert paged["chunks"] == v2["chunks"]  # every chunk's latency counted once, when its audio came back
    assert paged["peak_state_bytes"] < paged["state_bytes"] < v2["state_bytes"]


def test_stage_state_budget_buys_slots_or_pages():
    bench = _load("bench_codec_stage")
    decoder = bench.common.random_decoder("tiny-v2", "cpu")
    slot = decoder.config.state_bytes_per_slot(4)  # float32 rings on CPU
    budget = 2.5 * slot
    args = bench._parse(["--state-budget-gib", str(budget / 2**30)])
    assert bench.state_budget(args, "v2", decoder, 4) == (None, 2, None)
    fraction, slots, paged = bench.state_budget(args, "v2-paged", decoder, 4)
    assert fraction is None and slots is None
    assert paged == {"state_budget_bytes": int(budget), "expected_stream_frames": None}
    # The paged arm's pool pays its null pages from the budget (what the bench computed itself before).
    arm = bench.OurArm(decoder, 4, "v2-paged", False, [1, 15], 12, paged_budget=paged)
    pool = arm.session.pool
    null, full = pool._null_bytes(), pool._stream_bytes()
    assert pool.page_fraction == pytest.approx((int(budget) - null) / (4 * full))
    arm = bench.OurArm(
        decoder, 2, "v2-paged", False, [1, 15], 12, paged_budget=bench.state_budget(args, "v2-paged", decoder, 2)[2]
    )
    assert arm.session.pool.page_fraction == 1.0  # the budget buys more than full rings: capped
    split = bench._parse(["--state-budget-gib", str(budget / 2**30), "--expected-stream-seconds", "2"])
    assert bench.state_budget(split, "v2-paged", decoder, 4)[2] == {
        "state_budget_bytes": int(budget),
        "expected_stream_frames": 25,
    }
    unbudgeted = bench._parse(["--page-fraction", "0.5"])
    assert bench.state_budget(unbudgeted, "v2-paged", decoder, 4) == (0.5, None, None)
    assert bench.state_budget(unbudgeted, "v2", decoder, 4) == (None, None, None)
    with pytest.raises(SystemExit, match="is below one stream's rings"):
        bench.state_budget(bench._parse(["--state-budget-gib", str(0.5 * slot / 2**30)]), "v2", decoder, 4)
    # One slot's rings buy a compact slot but not the paged pool, which also needs its null pages.
    one_slot = bench._parse(["--state-budget-gib", str((slot + 8) / 2**30)])
    assert bench.state_budget(one_slot, "v2", decoder, 4) == (None, 1, None)
    with pytest.raises(SystemExit, match=r"for v2-paged: a state budget of \d+ bytes holds no stream: one stream's"):
        bench.state_budget(one_slot, "v2-paged", decoder, 4)


def test_stage_trace_and_slo_helpers():
    bench = _load("bench_codec_stage")
    assert bench.ramp_schedule(21, [1, 4, 15]) == [(0, 1), (1, 5), (5, 20), (20, 21)]
    assert bench.ramp_schedule(40, [1, 15]) == [(0, 1), (1, 16), (16, 31), (31, 40)]
    assert bench.ramp_schedule(3, [5]) == [(0, 3)]
    assert bench.graph_batch_sizes(3) == [1, 2, 3]
    assert bench.graph_batch_sizes(512) == [1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 256, 512]
    lengths = bench.request_lengths(4000, seed=0)
    assert lengths.min() >= 13 and lengths.max() <= 256 and 48 <= int(sorted(lengths)[2000]) <= 52

    def figures(p99):
        return {"codec_latency_ms": {"p50": 1.0, "p95": 2.0, "p99": p99}}

    per_c = {"64": figures(40.0), "128": figures(150.0), "256": figures(150.5), "512": figures(None)}
    details = {c: {"stopped_early": False} for c in per_c}
    assert bench.max_streams_at_slo(per_c, details, 150.0) == 128
    details["128"] = {"stopped_early": True}  # stopped runs never hold the SLO, whatever their p99
    assert bench.max_streams_at_slo(per_c, details, 150.0) == 64
    assert bench.max_streams_at_slo(per_c, details, 10.0) is None
    assert bench.stall_warning("v2", 64, {"step_ms": {"p50": 10.0, "max": 100.0}}) is None
    warning = bench.stall_warning("v2", 64, {"step_ms": {"p50": 10.0, "max": 100.5}})
    assert warning.startswith("warning: v2 C=64: step time max 100.5 ms > 10x its p50 10.0 ms")
    slowest = {"step_ms": {"p50": 10.0, "max": 100.5}, "slowest_step": {"chunks": 61, "max_frames": 15}}
    assert bench.stall_warning("v2", 64, slowest) == (
        "warning: v2 C=64: step time max 100.5 ms > 10x its p50 10.0 ms; that step decoded 61 chunks of up to "
        "15 frames (a burst of chunks when that is most of the live streams, a stall of the machine when it is a few)"
    )


def test_stage_summary_splits_decode_calls_into_replay_and_host_time():
    bench = _load("bench_codec_stage")
    run = bench.Run(codec_latency=[0.01], first_latency=[0.1], serving_s=1.0, audio_s=1.0)
    run.step_wall, run.step_chunks, run.step_frames = [0.010, 0.050, 0.020], [1, 8, 2], [1, 15, 15]
    stats = {"decoded_frames": 10, "padded_frames": 0, "steps_by_path": {"graph": 3, "eager": 0}}
    _, details = bench.summarize(run, stats, None)
    assert details["slowest_step"] == {"chunks": 8, "max_frames": 15}
    assert "replay_ms" not in details  # not timed without --time-replays
    run.step_replay = [0.004, 0.030, 0.015]
    _, details = bench.summarize(run, stats, None)
    assert details["slowest_step"] == {"chunks": 8, "max_frames": 15, "replay_ms": 30.0}
    assert details["replay_ms"]["p50"] == 15.0 and details["host_ms"]["p50"] == 6.0
    assert details["host_ms"]["p99"] == pytest.approx(19.72)  # numpy percentile of [6, 20, 5] ms


def test_stage_trace_calls_reports_each_phase_and_the_slowest_call(tmp_path):
    # --trace-calls: one session.CallTrace per decode call of our arm, summarised per phase, and the
    # slowest call's own trace, whose phases add up to its total and fit inside the call's wall time.
    bench = _load("bench_codec_stage")
    argv = "--device cpu --preset tiny-v2 --arms v2 --concurrency 3 --requests-per-stream 2 --quiet --trace-calls"
    result = bench.main([*argv.split(), "--out", str(tmp_path)])
    details = result["details"]["v2"]["3"]
    phases = ("plan_ms", "stage_ms", "run_ms", "to_host_ms", "finish_ms", "wait_ms", "total_ms", "gc_ms")
    assert list(details["call_trace_ms"]) == list(phases)
    for phase in phases:
        assert 0 <= details["call_trace_ms"][phase]["p50"] <= details["call_trace_ms"][phase]["p99"]
    slowest = details["slowest_step"]
    trace = slowest["trace"]
    assert trace["chunks"] == slowest["chunks"] and trace["steps"] == 1 and trace["failed"] is False
    assert sum(trace[p] for p in phases[:6]) == pytest.approx(trace["total_ms"], abs=0.01)
    assert 0 < trace["run_ms"] < trace["total_ms"] <= details["step_ms"]["max"]

    # Without the flag, nothing is traced.
    result = bench.main(["--device", "cpu", "--preset", "tiny-v2", "--arms", "v2", "--concurrency", "2",
                         "--requests-per-stream", "1", "--quiet", "--out", str(tmp_path / "plain")])  # fmt: skip
    details = result["details"]["v2"]["2"]
    assert "call_trace_ms" not in details and "trace" not in details["slowest_step"]


def test_upstream_stage_plan_follows_upstream_policy():
    plan_steps = _load("bench_codec_stage").upstream_stage.plan_steps

    def rows(steps):
        return [[(i, a, b, last) for i, a, b, last in step.rows] for step in steps]

    frames = [15, 1, 3, 15, 7, 1]
    finished = [False, False, True, True, True, False]
    # Graphs with a bucket holding every stream: tails join the smallest graph frame size that holds them.
    padded = plan_steps(frames, finished, graph_frame_sizes=[1, 15], pad_tails=True, max_step_frames=15)
    assert rows(padded) == [
        [(0, 0, 15, False), (2, 0, 3, True), (3, 0, 15, True), (4, 0, 7, True)],
        [(1, 0, 1, False), (5, 0, 1, False)],
    ]
    assert [s.frames for s in padded] == [15, 1] and not padded[0].all_terminal
    # No graphs (CPU): every distinct length is its own step.
    exact = plan_steps(frames, finished, graph_frame_sizes=[1, 15], pad_tails=False, max_step_frames=15)
    assert [[r[0] for r in step] for step in rows(exact)] == [[0, 3], [1, 5], [2], [4]]
    # A tail group without a steady chunk stays at its longest tail; the graph then pads it further.
    tails = plan_steps([3, 7], [True, True], graph_frame_sizes=[1, 15], pad_tails=True, max_step_frames=15)
    assert len(tails) == 1 and tails[0].frames == 7 and tails[0].all_terminal
    # Chunks over max_step_frames become single-row steps first; only the last piece is terminal.
    long = plan_steps([1, 32], [False, True], graph_frame_sizes=[1, 15], pad_tails=True, max_step_frames=15)
    assert rows(long) == [[(1, 0, 15, False)], [(1, 15, 30, False)], [(1, 30, 32, True)], [(0, 0, 1, False)]]
    with pytest.raises(ValueError, match="chunk 1 has 0 frames"):
        plan_steps([1, 0], [False, False], graph_frame_sizes=[], pad_tails=False, max_step_frames=15)


def test_upstream_stage_streams_match_single_stream_decode():
    """Batched streams through the driver (slots taken and freed, LIFO reuse, terminal resets) decode exactly as
    each stream alone on a fresh upstream pool (fp32 CPU; rows differ only by GEMM batch shape)."""
    bench = _load("bench_codec_stage")
    common, torch, us = bench.common, bench.torch, bench.upstream_stage
    if not common.upstream_status("tiny-v2", torch.device("cpu"))[0]:
        pytest.skip("vllm-omni 0.30.0 moss_tts files or transformers missing")
    codec = common.build_upstream_codec("tiny-v2", torch.device("cpu"), seed=3, n_vq=12)
    spf = codec.config["downsample_rate"]
    gen = torch.Generator().manual_seed(0)
    streams = {rid: torch.randint(0, 1024, (12, n), generator=gen) for rid, n in (("a", 35), ("b", 9), ("c", 17))}
    stage = us.UpstreamStage(
        codec.model, 2, graph_batch_sizes=[1, 2], graph_frame_sizes=[1, 15], n_vq=12, max_step_frames=15,
        samples_per_frame=spf,
    )  # fmt: skip
    assert stage.num_slots == 2 and stage.pad_tails is False  # CPU: no scratch slots, no graphs
    schedule = {rid: bench.ramp_schedule(c.shape[1], [1, 15]) for rid, c in streams.items()}
    batches = [[("a", 0), ("b", 0)], [("a", 1), ("b", 1)], [("a", 2)], [("c", 0)], [("c", 1), ("a", 3)], [("c", 2)]]
    got: dict[str, list] = {rid: [] for rid in streams}
    for batch in batches:
        chunks = []
        for rid, k in batch:
            a, b = schedule[rid][k]
            chunks.append(us.StageChunk(rid, streams[rid][:, a:b], finished=k == len(schedule[rid]) - 1))
        for rid, wav in stage.decode(chunks).items():
            got[rid].append(wav)
        if batch == [("a", 2)]:
            assert stage.free_slots == 1  # b finished in the previous batch
    assert stage.free_slots == 2 and stage.stats()["decoded_frames"] == 61
    assert stage.stats()["steps_by_path"] == {"graph": 0, "eager": 8}
    stage.close()

    for rid, codes in streams.items():
        codec.open_pool(1, 0)
        want = []
        for a, b in schedule[rid]:
            n = b - a
            audio, _ = codec.step(codes[:, None, a:b], torch.tensor([n]), torch.tensor([0]), torch.tensor([True]))
            want.append(audio[0, :, : n * spf])
        codec.close_pool()
        mine, ref = torch.cat(got[rid], dim=-1), torch.cat(want, dim=-1)
        assert mine.shape == (2, codes.shape[1] * spf)
        assert (mine - ref).abs().max() <= 1e-5 * ref.abs().max(), rid


def _run_python(code: str) -> str:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_upstream_oracle_module_is_import_light():
    out = _run_python(
        "import sys\n"
        "from vllm_omni_moss.testing import upstream\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'vllm_omni', 'transformers')]\n"
        "ours = [m for m in sys.modules if m.startswith('vllm_omni_moss.model_executor')]\n"
        "print(heavy, ours)\n"
    )
    assert out.strip() == "[] []"


def test_streaming_attention_loads_with_stand_in_triton_utils():
    pytest.importorskip("triton")
    oracle = pytest.importorskip("vllm_omni_moss.testing.upstream")
    if oracle.upstream_dir() is None or not (oracle.upstream_dir() / "streaming_attention.py").is_file():
        pytest.skip("vllm-omni 0.30.0 moss_tts files missing")
    # One loader of the file for the tests and both benchmarks that use it (bench_codec_step.py, upstream_stage.py).
    out = _run_python(
        "import sys\n"
        "sys.path.insert(0, 'benchmarks/tts')\n"
        "import bench_codec_step, upstream_stage\n"
        "from vllm_omni_moss.testing import upstream, upstream_files\n"
        "module = upstream_files.load_streaming_attention(upstream.upstream_dir(), stand_in=True)\n"
        "again = upstream_files.load_streaming_attention(stand_in=True)\n"
        "left = [m for m in sys.modules if m.split('.')[0] == 'vllm']\n"
        "same = upstream_stage.load_streaming_attention is bench_codec_step.load_streaming_attention\n"
        "same = same and upstream.load_streaming_attention is upstream_files.load_streaming_attention\n"
        "print(type(module.masked_attention).__name__, again is module, left, same)\n"
    )
    assert out.strip() == "CustomOpDef True [] True"


def test_stage_append_merges_a_split_sweep(tmp_path):
    bench = _load("bench_codec_stage")
    base = ["--device", "cpu", "--preset", "tiny-v2", "--requests-per-stream", "1", "--quiet", "--out", str(tmp_path)]
    first = bench.main([*base, "--concurrency", "2", "--arms", "v2"])
    merged = bench.main([*base, "--concurrency", "3", "--arms", "v2,legacy", "--append"])
    run = merged["run"]
    assert run["concurrency"] == [2, 3] and run["requests"] == {"2": 2, "3": 3}
    assert [i["command"] for i in run["invocations"]] == [first["run"]["command"], run["command"]]
    assert list(merged["arms"]["v2"]) == ["2", "3", "max_streams_at_slo"]
    assert list(merged["arms"]["legacy"]) == ["3", "max_streams_at_slo"]
    assert merged["arms"]["v2"]["2"] == first["arms"]["v2"]["2"]
    for arm in ("v2", "legacy"):
        held = [int(c) for c, f in merged["arms"][arm].items() if c != "max_streams_at_slo"]
        held = [c for c in held if merged["arms"][arm][str(c)]["codec_latency_ms"]["p99"] <= 150.0]
        assert merged["arms"][arm]["max_streams_at_slo"] == (max(held) if held else None)
    with bench.np.load(tmp_path / "latencies.npz") as stored:
        assert sorted(stored.files) == ["legacy/3", "v2/2", "v2/3"]
        assert len(stored["v2/2"]) == merged["details"]["v2"]["2"]["chunks"]

    with pytest.raises(SystemExit, match="requests_per_stream 1 != 2"):
        bench.main([*base[:4], "--requests-per-stream", "2", "--quiet", "--out", str(tmp_path), "--append"])
    # Settings of our arms' state and timing must agree too (they change what a run measures).
    for extra, message in (
        (["--state-budget-gib", "0.001"], "state_budget_gib None != 0.001"),
        (["--page-fraction", "0.5"], "page_fraction 1.0 != 0.5"),
        (["--trace-calls"], "trace_calls False != True"),
    ):
        with pytest.raises(SystemExit, match=message):
            bench.main([*base, "--concurrency", "4", *extra, "--append"])
    (tmp_path / "results.md").unlink()
    assert bench.main(["--out", str(tmp_path), "--report-only"]) == merged
    assert "| legacy | 3 | 3 |" in (tmp_path / "results.md").read_text()


def test_stage_paged_arm_splits_a_budget_by_fill_on_request(tmp_path, monkeypatch):
    bench = _load("bench_codec_stage")
    seen = {}
    original = bench.CodecStreamSession

    class Recording(original):
        def __init__(self, *args, **kwargs):
            seen.setdefault(kwargs.get("pool_kind"), kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(bench, "CodecStreamSession", Recording)
    argv = (
        "--device cpu --preset tiny-v2 --arms v2-paged --concurrency 4 --requests-per-stream 1 --quiet "
        "--state-budget-gib 0.0003 --expected-stream-seconds 4.3 --give-up-ms 600000"
    )
    result = bench.main([*argv.split(), "--out", str(tmp_path)])
    kwargs = seen["paged"]
    assert kwargs["state_budget_bytes"] == int(0.0003 * 2**30) and kwargs["expected_stream_frames"] == 54
    assert kwargs["page_fraction"] is None
    details = result["details"]["v2-paged"]["4"]
    assert not details["stopped_early"] and details["finished_requests"] == 4


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--page-fraction", "0"], r"--page-fraction must be in \(0, 1\], got 0.0"),
        (["--page-fraction", "nan"], r"--page-fraction must be in \(0, 1\], got nan"),
        (["--page-fraction", "1.5"], r"--page-fraction must be in \(0, 1\], got 1.5"),
        (["--state-budget-gib", "nan"], "--state-budget-gib must be a positive number, got nan"),
        (["--state-budget-gib", "-1"], "--state-budget-gib must be a positive number, got -1.0"),
        (["--expected-stream-seconds", "0"], "--expected-stream-seconds must be a positive number, got 0.0"),
        (["--slo-ms", "nan"], "--slo-ms must be a positive number, got nan"),
    ],
)
def test_main_job_refuses_bad_settings_before_any_arm_runs(argv, message, tmp_path, capsys):
    # A usage error (exit 2) naming the value, and nothing written: the pools would refuse these values only
    # when an arm builds them, after the arms before it had run and written their results.
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        _load("bench_codec_stage").main([*argv, "--device", "cpu", "--out", str(out)])
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--concurrency", "0"], "--concurrency '0': "),
        (["--concurrency", "abc"], "--concurrency 'abc': "),
        (["--chunks", "1.5"], "--chunks must be positive frame counts, got '1.5'"),
        (["--arms", "bogus"], "--arms 'bogus': "),
        (["--arms", "v2-paged", "--preset", "tiny-v1"], "no arm left to run (v2-paged: preset 'tiny-v1' is a v1 codec"),
    ],
)
def test_main_job_names_a_bad_list_argument_without_a_traceback(argv, message, tmp_path):
    # A message naming the argument (exit status 1, as SystemExit(str) gives), nothing written.
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        _load("bench_codec_stage").main(["--device", "cpu", *argv, "--out", str(out)])
    assert str(exc.value.code).startswith(message)
    assert not out.exists()


@pytest.mark.parametrize(
    "name, argv, message",
    [
        ("bench_codec_memory", ["--arms", "foo"], "--arms 'foo': 'foo' not in ['legacy', 'v2', 'v2-paged', 'upstream']"),
        ("bench_codec_memory", ["--streams", "x"], "--streams 'x': 'x' is not an integer"),
        ("bench_codec_memory", ["--streams", "64,,128"], "--streams '64,,128': empty item in '64,,128'"),
        ("bench_codec_memory", ["--context-frames", "0"], "--context-frames '0': expected positive integers"),
        ("bench_codec_step", ["--batch", "0"], "--batch '0': expected positive integers, got 0 in '0'"),
        ("bench_codec_step", ["--frames", "1,,15"], "--frames '1,,15': empty item in '1,,15'"),
        ("bench_codec_step", ["--modes", "warp"], "--modes 'warp': 'warp' not in ['eager', 'graph', 'compiled']"),
        ("bench_codec_step", ["--arms", "v2,bogus"], "--arms 'v2,bogus': 'bogus' not in"),
        ("bench_codec_step", ["--n-vq", "0"], "--n-vq must be >= 1, got 0"),
        ("bench_codec_startup", ["--checkpoint", "/nonexistent/codec"], "--checkpoint '/nonexistent/codec': no such directory"),
        ("bench_codec_startup", ["--checkpoint", ".", "--graph-batch-sizes", "1,,2"], "--graph-batch-sizes '1,,2': empty item"),
        ("bench_gemm_shapes", ["--batch", "64,"], "--batch '64,': empty item in '64,'"),
        ("bench_ring_attention", ["--frames", "x"], "--frames 'x': 'x' is not an integer"),
    ],
)  # fmt: skip
def test_benchmarks_name_a_bad_flag_and_exit_2(name, argv, message, tmp_path, capsys):
    # A usage error naming the flag and the value, before any work: no traceback, nothing written.
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as exc:
        _load(name).main([*argv, "--json", str(out)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_benchmarks_refuse_cuda_on_a_machine_without_it(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("bench_codec_memory", "bench_codec_step"):
        with pytest.raises(SystemExit) as exc:
            _load(name).main(["--device", "cuda"])
        assert exc.value.code == 2 and "--device cuda: no CUDA device is available" in capsys.readouterr().err


def test_plot_results_names_files_after_the_device_and_skips_empty_modes(tmp_path, capsys, monkeypatch):
    plots = _load("plot_results")
    assert plots.device_slug("NVIDIA H200") == "h200" and plots.device_slug("cpu") == "cpu"
    assert plots.device_slug("NVIDIA A100-SXM4-80GB") == "a100_sxm4_80gb"
    step = _load("bench_codec_step").main(
        "--preset tiny-v2 --batch 1 --frames 1 --modes eager --arms legacy,v2,v2-sdpa,v2-triton --repeats 1 "
        "--steps-per-round 1 --warmup 0 --device cpu".split()
        + ["--json", str(tmp_path / "step.json")]
    )
    memory = tmp_path / "memory.json"
    _load("bench_codec_memory").main(
        ["--preset", "tiny-v2", "--streams", "2", "--device", "cpu", "--json", str(memory)]
    )
    written = plots.main(["--step", str(tmp_path / "step.json"), "--memory", str(memory), "--out", str(tmp_path)])
    # A CPU run: cpu_* files; no graph-mode data on a CPU: no graph plot, and a line saying so.
    assert [p.name for p in written] == ["cpu_step_eager.png", "cpu_memory.png"]
    assert not list(tmp_path.glob("h200_*")) and not (tmp_path / "cpu_step_graph.png").exists()
    assert "no graph mode data in" in capsys.readouterr().out

    import matplotlib.figure
    from matplotlib.container import BarContainer

    captured = {}
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: captured.setdefault(path.name, fig)
    )
    plots.plot_step(tmp_path / "step.json", tmp_path, "eager")
    ax = captured["cpu_step_eager.png"].axes[0]
    assert ax.get_title().startswith("MOSS tiny-v2 codec decode step on cpu")  # the JSON's preset, not "v2"
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    colors = {tuple(p.get_facecolor()) for c in bars for p in c.patches}
    assert len(colors) == len(step["arms"]) == 4  # one colour per arm
