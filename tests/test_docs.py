# SPDX-License-Identifier: Apache-2.0
"""docs/: every citation of a docs page resolves, and the numbers the pages state match the code."""

from __future__ import annotations

import ast
import builtins
import functools
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_omni_moss.model_executor.models.moss_tts.checkpoint import random_checkpoint_bytes, random_checkpoint_shapes
from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config

pytestmark = [pytest.mark.cpu]

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CITATION = re.compile(r"docs/([a-z_]+\.md)(?:#([a-z0-9-]+))?")


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.M)}


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    )
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / n for n in out.stdout.split() if n.endswith((".py", ".md", ".sh", ".yaml", ".toml"))]


def test_every_docs_citation_resolves():
    cited = 0
    for path in _tracked_text_files():
        if not path.is_file():
            continue
        for m in CITATION.finditer(path.read_text(encoding="utf-8")):
            page = DOCS / m.group(1)
            where = f"{path.relative_to(ROOT)} cites {m.group(0)}"
            assert page.is_file(), where
            assert m.group(2) is None or m.group(2) in _anchors(page), where
            cited += 1
    assert cited >= 5


def test_docs_are_self_contained():
    for page in DOCS.glob("*.md"):
        text = page.read_text(encoding="utf-8")
        assert "codec-facts" not in text and "shared/docs" not in text, page.name


