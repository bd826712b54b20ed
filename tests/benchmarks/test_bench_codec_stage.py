# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the main job, ``bench_codec_stage.py`` and its ``codec_stage`` package: the results layout, the
arrival models, the playback figures (checked against the ideal arm's closed forms), the SLO lines, the state
plans, ``--append``, ``--chunks`` sweeps and every bad flag (exit 2 before any arm runs)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import bench_modules
import codec_stage.arms
import codec_stage.metrics
import codec_stage.playback
import codec_stage.report
import codec_stage.simulate
import codec_stage.trace
import common
import numpy as np
import pytest
import torch
import upstream_stage

from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import StepShape, frame_totals
from vllm_omni_moss.model_executor.models.moss_tts.serving.step_runner import StepRunner

pytestmark = [pytest.mark.cpu]

BENCH_DIR = bench_modules.BENCH_DIR
FIGURE_KEYS = {
    "audio_seconds_per_second",
    "codec_latency_ms",
    "first_chunk_latency_ms",
    "ttfp_ms",
    "underrun_ms",
    "underrun_requests",
    "continuity",
    "live_streams",
    "queued_requests",
    "queue_wait_ms",
    "steps_by_path",
    "padded_frame_fraction",
    "peak_memory_bytes",
}


def _bench():
    return bench_modules.load("bench_codec_stage")


def _cpu(flags: str = "", *, out: Path) -> list[str]:
    """argv of a quiet tiny-v2 CPU run writing into ``out``: ``flags`` split on spaces."""
    return ["--device", "cpu", "--preset", "tiny-v2", "--quiet", *flags.split(), "--out", str(out)]


# ------------------------------------------------------------------------------------------ the default layout


def _check_run(arm: str, c: str, figures: dict, details: dict, requests: int) -> None:
    assert set(figures) == FIGURE_KEYS
    assert list(figures["codec_latency_ms"]) == ["p10", "p50", "p90", "p95", "p99"]
    lat = figures["codec_latency_ms"]
    assert 0 <= lat["p10"] <= lat["p50"] <= lat["p90"] <= lat["p95"] <= lat["p99"]
    assert figures["steps_by_path"]["graph"] == 0 and figures["peak_memory_bytes"] is None  # no graphs on CPU
    padded, decoded = details["padded_frames"], details["decoded_frames"]
    assert figures["padded_frame_fraction"] == round(padded / (decoded + padded), 6)
    assert details["padding_rows"] == 0  # no graphs on CPU: no ladder, every step shaped exactly by its rows
    if arm == "ideal":
        assert lat["p99"] == 0.0 and figures["steps_by_path"]["eager"] == 0 and padded == 0
        assert details["slots"] == int(c) and details["state_bytes"] == details["peak_state_bytes"] == 0
    elif arm == "upstream":
        # Upstream without graphs: one step per distinct chunk length, every row at its own length.
        assert figures["steps_by_path"]["eager"] >= details["steps"] > 0 and padded == 0 and lat["p50"] > 0
        assert details["graph_ladder"] == [b for b in (1, 2) if b < int(c)] + [int(c)]  # its batch buckets
    else:
        # Ours: one packed step per round of a call; without graphs each packs exactly its real frames.
        assert figures["steps_by_path"]["eager"] >= details["steps"] > 0 and padded == 0 and lat["p50"] > 0
        # The frame totals of C slots x 15 frames (every total up to 64).
        assert details["graph_ladder"] == frame_totals(int(c) * 15) == list(range(1, int(c) * 15 + 1))
    if arm != "ideal":
        # Slots: compact pool N + 1 (the null slot); legacy and upstream have no scratch slots without graphs.
        assert details["slots"] == int(c) + (arm == "v2") and details["graphs"] == 0
        assert details["peak_state_bytes"] == details["state_bytes"] > 0  # full rings for every slot
    # First audio includes generating the 1-frame first chunk: 0.5 x 80 ms at the default talker RTF.
    first = figures["first_chunk_latency_ms"]
    ttfp = figures["ttfp_ms"]  # closed loop: arrival = start
    assert 40.0 <= first["p50"] <= first["p99"] and {"p50": ttfp["p50"], "p99": ttfp["p99"]} == first
    assert first["p50"] <= ttfp["p95"] <= first["p99"]
    assert figures["queued_requests"] == 0 and figures["queue_wait_ms"] == {"p50": 0.0, "p99": 0.0}
    assert figures["live_streams"]["max"] == int(c) and 0 < figures["live_streams"]["mean"] <= int(c)
    assert not details["stopped_early"] and details["finished_requests"] == details["requests"] == requests
    trace = details["state_bytes_over_time"]  # one point per decode call (fewer than 200 here)
    assert len(trace) == details["steps"] <= 200 and all(b == details["state_bytes"] for _, b in trace)
    assert [t for t, _ in trace] == sorted(t for t, _ in trace) and trace[-1][0] <= details["serving_seconds"]
    aps = figures["audio_seconds_per_second"]
    assert aps == pytest.approx(details["audio_seconds"] / details["serving_seconds"], rel=1e-3)
    assert 0 < aps <= int(c) / 0.5  # each live stream's talker makes 2 s of audio per second


def test_stage_cpu_tiny_trace(tmp_path, capsys):
    bench = _bench()
    argv = "--device cpu --preset tiny-v2 --concurrency 2,3 --requests-per-stream 2 --chunks 1,4,15 --quiet"
    argv += " --give-up-ms 600000"  # a busy machine makes steps slow, not requests lost
    result = bench.main([*argv.split(), "--out", str(tmp_path)])
    assert json.loads((tmp_path / "results.json").read_text()) == result
    for name in ("results.md", "latency_cdf.png", "concurrency.png", "playback.png", "state_over_time.png"):
        assert (tmp_path / name).stat().st_size > 0, name

    upstream_ok = common.upstream_status("tiny-v2", torch.device("cpu"))[0]
    arms = ["v2", "legacy", "upstream", "ideal"] if upstream_ok else ["v2", "legacy", "ideal"]
    assert list(result["arms"]) == arms and ("upstream" in result["run"]["skipped"]) == (not upstream_ok)
    run = result["run"]
    assert run["preset"] == "tiny-v2" and run["device"] == "cpu" and run["cuda_graphs"] is False
    assert (run["arrival"], run["burstiness"], run["talker_rtf"], run["request_rate"]) == ("wave", None, 0.5, None)
    assert run["requests"] == {"2": 4, "3": 6} and run["chunks"] == [1, 4, 15] and run["keys"] == ["2", "3"]
    assert run["graph_frame_sizes"] == [1, 4, 15] and "graph_ladder" not in run and "graph_batch_sizes" not in run
    assert run["command"].endswith(argv + f" --out {tmp_path}") and run["date"].endswith("+00:00")

    frames = {}
    for arm in arms:
        entry = result["arms"][arm]
        assert list(entry) == ["2", "3", "max_streams_at_slo", "slo_held_by_every_run"]
        for c in ("2", "3"):
            _check_run(arm, c, entry[c], result["details"][arm][c], run["requests"][c])
            frames.setdefault(c, set()).add(result["details"][arm][c]["decoded_frames"])
        held = [int(c) for c in ("2", "3") if entry[c]["codec_latency_ms"]["p99"] <= 150.0]
        assert entry["max_streams_at_slo"] == (max(held) if held else None)
        assert entry["slo_held_by_every_run"] == (held == [2, 3])
    # One trace per concurrency: every arm decoded exactly the same frames.
    assert all(len(f) == 1 for f in frames.values()) and frames["2"] != frames["3"]
    printed = capsys.readouterr().out
    assert "| arm | C | requests | audio-s/s |" in printed and "| v2 | 2 | 4 |" in printed
    assert "| peak GiB | peak state GiB | SLO |" in printed and "| arm | C | TTFP p50 / p95 / p99 ms |" in printed
    peak_v2 = result["details"]["v2"]["3"]["peak_state_bytes"] / 2**30
    assert f"| - | {peak_v2:.4g} | " in (tmp_path / "results.md").read_text()


# ------------------------------------------------------------------------------------------ playback


def test_playback_accounts_each_stall_and_the_one_a_cut_off_request_is_in():
    playback = codec_stage.playback.Playback(2)
    playback.on_audio(0, 1.0, 1)  # plays until 1.08
    playback.on_audio(0, 1.5, 5)  # stall 0.42, plays until 1.9
    playback.on_audio(0, 1.7, 5)  # on time: plays until 2.3
    playback.on_audio(0, 2.4, 1)  # stall 0.1
    assert playback.first_audio[0] == 1.0 and playback.play_end[0] == pytest.approx(2.48)
    assert playback.worst_stall[0] == pytest.approx(0.42)
    playback.on_audio(1, 0.5, 15)  # plays until 1.7
    playback.cut_off(1, 1.2)  # still playing: no stall
    assert playback.worst_stall[1] == 0.0
    playback.cut_off(1, 2.7)  # out of audio for 1.0 s when the run stopped
    assert playback.worst_stall[1] == pytest.approx(1.0)


def _ideal_worst_stall(frames: int, sizes: list[int], rtf: float) -> float:
    """Closed form of the ideal arm's worst stall: chunk [a, b) comes out when generated, at b * rtf / 12.5,
    and the client has played the a frames before it from the first chunk's arrival on unless it stalled."""
    ramp = codec_stage.trace.ramp_schedule(frames, sizes)
    play_end, worst = (ramp[0][1] * rtf + ramp[0][1]) / 12.5, 0.0
    for a, b in ramp[1:]:
        gap = b * rtf / 12.5 - play_end
        worst = max(worst, gap)
        play_end = max(play_end, b * rtf / 12.5) + (b - a) / 12.5
    return worst if worst > 1e-9 else 0.0


def test_ideal_arm_stalls_are_the_schedule_and_the_talker_and_a_chunk_sweep_keeps_each_schedule(tmp_path):
    bench = _bench()
    argv = _cpu("--arms ideal --concurrency 3 --requests-per-stream 4", out=tmp_path)
    swept = bench.main([*argv, "--chunks", "1,15", "--chunks", "1,2,4,8,15;1,15"])  # repeated and ';', deduplicated
    assert swept["sweep"]["schedules"] == {"1,15": "chunks_1_15", "1,2,4,8,15": "chunks_1_2_4_8_15"}
    assert json.loads((tmp_path / "sweep.json").read_text()) == swept["sweep"]
    assert "| 1,2,4,8,15 | ideal | C=3 |" in (tmp_path / "sweep.md").read_text()
    lengths = codec_stage.trace.request_lengths(12, seed=0)
    for sizes, directory in (([1, 15], "chunks_1_15"), ([1, 2, 4, 8, 15], "chunks_1_2_4_8_15")):
        result = swept["results"][directory]
        assert json.loads((tmp_path / directory / "results.json").read_text()) == result
        assert result["run"]["chunks"] == sizes and (tmp_path / directory / "playback.png").is_file()
        f = result["arms"]["ideal"]["3"]
        stalls = [_ideal_worst_stall(int(n), sizes, 0.5) * 1e3 for n in lengths]
        assert f["ttfp_ms"] == {"p50": 40.0, "p95": 40.0, "p99": 40.0}  # a 1-frame chunk generated at 25 frames/s
        assert f["underrun_ms"]["p50"] == pytest.approx(np.percentile(stalls, 50), abs=1e-3)
        assert f["underrun_ms"]["p99"] == pytest.approx(np.percentile(stalls, 99), abs=1e-3)
        for bound in (50, 100, 200):
            assert f["continuity"][f"c{bound}"] == round(float(np.mean(np.array(stalls) <= bound)), 4)
    # 1,15 at RTF 0.5: the 15-frame chunk takes 600 ms to generate after 80 ms of audio: a 520 ms stall for
    # streams of 16 frames or more. The doubling ramp is generated exactly as fast as it plays: no stall.
    assert max(_ideal_worst_stall(int(n), [1, 15], 0.5) for n in lengths) == pytest.approx(0.52)
    assert swept["results"]["chunks_1_2_4_8_15"]["arms"]["ideal"]["3"]["continuity"]["c50"] == 1.0
    # At RTF 1 (the talker only as fast as real time) the same ramp stalls once, before its second chunk.
    slow = bench.main([*argv, "--chunks", "1,15", "--talker-rtf", "1"])["arms"]["ideal"]["3"]
    assert slow["ttfp_ms"]["p50"] == 80.0 and slow["underrun_ms"]["p99"] == pytest.approx(1120.0)
    limits = "| arm | max streams at SLO | max streams at SLO with no underrun |\n|---|---|---|\n"
    assert limits + "| ideal | at least 3 | none |" in (tmp_path / "results.md").read_text()  # every request stalls


def test_a_sweep_cut_short_keeps_ideal_for_every_schedule_and_its_summary_so_far(tmp_path, monkeypatch):
    # A command's time limit can stop a sweep anywhere: `ideal` (no device time) runs first for every schedule,
    # and sweep.json / sweep.md are rewritten after each run, so what ran is summarised; tables keep --arms order.
    bench = _bench()
    sweep = sys.modules["codec_stage.sweep"]
    real, ran = sweep.run_arm, []

    def run_arm(name, make_arm, trace, load, sizes, settings):
        ran.append((name, tuple(sizes)))
        if name == "v2" and sizes == [1, 2, 4, 8, 15]:
            raise KeyboardInterrupt  # the command's time limit
        return real(name, make_arm, trace, load, sizes, settings)

    monkeypatch.setattr(sweep, "run_arm", run_arm)
    argv = _cpu("--arms v2,ideal --concurrency 2 --requests-per-stream 1 --chunks 1,15;1,2,4,8,15", out=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv)
    assert ran == [("ideal", (1, 15)), ("ideal", (1, 2, 4, 8, 15)), ("v2", (1, 15)), ("v2", (1, 2, 4, 8, 15))]
    table = (tmp_path / "sweep.md").read_text()
    assert json.loads((tmp_path / "sweep.json").read_text())["schedules"] == {
        "1,15": "chunks_1_15",
        "1,2,4,8,15": "chunks_1_2_4_8_15",
    }
    for row in ("| 1,15 | v2 | C=2 |", "| 1,15 | ideal | C=2 |", "| 1,2,4,8,15 | ideal | C=2 |"):
        assert row in table
    assert "| 1,2,4,8,15 | v2 |" not in table
    short = json.loads((tmp_path / "chunks_1_2_4_8_15" / "results.json").read_text())
    assert list(short["arms"]) == ["v2", "ideal"] and short["arms"]["v2"] == {}
    assert short["arms"]["ideal"]["2"]["continuity"]["c100"] == 1.0


def test_staggered_arrivals_spread_the_first_streams_over_one_steady_chunk():
    trace = codec_stage.trace.closed_loop_trace("staggered", 4, 10, 0.6, seed=0)
    assert trace.arrivals[:4] == pytest.approx([0.0, 0.15, 0.3, 0.45]) and np.isnan(trace.arrivals[4:]).all()
    wave = codec_stage.trace.closed_loop_trace("wave", 4, 10, 0.6, seed=0)
    assert (wave.arrivals[:4] == 0).all() and (wave.lengths == trace.lengths).all() and trace.limit == 4
    arm = codec_stage.arms.IdealArm(4, channels=2, samples_per_frame=3840, max_frames=15)
    codes = codec_stage.trace.CodeSource(trace, 12, 1024)
    kw = {"talker_rtf": 0.5, "give_up_s": 5.0, "channels": 2, "samples_per_frame": 3840, "sync": lambda: None}
    driver = codec_stage.simulate.Driver(arm, trace, codes, [1, 15], **kw)
    run = driver.simulate()
    # Each of the first four streams starts at its arrival; its first audio comes 40 ms later.
    assert driver.playback.first_audio[:4] == pytest.approx([0.04, 0.19, 0.34, 0.49])
    assert run.finished_requests == 10 and run.queue_wait == [0.0] * 10 and not run.stopped_early
    assert run.ttfp == pytest.approx([0.04] * 10) and run.codec_latency == [0.0] * len(run.codec_latency)
    assert max(n for _, n in run.live_trace) == 4


def test_a_request_arriving_during_a_decode_call_starts_its_talker_at_its_arrival(monkeypatch):
    # Every call of this arm takes 0.3 s. Request 1 arrives at 0.1 s, inside the first call (0.04-0.34 s): its
    # talker is a stage of its own, so it starts then and its first chunk (ready at 0.14 s) rides the next call
    # (0.34-0.64 s). Request 2 arrives at 0.2 s with both places taken: it starts when two streams end, at the end
    # of the third call (0.94 s), and its first chunk rides the call of 0.98-1.28 s.
    clock = [0.0]
    monkeypatch.setattr(codec_stage.simulate, "time", type("Clock", (), {"perf_counter": lambda: clock[0]}))

    class SlowArm(codec_stage.arms.IdealArm):
        timed = True

        def decode(self, chunks):
            clock[0] += 0.3
            return super().decode(chunks)

    trace = codec_stage.trace.Trace(np.array([13, 13, 13]), np.array([0.0, 0.1, 0.2]), np.ones(3, bool), 2, None, 0)
    arm = SlowArm(2, channels=2, samples_per_frame=3840, max_frames=15)
    kw = {"talker_rtf": 0.5, "give_up_s": 5.0, "channels": 2, "samples_per_frame": 3840, "sync": lambda: None}
    driver = codec_stage.simulate.Driver(arm, trace, codec_stage.trace.CodeSource(trace, 12, 1024), [1, 15], **kw)
    run = driver.simulate()
    assert [s.start for s in driver.streams.values()] == []  # every stream ended
    assert run.queue_wait == pytest.approx([0.0, 0.0, 0.74])
    assert run.ttfp == pytest.approx([0.34, 0.54, 1.08]) and run.first_latency == pytest.approx([0.34, 0.54, 0.34])
    assert run.step_chunks == [1, 1, 2, 1, 1] and run.serving_s == pytest.approx(1.76)
    # Live streams over time, in time order although request 1's start dates back into the first call.
    assert [n for _, n in run.live_trace] == [0, 1, 2, 1, 0, 1, 0, 0]
    assert [t for t, _ in run.live_trace] == pytest.approx([0.0, 0.0, 0.1, 0.94, 0.94, 0.94, 1.76, 1.76])


def test_staggered_run_of_our_arm(tmp_path):
    flags = "--arrival staggered --arms v2 --concurrency 2 --requests-per-stream 1 --give-up-ms 600000"
    result = _bench().main(_cpu(flags, out=tmp_path))
    f, d = result["arms"]["v2"]["2"], result["details"]["v2"]["2"]
    assert result["run"]["arrival"] == "staggered" and d["finished_requests"] == 2 and d["chunks"] > 2
    # TTFP = first-chunk latency + queue wait, request by request, so each quantile is at least the other's; a
    # request queues only when a decode call outlasts the stagger (150 ms), as on a busy CPU.
    ttfp, first = f["ttfp_ms"], f["first_chunk_latency_ms"]
    assert first["p50"] > 40.0 and all(ttfp[q] >= first[q] for q in ("p50", "p99"))
    if f["queued_requests"] == 0:
        assert {"p50": ttfp["p50"], "p99": ttfp["p99"]} == first and ttfp["p50"] <= ttfp["p95"] <= ttfp["p99"]


# ------------------------------------------------------------------------------------------ poisson


def test_poisson_arrivals_have_the_rate_and_the_burstiness():
    arrivals = codec_stage.trace.poisson_arrivals
    for shape in (1.0, 0.25):
        times = arrivals(50.0, shape, 400.0, seed=3)
        gaps = np.diff(times)
        assert times[0] == 0.0 and times[-1] < 400.0 and (gaps >= 0).all()  # shape < 1: gaps may underflow
        assert np.mean(gaps) == pytest.approx(1 / 50.0, rel=0.03)
        assert np.var(gaps) / np.mean(gaps) ** 2 == pytest.approx(1 / shape, rel=0.1)  # gamma: CV^2 = 1/shape
    short, long = arrivals(50.0, 1.0, 10.0, seed=3), arrivals(50.0, 1.0, 400.0, seed=3)
    assert (long[: len(short)] == short).all()  # a longer window adds arrivals, it changes none


def test_poisson_queues_past_max_concurrency_and_counts_the_measurement_window(tmp_path):
    bench = _bench()
    flags = "--arrival poisson --arms ideal --concurrency 3 --max-concurrency 1 --request-rate 0.25,0.5,4"
    argv = _cpu(flags + " --burstiness 0.5 --warmup-seconds 4 --measure-seconds 16 --give-up-ms 20000", out=tmp_path)
    result = bench.main(argv)
    run, entry, details = result["run"], result["arms"]["ideal"], result["details"]["ideal"]
    assert (run["arrival"], run["burstiness"], run["talker_rtf"]) == ("poisson", 0.5, 0.5)
    assert run["request_rate"] == [0.25, 0.5, 4.0] and run["keys"] == ["rate=0.25", "rate=0.5", "rate=4"]
    assert (run["max_concurrency"], run["concurrency"], run["requests_per_stream"]) == (1, [3], None)
    assert (run["warmup_seconds"], run["measure_seconds"]) == (4.0, 16.0)
    for key, rate in (("rate=0.25", 0.25), ("rate=0.5", 0.5), ("rate=4", 4.0)):
        trace = codec_stage.trace.poisson_trace(rate, 0.5, 4.0, 16.0, 1, seed=0)
        assert run["requests"][key] == trace.measured_count == details[key]["requests"] > 0
        assert details[key]["window_seconds"][0] == 4.0 and entry[key]["live_streams"]["max"] == 1
    # One stream at a time, streams of about 2 s: 4 requests/s queue until a wait passes --give-up-ms.
    fast = entry["rate=4"]
    assert details["rate=4"]["stopped_early"] and fast["queued_requests"] > 0 and fast["queue_wait_ms"]["p99"] > 1000
    complete = [k for k in ("rate=0.25", "rate=0.5") if not details[k]["stopped_early"]]
    assert complete and entry["max_rate_at_slo"] == float(complete[-1].removeprefix("rate="))
    assert entry["live_streams_at_max_rate"] == entry[complete[-1]]["live_streams"]["mean"]
    for key in complete:
        # TTFP counts from the arrival, so the queue shows in it: the ideal arm's first audio comes 40 ms after
        # the start, so TTFP is each request's queue wait plus 40 ms; first-chunk latency counts from the start.
        f = entry[key]
        assert f["first_chunk_latency_ms"] == {"p50": 40.0, "p99": 40.0}
        assert f["ttfp_ms"]["p99"] == pytest.approx(f["queue_wait_ms"]["p99"] + 40.0, abs=2e-3)
        assert f["ttfp_ms"]["p50"] == pytest.approx(f["queue_wait_ms"]["p50"] + 40.0, abs=2e-3)
    assert entry["rate=0.5"]["queued_requests"] > 0 and entry["rate=0.5"]["ttfp_ms"]["p99"] > 40.0
    assert entry["slo_held_by_every_run"] is False
    assert list(entry)[-3:] == ["max_rate_at_slo", "live_streams_at_max_rate", "slo_held_by_every_run"]
    assert (tmp_path / "request_rate.png").is_file() and not (tmp_path / "concurrency.png").exists()
    assert "| ideal | 0.5 |" in (tmp_path / "results.md").read_text()


def test_poisson_run_of_our_arm(tmp_path):
    # A give-up far beyond any CPU step: a busy machine makes steps slow, not requests lost.
    flags = "--arrival poisson --arms v2 --concurrency 2 --request-rate 3 --warmup-seconds 0.5 --measure-seconds 1"
    flags += " --give-up-ms 600000"
    argv = _cpu(flags, out=tmp_path)
    result = _bench().main(argv)
    f, d = result["arms"]["v2"]["rate=3"], result["details"]["v2"]["rate=3"]
    assert d["requests"] == result["run"]["requests"]["rate=3"] > 0 and d["finished_requests"] == d["requests"]
    assert f["ttfp_ms"]["p99"] >= f["first_chunk_latency_ms"]["p99"] > 40.0 and f["live_streams"]["max"] <= 2
    assert d["graph_ladder"] == list(range(1, 2 * 15 + 1)) and d["slots"] == 3  # frame_totals(2 slots x 15)


# ------------------------------------------------------------------------------------------ SLO lines, helpers


def test_stage_trace_and_slo_helpers():
    assert codec_stage.trace.ramp_schedule(21, [1, 4, 15]) == [(0, 1), (1, 5), (5, 20), (20, 21)]
    assert codec_stage.trace.ramp_schedule(40, [1, 15]) == [(0, 1), (1, 16), (16, 31), (31, 40)]
    assert codec_stage.trace.ramp_schedule(3, [5]) == [(0, 3)]
    assert codec_stage.arms.upstream_batch_sizes(3) == [1, 2, 3]
    per_stream = codec_stage.metrics.preemptions_per_stream
    assert per_stream({0: 2, 1: 1}, {0: 5, 1: 2, 3: 1}) == {"max": 3, "mean": 0.8}  # 3, 1 and 1 more streams
    assert per_stream({0: 2}, {0: 2}) == {"max": None, "mean": None}
    assert codec_stage.arms.upstream_batch_sizes(512) == [1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 256, 512]
    lengths = codec_stage.trace.request_lengths(4000, seed=0)
    assert lengths.min() >= 13 and lengths.max() <= 256 and 48 <= int(sorted(lengths)[2000]) <= 52

    def figures(p99, live=1.0):
        return {"codec_latency_ms": {"p50": 1.0, "p95": 2.0, "p99": p99}, "live_streams": {"mean": live}}

    per_c = {"64": figures(40.0), "128": figures(150.0), "256": figures(150.5), "512": figures(None)}
    details = {c: {"stopped_early": False} for c in per_c}
    assert codec_stage.metrics.max_streams_at_slo(per_c, details, 150.0) == 128
    details["128"] = {"stopped_early": True}  # stopped runs never hold the SLO, whatever their p99
    assert codec_stage.metrics.max_streams_at_slo(per_c, details, 150.0) == 64
    assert codec_stage.metrics.max_streams_at_slo(per_c, details, 10.0) is None
    rates = {"rate=2": figures(10.0, 3.5), "rate=16": figures(20.0, 30.1), "rate=4.5": figures(200.0, 9.0)}
    assert codec_stage.metrics.max_rate_at_slo(rates, {k: {} for k in rates}, 150.0) == (16.0, 30.1)
    assert codec_stage.metrics.max_rate_at_slo(rates, {k: {} for k in rates}, 5.0) == (None, None)
    limit_text = codec_stage.report.limit_text
    assert limit_text({"4": "held", "8": "held"}) == "at least 8"
    assert limit_text({"4": "held", "8": "missed", "16": "held"}) == "16"
    assert limit_text({"rate=2": "held", "rate=4.5": "held", "rate=8": "missed"}) == "4.5"
    assert limit_text({"rate=2": "missed"}) == "none" and limit_text({}) == "none"
    assert limit_text({"4": "held", "8": "unknown"}) == "unknown (C=8: a figure is missing)"
    status = codec_stage.metrics.slo_status
    assert [status(figures(p), {}, 150.0) for p in (150.0, 150.5, None)] == ["held", "missed", "unknown"]
    assert status(figures(None), {"stopped_early": True}, 150.0) == "missed"  # a stopped run misses, p99 or not
    assert (
        codec_stage.report.plural(1, "request") == "1 request"
        and codec_stage.report.plural(0, "request") == "0 requests"
    )
    assert codec_stage.metrics.stall_warning("v2", 64, {"step_ms": {"p50": 10.0, "max": 100.0}}) is None
    warning = codec_stage.metrics.stall_warning("v2", 64, {"step_ms": {"p50": 10.0, "max": 100.5}})
    assert warning.startswith("warning: v2 C=64: step time max 100.5 ms > 10x its p50 10.0 ms")
    slowest = {"step_ms": {"p50": 10.0, "max": 100.5}, "slowest_step": {"chunks": 61, "max_frames": 15}}
    assert codec_stage.metrics.stall_warning("v2", "rate=8", slowest).startswith("warning: v2 rate=8: step time max")
    assert "that step decoded 61 chunks of up to 15 frames" in codec_stage.metrics.stall_warning("v2", 64, slowest)
    slowest["slowest_step"]["chunks"] = 1
    assert "that step decoded 1 chunk of up to 15 frames" in codec_stage.metrics.stall_warning("v2", 64, slowest)
    slowest["slowest_step"]["max_frames"] = 1
    assert "that step decoded 1 chunk of up to 1 frame (" in codec_stage.metrics.stall_warning("v2", 64, slowest)


def test_live_streams_are_a_time_weighted_mean_over_the_window():
    stats = codec_stage.metrics.live_stream_stats
    trace = [(0.0, 0), (1.0, 2), (3.0, 1), (5.0, 0)]  # 2 streams for 2 s, 1 for 2 s
    assert stats(trace, (0.0, 5.0)) == {"mean": 1.2, "max": 2}
    assert stats(trace, (3.0, 5.0)) == {"mean": 1.0, "max": 1}
    assert stats(trace, (2.0, 10.0)) == {"mean": 0.5, "max": 2}  # nothing live after 5 s
    assert stats(trace, (4.0, 4.0)) == {"mean": None, "max": None}


def test_stage_summary_splits_decode_calls_into_replay_and_host_time():
    run = codec_stage.simulate.Run(codec_latency=[0.01], first_latency=[0.1], serving_s=1.0, audio_s=1.0)
    run.step_wall, run.step_chunks, run.step_frames = [0.010, 0.050, 0.020], [1, 8, 2], [1, 15, 15]
    stats = {"decoded_frames": 10, "padded_frames": 0, "steps_by_path": {"graph": 3, "eager": 0}}
    figures, details = codec_stage.metrics.summarize(run, stats, None)
    assert figures["audio_seconds_per_second"] == 1.0 and figures["ttfp_ms"] == {"p50": None, "p95": None, "p99": None}
    assert figures["underrun_requests"] is None  # no request had audio
    assert details["slowest_step"] == {"chunks": 8, "max_frames": 15}
    assert "replay_ms" not in details  # not timed without --time-replays
    run.step_replay = [0.004, 0.030, 0.015]
    _, details = codec_stage.metrics.summarize(run, stats, None)
    assert details["slowest_step"] == {"chunks": 8, "max_frames": 15, "replay_ms": 30.0}
    assert details["replay_ms"]["p50"] == 15.0 and details["host_ms"]["p50"] == 6.0
    assert details["host_ms"]["p99"] == pytest.approx(19.72)  # numpy percentile of [6, 20, 5] ms
    assert details["replay_seconds"] == 0.049 and details["host_seconds"] == 0.031  # of 0.080 s busy


def test_stage_state_over_time_keeps_every_bucket_maximum():
    points = [(0.1 * i, (i * 37) % 101) for i in range(1000)]
    points[613] = (61.3, 500)  # the peak, inside a bucket
    kept = codec_stage.metrics.downsample_max(points)
    assert len(kept) == codec_stage.metrics.STATE_TRACE_POINTS == 200
    assert max(b for _, b in kept) == 500 and [61.3, 500] in kept
    for i, (seconds, value) in enumerate(kept):  # 1000 points: buckets of exactly 5
        bucket = points[5 * i : 5 * i + 5]
        assert value == max(b for _, b in bucket) and (seconds, value) in [(round(t, 4), b) for t, b in bucket]
    assert codec_stage.metrics.downsample_max(points[:3]) == [[0.0, 0], [0.1, 37], [0.2, 74]]
    assert codec_stage.metrics.downsample_max([]) == []
    assert len(codec_stage.metrics.downsample_max(points[:401])) == 200  # buckets of 2 or 3 points


def test_every_arm_of_a_plot_has_its_own_style():
    sys.path.insert(0, str(BENCH_DIR))
    from plotting import arm_styles

    arms = ["v2", "legacy", "upstream", "ideal", "v2-paged", "v2-triton", "v2-sdpa", "upstream-triton"]
    styles = arm_styles(arms)
    for key in ("color", "marker", "linewidth"):
        values = [styles[a][key] for a in arms]
        assert len(set(values)) == len(values), key
    assert styles["ideal"]["linestyle"] == "--" and {styles[a]["linestyle"] for a in arms if a != "ideal"} == {"-"}
    assert styles["v2"]["color"] == "tab:blue" and arm_styles(["v2-triton"])["v2-triton"]["color"] != "tab:blue"


# ------------------------------------------------------------------------------------------ state


def test_stage_state_plan_buys_whole_pools_or_pages():
    meta = common.random_decoder("tiny-v2", "meta")
    slot = meta.config.state_bytes_per_slot(4)  # float32 rings on CPU
    kw = {"meta_decoder": meta, "state_dtype": torch.float32, "graphs": False}
    # 2.5 slots of rings: the compact pool's null slot counts, so two live slots (three in all) do not fit.
    budget = 2.5 * slot / 2**30
    assert codec_stage.arms.state_plan("v2", 4, budget_gib=budget, **kw) == codec_stage.arms.StatePlan(1)
    assert codec_stage.arms.state_plan("legacy", 4, budget_gib=budget, **kw) == codec_stage.arms.StatePlan(2)
    # With CUDA graphs the legacy pool adds a scratch slot per padding row: the largest bucket, its slots.
    assert codec_stage.arms.state_plan(
        "legacy", 4, budget_gib=budget, **{**kw, "graphs": True}
    ) == codec_stage.arms.StatePlan(1)
    for name in ("v2", "legacy"):
        slots = codec_stage.arms.state_plan(name, 64, budget_gib=10 * budget, **kw).slots
        spec = codec_stage.arms.StateSpec.from_options(meta, common.pool_kind(name), torch.float32)
        pool = codec_stage.arms.build_pool(meta, spec)
        for n, fits in ((slots, True), (slots + 1, False)):  # the most slots whose whole pool fits
            pool.initialize(n, 0)
            assert (pool.state_bytes() <= 10 * budget * 2**30) == fits, (name, n)
            pool.close()
    paged = codec_stage.arms.state_plan("v2-paged", 4, budget_gib=budget, expected_stream_seconds=2.0, **kw)
    assert paged == codec_stage.arms.StatePlan(
        4, paged_budget={"state_budget_bytes": int(2.5 * slot), "expected_stream_frames": 25}
    )
    assert codec_stage.arms.state_plan("v2-paged", 4, page_fraction=0.5, **kw) == codec_stage.arms.StatePlan(
        4, page_fraction=0.5
    )
    assert codec_stage.arms.state_plan("v2", 4, **kw) == codec_stage.arms.StatePlan(4)
    with pytest.raises(ValueError, match="is below one stream's pool"):
        codec_stage.arms.state_plan(
            "v2", 4, budget_gib=1.5 * slot / 2**30, **kw
        )  # one slot plus the null slot: 2 slots
    with pytest.raises(ValueError, match=r"a state budget of \d+ bytes holds no stream"):
        codec_stage.arms.state_plan("v2-paged", 4, budget_gib=slot / 2**30, **kw)  # the null pages too
    with pytest.raises(ValueError, match="page_fraction 0.01 gives group"):
        codec_stage.arms.state_plan("v2-paged", 4, page_fraction=0.01, **kw)
    # The paged arm's pool pays its null pages from the budget.
    decoder = common.random_decoder("tiny-v2", "cpu")
    arm = codec_stage.arms.OurArm(
        decoder, 4, "v2-paged", False, [1, 15], 12, paged_budget={"state_budget_bytes": int(2.5 * slot)}
    )
    pool = arm.session.pool
    assert pool.page_fraction == pytest.approx(
        (int(2.5 * slot) - pool.budget.null_bytes()) / (4 * pool.budget.stream_bytes())
    )
    assert arm.ladder == frame_totals(4 * 15) == list(range(1, 61))
    arm.close()


def test_stage_paged_arm_reports_the_state_its_streams_hold(tmp_path):
    argv = _cpu("--arms v2,v2-paged --concurrency 3 --requests-per-stream 1 --give-up-ms 600000", out=tmp_path)
    result = _bench().main(argv)
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


def test_stage_paged_arm_short_of_pages_preempts_and_still_decodes_every_frame(tmp_path):
    flags = "--arms v2,v2-paged --concurrency 4 --requests-per-stream 1 --page-fraction 0.45 --give-up-ms 600000"
    argv = _cpu(flags, out=tmp_path)
    result = _bench().main(argv)
    v2, paged = result["details"]["v2"]["4"], result["details"]["v2-paged"]["4"]
    assert paged["preemptions"] > 0 and v2["preemptions"] == 0
    assert not paged["stopped_early"] and paged["finished_requests"] == v2["finished_requests"] == 4
    assert paged["decoded_frames"] == v2["decoded_frames"]
    assert paged["chunks"] == v2["chunks"]  # every chunk's latency counted once, when its audio came back
    assert paged["peak_state_bytes"] < paged["state_bytes"] < v2["state_bytes"]
    # Per stream, over the 4 streams of the run (the warm-up's ended before it): most and mean preemptions.
    per = paged["preemptions_per_stream"]
    assert per["mean"] == round(paged["preemptions"] / 4, 4) and 1 <= per["max"] <= paged["preemptions"]
    assert v2["preemptions_per_stream"] == {"max": 0, "mean": 0.0} and v2["session_wait_ms_max"] == 0.0
    assert paged["session_wait_ms_max"] > 0
    report = (tmp_path / "results.md").read_text()
    assert f"| v2-paged | 4 | {paged['preemptions']} | {per['max']} / {per['mean']:.2f} | " in report


def test_stage_paged_arm_splits_a_budget_by_fill_on_request(tmp_path, monkeypatch):
    bench = _bench()
    seen = {}
    original = codec_stage.arms.CodecStreamSession

    class Recording(original):
        def __init__(self, decoder, spec, options, **kwargs):
            seen.setdefault(spec.kind, (spec, options))
            super().__init__(decoder, spec, options, **kwargs)

    monkeypatch.setattr(codec_stage.arms, "CodecStreamSession", Recording)
    flags = "--arms v2-paged --concurrency 2 --requests-per-stream 1 --state-budget-gib 0.0003"
    argv = _cpu(flags + " --expected-stream-seconds 4.3 --give-up-ms 600000", out=tmp_path)
    result = bench.main(argv)
    spec, options = seen["paged"]
    assert spec.paging.state_budget_bytes == int(0.0003 * 2**30) and spec.paging.expected_stream_frames == 54
    assert spec.paging.page_fraction is None and options.graph_frame_totals == ()  # no graphs on CPU
    details = result["details"]["v2-paged"]["2"]
    assert not details["stopped_early"] and details["finished_requests"] == 2


def test_stage_trace_calls_reports_each_phase_and_the_slowest_call(tmp_path):
    # --trace-calls: one session.CallTrace per decode call of our arm, summarised per phase, and the
    # slowest call's own trace, whose phases add up to its total and fit inside the call's wall time.
    bench = _bench()
    argv = _cpu("--arms v2 --concurrency 3 --requests-per-stream 2 --trace-calls", out=tmp_path)
    details = bench.main(argv)["details"]["v2"]["3"]
    phases = ("plan_ms", "stage_ms", "run_ms", "to_host_ms", "finish_ms", "wait_ms", "total_ms", "gc_ms")
    assert list(details["call_trace_ms"]) == list(phases)
    for phase in phases:
        assert 0 <= details["call_trace_ms"][phase]["p50"] <= details["call_trace_ms"][phase]["p99"]
        assert details["call_trace_ms"][phase]["sum"] >= details["call_trace_ms"][phase]["p99"]
    busy_ms = details["codec_busy_seconds"] * 1e3  # the calls' wall time, every phase of each inside it
    assert details["call_trace_ms"]["total_ms"]["sum"] <= busy_ms + 0.1
    slowest = details["slowest_step"]
    trace = slowest["trace"]
    assert trace["chunks"] == slowest["chunks"] and trace["steps"] >= 1 and trace["failed"] is False
    assert sum(trace[p] for p in phases[:6]) == pytest.approx(trace["total_ms"], abs=0.01)
    assert 0 < trace["run_ms"] < trace["total_ms"] <= details["step_ms"]["max"]
    cost = details["step_cost"]  # the calls' split into a fixed cost per step and a cost per frame
    assert cost["calls"] == details["steps"] and cost["basis"] == "wall" and cost["steps_per_call"] >= 1
    # Without the flag, nothing is traced.
    plain = bench.main(_cpu("--arms v2 --concurrency 2 --requests-per-stream 1", out=tmp_path / "p"))
    details = plain["details"]["v2"]["2"]
    assert "call_trace_ms" not in details and "trace" not in details["slowest_step"] and "step_cost" not in details


def test_stage_our_arms_take_one_step_a_call_on_a_staggered_ramp(tmp_path, capsys):
    """Every step is ragged (the v2-ragged arm is gone: naming it is a usage error): on the ramp 1, 2, 4, 6 with
    staggered starts, calls holding chunks of several lengths, every call of v2 and legacy takes one step, and
    both decode every frame of every request."""
    flags = "--arms v2,legacy --arrival staggered --concurrency 3 --requests-per-stream 2 --chunks 1,2,4,6"
    result = _bench().main(_cpu(flags + " --trace-calls --give-up-ms 600000", out=tmp_path))
    v2, legacy = result["details"]["v2"]["3"], result["details"]["legacy"]["3"]
    assert v2["decoded_frames"] == legacy["decoded_frames"] and v2["finished_requests"] == 6
    assert v2["step_cost"]["steps_per_call"] == legacy["step_cost"]["steps_per_call"] == 1.0
    assert v2["padded_frames"] == legacy["padded_frames"] == 0  # no graphs on CPU: exact packed steps
    with pytest.raises(SystemExit) as exc:
        _bench().main(_cpu("--arms v2-ragged", out=tmp_path / "gone"))
    assert exc.value.code == 2 and "--arms 'v2-ragged': 'v2-ragged' not in" in capsys.readouterr().err


def test_step_cost_recovers_the_fixed_cost_per_step_and_the_cost_per_frame():
    """Calls built from 4.3 ms a step and 0.05 ms a frame give those two back; calls whose steps and frames are
    proportional (or fewer than 3 calls) cannot separate them and give None."""
    step_cost = codec_stage.metrics.step_cost
    steps, frames = [1, 3, 2, 4, 1, 2], [10, 12, 40, 30, 25, 6]
    seconds = [(4.3 * s + 0.05 * f) / 1e3 for s, f in zip(steps, frames)]
    cost = step_cost(seconds, steps, frames, "replay")
    assert cost["calls"] == 6 and cost["steps_per_call"] == pytest.approx(13 / 6, abs=1e-4)
    assert (cost["fixed_ms_per_step"], cost["ms_per_frame"]) == (4.3, 0.05) and cost["basis"] == "replay"
    flat = step_cost([0.01, 0.02, 0.03], [1, 2, 3], [5, 10, 15], "wall")
    assert flat["fixed_ms_per_step"] is None and flat["ms_per_frame"] is None and flat["calls"] == 3
    assert step_cost([0.01, 0.02], [1, 2], [5, 3], "wall")["fixed_ms_per_step"] is None


# ------------------------------------------------------------------------------------------ --append


def test_stage_append_merges_a_split_sweep(tmp_path, capsys):
    bench = _bench()
    base = _cpu(out=tmp_path)
    first = bench.main([*base, "--requests-per-stream", "1", "--concurrency", "2", "--arms", "v2"])
    merged = bench.main([*base, "--requests-per-stream", "1", "--concurrency", "3", "--arms", "v2,ideal", "--append"])
    run = merged["run"]
    assert run["concurrency"] == [2, 3] and run["requests"] == {"2": 2, "3": 3} and run["keys"] == ["2", "3"]
    assert [i["command"] for i in run["invocations"]] == [first["run"]["command"], run["command"]]
    assert list(merged["arms"]["v2"]) == ["2", "3", "max_streams_at_slo", "slo_held_by_every_run"]
    assert list(merged["arms"]["ideal"]) == ["3", "max_streams_at_slo", "slo_held_by_every_run"]
    assert merged["arms"]["v2"]["2"] == first["arms"]["v2"]["2"] and merged["arms"]["ideal"]["max_streams_at_slo"] == 3
    held = [c for c in (2, 3) if merged["arms"]["v2"][str(c)]["codec_latency_ms"]["p99"] <= 150.0]
    assert merged["arms"]["v2"]["max_streams_at_slo"] == (max(held) if held else None)
    with np.load(tmp_path / "latencies.npz") as stored:
        assert sorted(stored.files) == ["ideal/3", "v2/2", "v2/3"]
        assert len(stored["v2/2"]) == merged["details"]["v2"]["2"]["chunks"]
    capsys.readouterr()
    # Settings that change what a run measures must agree (a usage error naming them, nothing run).
    for extra, message in (
        (["--requests-per-stream", "2"], "requests_per_stream 1 != 2"),
        (["--requests-per-stream", "1", "--state-budget-gib", "0.001"], "state_budget_gib None != 0.001"),
        (["--requests-per-stream", "1", "--page-fraction", "0.5", "--arms", "v2-paged"], "page_fraction 1.0 != 0.5"),
        (["--requests-per-stream", "1", "--trace-calls"], "trace_calls False != True"),
        (["--requests-per-stream", "1", "--talker-rtf", "1"], "talker_rtf 0.5 != 1.0"),
        (["--requests-per-stream", "1", "--arrival", "staggered"], "arrival 'wave' != 'staggered'"),
    ):
        with pytest.raises(SystemExit) as exc:
            bench.main([*base, "--concurrency", "4", "--arms", "ideal", *extra, "--append"])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    (tmp_path / "results.md").unlink()
    assert bench.main(["--out", str(tmp_path), "--report-only"]) == merged
    assert "| ideal | 3 | 3 |" in (tmp_path / "results.md").read_text()


# ------------------------------------------------------------------------------------------ bad flags


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--page-fraction", "0"], "--page-fraction must be in (0, 1], got 0.0"),
        (["--page-fraction", "nan"], "--page-fraction must be in (0, 1], got nan"),
        (["--page-fraction", "1.5"], "--page-fraction must be in (0, 1], got 1.5"),
        (["--state-budget-gib", "nan"], "--state-budget-gib must be a positive number, got nan"),
        (["--state-budget-gib", "-1"], "--state-budget-gib must be a positive number, got -1.0"),
        (["--expected-stream-seconds", "0"], "--expected-stream-seconds must be a positive number, got 0.0"),
        (["--expected-stream-seconds", "4.3"], "--expected-stream-seconds 4.3 splits a state budget: give --state"),
        (["--slo-ms", "nan"], "--slo-ms must be a positive number, got nan"),
        (["--talker-rtf", "0"], "--talker-rtf must be a positive number, got 0.0"),
        (["--talker-rtf", "-0.5"], "--talker-rtf must be a positive number, got -0.5"),
        (["--arrival", "bursty"], "argument --arrival: invalid choice: 'bursty'"),
        (["--request-rate", "2"], "--request-rate 2 applies to --arrival poisson, not --arrival wave"),
        (["--max-concurrency", "2", "--arrival", "staggered"], "--max-concurrency 2 applies to --arrival poisson"),
        (["--arrival", "poisson", "--request-rate", "0"], "--request-rate '0': expected positive numbers, got '0'"),
        (["--arrival", "poisson", "--request-rate", "nan"], "--request-rate 'nan': expected positive numbers"),
        (["--arrival", "poisson", "--request-rate", "-1"], "--request-rate '-1': expected positive numbers"),
        (["--arrival", "poisson", "--request-rate", "1,,2"], "--request-rate '1,,2': empty item in '1,,2'"),
        (["--arrival", "poisson", "--burstiness", "0"], "--burstiness must be a positive number, got 0.0"),
        (["--arrival", "poisson", "--measure-seconds", "0"], "--measure-seconds must be a positive number, got 0"),
        (["--arrival", "poisson", "--warmup-seconds", "-1"], "--warmup-seconds must be a non-negative number"),
        (["--arrival", "poisson", "--concurrency", "4,8"], "--concurrency '4,8': poisson takes one value"),
        (["--arrival", "poisson", "--concurrency", "4", "--max-concurrency", "5"], "--max-concurrency 5 exceeds"),
        (["--arrival", "poisson", "--requests-per-stream", "2"], "--requests-per-stream 2 applies to closed-loop"),
        (["--concurrency", "0"], "--concurrency '0': expected positive integers"),
        (["--concurrency", "abc"], "--concurrency 'abc': 'abc' is not an integer"),
        (["--concurrency", "4,,8"], "--concurrency '4,,8': empty item in '4,,8'"),
        (["--chunks", "1.5"], "--chunks '1.5': "),
        (["--chunks", "1,,15"], "--chunks '1,,15': '' is not an integer"),
        (["--chunks", "\u0661,\u0662"], "--chunks '\u0661,\u0662': '\u0661' is not an integer"),
        (["--concurrency", "1_6"], "--concurrency '1_6': '1_6' is not an integer"),
        (["--chunks", "1,15;1,0"], "--chunks '1,15;1,0': chunk sizes must be >= 1 frame, got '1,0'"),
        (["--arms", "bogus"], "--arms 'bogus': 'bogus' not in"),
        (["--arms", "v2-paged", "--preset", "tiny-v1"], "no arm left to run (v2-paged: preset 'tiny-v1' is a v1 codec"),
        (["--arms", "v2-paged", "--page-fraction", "0.01"], "--page-fraction 0.01 for v2-paged at 4 streams: "),
        (["--arms", "v2", "--state-budget-gib", "1e-9"], "--state-budget-gib 1e-09 for v2 at 4 streams: is below"),
        (["--n-vq", "13"], "--n-vq 13 exceeds the codec's 12 codebooks"),
        (
            ["--page-fraction", "0.5"],
            "--page-fraction 0.5 applies to the v2-paged arm, not to v2,legacy,upstream,ideal",
        ),
        (["--concurrency", "100000"], "--concurrency '100000': at most 65536 streams per run, got 100000"),
        (["--chunks", "1,1000000000000000"], "--chunks 1000000000000000: at most 100"),
        (["--chunks", "200"], "--chunks 200: at most 100"),  # the stage's limit: it refuses any larger chunk
        (["--chunks", "1,15;1,101"], "--chunks 101: at most 100"),
        (["--seed", str(2**63)], f"--seed must be in 0..{2**63 - 1}, got {2**63}"),
        (["--give-up-ms", "nan"], "--give-up-ms must be a positive number, got nan"),
        (
            ["--requests-per-stream", "1000000"],
            "--concurrency 4 x --requests-per-stream 1000000 = 4000000 requests: at",
        ),
        (
            ["--arrival", "poisson", "--request-rate", "1", "--measure-seconds", "1e7"],
            "--request-rate 1 x (--warmup-seconds 10 + --measure-seconds 1e+07) = 10000010 requests expected: at most",
        ),
    ],
)
def test_main_job_refuses_bad_flags_before_any_arm_runs(argv, message, tmp_path, capsys):
    # A usage error (exit 2) naming the flag and the value, and nothing written: the arms would refuse some of
    # these values only when built, after the arms before them had run and written their results.
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        _bench().main(["--device", "cpu", "--concurrency", "4", *argv, "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not out.exists()


def test_main_job_refuses_cuda_on_a_machine_without_it_and_an_out_it_cannot_write(tmp_path, capsys, monkeypatch):
    bench = _bench()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "cuda", "--out", str(tmp_path / "out")])
    assert exc.value.code == 2 and "--device cuda: no CUDA device is available" in capsys.readouterr().err
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "cpu", "--arms", "ideal", "--out", str(tmp_path / "file" / "out")])
    assert exc.value.code == 2
    assert re.search(r"--out '.*/file/out': cannot write there \(", capsys.readouterr().err)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--out", str(tmp_path / "none"), "--report-only"])
    assert exc.value.code == 2 and "results.json does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    "files, message",
    [
        ({"results.json": "{not json"}, "results.json is not valid JSON: Expecting property name"),
        ({"results.json": "[1, 2]"}, "results.json: the top level is a list, expected an object"),
        ({"results.json": '{"run": {}, "arms": {}, "details": {}}'}, "results.json: run.slo is missing"),
        ({"sweep.json": '{"schedules": 3}'}, "sweep.json: commit is missing"),
        (
            {"sweep.json": '{"commit": "x", "command": "x", "arrival": "wave", "schedules": 3}'},
            "sweep.json: schedules is 3, expected an object",
        ),
        (
            {"sweep.json": '{"commit": "x", "command": "x", "arrival": "wave", "schedules": {"1,15": "../x"}}'},
            "sweep.json: schedules.1,15 is a string, expected a directory name",
        ),
        (
            {"sweep.json": '{"commit": "x", "command": "x", "arrival": "wave", "schedules": {"1,15": "chunks_1_15"}}'},
            "chunks_1_15/results.json does not exist",
        ),
    ],
)
def test_report_only_names_a_file_it_cannot_read(files, message, tmp_path, capsys):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as exc:
        _bench().main(["--out", str(tmp_path), "--report-only"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def ideal_out(tmp_path_factory) -> Path:
    """One ``ideal`` run (no decoding) of two schedules: ``sweep/`` with a sub-directory each, and ``one/``."""
    root = tmp_path_factory.mktemp("report_only")
    for name, chunks in (("sweep", "1,15;3,5"), ("one", "1,15")):
        argv = _cpu("--arms ideal --concurrency 2 --requests-per-stream 1", out=root / name) + ["--chunks", chunks]
        _bench().main(argv)
    return root


def _set(doc, path: str, value):
    *parents, last = path.split(".")
    for key in parents:
        doc = doc[key]
    if value is _DROP:
        del doc[last]
    else:
        doc[last] = value


_DROP = object()
# (key of results.json, what it becomes, the error after the file's path)
BAD_RESULTS = {
    "nan": ("arms.ideal.2.codec_latency_ms.p99", float("nan"), "is NaN, expected a finite number"),
    "infinity": ("details.ideal.2.peak_state_bytes", float("-inf"), "is infinite, expected a finite number"),
    "null": ("run.slo.codec_latency_p99_ms", None, "is null, expected a positive number"),
    "null_figures": ("arms.ideal.2.steps_by_path", None, "is null, expected an object"),
    "zero_rtf": ("run.talker_rtf", 0, "is 0, expected a positive number"),
    "missing_key": ("run.frame_rate", _DROP, "is missing"),
    "missing_playback": ("arms.ideal.2.continuity", _DROP, "is missing"),
    "missing_details": ("details.ideal.2", _DROP, "is missing (arms.ideal.2 is a run)"),
    "arms_list": ("arms", [], "is a list, expected an object"),
}
REPORTS = ("results.md", "latency_cdf.png", "concurrency.png", "playback.png", "state_over_time.png", "sweep.md")


def _without_reports(src: Path, dst: Path) -> Path:
    """A copy of ``src`` holding only results.json, latencies.npz and sweep.json: every report is to be written."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*REPORTS))
    return dst


def _report_only_refused(out: Path, capsys) -> str:
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as exc:
        _bench().main(["--out", str(out), "--report-only"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files  # nothing written
    return err.split(": error: --report-only: ", 1)[1].rstrip("\n")


@pytest.mark.parametrize("case", sorted(BAD_RESULTS))
@pytest.mark.parametrize("layout", ["one", "sweep"])
def test_report_only_refuses_a_bad_results_file_naming_file_and_key_and_writes_nothing(
    ideal_out, tmp_path, capsys, case, layout
):
    out = _without_reports(ideal_out / layout, tmp_path / layout)
    # In a sweep the second schedule's file is the bad one: the first schedule's reports are not written either.
    path = out / ("chunks_3_5" if layout == "sweep" else "") / "results.json"
    key, value, said = BAD_RESULTS[case]
    doc = json.loads(path.read_text())
    _set(doc, key, value)
    path.write_text(json.dumps(doc))  # NaN and Infinity as Python's json writes them
    assert _report_only_refused(out, capsys) == f"{path}: {key} {said}"


def test_report_only_refuses_a_truncated_results_file_and_bad_latencies(ideal_out, tmp_path, capsys):
    out = _without_reports(ideal_out / "sweep", tmp_path / "sweep")
    path = out / "chunks_3_5" / "results.json"
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    assert _report_only_refused(out, capsys).startswith(f"{path} is not valid JSON: ")
    path.write_text(text)
    npz = out / "chunks_1_15" / "latencies.npz"
    np.savez(npz, **{"ideal/2": np.array([0.0, np.nan])})
    assert _report_only_refused(out, capsys) == f"{npz}: ideal/2 is not a list of finite latencies (ms)"
    np.savez(npz, **{"ideal": np.array([0.0])})
    assert _report_only_refused(out, capsys) == f"{npz} is not readable: array 'ideal' is not named <arm>/<run key>"
    npz.write_bytes(b"not an archive\n")
    assert _report_only_refused(out, capsys) == f"{npz} is not readable: not an .npz (zip) archive"


def test_report_only_rewrites_every_report_of_good_files(ideal_out, tmp_path, capsys):
    out = _without_reports(ideal_out / "sweep", tmp_path / "sweep")
    result = _bench().main(["--out", str(out), "--report-only"])
    assert list(result["results"]) == ["chunks_1_15", "chunks_3_5"]
    assert (out / "sweep.md").read_text() == (ideal_out / "sweep" / "sweep.md").read_text()
    for schedule in result["results"]:
        assert (out / schedule / "results.md").read_text() == (
            ideal_out / "sweep" / schedule / "results.md"
        ).read_text()


def test_report_only_refuses_run_flags(tmp_path, capsys):
    # --report-only runs nothing: a run flag given with it (valid or not) would be silently ignored.
    with pytest.raises(SystemExit) as exc:
        _bench().main(["--out", str(tmp_path), "--report-only", "--concurrency", "-5", "--seed", "3"])
    assert exc.value.code == 2
    assert "runs nothing: --concurrency, --seed has no effect" in capsys.readouterr().err


def test_main_job_trace_memory_stays_with_the_live_streams():
    # The codes of a request are drawn when it starts and dropped when it ends, in request order, so every arm
    # gets the same codes whatever order its chunks are sent in.
    trace = codec_stage.trace.closed_loop_trace("wave", 2, 6, 0.6, seed=5)
    a, b = codec_stage.trace.CodeSource(trace, 12, 1024), codec_stage.trace.CodeSource(trace, 12, 1024)
    third = a.take(3)
    assert sorted(a._kept) == [0, 1, 2, 3] and third.shape == (12, trace.lengths[3])
    for r in range(3):
        a.drop(r)
    assert sorted(a._kept) == [3] and torch.equal(b.take(3), third)
    assert torch.equal(a.take(5), b.take(5)) and not torch.equal(a.take(4)[:, :13], a.take(5)[:, :13])


def test_ideal_arm_returns_zero_audio_of_each_chunk_and_holds_no_state():
    cfg = preset_config("tiny-v2")
    arm = codec_stage.arms.IdealArm(2, cfg.number_channels, cfg.samples_per_frame, 15)
    codes = torch.zeros(12, 15, dtype=torch.long)
    audio = arm.decode([upstream_stage.StageChunk("a", codes[:, :1]), upstream_stage.StageChunk("b", codes)])
    assert audio["a"].shape == (2, cfg.samples_per_frame) and audio["b"].shape == (2, 15 * cfg.samples_per_frame)
    assert not audio["b"].any() and arm.timed is False and arm.state_peak_bytes() == 0
    assert arm.stats() == {"steps_by_path": {"graph": 0, "eager": 0}, "decoded_frames": 16, "padded_frames": 0}


def test_a_run_out_of_device_memory_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    # The CUDA-only error path, on the CPU: the run's figures are empty, its details name the error, the SLO
    # line leaves it out and the reports still render.
    bench = _bench()
    sweep = sys.modules["codec_stage.sweep"]
    real = sweep.run_arm

    def run_arm(name, make_arm, trace, load, sizes, settings):
        if load.key == "3":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(name, make_arm, trace, load, sizes, settings)

    monkeypatch.setattr(sweep, "run_arm", run_arm)
    result = bench.main(_cpu("--arms ideal --concurrency 2,3 --requests-per-stream 1", out=tmp_path))
    entry, details = result["arms"]["ideal"], result["details"]["ideal"]
    assert details["3"]["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert entry["3"]["codec_latency_ms"]["p99"] is None and entry["3"]["live_streams"] == {"mean": None, "max": None}
    assert entry["max_streams_at_slo"] == 2 and entry["slo_held_by_every_run"] is False
    assert "| ideal | 3 | 3 | - | - / - / - | - | - / - | 0 / 0 |" in (tmp_path / "results.md").read_text()
    assert "| OutOfMemoryError |" in (tmp_path / "results.md").read_text()


def test_time_replays_times_every_graph_replay_of_the_session(monkeypatch):
    """--time-replays brackets each graph replay the session runs (``StreamingGraphRunner.replay``, which the step
    runner calls after staging a step's inputs into the graph's buffers) with device synchronisations. The graph
    runner is a stand-in here (CPU): its replays take 2 ms each and return zero audio."""
    import time
    import types

    decoder = common.random_decoder("tiny-v2", "cpu")
    arm = codec_stage.arms.OurArm(decoder, 2, "v2", False, [1, 4], 12)
    session, syncs, replays = arm.session, [], []
    channels, spf = session.channels, session.samples_per_frame

    class Graphs:
        # No ladder without graphs on CPU: each step's shape is exact (rows, longest piece, real frames).
        graphs = {StepShape(2, 1, 2): None, StepShape(2, 4, 7): None}

        def buffers(self, shape):
            R, F = shape.rows, shape.total_frames
            zeros = torch.zeros(R, dtype=torch.long)
            return types.SimpleNamespace(
                codes=torch.zeros(session.n_vq, F, dtype=torch.long), valid_frames=zeros.clone(),
                slot_ids=zeros.clone(), valid=torch.zeros(R, dtype=torch.bool), padding_host=zeros,
            )  # fmt: skip

        def replay(self, shape):
            replays.append(shape)
            time.sleep(0.002)
            return torch.zeros(channels, shape.total_frames * spf)

        def decode(self, codes, valid_frames, slot_ids):  # what the session called before it staged steps itself
            raise AssertionError("the session no longer calls decode")

        def close(self):
            pass

    graphs, runner = Graphs(), session.step_runner  # the same runner over the stand-in: its planner holds its shapes
    session.step_runner = StepRunner(
        runner.pool, session.n_vq, runner.ladder, runner.counters, runner.tracer, graphs=graphs
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    arm._time_replays(graphs)
    arm.time_replays = True
    codes = torch.zeros(12, 4, dtype=torch.long)
    arm.decode(
        [upstream_stage.StageChunk("a", codes[:, :1], False), upstream_stage.StageChunk("b", codes[:, :1], False)]
    )
    arm.decode([upstream_stage.StageChunk("a", codes[:, :3], False), upstream_stage.StageChunk("b", codes, False)])
    assert replays == [StepShape(2, 1, 2), StepShape(2, 4, 7)]  # one step a call: 1 + 1 frames, then 3 + 4
    assert syncs == [session.device] * 4  # before and after each replay
    assert arm.take_replay_seconds() >= 0.004 and arm.take_replay_seconds() == 0.0
    arm.close()
