"""The communicators' collectives between ranks (runner.parallel.comm, runner/kernels/cpu_comm.cpp)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from jobs import has_open_mpi, launch_cmd, run_job

OPEN_MPI = pytest.param("openmpi", marks=pytest.mark.skipif(not has_open_mpi(), reason="Open MPI is not installed"))


def _shm_files() -> set:
    return set(Path("/dev/shm").glob("pmx-comm-*"))


@pytest.mark.parametrize("launcher,n", [("mpich", 2), ("mpich", 3), (OPEN_MPI, 2), ("torchrun", 2)])
def test_shared_memory_collectives_are_exact_and_leave_nothing_behind(tmp_path, launcher, n):
    """Sums in rank order and rank-major gathers, float32 / bfloat16 / float16, in one chunk or several, both
    parities reused; a peer that never joins gives the deadline error while other threads keep running
    (tests/comm_worker.py checks each rank's results itself). More ranks than cores: the waits must yield.
    Under torchrun, the gloo communicator's shared-memory collectives."""
    before = _shm_files()
    cmd, env = launch_cmd(launcher, n, sys.executable, ROOT / "tests" / "comm_worker.py")
    rc, out, err, _ = run_job(cmd, tmp_path, env, timeout=120)
    assert rc == 0, err[-3000:]
    assert sorted(int(r) for r in re.findall(r"rank (\d+): ok", out)) == list(range(n)), out
    assert _shm_files() <= before, "a shared-memory file was left in /dev/shm"
