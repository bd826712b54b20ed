# SPDX-License-Identifier: Apache-2.0
"""Build the fork form of vllm-omni-moss: a patch series over vLLM-Omni 0.30.0 and a patched wheel.

Run through ``scripts/build_fork.sh`` (see ``--help``). The published ``vllm-omni==0.30.0`` wheel is
unpacked with the ``wheel`` package and committed as the base of a scratch git repository; three
commits follow, each reviewable on its own:

1. the codec core and ops: every file of ``vllm_omni_moss/model_executor/models/moss_tts/`` except the
   stage module, copied to ``vllm_omni/model_executor/models/moss_tts/`` with imports rewritten;
2. the stage: the module defining ``MossTTSCodecDecoder``, the ``MossTTSCodecDecoder`` entry of
   ``vllm_omni/model_executor/models/registry.py`` pointed at it (one line), and the upstream modules
   whose role the new code takes over removed (``SUPERSEDED``);
3. the tests (``tests/model_executor/models/moss_tts/``), the benchmarks (``benchmarks/tts/``) and,
   when the package has one, ``vllm_omni_moss/testing/``.

Outputs, in ``--out`` (default ``dist/fork``): ``patches/000N-*.patch`` (``git format-patch``),
``vllm_omni-0.30.0-<build tag>-py3-none-any.whl`` (the tree after all commits, without the top-level
``tests/`` and ``benchmarks/``, packed with ``wheel pack``) and ``manifest.json`` (what went where).

The base is the published wheel and nothing else: its sha256 is pinned in ``vllm_omni-0.30.0.sha256`` next to
this file (the digest PyPI lists for ``vllm_omni-0.30.0-py3-none-any.whl``; check a download by hand with
``sha256sum -c``), and a ``--wheel`` (or a download) with another digest is refused, however consistent its
``RECORD``.

Facts about the base (read from the 0.30.0 wheel): the codec stage is ``MossTTSCodecDecoder`` in
``moss_tts/modeling_moss_tts_codec.py``, registered in ``registry.py`` as the tuple
``("moss_tts", "modeling_moss_tts_codec", "MossTTSCodecDecoder")``; only that module imports
``cuda_graph_streaming_decoder_wrapper.py``, ``moss_codec_cudagraph.py`` and ``streaming_attention.py``;
``audio_tokenizer.py``, ``audio_tokenizer_v2.py`` and ``configuration_moss_audio_tokenizer_v2.py`` also
hold the codec encoders, which this project does not reimplement, so they stay. No file of the wheel
reads ``VLLM_OMNI_MOSS_CODEC_SHARED_KV``; the build fails if one of the fork's would.

Exit status 2 with a one-line ``build_fork: error: ...`` message for every refused input.
"""

from __future__ import annotations

import argparse
import ast
import email.parser
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

UPSTREAM_NAME = "vllm-omni"
UPSTREAM_VERSION = "0.30.0"
DEFAULT_BUILD_TAG = "1moss"
UPSTREAM_WHEEL = f"vllm_omni-{UPSTREAM_VERSION}-py3-none-any.whl"
#: ``<sha256>  <file name>`` of the published wheel (``sha256sum`` format).
PINNED_SHA256_FILE = Path(__file__).resolve().parent / f"vllm_omni-{UPSTREAM_VERSION}.sha256"
SIGN_OFF = "Signed-off-by: vllm-omni-moss developers <dev@vllm-omni-moss.invalid>"
AUTHOR_NAME = "vllm-omni-moss developers"
AUTHOR_EMAIL = "dev@vllm-omni-moss.invalid"

ARCHITECTURE = "MossTTSCodecDecoder"
OLD_ENV_VAR = "VLLM_OMNI_MOSS_CODEC_SHARED_KV"
FORK_PKG = "vllm_omni/model_executor/models/moss_tts"
FORK_MODULE = "vllm_omni.model_executor.models.moss_tts"
REGISTRY = "vllm_omni/model_executor/models/registry.py"
UPSTREAM_STAGE_MODULE = "modeling_moss_tts_codec"
# Custom-op namespace in the fork: the plugin's ``vllm_omni_moss`` would clash with the plugin itself
# when both are importable in one process.
FORK_OP_NAMESPACE = "moss_tts_codec"

