# SPDX-License-Identifier: Apache-2.0
"""scripts/test_cuda.sh: the fast CUDA lane holds a test of every CUDA test file (collection only, no GPU), and
the check names a file whose CUDA tests are all marked slow."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "test_cuda.sh"


def _check(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), "--check", *map(str, paths)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_fast_lane_has_a_test_of_every_cuda_test_file():
    proc = _check()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Ten files hold CUDA tests today (tests/model_executor/models/moss_tts/); fewer means some went missing.
    assert int(proc.stdout.split("of the ")[1].split()[0]) >= 10, proc.stdout


def test_check_names_a_file_with_slow_cuda_tests_only(tmp_path):
    (tmp_path / "test_only_slow.py").write_text(
        "import pytest\n\n\n@pytest.mark.cuda\n@pytest.mark.slow\ndef test_a():\n    pass\n"
    )
    (tmp_path / "test_fast.py").write_text("import pytest\n\n\n@pytest.mark.cuda\ndef test_b():\n    pass\n")
    proc = _check(tmp_path / "test_only_slow.py", tmp_path / "test_fast.py")
    assert proc.returncode == 1
    head, *files = proc.stderr.splitlines()
    assert head == "test_cuda.sh: the fast lane has no test of these CUDA test files:"
    # Node ids are relative to pytest's rootdir, which depends on where the checkout lies.
    assert [Path(f).name for f in files] == ["test_only_slow.py"]
