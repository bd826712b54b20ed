# SPDX-License-Identifier: Apache-2.0
"""CPU tests of bench_fidelity.py: the windows' arithmetic, the JSON layout of a tiny-v2 run, an arm against a
repeat of itself (exactly 0 in every window), the arms sharing one set of weights, upstream's float32 stand-in,
and bad input refused before any work."""

from __future__ import annotations

import argparse
import json
import math
import zipfile

import bench_modules
import pytest
import torch

pytestmark = [pytest.mark.cpu]

BENCH_DIR = bench_modules.BENCH_DIR

BF16_EPS = 2.0**-8  # spacing of bf16 numbers in [1, 2)


def _bench():
    return bench_modules.load("bench_fidelity")


UPSTREAM = _bench().common.oracle.upstream_available()
ARMS = ["v2", "upstream", "v2-exact", "legacy"] if UPSTREAM else ["v2", "v2-exact", "legacy"]


def test_windows_sum_squares_over_their_own_frames_only():
    bench = _bench()
    spf, frames = 4, 100
    reference = torch.ones(2, 2, frames * spf)
    test = reference.clone()
    test[0, 1, 10 * spf : 20 * spf] += 0.5  # one row and channel, frames [10, 20)
    test[1, 0, 95 * spf] -= 3.0  # one sample of frame 95
    err_sq, ref_sq = bench.frame_energies(test, reference, spf)
    assert err_sq.dtype == torch.float64 and err_sq.shape == (frames,)
    assert err_sq[10:20].tolist() == [spf * 0.25] * 10 and err_sq[95].item() == 9.0
    assert ref_sq.tolist() == [2 * 2 * spf] * frames
    windows = bench.window_errors(err_sq, ref_sq, [43, 60, 100], 43)
    assert windows["43"]["frames"] == [0, 43] and windows["60"]["frames"] == [17, 60]
    assert windows["43"]["rel_error"] == pytest.approx(math.sqrt(10 * spf * 0.25 / (43 * 16 * 1.0)), rel=1e-15)
    assert windows["60"]["rel_error"] == pytest.approx(math.sqrt(3 * spf * 0.25 / (43 * 16)), rel=1e-15)
    assert windows["100"]["rel_error"] == pytest.approx(math.sqrt(9.0 / (43 * 16)), rel=1e-15)
    assert windows["100"]["cumulative_rel_error"] == pytest.approx(math.sqrt((10 + 9.0) / (100 * 16)), rel=1e-15)
    assert windows["43"]["snr_db"] == pytest.approx(-20 * math.log10(windows["43"]["rel_error"]))
    assert windows["43"]["cumulative_rel_error"] == windows["43"]["rel_error"]  # [0, 43) both
    assert bench.growth(windows) == windows["100"]["rel_error"] / windows["43"]["rel_error"]
    same = bench.window_errors(*bench.frame_energies(reference, reference.clone(), spf), [43, 100], 43)
    assert all(w["rel_error"] == 0.0 and w["snr_db"] is None for w in same.values())
    assert bench.growth(same) is None
    with pytest.raises(ValueError, match="mark 101 needs 43 <= mark <= 100 frames"):
        bench.window_errors(err_sq, ref_sq, [101], 43)
    with pytest.raises(ValueError, match="not whole frames"):
        bench.frame_energies(test[..., :-1], reference[..., :-1], spf)


def test_targets_compare_with_upstream_beyond_the_tie_tolerance():
    bench = _bench()

    def arm(*errors):
        return {"windows": {str(m): {"rel_error": e} for m, e in zip((43, 94, 171), errors)}}

    arms = {
        "v2": arm(1.0e-2, 1.0e-2, 1.005e-2),  # ties upstream's last window within 1%
        "upstream": arm(1.0e-2, 2.0e-2, 1.0e-2),
        "v2-exact": arm(1.0e-2, 1.0e-2, 2.5e-2),  # above upstream, and grows 2.5x
        "legacy": {"error": "RuntimeError: boom"},  # failed: no figures
    }
    targets = bench.evaluate_targets(arms)
    assert targets["ours_never_above_upstream"] == {"v2": True, "v2-exact": False}
    assert targets["ours_over_upstream_max"]["v2"] == pytest.approx(1.005)
    assert targets["ours_over_upstream_max"]["v2-exact"] == pytest.approx(2.5)
    assert targets["growth_first_to_last"] == pytest.approx({"v2": 1.005, "upstream": 1.0, "v2-exact": 2.5})
    assert targets["growth_within_bound"] == {"v2": True, "upstream": True, "v2-exact": False}
    assert bench.evaluate_targets({"v2": arm(1e-2, 1e-2, 1e-2)})["ours_never_above_upstream"] == {"v2": None}


