"""pmx-runner: a tensor-parallel LLM inference runner built around the PMX model-exchange format.

`from runner import LLM, SamplingParams` is the offline API (see `runner.serve`); it loads on first use.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name in __all__:
        from runner import serve
        return getattr(serve, name)
    raise AttributeError(f"module 'runner' has no attribute {name!r}")
