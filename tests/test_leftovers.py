"""Runs last (tests/conftest.py orders it so): the suite left nothing in /dev/shm or /tmp, e.g. MPICH's segments
(scripts/mpirun.sh, runner.parallel.launch.end_job), torchrun's log directories (scripts/torchrun.sh), temporary
files of a command or a test."""

from __future__ import annotations

import pytest

from conftest import AT_START, suite_leftovers


def test_the_suite_left_nothing_in_dev_shm_or_tmp(request):
    if AT_START not in request.config.stash:
        pytest.skip("PMX_TEST_LEFTOVERS_CHECK=0: a suite run inside another one, whose run makes this check")
    left = suite_leftovers(request.config.stash[AT_START])
    assert not left, f"left behind by the test suite (nothing holds them): {left}"
