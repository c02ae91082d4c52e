#!/usr/bin/env bash
# The SGLang suite: tests marked `sglang` (tests/sglang/) inside real SGLang engines on CPU,
# in a cached venv with the pinned sglang (it pulls its own torch; .ci/engine-suite.sh). Any
# pytest arguments pass through.
#   .ci/sglang-suite.sh               # PPLOADER_SGLANG_VENV overrides the venv location
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${PPLOADER_SGLANG_VENV:-$HOME/.cache/pploader/sglang-venv}"
PY="$VENV/bin/python"
TEST_DEPS="safetensors numpy pytest pytest-timeout transformers"

ready() {
  "$PY" - <<'PY' 2>/dev/null
from importlib.metadata import version
assert version("sglang") == "0.5.23", version("sglang")
import torch, sglang.srt.model_loader.loader  # noqa: F401
PY
}
install() { "$PY" -m pip install -q "sglang==0.5.23"; }   # about 10 minutes and 11 GB

. "$ROOT/.ci/engine-suite.sh"
run_engine_suite sglang-suite sglang -- -p no:cacheprovider "$@"
