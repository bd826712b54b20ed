# SPDX-License-Identifier: Apache-2.0
"""The package's layout rules: the core imports no vLLM, no module, class or function outgrows its bound,
and no module imports another's private name.

Bounds (the structure the package keeps, docs/layout.md): a module of ``vllm_omni_moss/`` at most 900 lines, a
class at most 400, a function at most 60. Only ``@triton.jit`` kernels are exempt from the function bound (a
kernel is one launch and reads best whole): the decorator ``triton.jit`` or ``triton.jit(...)``, or a ``jit``
imported from ``triton``; ``torch.jit.script`` and other decorators named ``jit`` are not. A private name
(``_x``, not a dunder) is imported by no module of the package (``from .m import _x``, ``from pkg.m import _x``):
what several modules share is public. Each rule has a negative control: the checker is fed sources that break
it and must report them.
"""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

# core_model: the Buildkite L1 CPU step selects ``-m "core_model and cpu" --run-level core_model``.
pytestmark = [pytest.mark.cpu, pytest.mark.core_model]

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_omni_moss"
CODEC = PACKAGE / "model_executor" / "models" / "moss_tts"
#: The modules that import vLLM or vLLM-Omni: the vLLM model contract and vLLM's compile decorator.
VLLM_MODULES = {"stage.py", "talker_chunker.py", "vllm_compile.py"}
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 900, 400, 60


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


# ------------------------------------------------------------------------------------------------ checkers


def _triton_jit_names(tree: ast.Module) -> set[str]:
    """Local names bound to ``triton.jit`` by ``from triton import jit [as name]``."""
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "triton" and node.level == 0
        for alias in node.names
        if alias.name == "jit"
    }


def _is_triton_kernel(node: ast.FunctionDef, jit_names: set[str]) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target) == "triton.jit" or (isinstance(target, ast.Name) and target.id in jit_names):
            return True
    return False


def layout_findings(rel: str, text: str) -> list[str]:
    """What breaks the bounds or imports a private name in the module ``rel`` of source ``text``: one line
    per finding, ``"<rel>[:<line>] <what>"``; empty when the module keeps every rule."""
    tree = ast.parse(text)
    jit_names = _triton_jit_names(tree)
    found = []
    if len(text.splitlines()) > MODULE_LINES:
        found.append(f"{rel}: {len(text.splitlines())} lines > {MODULE_LINES}")
    for node in ast.walk(tree):
        size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.ClassDef) and size > CLASS_LINES:
            found.append(f"{rel}:{node.lineno} class {node.name}: {size} lines > {CLASS_LINES}")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > FUNCTION_LINES:
            if not (isinstance(node, ast.FunctionDef) and _is_triton_kernel(node, jit_names)):
                found.append(f"{rel}:{node.lineno} {node.name}(): {size} lines > {FUNCTION_LINES}")
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                private = alias.name.startswith("_") and not (alias.name.startswith("__") and alias.name.endswith("__"))
                if private:
                    module = "." * node.level + (node.module or "")
                    found.append(f"{rel}:{node.lineno} imports the private name {alias.name} from {module}")
    return found


def test_no_module_class_or_function_outgrows_its_bound_and_no_private_name_is_imported():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += layout_findings(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))
    assert found == []


#: What the decoder state (``state/``) never imports: the pool is memory, and the step that runs over it (the
#: decoder, the attention and its step plan, the ops, the step metadata) is chosen where the step runs.
STATE_FORBIDDEN = ("decoder", "attention", "ops", "step_metadata", "step")
STATE = PACKAGE / "model_executor" / "models" / "moss_tts" / "state"


def state_import_findings(rel: str, text: str) -> list[str]:
    """The imports of the ``state/`` module ``rel`` (source ``text``) that reach a module of
    :data:`STATE_FORBIDDEN` or below it, relative (``from ..ops.x import y``, ``from .. import attention``) or
    absolute (``import vllm_omni_moss.model_executor.models.moss_tts.step``): one line per import."""
    package = "vllm_omni_moss.model_executor.models.moss_tts."
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                targets = [node.module or ""]
            elif node.level == 2:
                base = package + (node.module + "." if node.module else "")
                targets = [base + alias.name if not node.module else base.rstrip(".") for alias in node.names]
            else:
                continue  # within state/
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            if not target.startswith(package):
                continue
            top = target[len(package) :].split(".")[0]
            if top in STATE_FORBIDDEN:
                found.append(f"{rel}:{node.lineno} imports {top}")
    return found


def test_the_state_imports_no_decoder_attention_op_step_metadata_or_step():
    found = []
    for path in sorted(STATE.rglob("*.py")):
        found += state_import_findings(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))
    assert found == []


