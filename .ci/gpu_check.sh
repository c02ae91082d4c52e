#!/usr/bin/env bash
# The GPU check: one command on a 2-GPU machine, from the repository root.
#
#   ./.ci/gpu_check.sh [--commit SHA] [--bench [BUDGET_S]]
#
# 1. `pytest -m gpu` over tests/ (every GPU test runs: the NCCL ones need 2 GPUs);
#    the report goes to $OUT/pytest_gpu.txt and $OUT/junit_gpu.xml.
# 2. When green with nothing skipped, writes tests/gpu/LAST_RUN (commit, date, device, counts,
#    digest of the GPU-path sources, see tests/gpu/last_run.py), copies it to $OUT/LAST_RUN and
#    prints it. Commit that file: the CPU test tests/gpu/test_gpu_stale.py fails in CI when the
#    GPU-path sources differ from the recorded ones.
# 3. With --bench, then the GPU benchmark (python -m pploader.bench.cuda, docs/benchmarks-gpu.md)
#    into $OUT/bench. Competitors' wheels are optional: installed from .whl/ when present.
#
# The commit recorded is --commit, else $GPU_CHECK_COMMIT, else `git rev-parse HEAD` (+dirty).
# On the lent device machine pass --commit "$(git rev-parse HEAD)" from the calling side.
# Exit status: pytest's (0 only when the GPU tests are green and LAST_RUN was written).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
COMMIT="${GPU_CHECK_COMMIT:-}"; BENCH=""; BUDGET=420
while [ $# -gt 0 ]; do
  case "$1" in
    --commit) COMMIT="$2"; shift 2 ;;
    --bench) BENCH=1; shift; if [[ "${1:-}" =~ ^[0-9]+$ ]]; then BUDGET="$1"; shift; fi ;;
    *) echo "usage: $0 [--commit SHA] [--bench [BUDGET_S]]" >&2; exit 2 ;;
  esac
done
if [ -z "$COMMIT" ] && git rev-parse HEAD >/dev/null 2>&1; then
  COMMIT="$(git rev-parse HEAD)$(git diff --quiet HEAD -- 2>/dev/null || echo '+dirty')"
fi
COMMIT="${COMMIT:-unknown}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then  # optional competitors for the benchmark
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pploader-site .whl/*.whl >/dev/null 2>&1 && \
    export PYTHONPATH="$PYTHONPATH:/tmp/pploader-site"
fi
nvidia-smi -L 2>/dev/null
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
DEVICE=$("$PY" -c "import torch; n=torch.cuda.device_count(); print(f'{n}x ' + (torch.cuda.get_device_name(0) if n else 'no GPU') + f', torch {torch.__version__}')")
echo "== pytest -m gpu ($DEVICE, commit $COMMIT) =="
"$PY" -m pytest tests -m gpu -q -p no:cacheprovider -o addopts="" --junitxml "$OUT/junit_gpu.xml" \
  2>&1 | tee "$OUT/pytest_gpu.txt" | grep -E "passed|failed|error|^FAILED|^ERROR|^E  " | head -40
RC=${PIPESTATUS[0]}
if [ "$RC" -eq 0 ]; then
  "$PY" tests/gpu/last_run.py record "$OUT/junit_gpu.xml" --device "$DEVICE" --gpus "$GPUS" \
    --commit "$COMMIT" --copy-to "$OUT" || RC=3
else
  echo "pytest -m gpu failed (rc $RC): tests/gpu/LAST_RUN not written"
fi
if [ -n "$BENCH" ]; then
  echo "== GPU benchmark (one GPU, warm and cold; budget ${BUDGET}s) =="
  "$PY" -m pploader.bench.cuda --ckdir /tmp/ck --out "$OUT/bench" --budget "$BUDGET"
fi
exit "$RC"
