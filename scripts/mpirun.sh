#!/usr/bin/env bash
# mpirun with the flags each MPI needs here: MPICH (pip's mpich in .venv, the default) as it is;
# Open MPI (Debian's openmpi-bin) with --allow-run-as-root --oversubscribe.
# Pick one with MPIRUN=/path/to/mpirun.   Usage: scripts/mpirun.sh -np N python ...
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
MPIRUN=${MPIRUN:-$( [ -x "$here/.venv/bin/mpirun" ] && echo "$here/.venv/bin/mpirun" || command -v mpirun )}
if "$MPIRUN" --version 2>&1 | grep -qi "open mpi"; then
  exec "$MPIRUN" --allow-run-as-root --oversubscribe "$@"
fi
exec "$MPIRUN" "$@"
