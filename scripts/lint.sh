#!/usr/bin/env bash
# Set up (if needed) and run the checkers CI runs: ruff, then mypy, over cloudtrain/,
# provisioners/ and bench/ (their settings: pyproject.toml; their versions: constraints-dev.txt).
# Exits non-zero when either finds something.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
rc=0
.venv/bin/python -m ruff check cloudtrain provisioners bench || rc=1
.venv/bin/python -m mypy || rc=1
exit "$rc"
