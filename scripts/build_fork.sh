#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build the fork form of this project against vLLM-Omni 0.30.0 (see README, "Fork"):
#
#   bash scripts/build_fork.sh [--wheel PATH] [--out DIR] [--force] [--build-tag TAG]
#
# Without --wheel, `pip download --no-deps vllm-omni==0.30.0` fetches the published wheel; either way the wheel
# must have the sha256 pinned in scripts/fork/vllm_omni-0.30.0.sha256 (exit 2 naming both digests). Writes
# dist/fork/patches/000N-*.patch, dist/fork/vllm_omni-0.30.0-1moss-py3-none-any.whl and
# dist/fork/manifest.json; an existing dist/fork is replaced only with --force.
# Needs git and the `wheel` package (installed by scripts/install.sh with the test extras).
# Env: PYTHON picks the interpreter (default: ./.venv/bin/python, else python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then
    PY="$ROOT/.venv/bin/python"
else
    PY=python3
fi
exec "$PY" "$ROOT/scripts/fork/build_fork.py" "$@"