# Upstream moss_tts modules removed in commit 2, each with the module(s) of ours that take over its role.
SUPERSEDED = {
    "modeling_moss_tts_codec.py": "the stage module (Stage-1 class), serving/ (stream session), "
    "state/ (decoder state pool)",
    "cuda_graph_streaming_decoder_wrapper.py": "cuda_graph.py and compile.py (graph runner, compiled adapters)",
    "moss_codec_cudagraph.py": "cuda_graph.py (graph capture and replay)",
    "streaming_attention.py": "decoder.py and step_metadata.py (ring attention and its metadata)",
}

# Where each part of the plugin repository goes in the fork (source relative to the repository root).
PACKAGE_SRC = "vllm_omni_moss/model_executor/models/moss_tts"
TESTING_SRC = "vllm_omni_moss/testing"
TESTING_DST = f"{FORK_PKG}/testing"
TESTS_SRC = "tests/model_executor/models/moss_tts"
BENCH_SRC = "benchmarks/tts"
# Plugin-only files: the registry entry of commit 2 replaces the entry point, the fork has its own
# package ``__init__`` files.
PLUGIN_ONLY = {
    "vllm_omni_moss/__init__.py",
    "vllm_omni_moss/plugin.py",
    "vllm_omni_moss/model_executor/__init__.py",
    "vllm_omni_moss/model_executor/models/__init__.py",
}
CONFTEST_ADDENDUM = Path(__file__).resolve().parent / "conftest_addendum.py"
# The keys of the manifest.json a build writes: ``--force`` replaces only a directory holding one.
MANIFEST_KEYS = (
    "base_wheel",
    "source_revision",
    "wheel",
    "build_tag",
    "patches",
    "base_tree",
    "head_tree",
    "stage_class",
    "op_namespace",
    "added",
    "kept_upstream",
    "removed_upstream",
    "left_out",
    "warnings",
)
_OUTPUT_WHEEL = re.compile(rf"vllm_omni-{re.escape(UPSTREAM_VERSION)}-[0-9][0-9A-Za-z_.]*-py3-none-any\.whl")
_OUTPUT_PATCH = re.compile(r"[0-9]{4}-[^/]*\.patch")

_REWRITES = (
    # Module paths, dotted and slashed: the plugin's model_executor tree sits at the same place in vllm_omni.
    (re.compile(r"\bvllm_omni_moss([./])testing\b"), lambda m: TESTING_DST.replace("/", m.group(1))),
    (re.compile(r"\bvllm_omni_moss([./])model_executor\b"), lambda m: f"vllm_omni{m.group(1)}model_executor"),
    # Custom-op namespace: definitions ("ns::op"), calls (torch.ops.ns.op) and the docstring naming it.
    (re.compile(r"\bvllm_omni_moss(?=::)"), lambda m: FORK_OP_NAMESPACE),
    (re.compile(r"\btorch\.ops\.vllm_omni_moss\b"), lambda m: f"torch.ops.{FORK_OP_NAMESPACE}"),
    (re.compile(r"(namespace\s+``)vllm_omni_moss(``)"), lambda m: f"{m.group(1)}{FORK_OP_NAMESPACE}{m.group(2)}"),
)
_PLUGIN_WORD = re.compile(r"\bvllm_omni_moss\b")
_SKIP_PARTS = {"__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache"}


class BuildError(Exception):
    """A refused input or an unexpected base: reported as one line, exit status 2."""


def pinned_sha256() -> str:
    """The published wheel's sha256 from :data:`PINNED_SHA256_FILE`.

    Raises:
        BuildError: the file is missing or does not hold one ``<64 hex digits>  <wheel name>`` line.
    """
    try:
        text = PINNED_SHA256_FILE.read_text(encoding="utf-8")
    except OSError as exc:
        raise BuildError(f"cannot read the pinned sha256 of {UPSTREAM_WHEEL}: {exc}") from None
    m = re.fullmatch(rf"([0-9a-f]{{64}})  {re.escape(UPSTREAM_WHEEL)}\n?", text)
    if m is None:
        raise BuildError(f"{PINNED_SHA256_FILE} must hold one line '<sha256>  {UPSTREAM_WHEEL}'")
    return m.group(1)


@dataclass
class Plan:
    """What the build decided, per file; written to ``manifest.json``."""

    added: dict[str, list[str]] = field(default_factory=dict)  # commit title -> fork paths
    removed_upstream: dict[str, str] = field(default_factory=dict)  # fork path -> role taken over by
    kept_upstream: list[str] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)  # source path -> reason
    warnings: list[str] = field(default_factory=list)
    stage_class: str = ""


