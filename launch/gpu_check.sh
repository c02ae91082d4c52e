#!/usr/bin/env bash
# On a GPU machine (2 GPUs for the NCCL tests and PP=2): GPU tests, then the anchors benchmark
# with pploader in the same run, then PP=2 stages alone vs together. Wheels for the competitors
# (and pytest/transformers when the image lacks them) come from .whl/ and .whlhf/ if present.
#   ANCHORS=path/to/bench_anchors.py OUT=results ./launch/gpu_check.sh [budget_s]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu}"; mkdir -p "$OUT"
ANCHORS="${ANCHORS:-.anchors/bench_anchors.py}"
BUDGET="${1:-400}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1
  python3 -c "import transformers" 2>/dev/null || { ls .whlhf/*.whl >/dev/null 2>&1 && \
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whlhf/*.whl >/dev/null 2>&1; }
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
nvidia-smi -L; python3 -c "import torch, safetensors; print('torch', torch.__version__, 'safetensors', safetensors.__version__)"
echo "== pytest -m gpu =="
timeout 240 python3 -m pytest tests/test_gpu.py -m gpu -q -p no:cacheprovider 2>&1 \
  | tee "$OUT/pytest_gpu.txt" | grep -E "passed|failed|^FAILED|^E  " | head -30
echo "== anchors + pploader (one GPU, warm and cold) =="
python3 pploader/bench_cuda.py --anchors "$ANCHORS" --ckdir /tmp/ck --out "$OUT" --budget "$BUDGET" \
  ${METHODS:+--methods "$METHODS"} 2>&1 \
  | grep -v '^\[anchors\] env' | tail -40
echo "== PP=2: each stage alone on its GPU, then both at once =="
OUT="$OUT" python3 pploader/bench_cuda.py --pp2 --ckdir /tmp/ck 2>&1 | tail -8
