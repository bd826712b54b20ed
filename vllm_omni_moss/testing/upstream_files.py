# SPDX-License-Identifier: Apache-2.0
"""Locating and loading vLLM-Omni 0.30.0's own ``moss_tts`` files by path, without importing vLLM.

Import-light on purpose: importing this module imports torch and the standard library only. The codec files
(``audio_tokenizer.py`` = v1, ``audio_tokenizer_v2.py`` + its configuration = v2) are loaded into a synthetic
package so that ``vllm_omni/__init__.py`` (which needs vLLM) never runs; ``transformers`` is imported only then.
``streaming_attention.py`` (upstream's masked Triton attention) is loaded by :func:`load_streaming_attention`,
the one loader of that file for the tests and the benchmarks.

Set ``MOSS_UPSTREAM_MOSS_TTS_DIR`` to a directory holding upstream's ``moss_tts`` files to use a copy that is
not installed as a package (e.g. an unzipped wheel on a machine without vLLM).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import os
import sys
import types
from pathlib import Path

__all__ = [
    "STREAMING_ATTENTION_MODULE",
    "UPSTREAM_VERSION",
    "load_streaming_attention",
    "load_upstream_module",
    "upstream_available",
    "upstream_dir",
]

UPSTREAM_VERSION = "0.30.0"
"""The only vllm-omni release whose codec semantics this oracle encodes."""

_DIR_ENV = "MOSS_UPSTREAM_MOSS_TTS_DIR"
_PKG = "_moss_upstream_oracle_pkg"
_MODULE_FILES = ("audio_tokenizer", "audio_tokenizer_v2", "configuration_moss_audio_tokenizer_v2")
#: ``sys.modules`` name of the loaded ``streaming_attention.py``.
STREAMING_ATTENTION_MODULE = "_moss_upstream_streaming_attention"


def upstream_dir() -> Path | None:
    """Directory holding upstream's ``moss_tts`` codec files, or None when it cannot be found.

    The installed package is located with ``importlib.util.find_spec`` on the top-level name, which
    reads the spec without executing ``vllm_omni/__init__.py``. An installed vllm-omni of another
    release is rejected because the oracle encodes 0.30.0 behaviour (ring layout, offset bank).
    """
    override = os.environ.get(_DIR_ENV)
    if override:
        candidate = Path(override)
    else:
        try:
            spec = importlib.util.find_spec("vllm_omni")
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        if spec.submodule_search_locations:
            root = Path(next(iter(spec.submodule_search_locations)))
        elif spec.origin:
            root = Path(spec.origin).parent
        else:
            return None
        try:
            installed = importlib.metadata.version("vllm-omni")
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is not None and installed != UPSTREAM_VERSION:
            return None
        candidate = root / "model_executor" / "models" / "moss_tts"
    if all((candidate / f"{name}.py").is_file() for name in _MODULE_FILES):
        return candidate
    return None


def upstream_available() -> bool:
    """True when upstream 0.30.0's codec files are locatable and ``transformers`` imports."""
    if upstream_dir() is None:
        return False
    try:
        import transformers  # noqa: F401
        import transformers.modeling_utils  # noqa: F401
    except Exception:
        return False
    return True


def _ensure_package(directory: Path) -> types.ModuleType:
    # A synthetic parent package lets the v2 file's relative import of its configuration resolve
    # to our by-path copy instead of to ``vllm_omni.model_executor...`` (which would import vLLM).
    pkg = sys.modules.get(_PKG)
    if pkg is None:
        pkg = types.ModuleType(_PKG)
        pkg.__path__ = [str(directory)]
        pkg.__package__ = _PKG
        sys.modules[_PKG] = pkg
    return pkg