# --------------------------------------------------------------------------------------------- input


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check_wheel(path: Path) -> dict[str, str]:
    """Validate that ``path`` is the published pure-Python vllm-omni 0.30.0 wheel, byte for byte.

    Returns:
        ``{"name", "version", "sha256"}``: name and version from the wheel's ``.dist-info/METADATA``.

    Raises:
        BuildError: missing file, not a wheel (no zip, no ``.whl`` name, no ``*.dist-info/WHEEL``), another
            project, another version, a platform-specific build, or (whatever it claims to be) a sha256 other
            than the pinned one (:func:`pinned_sha256`): an altered, rebuilt or corrupted wheel.
    """
    if not path.is_file():
        raise BuildError(f"wheel not found: {path}")
    if path.suffix != ".whl" or not zipfile.is_zipfile(path):
        raise BuildError(f"{path} is not a wheel (expected a {UPSTREAM_NAME}=={UPSTREAM_VERSION} .whl zip archive)")
    expected = pinned_sha256()
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    sha = digest.hexdigest()
    # Another project or version is named as such; anything else that is not the pinned file (a member
    # altered, its RECORD rewritten to match, a corrupted member) is refused by its digest.
    name, version = _claimed(path, sha == expected)
    if sha != expected:
        raise BuildError(
            f"{path}: sha256 {sha}, expected {expected} (the published {UPSTREAM_WHEEL}); refusing any other file"
        )
    return {"name": name, "version": version, "sha256": sha}


