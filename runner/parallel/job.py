"""How one process of a launched job reports a failure and ends (:class:`JobControl`, made first thing by
:func:`runner.cli.run`), so that a job never hangs and never loses the real message. Under mpirun it initialises MPI
on every rank before flags are read (MPICH's start-up waits for every rank: a rank that left before initialising MPI
would leave the others spinning there); SIGINT and SIGTERM become the error path, even while the main thread is
blocked in a collective; a failing rank prints its own message once, `rank R: error: ...`, and ends the whole job
(:func:`runner.parallel.launch.end_job`) without running a collective: its rank comes from the environment."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from typing import Iterator, NoReturn, Optional

from runner.errors import PmxError
from runner.parallel.launch import end_job, mpi, rank_from_environment, under_mpi

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
PEER_ENDED = "ended while rank"  # in the error of a shared-memory wait whose peer exited (cpu_comm.cpp's PEER_ENDED)
PEER_ENDED_CODE = 3              # as the collective timeout's (runner.parallel.watchdog)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; raised in the main thread so that clean-up code runs on the way out."""

    def __init__(self, signum: int):
        self.signum = signum
        how = "interrupted" if signum == signal.SIGINT else "terminated"
        super().__init__(f"{how} ({signal.Signals(signum).name})")


def exit_code(signum: int) -> int:
    return 128 + signum


class JobControl:
    def __init__(self, grace_s: Optional[float] = None):
        self.rank, self.world_size = rank_from_environment()
        # how long the main thread has to unwind (and clean up) after a signal before the watcher ends the job:
        # short when peers are waiting, longer for one process, whose temporary outputs it removes on the way
        self.grace_s = grace_s if grace_s is not None else (1.0 if self.world_size > 1 else 3.0)
        self._failing = threading.Lock()
        self._interrupted = False
        self._done = threading.Event()

    def start(self) -> "JobControl":
        """Initialises MPI under mpirun (every rank, before anything else can fail)."""
        if under_mpi():
            mpi()
        return self

    # -- signals ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def signals_handled(self) -> Iterator["JobControl"]:
        """SIGINT / SIGTERM become :class:`Interrupted` in the main thread, and the watcher ends the job
        `grace_s` later if the main thread has not. Handlers are restored on the way out (main thread only;
        elsewhere this does nothing)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        previous = {sig: signal.signal(sig, self._raise_interrupted) for sig in HANDLED_SIGNALS}
        previous_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._watcher, args=(r,), name="pmx-signals", daemon=True).start()
        try:
            yield self
        finally:
            self._done.set()
            signal.set_wakeup_fd(previous_fd)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(w)  # the watcher reads end-of-file and returns

    def _raise_interrupted(self, signum, frame) -> None:
        if not self._interrupted:  # once: a second Ctrl-C must not break the clean-up of the first
            self._interrupted = True
            raise Interrupted(signum)

    def _watcher(self, fd: int) -> None:
        """Runs beside the main thread: a signal that the main thread cannot act on in time (it is blocked
        in C, e.g. in an MPI collective) still ends the job."""
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while True:
                data = pipe.read(1)
                if not data:
                    return
                if data[0] in HANDLED_SIGNALS:
                    break
        if not self._done.wait(self.grace_s):  # the main thread did not end the job in time
            self.fail(str(Interrupted(data[0])), exit_code(data[0]), from_thread=True)

    # -- the error path -----------------------------------------------------------------------------
    def prefix(self) -> str:
        return f"rank {self.rank}: " if self.world_size > 1 else ""

    def report(self, message: str, details: Optional[str] = None) -> None:
        """One write of `details` (e.g. a traceback) and then `rank R: error: message` on a line of its own."""
        text = "".join(f"{self.prefix()}{ln}\n" for ln in (details or "").splitlines())
        text += f"{self.prefix()}error: {message}\n"
        if self.rank or _progress_bar_open():  # rank 0's progress bar may hold the current line: start a new one
            text = "\n" + text
        try:
            sys.stderr.flush()
            os.write(2, text.encode(errors="replace"))
        except OSError:
            pass

    def fail(self, message: str, code: int, details: Optional[str] = None, from_thread: bool = False) -> NoReturn:
        """Reports once and ends: the whole job when several ranks run, else this process (sys.exit, so
        that a caller in the same process can catch it)."""
        if not self._failing.acquire(blocking=False):  # another thread is already ending the process
            threading.Event().wait()
        self.report(message, details)
        if self.world_size > 1 or from_thread:
            end_job(code)
        sys.exit(code)


def _progress_bar_open() -> bool:
    tqdm = sys.modules.get("tqdm")
    return bool(tqdm and len(getattr(tqdm.tqdm, "_instances", ())))


def describe(exc: BaseException, skip: tuple[str, ...] = ()) -> tuple[str, int, Optional[str]]:
    """(message, exit code, traceback or None) for an exception reaching the top of a command. The traceback
    starts below the frames whose file name starts with one of `skip` (the dispatcher's: the command line, fire)."""
    if isinstance(exc, Interrupted):
        return str(exc), exit_code(exc.signum), None
    if isinstance(exc, KeyboardInterrupt):
        return str(Interrupted(signal.SIGINT)), exit_code(signal.SIGINT), None
    if isinstance(exc, PmxError):
        return str(exc), 2, None
    if isinstance(exc, RuntimeError) and PEER_ENDED in str(exc):  # another rank failed first: its message says why
        return str(exc).splitlines()[0], PEER_ENDED_CODE, None
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}", 2, None
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(skip):  # start at the command itself
        tb = tb.tb_next
    return f"{type(exc).__name__}: {exc}", 1, "".join(traceback.format_exception(type(exc), exc, tb))
