"""The shared-memory collectives of runner/kernels/cpu_comm.cpp on N ranks, against sums and gathers made locally.

Under mpirun:

Every rank can make every rank's input (seeded by rank), so each rank checks its result exactly: all_reduce is the
sum in rank order 0..N-1 (float32; half types summed in float32 and rounded once), all_gather the inputs cat
rank-major. A workspace with small slots makes the larger tensors go in several chunks, and the collectives are
mixed, many times over, so both parities of the workspace are reused. Then rank 0 waits for a collective that
rank 1 never joins and must get the deadline error, while another thread of it keeps running. reduce_norm (sequence
parallelism) against all_reduce + skip_rms_norm made locally: the same bits, for each rank's rows. Prints `rank R: ok`
per rank.
Under torchrun: the CPU communicator (gloo) shares memory too, and its all-reduce and all-gather are exact.
Usage: mpirun -np N python tests/comm_worker.py | torchrun --nproc_per_node N tests/comm_worker.py
"""

from __future__ import annotations

import threading
import time

import torch

from runner.kernels.cpu_ext import cpu_ops
from runner.parallel.comm import DEFAULT_TIMEOUT_S
from runner.parallel.dist import TorchComm
from runner.parallel.launch import detect, mpi
from runner.parallel.mpi import MpiComm
from runner.parallel.shm import SharedMemory

SLOT = 4096  # bytes per rank and parity: 1024 float32
AREA = 65536  # bytes per reduce_norm area: 16384 float32


def data(rank: int, step: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, generator=g).to(dtype)


def under_torchrun() -> None:
    env = detect()
    comm = TorchComm(env, torch.device("cpu"), DEFAULT_TIMEOUT_S)
    assert comm.shm is not None, "the ranks of one machine do not share memory"
    for step in range(6):
        mine = data(env.rank, step, 3000, torch.float32)
        acc = data(0, step, 3000, torch.float32)
        for r in range(1, env.world_size):
            acc = acc + data(r, step, 3000, torch.float32)
        assert torch.equal(comm.all_reduce_(mine.clone()), acc), f"all_reduce step {step}"
        got = comm.all_gather(mine.view(3, 1000), dim=-1)
        assert torch.equal(got, torch.cat([data(r, step, 3000, torch.float32).view(3, 1000)
                                           for r in range(env.world_size)], dim=-1)), f"all_gather step {step}"
    print(f"rank {env.rank}: ok", flush=True)
    comm.close()


def check_reduce_norm(shm: SharedMemory, rank: int, world: int) -> None:
    """reduce_norm against the sum in rank order and skip_rms_norm on every row, made locally: the same bits for this
    rank's rows and every row's output, for row counts that do and do not divide among the ranks (and fewer rows than
    ranks), with the partial copied in or written in place; shapes past the area and wrong residuals are refused."""
    ops = cpu_ops()
    for step, (m, d) in enumerate([(1, 64), (5, 96), (37, 64), (128, 128), (2, 16)] * 3):
        seed = 100 + step
        partial = data(rank, seed, m * d, torch.float32).view(m, d)
        total = data(0, seed, m * d, torch.float32).view(m, d)
        for r in range(1, world):
            total = total + data(r, seed, m * d, torch.float32).view(m, d)
        residual = data(world, seed, m * d, torch.float32).view(m, d)  # the same on every rank
        weight = data(world + 1, seed, d, torch.float32)
        want_y, want_r = ops.skip_rms_norm(total, residual, weight, 1e-5)
        rows = shm.rows(m)
        assert rows.start == min(m, rank * -(-m // world)) and rows.stop - rows.start <= -(-m // world)
        mine = residual[rows].clone()
        src = partial if step % 2 == 0 else shm.partial(m, d).copy_(partial)  # in place: no copy in the collective
        y = shm.reduce_norm(src, mine, weight, 1e-5)
        assert torch.equal(y, want_y), f"reduce_norm step {step}: normed rows differ"
        assert torch.equal(mine, want_r[rows]), f"reduce_norm step {step}: residual rows differ"
    big = shm.rows(200)
    for bad, message in [((torch.ones(200, 128), torch.ones(big.stop - big.start, 128)), "do not fit the region's areas"),
                         ((torch.ones(4, 8), torch.ones(3, 8)), "residual must be contiguous float32")]:
        try:
            shm.reduce_norm(*bad, torch.ones(bad[0].shape[1]), 1e-5)
            raise AssertionError(f"reduce_norm took {message}")
        except RuntimeError as e:
            assert message in str(e), e


def main() -> None:
    if detect().launcher == "torchrun":
        return under_torchrun()
    MPI = mpi()
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    assert MpiComm(detect(), DEFAULT_TIMEOUT_S).shm is not None, "the ranks of one machine do not share memory"
    assert MpiComm(detect(), DEFAULT_TIMEOUT_S, environ={"PMX_SHM_COMM": "0"}).shm is None
    shm = SharedMemory.open(rank, world, lambda obj: comm.bcast(obj, root=0),
                            lambda flag: comm.allreduce(bool(flag), op=MPI.LAND), True, 10.0, slot_bytes=SLOT,
                            area_bytes=AREA)
    ws, ops = shm.workspace, cpu_ops()
    sizes = (1, 768, 1024, 1025, 5000)  # inside one slot, exactly one, just over, several chunks
    for step in range(40):
        n = sizes[step % len(sizes)]
        dtype = (torch.float32, torch.bfloat16, torch.float16)[step % 3]
        mine = data(rank, step, n, dtype)
        if step % 2 == 0:
            t = mine.clone()
            ops.shm_all_reduce_(t, ws, rank, world, 10.0)
            acc = data(0, step, n, dtype).float()
            for r in range(1, world):
                acc = acc + data(r, step, n, dtype).float()
            assert torch.equal(t, acc.to(dtype)), f"all_reduce step {step}: max diff {(t.float() - acc).abs().max()}"
        else:
            out = ops.shm_all_gather(mine, ws, rank, world, 10.0)
            want = torch.cat([data(r, step, n, dtype) for r in range(world)])
            assert torch.equal(out, want), f"all_gather step {step}"
    check_reduce_norm(shm, rank, world)
    ids = ops.shm_all_gather(torch.arange(3, dtype=torch.int64) + 10 * rank, ws, rank, world, 10.0)
    assert ids.tolist() == [10 * r + i for r in range(world) for i in range(3)], ids
    comm.Barrier()
    if rank == 0:  # rank 1 never joins this one; meanwhile another Python thread must run (the wait frees the GIL)
        ticks, stop = [], threading.Event()
        ticker = threading.Thread(target=lambda: [ticks.append(1) or time.sleep(0.01) for _ in iter(stop.is_set, True)])
        ticker.start()
        t0 = time.monotonic()
        try:
            ops.shm_all_reduce_(torch.ones(8), ws, rank, world, 0.5)
            raise AssertionError("a collective without its peers returned")
        except RuntimeError as e:
            assert "all_reduce did not complete within 0.5s" in str(e) and "waited for rank 1" in str(e), e
        finally:
            stop.set()
            ticker.join()
        assert time.monotonic() - t0 < 5
        assert len(ticks) > 10, f"another thread ran {len(ticks)} times while the collective waited: GIL held"
    comm.Barrier()
    print(f"rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main()
