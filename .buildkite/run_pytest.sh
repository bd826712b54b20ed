#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Buildkite helper: run pytest with the given arguments.
# CPU agents: uses ./.venv made by scripts/install.sh (Triton kernels through the CPU interpreter).
# GPU agents (MOSS_GPU=1): uses the preinstalled torch/triton/pytest of the agent (no network there);
#   installs this package in place without dependencies or build isolation.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ "${MOSS_GPU:-0}" = 1 ]; then
    python -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
    python -m pip install --no-deps --no-build-isolation --no-index -e . >/dev/null \
        || export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    # shellcheck disable=SC1091
    source .venv/bin/activate
    export TRITON_INTERPRET=1
fi

exec python -m pytest "$@"
