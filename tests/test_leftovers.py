"""Runs last (tests/conftest.py orders it so): the suite left nothing in /dev/shm or /tmp, e.g. MPICH's segments
(scripts/mpirun.sh, runner.parallel.launch.end_job), torchrun's log directories (scripts/torchrun.sh), temporary
files of a command or a test."""

from __future__ import annotations

from conftest import AT_START, leftovers


def test_the_suite_left_nothing_in_dev_shm_or_tmp(request, tmp_path_factory):
    base = tmp_path_factory.getbasetemp()  # /tmp/pytest-of-USER/pytest-N: pytest's own, kept by its design
    left = [p for p in leftovers(request.config.stash[AT_START]) if p not in (str(base), str(base.parent))]
    assert not left, f"left behind by the test suite (nothing holds them): {left}"
