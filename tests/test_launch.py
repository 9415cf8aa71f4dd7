"""Launch environment, threads, the collective timeout and the error path, without starting a job
(real jobs: test_faults.py)."""

from __future__ import annotations

import os

import pytest
import torch

from runner.errors import PmxError
from runner.parallel.comm import collective_timeout
from runner.parallel.job import Interrupted, JobControl, describe
from runner.parallel.launch import LaunchEnv, rank_from_environment, set_cpu_threads

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}


@pytest.mark.parametrize("environ,want", [
    ({}, (0, 1)), (TORCHRUN, (1, 2)), ({"PMI_RANK": "3", "PMI_SIZE": "4", "HYDRA_CONTROL_FD": "9"}, (3, 4)),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, (1, 2)), ({"RANK": "5"}, (0, 1)),
])
def test_rank_from_the_environment_alone(environ, want):
    assert rank_from_environment(environ) == want


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_threads_under_torchrun_ignore_its_default_of_one(restore_threads):
    cores = os.cpu_count()
    env = LaunchEnv("torchrun", 0, 1, 0, 1)
    assert set_cpu_threads(env, {**TORCHRUN, "OMP_NUM_THREADS": "1"}) == min(cores, len(os.sched_getaffinity(0)))
    assert set_cpu_threads(env, {**TORCHRUN, "OMP_NUM_THREADS": "1", "PMX_NUM_THREADS": "1"}) == 1
    assert set_cpu_threads(LaunchEnv("mpi", 0, 1, 0, 1), {"OMP_NUM_THREADS": "1"}) == 1  # a user's choice
    assert torch.get_num_threads() == 1
    assert set_cpu_threads(env, {"OMP_NUM_THREADS": "2,1"}) == 2
    with pytest.raises(PmxError, match="PMX_NUM_THREADS must be a positive integer, got 'many'"):
        set_cpu_threads(env, {"PMX_NUM_THREADS": "many"})


def test_collective_timeout_from_the_flag_or_the_environment():
    assert collective_timeout(None, {}) == 30 and collective_timeout(2.5, {"PMX_COLLECTIVE_TIMEOUT": "9"}) == 2.5
    assert collective_timeout(None, {"PMX_COLLECTIVE_TIMEOUT": "9"}) == 9
    with pytest.raises(PmxError, match="PMX_COLLECTIVE_TIMEOUT must be a number of seconds > 0, got 'soon'"):
        collective_timeout(None, {"PMX_COLLECTIVE_TIMEOUT": "soon"})


def test_an_error_is_one_line_with_the_rank(capfd, monkeypatch):
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    JobControl().report("bad thing")
    assert capfd.readouterr().err == "\nrank 1: error: bad thing\n"  # a line of its own beside rank 0's progress
    monkeypatch.delenv("PMI_RANK")
    monkeypatch.delenv("PMI_SIZE")
    JobControl().report("bad thing", details="Traceback\n  here")
    assert capfd.readouterr().err == "Traceback\n  here\nerror: bad thing\n"


def test_what_each_failure_reports():
    assert describe(PmxError("x: bad")) == ("x: bad", 2, None)
    assert describe(Interrupted(15))[:2] == ("terminated (SIGTERM)", 143)
    assert describe(KeyboardInterrupt())[:2] == ("interrupted (SIGINT)", 130)
    assert describe(FileNotFoundError(2, "No such file or directory", "/x/y")) == ("/x/y: No such file or directory",
                                                                                   2, None)
    try:
        {}["k"]
    except KeyError as e:
        message, code, details = describe(e)
    assert message == "KeyError: 'k'" and code == 1 and "test_launch.py" in details


def test_gloo_is_pointed_at_the_interface_towards_the_rendezvous_where_the_host_name_does_not_resolve(monkeypatch):
    """Under torchrun on a machine whose host name does not resolve, gloo would bind to loopback, which the other
    machines cannot reach: GLOO_SOCKET_IFNAME is set to the interface that routes to MASTER_ADDR, unless it is set
    or the host name resolves."""
    import socket

    from runner.parallel import dist
    loopback = dist.interface_of("127.0.0.1")
    if loopback is None:
        pytest.skip("this machine lists no interface holding 127.0.0.1")
    monkeypatch.setattr(socket, "gethostname", lambda: "pmx-no-such-host.invalid")
    environ = {}
    dist._gloo_interface_towards("127.0.0.1", environ)
    assert environ == {"GLOO_SOCKET_IFNAME": loopback}
    environ = {"GLOO_SOCKET_IFNAME": "eth9"}
    dist._gloo_interface_towards("127.0.0.1", environ)
    assert environ == {"GLOO_SOCKET_IFNAME": "eth9"}  # the user's choice stands
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    environ = {}
    dist._gloo_interface_towards("127.0.0.1", environ)
    assert environ == {}  # a host name that resolves: gloo finds its interface itself
