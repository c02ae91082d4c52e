# Sourced by demo.sh and test.sh: create .venv when missing and install what pploader needs.
# torch is installed first, pinned, from pip's configured index (on Linux x86-64 PyPI that is
# the CUDA build); PPLOADER_TORCH chooses another pin, e.g. torch==2.13.0+cpu with
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu for the CPU build (README).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PPLOADER_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi
_stamp="$VENV/.pploader-installed-${1:-base}"
if [ ! -f "$_stamp" ] || [ "$ROOT/setup.cfg" -nt "$_stamp" ]; then
  echo "[setup] installing pploader (${1:-base}) into $VENV"
  "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "${PPLOADER_TORCH:-torch==2.13.0}"
  "$PY" -m pip install -q -e "$ROOT${2:-}"
  touch "$_stamp"
fi
export PATH="$VENV/bin:$PATH"
