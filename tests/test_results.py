# SPDX-License-Identifier: Apache-2.0
"""scripts/make_results.py: RESULTS.md and README's table equal what the committed JSON generates, each
renderer on small synthetic JSON, and the one-line errors for bad input."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.cpu]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "make_results.py"
_spec = importlib.util.spec_from_file_location("make_results", SCRIPT)
mr = importlib.util.module_from_spec(_spec)
sys.modules["make_results"] = mr  # dataclasses look their module up while the class is built
_spec.loader.exec_module(mr)


# ------------------------------------------------------------------------------------ the committed files


def test_committed_results_match_their_json():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "benchmarks/RESULTS.md, README.md: up to date with the JSON\n" and done.stderr == ""


def test_results_md_stays_short_and_labels_older_commits():
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    # A page of current tables, not a log (the reasoning between runs is in history/): 340 lines at most.
    assert len(text.splitlines()) <= 340
    manifest = yaml.safe_load((ROOT / "benchmarks" / "results" / "current.yaml").read_text(encoding="utf-8"))
    current = str(manifest["current_commit"])
    for heading in re.findall(r"^## (.+)$", text, re.M):
        for commit in re.findall(r"measured at `([0-9a-f]{7})`", heading):
            assert commit != current, heading
    assert "## Persistent decoder state, on an NVIDIA H200 (`bench_codec_memory.py`) (measured at `3cec6cc`)" in text


def test_every_json_under_results_is_valid():
    files = sorted((ROOT / "benchmarks" / "results").rglob("*.json"))
    assert len(files) > 20
    for path in files:
        json.loads(path.read_text(encoding="utf-8"))


def _markdown_pages() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return pages + sorted((ROOT / "benchmarks").rglob("*.md"))


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown page."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_of_the_markdown_pages_resolves():
    links = 0
    for page in _markdown_pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            path, _, anchor = target.partition("#")
            if re.match(r"[a-z]+:", path):
                continue
            linked = page.parent / path if path else page
            assert linked.exists(), f"{page.relative_to(ROOT)} links {target}"
            if anchor and linked.suffix == ".md":
                assert anchor in _anchors(linked), f"{page.relative_to(ROOT)} links {target}"
            links += 1
    assert links > 100


# Spelled with character classes so that this file itself passes `git grep -w` for the same words.
FORBIDDEN = re.compile(r"\b(l[e]ase[sd]?|l[e]asing|l[e]nt)\b|`?devic[e]`? tool|\bmachine [A-H]\b|issue \d+", re.I)


def test_results_and_docs_speak_of_code_and_hardware_only():
    """The pages and raw files of measurements say what ran where, never how a machine was obtained."""
    files = _markdown_pages() + [ROOT / "benchmarks" / "tts" / "run_gpu.sh"]
    files += [p for p in sorted((ROOT / "benchmarks" / "results").rglob("*")) if p.suffix in (".json", ".txt", ".yaml")]
    for path in files:
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            assert not FORBIDDEN.search(line), f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:120]}"


# ---------------------------------------------------------------------------------------- synthetic JSON


def _job(kind: str, docs: list, **spec) -> mr.Job:
    spec = {"id": "j", "kind": kind, "files": [f"f{i}.json" for i in range(len(docs))], **spec}
    return mr.Job(spec, docs, current_commit="abc1234")


def _stage_result(p50, p99, first=80.0, graph=10, peak_mem=2 * mr.GIB):
    return {
        "codec_latency_ms": {"p50": p50, "p95": (p50 + p99) / 2, "p99": p99},
        "first_chunk_latency_ms": {"p50": first, "p99": first + 5},
        "steps_by_path": {"graph": graph, "eager": 0},
        "padded_frame_fraction": 0.125,
        "peak_memory_bytes": peak_mem,
    }


def _stage_doc(commit="abc1234"):
    run = {"commit": commit, "date": "2026-12-01T10:00:00+00:00", "command": "/x/bin/python3 bench.py --go"}
    run |= {"concurrency": [64, 128], "slo": {"codec_latency_p99_ms": 150.0}, "device_name": "NVIDIA H200"}
    return {
        "run": run,
        "arms": {
            "v2": {"64": _stage_result(5.0, 30.0), "128": _stage_result(7.0, 160.0), "max_streams_at_slo": 64},
            "upstream": {"64": _stage_result(40.0, 140.0), "max_streams_at_slo": None},
        },
        "details": {
            "v2": {
                "64": {"peak_state_bytes": mr.GIB, "preemptions": 0},
                "128": {"peak_state_bytes": 2 * mr.GIB, "preemptions": 3, "stopped_early": True},
            },
            "upstream": {"64": {"peak_state_bytes": 4 * mr.GIB, "preemptions": 0}},
        },
    }


def test_stage_rows_name_held_missed_stopped_and_not_run():
    lines = mr.render_stage(_job("stage", [_stage_doc()], show_preemptions=True))
    assert lines[0] == (
        "| arm | C | codec-added p50 / p95 / p99 ms | first chunk p50 / p99 ms | steps graph / eager | padded frames "
        "| peak state GiB | peak memory GiB | preemptions | SLO (p99 <= 150 ms) |"
    )
    assert lines[2] == "| v2 | 64 | 5.0 / 17.5 / 30.0 | 80.0 / 85.0 | 10 / 0 | 0.125 | 1.00 | 2.00 | 0 | held |"
    assert lines[3].endswith("| 2.00 | 2.00 | 3 | missed (stopped early) |")
    assert lines[4] == "| upstream | 64 | 40.0 / 90.0 / 140.0 | 80.0 / 85.0 | 10 / 0 | 0.125 | 4.00 | 2.00 | 0 | held |"
    assert lines[5] == "| upstream | 128 | - | - | - | - | - | - | - | not run |"
    assert lines[-1] == "Most streams within the SLO (`max_streams_at_slo`): **v2 64, upstream none**."


def test_stage_repeats_take_runs_lists_and_single_runs():
    single = _stage_doc()
    traced = _stage_doc(commit="def5678")
    trace = {f"{p}_ms": 0.5 for p in ("plan", "stage", "run", "to_host", "finish")} | {
        "wait_ms": 50.0,
        "total_ms": 52.5,
    }
    traced["details"]["v2"]["128"]["slowest_step"] = {"chunks": 128, "trace": trace}
    lines = mr.render_stage_repeats(_job("stage_repeats", [{"runs": [traced]}, single], concurrency=128))
    assert (
        lines[2]
        == "| 1 | `def5678` | 7.0 / 83.5 / 160.0 | 80.0 | 128 | 52.50 | 0.50 / 0.50 / 0.50 / 0.50 / 0.50 / 50.00 |"
    )
    assert lines[3] == "| 2 | `abc1234` | 7.0 / 83.5 / 160.0 | 80.0 | - | - | - |"


def _stats(median):
    return {"median_ms": median, "p10_ms": median - 1, "p90_ms": median + 1, "n": 10}


def _step_doc():
    def result(b, t, ours, theirs):
        return {
            "batch": b,
            "frames": t,
            "modes": {"graph": {"arms": {"v2": _stats(ours), "upstream-triton": _stats(theirs)}}},
            "peak_transient_bytes": {"v2": mr.GIB // 4, "upstream-triton": mr.GIB},
            "profile": {
                "v2": {"kernel_ms": 10.0, "kernels": 100, "categories": {"gemm": 6.0, "norm": 1.0, "gelu": 2.0}}
            },
        }

    results = [result(512, 15, 200.0, 800.0), result(2048, 1, 50.0, 100.0)]
    return {"arms": ["v2", "upstream-triton"], "modes": ["graph"], "results": results}


def test_step_table_ratios_spread_transient_and_profile():
    lines = mr.render_step(_job("step", [_step_doc()], profile_categories=2))
    assert lines[0] == "Mode `graph`: median of 10 timed steps, ms (p10-p90 of `v2` in brackets)."
    assert (
        lines[2] == "| B | T | v2 ms | upstream-triton ms | v2 / upstream-triton | transient GiB v2 / upstream-triton |"
    )
    assert lines[4] == "| 512 | 15 | 200.00 (199.00-201.00) | 800.00 | 0.250 | 0.250 / 1.000 |"
    assert lines[5] == "| 2048 | 1 | 50.00 (49.00-51.00) | 100.00 | 0.500 | 0.250 / 1.000 |"
    # The two largest categories by total, then what the kernel time leaves.
    assert "| B, T | kernel ms | kernels | gemm | gelu | rest |" in lines
    assert "| 512, 15 | 10.00 | 100 | 6.00 | 2.00 | 2.00 |" in lines


def test_step_table_without_profile_compares_any_two_arms():
    lines = mr.render_step(_job("step", [_step_doc()], ours="upstream-triton", baseline="v2", profile=False))
    assert lines[-1] == "| 2048 | 1 | 50.00 | 100.00 (99.00-101.00) | 2.000 | 1.000 / 0.250 |"


def test_step_table_shows_the_floor_and_our_step_over_it_when_the_json_has_floors():
    doc = _step_doc()
    doc["results"][0]["floor"] = {"gemm_ms": 120.0, "state_read_ms": 40.0, "total_ms": 160.0, "copy_gb_s": 4300.0}
    lines = mr.render_step(_job("step", [doc], profile=False))
    assert lines[2].endswith("| transient GiB v2 / upstream-triton | floor ms (GEMMs + state read) | v2 / floor |")
    assert (
        lines[4]
        == "| 512 | 15 | 200.00 (199.00-201.00) | 800.00 | 0.250 | 0.250 / 1.000 | 160.00 (120.00 + 40.00) | 1.250 |"
    )
    assert lines[5].endswith("| 0.250 / 1.000 | - | - |")  # a (B, T) without a floor
    plain = mr.render_step(_job("step", [_step_doc()], profile=False))
    assert "floor" not in plain[2]  # JSON without floors: no floor columns


def step_floor_module():
    sys.path.insert(0, str(ROOT / "benchmarks" / "tts"))
    import step_floor

    return step_floor


def test_step_floor_adds_gemms_and_one_state_read_and_puts_the_ratio_in_every_arm():
    """The floor of a tiny-v2 step on a CPU: its GEMMs' measured time plus the state of its rows read at the given
    copy bandwidth; with_ratios divides every arm's median by it."""
    import torch

    from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
    from vllm_omni_moss.model_executor.models.moss_tts.state import state_bytes_for

    step_floor = step_floor_module()
    config = preset_config("tiny-v2")
    floor = step_floor.step_floor(config, 4, 3, torch.device("cpu"), copy_gb_s=2.0, element_size=2)
    state = state_bytes_for(config, 4, "compact", 2)
    assert floor["state_bytes"] == state and floor["copy_gb_s"] == 2.0
    assert floor["state_read_ms"] == round(state / 2e9 * 1e3, 4) and floor["gemm_ms"] > 0
    assert floor["total_ms"] == round(floor["gemm_ms"] + floor["state_read_ms"], 4)
    record = {"floor": floor, "modes": {"eager": {"arms": {"v2": {"median_ms": 3 * floor["total_ms"]}}}}}
    step_floor.with_ratios(record)
    assert record["modes"]["eager"]["arms"]["v2"]["step_over_floor"] == 3.0
    assert step_floor.copy_bandwidth_gb_s(torch.device("cpu"), 2**20) > 0


