"""The fault matrix of the README ("When something goes wrong"), one test per row, with real jobs:
`mpirun -np N` (MPICH from the venv; Open MPI where Debian's openmpi-bin is installed) and `torchrun`,
on loopback, each bounded in time and checked to leave no process behind (tests/jobs.py)."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import ROOT
from jobs import Job, has_open_mpi, launch_cmd, proc_stat, run_job

# each test times how soon a job ends after a fault: under pytest-xdist, none runs beside another test (conftest)
pytestmark = pytest.mark.alone
DEMO = [sys.executable, ROOT / "scripts" / "Demo.py"]
LONG = ["--batch", 128, "--max_gen_len", 500, "--context_chunking", "false"]  # > 5 s of generation on 2 cores
END_WITHIN = 5.0  # seconds from a fault to the end of the whole job
OPEN_MPI = pytest.param("openmpi", marks=pytest.mark.skipif(not has_open_mpi(), reason="Open MPI is not installed"))


# The launcher's exit status is non-zero but its own (MPICH may report 9 for a rank it killed, torchrun's agent
# 1): each rank's message, and its exit status in test_launch.py, are what the tests pin down.
def error_lines(stderr: str, rank: int) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith(f"rank {rank}: error: ")]


def ended_within(job: Job, seconds: float, since: float) -> int:
    rc = job.wait(60)
    took = time.monotonic() - since
    assert took < seconds, f"the job took {took:.1f}s to end after the fault:\n{job.stderr[-2000:]}"
    assert not job.lingering(), "processes outlived the job"
    return rc


@pytest.mark.parametrize("launcher", ["mpich", "torchrun", OPEN_MPI])
def test_an_exception_on_one_rank_ends_the_job_with_its_message(stories, tmp_path, launcher):
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "rank_1").write_text("")  # rank 1 cannot make its dump folder; rank 0 can
    cmd, env = launch_cmd(launcher, 2, *DEMO, "--ckpt_dir", stories / "pmx_2", "--dump_tensor_path", dump)
    with Job(cmd, tmp_path, env) as job:
        job.wait_for("rank 1: error:")
        rc = ended_within(job, END_WITHIN, time.monotonic())
    assert rc != 0
    assert error_lines(job.stderr, 1) == [f"rank 1: error: {dump / 'rank_1'}: cannot create the directory: "
                                          f"{dump / 'rank_1'} exists and is not a directory"], job.stderr
    assert not [ln for ln in job.stderr.splitlines() if ln.startswith("rank ") and "Traceback" in ln]
    assert os.listdir(dump) == ["rank_1"]  # rank 0 wrote nothing either


def test_an_unexpected_error_mid_generation_ends_the_job(stories, tmp_path):
    """A broken shard (NaN in rank 0's last down projection, summed into every rank's hidden state) makes every logit
    NaN: sampling fails on rank 0 while rank 1 waits in a collective."""
    bad = tmp_path / "nan"
    bad.mkdir()
    for f in (stories / "pmx_2").iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    with safe_open(str(bad / "model.00.safetensors"), "pt") as f:
        meta, sd = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    last = max(int(k.split(".")[1]) for k in sd if k.startswith("layers."))
    sd[f"layers.{last}.feed_forward.w2.weight"].fill_(float("nan"))
    save_file(sd, str(bad / "model.00.safetensors"), metadata=meta)
    cmd, env = launch_cmd("mpich", 2, *DEMO, "--ckpt_dir", bad, "--temperature", 0.8, "--max_gen_len", 20)
    with Job(cmd, tmp_path, env) as job:
        job.wait_for(": error: prompt 0 could not go on: NonFiniteLogits")
        ended_within(job, END_WITHIN, time.monotonic())
    err = job.stderr
    assert job.proc.returncode != 0 and "the model's logits are all NaN in 1 of 1 row(s)" in err, err
    assert sum(len(error_lines(err, r)) for r in (0, 1)) >= 1 and len(error_lines(err, 0)) <= 1


SIGNAL_CASES = [  # (launcher, signal, whom: a rank number or "launcher"); SIGTERM to a rank takes SIGINT's handler
    # (under another name) on either launcher: --extended (the servers' SIGTERM drain: test_server, test_soak)
    ("mpich", signal.SIGINT, 1), pytest.param("mpich", signal.SIGTERM, 1, marks=pytest.mark.extended),
    ("mpich", signal.SIGKILL, 1), ("mpich", signal.SIGINT, "launcher"),
    pytest.param("torchrun", signal.SIGTERM, 1, marks=pytest.mark.extended), ("torchrun", signal.SIGKILL, 1),
]


@pytest.mark.parametrize("launcher,sig,whom", SIGNAL_CASES)
def test_a_signal_to_one_rank_or_the_launcher_ends_the_job(stories, tmp_path, launcher, sig, whom):
    cmd, env = launch_cmd(launcher, 2, *DEMO, "--ckpt_dir", stories / "pmx_2", *LONG)
    with Job(cmd, tmp_path, env) as job:
        victim = job.proc.pid if whom == "launcher" else job.rank_pid(whom)
        job.wait_for("generating")
        time.sleep(0.5)  # well inside generation: ranks are in and out of collectives
        t0 = time.monotonic()
        os.kill(victim, sig)
        rc = ended_within(job, END_WITHIN, t0)
    assert rc != 0
    if whom != "launcher" and sig != signal.SIGKILL:
        how = "interrupted" if sig == signal.SIGINT else "terminated"
        assert error_lines(job.stderr, whom) == [f"rank {whom}: error: {how} ({sig.name})"], job.stderr


def test_a_rank_that_hangs_makes_the_others_end_the_job_after_the_collective_timeout(stories, tmp_path):
    cmd, env = launch_cmd("mpich", 2, *DEMO, "--ckpt_dir", stories / "pmx_2", *LONG, "--collective_timeout", 2)
    with Job(cmd, tmp_path, env) as job:
        victim = job.rank_pid(1)
        job.wait_for("generating")
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        rc = ended_within(job, 2 + END_WITHIN, t0)
    assert rc != 0
    # where it stopped: a prefill step's reduce_norms (sequence parallelism) or all-gathers (embedding, logits), or a
    # decode step (its collectives run inside the one C++ call of runner.engine.fused_decode, watched as a whole)
    lines = error_lines(job.stderr, 0)
    assert len(lines) == 1 and re.fullmatch(r"rank 0: error: (all_(reduce|gather)|reduce_norm|decode step) did not "
                                            r"complete within 2s "
                                            r"\(--collective_timeout\); another rank has probably died or hung",
                                            lines[0]), job.stderr


def test_the_wrong_number_of_ranks_for_a_model_ends_in_seconds(stories, tmp_path):
    cmd, env = launch_cmd("mpich", 3, *DEMO, "--ckpt_dir", stories / "pmx_2")
    rc, _, err, secs = run_job(cmd, tmp_path, env, timeout=60)
    assert rc != 0 and f"{stories / 'pmx_2'}: the model is split into 2 shard(s) but 3 rank(s) were started" in err


def test_the_wrong_number_of_ranks_for_a_dump_ends_in_seconds(stories, tmp_path):
    """benchmark.sh under -np 3 on a 2-rank dump used to hang forever (rank 2 left before MPI started). Whichever rank
    fails first says why: rank 2 finds no folder of its own, or the model's shards or the dump's ranks are 2."""
    env = {"MODEL_PATH": str(stories / "pmx_2"), "TEST_DATA_DIR": str(stories / "dump2"),
           "OUTPUT_DIR": str(tmp_path / "out"), "MIN_PROFILING_SECONDS": "0"}
    cmd, launch_env = launch_cmd("mpich", 3, ROOT / "scripts" / "benchmark.sh", 1)
    rc, _, err, secs = run_job(cmd, tmp_path, {**env, **launch_env}, timeout=60)
    assert rc != 0 and ("has no rank_2" in err or "split into 2 shard(s) but 3 rank(s)" in err or
                        "the dump was made on 2 rank(s), but 3 were started; replay it with -np 2" in err), err
    assert not (tmp_path / "out").exists()  # no empty rank folders


def test_a_rank_that_exits_unseen_by_the_launcher_ends_the_others_at_once(stories, tmp_path):
    """MPICH's launcher kills the other ranks when one exits, but can miss it (rank 0 would wait for the collective
    timeout). Here the launcher's proxy is stopped while rank 1 is killed (so it is left a zombie no one reaps): rank
    0's shared-memory wait sees it gone and ends, naming it."""
    cmd, env = launch_cmd("mpich", 2, *DEMO, "--ckpt_dir", stories / "pmx_2", *LONG)
    with Job(cmd, tmp_path, env) as job:
        rank0, victim = job.rank_pid(0), job.rank_pid(1)
        proxy = int(proc_stat(victim)[1])  # both ranks' parent
        job.wait_for("generating")
        time.sleep(0.5)
        os.kill(proxy, signal.SIGSTOP)  # (it forwards the ranks' output too: rank 0's message shows after SIGCONT)
        try:
            t0 = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            while proc_stat(rank0)[:1] not in (["Z"], []) and time.monotonic() - t0 < 2 * END_WITHIN:
                time.sleep(0.02)
            took = time.monotonic() - t0
        finally:
            os.kill(proxy, signal.SIGCONT)
        rc = ended_within(job, 60, t0)
    assert rc != 0 and took < 2.0, (took, job.stderr)
    assert re.fullmatch(rf"rank 0: error: rank 1 \(pid {victim}\) ended while rank 0 waited for it in "
                        r"(all_reduce|all_gather|reduce_norm)", error_lines(job.stderr, 0)[0]), job.stderr
