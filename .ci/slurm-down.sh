#!/usr/bin/env bash
# Stop the single-node Slurm started by .ci/slurm-up.sh (only the daemons it started, by pid).
set -uo pipefail

DIR=${PPLOADER_SLURM_DIR:-/tmp/pploader-slurm}
export SLURM_CONF="$DIR/slurm.conf"

if [ -f "$SLURM_CONF" ] && command -v scancel >/dev/null; then
    scancel --quiet --full --user="$(id -un)" 2>/dev/null || true
fi
stop() {  # stop <pidfile>: TERM, wait up to 10 s, then KILL
    local pidfile=$1 pid
    [ -s "$pidfile" ] || return 0
    pid=$(cat "$pidfile")
    kill -TERM "$pid" 2>/dev/null || { rm -f "$pidfile"; return 0; }
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}
stop "$DIR/slurmd.pid"
stop "$DIR/slurmctld.pid"
if [ -f "$DIR/munged.started-here" ]; then
    stop /run/munge/munged.pid
    rm -f "$DIR/munged.started-here"
fi
if [ -L /etc/slurm/slurm.conf ] && [ "$(readlink /etc/slurm/slurm.conf)" = "$SLURM_CONF" ]; then
    rm -f /etc/slurm/slurm.conf
fi
echo "slurm-down: stopped"
