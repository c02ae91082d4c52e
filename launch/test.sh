#!/usr/bin/env bash
# The test suite: make .venv, install the test extras, run pytest in parallel.
#   ./launch/test.sh                 # everything CI runs
#   ./launch/test.sh -m "not slow"   # quick subset; any pytest arguments pass through
_workers="${PPLOADER_TEST_WORKERS:-auto}"
if ! [[ "$_workers" == auto || "$_workers" =~ ^[1-9][0-9]{0,3}$ ]]; then
  echo "[test] error: PPLOADER_TEST_WORKERS='$_workers': give auto or a number of workers" \
    "from 1 to 9999 (pytest-xdist -n), or unset it" >&2
  exit 2
fi
source "$(dirname "$0")/_venv.sh" test "[test,hf,bench]"
cd "$ROOT"
exec "$PY" -m pytest -n "$_workers" --timeout 900 -q "$@"
