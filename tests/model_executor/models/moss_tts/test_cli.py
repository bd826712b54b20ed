# SPDX-License-Identifier: Apache-2.0
"""The ``vllm-omni-moss`` command line (``cli.py``), including README's examples as written."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_omni_moss.model_executor.models.moss_tts import checkpoint
from vllm_omni_moss.model_executor.models.moss_tts.checkpoint import load_checkpoint
from vllm_omni_moss.model_executor.models.moss_tts.cli import main
from vllm_omni_moss.model_executor.models.moss_tts.config import PRESETS

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]

soundfile = pytest.importorskip("soundfile")  # the GPU machine has no soundfile; CI does

REPO_ROOT = Path(__file__).resolve().parents[4]
CLI_MODULE = "vllm_omni_moss.model_executor.models.moss_tts.cli"


def test_cli_make_checkpoint_and_decode_v2(tmp_path, capsys):
    assert main(["make-checkpoint", "--preset", "tiny-v2", str(tmp_path / "ck"), "--seed", "3"]) == 0
    codes = np.random.default_rng(0).integers(0, 1024, size=(12, 18))
    np.save(tmp_path / "codes.npy", codes)
    out = tmp_path / "out.wav"
    assert main(["decode", str(tmp_path / "codes.npy"), "-o", str(out), "--checkpoint", str(tmp_path / "ck")]) == 0
    audio, rate = soundfile.read(out)
    assert rate == 48000 and audio.shape == (18 * 3840, 2)
    printed = capsys.readouterr().out
    assert "decoded 18 frames in 3 chunks" in printed and "real-time factor" in printed
    decoder = load_checkpoint(tmp_path / "ck")
    expected = decoder.decode(torch.from_numpy(codes)[:, None], chunk_frames=[1, 15])[0].T.numpy()
    assert np.array_equal(audio.astype(np.float32), expected)
    assert f"peak |sample| {float(np.abs(expected).max()):.3g};" in printed


def test_cli_decode_with_random_weights_says_how_loud_the_noise_is(tmp_path, capsys):
    codes = np.random.default_rng(1).integers(0, 1024, size=(12, 4))
    np.save(tmp_path / "codes.npy", codes)
    out = tmp_path / "out.wav"
    assert main(["decode", str(tmp_path / "codes.npy"), "-o", str(out), "--preset", "tiny-v2"]) == 0
    peak = float(np.abs(soundfile.read(out)[0]).max())
    assert peak > 1  # random weights: noise far outside [-1, 1]
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"note: the audio peaks at |sample| = {peak:.3g}, outside [-1, 1]: random weights are not a trained "
        "codec, and a player clips what the float WAV holds"
    )


def test_cli_errors(tmp_path, capsys):
    np.save(tmp_path / "bad.npy", np.zeros((12, 3, 4), dtype=np.int64))
    assert main(["decode", str(tmp_path / "bad.npy"), "-o", str(tmp_path / "x.wav")]) == 2
    assert "codes must have shape (n_vq, T), got (12, 3, 4)" in capsys.readouterr().err
    np.save(tmp_path / "big.npy", np.full((12, 3), 5000))
    assert main(["decode", str(tmp_path / "big.npy"), "-o", str(tmp_path / "x.wav")]) == 2
    err = capsys.readouterr().err
    assert "code 5000 is outside the codebook range [0, 1023]" in err
    assert "RANDOM weights" not in err  # refused before any weight is made or read
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text(json.dumps(PRESETS["tiny-v2"]))
    np.save(tmp_path / "ok.npy", np.zeros((12, 3), dtype=np.int64))
    assert (
        main(["decode", str(tmp_path / "ok.npy"), "-o", str(tmp_path / "x.wav"), "--checkpoint", str(tmp_path / "ck")])
        == 2
    )
    assert "no model.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "x.wav").exists()  # the output opened before the load is removed when the load fails
    assert main(["decode", str(tmp_path / "ok.npy"), "-o", "x.wav", "--chunks", "1,a"]) == 2
    assert "--chunks must be comma-separated positive integers" in capsys.readouterr().err
    # An empty item is refused by name, not skipped.
    assert main(["decode", str(tmp_path / "ok.npy"), "-o", "x.wav", "--chunks", "1,,15"]) == 2
    assert "--chunks must be comma-separated positive integers, got '1,,15'" in capsys.readouterr().err


def test_cli_rejects_bad_output_device_and_preset_before_decoding(tmp_path, capsys):
    np.save(tmp_path / "ok.npy", np.zeros((12, 3), dtype=np.int64))
    codes = str(tmp_path / "ok.npy")
    cases = [
        (["-o", str(tmp_path / "x.mp3")], "must be a .wav file path"),
        (["-o", str(tmp_path)], "must be a .wav file path"),
        (["-o", "/proc/x.wav"], "cannot write /proc/x.wav"),
        (["-o", str(tmp_path / "x.wav"), "--preset", "bogus"], "unknown preset 'bogus'"),
        (["-o", str(tmp_path / "x.wav"), "--device", "nonsense"], "is not a torch device"),
        (["-o", str(tmp_path / "x.wav"), "--device", "meta"], "only cpu and cuda devices decode"),
    ]
    for extra, message in cases:
        assert main(["decode", codes, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra
    np.save(tmp_path / "c.npy", np.zeros((12, 3), dtype=np.complex64))
    assert main(["decode", str(tmp_path / "c.npy"), "-o", str(tmp_path / "x.wav")]) == 2
    assert "codes must be integers, got dtype torch.complex64" in capsys.readouterr().err


def test_codes_and_output_are_checked_before_the_decoder_is_loaded(tmp_path, capsys, monkeypatch):
    # The v2 preset's weights are 7.91 GiB: a file of bad codes or an unwritable output must fail first.
    from vllm_omni_moss.model_executor.models.moss_tts import cli

    def no_load(*_):
        raise AssertionError("the decoder was loaded")

    monkeypatch.setattr(cli, "_load_decoder", no_load)
    np.save(tmp_path / "wide.npy", np.zeros((33, 3), dtype=np.int64))
    np.save(tmp_path / "neg.npy", np.full((12, 3), -1))
    np.save(tmp_path / "ok.npy", np.zeros((12, 3), dtype=np.int64))
    (tmp_path / "file").write_text("x")
    cases = [
        ("wide.npy", tmp_path / "x.wav", "codes have n_vq=33 codebooks; this codec has 1..32"),
        ("neg.npy", tmp_path / "x.wav", "code -1 is outside the codebook range [0, 1023]"),
        ("ok.npy", tmp_path / "file" / "x.wav", f"cannot write {tmp_path / 'file' / 'x.wav'}"),
    ]
    for name, out, message in cases:
        assert main(["decode", str(tmp_path / name), "-o", str(out), "--preset", "v2"]) == 2, name
        assert message in capsys.readouterr().err, name
    assert not (tmp_path / "x.wav").exists()


def test_paths_the_system_refuses_are_one_line_errors(tmp_path, capsys):
    long = str(tmp_path / ("x" * 300))
    np.save(tmp_path / "ok.npy", np.zeros((12, 3), dtype=np.int64))
    for argv in (
        ["make-checkpoint", "--preset", "tiny-v2", long],
        ["decode", str(tmp_path / "ok.npy"), "-o", long + ".wav"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("vllm-omni-moss: error:") and "File name too long" in err and "Traceback" not in err
    assert main(["make-checkpoint", "--preset", "tiny-v2", ""]) == 2
    assert "make-checkpoint needs a directory to write, got an empty path" in capsys.readouterr().err


def test_make_checkpoint_announces_the_size_and_shows_progress(tmp_path, capsys):
    directory = tmp_path / "ck"
    assert main(["make-checkpoint", "--preset", "tiny-v2", str(directory), "--seed", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        f"writing a random tiny-v2 checkpoint (seed 3) to {directory}: 1,866,816 bytes (1.8 MiB) of fp32 tensors",
        f"wrote 2 files (1.8 MiB) to {directory}",
    ]
    assert "make-checkpoint: 100%" in err and "1.78M/1.78M" in err  # tqdm, binary units
    assert {stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()} == {0o644}


def test_make_checkpoint_announces_before_writing(tmp_path, capsys, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint, "save_random_checkpoint", fail)
    assert main(["make-checkpoint", "--preset", "v2", str(tmp_path / "ck")]) == 2
    out, err = capsys.readouterr()
    assert out == (
        f"writing a random v2 checkpoint (seed 0) to {tmp_path / 'ck'}: "
        "8,494,804,992 bytes (7.91 GiB) of fp32 tensors\n"
    )
    assert err.endswith(f"error: cannot write a checkpoint to {tmp_path / 'ck'}: No space left on device\n")


def test_make_checkpoint_refuses_to_overwrite_without_force(tmp_path, capsys):
    directory = tmp_path / "ck"
    assert main(["make-checkpoint", "--preset", "tiny-v2", str(directory), "--seed", "3"]) == 0
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    lut_before = load_checkpoint(directory).lut
    capsys.readouterr()
    assert main(["make-checkpoint", "--preset", "tiny-v2", str(directory), "--seed", "4"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"vllm-omni-moss: error: {directory} already holds a checkpoint (config.json, ...); pass --force to replace it\n"
    )
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert main(["make-checkpoint", "--preset", "tiny-v2", str(directory), "--seed", "4", "--force"]) == 0
    assert not torch.equal(load_checkpoint(directory).lut, lut_before)


@pytest.mark.parametrize("seed", ["99999999999999999999999", str(2**63), "-1", "abc"])
@pytest.mark.parametrize("command", ["make-checkpoint", "decode"])
def test_seed_outside_64_bits_is_a_usage_error_that_touches_nothing(tmp_path, capsys, seed, command):
    directory = tmp_path / "ck"
    assert main(["make-checkpoint", "--preset", "tiny-v2", str(directory)]) == 0
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    np.save(tmp_path / "ok.npy", np.zeros((12, 3), dtype=np.int64))
    capsys.readouterr()
    if command == "make-checkpoint":
        argv = [command, "--preset", "tiny-v2", str(directory), "--force", f"--seed={seed}"]
    else:
        argv = [command, str(tmp_path / "ok.npy"), "-o", str(tmp_path / "x.wav"), f"--seed={seed}"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"vllm-omni-moss {command}: error: argument --seed: must be an integer in [0, 2**63), got {seed!r}"
    )
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ok.npy"]


def test_force_replaces_the_checkpoint_only_once_the_new_one_is_written(tmp_path, capsys, monkeypatch):
    directory = tmp_path / "ck"
    assert main(["make-checkpoint", "--preset", "tiny-v2", str(directory), "--seed", "3"]) == 0
    (directory / "notes.txt").write_text("mine\n")
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    save = checkpoint.save_random_checkpoint

    def fail_half_way(config, path, **kwargs):
        Path(path, "model.safetensors").write_bytes(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint, "save_random_checkpoint", fail_half_way)
    assert main(["make-checkpoint", "--preset", "tiny-v2", str(directory), "--seed", "4", "--force"]) == 2
    assert capsys.readouterr().err.endswith(
        f"vllm-omni-moss: error: cannot write a checkpoint to {directory}: No space left on device\n"
    )
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no scratch directory left beside it

    monkeypatch.setattr(checkpoint, "save_random_checkpoint", save)
    assert main(["make-checkpoint", "--preset", "tiny-v2", str(directory), "--seed", "4", "--force"]) == 0
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    assert torch.equal(load_checkpoint(directory).lut, load_checkpoint(save("tiny-v2", tmp_path / "ref", seed=4)).lut)
    assert {stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir() if p.name != "notes.txt"} == {0o644}


def test_big_endian_npy_decodes_like_native(tmp_path, capsys):
    codes = np.random.default_rng(1).integers(0, 1024, size=(12, 4))
    for order in ("<", ">"):
        np.save(tmp_path / f"{order == '>'}.npy", codes.astype(f"{order}i8"))
        assert main(["decode", str(tmp_path / f"{order == '>'}.npy"), "-o", str(tmp_path / f"{order == '>'}.wav")]) == 0
    # Samples, not file bytes: libsndfile stamps float WAVs with the wall-clock second (its PEAK chunk),
    # so two files written across a second boundary differ in their headers.
    big, rate_big = soundfile.read(tmp_path / "True.wav", dtype="float32")
    native, rate_native = soundfile.read(tmp_path / "False.wav", dtype="float32")
    assert rate_big == rate_native and np.array_equal(big, native)


@pytest.mark.parametrize("suffix", [".npy", ".pt"])
def test_uint64_code_beyond_int64_is_reported_with_its_value(tmp_path, capsys, suffix):
    path = tmp_path / f"codes{suffix}"
    values = np.full((12, 3), 7, dtype=np.uint64)
    values[3, 1] = 2**63 + 5
    if suffix == ".npy":
        np.save(path, values)
    else:
        torch.save(torch.from_numpy(values), path)
    assert main(["decode", str(path), "-o", str(tmp_path / "x.wav")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"vllm-omni-moss: error: {path}: code 9223372036854775813 is outside the codebook range [0, 1023]"
    )
    assert not (tmp_path / "x.wav").exists()


def _text(path):
    path.write_text("12 34 56\n")


def _pickled_objects(path):
    with open(path, "wb") as f:
        np.save(f, np.array([[1, "a"]], dtype=object), allow_pickle=True)


def _npz(path):
    with open(path, "wb") as f:
        np.savez(f, codes=np.zeros((12, 3), dtype=np.int64))


@pytest.mark.parametrize("write", [_text, _pickled_objects, _npz])
@pytest.mark.parametrize("name", ["codes.npy", "codes.txt"])
def test_garbage_codes_file_gives_one_line(tmp_path, capsys, write, name):
    path = tmp_path / name
    write(path)
    assert main(["decode", str(path), "-o", str(tmp_path / "x.wav")]) == 2
    err = capsys.readouterr().err
    assert (
        err == f"vllm-omni-moss: error: {path} is not a valid .npy array of integer codes (expected shape (n_vq, T))\n"
    )


def test_garbage_pt_file_gives_one_line(tmp_path, capsys):
    path = tmp_path / "codes.pt"
    path.write_bytes(b"not a tensor")
    assert main(["decode", str(path), "-o", str(tmp_path / "x.wav")]) == 2
    assert capsys.readouterr().err == (
        f"vllm-omni-moss: error: {path} is not a valid .pt tensor of integer codes (expected shape (n_vq, T))\n"
    )


def _our_readme() -> bool:
    readme = REPO_ROOT / "README.md"
    return readme.exists() and readme.read_text(encoding="utf-8").startswith("# vllm-omni-moss")


# The fork form (scripts/build_fork.sh) carries these tests into vLLM-Omni's tree, whose README is its own.
needs_our_readme = pytest.mark.skipif(not _our_readme(), reason="this tree's README.md is not vllm-omni-moss's")


def _readme_block(heading: str) -> list[str]:
    """Lines of the first ```bash block after ``heading`` in README.md."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    return [line for line in match.group(1).splitlines() if line.strip()]


@needs_our_readme
def test_readme_command_line_examples_run_as_written(tmp_path):
    """README's CLI block, run line by line in a scratch directory: ``.venv/bin/X`` becomes this
    interpreter (the venv the tests run in) and ``/tmp/`` a scratch directory."""
    lines = _readme_block("## Command line")
    assert [shlex.split(line, comments=True)[0] for line in lines] == [
        ".venv/bin/vllm-omni-moss",
        ".venv/bin/python",
        ".venv/bin/vllm-omni-moss",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for line in lines:
        argv = [a.replace("/tmp/", f"{tmp_path}/") for a in shlex.split(line, comments=True)]
        head = [sys.executable] if argv[0] == ".venv/bin/python" else [sys.executable, "-m", CLI_MODULE]
        done = subprocess.run(head + argv[1:], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (line, done.stderr)
    codes = np.load(tmp_path / "codes.npy")
    assert codes.shape[0] == 12 and codes.dtype.kind == "i" and 0 <= codes.min() and codes.max() < 1024
    audio, rate = soundfile.read(tmp_path / "out.wav")
    assert rate == 48000 and audio.shape == (codes.shape[1] * 3840, 2)


@needs_our_readme
def test_readme_states_the_code_format():
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert "`(12, T)` integers in `[0, 1024)`" in text
    assert "`source .venv/bin/activate`" in text
