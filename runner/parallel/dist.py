"""The torch.distributed communicator (:class:`TorchComm`), its rendezvous and NCCL's check for a GPU per rank."""

from __future__ import annotations

import os
import re
import socket
from contextlib import nullcontext
from datetime import timedelta
from typing import Optional

import torch

from runner.errors import PmxError
from runner.parallel.communicator import Communicator
from runner.parallel.launch import LaunchEnv, mpi
from runner.parallel.shm import SharedMemory, machine_id
from runner.parallel.watchdog import Watchdog

PROCESS_GROUP_TIMEOUT = timedelta(days=1)  # torch.distributed's own deadline; the watchdog enforces ours


class TorchComm(Communicator):
    """torch.distributed: NCCL on CUDA, gloo on CPU; every collective carries the group timeout. On CPU, ranks on
    one machine all-reduce and all-gather through shared memory as MpiComm does (gloo takes milliseconds)."""

    def __init__(self, env: LaunchEnv, device: torch.device, timeout_s: float, environ=os.environ,
                 backend: Optional[str] = None):
        import torch.distributed as dist
        self.dist = dist
        self.rank, self.world_size = env.rank, env.world_size
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl":
            if device.type != "cuda":
                raise PmxError("the nccl backend needs CUDA tensors (--device cuda)")
            check_gpus_for_nccl(env, torch.cuda.device_count())
        self.captures_cuda_graphs = backend == "nccl"  # NCCL collectives run inside a CUDA graph; gloo's do not
        kwargs = dict(backend=backend, rank=env.rank, world_size=env.world_size, timeout=PROCESS_GROUP_TIMEOUT)
        if env.launcher == "mpi":  # mpirun sets no MASTER_ADDR: rank 0 publishes a reachable address
            kwargs["init_method"] = _mpi_rendezvous()
        elif env.launcher == "single":  # one process asked for a process group (nccl / gloo at TP=1)
            kwargs["init_method"] = f"tcp://127.0.0.1:{_free_port('127.0.0.1')}"
        if not dist.is_initialized():
            dist.init_process_group(**kwargs)
        self._dog = Watchdog(timeout_s)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.10
        self._ops = {"all_reduce": dist.all_reduce, "all_gather": gather, "broadcast": dist.broadcast,
                     "barrier": dist.barrier}
        self.shm = self._shared_memory(timeout_s, environ) if device.type == "cpu" else None

    def _shared_memory(self, timeout_s: float, environ) -> Optional[SharedMemory]:
        def gathered(obj) -> list:  # every rank's obj
            out = [None] * self.world_size
            self.dist.all_gather_object(out, obj)
            return out
        return SharedMemory.open(self.rank, self.world_size, lambda obj: gathered(obj)[0],
                                 lambda flag: all(gathered(bool(flag))), len(set(gathered(machine_id()))) == 1,
                                 2 * timeout_s + 1, environ)

    def _run(self, what: str, *args, guarded: bool = True, **kwargs) -> None:
        """One collective under the watchdog; a peer that has gone shows as an error naming the collective."""
        try:
            with self._dog.guard(what) if guarded else nullcontext():
                self._ops[what](*args, **kwargs)
        except RuntimeError as e:  # gloo / NCCL: the connection to a rank that exited or was killed
            cause = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(e).split())).split(". ")[0]
            raise PmxError(f"{what} failed: lost contact with another rank, which has probably failed (see its "
                           f"message): {cause[:160]}") from None

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.shm is not None and t.is_contiguous():
            self._dog.guarded("all_reduce", self.shm.all_reduce_, t)
            return t
        if torch.compiler.is_compiling():
            import torch.distributed._functional_collectives as funcol
            return t.copy_(funcol.all_reduce(t, "sum", self.dist.group.WORLD))
        self._run("all_reduce", t)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        src = t.contiguous()
        if self.shm is not None:
            return self._gathered(self._dog.guarded("all_gather", self.shm.all_gather, src.view(-1)), src, dim)
        if torch.compiler.is_compiling():
            import torch.distributed._functional_collectives as funcol
            return self._gathered(funcol.all_gather_tensor(src.view(-1), 0, self.dist.group.WORLD), src, dim)
        out = torch.empty(self.world_size * src.numel(), dtype=src.dtype, device=src.device)
        self._run("all_gather", out, src.view(-1))
        return self._gathered(out, src, dim)

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._run("broadcast", t, src=src)
        return t

    def guard(self, what: str):
        return self._dog.guard(what)

    def barrier(self) -> None:
        self._run("barrier")

    def sync(self) -> None:
        self._run("barrier", guarded=False)

    def close(self) -> None:
        """Tears the process group down (gloo aborts at exit otherwise)."""
        self.barrier()
        self.dist.destroy_process_group()


def check_gpus_for_nccl(env: LaunchEnv, gpus: int) -> None:
    """NCCL needs a GPU per rank on a machine: refused by name before the first collective, rather than as
    NCCL's own error inside it."""
    if env.local_world_size > gpus:
        raise PmxError(f"{env.local_world_size} ranks on this machine but {gpus} GPU(s): NCCL needs one GPU per "
                       f"rank; start at most {gpus} rank(s) per machine, or give --comm_backend gloo (ranks share "
                       f"GPUs, slower) or --device cpu")


def _free_port(host: str = "") -> int:
    """A TCP port free on `host` now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _mpi_rendezvous() -> str:
    """tcp://host:port chosen by rank 0 (MASTER_ADDR if set, else its own IP) and broadcast with mpi4py."""
    MPI = mpi()
    comm = MPI.COMM_WORLD
    addr = None
    if comm.Get_rank() == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        port = int(os.environ.get("MASTER_PORT", 0)) or _free_port()
        addr = f"tcp://{host}:{port}"
    return comm.bcast(addr, root=0)
