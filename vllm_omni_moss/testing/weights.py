# SPDX-License-Identifier: Apache-2.0
"""Random decoder weights for timing, memory and numerics tests (not a trained codec)."""

from __future__ import annotations

import math

import torch

__all__ = ["fill_random_weights_"]


@torch.no_grad()
def fill_random_weights_(decoder: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fill every parameter and buffer of a :class:`~..model_executor.models.moss_tts.decoder.CodecDecoder`
    in place, in its own dtype and on its own device, from one generator seeded with ``seed``, in name order:
    matrices ``N(0, 1/fan_in)``, LayerNorm weights ``N(1, 0.1)``, every other vector ``N(0, 0.1)``, the
    decode table ``lut`` ``N(0, 1/num_quantizers)``. Returns ``decoder``."""
    device = decoder.lut.device
    gen = torch.Generator(device=device).manual_seed(int(seed))
    named = list(decoder.named_parameters()) + list(decoder.named_buffers())
    for name, tensor in sorted(named, key=lambda item: item[0]):
        if name == "lut":
            tensor.normal_(0.0, 1.0 / math.sqrt(decoder.config.num_quantizers), generator=gen)
        elif tensor.dim() >= 2:
            tensor.normal_(0.0, 1.0 / math.sqrt(tensor.shape[-1]), generator=gen)
        elif name.endswith(("norm1.weight", "norm2.weight")):
            tensor.normal_(1.0, 0.1, generator=gen)
        else:
            tensor.normal_(0.0, 0.1, generator=gen)
    return decoder
