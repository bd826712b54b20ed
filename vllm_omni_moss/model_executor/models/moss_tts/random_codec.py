# SPDX-License-Identifier: Apache-2.0
"""A random-weight codec built in memory: the decoder of the random checkpoint that
:func:`~.checkpoint.save_random_checkpoint` writes for the same preset and seed, without writing it.

The stage serves one under vLLM's dummy load format (``docs/serving_stage.md``, "Serving without the
checkpoint"): the real geometry, no download, and audio that is noise.
"""

from __future__ import annotations

import torch

from .checkpoint import decoder_from_tensors, is_skipped, random_official_state_dict
from .config import CodecConfig, preset_config
from .decoder import CodecDecoder

__all__ = ["random_decoder"]


class _DrawnTensors:
    """The tensors of :func:`~.checkpoint.random_official_state_dict` that decoding reads, in host memory, read
    like a checkpoint directory (``where`` and ``get``). Encoder tensors are drawn too, so that every decoder
    tensor gets the same values as in the written checkpoint, and dropped at once."""

    def __init__(self, config: CodecConfig, seed: int) -> None:
        self.tensors = {name: t for name, t in random_official_state_dict(config, seed) if not is_skipped(name)}
        self.where = dict.fromkeys(self.tensors, "memory")

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def random_decoder(preset: str | CodecConfig, seed: int = 0, device: torch.device | str = "cpu") -> CodecDecoder:
    """The decoder of ``save_random_checkpoint(preset, path, seed)``, equal to loading that checkpoint with
    :func:`~.checkpoint.load_checkpoint` on ``device`` (bfloat16 on CUDA), drawn without writing a file.

    The tensors are drawn on the host in float32 whatever the caller's default device and dtype (vLLM builds a
    model under its own). Time and memory: the draw of every tensor of the checkpoint (2.1e9 numbers for the
    ``v2`` preset) and the decoder's float32 weights twice on the host (about 8.5 GB for ``v2``).

    Raises:
        ValueError: unknown preset name (the message lists the known ones).
    """
    config = preset_config(preset) if isinstance(preset, str) else preset
    name = preset if isinstance(preset, str) else config.version
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            decoder = decoder_from_tensors(config, _DrawnTensors(config, seed), f"random {name} weights", "cpu")
    finally:
        torch.set_default_dtype(previous)
    return decoder.to_serving(device)
