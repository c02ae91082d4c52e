#!/usr/bin/env bash
# The main job on the bundled tiny model: make .venv, write the checkpoint, load it with
# PP=4 on 4 CPU ranks (gloo), print the per-rank table.
#   ./launch/demo.sh                 # defaults
#   MODEL=configs/models/tiny-llama.json NPROC=4 ./launch/demo.sh --ep 1
source "$(dirname "$0")/_venv.sh" base
cd "$ROOT"
CONFIG="${MODEL:-configs/models/tiny-qwen3_5_moe.json}"
[ -f "$CONFIG" ] || CONFIG=configs/models/tiny-llama.json
NPROC="${NPROC:-4}"
OUT="${OUT:-$ROOT/out/demo/$(basename "$CONFIG" .json)}"
# Never delete OUT: make-tiny writes only into a new or empty directory or one pploader made
# (its .pploader-output marker), and --force replaces only pploader's own files there.
if ! pploader make-tiny "$CONFIG" "$OUT" --force; then
  echo "demo: OUT=$OUT was not written (see above); set OUT to a new directory" >&2
  exit 2
fi
echo
echo "== plan (one process, headers only) =="
pploader plan --model "$OUT" --pp "$NPROC" "$@"
quiet() { grep -v -E '^(W|I)[0-9]{4} |\*{10}|OMP_NUM_THREADS' >&2; }
echo
echo "== load: torchrun --standalone --nproc_per_node=$NPROC -m pploader load --pp $NPROC =="
OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node="$NPROC" -m pploader load \
  --model "$OUT" --pp "$NPROC" --progress "$@" 2> >(quiet)
if [ $((NPROC % 2)) -eq 0 ] && grep -q -E '"num_(local_)?experts"|"n_routed_experts"' "$OUT/config.json"; then
  echo
  echo "== load with experts split: --pp $((NPROC / 2)) --ep 2 (each rank reads only its experts) =="
  OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node="$NPROC" -m pploader load \
    --model "$OUT" --pp $((NPROC / 2)) --ep 2 --no-pools "$@" 2> >(quiet)
fi
echo
echo "== next: use this venv's pploader (README) =="
echo "  source $VENV/bin/activate    # or call $VENV/bin/pploader"
echo "  pploader plan --model $OUT --pp $NPROC"
