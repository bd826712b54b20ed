# SPDX-License-Identifier: Apache-2.0
"""vLLM-Omni general plugin: serve MOSS-TTS Stage 1 with this package's codec stage.

vLLM-Omni runs the ``vllm_omni.general_plugins`` entry-point group (see ``setup.py``)
in every omni process before a stage model loads. :func:`register` points the
``MossTTSCodecDecoder`` architecture of vLLM-Omni's own registry, ``OmniModelRegistry``
(separate from vLLM's global ``ModelRegistry``, which omni stages do not consult), at
our class. The lazy ``"module:Class"`` form keeps this import free of torch: the stage
module is imported only when a stage resolves the architecture.
"""

from __future__ import annotations

__all__ = ["ARCHITECTURE", "STAGE_CLASS", "register"]

ARCHITECTURE = "MossTTSCodecDecoder"
STAGE_CLASS = "vllm_omni_moss.model_executor.models.moss_tts.stage:MossTTSCodecDecoder"


def register() -> None:
    """Register the codec stage on ``OmniModelRegistry``. Idempotent; overwrites upstream's entry.

    Raises:
        ImportError: vLLM-Omni is not installed (only omni processes call this).
    """
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    module, _, cls = STAGE_CLASS.partition(":")
    current = OmniModelRegistry.models.get(ARCHITECTURE)
    if getattr(current, "module_name", None) == module and getattr(current, "class_name", None) == cls:
        return
    OmniModelRegistry.register_model(ARCHITECTURE, STAGE_CLASS)
