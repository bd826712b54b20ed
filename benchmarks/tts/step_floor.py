# SPDX-License-Identifier: Apache-2.0
"""The floor of one decode step, measured in the running command (``bench_codec_step.py`` reports it beside
every step it times).

``floor(B, T) = gemm_ms + state_read_ms``:

* ``gemm_ms`` - the step's projection GEMMs (``bench_gemm_shapes.step_gemms``: input, QKV, output and FFN
  projections of every layer of every resolution group, ``B x T x tokens_per_frame`` token rows) timed alone,
  each shape as ``torch.nn.functional.linear`` runs it (cuBLAS bf16 on CUDA, ``bench_gemm_shapes.time_gemm``;
  float32 on a CPU), times its calls.
* ``state_read_ms`` - the ring state the step must read: every live row's whole state once
  (``state.state_bytes_for(config, B, "compact", element_size)``, 84.57 MiB a stream for the v2 codec in
  bf16), at ``copy_gb_s``.
* ``copy_gb_s`` - what a device-to-device copy of :data:`COPY_BYTES` moves per second, counting each byte read
  and each byte written (so it compares with a read of the state at the device's memory bandwidth).

A step cannot be faster than its GEMMs run alone plus one read of the state it attends over, so
``step / floor`` says how much of a step is overhead that fusing could remove.
"""

from __future__ import annotations

import statistics
import time

import bench_gemm_shapes
import common
import torch

from vllm_omni_moss.model_executor.models.moss_tts.config import CodecConfig
from vllm_omni_moss.model_executor.models.moss_tts.state import state_bytes_for

__all__ = ["COPY_BYTES", "copy_bandwidth_gb_s", "gemm_ms", "step_floor", "with_ratios"]

#: Bytes of the timed copy: 1 GiB on CUDA (well past the H200's 60 MiB L2 cache), 64 MiB on a CPU.
COPY_BYTES = {"cuda": 2**30, "cpu": 64 * 2**20}


def _cpu_ms(fn, runs: int = 3) -> float:
    # Median wall milliseconds of ``runs`` calls after one untimed call.
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gb_s(device: torch.device, nbytes: int | None = None) -> float:
    """GB/s (1e9 bytes) of a device-to-device copy of ``nbytes`` (default :data:`COPY_BYTES`), bytes read plus
    bytes written over the copy's median time (CUDA: ``common.graph_launch_ms``; CPU: wall time)."""
    nbytes = nbytes or COPY_BYTES["cuda" if device.type == "cuda" else "cpu"]
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(1)
    if device.type == "cuda":
        ms = common.graph_launch_ms(lambda: dst.copy_(src), launches=5)
    else:
        ms = _cpu_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def gemm_ms(config: CodecConfig, batch: int, frames: int, device: torch.device, seed: int = 0) -> float:
    """Milliseconds of the projection GEMMs of one step of ``batch`` rows and ``frames`` frames, each shape timed
    alone (CUDA: bf16 through ``bench_gemm_shapes.time_gemm``; CPU: float32 ``linear``, median wall time)."""
    total = 0.0
    for gemm in bench_gemm_shapes.step_gemms(config, batch, frames):
        if device.type == "cuda":
            ms = bench_gemm_shapes.time_gemm(gemm, seed)
        else:
            gen = torch.Generator().manual_seed(seed)
            x, w = torch.randn(gemm.rows, gemm.k, generator=gen), torch.randn(gemm.n, gemm.k, generator=gen)
            ms = _cpu_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w))
        total += ms * gemm.calls
    return total


def step_floor(
    config: CodecConfig, batch: int, frames: int, device: torch.device, copy_gb_s: float, element_size: int
) -> dict[str, float | int]:
    """The floor of one step: ``{gemm_ms, state_read_ms, total_ms, copy_gb_s, state_bytes}``.

    Args:
        copy_gb_s: the device's copy bandwidth, measured once per command (:func:`copy_bandwidth_gb_s`).
        element_size: bytes of one ring element (2 for bf16 rings).
    """
    state = state_bytes_for(config, batch, "compact", element_size)
    # The total is the sum of the two parts as recorded, so that the record adds up to the digit.
    gemm = round(gemm_ms(config, batch, frames, device), 4)
    read = round(state / (copy_gb_s * 1e9) * 1e3, 4)
    return {
        "gemm_ms": gemm,
        "state_read_ms": read,
        "total_ms": round(gemm + read, 4),
        "copy_gb_s": round(copy_gb_s, 2),
        "state_bytes": int(state),
    }


def with_ratios(record: dict) -> None:
    """Put ``step_over_floor`` (the arm's median step / ``record["floor"]["total_ms"]``) into every arm of every
    mode of a ``bench_codec_step.py`` result record that has a floor."""
    floor = record.get("floor")
    if not floor or floor["total_ms"] <= 0:
        return
    for entry in record["modes"].values():
        for stats in entry["arms"].values():
            stats["step_over_floor"] = round(stats["median_ms"] / floor["total_ms"], 4)