# ------------------------------------------------------------------------------------------ negative control


def _function(name: str, lines: int, decorator: str | None = None) -> str:
    """Source of a function ``name`` of exactly ``lines`` lines (its decorator excluded)."""
    head = [f"@{decorator}"] if decorator else []
    body = [f"    x{i} = {i}" for i in range(lines - 2)]
    return "\n".join([*head, f"def {name}():", *body, "    return 0"]) + "\n"


def _class(name: str, lines: int) -> str:
    """Source of a class ``name`` of exactly ``lines`` lines, all attributes (no function in it)."""
    return "\n".join([f"class {name}:", *(f"    x{i} = {i}" for i in range(lines - 1))]) + "\n"


def test_the_checker_reports_each_broken_rule():
    """Synthetic sources one line past each bound, and private imports, are each reported; sources at
    the bounds, ``@triton.jit`` kernels in all three spellings and dunder imports are not."""
    fit = _function("fits", 60) + _class("Fits", 400)
    fit += "\n" * (MODULE_LINES - len(fit.splitlines()))
    assert len(fit.splitlines()) == MODULE_LINES
    assert layout_findings("fit.py", fit) == []

    source = (
        "import torch\n"
        "import triton\n"
        "from triton import jit as triton_jit\n"
        "from .m import _hidden, public, __version__\n"
        "from vllm_omni_moss.model_executor import _private_name\n"
        "from . import _private_module\n"
        + _function("too_long", 61)  # lines 7-67
        + _class("TooLong", 401)  # 68-468
        + _function("scripted", 61, "torch.jit.script")  # 469-530
        + _function("other_jit", 61, "numba.jit")  # 531-592
        + _function("kernel", 61, "triton.jit")
        + _function("kernel_call", 61, "triton.jit(do_not_specialize=['n'])")
        + _function("kernel_imported", 61, "triton_jit")
    )
    source += "\n" * (MODULE_LINES + 1 - len(source.splitlines()))
    assert layout_findings("bad.py", source) == [
        "bad.py: 901 lines > 900",
        "bad.py:4 imports the private name _hidden from .m",
        "bad.py:5 imports the private name _private_name from vllm_omni_moss.model_executor",
        "bad.py:6 imports the private name _private_module from .",
        "bad.py:7 too_long(): 61 lines > 60",
        "bad.py:68 class TooLong: 401 lines > 400",
        "bad.py:470 scripted(): 61 lines > 60",
        "bad.py:532 other_jit(): 61 lines > 60",
    ]


def test_the_state_import_checker_reports_each_forbidden_import():
    """Each forbidden module is reported however it is imported; the state's own modules, the package's plain
    modules (checks, config, pool_kinds, backends), torch and a name merely starting like a forbidden one are not."""
    source = (
        "import torch\n"
        "from ..attention import plan_builder\n"
        "from ..ops.ring_write import RING_DTYPES\n"
        "from .. import decoder, step_metadata\n"
        "from ..step import decode_batch\n"
        "import vllm_omni_moss.model_executor.models.moss_tts.ops.dispatch\n"
        "from vllm_omni_moss.model_executor.models.moss_tts.attention import step_plan\n"
        "from ..checks import check_count\n"
        "from ..config import check_ring_semantics\n"
        "from ..backends import RING_DTYPES\n"
        "from ..pool_kinds import POOL_KINDS\n"
        "from ..step_inputs_like import x\n"
        "from .spec import StateSpec\n"
        "from . import offsets\n"
    )
    assert state_import_findings("state/bad.py", source) == [
        "state/bad.py:2 imports attention",
        "state/bad.py:3 imports ops",
        "state/bad.py:4 imports decoder",
        "state/bad.py:4 imports step_metadata",
        "state/bad.py:5 imports step",
        "state/bad.py:6 imports ops",
        "state/bad.py:7 imports attention",
    ]


def test_the_buildkite_l1_cpu_step_selects_this_file():
    """The L1 CPU step's own pytest arguments (``.buildkite/pipeline.yml``) collect every test here."""
    steps = yaml.safe_load((ROOT / ".buildkite" / "pipeline.yml").read_text(encoding="utf-8"))["steps"]
    (command,) = [c for s in steps if s.get("key") == "l1-cpu" for c in s["commands"] if "run_pytest.sh" in c]
    args = shlex.split(command)[2:]  # after "bash .buildkite/run_pytest.sh"
    assert args[0] == "tests"
    here = Path(__file__).relative_to(ROOT).as_posix()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", here, *args[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    collected = {line.split("::")[1] for line in proc.stdout.splitlines() if line.startswith(f"{here}::")}
    tests = {name for name, value in globals().items() if name.startswith("test_") and callable(value)}
    assert collected == tests