def load_upstream_module(name: str) -> types.ModuleType:
    """Load one of upstream's codec files by path (cached in ``sys.modules``).

    ``name`` is one of ``"audio_tokenizer"`` (v1), ``"audio_tokenizer_v2"`` or
    ``"configuration_moss_audio_tokenizer_v2"``. The modules are registered as
    ``_moss_upstream_oracle_pkg.<name>``.
    """
    if name not in _MODULE_FILES:
        raise ValueError(f"unknown upstream codec module {name!r}; expected one of {_MODULE_FILES}")
    qualified = f"{_PKG}.{name}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    directory = upstream_dir()
    if directory is None:
        raise RuntimeError(f"vllm-omni {UPSTREAM_VERSION} moss_tts files not found (set {_DIR_ENV}?)")

    import transformers.modeling_utils as modeling_utils

    # transformers releases without this base class still run the v2 file unchanged when it aliases
    # PreTrainedModel (the codec uses no audio-tokenizer-specific base behaviour).
    if not hasattr(modeling_utils, "PreTrainedAudioTokenizerBase"):
        modeling_utils.PreTrainedAudioTokenizerBase = modeling_utils.PreTrainedModel

    _ensure_package(directory)
    if name == "audio_tokenizer_v2":
        load_upstream_module("configuration_moss_audio_tokenizer_v2")
    spec = importlib.util.spec_from_file_location(qualified, directory / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot build an import spec for {directory / name}.py")
    module = importlib.util.module_from_spec(spec)
    module.__package__ = _PKG
    # Registered before execution: dataclasses resolve their module through sys.modules.
    sys.modules[qualified] = module
    captured = io.StringIO()
    try:
        # transformers' auto_docstring prints a "[ERROR] Config not found" line for files living
        # outside its own model tree; that is noise here, anything else is passed through.
        with contextlib.redirect_stdout(captured):
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(qualified, None)
        raise
    finally:
        for line in captured.getvalue().splitlines():
            if not line.startswith("[ERROR] Config not found for"):
                print(line)
    return module


def load_streaming_attention(directory: Path | None = None, stand_in: bool | None = None) -> types.ModuleType:
    """Load the wheel's ``streaming_attention.py`` by path, once per process (cached in ``sys.modules`` as
    :data:`STREAMING_ATTENTION_MODULE`); its ``masked_attention`` is upstream's Triton masked attention.

    The file takes ``triton`` and ``tl`` from ``vllm.triton_utils``. With ``stand_in`` True, or None (the
    default) on a machine without vLLM, stand-in ``vllm`` / ``vllm.triton_utils`` modules exposing the
    installed ``triton`` and ``triton.language`` are placed in ``sys.modules`` for the duration of the load
    only (never while a ``vllm`` module is imported already); otherwise vLLM's own module is imported.

    Args:
        directory: the ``moss_tts`` directory; default :func:`upstream_dir`.
        stand_in: see above.
    Raises:
        FileNotFoundError: no directory was found, or it has no ``streaming_attention.py``.
        ImportError: triton is not installed.
    """
    cached = sys.modules.get(STREAMING_ATTENTION_MODULE)
    if cached is not None:
        return cached
    directory = upstream_dir() if directory is None else Path(directory)
    if directory is None:
        raise FileNotFoundError(f"vllm-omni {UPSTREAM_VERSION} moss_tts files not found (set {_DIR_ENV}?)")
    path = directory / "streaming_attention.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (vLLM-Omni 0.30.0 ships it next to audio_tokenizer_v2.py)")
    if stand_in is None:
        stand_in = importlib.util.find_spec("vllm") is None
    stand_ins = _triton_utils_stand_ins() if stand_in else {}
    spec = importlib.util.spec_from_file_location(STREAMING_ATTENTION_MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot build an import spec for {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules.update(stand_ins)
    sys.modules[STREAMING_ATTENTION_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(STREAMING_ATTENTION_MODULE, None)
        raise
    finally:
        for name, stand_in_module in stand_ins.items():
            if sys.modules.get(name) is stand_in_module:
                del sys.modules[name]
    return module


def _triton_utils_stand_ins() -> dict[str, types.ModuleType]:
    # Empty while any vllm module is imported: the real one then serves the file's import.
    if "vllm" in sys.modules or "vllm.triton_utils" in sys.modules:
        return {}
    import triton
    import triton.language as tl

    utils = types.ModuleType("vllm.triton_utils")
    utils.triton, utils.tl = triton, tl
    parent = types.ModuleType("vllm")
    parent.__path__ = []  # a package, so that the submodule import resolves
    parent.triton_utils = utils
    return {"vllm": parent, "vllm.triton_utils": utils}
