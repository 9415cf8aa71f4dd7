"""Who am I? Rank, world size and local rank from the launcher's environment.

Order (DESIGN.md): torchrun's RANK / WORLD_SIZE / LOCAL_RANK; then an MPI launch (MPICH's PMI_RANK /
MPI_LOCALRANKID, Open MPI's OMPI_COMM_WORLD_*, PMIx's PMIX_RANK), read through mpi4py's COMM_WORLD
with the local rank from a shared-memory split; otherwise one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MPI_MARKERS = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
               "PMIX_RANK", "HYDRA_CONTROL_FD")


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str          # "torchrun" | "mpi" | "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def under_mpi(environ=os.environ) -> bool:
    return any(k in environ for k in MPI_MARKERS)


def detect(environ=os.environ) -> LaunchEnv:
    """The launch environment of this process (see module docstring for the order)."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        ws = int(environ["WORLD_SIZE"])
        return LaunchEnv("torchrun", int(environ["RANK"]), ws, int(environ.get("LOCAL_RANK", 0)),
                         int(environ.get("LOCAL_WORLD_SIZE", ws)))
    if under_mpi(environ):
        if any(k.startswith("OMPI_COMM_WORLD_") for k in environ) and "MPI4PY_MPIABI" not in environ:
            # mpi4py's PyPI wheel serves MPICH and Open MPI; it must load Open MPI's library under Open MPI's
            # mpirun (this is read once, when mpi4py.MPI is first imported)
            os.environ["MPI4PY_MPIABI"] = "openmpi"
        from mpi4py import MPI
        world = MPI.COMM_WORLD
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
        env = LaunchEnv("mpi", world.Get_rank(), world.Get_size(), local.Get_rank(), local.Get_size())
        local.Free()
        return env
    return LaunchEnv("single", 0, 1, 0, 1)


def set_cpu_threads(env: LaunchEnv) -> int:
    """Gives each local rank its share of the cores (torch under mpirun starts with one thread).

    OMP_NUM_THREADS wins when set; otherwise cores / local ranks, never more than this process's
    CPU affinity allows (Open MPI may bind each rank to one core).
    """
    import torch
    if os.environ.get("OMP_NUM_THREADS"):
        n = int(os.environ["OMP_NUM_THREADS"])
    else:
        total = os.cpu_count() or 1
        allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
        n = max(1, min(allowed, total // max(env.local_world_size, 1)))
    torch.set_num_threads(n)
    return n
