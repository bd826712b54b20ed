# SPDX-License-Identifier: Apache-2.0
"""Packaging for vllm-omni-moss: the MOSS-TTS codec stage as a vLLM-Omni plugin."""

import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _version() -> str:
    text = (ROOT / "vllm_omni_moss" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.M)
    if match is None:
        raise RuntimeError("vllm_omni_moss/__init__.py defines no __version__")
    return match.group(1)


def _long_description() -> str:
    readme = ROOT / "README.md"
    return readme.read_text(encoding="utf-8") if readme.exists() else ""


setup(
    name="vllm-omni-moss",
    version=_version(),
    description="MOSS-TTS audio codec stage for vLLM-Omni (out-of-tree plugin)",
    long_description=_long_description(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_omni_moss", "vllm_omni_moss.*"]),
    include_package_data=True,
    install_requires=[
        # Supported range: 2.11 runs on the GPU machine (benchmarks/RESULTS.md), 2.13 on CPU / the vLLM 0.30 lane.
        "torch>=2.11,<2.14",
        "numpy>=1.26",
        "safetensors>=0.4",
        "soundfile>=0.12",
        # The command line's progress bar. Kept core rather than optional: vllm-omni itself requires
        # tqdm>=4.66, so a serving install has it anyway, and the CLI needs no fallback code path.
        "tqdm>=4.66",
    ],
    extras_require={
        "test": [
            "pytest>=8,<10",
            "pytest-xdist>=3.8,<4",  # scripts/test.sh runs the CPU suite in two processes (-n 2)
            "hypothesis>=6.100",
            "wheel>=0.40",  # scripts/build_fork.sh: wheel unpack / pack
        ],
        # Triton kernels; tests run them on CPU with TRITON_INTERPRET=1.
        "triton": [
            "triton>=3.5",
        ],
        # Upstream codec as a test oracle (vllm-omni itself is installed with --no-deps by scripts/install.sh).
        "oracle": [
            "transformers>=5.13,<5.15",
        ],
        # Benchmark plots (benchmarks/tts/*.py); the benchmarks' progress bars use the core tqdm.
        "bench": [
            "matplotlib>=3.8",
        ],
        "dev": [
            "ruff==0.17.6",
            "pre-commit>=3.5",
            "pre-commit-hooks==6.0.0",
            "pyyaml>=6.0",
        ],
    },
    entry_points={
        "console_scripts": [
            "vllm-omni-moss = vllm_omni_moss.model_executor.models.moss_tts.cli:main",
        ],
        "vllm_omni.general_plugins": [
            "moss_tts_codec = vllm_omni_moss.plugin:register",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Multimedia :: Sound/Audio :: Speech",
    ],
)
