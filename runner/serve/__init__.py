"""Serving: the OpenAI-compatible HTTP server (`python -m runner serve`, `runner.serve.server`) and the
offline API (`LLM`, `SamplingParams`, in vLLM's shape). Exports load on first use (they import torch)."""

_EXPORTS = {"LLM": "runner.serve.llm", "SamplingParams": "runner.serve.params",
            "RequestOutput": "runner.serve.output", "CompletionOutput": "runner.serve.output",
            "Logprob": "runner.serve.output"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'runner.serve' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_EXPORTS[name]), name)
