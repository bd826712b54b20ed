# SPDX-License-Identifier: Apache-2.0
"""What the main job's reports claim (issue 51): a missing figure is unknown, never a pass; ``--report-only``
without ``latencies.npz`` refuses; the CPU banner and ``results.md`` say what the run found; the host load is
recorded; ``--chunks`` has the stage's limit; TTFP p95, the underrun count and the load that keeps zero underruns
and the SLO; ``playback.png`` from zero; ``wall_seconds`` from the process start."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import bench_modules
import pytest

pytestmark = [pytest.mark.cpu]


def _bench():
    return bench_modules.load("bench_codec_stage")


def _module(name: str):
    _bench()  # puts benchmarks/tts on sys.path
    return sys.modules[f"codec_stage.{name}"]


def _ideal(out: Path, flags: str) -> dict:
    argv = ["--device", "cpu", "--preset", "tiny-v2", "--quiet", "--arms", "ideal", *flags.split()]
    return _bench().main([*argv, "--out", str(out)])


@pytest.fixture(scope="module")
def ramp_out(tmp_path_factory) -> Path:
    """The ideal arm at 2 and 3 streams on the doubling ramp (no request stalls at talker RTF 0.5)."""
    out = tmp_path_factory.mktemp("ramp")
    _ideal(out, "--concurrency 2,3 --requests-per-stream 2 --chunks 1,2,4,8,15")
    return out


def _copy(src: Path, dst: Path, *keep: str) -> Path:
    dst.mkdir()
    for name in keep:
        shutil.copy(src / name, dst / name)
    return dst


def _report_only(out: Path) -> dict:
    return _bench().main(["--out", str(out), "--report-only"])


# ------------------------------------------------------------------------------------------ item 5


def test_report_only_calls_a_null_p99_unknown_never_a_pass(ramp_out, tmp_path):
    out = _copy(ramp_out, tmp_path / "out", "results.json", "latencies.npz")
    doc = json.loads((out / "results.json").read_text())
    assert doc["arms"]["ideal"]["max_streams_at_slo"] == 3 and doc["arms"]["ideal"]["slo_held_by_every_run"]
    doc["arms"]["ideal"]["3"]["codec_latency_ms"]["p99"] = None  # the stored sweep lines still say "held"
    (out / "results.json").write_text(json.dumps(doc))
    _report_only(out)
    md = (out / "results.md").read_text()
    assert "| ideal | unknown (C=3: a figure is missing) | unknown (C=3: a figure is missing) |" in md
    assert "at least 3" not in md and "| unknown (codec p99 missing) |" in md
    assert "This run: ideal held the SLO at 2 streams, has no p99 at 3 streams." in md


# ------------------------------------------------------------------------------------------ item 8


def test_report_only_without_latencies_npz_names_it_exits_2_and_writes_nothing(ramp_out, tmp_path, capsys):
    out = _copy(ramp_out, tmp_path / "out", "results.json")
    with pytest.raises(SystemExit) as exc:
        _report_only(out)
    captured = capsys.readouterr()
    assert exc.value.code == 2
    assert captured.err == f"bench_codec_stage.py: error: --report-only: {out / 'latencies.npz'} does not exist\n"
    assert "rewrote" not in captured.out
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]  # no CDF, no report


# ------------------------------------------------------------------------------------------ item 9


def test_results_say_what_the_run_found_not_a_fixed_claim(ramp_out):
    report = _module("report")
    md = (ramp_out / "results.md").read_text()
    assert "This run: ideal held the SLO at 2 and 3 streams." in md
    assert "every arm holds the SLO" not in md and "every arm holds" not in report.cpu_note("cpu", "tiny-v2")
    result = {
        "run": {"slo": {"codec_latency_p99_ms": 150.0}},
        "arms": {
            "v2": {"4": {"codec_latency_ms": {"p99": 20.0}}, "8": {"codec_latency_ms": {"p99": 30.0}}},
            "upstream": {"4": {"codec_latency_ms": {"p99": 90.0}}, "8": {"codec_latency_ms": {"p99": 151.0}}},
        },
        "details": {"v2": {"4": {}, "8": {}}, "upstream": {"4": {}, "8": {"stopped_early": False}}},
    }
    assert report.run_findings(result) == (
        "This run: v2 held the SLO at 4 and 8 streams; upstream held the SLO at 4 streams, missed it at 8 streams."
    )
    result["arms"] = {"v2": {"rate=2": {"codec_latency_ms": {"p99": 20.0}}}}
    result["details"] = {"v2": {"rate=2": {"error": "OutOfMemoryError: x"}}}
    assert report.run_findings(result) == "This run: v2 missed it at 2 requests/s."


def test_poisson_findings_name_request_rates(tmp_path):
    flags = "--arrival poisson --concurrency 4 --request-rate 2 --warmup-seconds 1 --measure-seconds 2 --chunks 1,15"
    _ideal(tmp_path, flags)
    assert "This run: ideal held the SLO at 2 requests/s." in (tmp_path / "results.md").read_text()


def test_host_load_is_recorded_and_a_busy_host_is_warned_of(tmp_path, monkeypatch, capsys):
    sweep = _module("sweep")
    record, warning = sweep.host_load((1.2, 1.0, 0.9), (2.4, 1.5, 1.0), 2)
    assert record == {"cores": 2, "before": [1.2, 1.0, 0.9], "after": [2.4, 1.5, 1.0], "busy": False}
    assert warning is None
    record, warning = sweep.host_load((1.6, 1.0, 0.9), (1.0, 1.0, 1.0), 2)  # others used the cores before
    assert record["busy"] and warning == (
        "the host was busy: 1-minute load average 1.60 before the runs and 1.00 after, on 2 cores (busy above 1.5 "
        "before, 2.5 after): other work shared the cores, so step times and every latency may be slower than this "
        "machine's"
    )
    assert sweep.host_load((0.1, 0.1, 0.1), (2.6, 1.0, 1.0), 2)[0]["busy"]

    monkeypatch.setattr(sweep.os, "getloadavg", lambda: (9.0, 8.0, 7.0))
    monkeypatch.setattr(sweep, "host_cores", lambda: 4)
    result = _ideal(tmp_path, "--concurrency 2 --requests-per-stream 1")
    assert result["run"]["host_load"] == {"cores": 4, "before": [9.0, 8.0, 7.0], "after": [9.0, 8.0, 7.0], "busy": True}
    assert json.loads((tmp_path / "results.json").read_text())["run"]["host_load"]["busy"] is True
    assert result["warnings"][-1].startswith("the host was busy: 1-minute load average 9.00 before the runs")
    assert "warning: the host was busy" in capsys.readouterr().out
    md = (tmp_path / "results.md").read_text()
    assert (
        "Host load average (1 / 5 / 15 min) 9.00 / 8.00 / 7.00 before the runs, 9.00 / 8.00 / 7.00 after, on 4 " in md
    )
    assert "cores (busy: figures may be slow)." in md


# ------------------------------------------------------------------------------------------ item 10


def test_chunks_take_the_stage_limit_from_the_package(tmp_path, capsys):
    from vllm_omni_moss.model_executor.models.moss_tts.stage_options import DEFAULT_MAX_STEP_FRAMES

    assert DEFAULT_MAX_STEP_FRAMES == 100
    with pytest.raises(SystemExit) as exc:
        _bench().main(["--device", "cpu", "--chunks", "1,200", "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert capsys.readouterr().err == "bench_codec_stage.py: error: --chunks 200: at most 100 (see --help)\n"
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ item 12


def test_ttfp_p95_underrun_count_and_the_load_with_no_underrun(ramp_out, tmp_path):
    # The doubling ramp at talker RTF 0.5 is generated as fast as it plays: no request stalls.
    doc = json.loads((ramp_out / "results.json").read_text())
    for c, requests in (("2", 4), ("3", 6)):
        f = doc["arms"]["ideal"][c]
        assert f["ttfp_ms"] == {"p50": 40.0, "p95": 40.0, "p99": 40.0} and f["underrun_requests"] == 0
        assert doc["details"]["ideal"][c]["requests"] == requests
    md = (ramp_out / "results.md").read_text()
    assert "| arm | C | TTFP p50 / p95 / p99 ms | underrun p50 / p99 ms | requests with an underrun |" in md
    assert "| ideal | 2 | 40.0 / 40.0 / 40.0 | 0.0 / 0.0 | 0 |" in md
    assert "| ideal | at least 3 | at least 3 |" in md
    # 1 then 15: the second chunk (12 frames or more) takes at least 480 ms to generate after 80 ms of audio,
    # so every request stalls.
    stalled = _ideal(tmp_path, "--concurrency 2,3 --requests-per-stream 2 --chunks 1,15")
    assert [stalled["arms"]["ideal"][c]["underrun_requests"] for c in ("2", "3")] == [4, 6]
    md = (tmp_path / "results.md").read_text()
    assert "| ideal | 3 | 40.0 / 40.0 / 40.0 | " in md and "| ideal | at least 3 | none |" in md
    # A file older than underrun_requests: the second line is unknown, never a pass.
    out = _copy(ramp_out, tmp_path / "old", "results.json", "latencies.npz")
    for c in ("2", "3"):
        del doc["arms"]["ideal"][c]["underrun_requests"]
        del doc["arms"]["ideal"][c]["ttfp_ms"]["p95"]
    (out / "results.json").write_text(json.dumps(doc))
    _report_only(out)
    md = (out / "results.md").read_text()
    assert "| ideal | 2 | 40.0 / - / 40.0 | 0.0 / 0.0 | - |" in md
    assert "| ideal | at least 3 | unknown (C=2, C=3: a figure is missing) |" in md


def test_playback_plot_y_axes_start_at_zero(ramp_out, monkeypatch, tmp_path):
    plots = _module("plots")
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, plt, path: figures.append(fig))
    plots.plot_playback(json.loads((ramp_out / "results.json").read_text()), tmp_path / "playback.png")
    ttfp, stall, cont = figures[0].axes[:3]
    assert ttfp.get_ylim()[0] == 0.0 and ttfp.get_ylim()[1] >= 40.0  # every TTFP is 40 ms: the axis shows 0 too
    assert stall.get_ylim()[0] == 0.0 and cont.get_ylim() == (-0.02, 1.02)


def test_wall_seconds_count_from_the_process_start_through_the_reports(tmp_path, monkeypatch):
    sweep = _module("sweep")
    written = []
    real = sweep.write_reports
    monkeypatch.setattr(sweep, "write_reports", lambda *a, **k: (real(*a, **k), written.append(time.perf_counter())))
    argv = ["--device", "cpu", "--preset", "tiny-v2", "--quiet", "--arms", "ideal", "--concurrency", "2"]
    argv += ["--requests-per-stream", "1", "--out", str(tmp_path)]
    started = time.perf_counter() - 100.0  # as if imports had taken 100 s
    result = sweep.main(argv, "d", started)
    wall = result["run"]["invocations"][-1]["wall_seconds"]
    assert wall >= round(written[-1] - started, 1) >= 100.0  # the reports written before it was taken
    assert json.loads((tmp_path / "results.json").read_text())["run"]["invocations"][-1]["wall_seconds"] == wall
    script = (bench_modules.BENCH_DIR / "bench_codec_stage.py").read_text()
    assert script.index("STARTED = time.perf_counter()") < script.index("from codec_stage.sweep import main")


# ------------------------------------------------------------------------------------------ item 11


def test_the_main_job_prints_a_legend_of_its_arms_and_figures_once(tmp_path, capsys):
    report = _module("report")
    _ideal(tmp_path, "--concurrency 2 --requests-per-stream 1")
    printed = capsys.readouterr().out
    text = report.wrapped(report.legend(["ideal"], 150.0, False))
    assert printed.count(text) == 1 and printed.index(text) < printed.index("ideal C=2:")  # before the first run
    assert "Legend." in text and printed.count("Legend.") == 1
    line = report.legend(["v2", "upstream", "ideal", "v2-ragged"], 120.0, True)
    assert "v2 = this package's session (the default pool); upstream = vLLM-Omni 0.30.0's own codec stage;" in line
    assert "; v2-ragged. Loads: rate=R: R requests/s arriving (Poisson)." in line  # no meaning: named alone
    assert "SLO: codec p99 <= 120 ms over the run" in line and "C100: the share of requests" in line
    assert "More: docs/glossary.md, 'Benchmarks and serving'." in line
