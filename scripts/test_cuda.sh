#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The CUDA test lanes (docs/testing.md), from ./.venv on a machine with a CUDA GPU:
#   bash scripts/test_cuda.sh            # fast lane: -m "cuda and not slow", every CUDA test file (about 4 min on an H200)
#   bash scripts/test_cuda.sh --slow     # slow lane: -m "cuda and slow" (compiles, the v2 geometry, long matrices)
#   bash scripts/test_cuda.sh --all      # the whole CUDA suite: -m cuda
#   bash scripts/test_cuda.sh --check    # collect only: fail unless the fast lane has a test of every CUDA test file
# Extra args go to pytest; a path replaces `tests` (e.g. one file of the slow lane, to split it over two commands).
# Each lane prints the 25 slowest tests; with $OUT set it also writes $OUT/junit-<lane>.xml.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ ! -f .venv/bin/activate ]; then
    echo "test_cuda.sh: no .venv; run 'bash scripts/install.sh' first" >&2
    exit 1
fi
# shellcheck disable=SC1091
source .venv/bin/activate

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
        if ! listing="$(python -m pytest "${targets[@]}" -q --co -m "$1" "${@:2}" 2>&1)"; then
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

junit=()
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    junit=(--junitxml="$OUT/junit-$lane.xml")
fi
exec python -m pytest "${targets[@]}" -v -m "$marker" --durations=25 ${junit[@]+"${junit[@]}"} "$@"
