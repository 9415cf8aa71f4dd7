"""Ranks on separate machines, made on this one: each "host" is a UTS and mount namespace of its own (its own host
name, which does not resolve, and its own /dev/shm: tests/fake_host.sh). MPICH launches through it as through ssh,
with a hostfile naming two hosts; torchrun runs one agent per namespace (--nnodes 2) over loopback. Generation,
replay and serving give TP=1's tokens, the shared-memory workspace is not used across the hosts (MPI carries the
collectives), and the fault matrix's rows for a rank that dies or fails hold. Every job is bounded in time and
leaves no process behind (tests/jobs.py). Needs root, or user namespaces for another user (fake_host.sh uses one
then); skipped, with the kernel's reason, only where fake_host.sh itself cannot make a host (probed by running it)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, STORIES_PROMPT
from jobs import Job, run_job
from test_faults import END_WITHIN, LONG, ended_within, error_lines
from test_generate import REFERENCE, ids_of
from test_server import Server

FAKE_HOST = ROOT / "tests" / "fake_host.sh"
HOSTS = ("pmx-host-a", "pmx-host-b")  # in no /etc/hosts: names that do not resolve
DEMO = [sys.executable, ROOT / "scripts" / "Demo.py"]


@pytest.fixture(scope="module")
def hostfile(tmp_path_factory) -> Path:
    reason = fake_host_refused()
    if reason:
        pytest.skip(reason)
    path = tmp_path_factory.mktemp("hosts") / "hostfile"
    path.write_text("".join(f"{h}\n" for h in HOSTS))
    return path


def fake_host_refused() -> str:
    """Why tests/fake_host.sh cannot make a host here ('' where it can): it is run as the tests run it, naming a
    host and mounting its /dev/shm, so a kernel or container that refuses (no root and no user namespaces, a seccomp
    filter on unshare or mount) is told apart from a failure of the code under test."""
    try:
        script = f'test "$(hostname)" = {HOSTS[0]} && touch /dev/shm/probe && test "$(ls /dev/shm)" = probe'
        res = subprocess.run([FAKE_HOST, HOSTS[0], shlex.join(["sh", "-c", script])], capture_output=True, text=True,
                             timeout=30)
    except subprocess.TimeoutExpired:
        return "cannot make a host of its own here: tests/fake_host.sh did not finish within 30 s"
    if res.returncode:
        return (f"cannot make a host of its own here (`unshare --uts --mount`, as root or in a user namespace, is "
                f"refused by this kernel or container): {res.stderr.strip()[-300:]}")
    return ""


def mpich(hostfile: Path, *cmd) -> list:
    """mpirun -np 2 with one rank on each host of `hostfile`, started through tests/fake_host.sh as through ssh."""
    return [ROOT / "scripts" / "mpirun.sh", "-launcher", "ssh", "-launcher-exec", FAKE_HOST, "-f", hostfile, "-np", 2,
            *cmd]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TorchrunNodes:
    """torchrun --nnodes 2 (as scripts/torchrun.sh runs it: no /tmp/torchelastic_* left), one agent (one rank) in each
    host's namespace, meeting at 127.0.0.1."""

    def __init__(self, out_dir: Path, *cmd):
        port = free_port()
        self.jobs = []
        for node, host in enumerate(HOSTS):
            agent = [sys.executable, "-m", "runner.parallel.torchrun", "--nnodes", 2, "--nproc_per_node", 1,
                     "--node_rank", node, "--rdzv_endpoint", f"127.0.0.1:{port}", *cmd]
            self.jobs.append(Job([FAKE_HOST, host, shlex.join(map(str, agent))], out_dir))

    def __enter__(self) -> "TorchrunNodes":
        return self

    def __exit__(self, *exc) -> None:
        for job in self.jobs:
            job.cleanup()

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        return [job.wait(max(deadline - time.monotonic(), 1)) for job in self.jobs]


