#!/usr/bin/env bash
# Static checks: ruff over pploader/ and benchmarks/ (ruff.toml: a mild rule set, no
# reformatting) and mypy over pploader/ (setup.cfg [mypy]). Installs both into the active
# environment when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" -m ruff --version >/dev/null 2>&1 && "$PY" -m mypy --version >/dev/null 2>&1 || \
  "$PY" -m pip install -q mypy ruff
echo "[lint] ruff"
"$PY" -m ruff check pploader benchmarks
echo "[lint] mypy"
"$PY" -m mypy
