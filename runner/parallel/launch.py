"""Who am I? Rank, world size and local rank from the launcher's environment.

Order (docs/architecture.md): torchrun's RANK / WORLD_SIZE / LOCAL_RANK; then an MPI launch (MPICH's PMI_RANK /
PMI_SIZE / MPI_LOCALRANKID / MPI_LOCALNRANKS, Open MPI's OMPI_COMM_WORLD_*, PMIx's PMIX_RANK);
otherwise one process.

Under MPI, :func:`detect` initialises MPI (mpi4py's COMM_WORLD) and reads rank and size from it; the
local rank comes from the launcher's variables, and only where they are missing from a
shared-memory split, a collective. :func:`rank_from_environment` never touches MPI: it is what the
error path uses, so that reporting an error can never block on a peer.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

from runner.errors import PmxError

MPI_MARKERS = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
               "PMIX_RANK", "HYDRA_CONTROL_FD")
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_LOCAL_VARS = (("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"), ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"))


COMM_BACKENDS = ("auto", "mpi", "torch", "nccl", "gloo")   # --comm_backend (runner.parallel.comm.make_comm)


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str          # "torchrun" | "mpi" | "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def under_mpi(environ=os.environ) -> bool:
    return any(k in environ for k in MPI_MARKERS)


def under_torchrun(environ=os.environ) -> bool:
    return "RANK" in environ and "WORLD_SIZE" in environ


def _first_int(environ, names) -> int | None:
    for n in names:
        if environ.get(n, "").strip().isdigit():
            return int(environ[n])
    return None


def rank_from_environment(environ=os.environ) -> tuple[int, int]:
    """(rank, world size) from the launcher's variables alone, (0, 1) when there are none. No MPI call."""
    names = _RANK_VARS if under_torchrun(environ) or under_mpi(environ) else ()
    rank, size = _first_int(environ, names), _first_int(environ, _SIZE_VARS if names else ())
    return (rank or 0, size or 1)


def mpi():
    """mpi4py's MPI module, initialising MPI on first use. Under Open MPI's mpirun, mpi4py's PyPI wheel
    (which serves MPICH and Open MPI) must load Open MPI's library; it reads this when first imported."""
    if any(k.startswith("OMPI_COMM_WORLD_") for k in os.environ) and "MPI4PY_MPIABI" not in os.environ:
        os.environ["MPI4PY_MPIABI"] = "openmpi"
    from mpi4py import MPI
    return MPI


def detect(environ=os.environ) -> LaunchEnv:
    """The launch environment of this process (see module docstring for the order)."""
    if under_torchrun(environ):
        ws = int(environ["WORLD_SIZE"])
        return LaunchEnv("torchrun", int(environ["RANK"]), ws, int(environ.get("LOCAL_RANK", 0)),
                         int(environ.get("LOCAL_WORLD_SIZE", ws)))
    if under_mpi(environ):
        world = mpi().COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()
        for rank_var, size_var in _LOCAL_VARS:
            local, local_size = _first_int(environ, (rank_var,)), _first_int(environ, (size_var,))
            if local is not None and local_size:
                return LaunchEnv("mpi", rank, size, local, local_size)
        split = world.Split_type(mpi().COMM_TYPE_SHARED, key=rank)  # a collective: only at start-up
        env = LaunchEnv("mpi", rank, size, split.Get_rank(), split.Get_size())
        split.Free()
        return env
    return LaunchEnv("single", 0, 1, 0, 1)


def spans_machines(environ=os.environ) -> bool:
    """Whether an MPI launch put ranks on other machines than this one's: fewer ranks here (MPICH's
    MPI_LOCALNRANKS, Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE) than in the job. From the environment alone."""
    world = _first_int(environ, _SIZE_VARS[1:])
    for _, size_var in _LOCAL_VARS:
        local = _first_int(environ, (size_var,))
        if local and world:
            return local < world
    return False


def end_job(code: int, environ=os.environ) -> None:
    """Ends this process at once with `code` (non-zero), which ends the whole job: under mpirun, a rank that
    exits after MPI_Init without MPI_Finalize makes MPICH's and Open MPI's launchers kill every rank; under
    torchrun the elastic agent stops the other workers. Never runs a collective and never returns.

    Not MPI_Abort: under MPICH it tears the job's output forwarding down at once, which can lose the rank's
    own message, already written; after a plain exit the launcher reads the rank's output to its end first.
    Where the ranks span machines, MPICH's launcher lets the other machines' ranks wait for ever after a plain
    exit (only ranks beside the one that exited are killed): there the rank kills itself (SIGKILL), which ends
    the job at once and, unlike MPI_Abort (17 of 20 runs), kept its message in 20 of 20 runs here."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if under_mpi(environ):
        remove_mpich_segments()
    if under_mpi(environ) and spans_machines(environ):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(code)


def remove_mpich_segments(maps: str = "/proc/self/maps") -> list[str]:
    """Unlinks the MPICH shared-memory files this process maps (/dev/shm/mpich_*); returns their paths.

    MPICH removes its node's segment (mpich_shm_<job>_<node>, 2-3 MB, made by the first rank of the node to open
    it) in MPI_Finalize only, and the ranks the launcher kills when one exits never get there: the rank that
    ends the job removes it for all of them (every rank of the node maps the same file; those still attached
    keep their mapping). scripts/mpirun.sh removes what a rank killed outright leaves."""
    try:
        with open(maps) as f:
            paths = {ln.split(None, 5)[5].rstrip("\n") for ln in f if " /dev/shm/mpich_" in ln}
    except OSError:
        return []
    removed = []
    for path in sorted(paths):
        if path.endswith(" (deleted)"):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def torchrun_default_threads(environ=os.environ) -> bool:
    """torchrun sets OMP_NUM_THREADS=1 in every worker when the user did not set it."""
    return under_torchrun(environ) and "TORCHELASTIC_RUN_ID" in environ and environ.get("OMP_NUM_THREADS") == "1"


def set_cpu_threads(env: LaunchEnv, environ=os.environ) -> int:
    """Gives each local rank its share of the cores (torch under mpirun starts with one thread).

    PMX_NUM_THREADS wins, then OMP_NUM_THREADS (except the 1 that torchrun sets for every worker);
    otherwise cores / local ranks, never more than this process's CPU affinity allows (Open MPI may
    bind each rank to one core).
    """
    import torch
    n = _threads(environ, "PMX_NUM_THREADS")
    if n is None and not torchrun_default_threads(environ):
        n = _threads(environ, "OMP_NUM_THREADS")
    if n is None:
        total = os.cpu_count() or 1
        allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
        n = max(1, min(allowed, total // max(env.local_world_size, 1)))
    torch.set_num_threads(n)
    return n


def _threads(environ, name: str) -> int | None:
    """A thread count from the environment (OpenMP's "4,2" nesting: its first level), None when unset."""
    value = environ.get(name, "").split(",")[0].strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise PmxError(f"{name} must be a positive integer, got {environ[name]!r}")
    return int(value)
