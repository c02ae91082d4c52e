# Sourced by demo.sh and test.sh: create .venv when missing and install what pploader needs.
# torch is installed first, pinned, from pip's configured index (on Linux x86-64 PyPI that is
# the CUDA build); PPLOADER_TORCH chooses another pin, e.g. torch==2.13.0+cpu with
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu for the CPU build (README).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PPLOADER_VENV:-$ROOT/.venv}"
_torch="${PPLOADER_TORCH:-torch==2.13.0}"
if ! [[ "$_torch" =~ ^torch([=\<\>\!~]=?[0-9][0-9A-Za-z.+*-]*)?$ ]]; then
  echo "[setup] error: PPLOADER_TORCH='$_torch' is not a torch requirement; give e.g." \
    "torch==2.13.0 (or torch==2.13.0+cpu with PIP_EXTRA_INDEX_URL), or unset it" >&2
  exit 2
fi
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi
_stamp="$VENV/.pploader-installed-${1:-base}"
if [ ! -f "$_stamp" ] || [ "$ROOT/setup.cfg" -nt "$_stamp" ]; then
  echo "[setup] installing pploader (${1:-base}) into $VENV"
  "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! "$PY" -c "import torch" 2>/dev/null; then
    _log="$VENV/.pploader-pip-torch.log"
    if ! "$PY" -m pip install -q "$_torch" >"$_log" 2>&1; then
      _why="$(grep -m1 '^ERROR' "$_log" || tail -n1 "$_log")"
      echo "[setup] error: pip could not install PPLOADER_TORCH=$_torch (${_why:-see $_log});" \
        "give a version your index has, e.g. torch==2.13.0" >&2
      exit 2
    fi
  fi
  "$PY" -m pip install -q -e "$ROOT${2:-}"
  touch "$_stamp"
fi
export PATH="$VENV/bin:$PATH"
