# SPDX-License-Identifier: Apache-2.0
"""The plain developer install (``scripts/install.sh`` without ``--vllm``) collects the suite: a test module of the
vLLM lane imports nothing of that lane at module level, and its tests are skipped by the ``vllm`` marker.

The lane is simulated in a subprocess by blocking its modules (``sys.modules[name] = None`` makes ``import name``
raise ``ImportError`` and ``importlib.util.find_spec(name)`` answer None, as when they are not installed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]

ROOT = Path(__file__).resolve().parents[1]
#: Modules that only the vLLM lane installs.
VLLM_LANE = ["vllm", "vllm_omni", "msgspec"]

_RUN = """
import json, sys
sys.modules.update(dict.fromkeys({blocked!r}))
try:
    import msgspec
except ImportError:
    pass
else:
    raise SystemExit("msgspec was not blocked")
import pytest

class Outcomes:
    def __init__(self):
        self.collect_errors, self.tests = [], {{}}

    def pytest_collectreport(self, report):
        if report.failed:
            self.collect_errors.append((report.nodeid, str(report.longrepr)[-2000:]))

    def pytest_runtest_logreport(self, report):
        if report.when == "setup" or report.failed:
            reason = report.longrepr[2] if report.skipped else None
            self.tests[report.nodeid] = (report.outcome, reason)

outcomes = Outcomes()
code = pytest.main(["-q", "-p", "no:xdist", "-p", "no:cacheprovider", {path!r}], plugins=[outcomes])
print("OUTCOMES=" + json.dumps({{"code": int(code), "errors": outcomes.collect_errors, "tests": outcomes.tests}}))
"""


@pytest.mark.parametrize("module", ["tests/model_executor/models/moss_tts/test_talker_chunker.py"])
def test_a_vllm_lane_module_collects_and_skips_without_the_lane(module):
    """Without vllm, vllm-omni and msgspec the module collects, and every one of its tests is skipped with the
    ``vllm`` marker's reason (none errors, none runs)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = _RUN.format(blocked=VLLM_LANE, path=module)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("OUTCOMES=")]
    assert lines, f"no outcome (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    got = json.loads(lines[-1][len("OUTCOMES=") :])
    assert got["errors"] == []
    assert got["code"] == 0
    assert len(got["tests"]) > 10
    reasons = {outcome: set() for outcome, _ in got["tests"].values()}
    for outcome, reason in got["tests"].values():
        reasons[outcome].add(reason)
    assert reasons == {"skipped": {"Skipped: needs vllm + vllm-omni (scripts/install.sh --vllm)"}}
