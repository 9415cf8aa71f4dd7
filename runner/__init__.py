"""pmx-runner: a tensor-parallel LLM inference runner built around the PMX model-exchange format."""

__version__ = "0.1.0"
