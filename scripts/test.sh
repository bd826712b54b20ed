#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run the CPU test suite from ./.venv (create it with scripts/install.sh). Extra args go to pytest:
#   bash scripts/test.sh -k stft -x
#   bash scripts/test.sh tests/model_executor/models/moss_tts/test_config.py   # a path replaces `tests`
#   bash scripts/test.sh -n 0                                                    # one process (a later -n wins)
# A later `-m EXPR` overrides the default `-m "not cuda"`.
# Workers: pytest-xdist (the `test` extra) runs the tests in MOSS_TEST_WORKERS processes (default 2, one per core
# of the CI machine), `--dist loadgroup`: tests marked `xdist_group` share one worker (their module fixtures are
# built once). Without pytest-xdist the suite runs in one process, with a warning.
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

workers=()
if python -c "import xdist" 2>/dev/null; then
    workers=(-n "${MOSS_TEST_WORKERS:-2}" --dist loadgroup)
else
    echo "test.sh: pytest-xdist is not installed: one process (bash scripts/install.sh installs it)" >&2
fi

exec python -m pytest "${targets[@]}" "${workers[@]}" -q -m "not cuda" "$@"