def _claimed(path: Path, pinned: bool) -> tuple[str, str]:
    """The name and version that ``path``'s metadata claims, when they are not vllm-omni 0.30.0 (a BuildError
    naming them); a wheel whose metadata cannot be read is left to the digest check unless it is ``pinned``."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            dist_infos = sorted({n.split("/", 1)[0] for n in names if re.match(r"[^/]+\.dist-info/WHEEL$", n)})
            if len(dist_infos) != 1 or f"{dist_infos[0]}/METADATA" not in names:
                raise BuildError(f"{path} is not a wheel: no single *.dist-info/ with WHEEL and METADATA")
            meta = email.parser.Parser().parsestr(archive.read(f"{dist_infos[0]}/METADATA").decode("utf-8"))
            wheel_meta = email.parser.Parser().parsestr(archive.read(f"{dist_infos[0]}/WHEEL").decode("utf-8"))
    except (zipfile.BadZipFile, UnicodeDecodeError, zlib.error, EOFError, OSError) as exc:
        if not pinned:
            return "", ""
        raise BuildError(f"{path} is not a readable wheel: {exc}") from exc
    name, version = meta.get("Name", ""), meta.get("Version", "")
    if _normalize(name) != UPSTREAM_NAME:
        raise BuildError(
            f"{path} is a wheel of {name!r}, not {UPSTREAM_NAME}; the fork patches target {UPSTREAM_NAME} {UPSTREAM_VERSION}"
        )
    if version != UPSTREAM_VERSION:
        raise BuildError(
            f"{path} is {UPSTREAM_NAME} {version}; the fork patches target {UPSTREAM_NAME} {UPSTREAM_VERSION} "
            f"(pass the {UPSTREAM_VERSION} wheel, or none to download it)"
        )
    pure = wheel_meta.get("Root-Is-Purelib", "").strip().lower() == "true"
    if not pure or "py3-none-any" not in wheel_meta.get_all("Tag", []):
        raise BuildError(f"{path} is not the pure-Python (py3-none-any) {UPSTREAM_NAME} {UPSTREAM_VERSION} wheel")
    return name, version


def download_wheel(dest: Path) -> Path:
    """``pip download --no-deps`` the published wheel into ``dest``.

    Raises:
        BuildError: pip failed (no network, no index) or produced no wheel.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
    cmd += ["-d", str(dest), f"{UPSTREAM_NAME}=={UPSTREAM_VERSION}"]
    print(f"build_fork: downloading {UPSTREAM_NAME}=={UPSTREAM_VERSION} (pip download --no-deps)", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("vllm_omni-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise BuildError(f"pip download {UPSTREAM_NAME}=={UPSTREAM_VERSION} failed: {tail[0]} (pass --wheel PATH)")
    return wheels[0]


# --------------------------------------------------------------------------------------------- git


class Repo:
    """The scratch repository: fixed identity and dates; no user or system config, hooks or signing."""

    _CONFIG = ("-c", "init.defaultBranch=main", "-c", "core.autocrlf=false", "-c", "commit.gpgsign=false")

    def __init__(self, path: Path, epoch: int):
        self.path = path
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        self.env.update(
            GIT_CONFIG_GLOBAL=os.devnull,
            GIT_CONFIG_NOSYSTEM="1",
            GIT_AUTHOR_NAME=AUTHOR_NAME,
            GIT_AUTHOR_EMAIL=AUTHOR_EMAIL,
            GIT_COMMITTER_NAME=AUTHOR_NAME,
            GIT_COMMITTER_EMAIL=AUTHOR_EMAIL,
            GIT_AUTHOR_DATE=f"@{epoch} +0000",
            GIT_COMMITTER_DATE=f"@{epoch} +0000",
        )

    def git(self, *args: str, stdin: str | None = None) -> str:
        proc = subprocess.run(
            ["git", *self._CONFIG, *args], cwd=self.path, env=self.env, input=stdin, capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise BuildError(f"git {' '.join(args[:2])} failed: {(proc.stderr or proc.stdout).strip()[-500:]}")
        return proc.stdout

    def commit_all(self, title: str, body: str) -> None:
        self.git("add", "-A")
        self.git("commit", "-q", "--no-verify", "-F", "-", stdin=f"{title}\n\n{body.strip()}\n\n{SIGN_OFF}\n")


def source_epoch() -> int:
    """Commit time of the source tree (``SOURCE_DATE_EPOCH`` wins): makes patches and the wheel reproducible."""
    if os.environ.get("SOURCE_DATE_EPOCH", "").isdigit():
        return max(int(os.environ["SOURCE_DATE_EPOCH"]), 315532800)
    proc = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%ct"], capture_output=True, text=True)
    value = proc.stdout.strip()
    return max(int(value), 315532800) if proc.returncode == 0 and value.isdigit() else 315532800


def source_revision() -> str:
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True, text=True
    )
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else "unknown"


# --------------------------------------------------------------------------------------------- rewriting


def rewrite_text(text: str) -> str:
    """Apply the import / module-path / op-namespace rewrites (``_REWRITES``) to one file's text."""
    for pattern, repl in _REWRITES:
        text = pattern.sub(repl, text)
    return text


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def plugin_code_references(text: str, name: str) -> list[str]:
    """Code (not prose) in rewritten Python ``text`` that still names ``vllm_omni_moss``.

    Returns:
        ``"name:line: what"`` entries for imports of ``vllm_omni_moss...`` and string literals (other than
        docstrings) naming it; such code has no place in the fork.

    Raises:
        BuildError: ``text`` is not valid Python.
    """
    try:
        tree = ast.parse(text, filename=name)
    except SyntaxError as exc:
        raise BuildError(f"{name}: cannot parse: {exc}") from exc
    docstrings = _docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{name}:{node.lineno}: import {a.name}" for a in node.names if _PLUGIN_WORD.match(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _PLUGIN_WORD.match(node.module or ""):
            found.append(f"{name}:{node.lineno}: from {node.module} import ...")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and _PLUGIN_WORD.search(node.value)
        ):
            found.append(f"{name}:{node.lineno}: string {node.value[:60]!r}")
    return found


def prose_mentions(text: str, name: str) -> list[str]:
    return [
        f"{name}:{i}: mentions vllm_omni_moss"
        for i, line in enumerate(text.splitlines(), 1)
        if _PLUGIN_WORD.search(line)
    ]


def _source_files(directory: Path) -> list[Path]:
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file() and not _SKIP_PARTS.intersection(p.relative_to(directory).parts) and p.suffix != ".pyc"
    )


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def check_package_layout() -> None:
    """Every file of ``vllm_omni_moss/`` must have a place in the fork (or be plugin-only).

    Raises:
        BuildError: naming the first file with no place, so the map in this script gets extended.
    """
    pkg = ROOT / "vllm_omni_moss"
    if not (ROOT / PACKAGE_SRC).is_dir():
        raise BuildError(f"{ROOT / PACKAGE_SRC} not found: run from a vllm-omni-moss checkout")
    for path in _source_files(pkg):
        rel = path.relative_to(ROOT).as_posix()
        if rel in PLUGIN_ONLY or rel.startswith((PACKAGE_SRC + "/", TESTING_SRC + "/")):
            continue
        raise BuildError(f"{rel} has no place in the fork; extend the map in scripts/fork/build_fork.py")


