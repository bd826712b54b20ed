# SPDX-License-Identifier: Apache-2.0
"""The stage benchmark behind ``bench_codec_stage.py`` (whose docstring documents the job and its results).

Imported with ``benchmarks/tts`` on ``sys.path`` (the script puts it there): its modules import the
benchmarks' ``common`` and ``upstream_stage`` as top-level modules. Importing the package imports nothing.
"""
