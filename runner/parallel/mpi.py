"""The communicator of CPU ranks under mpirun (:class:`MpiComm`), and mpi4py's collectives as torch ops, which a
compiled step calls without a graph break (on MPI's COMM_WORLD, the one group an mpirun launch has)."""

from __future__ import annotations

import os
import time

import torch

from runner.parallel.communicator import Communicator
from runner.parallel.launch import LaunchEnv, mpi
from runner.parallel.shm import SharedMemory, machine_id
from runner.parallel.watchdog import Watchdog


@torch.library.custom_op("pmx::mpi_all_reduce_", mutates_args=("t",))
def mpi_all_reduce_(t: torch.Tensor) -> None:
    from mpi4py import MPI
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)


mpi_all_reduce_.register_fake(lambda t: None)


@torch.library.custom_op("pmx::mpi_all_gather", mutates_args=())
def mpi_all_gather(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """[numel] of each rank -> [world_size * numel], rank-major."""
    from mpi4py import MPI
    out = t.new_empty(world_size * t.numel())
    MPI.COMM_WORLD.Allgather(t.numpy(), out.numpy())
    return out


mpi_all_gather.register_fake(lambda t, world_size: t.new_empty(world_size * t.numel()))


class MpiComm(Communicator):
    """mpi4py on CPU tensors: in-place Allreduce, Allgather, Bcast; all-reduce and all-gather through the ranks'
    shared memory where every rank is on this machine (unless PMX_SHM_COMM=0)."""

    def __init__(self, env: LaunchEnv, timeout_s: float, environ=os.environ):
        MPI = mpi()
        self._MPI, self._comm = MPI, MPI.COMM_WORLD
        self.rank, self.world_size = env.rank, env.world_size
        self._dog = Watchdog(timeout_s)
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.machines = len(set(self._comm.allgather(machine_id())))
        one_machine = local.Get_size() == self.world_size and self.machines == 1  # MPI's node and ours agree
        local.Free()
        self.transport = f"MPI ({' '.join(MPI.Get_library_version().splitlines()[0].split(',')[0].split())})"
        self.shm = SharedMemory.open(self.rank, self.world_size, lambda obj: self._comm.bcast(obj, root=0),
                                     lambda flag: self._comm.allreduce(bool(flag), op=MPI.LAND), one_machine,
                                     2 * timeout_s + 1, environ)

    @staticmethod
    def _np(t: torch.Tensor):
        if t.dtype == torch.bfloat16:
            raise TypeError("bfloat16 tensors go through MpiComm as float32")
        return t.numpy()

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.shm is not None and t.is_contiguous():
            self._dog.guarded("all_reduce", self.shm.all_reduce_, t)
            return t
        if t.dtype in (torch.bfloat16, torch.float16):  # MPI has no half types; reduce in fp32
            return t.copy_(self.all_reduce_(t.float()))
        if torch.compiler.is_compiling():  # the compiled step runs under one guard (see `guard`)
            mpi_all_reduce_(t)
            return t
        assert t.is_contiguous()
        with self._dog.guard("all_reduce"):
            self._comm.Allreduce(self._MPI.IN_PLACE, self._np(t), op=self._MPI.SUM)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        src = t.contiguous()
        if self.shm is not None:
            return self._gathered(self._dog.guarded("all_gather", self.shm.all_gather, src.view(-1)), src, dim)
        if src.dtype in (torch.bfloat16, torch.float16):
            return self.all_gather(src.float(), dim).to(t.dtype)
        if torch.compiler.is_compiling():
            return self._gathered(mpi_all_gather(src.view(-1), self.world_size), src, dim)
        out = torch.empty(self.world_size * src.numel(), dtype=src.dtype)
        with self._dog.guard("all_gather"):
            self._comm.Allgather(self._np(src), self._np(out))
        return self._gathered(out, src, dim)

    def guard(self, what: str):
        return self._dog.guard(what)

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        with self._dog.guard("broadcast"):
            self._comm.Bcast(self._np(t), root=src)
        return t

    # MPICH's blocking collectives poll without pause: a server's ranks 1..N-1, waiting in a broadcast for rank 0's next
    # step, kept a core each at 100% while the server idled. wait_broadcast_ polls a nonblocking broadcast instead:
    # without pause for WAIT_SPIN_S (longer than the gap between a busy server's steps, so that no step waits on a nap),
    # then between naps that double up to WAIT_NAP_MAX_S (the most a first request after an idle spell waits for the
    # other ranks to notice it). Idle, that is the spin after each heartbeat (1 s): 2% of a core.
    WAIT_SPIN_S, WAIT_NAP_MAX_S = 0.02, 0.002

    def wait_broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        with self._dog.guard("broadcast"):
            req = self._comm.Ibcast(self._np(t), root=src)
            start, nap = time.monotonic(), 25e-6
            while not req.Test():
                if time.monotonic() - start > self.WAIT_SPIN_S:
                    time.sleep(nap)
                    nap = min(2 * nap, self.WAIT_NAP_MAX_S)
        return t

    def barrier(self) -> None:
        with self._dog.guard("barrier"):
            self._comm.Barrier()

    def sync(self) -> None:
        self._comm.Barrier()

    close = barrier
