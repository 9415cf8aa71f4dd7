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
    """One sequence's sampling: greedy at temperature 0, else from softmax(logits / temperature) cut to the top k and
    the top p, drawn with the sequence's own seeded generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.gen = torch.Generator() if params.temperature != 0 else None  # (greedy draws nothing)
        if self.gen is not None and params.seed is not None:
            self.gen.manual_seed(params.seed)
        elif self.gen is not None:
            self.gen.seed()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> the distribution [B, V] float32 (CPU) that a token is drawn from (temperature > 0)."""
        p = self.params
        raw = logits.float().cpu()
        # Shifted so that each row's largest logit is 0 before dividing: no temperature, however small (1e-300) or
        # large, can overflow it (the largest stays 0, the rest go to -inf at worst, so softmax stays a
        # distribution).
        # The top-k cut is taken before dividing (the same set: temperature > 0 keeps the order), so a huge
        # temperature that flattens every shifted logit to 0 cannot widen it.
        logits = raw - raw.amax(-1, keepdim=True)
        if p.top_k:
            kth = logits.topk(min(p.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        logits = logits / p.temperature
        probs = logits.softmax(-1)
        if p.top_p < 1:
            sorted_p, idx = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > p.top_p  # keep the smallest prefix whose mass reaches top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        bad = ~(probs.isfinite().all(-1) & (probs.sum(-1) > 0))  # rows of NaN/inf logits, or every logit -inf
        if bad.any():  # such a row takes its greedy token (NaN read as -inf), never an exception that ends the step
            best = raw[bad].nan_to_num(nan=float("-inf")).argmax(-1)
            probs[bad] = torch.nn.functional.one_hot(best, probs.shape[-1]).to(probs.dtype)
        return probs

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] float32 -> next tokens [B] int64."""
        if self.params.temperature == 0:
            return logits.argmax(-1)
        return torch.multinomial(self.probs(logits), 1, generator=self.gen).view(-1)

    def verify(self, logits: torch.Tensor, proposal: list, draft_probs: Optional[torch.Tensor] = None
               ) -> tuple[int, int]:
        """Speculative decoding: logits [m + 1, V] of the positions after the last token and after each of the m
        proposed tokens. Returns (how many proposals are accepted, the token after them). Greedy: the proposals that
        equal the argmax, then the argmax. Sampled (Leviathan et al.): proposal x_j is accepted with probability
        min(1, p_j(x) / q_j(x)), q the draft's distribution (one-hot for a deterministic proposer: n-gram), and a
        rejection draws from max(0, p_j - q_j) renormalised; so each token follows p exactly as sampling one at a
        time would."""
        if self.params.temperature == 0:
            best = greedy_ids(logits)
            a = next((j for j, x in enumerate(proposal) if best[j] != x), len(proposal))
            return a, best[a]
        p = self.probs(logits)
        for j, x in enumerate(proposal):
            q = draft_probs[j] if draft_probs is not None else None
            ratio = p[j, x] if q is None else p[j, x] / q[x].clamp_min(1e-30)
            if float(torch.rand((), generator=self.gen)) < float(ratio):
                continue
            residual = p[j].clone()
            if q is None:
                residual[x] = 0
            else:
                residual = (residual - q).clamp_min_(0)
            if not residual.sum() > 0:  # (rounding: p and q alike everywhere)
                residual = p[j]
            return j, int(torch.multinomial(residual, 1, generator=self.gen))
        return len(proposal), int(torch.multinomial(p[-1], 1, generator=self.gen))
