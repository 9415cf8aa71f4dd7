#!/usr/bin/env bash
# mpirun with the flags each MPI needs here: MPICH (pip's mpich in .venv, the default) as it is;
# Open MPI (Debian's openmpi-bin) with --allow-run-as-root --oversubscribe.
# Pick one with MPIRUN=/path/to/mpirun.   Usage: scripts/mpirun.sh -np N python ...
#
# MPICH removes its node's shared-memory segment (/dev/shm/mpich_shm_*, 2-3 MB) in MPI_Finalize only. The runner's
# error path removes it when a rank ends the job (runner.parallel.launch.end_job), but a rank that is killed or
# crashes, and the ranks MPICH then kills, cannot: so once the job has ended, this removes the segments that
# appeared while it ran and that no live process maps (another job's are mapped by its ranks), and likewise the
# hwloc file MPICH's launcher writes to /tmp (held open by the launcher that made it while it runs).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
MPIRUN=${MPIRUN:-$( [ -x "$here/.venv/bin/mpirun" ] && echo "$here/.venv/bin/mpirun" || command -v mpirun )}
flags=()
if "$MPIRUN" --version 2>&1 | grep -qi "open mpi"; then
  flags=(--allow-run-as-root --oversubscribe)
fi

segments() { compgen -G "/dev/shm/mpich_*" || true; compgen -G "/tmp/hydra_hwloc_xmlfile_*" || true; }
before=" $(segments | tr '\n' ' ') "

# mpirun in the background (SIGINT / SIGQUIT restored: bash ignores them in background commands), with the
# signals this script gets passed on to it, as if it were exec'd
( trap - INT QUIT; exec "$MPIRUN" ${flags[@]+"${flags[@]}"} "$@" ) <&0 &
pid=$!
for sig in INT TERM HUP QUIT USR1 USR2; do
  trap "kill -$sig $pid 2>/dev/null || true" "$sig"
done
while :; do
  rc=0
  wait "$pid" || rc=$?
  kill -0 "$pid" 2>/dev/null || break  # wait was cut short by a signal passed on: wait on
done

for f in $(segments); do
  case "$before" in *" $f "*) continue ;; esac
  grep -qsF -- "$f" /proc/[0-9]*/maps && continue
  [ -n "$(find /proc/[0-9]*/fd -lname "$f" -print -quit 2>/dev/null)" ] && continue
  rm -f -- "$f"
done
exit "$rc"
