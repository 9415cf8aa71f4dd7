"""The ranks' shared-memory workspace (:class:`SharedMemory`: the CPU communicators' all-reduce and all-gather,
faster than mpi4py's or gloo's for a step's small tensors), and :func:`machine_id`: which ranks can share one."""

from __future__ import annotations

import mmap
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from runner.kernels.cpu_ext import cpu_ops

SHM_ENV = "PMX_SHM_COMM"       # 0: the CPU communicators never use shared memory (mpi4py / gloo only)
SHM_SLOT_BYTES = 4 << 20       # per rank and parity: larger collectives go in chunks of this size
SHM_AREA_BYTES = 8 << 20       # per area of reduce_norm (world + 1 areas): the most floats [M, D] it takes
SHM_LINE, SHM_PID_AT = 64, 8   # the header's line per rank, and where its pid sits there (cpu_comm.cpp's LINE, PID_AT)


class SharedMemory:
    """All-reduce, all-gather and reduce_norm between the ranks of one machine through a workspace every rank maps
    (runner/kernels/cpu_comm.cpp). Made by :meth:`open`; None there (on every rank alike) where the ranks are not
    all on this machine, the C++ extension is missing, /dev/shm cannot be used or PMX_SHM_COMM=0.

    The communicator's watchdog (which a wait lets run: the C++ wait releases the GIL) ends a job whose peer
    hangs, with its message; the wait's own deadline, `deadline_s`, is a backstop behind it. A wait also ends at
    once, with an error, when the rank it waits for has exited (each rank's pid is in the workspace's header),
    whether or not the launcher ends the job."""

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
        if mm is not None:  # this rank's pid in its header line, for the waits' look at whether a peer still runs
            mm[pid_slot(rank)] = os.getpid().to_bytes(8, "little")
        mapped = all_true(mm is not None)  # also: every rank has opened the file and written its pid
        if mapped and not all_true(all(_maps(pid_in(mm, r), made[0]) for r in range(world) if r != rank)):
            for r in range(world):  # some rank cannot see another's process (pid namespaces): no looks at all
                mm[pid_slot(r)] = bytes(8)
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


def pid_slot(rank: int) -> slice:
    """The workspace's bytes that hold rank `rank`'s pid (int64, little-endian; 0: no looks at that rank)."""
    return slice(rank * SHM_LINE + SHM_PID_AT, rank * SHM_LINE + SHM_PID_AT + 8)


def pid_in(mm, rank: int) -> int:
    """The pid rank `rank` wrote in its header line."""
    return int.from_bytes(mm[pid_slot(rank)], "little")


def _maps(pid: int, path: str) -> bool:
    """Whether process `pid`, as this process sees it, maps `path`: then a wait can tell from /proc whether that
    peer still runs (not so across pid namespaces, where the number is another process or none)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(path in ln for ln in f)
    except OSError:
        return False


def machine_id() -> str:
    """This machine (host name and boot id): equal for processes that can share memory."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
