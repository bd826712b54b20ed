#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Offline equivalent of .pre-commit-config.yaml: ruff lint, ruff format check, YAML validity,
# end-of-file newline and trailing whitespace, over tracked + untracked (not ignored) files.
#   bash scripts/lint.sh          # check only (CI)
#   bash scripts/lint.sh --fix    # ruff check --fix + ruff format (whitespace issues are only reported)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ -f .venv/bin/activate ]; then
    # shellcheck disable=SC1091
    source .venv/bin/activate
fi
command -v ruff >/dev/null || { echo "lint.sh: ruff not found; run 'bash scripts/install.sh'" >&2; exit 1; }

FIX=0
[ "${1:-}" = "--fix" ] && FIX=1

rc=0
if [ "$FIX" = 1 ]; then
    ruff check --fix . || rc=1
    ruff format . || rc=1
else
    echo "==> ruff check"
    ruff check . || rc=1
    echo "==> ruff format --check"
    ruff format --check . || rc=1
fi

echo "==> yaml / end-of-file / trailing whitespace"
python - <<'PYEOF' || rc=1
import subprocess
import sys

import yaml

out = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    check=True, capture_output=True,
).stdout
problems = []
for name in sorted({p for p in out.decode().split("\0") if p}):
    try:
        data = open(name, "rb").read()
    except (FileNotFoundError, IsADirectoryError):
        continue
    if b"\0" in data[:8192] or not data:
        continue  # binary or empty
    if name.endswith((".yaml", ".yml")):
        try:
            list(yaml.safe_load_all(data))
        except yaml.YAMLError as exc:
            problems.append(f"{name}: invalid YAML: {exc}")
    if name.endswith((".md", ".diff", ".patch")):
        continue  # markdown hard breaks; patches keep their whitespace
    if not data.endswith(b"\n") or data.endswith(b"\n\n"):
        problems.append(f"{name}: must end with exactly one newline")
    for lineno, line in enumerate(data.split(b"\n"), 1):
        if line.rstrip(b"\r") != line.rstrip(b"\r").rstrip(b" \t"):
            problems.append(f"{name}:{lineno}: trailing whitespace")
            break
for p in problems:
    print(p)
sys.exit(1 if problems else 0)
PYEOF

[ "$rc" = 0 ] && echo "lint: OK" || echo "lint: FAILED"
exit "$rc"