def test_memory_startup_attention_and_gemm_tables():
    memory = {
        "slot_bytes": 1000,
        "arms": {
            "v2": {
                "128": {
                    "slots": 129,
                    "state_bytes": mr.GIB,
                    "allocated_delta_bytes": mr.GIB,
                    "reserved_delta_bytes": 2 * mr.GIB,
                }
            }
        },
        "weights": {"ours": {"param_bytes": mr.GIB, "allocated_bytes": mr.GIB, "note": "decoder"}},
    }
    lines = mr.render_memory(_job("memory", [memory]))
    assert lines[2] == f"| v2 | 128 | 129 | 1.00 ({mr.GIB:,}) | 1.00 | 2.00 |"
    assert "| ours | 1.00 | 1.00 | decoder |" in lines and lines[-1] == "Ring bytes per slot: 1,000."

    def startup(total):
        return {"phases_s": {"imports": 1.0, "capture": total - 1}, "total_s": total, "capacity": 8, "graphs": 4}

    # bench_codec_startup.py's record: the step shapes' packed frame totals (frame_totals(8 x 15): 1 to 64, then
    # 66, 68, ..., 96, 99, 102, ..., 120).
    totals = [*range(1, 65), *range(66, 97, 2), *range(99, 121, 3)]
    docs = [startup(10.0) | {"graph_frame_totals": totals, "graph_frame_sizes": [1, 15]}, startup(5.0)]
    lines = mr.render_startup(_job("startup", docs, labels=["cold", "warm"]))
    assert lines[:5] == [
        "| phase (s) | cold | warm |",
        "|---|---|---|",
        "| imports | 1.00 | 1.00 |",
        "| capture | 9.00 | 4.00 |",
        "| **total** | **10.00** | **5.00** |",
    ]
    assert lines[-1] == "8 slots, 4 CUDA graphs (88 packed frame totals, 1 to 120; frame sizes 1, 15)."
    # A file written before the ladder of frame totals (benchmarks/results/archive) names batch buckets.
    old = [startup(10.0) | {"graph_batch_sizes": [4, 8], "graph_frame_sizes": [1, 15]}]
    assert mr.render_startup(_job("startup", old, labels=["cold"]))[-1] == (
        "8 slots, 4 CUDA graphs (batch buckets 4, 8; frame sizes 1, 15)."
    )
    with pytest.raises(mr.InputError, match="has no 'graph_frame_totals'"):
        mr.render_startup(_job("startup", [startup(1.0) | {"graph_frame_sizes": [1]}], labels=["cold"]))

    def records(ms):
        shape = {"batch": 64, "frames": 15, "tokens": 15, "heads": 2, "capacity": 125}
        return {"records": [shape | {"group": 0, "layers": 10, "default": {"ms": ms}}]}

    lines = mr.render_attention(_job("attention", [records(0.1), records(0.05)], labels=["a", "b"]))
    assert lines[2] == "| 64, 15 | 0 | 15 | 2 x 125 | 10 | 100.0 | 50.0 |"
    assert lines[-1] == "| 64, 15 | 1.00 | 0.50 |"

    gemm = {
        "records": [
            {"batch": 8, "frames": 1, "group": 0, "ms": 0.5, "calls": 2},
            {"batch": 8, "frames": 1, "group": 1, "ms": 1.0, "calls": 1},
            {"batch": 8, "frames": 1, "step_ms": 2.0, "step_tflop": 1.0},
        ]
    }
    assert mr.render_gemm(_job("gemm", [gemm]))[2] == "| 8, 1 | 1.00 | 1.00 | 2.00 (500) |"


