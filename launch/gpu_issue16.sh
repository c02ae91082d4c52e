#!/usr/bin/env bash
# The issue 16/17 GPU session on a 4-GPU machine, in one command (docs/benchmarks-gpu.md):
# TP=2 and TP=4 (direct / redistribute / auto, warm and cold), pytest -m gpu, PP=4 alone vs
# together with each stage's raw ceiling, the PP=4 profile, the CLI with --exchange-cost auto.
# Each step is skipped when less than its time is left of BUDGET_S (default 560).
#   OUT=results ./launch/gpu_issue16.sh [--commit SHA]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu}"; mkdir -p "$OUT"; CK=/tmp/ck; BUDGET="${BUDGET_S:-560}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
left() { echo $((BUDGET - SECONDS)); }
step() { echo "== [$SECONDS s] $1"; }
step "machine"; nvidia-smi -L; nvidia-smi topo -m; nproc; free -g | head -2
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
step "checkpoint"; time python3 -c "from pploader.bench.cuda import write_checkpoint; write_checkpoint('$CK', 'full')"
du -sh $CK
for n in 2 4; do
  [ "$n" -le "$GPUS" ] && [ "$(left)" -gt 150 ] || { echo "skip TP=$n"; continue; }
  step "TP=$n"
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout $(( $(left) < 200 ? $(left) : 200 )) \
    torchrun --standalone --nproc_per_node="$n" -m pploader.bench.tp_gpu --model $CK \
    --repeat 2 --cold-repeat 1 --out "$OUT/tp$n.json" 2>&1 | grep -v "^W1\|^\*\*\*\|OMP_NUM"
done
if [ "$(left)" -gt 130 ]; then
  step "pytest -m gpu"
  OUT=/tmp/gpuc timeout $(( $(left) - 20 )) ./launch/gpu_check.sh "$@"
  cp /tmp/gpuc/pytest_gpu.txt /tmp/gpuc/LAST_RUN "$OUT"/ 2>/dev/null
  tail -3 /tmp/gpuc/pytest_gpu.txt
fi
if [ "$GPUS" -ge 4 ] && [ "$(left)" -gt 90 ]; then
  step "PP=4 alone vs together"
  timeout $(( $(left) - 10 )) python3 -m pploader.bench.cuda --pp2 --pp 4 --ckdir $CK --out "$OUT"
fi
if [ "$GPUS" -ge 4 ] && [ "$(left)" -gt 40 ]; then
  step "CLI TP=4 --exchange-cost auto (warm)"
  timeout 40 torchrun --standalone --nproc_per_node=4 -m pploader load --model $CK --tp 4 \
    --device cuda --no-pools --json --exchange-cost auto 2>/dev/null | python3 -c "
import json, sys; j = json.load(sys.stdin)
for r in j['ranks']: print('cli auto rank', r['rank'], r['seconds'], 'read/ideal', round(r['read_bytes'] / r['ideal_bytes'], 4), r.get('extra', {}).get('redistribute'))"
fi
if [ "$GPUS" -ge 4 ] && [ "$(left)" -gt 60 ]; then
  step "PP=4 profile"
  timeout $(( $(left) - 5 )) python3 -m pploader.bench.cuda --pp2-profile --pp 4 --ckdir $CK --out "$OUT"
fi
step "done"
