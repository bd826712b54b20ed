# SPDX-License-Identifier: Apache-2.0
"""Custom ops of the codec decoder: one file per op family, each holding its Triton kernels, their
launch, the ``torch.library.custom_op`` with ``register_fake``, and the PyTorch reference it is tested
against; the ring op's kernels have a file each (``ring_attention``, ``ring_write``). No module imports
another's private name.

* :mod:`.commit` - ``commit_ring`` / ``commit_offsets``: masked write-back of a step's ring cells
  and offsets into the state pool.
* :mod:`.ring_attention_packed` - ``ring_attention_write_packed``: one layer's streaming attention over a ragged
  step's packed rows (row ``b`` from token ``token_start[b]``), reading the pool's rings in place, and the write
  of each row's last ``min(tokens, C)`` tokens into its ring, as one op.
* :mod:`.ring_attention` - the attention kernel that op launches (it stores the chunk itself for rows of at most
  32 tokens), its launch and launch table (``attention_launch_config``: block sizes, warps, stages, fused write
  per step shape), and the grid reference the op's reference builds on. The kernel can rotate queries and keys
  by RoPE as it loads them (``bench_ring_attention.py`` times that; the decoder rotates first, with ``rope``).
* :mod:`.ring_write` - the write kernel (for longer rows, after the attention kernel) and its launch, its grid
  reference, and what both ring kernels build on: their jit helpers, RoPE and paging arguments, the page
  table's check.
* :mod:`.ring_reference` - ``attend_gathered_rows``, the SDPA computation over gathered ring rows
  that the ``"sdpa"`` backend runs and the ring ops' references build on, and the logical view of a
  paged ring those references read and write.
* :mod:`.rope` - ``rope``: RoPE of a layer's queries and keys as one pass, bitwise
  ``step_metadata.apply_rope``; the triton backend runs it before the attention kernel, which then
  reads ready keys. ``step_rope_tables``: a step's RoPE tables of one resolution group in one kernel,
  bitwise ``step_metadata.rope_tables`` (CUDA; CPU runs that formula).
* :mod:`.layer_norm` - ``layer_norm``: a decoder layer's LayerNorm in float32 as one pass, the only pass
  between sublayers on the fused path (CUDA; CPU decodes with its reference), and the reference of a
  sublayer's end (``residual_layer_norm_reference``).

:mod:`.dispatch` holds what every family shares: Triton (``backends.py`` imports it under a guard), the dispatch
between kernel and reference, the device guard of a launch and the shape check.
"""