def test_serving_runs_under_arrival_models():
    def load(p99, ttfp, stall_p99=40.0):
        return {
            "codec_latency_ms": {"p50": 10.0, "p99": p99},
            "ttfp_ms": {"p50": ttfp, "p99": 2 * ttfp},
            "underrun_ms": {"p50": 0.0, "p99": stall_p99},
            "continuity": {"c50": 1.0, "c100": 0.99, "c200": 0.9},
            "live_streams": {"mean": 300.0, "max": 320},
        }

    run = {"arrival": "poisson", "burstiness": 1.0, "request_rate": [2, 10], "talker_rtf": 1.0}
    doc = {
        "run": run | {"slo": {"codec_latency_p99_ms": 150}},
        "arms": {"v2": {"rate=10": load(200.0, 90.0), "rate=2": load(40.0, 85.0), "max_rate_at_slo": 2}},
        "details": {"v2": {"rate=10": {}, "rate=2": {"stopped_early": False}}},
    }
    lines = mr.render_serving(_job("serving", [doc]))
    assert lines[0].startswith(
        "| arrival, talker RTF | arm | load | codec-added p50 / p99 ms | TTFP p50 / p95 / p99 ms | "
        "worst stall p50 / p99 ms | requests with an underrun |"
    )
    # Files older than issue 51 hold no TTFP p95 and no underrun count: "n/a", not a failure.
    assert lines[2:] == [
        "| poisson (burstiness 1.0, [2, 10] req/s), 1.0 | v2 | rate=2 | 10.0 / 40.0 | 85.0 / n/a / 170.0 | 0.0 / 40.0 "
        "| n/a | 1.000 / 0.990 / 0.900 | 300.0 / 320 | held |",
        "| poisson (burstiness 1.0, [2, 10] req/s), 1.0 | v2 | rate=10 | 10.0 / 200.0 | 90.0 / n/a / 180.0 | 0.0 / 40.0 "
        "| n/a | 1.000 / 0.990 / 0.900 | 300.0 / 320 | missed |",
        "",  # rate=2 held the SLO, but a request stalled (a worst stall of 40 ms)
        "Highest load at the SLO / at the SLO with no underrun, per sweep: "
        "v2 (poisson (burstiness 1.0, [2, 10] req/s), 1.0) rate=2 / none.",
    ]
    # `arms` shows only the arms it lists; `chunks` labels rows with the file's schedule.
    ideal = {"rate=2": load(0.0, 80.0), "rate=10": load(0.0, 80.0)}
    both = doc | {"arms": doc["arms"] | {"ideal": ideal}, "details": doc["details"] | {"ideal": ideal}}
    assert len(mr.render_serving(_job("serving", [both]))) == 2 + 4 + 2
    only = mr.render_serving(
        _job("serving", [both | {"run": both["run"] | {"chunks": [3, 5]}}], arms=["v2"], chunks=True)
    )
    assert [row.split(" | ")[1] for row in only[2:4]] == ["v2", "v2"] and len(only) == 2 + 2 + 2
    assert only[2].startswith("| poisson (burstiness 1.0, [2, 10] req/s), 1.0, chunks [3, 5] | v2 | rate=2 |")
    ordered = mr.render_serving(_job("serving", [both], arms=["ideal", "v2"]))  # rows in the order of `arms`
    assert [row.split(" | ")[1] for row in ordered[2:6]] == ["ideal", "ideal", "v2", "v2"]
    with pytest.raises(mr.InputError, match="job 'j': f0.json has no 'run.chunks'"):
        mr.render_serving(_job("serving", [both], chunks=True))


