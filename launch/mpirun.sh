#!/usr/bin/env bash
# Run `pploader load` (or your own entry point) on NP ranks with mpiexec (MPICH/Hydra or
# Open MPI). pploader finds its rank from PMI_* / OMPI_COMM_WORLD_*; rank 0 opens the job's
# store on a free port and broadcasts it through mpi4py (pip install 'pploader[mpi]').
#
#   NP=3 launch/mpirun.sh --model DIR --pp 3
#   NP=16 MPI_ARGS="-hosts node01,node02 -ppn 8" launch/mpirun.sh --model DIR --pp 2 --tp 8
#
# Arguments go to `pploader load` unchanged. Environment:
#   NP (default 1), MPIEXEC (default mpiexec), MPI_ARGS (extra mpiexec options),
#   PPLOADER_ENTRY (default "-m pploader load"), PYTHON (default python3)
# Exit status: mpiexec's, non-zero when any rank failed.
set -euo pipefail

PYTHON=${PYTHON:-python3}
ENTRY=${PPLOADER_ENTRY:--m pploader load}
# shellcheck disable=SC2086 # MPI_ARGS and ENTRY are deliberately split into words
exec "${MPIEXEC:-mpiexec}" -n "${NP:-1}" ${MPI_ARGS:-} "$PYTHON" $ENTRY "$@"
