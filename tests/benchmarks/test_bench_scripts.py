# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the codec benchmark scripts: JSON shape, integer bytes, exact v2 accounting, the stage bench's
figures and SLO, and the upstream arm's driver against upstream's own pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import bench_modules
import codec_stage.trace
import common
import pytest
import torch
import upstream_stage

from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
from vllm_omni_moss.model_executor.models.moss_tts.state import state_bytes_for

pytestmark = [pytest.mark.cpu]

BENCH_DIR = bench_modules.BENCH_DIR
SLOT_BYTES_V2 = 88_678_400  # bf16 K+V rings of one v2 slot (docs/memory.md)
LEGACY_BANK_ROWS_V2 = 190  # 2 offsets x 92 layers + 6 group offsets (docs/memory.md)


_load = bench_modules.load


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
        pages = min(-(-frames * g.tokens_per_frame // page_size), g.ring_capacity // page_size)
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
            pages = [
                min(-(-f * g.tokens_per_frame // PAGE_SIZE_V2), g.ring_capacity // PAGE_SIZE_V2) for g in cfg.groups
            ]
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


def test_step_mixed_steps_time_the_grid_and_the_packed_step_against_their_chunks_cost(tmp_path):
    """--mixed 1,3: per --batch a step whose rows cycle through 1 and 3 frames, our arms on the grid and packed
    (upstream left out), each over what its chunks cost at their own T in the full step of the same run."""
    argv = (
        "--preset tiny-v2 --batch 2,3 --frames 1,3 --modes eager --arms legacy,v2,upstream --mixed 1,3 "
        "--repeats 1 --steps-per-round 1 --warmup 0 --device cpu --no-floor"
    ).split()
    result = _load("bench_codec_step").main(argv)
    mixed = result["mixed"]
    assert [(m["batch"], m["frames"], m["real_frames"], m["mix"]) for m in mixed] == [
        (2, 3, 4, [1, 3]),
        (3, 3, 5, [1, 3]),
    ]
    table = {(r["batch"], r["frames"]): r["modes"]["eager"]["arms"] for r in result["results"]}
    for m in mixed:
        arms = m["modes"]["eager"]["arms"]
        assert set(arms) == {"legacy", "v2", "legacy+packed", "v2+packed"}
        lengths = [1, 3, 1][: m["batch"]]
        for arm in ("legacy", "v2"):
            chunks = sum(table[(3, t)][arm]["median_ms"] for t in lengths) / 3
            assert m["chunk_cost_ms"]["eager"][arm] == round(chunks, 4)
            for name in (arm, f"{arm}+packed"):
                assert arms[name]["over_chunk_cost"] == round(arms[name]["median_ms"] / chunks, 3)


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
        # The floor of the shape: fp32 rings of its live rows read once at the command's copy bandwidth, plus its
        # GEMMs; every arm's step over it.
        floor = record["floor"]
        read = state_bytes_for(cfg, record["batch"], "compact", element_size=4) / (result["copy_gb_s"] * 1e6)
        assert floor["copy_gb_s"] == result["copy_gb_s"] > 0 and floor["state_read_ms"] == pytest.approx(read, abs=1e-4)
        for stats in entry["arms"].values():
            assert stats["step_over_floor"] == pytest.approx(stats["median_ms"] / floor["total_ms"], abs=1e-4)


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
            "bench_gemm_epilogue",
            ["--batch", "512", "--frames", "5"],
            "this script times cuBLAS GEMMs on a CUDA device; none is available",
        ),
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
        _load(name).main([*argv, "--out" if name == "bench_fidelity" else "--json", str(out)])
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


# ------------------------------------------------------------------------------------------ upstream stage


def test_upstream_stage_plan_follows_upstream_policy():
    plan_steps = _load("upstream_stage").plan_steps

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
    us = upstream_stage
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
    schedule = {rid: codec_stage.trace.ramp_schedule(c.shape[1], [1, 15]) for rid, c in streams.items()}
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
        ("bench_codec_step", ["--n-vq", "0"], "--n-vq must be in 1..12 for preset 'tiny-v2', got 0"),
        ("bench_codec_step", ["--n-vq", "99"], "--n-vq must be in 1..12 for preset 'tiny-v2', got 99"),
        ("bench_codec_memory", ["--n-vq", "99"], "--n-vq must be in 1..32 for preset 'v2', got 99"),
        ("bench_codec_memory", ["--page-fraction", "0.5", "--arms", "v2"], "--page-fraction 0.5 applies to the v2-paged arm, not to v2"),
        ("bench_codec_startup", ["--checkpoint", "/nonexistent/codec"], "--checkpoint '/nonexistent/codec': no such directory"),
        ("bench_codec_startup", ["--checkpoint", ".", "--graph-frame-totals", "1,,2"], "--graph-frame-totals '1,,2': empty item"),
        ("bench_gemm_shapes", ["--batch", "64,"], "--batch '64,': empty item in '64,'"),
        ("bench_codec_memory", ["--streams", "1000000"], "--streams 1000000: at most 65536"),
        ("bench_codec_memory", ["--context-frames", "10000000"], "--context-frames 10000000: at most 45000"),
        ("bench_codec_step", ["--batch", "1000000000"], "--batch 1000000000: at most 65536"),
        ("bench_codec_step", ["--frames", "1000000000"], "--frames 1000000000: at most 4096"),
        ("bench_codec_step", ["--code-sets", "1000000000000"], "--code-sets 1000000000000: at most 1024"),
        ("bench_codec_step", ["--seed", str(2**63)], f"--seed must be in 0..{2**63 - 1}, got {2**63}"),
        ("bench_codec_step", ["--context-frames", "-1"], "--context-frames must be >= 0, got -1"),
        ("bench_codec_step", ["--context-frames", "45001"], "--context-frames 45001: at most 45000"),
        ("bench_codec_step", ["--context-frames", "9", "--arms", "v2,legacy"], "compact-pool arms ('v2', 'v2-sdpa', 'v2-triton', 'v2-exact') only, not ['legacy']"),
        ("bench_codec_step", ["--context-frames", "9", "--arms", "v2-paged"], "only, not ['v2-paged']"),
        ("bench_fidelity", ["--frames", "1000000000000"], "--frames 1000000000000: at most 45000"),
        ("bench_fidelity", ["--streams", "1000000000"], "--streams 1000000000: at most 65536"),
        ("bench_fidelity", ["--seed", str(2**63)], f"--seed must be in 0..{2**63 - 1}, got {2**63}"),
        ("bench_ring_attention", ["--frames", "x"], "--frames 'x': 'x' is not an integer"),
        ("bench_ring_attention", ["--seed", "-5"], "--seed must be in 0..9223372036854775807, got -5"),
        ("bench_ring_attention", ["--batch", "100000000"], "--batch 100000000: at most 65536"),
        ("bench_gemm_epilogue", ["--frames", "100000"], "--frames 100000: at most 4096"),
        ("bench_gemm_epilogue", ["--seed", "-1"], "--seed must be in 0..9223372036854775807, got -1"),
    ],
)  # fmt: skip
def test_benchmarks_name_a_bad_flag_and_exit_2(name, argv, message, tmp_path, capsys):
    # A usage error naming the flag and the value, before any work: no traceback, nothing written.
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as exc:
        _load(name).main([*argv, "--out" if name == "bench_fidelity" else "--json", str(out)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "name, argv, flag",
    [
        ("bench_codec_memory", ["--device", "cpu"], "--json"),
        ("bench_codec_step", ["--device", "cpu"], "--json"),
        ("bench_codec_startup", ["--device", "cpu", "--checkpoint", "{ckpt}"], "--json"),
        ("bench_fidelity", ["--device", "cpu"], "--out"),
    ],
)
def test_benchmarks_check_their_output_path_before_any_work(name, argv, flag, tmp_path, capsys):
    # A directory where the output file goes, and a path under a regular file: both refused before any run.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    argv = [a.replace("{ckpt}", str(ckpt)) for a in argv]
    (tmp_path / "file").write_text("x")
    for target, message in ((tmp_path, "is a directory, not a file"), (tmp_path / "file" / "r.json", "cannot write")):
        with pytest.raises(SystemExit) as exc:
            _load(name).main([*argv, flag, str(target)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"{flag} {str(target)!r}: {message}" in err, err


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


def test_ring_attention_sweep_counts_the_bytes_a_launch_moves_and_its_deep_grid():
    bench = _load("bench_ring_attention")
    # v2's last group at B512 x T5: 160 tokens a row, 12 heads of 64, ring of 400 cells, bf16. Under "upstream"
    # the queries see the 400 - 160 positions the post-write ring keeps; under "exact" the 399 before the chunk.
    per_token = 12 * 64 * 2
    chunk, stored = 4 * 512 * 160 * per_token, 2 * 512 * 160 * per_token
    upstream, exact = 2 * 512 * 240 * per_token, 2 * 512 * 399 * per_token
    assert bench.moved_bytes(512, 12, 400, 64, 160, write=False) == upstream + chunk == 880_803_840
    assert bench.moved_bytes(512, 12, 400, 64, 160, write=True) == upstream + chunk + stored == 1_132_462_080
    assert bench.moved_bytes(512, 12, 400, 64, 160, False, "exact") == exact + chunk == 1_130_889_216
    # A chunk longer than the ring: no ring cell is read under "upstream", and only C tokens are stored.
    assert bench.moved_bytes(1, 1, 4, 2, 10, write=False) == 4 * 10 * 4
    assert bench.moved_bytes(1, 1, 4, 2, 10, write=True) - bench.moved_bytes(1, 1, 4, 2, 10, write=False) == 2 * 4 * 4
    assert len(bench.DEEP_GRID) == 4 * 3 * 2 * 3 and {c["pv"] for c in bench.DEEP_GRID} == {"low"}
    # 40 tokens a row (T5 in group 3) run 16- and 32-query blocks, 160 tokens 64- and 128-query blocks.
    assert {c["block_q"] for c in bench.DEEP_GRID if bench._in_grid(c, 40, 5)} == {16, 32}
    assert {c["block_q"] for c in bench.DEEP_GRID if bench._in_grid(c, 160, 5)} == {64, 128}
    assert sorted(bench.GRIDS) == ["deep", "default", "launch"]


def test_step_context_frames_start_every_slot_there(tmp_path):
    # The compact pool's slots start at the context; a step advances them by T; the null slot stays at 0.
    bench = _load("bench_codec_step")
    decoder = bench.common.random_decoder("tiny-v2", "cpu")
    for kind in ("v2", "v2-exact"):
        arm = bench._our_arm(decoder, kind, 3, context_frames=7)
        pool = arm._close.__self__  # the arm closes its pool: pool.close bound to it
        assert pool.frames_decoded.tolist() == [7, 7, 7, 0]
        codes = bench.common.random_codes(1, 12, 3, 2, decoder.config.codebook_size, "cpu", 0)[0]
        arm.step(codes, torch.full((3,), 2), torch.arange(3), torch.ones(3, dtype=torch.bool))
        assert pool.frames_decoded.tolist() == [9, 9, 9, 0]
        arm.close()
    fresh = bench._our_arm(decoder, "v2", 3)
    assert fresh._close.__self__.frames_decoded.tolist() == [0, 0, 0, 0]
    argv = ["--preset", "tiny-v2", "--device", "cpu", "--arms", "v2", "--batch", "2", "--frames", "1"]
    argv += ["--modes", "eager", "--repeats", "1", "--steps-per-round", "1", "--no-floor", "--context-frames", "30"]
    result = bench.main([*argv, "--json", str(tmp_path / "step.json")])
    assert result["context_frames"] == 30 and len(result["results"]) == 1
