#!/usr/bin/env bash
# Run `pploader load` (or your own entry point) on every rank with torchrun.
#
#   one node:    NPROC_PER_NODE=4 launch/torchrun.sh --model DIR --pp 4
#   many nodes:  on every node, the same line:
#                NNODES=2 NPROC_PER_NODE=8 HEAD_ADDR=node01 launch/torchrun.sh --model DIR --pp 2 --tp 8
#
# Arguments are passed to `pploader load` unchanged. Environment:
#   NPROC_PER_NODE  ranks on this node (default: number of GPUs, else 1)
#   NNODES          nodes (default 1: --standalone; >1 needs HEAD_ADDR)
#   HEAD_ADDR       host of the c10d rendezvous (multi-node), HEAD_PORT (default 29500)
#   RDZV_ID         rendezvous id shared by all nodes (default: pploader-$HEAD_ADDR-$HEAD_PORT)
#   PPLOADER_ENTRY  what each rank runs (default "-m pploader load"), e.g. "serve.py"
#   PYTHON          interpreter (default python3)
# Runs torchrun through `python -m pploader.torchrun`: Ctrl-C / SIGTERM end every rank within
# a few seconds with one line and exit 130 / 143 (plain torchrun: a traceback and 1).
# Exit status: otherwise torchrun's, non-zero when any rank failed (docs/launch.md).
set -euo pipefail

PYTHON=${PYTHON:-python3}
ENTRY=${PPLOADER_ENTRY:--m pploader load}
if [ -z "${NPROC_PER_NODE:-}" ]; then
    NPROC_PER_NODE=$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))')
fi
NNODES=${NNODES:-1}

if [ "$NNODES" = 1 ] && [ -z "${HEAD_ADDR:-}" ]; then
    RDZV=(--standalone)
else
    : "${HEAD_ADDR:?set HEAD_ADDR to the rendezvous host for a multi-node run}"
    HEAD_PORT=${HEAD_PORT:-29500}
    RDZV=(--rdzv_backend=c10d --rdzv_endpoint="$HEAD_ADDR:$HEAD_PORT"
          --rdzv_id="${RDZV_ID:-pploader-$HEAD_ADDR-$HEAD_PORT}")
fi
# shellcheck disable=SC2086 # ENTRY is deliberately split into words
exec "$PYTHON" -m pploader.torchrun "${RDZV[@]}" --nnodes="$NNODES" \
    --nproc_per_node="$NPROC_PER_NODE" $ENTRY "$@"
