# SPDX-License-Identifier: Apache-2.0
"""What ``setup.py``, ``scripts/install.sh``, ``scripts/test.sh`` and README declare agree with each other."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
import setuptools

pytestmark = [pytest.mark.cpu]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_kwargs() -> dict:
    """The keyword arguments ``setup.py`` passes to ``setuptools.setup`` (nothing is built)."""
    captured: dict = {}
    real = setuptools.setup
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    finally:
        setuptools.setup = real
    return captured


def _names(requirements: list[str]) -> list[str]:
    return [re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in requirements]


def test_core_dependencies_and_torch_range(setup_kwargs):
    core = setup_kwargs["install_requires"]
    assert _names(core) == ["torch", "numpy", "safetensors", "soundfile", "tqdm"]
    assert core[0] == "torch>=2.11,<2.14"
    assert "matplotlib" not in " ".join(core)


def test_running_torch_is_in_the_supported_range(setup_kwargs):
    import torch
    from packaging.requirements import Requirement
    from packaging.version import Version

    spec = Requirement(setup_kwargs["install_requires"][0]).specifier
    assert Version(torch.__version__.split("+")[0]) in spec


def test_bench_extra_holds_the_plotting_dependency(setup_kwargs):
    extras = setup_kwargs["extras_require"]
    assert extras["bench"] == ["matplotlib>=3.8"]
    assert sorted(extras) == ["bench", "dev", "oracle", "test", "triton"]


def test_install_script_installs_the_extras_its_header_lists(setup_kwargs):
    text = (ROOT / "scripts" / "install.sh").read_text(encoding="utf-8")
    header = re.search(r"^# Extras installed \(setup.py\): (.*)\.$", text, re.M).group(1).split(", ")
    installed = re.search(r'^EXTRAS="([^"]*)"$', text, re.M).group(1).split(",")
    assert header == installed == ["test", "dev", "triton", "oracle", "bench"]
    assert set(installed) == set(setup_kwargs["extras_require"])
    assert '"${PIP[@]}" install -e ".[${EXTRAS}]"' in text


def test_readme_matches_what_the_scripts_do(setup_kwargs):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"Supported torch: `{setup_kwargs['install_requires'][0].removeprefix('torch')}`" in readme
    assert "[test,dev,triton,oracle,bench]" in readme
    # GPU tests are deselected by test.sh's default marker expression, and README says so.
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert 'exec python -m pytest "${targets[@]}" "${workers[@]}" -q -m "not cuda" "$@"' in script
    assert '**deselected** by `scripts/test.sh`, which passes `-m "not cuda"`' in readme
    assert "skipped without a GPU" not in readme
    assert "**Serving needs a GPU machine with `vllm==0.30.0` and `vllm-omni==0.30.0` installed**" in readme


def test_test_script_runs_two_workers_from_the_test_extra(setup_kwargs):
    # The CPU suite runs in two pytest-xdist processes unless MOSS_TEST_WORKERS or a later -n says otherwise.
    assert "pytest-xdist>=3.8,<4" in setup_kwargs["extras_require"]["test"]
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert 'workers=(-n "${MOSS_TEST_WORKERS:-2}" --dist loadgroup)' in script
    assert "bash scripts/test.sh --durations=15" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "`MOSS_TEST_WORKERS=N`" in readme and "`pytest-xdist`" in readme


def test_license_file_is_the_apache_2_text_setup_declares(setup_kwargs):
    assert setup_kwargs["license"] == "Apache-2.0"
    assert setup_kwargs["license_files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert text.rstrip().endswith("limitations under the License.")
    assert "License :: OSI Approved :: Apache Software License" in setup_kwargs["classifiers"]


def test_readme_states_the_supported_python(setup_kwargs):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f'`python_requires="{setup_kwargs["python_requires"]}"`' in readme
    versions = [c.rsplit(" :: ", 1)[1] for c in setup_kwargs["classifiers"] if re.fullmatch(r".*Python :: 3\.\d+", c)]
    assert f"({versions[0]} to {versions[-1]} declared)" in readme
    first_screen = "\n".join(readme.splitlines()[:45])
    assert "## Install into an existing vLLM-Omni deployment" in first_screen and "LICENSE" in first_screen
