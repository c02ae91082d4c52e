#!/usr/bin/env bash
# TP stage loads on GPUs with every TP rank on its own GPU, all ranks at once:
# direct strided reads vs read-and-redistribute (row shares + NCCL all-to-all, pipelined with
# the reads) vs --exchange-cost auto, warm and cold (python -m benchmarks.tp_gpu_loads), on the
# GPU benchmark's Llama-3-8B-shaped checkpoint (16.06 GB). Results: $OUT/tp<N>.json.
#   OUT=results ./benchmarks/tp_gpu_loads.sh [CKDIR] [TP sizes, default "2 4"] [WARM REPEATS]
set -uo pipefail
cd "$(dirname "$0")/.."
CK="${1:-/tmp/ck}"; SIZES="${2:-2 4}"; REPEATS="${3:-2}"; OUT="${OUT:-out/gpu}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "from pploader.bench.cuda import write_checkpoint; write_checkpoint('$CK', 'full')"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
for n in $SIZES; do
  [ "$n" -le "$GPUS" ] || { echo "skip TP=$n: $GPUS GPU(s)"; continue; }
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout 240 torchrun --standalone \
    --nproc_per_node="$n" -m benchmarks.tp_gpu_loads --model "$CK" --repeat "$REPEATS" \
    --out "$OUT/tp$n.json" 2>&1 | grep -v "^W1\|^\*\*\*\|OMP_NUM_THREADS"
done
