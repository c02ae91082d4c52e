#!/usr/bin/env bash
# Start a real single-node Slurm cluster for CI (root, Debian/Ubuntu).
#
#   .ci/slurm-up.sh            # installs slurm-wlm + munge if missing, starts munged,
#                              # slurmctld and slurmd, waits until the node is idle
#   export SLURM_CONF=/tmp/pploader-slurm/slurm.conf   # (printed at the end)
#   .ci/slurm-down.sh          # stops exactly the daemons started here
#
# State, spool, logs and the config live in $PPLOADER_SLURM_DIR (default /tmp/pploader-slurm).
# No cgroups (proctrack/linuxproc, task/none), no accounting (poll squeue), one node declared
# with CPUs=4 (config_overrides) so 4 tasks fit on a 2-core machine.
set -euo pipefail

DIR=${PPLOADER_SLURM_DIR:-/tmp/pploader-slurm}
NODE=$(hostname -s)
CPUS=${PPLOADER_SLURM_CPUS:-4}

if [ "$(id -u)" != 0 ]; then
    echo "slurm-up: must run as root" >&2; exit 1
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends slurm-wlm munge
fi

mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
# munge: the daemon runs as user munge and needs its key and /run/munge.
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge /etc/munge
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=128 status=none
    chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
fi
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged  # pid file: /run/munge/munged.pid
    for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    touch "$DIR/munged.started-here"
fi

cat >"$DIR/slurm.conf" <<EOF
ClusterName=pploader-ci
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=${PPLOADER_SLURMCTLD_PORT:-6817}
SlurmdPort=${PPLOADER_SLURMD_PORT:-6818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=5
InactiveLimit=0
MinJobAge=300
NodeName=$NODE CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=ci Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$DIR/slurm.conf"
# Clients (sbatch, squeue) read /etc/slurm/slurm.conf unless SLURM_CONF is set: point it here
# when nothing else is installed there, so plain `sbatch` works in CI too.
if [ ! -e /etc/slurm/slurm.conf ] || [ -L /etc/slurm/slurm.conf ]; then
    mkdir -p /etc/slurm && ln -sfn "$SLURM_CONF" /etc/slurm/slurm.conf
fi

running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
running "$DIR/slurmctld.pid" || slurmctld -f "$SLURM_CONF"
running "$DIR/slurmd.pid" || slurmd -f "$SLURM_CONF"

for _ in $(seq 120); do
    state=$(sinfo -h -N -o %t 2>/dev/null | head -1 || true)
    case "$state" in idle*|mix*|alloc*) break ;; esac
    sleep 0.5
done
if ! sinfo -h -N -o %t | grep -qE '^(idle|mix|alloc)'; then
    echo "slurm-up: node did not come up (state: $(sinfo -h -N -o %t 2>&1))" >&2
    tail -n 20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
    exit 1
fi
echo "slurm-up: node $NODE up with $CPUS CPUs; export SLURM_CONF=$SLURM_CONF"