def test_serving_reports_ttfp_p95_the_underrun_count_and_the_load_with_no_underrun():
    def load(p99, underruns, stall_p99=0.0, ttfp_p95=95.0):
        return {
            "codec_latency_ms": {"p50": 10.0, "p99": p99},
            "ttfp_ms": {"p50": 80.0, "p95": ttfp_p95, "p99": 120.0},
            "underrun_ms": {"p50": 0.0, "p99": stall_p99},
            "underrun_requests": underruns,
            "continuity": {"c50": 1.0, "c100": 1.0, "c200": 1.0},
            "live_streams": {"mean": 10.0, "max": 12},
        }

    doc = {
        "run": {"arrival": "wave", "talker_rtf": 0.5, "slo": {"codec_latency_p99_ms": 150}},
        "arms": {
            "v2": {"4": load(20.0, 0), "8": load(30.0, 0), "16": load(40.0, 3, 0.0), "32": load(200.0, 0)},
            "upstream": {"4": load(20.0, 0), "8": load(None, 0)},  # a null p99: unknown, never a pass
        },
        "details": {"v2": {"4": {}, "8": {}, "16": {}, "32": {}}, "upstream": {"4": {}, "8": {}}},
    }
    lines = mr.render_serving(_job("serving", [doc]))
    assert lines[2] == (
        "| wave, 0.5 | v2 | C=4 | 10.0 / 20.0 | 80.0 / 95.0 / 120.0 | 0.0 / 0.0 | 0 | 1.000 / 1.000 / 1.000 "
        "| 10.0 / 12 | held |"
    )
    assert lines[4].split(" | ")[6] == "3" and lines[7].endswith("| unknown |")
    assert lines[-1] == (
        "Highest load at the SLO / at the SLO with no underrun, per sweep: v2 (wave, 0.5) C=16 / C=8; "
        "upstream (wave, 0.5) n/a / n/a."
    )