def find_stage_module(package: Path) -> str:
    """Relative path (in ``package``) of the one module defining a top-level class ``MossTTSCodecDecoder``.

    Raises:
        BuildError: none or several.
    """
    hits = []
    for path in _source_files(package):
        if path.suffix == ".py":
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            if any(isinstance(n, ast.ClassDef) and n.name == ARCHITECTURE for n in tree.body):
                hits.append(path.relative_to(package).as_posix())
    if len(hits) != 1:
        raise BuildError(f"expected exactly one module of {PACKAGE_SRC} defining class {ARCHITECTURE}, found {hits}")
    return hits[0]


def _has_code(text: str) -> bool:
    tree = ast.parse(text)
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    return any(not (isinstance(n, ast.ImportFrom) and n.module == "__future__") for n in body)


def copy_tree(
    src: Path,
    dst_rel: str,
    tree: Path,
    plan: Plan,
    *,
    kind: str,
    skip: set[str] = frozenset(),
    keep_upstream_init: bool = False,
) -> list[str]:
    """Copy ``src`` into ``tree/dst_rel`` with rewrites. ``kind`` is ``"package"`` (leftover plugin code is
    an error) or ``"tests"`` (a file with leftover plugin code is left out of the fork).

    Returns:
        Fork paths written.

    Raises:
        BuildError: plugin code left in a package file, an upstream file of the same name (other than the
            package ``__init__.py`` kept from upstream), or a package ``__init__.py`` of ours with code.
    """
    written = []
    for path in _source_files(src):
        rel = path.relative_to(src).as_posix()
        if rel in skip:
            continue
        src_rel = path.relative_to(ROOT).as_posix()
        dst = tree / dst_rel / rel
        dst_name = f"{dst_rel}/{rel}"
        text = _read_text(path)
        if keep_upstream_init and rel == "__init__.py" and dst.exists():
            if text is not None and _has_code(text):
                raise BuildError(
                    f"{src_rel} has code; the fork keeps upstream's {dst_name} (move the code to a module)"
                )
            plan.kept_upstream.append(dst_name)
            continue
        if dst.exists():
            raise BuildError(
                f"{src_rel} would replace upstream's {dst_name}, which plays another role; rename it "
                "or add it to SUPERSEDED in scripts/fork/build_fork.py"
            )
        if text is not None:
            text = rewrite_text(text)
            if path.suffix == ".py":
                leftovers = plugin_code_references(text, src_rel)
                if leftovers and kind == "package":
                    raise BuildError(f"plugin-only code left after rewriting: {leftovers[0]}")
                if leftovers:
                    plan.left_out[src_rel] = f"needs the vllm-omni-moss plugin: {leftovers[0].split(': ', 1)[1]}"
                    continue
            plan.warnings += prose_mentions(text, src_rel)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            shutil.copyfile(path, dst)
        else:
            dst.write_text(text, encoding="utf-8")
        shutil.copymode(path, dst)
        written.append(dst_name)
    return written


# --------------------------------------------------------------------------------------------- commits


def edit_registry(tree: Path, stage_module: str) -> str:
    """Point the ``MossTTSCodecDecoder`` registry tuple's module at ``stage_module`` (one line).

    Raises:
        BuildError: ``registry.py`` is missing, or the entry is not in 0.30.0's form
            ``("moss_tts", "modeling_moss_tts_codec", "MossTTSCodecDecoder")``.
    """
    path = tree / REGISTRY
    if not path.is_file():
        raise BuildError(f"{REGISTRY} is not in the base wheel; is it {UPSTREAM_NAME} {UPSTREAM_VERSION}?")
    text = path.read_text(encoding="utf-8")
    pattern = re.compile(
        rf'("{ARCHITECTURE}":\s*\(\s*"moss_tts",\s*)"{UPSTREAM_STAGE_MODULE}"(,\s*"{ARCHITECTURE}",\s*\))'
    )
    matches = pattern.findall(text)
    if len(matches) != 1:
        raise BuildError(f"{REGISTRY} has no single {ARCHITECTURE} entry in the 0.30.0 form; is the base 0.30.0?")
    path.write_text(pattern.sub(lambda m: f'{m.group(1)}"{stage_module}"{m.group(2)}', text), encoding="utf-8")
    return f"{FORK_MODULE}.{stage_module}:{ARCHITECTURE}"


