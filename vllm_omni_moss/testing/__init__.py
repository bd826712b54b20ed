# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the tests and the benchmarks; not used when serving.

``vllm_omni_moss.testing.upstream`` runs vLLM-Omni 0.30.0's own codec files as a reference (an oracle).
Importing this package imports nothing: each submodule is imported explicitly.
"""