def test_files_of_one_command_share_one_line():
    job = _job("serving", [{}, {}, {}], files=["a.json", "b.json", "c.json"])
    job.commits, job.commands = (
        ["abc1234", "abc1234", "abc1234"],
        ["/venv/bin/python3 x.py --chunks 1", "python x.py --chunks 1", "python y.py"],
    )
    job.dates = ["2026-12-02T06:01:09+00:00", "2026-12-02T06:02:10+00:00", "2026-12-01"]
    assert mr._file_lines(job) == [
        "- [`a.json`](results/a.json), [`b.json`](results/b.json): commit `abc1234`, 2026-12-02 06:01 UTC: "
        "`python x.py --chunks 1`",
        "- [`c.json`](results/c.json): commit `abc1234`, 2026-12-01: `python y.py`",
    ]


def test_fidelity_and_proof_tables():
    windows = {"43": {"rel_error": 0.02}, "94": {"rel_error": 0.021}}
    doc = {
        "run": {"marks": [43, 94], "streams": 4, "frames": 94, "chunks": [1, 15], "window_frames": 43},
        "arms": {"v2": {"windows": windows}, "upstream": {"windows": windows}},
        "targets": {"ours_over_upstream_max": {"v2": 1.0}, "growth_first_to_last": {"v2": 1.05, "upstream": 1.05}},
    }
    lines = mr.render_fidelity(_job("fidelity", [doc]))
    assert lines[2:] == [
        "| arm | frames ..43 | frames ..94 | growth last / first | at most x upstream |",
        "|---|---|---|---|---|",
        "| v2 | 2.00e-02 | 2.10e-02 | 1.05x | 1.000x |",
        "| upstream | 2.00e-02 | 2.10e-02 | 1.05x | - |",
    ]
    stats = {"p10_ms": 1.0, "median_ms": 2.0, "p50_ms": 2.0, "p90_ms": 3.0}
    proof = {
        "run": {"trees": {"parent": "aaa", "refactor": "bbb"}},
        "step": {"B1/T1": {"parent": stats, "refactor": stats}},
        "stage": {"64": {"parent": stats, "refactor": stats}},
        "overlap": {"step": {"B1/T1": True}, "stage": {"64": False}},
    }
    lines = mr.render_proof(_job("proof", [proof]))
    assert lines[2:] == [
        "| one B1/T1 step, ms | 1.00 / 2.00 / 3.00 | 1.00 / 2.00 / 3.00 | yes |",
        "| codec-added at C=64, ms | 1.00 / 2.00 / 3.00 | 1.00 / 2.00 / 3.00 | NO |",
    ]


