#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run the CPU test suite from ./.venv (create it with scripts/install.sh). Extra args go to pytest:
#   bash scripts/test.sh -k stft -x
#   bash scripts/test.sh tests/model_executor/models/moss_tts/test_config.py   # a path replaces `tests`
# A later `-m EXPR` overrides the default `-m "not cuda"`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ ! -f .venv/bin/activate ]; then
    echo "test.sh: no .venv; run 'bash scripts/install.sh' first" >&2
    exit 1
fi
# shellcheck disable=SC1091
source .venv/bin/activate

# Triton kernels run on CPU through the interpreter.
export TRITON_INTERPRET=1

# Default to the whole tests/ tree unless a path (or path::node) is given.
targets=(tests)
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        targets=()
        break
    fi
done

exec python -m pytest "${targets[@]}" -q -m "not cuda" "$@"
