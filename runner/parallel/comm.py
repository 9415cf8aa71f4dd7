"""The communicator of a launch (:func:`make_comm`), the one for a single rank, and the collective timeout: every
collective must finish within `--collective_timeout`, else `$PMX_COLLECTIVE_TIMEOUT`, else 30 s, or the watchdog
(runner.parallel.watchdog) ends the job. Loading is not counted: `sync`, after it, waits without a deadline since
ranks load at different speeds (a rank that dies meanwhile ends the job through its launcher)."""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Optional

import torch

from runner.errors import PmxError
from runner.parallel.communicator import Communicator
from runner.parallel.dist import TorchComm
from runner.parallel.launch import COMM_BACKENDS, LaunchEnv
from runner.parallel.mpi import MpiComm

DEFAULT_TIMEOUT_S = 30.0
TIMEOUT_ENV = "PMX_COLLECTIVE_TIMEOUT"


def collective_timeout(value: Optional[float] = None, environ=os.environ) -> float:
    """Seconds a collective may wait: `value` (the --collective_timeout flag), else $PMX_COLLECTIVE_TIMEOUT, else 30."""
    if value is None and environ.get(TIMEOUT_ENV):
        try:
            value = float(environ[TIMEOUT_ENV])
        except ValueError:
            value = -1.0
        if not value > 0:
            raise PmxError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {environ[TIMEOUT_ENV]!r}")
    return DEFAULT_TIMEOUT_S if value is None else float(value)


class SingleComm(Communicator):
    """One rank: nothing to communicate, so a CUDA graph of the step holds no collective."""
    captures_cuda_graphs = True

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return t

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        return t

    def barrier(self) -> None:
        pass

    sync = close = barrier

    def guard(self, what: str):
        return nullcontext()


def make_comm(env: LaunchEnv, device: torch.device, backend: str = "auto",
              timeout_s: float = DEFAULT_TIMEOUT_S) -> Communicator:
    """The communicator for this launch. auto: none for one rank, mpi4py on CPU under mpirun, else
    torch.distributed (NCCL on CUDA, gloo on CPU). torch: torch.distributed's default for the device. nccl / gloo:
    that torch.distributed backend, even for one rank (NCCL at TP=1 inside CUDA graphs; gloo's CUDA tensors for
    several ranks sharing one GPU, which NCCL refuses)."""
    if backend not in COMM_BACKENDS:
        raise PmxError(f"--comm_backend must be one of {', '.join(COMM_BACKENDS)}; got {backend!r}")
    if backend in ("nccl", "gloo"):
        return TorchComm(env, device, timeout_s, backend=backend)
    if env.world_size == 1:
        return SingleComm()
    if backend == "auto":
        backend = "mpi" if env.launcher == "mpi" and device.type == "cpu" else "torch"
    if backend == "mpi":
        if env.launcher != "mpi" or device.type != "cpu":
            raise PmxError("--comm_backend mpi needs an mpirun launch and CPU tensors")
        return MpiComm(env, timeout_s)
    return TorchComm(env, device, timeout_s)
