#!/usr/bin/env bash
# The test suite: make .venv, install the test extras, run pytest in parallel.
#   ./launch/test.sh                 # everything CI runs
#   ./launch/test.sh -m "not slow"   # quick subset; any pytest arguments pass through
source "$(dirname "$0")/_venv.sh" test "[test,hf,bench]"
cd "$ROOT"
exec "$PY" -m pytest -n "${PPLOADER_TEST_WORKERS:-auto}" --timeout 900 -q "$@"
