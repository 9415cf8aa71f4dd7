"""`scripts/torchrun.sh` (`python -m runner.parallel.torchrun`): torchrun as this project launches it, with torchrun's
own flags and exit status, less three things that get in a user's way:

- the OMP_NUM_THREADS banner on every run: torchrun sets the variable to 1 for its workers when it is unset, and
  says so; the runner gives each rank cores / local ranks threads itself (runner.parallel.launch.set_cpu_threads
  ignores torchrun's 1), so 1 is set here beforehand, quietly (a value already set is kept, and honoured);
- a /tmp/torchelastic_* directory left by every run: without --log-dir torchrun makes one for its workers' error
  files and never removes it; here it is a temporary directory removed when torchrun ends;
- a 25-line traceback of the agent when it is stopped by a signal (SIGTERM, Ctrl-C) or a worker fails: one line
  instead, the ranks' own messages being above it.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    log_dir = None
    if not any(a.split("=")[0] in ("--log-dir", "--log_dir") for a in argv):
        log_dir = tempfile.mkdtemp(prefix="torchelastic_")
        argv = ["--log-dir", log_dir, *argv]
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    try:
        torchrun(argv)
        return 0
    except SignalException as e:
        print(f"torchrun: stopped by {e.sigval.name}; its workers were stopped with it", file=sys.stderr, flush=True)
        return 1
    except ChildFailedError as e:
        failures = sorted(e.failures.items())
        own = [(r, f) for r, f in failures if f.exitcode != -signal.SIGTERM]  # not those the agent stopped after them
        failed = ", ".join(f"rank {r} (exit code {f.exitcode})" for r, f in (own or failures))
        stopped = len(failures) - len(own) if own else 0
        print(f"torchrun: {e.name} failed on {failed}" + (f"; {stopped} other rank(s) stopped with it" if stopped
                                                           else ""), file=sys.stderr, flush=True)
        return 1
    finally:
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
