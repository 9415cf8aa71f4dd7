"""Jobs the tests start (mpirun, torchrun, scripts): bounded in time, on loopback, no process left behind.

MPICH's launcher puts each rank in a session of its own, so killing the launcher's process group is not
enough: every process a job starts inherits a marker in its environment (PMX_TEST_JOB), and
:meth:`Job.cleanup` kills whatever still carries it. Output goes to files, so a test can wait for a line
while the job runs.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
MARKER = "PMX_TEST_JOB"
RANK_VARS = (b"PMI_RANK", b"OMPI_COMM_WORLD_RANK", b"RANK")


OPEN_MPI = "/usr/bin/mpirun"


def has_open_mpi() -> bool:
    return Path(OPEN_MPI).exists() and b"Open MPI" in subprocess.run([OPEN_MPI, "--version"],
                                                                     capture_output=True).stdout


def proc_stat(pid: int) -> list[str]:
    """Process `pid`'s /proc stat fields after its name: [state (R, S, Z, ...), parent pid, ...]; [] once reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def launch_cmd(launcher: str, n: int, *cmd) -> tuple[list, dict]:
    """(command, environment) starting `cmd` on n ranks: launcher "mpich" (the venv's mpirun), "openmpi" (both
    through scripts/mpirun.sh) or "torchrun" (its standalone rendezvous on localhost, as scripts/torchrun.sh runs
    it; it starts Python itself, so a leading interpreter in `cmd` is left out)."""
    if launcher == "torchrun":
        cmd = cmd[1:] if str(cmd[0]) == sys.executable else cmd
        return [sys.executable, "-m", "runner.parallel.torchrun", "--standalone", "--nproc_per_node", n, *cmd], {}
    return [ROOT / "scripts" / "mpirun.sh", "-np", n, *cmd], ({"MPIRUN": OPEN_MPI} if launcher == "openmpi" else {})


def _environ(pid: int) -> dict:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)


class Job:
    """A command started in a session of its own, its stdout / stderr in files under `out_dir`."""

    def __init__(self, cmd, out_dir: Path, env: dict | None = None):
        self.marker = uuid.uuid4().hex
        self.out, self.err = Path(out_dir) / f"{self.marker}.out", Path(out_dir) / f"{self.marker}.err"
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.proc = subprocess.Popen([str(c) for c in cmd], stdout=o, stderr=e, cwd=ROOT, start_new_session=True,
                                         env={**os.environ, **(env or {}), MARKER: self.marker})
        self.t0 = time.monotonic()

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def pids(self) -> dict[int, dict]:
        """{pid: environ} of every live process of this job."""
        out = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                env = _environ(int(name))
                if env.get(MARKER.encode()) == self.marker.encode():
                    out[int(name)] = env
        return out

    def rank_pid(self, rank: int, timeout: float = 60) -> int:
        """The pid of the rank process `rank` (found by its launcher's rank variable)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pid, env in self.pids().items():
                if any(env.get(v) == str(rank).encode() for v in RANK_VARS):
                    return pid
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended before rank {rank} started:\n{self.stderr[-2000:]}")
            time.sleep(0.1)
        raise AssertionError(f"rank {rank} did not start within {timeout}s")

    def wait_for(self, text: str, timeout: float = 60) -> None:
        """Until `text` shows on stderr."""
        deadline = time.monotonic() + timeout
        while text not in self.stderr:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{text!r} never showed on stderr:\n{self.stderr[-2000:]}")
            time.sleep(0.05)

    def wait(self, timeout: float) -> int:
        """The launcher's exit status; the job is killed (and the test fails) when it outlives `timeout`."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.cleanup()
            raise AssertionError(f"the job did not end within {timeout}s:\n{self.stderr[-2000:]}") from None

    def lingering(self, timeout: float = 3.0) -> list[int]:
        """The pids of this job still alive `timeout` seconds after its launcher ended (a launcher may return
        while its processes are still being killed)."""
        deadline = time.monotonic() + timeout
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        return list(self.pids())

    def cleanup(self, grace_s: float = 10.0) -> list[int]:
        """Ends the job: SIGTERM to a launcher still running, as a user would stop it (scripts/mpirun.sh then removes
        what MPICH left in /dev/shm and /tmp: a server fixture's teardown left it there), and after at most `grace_s`
        SIGKILL to every process still carrying this job's marker; returns their pids (empty when none)."""
        if self.proc.poll() is None and grace_s > 0:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        left = list(self.pids())
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        return left


def run_job(cmd, out_dir: Path, env: dict | None = None, timeout: float = 120) -> tuple[int, str, str, float]:
    """(exit status, stdout, stderr, seconds) of a job run to its end; asserts that it left no process behind."""
    with Job(cmd, out_dir, env) as job:
        rc = job.wait(timeout)
        elapsed = time.monotonic() - job.t0
        left = job.lingering()
        assert not left, f"processes {left} outlived the job"
        return rc, job.stdout, job.stderr, elapsed


def run_cli_here(*args) -> SimpleNamespace:
    """`python -m runner ARGS` in this process, as runner/__main__.py calls it (runner.cli.main ends a single process
    with sys.exit, so that a caller in the same process can catch it): returncode, stdout and stderr, file descriptors
    1 and 2 included (the error line is written to descriptor 2 itself). An unexpected exception leaves as the process
    would print it: a traceback and status 1. For the commands' error paths, without a process start each."""
    from runner.cli import main
    out, err, code = io.StringIO(), io.StringIO(), 0
    with tempfile.TemporaryFile() as fd1, tempfile.TemporaryFile() as fd2:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(fd1.fileno(), 1)
        os.dup2(fd2.fileno(), 2)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                main([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001
            err.write(traceback.format_exc())
            code = 1
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        fd1.seek(0)
        fd2.seek(0)
        return SimpleNamespace(returncode=code, stdout=out.getvalue() + fd1.read().decode(errors="replace"),
                               stderr=err.getvalue() + fd2.read().decode(errors="replace"))