def _text(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def test_memory_numbers_match_the_v2_geometry():
    cfg = preset_config("v2")
    text = _text("memory.md")
    for i, g in enumerate(cfg.groups):
        per_layer = g.ring_bytes(2) // g.num_layers
        row = f"| {i} | {g.num_layers} | {g.num_heads} | {g.ring_capacity} | {per_layer:,} | {g.ring_bytes(2):,} |"
        assert row in text
    slot = cfg.state_bytes_per_slot(2)
    assert f"**{slot:,} bytes = {slot / 2**20:.2f} MiB per v2 slot in bf16**" in text
    assert f"({cfg.state_bytes_per_slot(4):,} bytes in fp32)" in text
    v1 = preset_config("v1")
    assert f"{v1.state_bytes_per_slot(2):,} bytes in bf16 and {v1.state_bytes_per_slot(4):,} bytes in fp32" in text
    for n in (32, 64, 128, 256):
        legacy, compact = 2 * n * slot, (n + 1) * slot
        row = (
            f"| {n} | {2 * n} | {legacy:,} B ({legacy / 2**30:.2f} GiB) | {n + 1} | "
            f"{compact:,} B ({compact / 2**30:.2f} GiB) | {(legacy - compact) / 2**30:.2f} GiB |"
        )
        assert row in text
    rows = 2 * cfg.num_layers + len(cfg.groups)
    assert f"`R = 2 x {cfg.num_layers} + {len(cfg.groups)} = {rows}` rows" in text
    assert f"`{rows} x 256 x 8 = {rows * 256 * 8:,}` bytes" in text
    assert f"`R = {v1.num_layers}` rows" in text


def test_architecture_table_matches_the_v2_preset():
    cfg = preset_config("v2")
    text = _text("codec_architecture.md")
    rate = cfg.frame_rate
    for i, g in enumerate(cfg.groups):
        tokens_per_s = rate * g.tokens_per_frame
        duration = g.ring_capacity / tokens_per_s
        row = (
            f"| {i} | `decoder.{g.index}` | {g.input_dim} -> {g.d_model} -> {g.output_dim} | {g.num_layers} | "
            f"{g.num_heads} x {g.head_dim} | {g.dim_feedforward} | {tokens_per_s:g} | {duration:g} s | {g.ring_capacity} | "
            f"{g.tokens_per_frame} | x{g.upsample} |"
        )
        assert row in text
    assert cfg.num_layers == 92 and cfg.samples_per_frame == 3840 and "**3840 samples per channel**" in text
    assert [g.ring_capacity for g in preset_config("v1").groups] == [125, 250, 500, 1000]
    assert "rings of 125, 250, 500 and 1000 tokens" in text


def test_checkpoint_sizes_match_the_random_writer():
    cfg = preset_config("v2")
    params: dict[str, int] = {}
    for name, shape in random_checkpoint_shapes(cfg):
        params[name.split(".")[0]] = params.get(name.split(".")[0], 0) + math.prod(shape)
    text = _text("checkpoint.md")
    total = random_checkpoint_bytes(cfg)
    assert f"is {total:,} bytes of\ntensors ({total // 4:,} parameters" in text
    assert f"encoder and decoder {params['decoder']:,} each, quantizer {params['quantizer']:,})" in text
    assert params["encoder"] == params["decoder"]


#: A backticked span the glossary gives as code: a name, ``Class.attr`` / ``module.name``, a call or subscript of
#: one (``stats()["preemptions"]``, ``valid_rows[b]``), or a module path (``serving/requests.py``).
CODE_SPAN = re.compile(r"`([A-Za-z_][A-Za-z0-9_.]*)(?:[(\[][^`]*)?`|`((?:[a-z_]+/)*[a-z_]+\.py)`")
CODEC = ROOT / "vllm_omni_moss" / "model_executor" / "models" / "moss_tts"


def _bound_names(node: ast.AST) -> set[str]:
    """Identifiers ``node`` binds or spells: definitions, arguments, assignment targets (names and
    attributes), imports, keywords, and string constants that are identifiers (option names, kinds)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.arg):
        return {node.arg}
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        return {node.id}
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        return {node.attr}
    if isinstance(node, ast.alias):
        return {(node.asname or node.name).split(".")[0]}
    if isinstance(node, ast.keyword) and node.arg:
        return {node.arg}
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
        return {node.value}
    return set()


@functools.cache
def _code_index() -> tuple[set[str], dict[str, set[str]], dict[str, set[str]]]:
    """``(names, members, modules)`` of the package: every identifier it binds or spells; per class its
    members (own body, ``self.x`` assignments, and those of its bases in the package); per module stem (a
    package's directory name for its ``__init__``) the names bound at its top level."""
    names: set[str] = set()
    own: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    modules: dict[str, set[str]] = {}
    for path in sorted((ROOT / "vllm_omni_moss").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        stem = path.parent.name if path.name == "__init__.py" else path.stem
        top = modules.setdefault(stem, set())
        for node in tree.body:
            for sub in [node, *(getattr(node, "names", None) or [])]:
                top |= _bound_names(sub)
            for target in getattr(node, "targets", [getattr(node, "target", None)]):
                top |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)} if target else set()
        for node in ast.walk(tree):
            names |= _bound_names(node)
            if isinstance(node, ast.ClassDef):
                body = {n for child in node.body for sub in ast.walk(child) for n in _bound_names(sub)}
                own.setdefault(node.name, set()).update(body)
                bases.setdefault(node.name, []).extend(ast.unparse(b).split(".")[-1] for b in node.bases)
    members = {}
    for cls in own:
        seen, todo = set(), [cls]
        while todo:
            c = todo.pop()
            if c in own and c not in seen:
                seen.add(c)
                todo += bases[c]
        members[cls] = set().union(*(own[c] for c in seen))
    return names, members, modules


def glossary_code_names_missing(text: str) -> list[str]:
    """The code names of glossary ``text`` (:data:`CODE_SPAN`) the package does not have: a name it never
    binds or spells; ``Class.attr`` where the class has no such member; ``module.name`` where the module binds
    no such name at its top level; ``variable.attr`` where no class has the attribute; a ``.py`` path that is
    no module of the codec package. Names of one or two characters are the glossary's notation (``B``, ``Dh``,
    ``p``), and Python's builtins (``min(...)``) its arithmetic."""
    names, members, modules = _code_index()
    attrs = set().union(*members.values())
    missing = []
    for match in CODE_SPAN.finditer(text):
        name, path = match.groups()
        path = name if name and name.endswith(".py") else path
        if path is not None:
            if not (CODEC / path).is_file():
                missing.append(path)
            continue
        first, *rest = name.split(".")
        if len(name) <= 2 or hasattr(builtins, name) or name.endswith((".json", ".yaml", ".md")):
            continue
        if not rest:
            found = name in names
        elif first in members:
            found = rest[0] in members[first]
        elif first in modules:
            found = rest[0] in modules[first] or rest[0] in attrs
        else:
            found = first in names and rest[0] in attrs
        if not found:
            missing.append(name)
    return sorted(set(missing))


def test_glossary_names_exist_in_the_code():
    """Every code name the glossary gives (names, ``Class.attr``, calls, module paths) is in the package."""
    text = _text("glossary.md")
    spans = {m.group(1) or m.group(2) for m in CODE_SPAN.finditer(text)}
    assert {"CompactDecoderStatePool.null_slot", "DecoderStatePool.reserve", "serving/streams.py"} <= spans
    assert glossary_code_names_missing(text) == []


def test_the_glossary_check_reports_names_the_code_lacks():
    """Negative control: names, members, module names and paths the package lacks are each reported."""
    text = (
        "Code: `NoSuchPool`, `CompactDecoderStatePool.no_such_member`, `Stream.frames_decoded` (a field),\n"
        "`DecoderStatePool.null_slot` (a subclass's member), `state.NO_SUCH_TABLE`, `state.POOL_KINDS`,\n"
        '`pool.no_such_attribute`, `pool.rings`, `no_such_call(x)`, `no_such_rows[b]`, `stats()["preemptions"]`,\n'
        "`serving/no_such.py`, `serving/streams.py`, `no_such.py`, `decoder.py`, `codec_pool_kind` (an option\n"
        "name), `B`, `min(a, b)`."
    )
    assert glossary_code_names_missing(text) == [
        "CompactDecoderStatePool.no_such_member",
        "DecoderStatePool.null_slot",
        "NoSuchPool",
        "no_such.py",
        "no_such_call",
        "no_such_rows",
        "pool.no_such_attribute",
        "serving/no_such.py",
        "state.NO_SUCH_TABLE",
    ]


def test_glossary_is_linked_from_readme_and_the_pages_that_use_its_terms():
    assert "[glossary](docs/glossary.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
    for page in ("ring_semantics.md", "memory.md", "serving.md", "serving_stage.md", "codec_architecture.md"):
        assert "[glossary](glossary.md)" in _text(page), page
    terms = [t.lower() for t in re.findall(r"^- \*\*([^*]+?)\.?\*\*", _text("glossary.md"), re.M)]
    assert len(terms) == len(set(terms))
    assert set(terms) >= {
        "frame",
        "codebook",
        "chunk",
        "piece",
        "step",
        "row",
        "padding row",
        "padding frame",
        "valid frames",
        "slot",
        "null slot",
        "ring",
        "ring capacity",
        "window",
        "token offset",
        "frames decoded",
        "resolution group",
        "tokens per frame",
        "page",
        "page size",
        "page table",
        "null page",
        "step shape",
        "frame size",
        "graph ladder",
        "ring semantics",
        "state spec",
        "pool kind",
        "attention backend",
        "stream",
        "request id",
        "admission queue",
        "waiting stream",
        "preemption",
        "reserve",
        "state budget",
    }


#: The terms README's first screen and the main job's tables use (issue 51): each has a glossary entry.
BENCHMARK_TERMS = {"main job", "arm", "load", "slo", "talker rtf", "ttfp", "underrun", "c100", "audio-s/s", "b x t"}


def test_glossary_defines_the_benchmark_terms_readme_uses_before_it_uses_them():
    text = _text("glossary.md")
    terms = {t.lower() for t in re.findall(r"^- \*\*([^*]+?)\.?\*\*", text, re.M)}
    assert BENCHMARK_TERMS <= terms, sorted(BENCHMARK_TERMS - terms)
    assert "\n## Benchmarks and serving\n" in text  # the anchor README links to
    entries = dict(re.findall(r"^- \*\*([^*]+?)\.?\*\*(.*?)(?=^- \*\*|^## |\Z)", text, re.M | re.S))
    assert "150 ms" in entries["SLO"] and "unknown, never a pass" in entries["SLO"]
    assert "C100 is vLLM-Omni's" in entries["C100"] and "B128/T15" in entries["B x T"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    intro, _, rest = readme.partition("```bash\n")
    # One sentence on what the project is, and the glossary link, before the two commands, which stay first.
    assert intro.startswith("# vllm-omni-moss\n\nA plugin that gives vLLM-Omni 0.30.0 a faster MOSS-TTS codec stage")
    assert "[glossary](docs/glossary.md#benchmarks-and-serving)" in intro and "```" not in intro
    commands = [line.split("#")[0].strip() for line in rest.split("```")[0].splitlines()]
    assert commands == [
        "bash scripts/install.sh && .venv/bin/python benchmarks/tts/bench_codec_stage.py",
        "bash scripts/install.sh --vllm && bash scripts/test.sh",
    ]


def test_readme_states_the_suites_figures_with_their_commit_and_no_stale_ones():
    """The developer-install section gives the CPU suite's counts and seconds at a named commit, and the first
    screen the second command's duration; none of the figures an older suite had is left."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.search(
        r"At `[0-9a-f]{7}` \([^)]*2 cores[^)]*\)\s+`bash scripts/test\.sh` ran [\d,]+ tests passed and \d+ skipped in [\d,]+ s",
        readme,
    )
    assert re.search(
        r"The second command's tests take about \d+ minutes on two idle\s+cores", "\n".join(readme.splitlines()[:45])
    )
    for stale in ("1,085 passed", "14 skipped", "726 s", "207 s", "231 s", "<!-- suite-figures -->"):
        assert stale not in readme, stale


def test_readme_fork_table_names_every_file_patch_0003_leaves_out():
    """The build leaves out any test or benchmark whose code still names the plugin after the rewrite
    (``scripts/fork/build_fork.py``, ``plugin_code_references``); README's row of patch 0003 names each."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_fork_for_docs", ROOT / "scripts" / "fork" / "build_fork.py")
    build_fork = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = build_fork  # dataclasses look their module up while the class is built
    spec.loader.exec_module(build_fork)
    left_out = []
    for folder in (build_fork.TESTS_SRC, build_fork.BENCH_SRC):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = build_fork.rewrite_text(path.read_text(encoding="utf-8"))
            if build_fork.plugin_code_references(text, path.name):
                left_out.append(path.relative_to(ROOT).as_posix())
    assert "benchmarks/tts/bench_chunker.py" in left_out
    row = next(
        line for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines() if line.startswith("| 0003 |")
    )
    assert [p for p in left_out if f"`{p}`" not in row] == []
