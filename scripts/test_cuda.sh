#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The CUDA test lanes (docs/testing.md), on a machine with a CUDA GPU:
#   bash scripts/test_cuda.sh            # fast lane: -m "cuda and not slow", every CUDA test file (about 4 min on an H200)
#   bash scripts/test_cuda.sh --slow     # slow lane: -m "cuda and slow" (compiles, the v2 geometry, long matrices)
#   bash scripts/test_cuda.sh --all      # the whole CUDA suite: -m cuda
#   bash scripts/test_cuda.sh --check    # collect only: fail unless the fast lane has a test of every CUDA test file
# Extra args go to pytest; a path replaces `tests` (e.g. one file of the slow lane, to split it over two commands).
# Each lane prints the 25 slowest tests; with $OUT set it also writes $OUT/junit-<lane>.xml.
# Env: PYTHON picks the interpreter (default: ./.venv/bin/python, else python3, as on a GPU image without
# .venv); this checkout is put first on PYTHONPATH.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=python3
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

lane=fast
marker="cuda and not slow"
case "${1:-}" in
    --fast) shift ;;
    --slow) lane=slow; marker="cuda and slow"; shift ;;
    --all) lane=all; marker="cuda"; shift ;;
    --check) lane=check; shift ;;
    -*) ;;  # a pytest option: the fast lane
    "") ;;
    *) [ -e "${1%%::*}" ] || { echo "test_cuda.sh: unknown lane '$1' (expected --fast, --slow, --all or --check)" >&2; exit 2; } ;;
esac

# Compiled kernels only: a CUDA kernel test skips itself when Triton was told to interpret.
unset TRITON_INTERPRET

targets=(tests)
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        targets=()
        break
    fi
done

if [ "$lane" = check ]; then
    collect() {  # the test files holding tests of marker $1
        local listing
        if ! listing="$("$PY" -m pytest "${targets[@]}" -q --co -m "$1" "${@:2}" 2>&1)"; then
            echo "$listing" >&2
            echo "test_cuda.sh: collecting -m '$1' failed" >&2
            return 1
        fi
        grep '::' <<<"$listing" | cut -d: -f1 | sort -u || true
    }
    all_files="$(collect cuda "$@")"
    fast_files="$(collect "cuda and not slow" "$@")"
    missing="$(comm -23 <(echo "$all_files") <(echo "$fast_files"))"
    if [ -n "$missing" ]; then
        echo "test_cuda.sh: the fast lane has no test of these CUDA test files:" >&2
        echo "$missing" >&2
        exit 1
    fi
    echo "fast lane: a test of every one of the $(grep -c . <<<"$all_files") CUDA test files"
    exit 0
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "test_cuda.sh: the $lane lane needs a CUDA device and torch in $PY (set PYTHON=...); nothing was run" >&2
    exit 2
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

junit=()
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    junit=(--junitxml="$OUT/junit-$lane.xml")
fi
# --continue-on-collection-errors: a test module that does not import on this image (a package it lacks) must
# not stop the other modules' CUDA tests; the error is still reported and fails the lane.
exec "$PY" -m pytest "${targets[@]}" -v -rs -m "$marker" --continue-on-collection-errors --durations=25 \
    ${junit[@]+"${junit[@]}"} "$@"
