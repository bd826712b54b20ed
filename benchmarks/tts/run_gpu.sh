#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# One command for the GPU machine: CUDA tests, the codec memory and step benchmarks, the stage sweep.
#
#   bash benchmarks/tts/run_gpu.sh [path/to/vllm_omni-0.30.0-*.whl]
#
# Default wheel: .whl/vllm_omni-0.30.0-*.whl (`pip download --no-deps vllm-omni==0.30.0 -d .whl`). Only the
# wheel's moss_tts directory is unzipped (to /tmp) and exposed through MOSS_UPSTREAM_MOSS_TTS_DIR for the
# upstream arms; without a wheel those arms are skipped and the rest still runs. Results go to $OUT
# (default ./out/gpu); benchmarks/results/current.yaml names the files RESULTS.md is generated from.
#
# PARTS picks what runs, in this order (default "tests memory step"; measured on one H200 on 2026-11-29:
# 204 s wall, tests 25 s, memory ~25 s, steps ~135 s):
#   tests   pytest -m cuda                       -> env.txt pytest.log
#   memory  bench_codec_memory.py (64, 128)      -> memory.json memory.log
#   step    bench_codec_step.py                  -> step.json step.log
#   stage   bench_codec_stage.py $STAGE_ARGS     -> stage/ (results.json, results.md, latencies.npz, four PNGs)
# The stage sweep is the main job and takes longer than the other parts together (each arm and concurrency
# simulates ~75 s of traffic at 17 requests per stream), so run it on its own, in parts if need be, e.g.
#   PARTS=stage STAGE_ARGS="--arms v2,upstream --concurrency 64,128" bash benchmarks/tts/run_gpu.sh
#   PARTS=stage STAGE_ARGS="--arms v2,upstream --concurrency 256 --append" bash benchmarks/tts/run_gpu.sh
# (--append needs the previous $OUT/stage: the same machine, or a copy of it). results.json and latencies.npz
# are rewritten after every run, so a command cut short by STAGE_TIMEOUT (default 570 s) keeps the runs it
# finished; `bench_codec_stage.py --out DIR --report-only` then rewrites results.md and the plots.

set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
REPO=$(pwd)
OUT=${OUT:-$REPO/out/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "run_gpu.sh: needs a CUDA device and torch in $PY (set PYTHON=...); nothing was run" >&2
  exit 2
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

WHEEL=${1:-}
if [ -z "$WHEEL" ]; then
  WHEEL=$(ls "$REPO"/.whl/vllm_omni-0.30.0-*.whl 2>/dev/null | head -n 1)
fi
UPSTREAM_ROOT=/tmp/vllm_omni_0_30_0
if [ -n "$WHEEL" ] && [ -f "$WHEEL" ]; then
  rm -rf "$UPSTREAM_ROOT"
  "$PY" - "$WHEEL" "$UPSTREAM_ROOT" <<'EOF'
import sys
import zipfile

wheel, dest = sys.argv[1], sys.argv[2]
prefix = "vllm_omni/model_executor/models/moss_tts/"
with zipfile.ZipFile(wheel) as archive:
    members = [name for name in archive.namelist() if name.startswith(prefix)]
    archive.extractall(dest, members=members)
print(f"unzipped {len(members)} moss_tts files from {wheel}")
EOF
  export MOSS_UPSTREAM_MOSS_TTS_DIR="$UPSTREAM_ROOT/vllm_omni/model_executor/models/moss_tts"
else
  echo "no vllm-omni 0.30.0 wheel found (argument or .whl/): the upstream arm will be skipped"
fi

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.mem --format=csv
  "$PY" - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0))
for name in ("triton", "transformers", "hypothesis", "safetensors"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:  # report, never fail here
        print(name, "missing:", exc)
EOF
  echo "MOSS_UPSTREAM_MOSS_TTS_DIR=${MOSS_UPSTREAM_MOSS_TTS_DIR:-<unset>}"
  git -C "$REPO" rev-parse HEAD 2>/dev/null || true
  git -C "$REPO" status --short 2>/dev/null | head -n 40 || true
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
PARTS=${PARTS:-tests memory step}
STAGE_ARGS=${STAGE_ARGS:---arms v2,upstream --concurrency 64,128}
wants() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if wants tests; then
  echo "== pytest -m cuda"
  # --continue-on-collection-errors: a test module whose import fails on this image (a package the image
  # lacks) must not stop the CUDA tests of the other modules; the error is still reported and fails status.
  timeout 200 "$PY" -m pytest tests -m cuda -q -rs -p no:cacheprovider --continue-on-collection-errors \
    --durations=8 >"$OUT/pytest.log" 2>&1 || status=1
  tail -n 15 "$OUT/pytest.log"
fi

if wants memory; then
  echo "== codec state memory (64, 128 streams)"
  timeout 60 "$PY" benchmarks/tts/bench_codec_memory.py --preset v2 --streams 64,128 --device cuda \
    --json "$OUT/memory.json" 2>&1 | tee "$OUT/memory.log" || status=1
fi

if wants step; then
  echo "== codec step latency"
  timeout 180 "$PY" benchmarks/tts/bench_codec_step.py --preset v2 --batch 1,8,64,128 --frames 1,15 \
    --modes eager,graph --arms legacy,v2,upstream --repeats 5 --steps-per-round 2 --warmup 2 --device cuda \
    --json "$OUT/step.json" 2>&1 | tee "$OUT/step.log" || status=1
fi

if wants stage; then
  echo "== codec stage under load (main job): $STAGE_ARGS"
  # shellcheck disable=SC2086  # STAGE_ARGS is a list of flags
  timeout "${STAGE_TIMEOUT:-570}" "$PY" benchmarks/tts/bench_codec_stage.py --device cuda --quiet \
    --out "$OUT/stage" $STAGE_ARGS 2>&1 | tee "$OUT/stage.log" | tail -n 40 || status=1
fi

echo "== done (status $status); files in $OUT:"
ls -lR "$OUT"
exit $status
