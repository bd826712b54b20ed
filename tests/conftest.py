# SPDX-License-Identifier: Apache-2.0
"""Shared pytest configuration for vllm-omni-moss.

* ``--run-level {core_model,advanced_model}``: like upstream vLLM-Omni's suite. Given a level, only tests
  marked with that level's marker are kept (the others are deselected). Default: run everything collected.
* Tests marked ``cuda`` are skipped when ``torch.cuda.is_available()`` is False.
* Tests marked ``vllm`` are skipped when vLLM / vLLM-Omni are not installed (``scripts/install.sh --vllm``).

* Every test runs torch on one intra-op thread (session fixture); torch is imported when tests run,
  not when this file loads.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest

RUN_LEVELS = ("core_model", "advanced_model")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-level",
        action="store",
        default=None,
        choices=RUN_LEVELS,
        help="Test level to run (keeps only tests with that marker); default: every collected test.",
    )


@pytest.fixture(scope="session")
def run_level(request: pytest.FixtureRequest) -> str | None:
    """The ``--run-level`` given on the command line, or None."""
    return request.config.getoption("--run-level")


@pytest.fixture(scope="session", autouse=True)
def _single_intra_op_thread():
    """Every test runs torch on one intra-op thread: the tiny codecs' kernels are microseconds
    long and two threads on a loaded 2-core CI machine slowed them up to 15x (measured)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@functools.cache
def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@functools.cache
def _vllm_available() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("vllm_omni") is not None
    except (ImportError, ValueError):
        return False


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` deselection: torch is imported only if a cuda test remains
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    level = config.getoption("--run-level")
    if level is not None:
        kept, deselected = [], []
        for item in items:
            (kept if item.get_closest_marker(level) is not None else deselected).append(item)
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = kept

    skip_cuda = pytest.mark.skip(reason="needs CUDA")
    skip_vllm = pytest.mark.skip(reason="needs vllm + vllm-omni (scripts/install.sh --vllm)")
    for item in items:
        if item.get_closest_marker("cuda") is not None and not _cuda_available():
            item.add_marker(skip_cuda)
        if item.get_closest_marker("vllm") is not None and not _vllm_available():
            item.add_marker(skip_vllm)
