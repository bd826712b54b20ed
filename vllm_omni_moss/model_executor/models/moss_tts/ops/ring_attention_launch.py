# SPDX-License-Identifier: Apache-2.0
"""The launch table of the ring attention kernel (``ops/ring_attention.py``): per step shape, the block
of queries per program, the block of keys per inner iteration, warps, pipeline stages, how
probabilities meet values, and whether ``ring_attention_write`` fuses the ring write into the kernel.

Plain Python with no Triton import, so the table also answers where Triton is not installed (benchmarks
and tests read it). ``ring_attention.py`` re-exports every public name here, and ``_launch_config``.
"""

from __future__ import annotations

import torch

__all__ = ["FUSED_WRITE_MAX_TOKENS", "LAUNCH_KEYS", "MIN_ATTENTION_PROGRAMS", "attention_launch_config"]

#: Keys per inner iteration of the attention kernel.
_BLOCK_KEYS = 64
#: Largest block of queries per program for float32 rings (smaller steps use the next power of two >= T,
#: at least 16); 16-bit rings go up to 128 (``attention_launch_config``).
_MAX_BLOCK_QUERIES = 64
#: Most tokens per row for which ``ring_attention_write`` fuses the write (``attention_launch_config``).
FUSED_WRITE_MAX_TOKENS = 32
#: Fewest programs of 128 queries a 16-bit step needs before it uses 128-query blocks (about two per SM
#: of an H200's 132; ``attention_launch_config``).
MIN_ATTENTION_PROGRAMS = 256
#: The keys of a launch configuration (``attention_launch_config``), which ``tuning`` may override.
LAUNCH_KEYS = ("block_q", "block_k", "num_warps", "num_stages", "pv", "fused_write")


def attention_launch_config(num_tokens: int, ring_dtype: torch.dtype, row_heads: int | None = None) -> dict:
    """Launch parameters of the attention kernel for a step of ``num_tokens`` tokens per row.

    Args:
        num_tokens: ``T``, tokens per row in the step.
        ring_dtype: the rings' dtype.
        row_heads: ``B x H``, the step's (row, head) pairs; None counts as many.
    Returns:
        A dict with ``block_q`` (queries per program), ``block_k`` (keys per inner iteration),
        ``num_warps``, ``num_stages`` (software pipelining depth of the key loops), ``pv`` (how
        probabilities meet values: ``"low"`` rounds them to the 16-bit ring dtype and multiplies on
        16-bit tensor cores, ``"ieee"`` keeps float32) and ``fused_write`` (whether
        ``ring_attention_write`` stores the chunk from the attention kernel, one program per
        (row, head) walking its query blocks in order, rather than with the write kernel after it).

    Chosen on an H200 from the launch sweeps of ``benchmarks/RESULTS.md`` (block sizes, stages and
    ``pv`` over the v2 codec's six group shapes at 64 and 128 rows, T = 1 and 15 frames; the 64-query
    block and the fused write at 1 to 128 rows). For 16-bit rings ``"low"`` was the fastest in every
    shape. The best block is
    the smallest power of two >= T up to 64 queries (16, 32, 64), and 128 above, except when a step
    has fewer than ``MIN_ATTENTION_PROGRAMS`` programs of 128 queries (one row at T = 15): 64 then
    doubles them. Three pipeline stages won at 30 tokens and above, two at 15. The fused write pays
    only where a row is one small block (T <= 32 tokens: reading the chunk again and one launch are
    a large share there); with several blocks per row, one program per (row, head) left the device
    idler than the separate write costs. Float32 rings keep the configuration they were validated
    with (and the same write rule).
    """
    if ring_dtype == torch.float32:
        block_q = min(_MAX_BLOCK_QUERIES, max(16, _next_power_of_2(num_tokens)))
        config = dict(block_q=block_q, block_k=_BLOCK_KEYS, num_warps=4, num_stages=2, pv="ieee")
    else:
        block_q = max(16, _next_power_of_2(num_tokens))
        if block_q > 64:
            few = row_heads is not None and row_heads * -(-num_tokens // 128) < MIN_ATTENTION_PROGRAMS
            block_q = 64 if few else 128
        num_stages = 2 if num_tokens <= 16 else 3
        config = dict(block_q=block_q, block_k=_BLOCK_KEYS, num_warps=4, num_stages=num_stages, pv="low")
    config["fused_write"] = num_tokens <= FUSED_WRITE_MAX_TOKENS
    return config


def _launch_config(num_tokens: int, ring_dtype: torch.dtype, tuning: dict | None, row_heads: int | None = None) -> dict:
    """:func:`attention_launch_config` with ``tuning``'s entries in place of the defaults.

    Raises:
        ValueError: ``tuning`` names a key outside :data:`LAUNCH_KEYS`.
    """
    config = attention_launch_config(num_tokens, ring_dtype, row_heads)
    unknown = sorted(set(tuning or ()) - set(LAUNCH_KEYS))
    if unknown:
        raise ValueError(f"ring_attention: unknown launch configuration keys {unknown}; expected some of {LAUNCH_KEYS}")
    config.update(tuning or {})
    return config


def _next_power_of_2(n: int) -> int:
    # triton.next_power_of_2's value, here so that attention_launch_config also answers without Triton.
    return 1 << max(n - 1, 0).bit_length()
