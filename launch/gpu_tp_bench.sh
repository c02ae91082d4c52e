#!/usr/bin/env bash
# TP=2 on 2 GPUs through the CLI: direct strided reads (--no-redistribute) vs read-and-
# redistribute (row shares + NCCL all-to-all), on the GPU benchmark's Llama-3-8B-shaped
# checkpoint, warm page cache; per rank: seconds, bytes read, ideal bytes (docs/benchmarks-gpu.md).
#   OUT=results ./launch/gpu_tp_bench.sh [CKDIR] [REPEATS]
set -euo pipefail
cd "$(dirname "$0")/.."
CK="${1:-/tmp/ck}"; REPEATS="${2:-2}"; OUT="${OUT:-out/gpu}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0
python3 -c "from pploader.bench.cuda import write_checkpoint; write_checkpoint('$CK', 'full')"
cat "$CK"/*.safetensors > /dev/null  # warm
for i in $(seq "$REPEATS"); do
  for mode in "--no-redistribute" ""; do
    name=direct; [ -z "$mode" ] && name=redistribute
    torchrun --standalone --nproc_per_node=2 -m pploader load --model "$CK" --tp 2 \
      --device cuda --no-pools --json $mode > "$OUT/tp2-$name-$i.json"
    python3 - "$OUT/tp2-$name-$i.json" "$name" <<'PY'
import json, sys
job = json.load(open(sys.argv[1]))
for r in job["ranks"]:
    gb = r["read_bytes"] / 1e9
    print(f"{sys.argv[2]:>13} rank {r['rank']}: {r['seconds']:.3f} s, read {gb:.2f} GB "
          f"({r['read_bytes'] / r['ideal_bytes']:.3f}x ideal), {r['ideal_bytes'] / 1e9 / r['seconds']:.2f} GB/s "
          f"{r.get('extra', {}).get('redistribute', '')}")
PY
  done
done
