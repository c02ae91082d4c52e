#!/usr/bin/env bash
# The GPU field on one machine (python -m benchmarks.gpu_field), in parts that each fit one
# 10-minute device call (run them back to back on the same warm machine; the checkpoint in
# $CKDIR is written once and kept), from the repository root:
#
#   ./benchmarks/gpu_field.sh 1   # warm + cold field, the disk's best pattern, PP=2
#   ./benchmarks/gpu_field.sh 2   # PP=4 alone vs together, CLI wall vs a bare torchrun
#   ./benchmarks/gpu_field.sh 3   # PP=4 profile: page-cache reads and H2D, alone vs together
#
# Needs 4 GPUs for PP=4 (2 for the rest). Competitors' wheels (instanttensor, fastsafetensors)
# are installed from .whl/ when present. Logs go to $OUT/partN/, JSON to $OUT/partN_NAME/ (two levels: what the device returns).
# The numbers are written up in docs/benchmarks-gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PART="${1:?usage: $0 1|2|3}"
OUT="${OUT:-out/gpu}"; DIR="$OUT/part$PART"; mkdir -p "$DIR"
CKDIR="${CKDIR:-/tmp/ck}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pploader-site .whl/*.whl >/dev/null 2>&1 && \
    export PYTHONPATH="$PYTHONPATH:/tmp/pploader-site"
fi
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c;
  "$PY" -c "import torch; print('torch', torch.__version__)";
  "$PY" -c "import instanttensor, fastsafetensors; print('competitors importable')" 2>&1 | tail -1
} | tee "$DIR/machine.txt"
bench() { local name="$1"; shift
  echo "== $name: $PY -m benchmarks.gpu_field --ckdir $CKDIR $*" | tee -a "$DIR/commands.txt"
  "$PY" -m benchmarks.gpu_field --ckdir "$CKDIR" --out "${DIR}_$name" "$@" 2>&1 | tee "$DIR/$name.log"
}
case "$PART" in
  1)
    bench field --budget 300 --methods raw_preadv16,pploader_first,pploader_reused,instanttensor_buf,fastsafetensors_buf,fastsafetensors_odirect,st_readall,raw_preadv16,pploader_first
    bench disk_best --disk-best q16x16_file,q32x16_file,q8x64_file,streams1_per_file_x64,streams4_per_file_x16
    bench pp2 --pp2 ;;
  2)
    bench pp4 --pp2 --pp 4
    bench cli_wall --cli-wall 1 ;;
  3)
    bench pp4_profile --pp2-profile --pp 4 ;;
  *) echo "usage: $0 1|2|3" >&2; exit 2 ;;
esac