def test_tiny_run_writes_every_arm_and_window(tmp_path, capsys):
    out = tmp_path / "fid" / "results.json"
    result = _bench().main(
        ["--device", "cpu", "--preset", "tiny-v2", "--frames", "100", "--streams", "2", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    run = result["run"]
    for key in ("date", "commit", "command", "device_name", "torch", "preset", "wall_seconds"):
        assert key in run
    assert (run["device_name"], run["preset"], run["frames"], run["streams"]) == ("cpu", "tiny-v2", 100, 2)
    assert run["marks"] == [43, 94] and run["window_frames"] == 43 and run["chunks"] == [1, 15]
    assert run["arms"] == ARMS and run["reference"] == "float32" and run["cuda_graphs"] is False
    assert list(result["arms"]) == ARMS
    for name, entry in result["arms"].items():
        assert set(entry["runs"]) == {"bfloat16", "float32"}
        assert entry["runs"]["bfloat16"]["state_dtype"] == "bfloat16"
        assert entry["runs"]["float32"]["state_dtype"] == "float32"
        # 100 frames = 1 + 6 x 15 + 9: eight calls of one step each, every one eager on a CPU.
        assert entry["runs"]["float32"]["steps_by_path"] == {"graph": 0, "eager": 8}
        assert list(entry["windows"]) == ["43", "94"]
        first, second = entry["windows"]["43"], entry["windows"]["94"]
        assert first["frames"] == [0, 43] and second["frames"] == [51, 94]
        assert first["cumulative_rel_error"] == first["rel_error"]
        for w in (first, second):
            # bf16 against float32 of the same weights: above zero, far below an unrelated signal's 1.
            assert 0 < w["rel_error"] < 16 * BF16_EPS, (name, w)
            assert w["snr_db"] == pytest.approx(-20 * math.log10(w["rel_error"]))
        assert result["targets"]["growth_first_to_last"][name] == pytest.approx(
            second["rel_error"] / first["rel_error"]
        )
    assert result["arms"]["v2"]["runs"]["bfloat16"]["ring_semantics"] == "upstream"
    assert result["arms"]["v2-exact"]["runs"]["bfloat16"]["ring_semantics"] == "exact"
    assert result["arms"]["legacy"]["runs"]["bfloat16"]["pool_kind"] == "legacy"
    # The compact and legacy pools compute the same bits on a CPU, so their errors are identical.
    assert result["arms"]["v2"]["windows"] == result["arms"]["legacy"]["windows"]
    targets = result["targets"]
    assert set(targets["growth_within_bound"]) == set(ARMS) and targets["growth_bound"] == 2.0
    assert set(targets["ours_never_above_upstream"]) == {"v2", "v2-exact", "legacy"}
    agreement = result["details"]["fp32_vs_legacy"]
    assert agreement["v2"] == 0.0
    if UPSTREAM:
        # Upstream's model carries our weights: its float32 audio is legacy's up to float32 rounding.
        assert 0 < agreement["upstream"] < 1e-5
        assert targets["ours_never_above_upstream"]["v2"] is True
        assert result["arms"]["upstream"]["runs"]["bfloat16"]["attention"] == "sdpa"
    md = out.with_suffix(".md").read_text()
    printed = capsys.readouterr().out
    assert md in printed and printed.index(md) > printed.index("legacy float32: setup")  # the table comes last
    assert sum(line.startswith(f"| {name} |") for name in ARMS for line in md.splitlines()) == len(ARMS)


def test_an_arm_against_a_repeat_of_itself_is_exactly_zero(tmp_path):
    out = tmp_path / "repeat.json"
    result = _bench().main(
        ["--device", "cpu", "--frames", "94", "--streams", "2", "--reference", "repeat", "--quiet", "--out", str(out)]
    )
    assert result["run"]["preset"] == "tiny-v2" and result["run"]["reference"] == "repeat"
    assert list(result["arms"]) == ARMS
    for name, entry in result["arms"].items():
        assert set(entry["runs"]) == {"bfloat16", "repeat"}
        assert entry["runs"]["repeat"]["state_dtype"] == "bfloat16"
        for w in entry["windows"].values():
            assert (w["rel_error"], w["snr_db"], w["cumulative_rel_error"]) == (0.0, None, 0.0), name
    assert set(result["targets"]["growth_first_to_last"].values()) == {None}
    assert result["details"]["fp32_vs_legacy"] == {}


@pytest.mark.skipif(not UPSTREAM, reason="upstream 0.30.0 codec files not installed")
def test_upstream_float32_stand_in_turns_off_autocast_and_bf16_only_inside():
    bench = _bench()
    module = bench.common.oracle.load_upstream_module("audio_tokenizer_v2")
    with bench.upstream_float32(module):
        stand_in = module.torch
        assert stand_in is not torch and stand_in.bfloat16 is torch.float32
        assert stand_in.Tensor is torch.Tensor and stand_in.float32 is torch.float32
        with stand_in.autocast(device_type="cuda", dtype=stand_in.bfloat16, enabled=True):
            assert not torch.is_autocast_enabled("cuda")
    assert module.torch is torch


@pytest.mark.skipif(not UPSTREAM, reason="upstream 0.30.0 codec files not installed")
def test_every_decoder_tensor_maps_to_one_upstream_parameter():
    bench = _bench()
    common = bench.common
    decoder = common.random_decoder("tiny-v2", "cpu", seed=1).to(torch.bfloat16)
    codec = common.build_upstream_codec("tiny-v2", torch.device("cpu"), 1, 12)
    mapping = bench.upstream_parameter_names(decoder, codec.model)
    assert len(mapping) == len(dict(decoder.named_parameters())) == len(set(mapping.values()))
    assert set(mapping.values()) == {n for n, _ in codec.model.named_parameters() if n.startswith("decoder.")}
    bench.load_into_upstream(codec.model, decoder, 12, mapping)
    theirs = dict(codec.model.named_parameters())
    for name, param in decoder.named_parameters():
        assert theirs[mapping[name]].dtype == torch.bfloat16 and torch.equal(theirs[mapping[name]], param), name
    assert torch.equal(codec.model.quantizer._decode_lut, decoder.lut[:12])


def test_cuda_estimate_and_the_time_budget(tmp_path):
    bench = _bench()
    args = argparse.Namespace(
        device=torch.device("cuda"), preset="v2", frames=4000, arms=list(bench.ARMS), reference="float32"
    )
    estimate = bench.estimate_seconds(args)
    calls = 1 + 266 + 1  # 1 frame, 266 x 15, then the 9 frames left
    assert estimate["runs"]["v2/0"] == pytest.approx(5.0 + 15.0 + calls * 5.0 / 1e3)
    assert estimate["runs"]["upstream/1"] == pytest.approx(5.0 + calls * 45.0 / 1e3)  # SDPA: nothing to compile
    assert estimate["runs"]["legacy/1"] == pytest.approx(5.0 + calls * 20.0 / 1e3)
    assert estimate["total"] == pytest.approx(30.0 + sum(estimate["runs"].values()))
    assert estimate["total"] < 200  # the run fits about 3 minutes of device time
    assert bench.estimate_seconds(argparse.Namespace(**{**vars(args), "device": torch.device("cpu")})) is None
    # A budget already spent by the first arm: the others are skipped, named, and left without figures.
    result = bench.main(
        ["--device", "cpu", "--frames", "43", "--streams", "1", "--arms", "v2,legacy", "--budget-s", "1e-3"]
        + ["--quiet", "--out", str(tmp_path / "r.json")]
    )
    assert list(result["arms"]) == ["v2"]
    assert result["run"]["skipped"]["legacy"].startswith("--budget-s 0.001: ")


def test_a_failing_arm_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    bench = _bench()
    real = bench.run_ours

    def run_ours(spec, *args, **kwargs):
        if spec.name == "v2-exact":
            raise RuntimeError("out of | memory")
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(bench, "run_ours", run_ours)
    out = tmp_path / "r.json"
    result = bench.main(
        ["--device", "cpu", "--frames", "43", "--streams", "1", "--arms", "v2,v2-exact,legacy", "--quiet"]
        + ["--out", str(out)]
    )
    assert result["arms"]["v2-exact"] == {"error": "RuntimeError: out of | memory"}
    assert (
        set(result["arms"]["legacy"]["windows"]) == {"43"}
        and "v2-exact" not in result["targets"]["growth_first_to_last"]
    )
    assert "| v2-exact | - | failed: RuntimeError: out of / memory |" in out.with_suffix(".md").read_text()


@pytest.mark.skipif(not UPSTREAM, reason="upstream 0.30.0 codec files not installed")
def test_upstream_attention_back_to_sdpa_for_the_float32_run():
    bench = _bench()
    codec = bench.common.build_upstream_codec("tiny-v2", torch.device("cpu"), 0, 12)
    attention = [
        m for m in codec.model.decoder.modules() if isinstance(m, codec.module.MossAudioTokenizerMultiheadAttention)
    ]
    for module in attention:
        module._streaming_attention = print  # what enable_triton_attention leaves: a kernel per module
    assert bench.set_upstream_attention(codec, triton=False) == 0
    assert len(attention) == 7 and not any(hasattr(m, "_streaming_attention") for m in attention)


def test_upstream_files_come_from_a_wheel(tmp_path):
    bench = _bench()
    wheel = tmp_path / "vllm_omni-0.30.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(bench.WHEEL_MOSS_TTS + "audio_tokenizer_v2.py", "# v2\n")
        archive.writestr("vllm_omni/__init__.py", "")
    directory = bench.extract_upstream_wheel(wheel, tmp_path / "out")
    assert directory == tmp_path / "out" / "vllm_omni/model_executor/models/moss_tts"
    assert sorted(p.name for p in directory.iterdir()) == ["audio_tokenizer_v2.py"]
    assert not (tmp_path / "out" / "vllm_omni" / "__init__.py").exists()
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as archive:
        archive.writestr("other/file.py", "")
    with pytest.raises(ValueError, match="holds no vllm_omni/model_executor/models/moss_tts/ files"):
        bench.extract_upstream_wheel(empty, tmp_path / "out2")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--frames", "0"], "--frames must be >= 1, got 0"),
        (["--frames", "30"], "--frames 30 is below every mark of --marks 43,94,171,400,1000,4000"),
        (["--window", "50"], "--window 50 is longer than the first mark, 43 frames"),
        (["--marks", "94,43"], "--marks must increase, got '94,43'"),
        (["--arms", "v3"], "--arms 'v3': 'v3' not in ['v2', 'upstream', 'v2-exact', 'legacy']"),
        (["--preset", "tiny-v1"], "--preset 'tiny-v1' is a v1 codec; these arms stream a v2 codec"),
        (["--n-vq", "13"], "--n-vq must be in 1..12 for preset 'tiny-v2', got 13"),
        (["--streams", "abc"], "argument --streams: invalid int value: 'abc'"),
        (["--budget-s", "0"], "--budget-s must be a positive number of seconds, got 0.0"),
        (["--upstream-wheel", "missing.whl"], "--upstream-wheel 'missing.whl' is not a wheel (zip) file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_any_work(argv, message, tmp_path, capsys):
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exc:
        _bench().main(["--device", "cpu", *argv, "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench_fidelity.py: error: ") and message in err
    assert not out.parent.exists() or not any(out.parent.iterdir())
