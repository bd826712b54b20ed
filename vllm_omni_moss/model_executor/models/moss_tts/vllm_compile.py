# SPDX-License-Identifier: Apache-2.0
"""vLLM's ``torch.compile`` decorator over the core's compile adapters (``compile.py``).

The stage owns graph capture (the session knows which slots padding rows may touch), so the adapter is built
under a copy of the vLLM config with vLLM's own CUDA graphs off and an empty static forward context. This
module and ``stage.py`` are the only ones of the package that import vLLM.
"""

from __future__ import annotations

import copy
import functools
import logging

from torch import nn

from .compile import DYNAMIC_ARG_DIMS, adapter_class_for

__all__ = ["vllm_adapter_class", "vllm_compile_factory"]

logger = logging.getLogger(__name__)


@functools.cache
def vllm_adapter_class(base: type[nn.Module]) -> type[nn.Module]:
    """``support_torch_compile`` subclass of the core adapter class ``base``.

    Built once per base class (:func:`~.compile.adapter_class_for` picks it for a pool): the decorator rewrites
    the class it is given (bases and ``__init__``), so it gets a subclass owned by this module, never the core
    class.
    """
    from vllm.compilation.decorators import support_torch_compile

    def __init__(self, *, pool, vllm_config, prefix: str = "") -> None:
        base.__init__(self, pool)

    name = f"Vllm{base.__name__}"
    cls = type(name, (base,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})
    return support_torch_compile(dynamic_arg_dims=DYNAMIC_ARG_DIMS)(cls)


def vllm_compile_factory(vllm_config):
    """``pool -> compiled step`` through vLLM's compiler, or None when it cannot be built (logged; the session
    then captures plain CUDA graphs)."""
    from vllm.config import CUDAGraphMode
    from vllm.config.vllm import set_current_vllm_config

    config = copy.copy(vllm_config)
    config.compilation_config = copy.copy(vllm_config.compilation_config)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    config.compilation_config.static_forward_context = {}

    def factory(pool):
        try:
            with set_current_vllm_config(config):
                return vllm_adapter_class(adapter_class_for(pool))(pool=pool, vllm_config=config)
        except Exception:
            logger.warning("vLLM compile adapter unavailable for the MOSS codec; plain CUDA graphs", exc_info=True)
            return None

    return factory
