"""Communicators: all-reduce, all-gather and broadcast over the ranks of one tensor-parallel group.

- :class:`SingleComm`: one rank, no communication at all.
- :class:`MpiComm`: CPU tensors under mpirun. Ranks on one machine all-reduce and all-gather through a
  shared-memory workspace (:class:`SharedMemory`, runner/kernels/cpu_comm.cpp: ~3 us for a decode step's 768
  floats here, against ~30 us for mpi4py's Allreduce called from the compiled step, and milliseconds for gloo);
  otherwise, or with PMX_SHM_COMM=0, with mpi4py's Allreduce / Allgather.
- :class:`TorchComm`: torch.distributed, NCCL on CUDA (under mpirun its rendezvous address is
  broadcast with mpi4py) or gloo on CPU under torchrun, whose all-reduce and all-gather also go through
  shared memory where the ranks share a machine.

Every collective runs under a watchdog: if it does not finish within the collective timeout (a peer
hangs), this rank prints which collective timed out and ends the job (runner.parallel.job). The
timeout is `--collective_timeout`, else `$PMX_COLLECTIVE_TIMEOUT`, else 30 s. Loading is not counted
against it: :meth:`sync` (after each rank has loaded its shard) waits without a deadline, since ranks
load at different speeds; a rank that dies meanwhile ends the job through its launcher.
"""

from __future__ import annotations

import mmap
import os
import re
import socket
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch

from runner.errors import PmxError
from runner.kernels.cpu_ext import cpu_ops
from runner.parallel.launch import COMM_BACKENDS, LaunchEnv, mpi

DEFAULT_TIMEOUT_S = 30.0
TIMEOUT_ENV = "PMX_COLLECTIVE_TIMEOUT"
SHM_ENV = "PMX_SHM_COMM"       # 0: the CPU communicators never use shared memory (mpi4py / gloo only)
SHM_SLOT_BYTES = 4 << 20       # per rank and parity: larger collectives go in chunks of this size
SHM_AREA_BYTES = 8 << 20       # per area of reduce_norm (world + 1 areas): the most floats [M, D] it takes
PROCESS_GROUP_TIMEOUT = timedelta(days=1)  # torch.distributed's own deadline; the watchdog enforces ours


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


# mpi4py's collectives as torch ops, so a compiled step calls them in place of a graph break. They act on
# MPI's COMM_WORLD, the one group an mpirun launch has.
@torch.library.custom_op("pmx::mpi_all_reduce_", mutates_args=("t",))
def mpi_all_reduce_(t: torch.Tensor) -> None:
    from mpi4py import MPI
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)


@mpi_all_reduce_.register_fake
def _(t):
    return None


