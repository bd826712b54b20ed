# SPDX-License-Identifier: Apache-2.0
"""What the main job, ``bench_codec_stage.py``, shows a reader: a bad flag as one line, the note a CPU run prints
first and writes at the top of ``results.md``, the interpreter by version, and plots whose axes, lines and notes
can be read (tick labels on every log axis, state in a unit that fits, coinciding lines told apart, a flat
continuity panel explained)."""

from __future__ import annotations

import platform
import sys

import bench_modules
import pytest

pytestmark = [pytest.mark.cpu]

BENCH_DIR = bench_modules.BENCH_DIR


def _bench():
    return bench_modules.load("bench_codec_stage")


def _plots():
    _bench()  # puts benchmarks/tts on sys.path
    return sys.modules["codec_stage.plots"]


# ------------------------------------------------------------------------------------------ errors and notes


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--talker-rtf", "0"], "--talker-rtf must be a positive number, got 0.0"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--arrival", "x"], "argument --arrival: invalid choice: 'x' (choose from 'wave', 'staggered', 'poisson')"),
    ],
)
def test_a_bad_flag_is_one_line_on_stderr(argv, message, tmp_path, capsys):
    # No usage block before the message: the one line names the flag and the value, and points to --help.
    with pytest.raises(SystemExit) as exc:
        _bench().main(["--device", "cpu", *argv, "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == f"bench_codec_stage.py: error: {message} (see --help)\n"
    assert captured.out == ""


def test_a_cpu_run_says_first_what_it_shows_and_records_the_python_version(tmp_path, capsys):
    bench = _bench()
    report = sys.modules["codec_stage.report"]
    argv = ["--device", "cpu", "--arms", "ideal", "--concurrency", "2", "--requests-per-stream", "1", "--quiet"]
    result = bench.main([*argv, "--out", str(tmp_path)])
    note = report.cpu_note("cpu", "tiny-v2")
    assert note.startswith("CPU run: it checks the pipeline end to end") and "shows no speed-up by design" in note
    assert "benchmarks/RESULTS.md and the table at the top of README.md" in note
    assert "holds the SLO" not in note  # the note makes no claim on what a run finds: results.md says it
    assert report.cpu_note("cuda", "v2") is None
    printed = capsys.readouterr().out
    assert printed.startswith(report.wrapped(note) + "\n\n")  # before any arm's line
    assert result["run"]["python"] == platform.python_version()
    assert result["run"]["command"].startswith(sys.executable + " ")  # results.json keeps what ran
    lines = (tmp_path / "results.md").read_text().splitlines()
    assert lines[2] == f"> {note}"
    command = " ".join(["python benchmarks/tts/bench_codec_stage.py", *argv, "--out", str(tmp_path)])
    assert lines[4].endswith(f"Command: `{command}` (python {platform.python_version()}).")
    assert sys.executable not in "\n".join(lines)


def test_short_command_names_the_interpreter_not_its_path():
    report = (_bench(), sys.modules["codec_stage.report"])[1]
    assert report.short_command("/x/.venv/bin/python3.11 bench.py --go") == "python bench.py --go"
    assert report.short_command("/usr/bin/python3 a.py") == "python a.py"
    assert report.short_command("python a.py --out /x/python3") == "python a.py --out /x/python3"


# ------------------------------------------------------------------------------------------ plots


def _result(latency_ms: dict[str, tuple[float, float]], continuity: float, states: dict[str, int]) -> dict:
    """A results.json of arms at C=4 and C=8: codec p50/p99 per arm, one continuity for every bound, constant
    decoder state (bytes) per arm; the ideal arm stalls 520 ms (the 1,15 schedule at talker RTF 0.5)."""
    arms, details = {}, {}
    for arm, (p50, p99) in latency_ms.items():
        runs = {}
        for c in ("4", "8"):
            runs[c] = {
                "audio_seconds_per_second": int(c) * 1.9,
                "codec_latency_ms": {"p10": p50, "p50": p50, "p90": p99, "p95": p99, "p99": p99},
                "ttfp_ms": {"p50": 45.0, "p99": 50.0},
                "underrun_ms": {"p50": 520.0, "p99": 530.0},
                "continuity": {"c50": continuity, "c100": continuity, "c200": continuity},
            }
        arms[arm] = {**runs, "max_streams_at_slo": 8, "slo_held_by_every_run": True}
        state = states.get(arm, 0)
        trace = [[t / 10, state] for t in range(40)] if state else []
        details[arm] = {c: {"state_bytes_over_time": trace, "peak_state_bytes": state} for c in ("4", "8")}
    run = {
        "preset": "tiny-v2",
        "device_name": "cpu",
        "arrival": "wave",
        "chunks": [1, 15],
        "talker_rtf": 0.5,
        "slo": {"codec_latency_p99_ms": 150.0},
        "requests": {"4": 68, "8": 136},
    }
    return {"run": run, "arms": arms, "details": details}


def _figure(monkeypatch, plot, result, tmp_path):
    """The figure ``plot`` draws for ``result``, drawn and kept open (not saved)."""
    plots = _plots()
    kept = []
    monkeypatch.setattr(plots, "_save", lambda fig, plt, path: kept.append(fig))
    plot(result, tmp_path / "plot.png")
    fig = kept[0]
    fig.canvas.draw()
    return fig


def _labels(axis) -> list[str]:
    """The tick labels that ``axis`` shows: those of its major ticks within the view, not blank."""
    low, high = sorted(axis.get_view_interval())
    ticks = zip(axis.get_majorticklocs(), axis.get_majorticklabels())
    return [label.get_text() for x, label in ticks if low <= x <= high and label.get_text()]


LATENCIES = {"v2": (6.7, 19.0), "legacy": (5.8, 47.4), "upstream": (12.0, 31.5), "ideal": (0.0, 0.0)}


def test_the_latency_log_axis_is_labelled_within_its_range(monkeypatch, tmp_path):
    # Codec-added latency 5.8 to 150 ms (the SLO line): labels at 1, 2 and 5 x 10^k, not at 10 and 100 alone.
    plots = _plots()
    fig = _figure(monkeypatch, plots.plot_load, _result(LATENCIES, 0.0, {}), tmp_path)
    left, right = fig.axes
    assert _labels(right.yaxis) == ["5", "10", "20", "50", "100"]
    assert _labels(right.xaxis) == _labels(left.xaxis) == ["4", "8"]  # every measured concurrency
    # Under one decade (12 to 60 ms, SLO 60): every integer multiple of 10.
    narrow = _result({"v2": (12.0, 30.0), "upstream": (20.0, 50.0)}, 0.0, {})
    narrow["run"]["slo"]["codec_latency_p99_ms"] = 60.0
    fig = _figure(monkeypatch, plots.plot_load, narrow, tmp_path)
    assert _labels(fig.axes[1].yaxis) == ["20", "30", "40", "50", "60"]
    assert type(fig.get_layout_engine()).__name__ == "ConstrainedLayoutEngine"


def test_the_load_axis_of_a_wide_sweep_labels_every_concurrency(monkeypatch, tmp_path):
    plots = _plots()
    result = _result(LATENCIES, 1.0, {})
    for entry in [*result["arms"].values(), *result["details"].values()]:
        for old, new in (("4", "64"), ("8", "512")):
            entry[new] = entry.pop(old)
    for arm in ("v2", "legacy"):
        result["arms"][arm]["128"] = result["arms"][arm]["256"] = result["arms"][arm]["64"]
    result["run"]["requests"] = {"64": 1, "128": 1, "256": 1, "512": 1}
    fig = _figure(monkeypatch, plots.plot_load, result, tmp_path)
    assert fig.axes[0].get_xscale() == "log"
    assert _labels(fig.axes[0].xaxis) == _labels(fig.axes[1].xaxis) == ["64", "128", "256", "512"]


def test_the_state_plot_picks_a_unit_and_keeps_equal_lines_apart(monkeypatch, tmp_path):
    plots = _plots()
    assert plots.state_unit(0) == (1024, "KiB")
    assert plots.state_unit(245_000) == (1024, "KiB")
    assert plots.state_unit(5 * 2**20) == (2**20, "MiB")
    assert plots.state_unit(10.65 * 2**30) == (2**30, "GiB")
    states = {"v2": 250_880, "legacy": 201_728, "upstream": 201_728}  # legacy and upstream equal on a CPU
    fig = _figure(monkeypatch, plots.plot_state_over_time, _result(LATENCIES, 0.0, states), tmp_path)
    for ax in fig.axes:
        assert ax.get_ylabel() == "decoder state in use (KiB)"
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == [
            "v2 (peak 245 KiB)",
            "legacy (peak 197 KiB)",
            "upstream (peak 197 KiB)",
        ]
        assert len({line.get_linestyle() for line in lines}) == 3 and len({line.get_marker() for line in lines}) == 3
        legacy, upstream = lines[1], lines[2]
        assert legacy.get_markevery() != upstream.get_markevery()  # markers of equal lines fall apart


def test_a_flat_continuity_panel_says_why(monkeypatch, tmp_path):
    plots = _plots()
    stalled = _result(LATENCIES, 0.0, {})
    note = plots.continuity_note(stalled)
    assert note.replace("\n", " ") == (
        "Every request stalls over 200 ms; the ideal arm (no codec) stalls 520 ms too: the chunk schedule 1,15 "
        "stalls by itself (docs/serving.md, 'Choosing a chunk schedule')."
    )
    fig = _figure(monkeypatch, plots.plot_playback, stalled, tmp_path)
    assert [t.get_text() for t in fig.axes[2].texts] == [note]
    without_ideal = _result({"v2": (6.7, 19.0)}, 0.0, {})
    assert "run the ideal arm to see whether the chunk schedule 1,15" in plots.continuity_note(without_ideal).replace(
        "\n", " "
    )
    assert plots.continuity_note(_result(LATENCIES, 0.5, {})) is None
    fig = _figure(monkeypatch, plots.plot_playback, _result(LATENCIES, 1.0, {}), tmp_path)
    assert len(fig.axes[2].texts) == 0
