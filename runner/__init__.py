"""pmx-runner: a tensor-parallel LLM inference runner built around the PMX model-exchange format.

`from runner import LLM, SamplingParams` is the offline API (see `runner.serve`); it loads on first use.
"""

import os

# OpenMP threads that wait at the end of a parallel region sleep at once instead of spinning for ~300k rounds
# (libgomp's default). A decode step runs ~60 short regions; when another process shares the cores, a spinning
# thread holds the core the thread it waits for needs, and batch-1 decode fell 10-20x beside one busy process.
# Read by libgomp when it loads, so only when runner is imported before torch (the CLI, the server); a value
# the user set is kept (OMP_WAIT_POLICY=ACTIVE brings the spinning back).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name in __all__:
        from runner import serve
        return getattr(serve, name)
    raise AttributeError(f"module 'runner' has no attribute {name!r}")
