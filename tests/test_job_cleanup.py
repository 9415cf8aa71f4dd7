"""What a job leaves behind and prints around its ranks' output: MPICH's shared-memory segment after a failed job
(the runner's error path, scripts/mpirun.sh), and torchrun through scripts/torchrun.sh (no OMP_NUM_THREADS
banner, no /tmp/torchelastic_* directory, one line instead of the agent's traceback)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from jobs import ROOT, Job, run_job

VENV_MPIRUN = Path(sys.executable).parent / "mpirun"

# Every rank prints the MPICH segments it maps, then rank 1 fails: through the runner's error path (JobControl.fail,
# which ends the job without MPI_Finalize), or killed outright (SIGKILL; MPICH then kills rank 0 with SIGKILL too).
SEGMENT_WORKER = """
import os, signal, sys
from runner.parallel.job import JobControl
job = JobControl().start()
from mpi4py import MPI
comm = MPI.COMM_WORLD
maps = [ln.split(None, 5) for ln in open("/proc/self/maps")]
print("segments", *sorted({m[5].strip() for m in maps if len(m) == 6 and m[5].startswith("/dev/shm/mpich_")}),
      flush=True)
comm.Barrier()
if comm.Get_rank() == 1:
    if sys.argv[1] == "error":
        job.fail("boom", 2)
    os.kill(os.getpid(), signal.SIGKILL)
comm.Barrier()
"""


def segments_of(stdout: str) -> set:
    return {p for ln in stdout.splitlines() if ln.startswith("segments") for p in ln.split()[1:]}


@pytest.mark.parametrize("how,launcher", [("error", "mpirun"), ("error", "scripts/mpirun.sh"),
                                          ("kill", "scripts/mpirun.sh")])
def test_a_failed_mpich_job_leaves_no_shared_memory(tmp_path, how, launcher):
    """MPICH removes its segment in MPI_Finalize only. A rank that fails through the runner's error path removes it
    itself (so also under a bare mpirun); a rank killed outright cannot, and scripts/mpirun.sh removes it after."""
    if launcher == "mpirun" and not VENV_MPIRUN.exists():
        pytest.skip(f"{VENV_MPIRUN} not found")
    mpirun = [VENV_MPIRUN] if launcher == "mpirun" else [ROOT / "scripts" / "mpirun.sh"]
    rc, out, err, _ = run_job([*mpirun, "-np", 2, sys.executable, "-c", SEGMENT_WORKER, how], tmp_path, timeout=60)
    segments = segments_of(out)
    assert rc != 0 and segments, out + err
    if how == "error":
        assert "rank 1: error: boom" in err
    assert not [s for s in segments if os.path.exists(s)], f"left in /dev/shm: {segments}\n{err}"


TORCHRUN_WORKER = """
import os, sys, time, torch
sys.stdout.write("error_file " + os.environ["TORCHELASTIC_ERROR_FILE"] + "\\n")  # one write (the ranks share the pipe)
sys.stdout.flush()
said = os.path.join(os.path.dirname(__file__), "rank1-said")
if os.environ["RANK"] == "1":
    open(said, "w").close()
else:  # rank 0 fails only once rank 1 has written its line (the agent stops rank 1 when rank 0 fails)
    deadline = time.monotonic() + 60
    while not os.path.exists(said) and time.monotonic() < deadline:
        time.sleep(0.01)
sys.exit(int(sys.argv[1]) if os.environ["RANK"] == "0" else 0)
"""


@pytest.mark.parametrize("status", [0, 3])
def test_torchrun_wrapper_is_quiet_and_leaves_no_log_directory(tmp_path, status):
    """scripts/torchrun.sh: no OMP_NUM_THREADS banner, torchrun's exit status, its temporary log directory (where a
    plain torchrun leaves /tmp/torchelastic_*) gone after the run, and a failed rank in one line, no traceback."""
    worker = tmp_path / "worker.py"
    worker.write_text(TORCHRUN_WORKER)
    rc, out, err, _ = run_job([ROOT / "scripts" / "torchrun.sh", "--standalone", "--nproc_per_node", 2, worker, status],
                              tmp_path, timeout=120)
    assert rc == (1 if status else 0), err
    assert "OMP_NUM_THREADS" not in err and "Traceback" not in err, err
    files = [Path(ln.split()[1]) for ln in out.splitlines() if ln.startswith("error_file")]
    assert len(files) == 2
    log_dirs = {f.parents[3] for f in files}  # LOG_DIR/RUN/attempt_0/RANK/error.json
    assert all(re.fullmatch(r"torchelastic_\w+", d.name) and not d.exists() for d in log_dirs), log_dirs
    if status:
        last = err.strip().splitlines()[-1]  # (rank 1 may be stopped by the agent before it exits: said apart)
        assert last in (f"torchrun: {worker} failed on rank 0 (exit code {status})" + tail for tail in
                        ("", "; 1 other rank(s) stopped with it")), err


def test_torchrun_wrapper_keeps_a_threads_setting(tmp_path):
    """OMP_NUM_THREADS given by the user is left as it is (and honoured by the runner)."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os, sys; sys.stdout.write(f\"omp {os.environ['OMP_NUM_THREADS']}\\n\")")  # one write:
    # the two workers share the pipe, unbuffered under torchrun (print's pieces would interleave)
    with Job([ROOT / "scripts" / "torchrun.sh", "--standalone", "--nproc_per_node", 2, worker], tmp_path,
             {"OMP_NUM_THREADS": "2"}) as job:
        assert job.wait(120) == 0, job.stderr
        assert job.stdout.split() == ["omp", "2", "omp", "2"] and "OMP_NUM_THREADS" not in job.stderr