def test_pick_selects_list_items_by_fields():
    doc = {"results": [{"batch": 1, "frames": 15, "v": 1}, {"batch": 128, "frames": 15, "v": 2}]}
    assert mr.pick(doc, "results[batch=128,frames=15].v") == 2
    with pytest.raises(mr.InputError, match=r"0 items match \[batch=3\]"):
        mr.pick(doc, "results[batch=3].v")


def test_clock_summary_reads_nvidia_smi_csv(tmp_path):
    log = tmp_path / "clocks.csv"
    log.write_text(
        "timestamp, clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active\n"
        "2026/11/30 13:21:20.999, 345 MHz, 78.86 W, 0x0000000000000001\n"
        "2026/11/30 13:21:21.499, 1980 MHz, 500.00 W, 0x0000000000000000\n"
        "2026/11/30 13:21:21.999, 1725 MHz, 599.37 W, 0x0000000000000004\n"
    )
    assert mr.clock_summary(log) == (
        "`nvidia-smi` every 500 ms, 3 samples: SM clock 1725-1980 MHz in the 2 busy samples, "
        "software power cap in 1 (at up to 599 W)"
    )


# ------------------------------------------------------------------------------------- a scratch tree


@pytest.fixture
def tree(tmp_path):
    """A repository root with one stage job, its history page and README markers."""
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "history").mkdir()
    (tmp_path / "benchmarks" / "history" / "abc1234.md").write_text("# abc1234\n")
    (tmp_path / "benchmarks" / "results" / "stage.json").write_text(json.dumps(_stage_doc()))
    (tmp_path / "README.md").write_text(f"# x\n\n{mr.README_BEGIN}\n{mr.README_END}\n\nrest\n")
    manifest = {
        "current_commit": "abc1234",
        "jobs": [{"id": "main", "kind": "stage", "files": ["stage.json"], "history": "abc1234"}],
        "readme": [
            {
                "label": "streams",
                "job": "main",
                "ours": "arms.v2.max_streams_at_slo",
                "upstream": "arms.upstream.max_streams_at_slo",
                "format": "int",
            }
        ],
    }
    _write_manifest(tmp_path, manifest)
    return tmp_path


def _write_manifest(root: Path, manifest: dict) -> None:
    (root / "benchmarks" / "results" / "current.yaml").write_text(yaml.safe_dump(manifest))


def _manifest(root: Path) -> dict:
    return yaml.safe_load((root / "benchmarks" / "results" / "current.yaml").read_text())


