#!/usr/bin/env bash
# What the engine suites share (.ci/sglang-suite.sh, .ci/vllm-suite.sh source this file).
#   run_engine_suite TAG MARK -- PYTEST_ARGS...
# with ROOT, VENV, PY, TEST_DEPS (pip names of the test dependencies), and the functions
# `ready` (exit 0 when the venv holds the pinned engine) and `install` (install it) set by
# the caller: makes (or reuses) the cached venv, installs the engine once, the test
# dependencies and this checkout (no dependencies; its entry points register the load format
# "pploader"), then runs `pytest -m MARK tests/MARK`.
run_engine_suite() {
  local tag=$1 mark=$2
  shift 3
  if [ ! -x "$PY" ]; then
    echo "[$tag] creating $VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV"
  fi
  if ! ready; then
    echo "[$tag] installing the pinned engine into $VENV (several minutes, once)"
    "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    install
    ready || { echo "[$tag] the pinned engine did not install cleanly into $VENV" >&2; exit 1; }
  fi
  # shellcheck disable=SC2086 # TEST_DEPS is a list of names
  "$PY" -m pip install -q $TEST_DEPS
  "$PY" -m pip install -q --no-deps -e "$ROOT"
  cd "$ROOT"
  exec "$PY" -m pytest -m "$mark" "tests/$mark" -q --timeout 3600 "$@"
}
