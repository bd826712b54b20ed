# SPDX-License-Identifier: Apache-2.0
"""The package's layout rules: the core imports no vLLM, and no module, class or function outgrows its bound.

Bounds (the structure the package keeps, docs/layout.md): a module of ``vllm_omni_moss/`` at most 600 lines, a
class at most 320, a function at most 60 (``@triton.jit`` kernels excepted: a kernel is one launch and reads
best whole).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu]

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_omni_moss"
CODEC = PACKAGE / "model_executor" / "models" / "moss_tts"
#: The modules that import vLLM or vLLM-Omni: the vLLM model contract and vLLM's compile decorator.
VLLM_MODULES = {"stage.py", "talker_chunker.py", "vllm_compile.py"}
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 600, 320, 60


def _core_modules() -> list[str]:
    names = []
    for path in sorted(CODEC.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        if path.name in VLLM_MODULES and path.parent == CODEC:
            continue
        names.append(".".join(rel.parts).removesuffix(".__init__"))
    return names


def test_the_core_imports_without_vllm():
    """Every codec module but the stage, its compile wrapper and the talker chunker imports in a process where
    ``vllm`` and ``vllm_omni`` cannot be imported at all (the GPU machine has torch and no vLLM)."""
    code = (
        "import importlib, sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('vllm', 'vllm_omni'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for name in {_core_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        "print('imported', len(sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("imported")


def test_the_stage_module_is_the_one_that_needs_vllm():
    """The blocker of the test above is real: the stage module does not import without vLLM."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('vllm', 'vllm_omni'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import vllm_omni_moss.model_executor.models.moss_tts.stage\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "blocked: vllm" in proc.stderr


def _is_kernel(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def _oversized() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT).as_posix()
        if len(text.splitlines()) > MODULE_LINES:
            found.append(f"{rel}: {len(text.splitlines())} lines > {MODULE_LINES}")
        for node in ast.walk(ast.parse(text)):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and size > CLASS_LINES:
                found.append(f"{rel}:{node.lineno} class {node.name}: {size} lines > {CLASS_LINES}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > FUNCTION_LINES:
                if not _is_kernel(node):
                    found.append(f"{rel}:{node.lineno} {node.name}(): {size} lines > {FUNCTION_LINES}")
    return found


def test_no_module_class_or_function_outgrows_its_bound():
    assert _oversized() == []