def test_each_rank_is_on_a_host_of_its_own_and_mpi_carries_the_collectives(hostfile, tmp_path):
    """What the ranks see: their host names, the same boot id, /dev/shm not this machine's, MPI's own node split of
    one rank each; the communicator counts 2 machines, declines the shared-memory workspace and sums through MPI."""
    probe = tmp_path / "probe.py"
    probe.write_text("""
import json, os, socket
import torch
from runner.parallel.launch import detect, mpi
from runner.parallel.mpi import MpiComm
from runner.parallel.shm import machine_id
MPI = mpi()
env = detect()
comm = MpiComm(env, 10.0)
t = torch.full((4,), float(env.rank + 1))
comm.all_reduce_(t)
print(json.dumps(dict(rank=env.rank, host=socket.gethostname(), machine=machine_id(), shm_dev=os.stat("/dev/shm").st_dev,
                      node_ranks=MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_size(), local=env.local_world_size,
                      machines=comm.machines, shm=comm.shm is not None, sum=t.tolist(), describe=comm.describe())),
      flush=True)
""")
    rc, out, err, _ = run_job(mpich(hostfile, sys.executable, probe), tmp_path, timeout=120)
    assert rc == 0, err[-3000:]
    starts = [m.start() for m in re.finditer(r'\{"rank": ', out)]  # (the launcher may join the ranks' lines)
    ranks = sorted((json.JSONDecoder().raw_decode(out, i)[0] for i in starts), key=lambda r: r["rank"])
    assert [r["host"] for r in ranks] == list(HOSTS)
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert [r["machine"] for r in ranks] == [f"{h}/{boot}" for h in HOSTS]  # same boot id, different host names
    assert all(r["shm_dev"] != os.stat("/dev/shm").st_dev for r in ranks) and ranks[0]["shm_dev"] != ranks[1]["shm_dev"]
    assert all(r["node_ranks"] == 1 and r["local"] == 1 and r["machines"] == 2 and not r["shm"] for r in ranks)
    assert all(r["sum"] == [3.0] * 4 for r in ranks)
    assert ranks[0]["describe"].startswith("2 rank(s) on 2 machines, collectives through MPI (MPICH")


@pytest.mark.parametrize("backend", ["auto", pytest.param("gloo", marks=pytest.mark.extended)])
def test_mpich_generation_gives_tp1_tokens(stories, hostfile, tmp_path, backend):
    """auto: mpi4py; gloo: torch.distributed, whose rendezvous rank 0 publishes although its host name does not
    resolve."""
    cmd = mpich(hostfile, *DEMO, "--ckpt_dir", stories / "pmx_2", *STORIES_PROMPT, "--show_ids",
                "--comm_backend", backend)
    rc, out, err, _ = run_job(cmd, tmp_path, timeout=180)
    assert rc == 0, err[-3000:]
    assert ids_of(out) == [REFERENCE["stories260k"][:40]], out
    how = "MPI (MPICH" if backend == "auto" else "gloo"
    assert f"engine: 2 rank(s) on 2 machines, collectives through {how}" in err, err[-3000:]
    assert "Unable to resolve hostname" not in err, err[-3000:]  # gloo's fallback to loopback (see the torchrun test)
    assert "one-call" not in err.split("engine:")[1].splitlines()[0]  # it needs the shared-memory workspace


def test_torchrun_two_nodes_generation_gives_tp1_tokens(stories, hostfile, tmp_path):
    with TorchrunNodes(tmp_path, ROOT / "scripts" / "Demo.py", "--ckpt_dir", stories / "pmx_2", *STORIES_PROMPT,
                       "--show_ids") as nodes:
        rcs = nodes.wait(180)
        a, b = nodes.jobs
        assert rcs == [0, 0], a.stderr[-2000:] + b.stderr[-2000:]
        assert not a.lingering() and not b.lingering()
    assert ids_of(a.stdout) == [REFERENCE["stories260k"][:40]] and ids_of(b.stdout) == [], a.stdout + b.stdout
    assert "engine: 2 rank(s) on 2 machines, collectives through gloo" in a.stderr, a.stderr[-3000:]
    # the host names do not resolve: gloo was pointed at the interface towards the rendezvous, not left to fall back
    assert "Unable to resolve hostname" not in a.stderr + b.stderr, a.stderr[-3000:] + b.stderr[-3000:]


