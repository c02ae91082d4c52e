#!/usr/bin/env bash
# The SGLang suite: tests marked `sglang` (tests/sglang/) inside real SGLang engines on CPU.
# Makes (or reuses) a cached venv with the pinned sglang (it pulls its own torch), installs
# this checkout into it without dependencies, then runs `pytest -m sglang`. Any pytest
# arguments pass through.
#   .ci/sglang-suite.sh               # PPLOADER_SGLANG_VENV overrides the venv location
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${PPLOADER_SGLANG_VENV:-$HOME/.cache/pploader/sglang-venv}"
PY="$VENV/bin/python"
SGLANG_PIN="sglang==0.5.23"

ready() {
  "$PY" - <<'PY' 2>/dev/null
from importlib.metadata import version
assert version("sglang") == "0.5.23", version("sglang")
import torch, sglang.srt.model_loader.loader  # noqa: F401
PY
}

if [ ! -x "$PY" ]; then
  echo "[sglang-suite] creating $VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
fi
if ! ready; then
  echo "[sglang-suite] installing $SGLANG_PIN into $VENV (about 10 minutes and 11 GB, once)"
  "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$PY" -m pip install -q "$SGLANG_PIN"
  ready || { echo "[sglang-suite] $SGLANG_PIN did not install cleanly into $VENV" >&2; exit 1; }
fi
"$PY" -c "import safetensors, numpy, pytest, pytest_timeout, transformers" 2>/dev/null \
  || "$PY" -m pip install -q safetensors numpy pytest pytest-timeout transformers
# this checkout, so the sglang.srt.plugins entry point (load format "pploader") is found
"$PY" -m pip install -q --no-deps -e "$ROOT"

cd "$ROOT"
exec "$PY" -m pytest -m sglang tests/sglang -q -p no:cacheprovider --timeout 3600 "$@"