def test_generate_then_check_then_detect_drift(tree, capsys):
    assert mr.main(["--root", str(tree), "--check"]) == 1  # nothing generated yet
    capsys.readouterr()
    assert mr.main(["--root", str(tree)]) == 0
    capsys.readouterr()
    assert mr.main(["--root", str(tree), "--check"]) == 0
    assert capsys.readouterr().out.endswith(": up to date with the JSON\n")
    readme = (tree / "README.md").read_text()
    assert "| streams | none | **64** | `abc1234` |" in readme and readme.endswith("\n\nrest\n")
    results = tree / "benchmarks" / "RESULTS.md"
    assert "commit `abc1234`, 2026-12-01 10:00 UTC: `python bench.py --go`" in results.read_text()
    results.write_text(results.read_text().replace("| held |", "| hold |", 1))
    capsys.readouterr()
    assert mr.main(["--root", str(tree), "--check"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("benchmarks/RESULTS.md differs from what the JSON generates (2 lines)")
    assert "-| v2 | 64 |" in err and "+| v2 | 64 |" in err


def _error(root: Path, capsys) -> str:
    assert mr.main(["--root", str(root), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("make_results.py: error: ")
    return err.removeprefix("make_results.py: error: ").strip()


def test_unknown_kind_names_the_job_and_the_kinds(tree, capsys):
    manifest = _manifest(tree)
    manifest["jobs"][0]["kind"] = "no-such-kind"
    _write_manifest(tree, manifest)
    assert _error(tree, capsys).startswith(
        "job 'main': no renderer for kind 'no-such-kind' (known: attention, fidelity, "
    )


def test_bad_input_is_one_line(tree, capsys):
    manifest = _manifest(tree)
    manifest["jobs"][0]["commit"] = "fff0000"
    _write_manifest(tree, manifest)
    assert _error(tree, capsys) == "job 'main': commit 'fff0000' contradicts stage.json's run block ('abc1234')"

    manifest["jobs"][0].pop("commit")
    manifest["jobs"][0]["files"] = ["missing.json"]
    _write_manifest(tree, manifest)
    assert _error(tree, capsys).endswith("benchmarks/results/missing.json does not exist")

    manifest["jobs"][0]["files"] = ["stage.json"]
    _write_manifest(tree, manifest)
    (tree / "benchmarks" / "results" / "stray.json").write_text("{}")
    assert "stray.json is named by no job of current.yaml" in _error(tree, capsys)
    (tree / "benchmarks" / "results" / "stray.json").unlink()

    doc = _stage_doc()
    del doc["details"]["v2"]["64"]  # a key the shape cannot name alone: the run that arms.v2.64 is
    (tree / "benchmarks" / "results" / "stage.json").write_text(json.dumps(doc))
    assert _error(tree, capsys) == "job 'main': stage.json has no 'details.v2.64'"

    (tree / "benchmarks" / "results" / "stage.json").write_text(json.dumps(_stage_doc()))
    arms = _stage_doc()["arms"]  # a job's `arms` lists arms its files have, in the order to show them
    for bad, said in (
        (["nosuch"], f"job 'main': arms ['nosuch'] are in none of its files (they have {list(arms)})"),
        (["v2", "typo"], f"job 'main': arms ['typo'] are in none of its files (they have {list(arms)})"),
        ([], "job 'main': arms must be a non-empty list of arm names, got []"),
        ("v2", "job 'main': arms must be a non-empty list of arm names, got 'v2'"),
        (5, "job 'main': arms must be a non-empty list of arm names, got 5"),
    ):
        manifest["jobs"][0]["arms"] = bad
        _write_manifest(tree, manifest)
        assert _error(tree, capsys) == said
    manifest["jobs"][0].pop("arms")
    _write_manifest(tree, manifest)

    (tree / "README.md").write_text("# x\n")
    assert "README.md has no block between" in _error(tree, capsys)


def test_the_script_runs_from_anywhere_and_exits_2_on_bad_input(tree):
    (tree / "benchmarks" / "results" / "current.yaml").write_text("jobs: [\n")
    done = subprocess.run([sys.executable, str(SCRIPT), "--root", str(tree)], cwd=tree, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.startswith("make_results.py: error: ") and "is not valid YAML" in done.stderr


# ------------------------------------------------------------------------------------------ bad results files


def _serving_doc() -> dict:
    figures = {name: {"p50": 10.0, "p99": 20.0} for name in ("codec_latency_ms", "ttfp_ms", "underrun_ms")}
    figures |= {"continuity": {"c50": 1.0, "c100": 1.0, "c200": 1.0}, "live_streams": {"mean": 8.0, "max": 8}}
    run = {"commit": "abc1234", "date": "2026-12-01", "command": "python bench.py --arrival staggered"}
    run |= {"arrival": "staggered", "talker_rtf": 1.0, "slo": {"codec_latency_p99_ms": 150.0}}
    return {"run": run, "arms": {"v2": {"8": figures, "max_streams_at_slo": 8}}, "details": {"v2": {"8": {}}}}


def _set(doc: dict, path: str, value) -> dict:
    *parents, last = path.split(".")
    for key in parents:
        doc = doc[key]
    doc[last] = value
    return doc


def _drop(doc: dict, path: str) -> dict:
    *parents, last = path.split(".")
    for key in parents:
        doc = doc[key]
    del doc[last]
    return doc


NAN = float("nan")
# (file, what to do to its JSON text, the error after the file's path); the README row reads
# arms.<arm>.max_streams_at_slo of stage.json.
BAD_FILES = {
    "nan_state": (
        "stage.json",
        lambda d: _set(d, "details.v2.128.peak_state_bytes", NAN),
        "details.v2.128.peak_state_bytes is NaN, expected a finite number",
    ),
    "nan_p99": (
        "stage.json",
        lambda d: _set(d, "arms.upstream.64.codec_latency_ms.p99", NAN),
        "arms.upstream.64.codec_latency_ms.p99 is NaN, expected a finite number",
    ),
    "infinity": (
        "stage.json",
        lambda d: _set(d, "arms.v2.max_streams_at_slo", float("inf")),
        "arms.v2.max_streams_at_slo is infinite, expected a finite number",
    ),
    "null_p99": (
        "stage.json",
        lambda d: _set(d, "arms.v2.64.codec_latency_ms.p99", None),
        "arms.v2.64.codec_latency_ms.p99 is null, expected a number",
    ),
    "null_slo": (
        "stage.json",
        lambda d: _set(d, "run.slo.codec_latency_p99_ms", None),
        "run.slo.codec_latency_p99_ms is null, expected a number",
    ),
    "missing_key": (
        "stage.json",
        lambda d: _drop(d, "arms.v2.64.first_chunk_latency_ms"),
        "arms.v2.64.first_chunk_latency_ms is missing",
    ),
    "missing_run": ("stage.json", lambda d: _drop(d, "run"), "run is missing"),
    "string_figure": (
        "stage.json",
        lambda d: _set(d, "details.upstream.64.peak_state_bytes", "4 GiB"),
        "details.upstream.64.peak_state_bytes is a string, expected a number",
    ),
    "stage_arms_list": ("stage.json", lambda d: _set(d, "arms", [d["arms"]]), "arms is a list, expected an object"),
    "serving_arms_list": (
        "serving.json",
        lambda d: _set(d, "arms", [{"v2": d["arms"]["v2"]}]),
        "arms is a list, expected an object",
    ),
    "serving_null_ttfp": (
        "serving.json",
        lambda d: _set(d, "arms.v2.8.ttfp_ms", None),
        "arms.v2.8.ttfp_ms is null, expected an object",
    ),
    "serving_missing_details": ("serving.json", lambda d: _drop(d, "details"), "details is missing"),
}


@pytest.fixture
def generated(tree):
    """The scratch tree with a serving job too, its RESULTS.md and README generated."""
    (tree / "benchmarks" / "results" / "serving.json").write_text(json.dumps(_serving_doc()))
    manifest = _manifest(tree)
    manifest["jobs"].append({"id": "serving", "kind": "serving", "files": ["serving.json"]})
    _write_manifest(tree, manifest)
    assert mr.main(["--root", str(tree)]) == 0
    return tree


def _outputs(root: Path) -> dict[str, bytes]:
    return {name: (root / name).read_bytes() for name in ("README.md", "benchmarks/RESULTS.md")}


def _run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), *args], capture_output=True, text=True)


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_results_file_is_one_line_naming_file_and_key_and_nothing_is_written(generated, case):
    name, spoil, said = BAD_FILES[case]
    path = generated / "benchmarks" / "results" / name
    doc = json.loads(path.read_text())
    spoil(doc)
    path.write_text(json.dumps(doc))  # NaN and Infinity as Python's json writes them
    before = _outputs(generated)
    for args in ((), ("--check",)):
        done = _run(generated, *args)
        assert (done.returncode, done.stdout, done.stderr) == (2, "", f"make_results.py: error: {path}: {said}\n")
    assert _outputs(generated) == before


def test_a_truncated_results_file_is_one_line_and_nothing_is_written(generated):
    path = generated / "benchmarks" / "results" / "serving.json"
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    before = _outputs(generated)
    done = _run(generated)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"make_results.py: error: {path} is not valid JSON: ")
    assert _outputs(generated) == before


def test_a_readme_cell_needs_a_value_its_format_can_show(generated):
    manifest = _manifest(generated)
    manifest["readme"][0]["format"] = "ms"  # arms.upstream.max_streams_at_slo is null: "none" only as an int
    _write_manifest(generated, manifest)
    before = _outputs(generated)
    done = _run(generated)
    assert (done.returncode, done.stderr) == (
        2,
        "make_results.py: error: readme row 'streams': stage.json: arms.upstream.max_streams_at_slo is null, "
        "expected a number\n",
    )
    assert _outputs(generated) == before