def test_dump_and_replay_on_two_hosts(stories, hostfile, tmp_path):
    """A dump made on the two hosts replays there bit for bit, and its logits are the one-machine dump's (to float
    rounding: there the decode steps ran in the one-call C++ step, here eagerly) with the same next tokens."""
    dump = tmp_path / "dump"
    cmd = mpich(hostfile, *DEMO, "--ckpt_dir", stories / "pmx_2", *STORIES_PROMPT, "--dump_tensor_path", dump,
                "--dump_steps", "0,1,39")
    rc, out, err, _ = run_job(cmd, tmp_path, timeout=180)
    assert rc == 0, err[-3000:]
    env = {"MODEL_PATH": str(stories / "pmx_2"), "TEST_DATA_DIR": str(dump), "OUTPUT_DIR": str(tmp_path / "out"),
           "MIN_PROFILING_SECONDS": "0.05", "WARMUP_ITERATIONS": "1", "PYTHON": sys.executable}
    rc, out, err, _ = run_job(mpich(hostfile, ROOT / "scripts" / "benchmark.sh", 1), tmp_path, env, timeout=180)
    assert rc == 0, out + err[-3000:]
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("0 ", "1 "))]
    assert [r[0] for r in rows] == ["0", "1"] and all(r[-1] == "exact" for r in rows), out
    for r in (0, 1):
        for step in (0, 1, 39):
            name = f"rank_{r}/step{step}_logits-1_512-fp32.bin"
            got, want = np.fromfile(dump / name, np.float32), np.fromfile(stories / "dump2" / name, np.float32)
            assert np.allclose(got, want, rtol=0, atol=1e-4) and got.argmax() == want.argmax(), (name, abs(got - want).max())
        replayed = np.fromfile(tmp_path / "out" / f"rank_{r}" / "step1_logits-1_512-fp32.bin", np.float32)
        assert np.array_equal(replayed, np.fromfile(dump / f"rank_{r}" / "step1_logits-1_512-fp32.bin", np.float32))


def test_serving_on_two_hosts(stories, hostfile, tmp_path):
    from test_serve import REFERENCE_TEXT
    cmd = mpich(hostfile, sys.executable, "-m", "runner", "serve", "--ckpt_dir", stories / "pmx_2", "--host",
                "127.0.0.1", "--port", 0)
    job = Job(cmd, tmp_path, {"OMP_NUM_THREADS": "1"})
    try:
        job.wait_for("serving ", 180)
        srv = Server(job)
        r = srv.client.completions.create(model=srv.model, prompt="Once upon a time", max_tokens=40, temperature=0)
        assert r.choices[0].text == REFERENCE_TEXT
        assert srv.stop() < 30
    finally:
        job.cleanup()


@pytest.mark.alone
def test_a_rank_killed_on_one_host_ends_the_job(stories, hostfile, tmp_path):
    with Job(mpich(hostfile, *DEMO, "--ckpt_dir", stories / "pmx_2", *LONG), tmp_path) as job:
        victim = job.rank_pid(1)
        job.wait_for("generating", 120)
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        assert ended_within(job, END_WITHIN, t0) != 0


@pytest.mark.alone
def test_an_exception_on_one_host_ends_the_job_with_its_message(stories, hostfile, tmp_path):
    """MPICH's launcher does not end the other hosts' ranks after a plain exit: the failing rank kills itself."""
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "rank_1").write_text("")  # rank 1 cannot make its dump folder
    with Job(mpich(hostfile, *DEMO, "--ckpt_dir", stories / "pmx_2", "--dump_tensor_path", dump), tmp_path) as job:
        job.wait_for("rank 1: error:", 120)
        assert ended_within(job, END_WITHIN, time.monotonic()) != 0
    assert error_lines(job.stderr, 1) == [f"rank 1: error: {dump / 'rank_1'}: cannot create the directory: "
                                          f"{dump / 'rank_1'} exists and is not a directory"], job.stderr


@pytest.mark.alone
def test_torchrun_a_rank_killed_on_one_node_ends_both(stories, hostfile, tmp_path):
    with TorchrunNodes(tmp_path, ROOT / "scripts" / "Demo.py", "--ckpt_dir", stories / "pmx_2", *LONG) as nodes:
        a, b = nodes.jobs
        victim = b.rank_pid(1)
        a.wait_for("generating", 120)
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        rcs = [ended_within(job, END_WITHIN, t0) for job in nodes.jobs]
    assert all(rc != 0 for rc in rcs)