def _references(text: str, module: str) -> bool:
    tree = ast.parse(text)
    docstrings = _docstring_nodes(tree)
    seg = re.compile(rf"(^|[.:/]){re.escape(module)}($|[.:/])")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(seg.search(a.name) for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom):
            if seg.search(node.module or "") or any(a.name == module for a in node.names):
                return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if seg.search(node.value):
                return True
    return False


def check_fork_package(tree: Path, removed: list[str]) -> None:
    """After commit 2: nothing imports a removed module, nothing mentions the old environment variable.

    Raises:
        BuildError: naming the offending file.
    """
    modules = [Path(r).stem for r in removed]
    for path in sorted((tree / "vllm_omni").rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        rel = path.relative_to(tree).as_posix()
        if OLD_ENV_VAR in text:
            raise BuildError(f"{rel} mentions {OLD_ENV_VAR}; the fork must not read it")
        if any(m in text for m in modules):
            for module in modules:
                if module in text and _references(text, module):
                    raise BuildError(f"{rel} still uses the removed upstream module {module}")


def build_series(tree: Path, repo: Repo, plan: Plan, revision: str) -> None:
    package = ROOT / PACKAGE_SRC
    stage_rel = find_stage_module(package)
    stage_module = stage_rel[: -len(".py")].replace("/", ".")
    origin = f"Generated by scripts/build_fork.sh from vllm-omni-moss {revision}."

    # 1. core and ops
    title1 = "moss_tts: add the streaming codec core and its ops"
    added = copy_tree(package, FORK_PKG, tree, plan, kind="package", skip={stage_rel}, keep_upstream_init=True)
    plan.added[title1] = added
    repo.commit_all(
        title1,
        f"""
Adds the MOSS audio-tokenizer decoder rebuilt for many concurrent streams: config and
checkpoint loading (decoder only), the decoder and its ring metadata, the legacy and
compact decoder state pools with their commit custom ops, CUDA-graph and compile helpers,
and the request-to-slot stream session. Nothing here imports vLLM; nothing is wired yet.

{_wrap("Files: " + ", ".join(sorted(Path(p).relative_to(FORK_PKG).as_posix() for p in added)) + ".")}
Custom ops are registered in the torch.library namespace "{FORK_OP_NAMESPACE}".

{origin}
""",
    )

    # 2. stage, registry entry, superseded modules
    title2 = f"moss_tts: serve {ARCHITECTURE} from the new codec stage"
    plan.added[title2] = copy_tree(
        package, FORK_PKG, tree, plan, kind="package", skip={p for p in _rels(package) if p != stage_rel}
    )
    plan.stage_class = edit_registry(tree, stage_module)
    for name, role in SUPERSEDED.items():
        target = tree / FORK_PKG / name
        if not target.is_file():
            raise BuildError(f"{FORK_PKG}/{name} is not in the base wheel; is it {UPSTREAM_NAME} {UPSTREAM_VERSION}?")
        target.unlink()
        plan.removed_upstream[f"{FORK_PKG}/{name}"] = role.replace("the stage module", f"{stage_rel}")
    check_fork_package(tree, list(plan.removed_upstream))
    removed_lines = "\n".join(
        textwrap.fill(f"- {Path(p).name}: now {role}", width=88, subsequent_indent="  ")
        for p, role in plan.removed_upstream.items()
    )
    repo.commit_all(
        title2,
        f"""
The {ARCHITECTURE} registry entry now resolves to moss_tts.{stage_module}.{ARCHITECTURE}
(same constructor, forward contract and interface flags). Removed upstream modules whose
role the new code takes over:
{removed_lines}
The audio tokenizer modules stay: they also hold the codec encoders.
No module reads {OLD_ENV_VAR}: the pool is chosen by the codec version.

{origin}
""",
    )

    # 3. tests and benchmarks (and the package's test helpers, if any)
    title3 = "moss_tts: add the codec tests and benchmarks"
    written = []
    if (ROOT / TESTING_SRC).is_dir():
        written += copy_tree(ROOT / TESTING_SRC, TESTING_DST, tree, plan, kind="package")
    written += copy_tree(ROOT / TESTS_SRC, TESTS_SRC, tree, plan, kind="tests")
    written += copy_tree(ROOT / BENCH_SRC, BENCH_SRC, tree, plan, kind="tests")
    conftest = tree / TESTS_SRC / "conftest.py"
    head = conftest.read_text(encoding="utf-8").rstrip("\n") + "\n\n\n" if conftest.exists() else ""
    conftest.write_text(head + CONFTEST_ADDENDUM.read_text(encoding="utf-8"), encoding="utf-8")
    if f"{TESTS_SRC}/conftest.py" not in written:
        written.append(f"{TESTS_SRC}/conftest.py")
    plan.added[title3] = written
    left = "".join("\n" + _wrap(f"Left out {src}: it {why}.") for src, why in plan.left_out.items())
    repo.commit_all(
        title3,
        f"""
CPU tests (markers cpu / core_model; Triton kernels under TRITON_INTERPRET=1), CUDA tests
(marker cuda) and the codec memory, step and stage benchmarks. The conftest registers the
"vllm" marker, skips cuda tests without a GPU and runs torch on one intra-op thread.{left}

{origin}
""",
    )


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=88, break_long_words=False, break_on_hyphens=False)


