"""Serving: the OpenAI-compatible HTTP server (`python -m runner serve`) and the offline API (`LLM`)."""

from runner.serve.engine import CompletionOutput, Logprob, RequestOutput
from runner.serve.llm import LLM
from runner.serve.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