@torch.library.custom_op("pmx::mpi_all_gather", mutates_args=())
def mpi_all_gather(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """[numel] of each rank -> [world_size * numel], rank-major."""
    from mpi4py import MPI
    out = t.new_empty(world_size * t.numel())
    MPI.COMM_WORLD.Allgather(t.numpy(), out.numpy())
    return out


@mpi_all_gather.register_fake
def _(t, world_size):
    return t.new_empty(world_size * t.numel())


class Watchdog:
    """Kills this process if a guarded section outlives its deadline (peers that died leave MPI hanging)."""

    def __init__(self, rank: int, timeout_s: float):
        self.rank, self.timeout_s = rank, timeout_s
        self._what: str | None = None
        self._since = 0.0
        self._lock = threading.Lock()
        t = threading.Thread(target=self._run, name="pmx-watchdog", daemon=True)
        t.start()

    @contextmanager
    def guard(self, what: str):
        with self._lock:
            self._what, self._since = what, time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._what = None

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            with self._lock:
                what, since = self._what, self._since
            if what is not None and time.monotonic() - since > self.timeout_s:
                from runner.parallel.job import Job
                Job().fail(f"{what} did not complete within {self.timeout_s:g}s (--collective_timeout); another "
                           f"rank has probably died or hung", 3, from_thread=True)


class SingleComm:
    rank, world_size, shm = 0, 1, None
    captures_cuda_graphs = True  # nothing to communicate: a CUDA graph of the step holds no collective

    def guard(self, what: str):
        return nullcontext()

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return t

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        return t

    def barrier(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


@contextmanager
def _unguarded():
    yield


def _cat_gathered(flat: torch.Tensor, world: int, t: torch.Tensor, dim: int) -> torch.Tensor:
    """[world * numel] gathered rank-major -> tensors cat along `dim`."""
    parts = flat.view(world, *t.shape)
    dim = dim % t.dim()
    return torch.cat(list(parts.unbind(0)), dim=dim) if dim != 0 else parts.reshape(world * t.shape[0], *t.shape[1:])


class SharedMemory:
    """All-reduce, all-gather and reduce_norm between the ranks of one machine through a workspace every rank maps
    (runner/kernels/cpu_comm.cpp). Made by :meth:`open`; None there (on every rank alike) where the ranks are not
    all on this machine, the C++ extension is missing, /dev/shm cannot be used or PMX_SHM_COMM=0.

    The communicator's watchdog (which a wait lets run: the C++ wait releases the GIL) ends a job whose peer
    hangs, with its message; the wait's own deadline, `deadline_s`, is a backstop behind it."""

    def __init__(self, workspace: torch.Tensor, region: torch.Tensor, area: int, rank: int, world: int,
                 deadline_s: float):
        self.workspace, self.region, self.area = workspace, region, area
        self.rank, self.world, self.deadline_s = rank, world, deadline_s

    @classmethod
    def open(cls, rank: int, world: int, bcast, all_true, on_one_machine: bool, deadline_s: float,
             environ=os.environ, slot_bytes: int = SHM_SLOT_BYTES, area_bytes: int = SHM_AREA_BYTES
             ) -> Optional["SharedMemory"]:
        """Collective: every rank calls it. `bcast(obj)` returns rank 0's obj on every rank, `all_true(flag)`
        whether every rank's flag is true. The file is unlinked as soon as all ranks have mapped it, so nothing
        is left in /dev/shm however the job ends. Pages are used only as collectives touch them; the reduce_norm
        areas are added only where /dev/shm has room for the whole file (a page touched past a full tmpfs would
        kill the rank with SIGBUS), else `area` is 0 and reduce_norm takes nothing (see `fits`)."""
        if not all_true(on_one_machine and environ.get(SHM_ENV, "1") != "0" and cpu_ops() is not None):
            return None
        slots = cpu_ops().shm_header_bytes() + 2 * world * slot_bytes
        made = None  # (path, bytes per reduce_norm area)
        if rank == 0:
            try:  # the areas only where /dev/shm has room for the whole file (pages are used as they are touched)
                st = os.statvfs("/dev/shm")
                area = area_bytes if st.f_bavail * st.f_frsize >= slots + (world + 1) * area_bytes else 0
                fd, path = tempfile.mkstemp(prefix="pmx-comm-", dir="/dev/shm")
                os.ftruncate(fd, slots + (world + 1) * area)
                os.close(fd)
                made = (path, area)
            except OSError:
                made = None
        made = bcast(made)
        mm = None
        if made is not None:
            try:
                with open(made[0], "r+b") as f:
                    mm = mmap.mmap(f.fileno(), os.fstat(f.fileno()).st_size)
            except OSError:
                mm = None
        mapped = all_true(mm is not None)  # also: every rank has opened the file
        if rank == 0 and made is not None:
            os.unlink(made[0])
        if not mapped:
            return None
        if rank == 0 and made[1] == 0:
            print(f"warning: /dev/shm has no room for {(world + 1) * area_bytes >> 20} MiB more of shared workspace: "
                  f"prefill runs without sequence parallelism (a larger /dev/shm, e.g. docker --shm-size 1g, "
                  f"gives it back)", file=sys.stderr, flush=True)
        mapping = torch.frombuffer(mm, dtype=torch.uint8)  # (the tensor keeps `mm` alive)
        return cls(mapping[:slots], mapping[slots:], made[1], rank, world, deadline_s)

    def all_reduce_(self, t: torch.Tensor) -> None:
        torch.ops.pmx_cpu.shm_all_reduce_(t, self.workspace, self.rank, self.world, self.deadline_s)

    def all_gather(self, flat: torch.Tensor) -> torch.Tensor:
        """[numel] of each rank -> [world * numel], rank-major."""
        return torch.ops.pmx_cpu.shm_all_gather(flat, self.workspace, self.rank, self.world, self.deadline_s)

    def rows(self, m: int) -> slice:
        """This rank's rows of an m-row reduce_norm: a contiguous 1/world of them (as cpu_comm.cpp's rows_of_rank)."""
        per = -(-m // self.world)
        first = min(m, self.rank * per)
        return slice(first, min(m, first + per))

    def _area(self, i: int, m: int, d: int) -> torch.Tensor:
        """Area i of the region (rank i's partial sums; i = world: the normed rows) as float32 [m, d]."""
        return self.region[i * self.area: i * self.area + m * d * 4].view(torch.float32).view(m, d)

    def partial(self, m: int, d: int) -> torch.Tensor:
        """This rank's partial area as float32 [m, d]: a caller that writes its partial sum here saves reduce_norm
        the copy."""
        return self._area(self.rank, m, d)

    def fits(self, m: int, d: int) -> bool:
        """Whether reduce_norm takes [m, d] float32."""
        return 0 < m * d * 4 <= self.area

    def reduce_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                    ) -> torch.Tensor:
        """Sequence parallelism's step between two row-parallel linears: with every rank's partial [M, D] summed,
        `residual` (this rank's rows, float32 [len(rows(M)), D]) += that sum on those rows, in place; returns the
        RMSNorm of every row's residual (weight `weight`), [M, D] float32 read in place from the shared area: valid
        until the next reduce_norm. Bit for bit all_reduce_ and skip_rms_norm on those rows. A `partial` that is
        :meth:`partial`'s area is not copied, and holds the sums on this rank's rows afterwards."""
        m, d = partial.shape
        torch.ops.pmx_cpu.shm_reduce_norm_(partial, residual, weight, eps, self.workspace, self.region, self.area,
                                           self.rank, self.world, self.deadline_s)
        return self._area(self.world, m, d)


def _guarded(dog: "Watchdog", what: str, collective, *args):
    """collective(*args) under the watchdog; a compiled step runs its collectives under one guard (`guard`)."""
    if torch.compiler.is_compiling():
        return collective(*args)
    with dog.guard(what):
        return collective(*args)


def machine_id() -> str:
    """This machine (host name and boot id): equal for processes that can share memory."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class MpiComm:
    """mpi4py on CPU tensors: in-place Allreduce, Allgather, Bcast; all-reduce and all-gather through shared
    memory where every rank is on this machine (see the module's docstring)."""
    captures_cuda_graphs = False

    def __init__(self, env: LaunchEnv, timeout_s: float = DEFAULT_TIMEOUT_S, environ=os.environ):
        MPI = mpi()
        self._MPI, self._comm = MPI, MPI.COMM_WORLD
        self.rank, self.world_size = env.rank, env.world_size
        self._dog = Watchdog(env.rank, timeout_s)
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        one_machine = local.Get_size() == self.world_size
        local.Free()
        self._shm = SharedMemory.open(self.rank, self.world_size, lambda obj: self._comm.bcast(obj, root=0),
                                      lambda flag: self._comm.allreduce(bool(flag), op=MPI.LAND), one_machine,
                                      2 * timeout_s + 1, environ)

    @property
    def shared_memory(self) -> bool:
        return self._shm is not None

    @property
    def shm(self) -> Optional[SharedMemory]:
        """The ranks' shared-memory workspace (C++ callers run their collectives on it), or None."""
        return self._shm

    @staticmethod
    def _np(t: torch.Tensor):
        if t.dtype == torch.bfloat16:
            raise TypeError("bfloat16 tensors go through MpiComm as float32")
        return t.numpy()

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self._shm is not None and t.is_contiguous():
            _guarded(self._dog, "all_reduce", self._shm.all_reduce_, t)
            return t
        if t.dtype in (torch.bfloat16, torch.float16):  # MPI has no half types; reduce in fp32
            t.copy_(self.all_reduce_(t.float()))
            return t
        if torch.compiler.is_compiling():  # the compiled step runs under one guard (see `guard`)
            mpi_all_reduce_(t)
            return t
        assert t.is_contiguous()
        with self._dog.guard("all_reduce"):
            self._comm.Allreduce(self._MPI.IN_PLACE, self._np(t), op=self._MPI.SUM)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        src = t.contiguous()
        if self._shm is not None:
            return _cat_gathered(_guarded(self._dog, "all_gather", self._shm.all_gather, src.view(-1)),
                                 self.world_size, src, dim)
        if src.dtype in (torch.bfloat16, torch.float16):
            return self.all_gather(src.float(), dim).to(t.dtype)
        if torch.compiler.is_compiling():
            return _cat_gathered(mpi_all_gather(src.view(-1), self.world_size), self.world_size, src, dim)
        out = torch.empty(self.world_size * src.numel(), dtype=src.dtype)
        with self._dog.guard("all_gather"):
            self._comm.Allgather(self._np(src), self._np(out))
        return _cat_gathered(out, self.world_size, src, dim)

    def guard(self, what: str):
        """Watches a whole step (a compiled one runs its collectives without their own guards)."""
        return self._dog.guard(what)

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        with self._dog.guard("broadcast"):
            self._comm.Bcast(self._np(t), root=src)
        return t

    def barrier(self) -> None:
        with self._dog.guard("barrier"):
            self._comm.Barrier()

    def sync(self) -> None:
        """A barrier without a deadline (after loading)."""
        self._comm.Barrier()

    def close(self) -> None:
        self.barrier()


class TorchComm:
    """torch.distributed: NCCL on CUDA, gloo on CPU; every collective carries the group timeout. On CPU, ranks on
    one machine all-reduce and all-gather through shared memory as MpiComm does (gloo takes milliseconds)."""

    def __init__(self, env: LaunchEnv, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S,
                 environ=os.environ, backend: Optional[str] = None):
        import torch.distributed as dist
        self.dist, self.device = dist, device
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
        self._dog = Watchdog(env.rank, timeout_s)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.10
        self._ops = {"all_reduce": dist.all_reduce, "all_gather": gather, "broadcast": dist.broadcast,
                     "barrier": dist.barrier}
        self._shm = self._shared_memory(timeout_s, environ) if device.type == "cpu" else None

    def _shared_memory(self, timeout_s: float, environ) -> Optional[SharedMemory]:
        dist = self.dist
        machines = [None] * self.world_size
        dist.all_gather_object(machines, machine_id())

        def bcast(obj):
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        def all_true(flag) -> bool:
            t = torch.tensor([int(bool(flag))])
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            return bool(t.item())
        return SharedMemory.open(self.rank, self.world_size, bcast, all_true, len(set(machines)) == 1,
                                 2 * timeout_s + 1, environ)

    @property
    def shared_memory(self) -> bool:
        return self._shm is not None

    @property
    def shm(self) -> Optional[SharedMemory]:
        """The ranks' shared-memory workspace (C++ callers run their collectives on it), or None."""
        return self._shm

    def _run(self, what: str, *args, guarded: bool = True, **kwargs) -> None:
        """One collective under the watchdog; a peer that has gone shows as an error naming the collective."""
        try:
            with self._dog.guard(what) if guarded else _unguarded():
                self._ops[what](*args, **kwargs)
        except RuntimeError as e:  # gloo / NCCL: the connection to a rank that exited or was killed
            cause = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(e).split())).split(". ")[0]
            raise PmxError(f"{what} failed: lost contact with another rank, which has probably failed (see its "
                           f"message): {cause[:160]}") from None

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self._shm is not None and t.is_contiguous():
            _guarded(self._dog, "all_reduce", self._shm.all_reduce_, t)
            return t
        if torch.compiler.is_compiling():
            import torch.distributed._functional_collectives as funcol
            return t.copy_(funcol.all_reduce(t, "sum", self.dist.group.WORLD))
        self._run("all_reduce", t)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        src = t.contiguous()
        if self._shm is not None:
            return _cat_gathered(_guarded(self._dog, "all_gather", self._shm.all_gather, src.view(-1)),
                                 self.world_size, src, dim)
        if torch.compiler.is_compiling():
            import torch.distributed._functional_collectives as funcol
            out = funcol.all_gather_tensor(src.view(-1), 0, self.dist.group.WORLD)
            return _cat_gathered(out, self.world_size, src, dim)
        out = torch.empty(self.world_size * src.numel(), dtype=src.dtype, device=src.device)
        self._run("all_gather", out, src.view(-1))
        return _cat_gathered(out, self.world_size, src, dim)

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._run("broadcast", t, src=src)
        return t

    def guard(self, what: str):
        return self._dog.guard(what)

    def barrier(self) -> None:
        self._run("barrier")

    def sync(self) -> None:
        """A barrier without a deadline (after loading)."""
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


def make_comm(env: LaunchEnv, device: torch.device, backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S):
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
