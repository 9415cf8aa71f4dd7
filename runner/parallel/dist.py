"""The torch.distributed communicator (:class:`TorchComm`), its rendezvous and NCCL's check for a GPU per rank."""

from __future__ import annotations

import os
import re
import socket
import struct
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
        self.transport = backend
        if not dist.is_initialized():
            kwargs = dict(backend=backend, rank=env.rank, world_size=env.world_size, timeout=PROCESS_GROUP_TIMEOUT)
            if env.launcher == "mpi":  # mpirun sets no MASTER_ADDR: rank 0 publishes addresses, each rank takes one
                kwargs["store"] = _mpi_rendezvous(env.world_size)
            elif env.launcher == "single":  # one process asked for a process group (nccl / gloo at TP=1)
                kwargs["init_method"] = f"tcp://127.0.0.1:{_free_port('127.0.0.1')}"
            elif backend == "gloo":  # torchrun: MASTER_ADDR is the rendezvous host
                _gloo_interface_towards(environ.get("MASTER_ADDR", ""), environ)
            dist.init_process_group(**kwargs)
        self._dog = Watchdog(timeout_s)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.10
        self._ops = {"all_reduce": dist.all_reduce, "all_gather": gather, "broadcast": dist.broadcast,
                     "barrier": dist.barrier}
        self.machines = len(set(self._gathered_objects(machine_id())))
        self.shm = self._shared_memory(timeout_s, environ) if device.type == "cpu" else None

    def _gathered_objects(self, obj) -> list:
        """Every rank's `obj` (a start-up collective)."""
        out = [None] * self.world_size
        self.dist.all_gather_object(out, obj)
        return out

    def _shared_memory(self, timeout_s: float, environ) -> Optional[SharedMemory]:
        return SharedMemory.open(self.rank, self.world_size, lambda obj: self._gathered_objects(obj)[0],
                                 lambda flag: all(self._gathered_objects(bool(flag))), self.machines == 1,
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


def _mpi_rendezvous(world_size: int):
    """The torch.distributed store of an mpirun launch: rank 0 starts it (on every interface) and broadcasts, with
    mpi4py, its port and the addresses it may be reached at (MASTER_ADDR when set; else its host name's addresses,
    then every interface's, loopback last); every other rank connects to the first of them that answers. So a host
    name that does not resolve (or resolves to a loopback address other machines cannot use) does not break the
    rendezvous. Where the host name does not resolve and GLOO_SOCKET_IFNAME is unset, gloo is pointed at the
    interface this rank reaches the store through (it would fall back to loopback, unreachable from elsewhere)."""
    import torch.distributed as dist
    MPI = mpi()
    comm = MPI.COMM_WORLD
    rank, store, found = comm.Get_rank(), None, None
    if rank == 0:
        port = int(os.environ.get("MASTER_PORT", 0))
        store = dist.TCPStore("0.0.0.0", port, world_size, is_master=True, timeout=PROCESS_GROUP_TIMEOUT,
                              wait_for_workers=False)
        found = ([os.environ["MASTER_ADDR"]] if os.environ.get("MASTER_ADDR") else host_addresses(), store.port)
    candidates, port = comm.bcast(found, root=0)
    local, host = None, None
    for host in candidates:
        try:
            with socket.create_connection((host, port), timeout=RENDEZVOUS_PROBE_S) as s:
                local = s.getsockname()[0]
            break
        except OSError:
            continue
    reached = comm.allgather(host if local is not None else None)
    if None in reached:
        raise PmxError(f"rank {reached.index(None)} cannot reach rank 0's rendezvous at any of {candidates} "
                       f"(port {port}); set MASTER_ADDR to an address of rank 0's machine that every machine reaches")
    if local is not None and "GLOO_SOCKET_IFNAME" not in os.environ and not _resolves(socket.gethostname()):
        ifname = interface_of(local)
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
    return store if store is not None else dist.TCPStore(host, port, world_size, is_master=False,
                                                         timeout=PROCESS_GROUP_TIMEOUT)


def _gloo_interface_towards(address: str, environ=os.environ) -> None:
    """Where this machine's host name does not resolve, gloo falls back to the loopback interface, which other
    machines cannot reach: point it (GLOO_SOCKET_IFNAME, unless set) at the interface that routes to `address`, the
    rendezvous host (found with a UDP socket's connect, which sends nothing)."""
    if not address or "GLOO_SOCKET_IFNAME" in environ or _resolves(socket.gethostname()):
        return
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            local = s.getsockname()[0]
    except OSError:
        return
    ifname = interface_of(local)
    if ifname:
        environ["GLOO_SOCKET_IFNAME"] = ifname


RENDEZVOUS_PROBE_S = 3.0  # how long a rank tries each of rank 0's addresses


def _resolves(name: str) -> bool:
    try:
        socket.gethostbyname(name)
        return True
    except OSError:
        return False


def _interfaces() -> dict[str, str]:
    """{IPv4 address: interface name} of this machine (Linux: SIOCGIFADDR on each interface); {} elsewhere."""
    try:
        import fcntl
        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError):
        return {}
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address
                continue
            out.setdefault(socket.inet_ntoa(packed[20:24]), name)
    return out


def host_addresses() -> list[str]:
    """This machine's IPv4 addresses, most likely reachable from other machines first: its host name's (when it
    resolves), then every interface's; loopback addresses last."""
    found = []
    try:
        found += socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        pass
    found += list(_interfaces())
    ordered = sorted(dict.fromkeys(found), key=lambda a: a.startswith("127."))  # stable: loopback last
    return ordered or ["127.0.0.1"]


def interface_of(address: str) -> Optional[str]:
    """The name of this machine's interface holding IPv4 `address`, or None."""
    return _interfaces().get(address)
