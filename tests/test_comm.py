"""The communicators' collectives between ranks (runner.parallel.comm, runner/kernels/cpu_comm.cpp)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from jobs import has_open_mpi, launch_cmd, proc_stat, run_job
from runner.kernels.cpu_ext import cpu_ops
from runner.parallel.job import describe
from runner.parallel.shm import SharedMemory, pid_slot

OPEN_MPI = pytest.param("openmpi", marks=pytest.mark.skipif(not has_open_mpi(), reason="Open MPI is not installed"))


def _shm_files() -> set:
    return set(Path("/dev/shm").glob("pmx-comm-*"))


@pytest.mark.parametrize("launcher,n", [("mpich", 2), ("mpich", 3), (OPEN_MPI, 2), ("torchrun", 2)])
def test_shared_memory_collectives_are_exact_and_leave_nothing_behind(tmp_path, launcher, n):
    """Sums in rank order and rank-major gathers, float32 / bfloat16 / float16, in one chunk or several, both
    parities reused; a peer that never joins gives the deadline error while other threads keep running
    (tests/comm_worker.py checks each rank's results itself). More ranks than cores: the waits must yield.
    Under torchrun, the gloo communicator's shared-memory collectives."""
    before = _shm_files()
    cmd, env = launch_cmd(launcher, n, sys.executable, ROOT / "tests" / "comm_worker.py")
    rc, out, err, _ = run_job(cmd, tmp_path, env, timeout=120)
    assert rc == 0, err[-3000:]
    assert sorted(int(r) for r in re.findall(r"rank (\d+): ok", out)) == list(range(n)), out
    assert _shm_files() <= before, "a shared-memory file was left in /dev/shm"


def test_comm_backend_choice():
    """--comm_backend: none for one rank by default; gloo (or nccl) asked for makes a process group even for one
    rank; an unknown name or mpi outside mpirun is refused by name."""
    import torch

    from runner.errors import PmxError
    from runner.parallel.comm import SingleComm, make_comm
    from runner.parallel.dist import TorchComm
    from runner.parallel.launch import LaunchEnv
    one, cpu = LaunchEnv("single", 0, 1, 0, 1), torch.device("cpu")
    assert isinstance(make_comm(one, cpu), SingleComm)
    with pytest.raises(PmxError, match="--comm_backend must be one of auto, mpi, torch, nccl, gloo; got 'ucc'"):
        make_comm(one, cpu, "ucc")
    with pytest.raises(PmxError, match="nccl backend needs CUDA tensors"):
        make_comm(one, cpu, "nccl")
    with pytest.raises(PmxError, match="--comm_backend mpi needs an mpirun launch"):
        make_comm(LaunchEnv("torchrun", 0, 2, 0, 2), cpu, "mpi")
    comm = make_comm(one, cpu, "gloo")
    try:
        assert isinstance(comm, TorchComm) and comm.dist.get_backend() == "gloo"
        assert not comm.captures_cuda_graphs
        t = torch.arange(4.0)
        assert torch.equal(comm.all_reduce_(t), torch.arange(4.0))
        assert torch.equal(comm.all_gather(torch.arange(3.0)), torch.arange(3.0))
    finally:
        comm.close()


def test_nccl_needs_a_gpu_per_rank_on_a_machine():
    """Checked by the NCCL communicator before its process group (gloo's ranks may share a GPU)."""
    from runner.errors import PmxError
    from runner.parallel.dist import check_gpus_for_nccl
    from runner.parallel.launch import LaunchEnv
    two = LaunchEnv("torchrun", 1, 2, 1, 2)
    with pytest.raises(PmxError, match="2 ranks on this machine but 1 GPU.*--comm_backend gloo"):
        check_gpus_for_nccl(two, gpus=1)
    with pytest.raises(PmxError, match="2 ranks on this machine but 1 GPU"):
        check_gpus_for_nccl(LaunchEnv("mpi", 1, 4, 1, 2), gpus=1)   # 4 ranks, 2 on this machine
    check_gpus_for_nccl(two, gpus=2)
    check_gpus_for_nccl(LaunchEnv("mpi", 3, 4, 1, 2), gpus=2)
    check_gpus_for_nccl(LaunchEnv("single", 0, 1, 0, 1), gpus=1)


@pytest.mark.skipif(cpu_ops() is None, reason="this project's CPU extension could not be built here")
def test_shared_memory_without_room_for_the_reduce_norm_areas_keeps_the_collectives(capfd):
    """/dev/shm too small for the areas of sequence parallelism (a page touched past a full tmpfs kills the rank):
    the workspace keeps its all-reduce and all-gather slots, takes no reduce_norm, and rank 0 says why."""
    before = _shm_files()
    shm = SharedMemory.open(0, 1, lambda obj: obj, bool, True, 5.0, area_bytes=1 << 50)
    assert shm is not None and shm.area == 0 and not shm.fits(1, 1)
    t = torch.arange(5.0)
    shm.all_reduce_(t)
    assert torch.equal(t, torch.arange(5.0)) and torch.equal(shm.all_gather(t), t)
    err = capfd.readouterr().err
    assert "/dev/shm has no room for" in err and "without sequence parallelism" in err, err
    assert _shm_files() <= before


@pytest.mark.alone
@pytest.mark.skipif(cpu_ops() is None, reason="this project's CPU extension could not be built here")
@pytest.mark.parametrize("peer", ["reaped", "zombie", "running"])
def test_a_shared_memory_wait_on_a_rank_that_has_exited_ends_at_once(peer):
    """A rank waiting for a peer that has exited (gone from /proc, or a zombie its launcher has not reaped) raises
    within a fraction of a second, not at the deadline, in one line that names the peer; one still running is waited
    for until the deadline (the launcher normally kills the waiting rank first: this is for when it does not)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"]) if peer != "running" else None
    try:
        if peer == "reaped":
            proc.wait(30)
        elif peer == "zombie":
            deadline = time.monotonic() + 30
            while proc_stat(proc.pid)[:1] != ["Z"] and time.monotonic() < deadline:
                time.sleep(0.01)
        pid = proc.pid if proc else os.getpid()
        ws = torch.zeros(cpu_ops().shm_header_bytes() + 2 * 2 * 4096, dtype=torch.uint8)
        ws[pid_slot(1)] = torch.frombuffer(bytearray(pid.to_bytes(8, "little")), dtype=torch.uint8)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as caught:
            torch.ops.pmx_cpu.shm_all_reduce_(torch.ones(4), ws, 0, 2, 1.0)
        took = time.monotonic() - t0
    finally:
        if proc:
            proc.wait(30)
    if peer == "running":
        assert took >= 1.0 and "all_reduce did not complete within 1s" in str(caught.value), caught.value
        return
    assert took < 0.5, took
    message, code, details = describe(caught.value)
    assert (message, code, details) == (f"rank 1 (pid {pid}) ended while rank 0 waited for it in all_reduce", 3, None)
