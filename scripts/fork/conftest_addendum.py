# ------------------------------------------------------------------------------------------------
# Fork only (appended by vllm-omni-moss's scripts/build_fork.sh). In the plugin repository these
# hooks live in its root tests/conftest.py; here they apply to this directory's tests only.
# ------------------------------------------------------------------------------------------------

import functools as _functools  # noqa: E402  (appended below the conftest's own code)
from pathlib import Path as _Path  # noqa: E402

import pytest  # noqa: E402

_HERE = _Path(__file__).resolve().parent


def pytest_configure(config):
    # The plugin repository gates tests needing vLLM with this marker; inside vLLM-Omni it always holds.
    config.addinivalue_line("markers", "vllm: needs vllm + vllm-omni (always installed here)")


@_functools.cache
def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if _HERE in _Path(str(item.path)).resolve().parents and item.get_closest_marker("cuda") is not None:
            if not _cuda_available():
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """The tiny codecs' kernels are microseconds long: extra intra-op threads only add contention."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
