"""What every communicator has, declared once so that callers read it directly; implemented in runner.parallel by
comm.SingleComm (one rank), mpi.MpiComm and dist.TorchComm, of which comm.make_comm picks one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Optional

import torch

from runner.parallel.shm import SharedMemory


class Communicator(ABC):
    """all_reduce_ sums `t` over the ranks in place; all_gather cats every rank's `t` along `dim`, in rank order;
    broadcast_ copies rank `src`'s `t` into every rank's. barrier waits for every rank under the collective timeout;
    sync waits without a deadline (after loading, which takes each rank its own time); close is a barrier that then
    frees the group. guard(what) watches a whole section as the collective `what` (a compiled step, whose
    collectives run without guards of their own)."""
    rank: int = 0
    world_size: int = 1
    shm: Optional[SharedMemory] = None  # the ranks' shared-memory workspace (C++ callers run collectives on it)
    captures_cuda_graphs: bool = False  # whether a CUDA graph of the step may hold its collectives
    machines: int = 1                   # how many machines (runner.parallel.shm.machine_id) the ranks are on
    transport: str = "none"             # what carries the collectives where shared memory does not

    def describe(self) -> str:
        """Where the ranks are and what carries their collectives (said once at start-up)."""
        where = "one machine" if self.machines == 1 else f"{self.machines} machines"
        how = f"shared memory (else {self.transport})" if self.shm is not None else self.transport
        return f"{self.world_size} rank(s) on {where}, collectives through {how}"

    @abstractmethod
    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor: ...
    @abstractmethod
    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor: ...
    @abstractmethod
    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor: ...

    def wait_broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """broadcast_ where the ranks may wait long for `src` (a server's ranks between requests), every rank calling
        this one (not broadcast_) for it: it waits without keeping a core busy where the transport would spin."""
        return self.broadcast_(t, src)

    @abstractmethod
    def barrier(self) -> None: ...
    @abstractmethod
    def sync(self) -> None: ...
    @abstractmethod
    def close(self) -> None: ...
    @abstractmethod
    def guard(self, what: str) -> AbstractContextManager: ...

    def _gathered(self, flat: torch.Tensor, t: torch.Tensor, dim: int) -> torch.Tensor:
        """[world_size * numel] gathered rank-major -> tensors like `t` cat along `dim`."""
        parts = flat.view(self.world_size, *t.shape)
        dim = dim % t.dim()
        return torch.cat(list(parts.unbind(0)), dim=dim) if dim != 0 else parts.flatten(0, 1)
