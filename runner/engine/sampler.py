"""Sampling: greedy (temperature 0), temperature, top-k and top-p (nucleus), with a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from runner.errors import PmxError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0: greedy
    top_k: int = 0             # 0: no top-k cut
    top_p: float = 1.0         # 1: no nucleus cut
    seed: Optional[int] = None

    def __post_init__(self):
        if self.temperature < 0:
            raise PmxError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise PmxError(f"--top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise PmxError(f"--top_p must be in (0, 1], got {self.top_p}")


def greedy_ids(logits: torch.Tensor) -> list:
    """The index of each row's largest logit (the first where tied) of logits [B, V]: numpy's argmax on CPU (a torch
    call right after a decode step costs several times more than numpy's), torch's elsewhere."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return (logits.detach() if logits.requires_grad else logits).numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.gen = torch.Generator() if params.temperature != 0 else None  # (greedy draws nothing)
        if self.gen is not None and params.seed is not None:
            self.gen.manual_seed(params.seed)
        elif self.gen is not None:
            self.gen.seed()

    def ids(self, logits: torch.Tensor) -> list:
        """logits [B, V] float32 -> next token ids, a list of B ints."""
        return greedy_ids(logits) if self.params.temperature == 0 else self(logits).tolist()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] float32 -> next tokens [B] int64."""
        p = self.params
        if p.temperature == 0:
            return logits.argmax(-1)
        logits = logits.float().cpu() / p.temperature
        if p.top_k:
            kth = logits.topk(min(p.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if p.top_p < 1:
            sorted_p, idx = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > p.top_p  # keep the smallest prefix whose mass reaches top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        return torch.multinomial(probs, 1, generator=self.gen).view(-1)