def _rels(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in _source_files(directory)}


# --------------------------------------------------------------------------------------------- main


def _wheel_cli(*args: str, env: dict[str, str] | None = None) -> None:
    proc = subprocess.run([sys.executable, "-m", "wheel", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise BuildError(f"wheel {args[0]} failed: {(proc.stderr or proc.stdout).strip()[-500:]}")


def check_replaceable(out: Path) -> None:
    """Refuse to replace an existing ``out`` that is not an earlier build's output.

    Replaceable: an empty directory, or one holding exactly what a build writes: ``manifest.json``
    (a JSON object with the keys :data:`MANIFEST_KEYS`), ``patches/`` (only ``000N-*.patch`` files)
    and the wheel the manifest names (``vllm_omni-0.30.0-<tag>-py3-none-any.whl``), none a symlink.

    Raises:
        BuildError: naming what makes ``out`` something else.
    """
    if not out.is_dir() or out.is_symlink():
        raise BuildError(f"{out} is not an earlier build_fork output (not a directory); not replacing it")
    entries = sorted(out.iterdir())
    if not entries:
        return
    manifest_path = out / "manifest.json"
    if not manifest_path.is_file():
        raise BuildError(f"{out} is not an earlier build_fork output (no manifest.json); not replacing it")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or sorted(manifest) != sorted(MANIFEST_KEYS):
        raise BuildError(
            f"{out} is not an earlier build_fork output (its manifest.json is not a build_fork manifest); "
            "not replacing it"
        )
    wheel = manifest["wheel"]
    for entry in entries:
        name = entry.name
        if entry.is_symlink():
            ok = False
        elif name == "manifest.json":
            ok = True
        elif name == "patches":
            ok = entry.is_dir() and all(
                p.is_file() and not p.is_symlink() and _OUTPUT_PATCH.fullmatch(p.name) for p in entry.iterdir()
            )
        else:
            ok = name == wheel and entry.is_file() and _OUTPUT_WHEEL.fullmatch(name) is not None
        if not ok:
            raise BuildError(
                f"{out} is not an earlier build_fork output (it holds {name}, which a build does not write); "
                "not replacing it"
            )


def build(wheel: Path | None, out: Path, force: bool, build_tag: str) -> Path:
    """Build the patch series and the patched wheel into ``out``; returns ``out``.

    ``out`` is replaced only after a successful build (and only with ``force``).

    Raises:
        BuildError: see :func:`check_wheel`, plus an existing ``out`` without ``force`` (or, with it, one
            that is not an earlier build's output, :func:`check_replaceable`), a missing ``wheel`` package
            or git, a bad build tag, or a base/source that does not fit the fork map.
    """
    if out.exists() and not force:
        raise BuildError(f"{out} already exists; pass --force to replace it")
    if out.exists() or out.is_symlink():
        check_replaceable(out)
    if not re.fullmatch(r"[0-9][0-9A-Za-z_.]*", build_tag):
        raise BuildError(f"build tag {build_tag!r} must start with a digit and hold only letters, digits, '_' and '.'")
    info = check_wheel(wheel) if wheel is not None else None
    if importlib.util.find_spec("wheel") is None:
        raise BuildError(f"the 'wheel' package is missing from {sys.executable}; run: bash scripts/install.sh")
    if shutil.which("git") is None:
        raise BuildError("git not found on PATH")
    check_package_layout()

    with tempfile.TemporaryDirectory(prefix="build_fork.") as tmp_name:
        tmp = Path(tmp_name)
        if wheel is None:
            (tmp / "download").mkdir()
            wheel = download_wheel(tmp / "download")
            info = check_wheel(wheel)
        _wheel_cli("unpack", "-d", str(tmp / "unpack"), str(wheel))
        (tree,) = [p for p in (tmp / "unpack").iterdir() if p.is_dir()]
        epoch, revision = source_epoch(), source_revision()
        repo = Repo(tree, epoch)
        repo.git("init", "-q")
        repo.commit_all(
            f"{UPSTREAM_NAME} {UPSTREAM_VERSION}: the published wheel, unpacked",
            f"Base: {wheel.name} (sha256 {info['sha256']}).",
        )
        base = repo.git("rev-parse", "HEAD").strip()
        top_level = sorted(p.name for p in tree.iterdir() if p.name != ".git")

        plan = Plan()
        build_series(tree, repo, plan, revision)

        stage = tmp / "out"
        (stage / "patches").mkdir(parents=True)
        repo.git("format-patch", "-q", "--zero-commit", "--no-signature", "-o", str(stage / "patches"), f"{base}..HEAD")
        packdir = tmp / "pack" / tree.name
        packdir.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "archive", "--format=tar", "HEAD", *top_level], cwd=tree, env=repo.env, capture_output=True
        )
        if archive.returncode != 0:
            raise BuildError(f"git archive failed: {archive.stderr.decode(errors='replace').strip()[-300:]}")
        subprocess.run(["tar", "-x", "-C", str(packdir)], input=archive.stdout, check=True)
        _wheel_cli(
            "pack",
            "--build-number",
            build_tag,
            "-d",
            str(stage),
            str(packdir),
            env=dict(os.environ, SOURCE_DATE_EPOCH=str(epoch)),
        )
        wheels = sorted(stage.glob("*.whl"))
        expected = f"vllm_omni-{UPSTREAM_VERSION}-{build_tag}-py3-none-any.whl"
        if [w.name for w in wheels] != [expected]:
            raise BuildError(f"wheel pack produced {[w.name for w in wheels]}, expected {expected}")

        manifest = {
            "base_wheel": {"file": wheel.name, **info},
            "source_revision": revision,
            "wheel": expected,
            "build_tag": build_tag,
            "patches": sorted(p.name for p in (stage / "patches").iterdir()),
            "base_tree": repo.git("rev-parse", f"{base}^{{tree}}").strip(),
            "head_tree": repo.git("rev-parse", "HEAD^{tree}").strip(),
            "stage_class": plan.stage_class,
            "op_namespace": FORK_OP_NAMESPACE,
            "added": plan.added,
            "kept_upstream": plan.kept_upstream,
            "removed_upstream": plan.removed_upstream,
            "left_out": plan.left_out,
            "warnings": plan.warnings,
        }
        assert tuple(manifest) == MANIFEST_KEYS
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")

        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(stage), str(out))

    for warning in plan.warnings:
        print(f"build_fork: warning: {warning}", file=sys.stderr)
    for src, why in plan.left_out.items():
        print(f"build_fork: left out {src}: {why}", file=sys.stderr)
    print(f"build_fork: {len(manifest['patches'])} patches in {out / 'patches'}")
    print(f"build_fork: wheel {out / expected}")
    print(f"build_fork: {ARCHITECTURE} -> {plan.stage_class}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="build_fork.sh",
        description=f"Build the fork form (patch series + patched wheel) against {UPSTREAM_NAME} {UPSTREAM_VERSION}.",
    )
    parser.add_argument(
        "--wheel", type=Path, help=f"the {UPSTREAM_NAME} {UPSTREAM_VERSION} wheel (default: pip download it)"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "dist" / "fork", help="output directory (default: dist/fork)"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    parser.add_argument(
        "--build-tag", default=DEFAULT_BUILD_TAG, help=f"wheel build tag (default: {DEFAULT_BUILD_TAG})"
    )
    args = parser.parse_args(argv)
    try:
        build(args.wheel.resolve() if args.wheel else None, args.out.resolve(), args.force, args.build_tag)
    except BuildError as exc:
        print(f"build_fork: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
