"""The collective timeout's enforcer: a collective that outlives it (a peer has died or hangs, which leaves MPI,
gloo or the shared-memory wait blocked) ends the job with a message naming the collective, exit status 3."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch

from runner.parallel.job import JobControl


class Watchdog:
    """Kills this process if a guarded section outlives its deadline; a thread of its own checks."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._section: tuple[str, float] | None = None  # (what, since): set and read whole, so no lock
        threading.Thread(target=self._watch, name="pmx-watchdog", daemon=True).start()

    @contextmanager
    def guard(self, what: str):
        self._section = (what, time.monotonic())
        try:
            yield
        finally:
            self._section = None

    def guarded(self, what: str, collective, *args):
        """collective(*args) under a guard; a compiled step runs its collectives under one guard (`guard`)."""
        if torch.compiler.is_compiling():
            return collective(*args)
        with self.guard(what):
            return collective(*args)

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            section = self._section
            if section is not None and time.monotonic() - section[1] > self.timeout_s:
                JobControl().fail(f"{section[0]} did not complete within {self.timeout_s:g}s (--collective_timeout); "
                                  f"another rank has probably died or hung", 3, from_thread=True)
