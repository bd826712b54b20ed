# SPDX-License-Identifier: Apache-2.0
"""The benchmark scripts under ``benchmarks/tts/`` as modules, for the tests of this directory.

They are scripts, not a package: each is loaded once from its path and registered as ``_bench_<name>``, so
every test file that needs one gets the same module object. Importing this module puts ``benchmarks/tts`` on
``sys.path``, so that tests import the scripts' helpers (``codec_stage``, ``common``, ``upstream_stage``) by name.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "tts"
# The scripts' helper packages and modules (codec_stage, common, upstream_stage), importable by name in tests.
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))


def load(name: str) -> ModuleType:
    """``benchmarks/tts/<name>.py`` as a module (loaded on the first call, the same object after)."""
    module_name = f"_bench_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, BENCH_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return sys.modules[module_name]
