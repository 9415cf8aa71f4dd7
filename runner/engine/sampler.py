"""Sampling: greedy (temperature 0), temperature, top-k, top-p (nucleus) and min-p, with a seeded generator; and what
a request may do to the logits first: a bias per token, and repetition, frequency and presence penalties over the
tokens so far (vLLM's and OpenAI's meaning; the parameters: runner.engine.sampling_params). Every admitted value is
numerically safe: the logits are shifted by their maximum before any division, and whatever an extreme value makes
non-finite is read as the most (+inf) or least (NaN, -inf) likely, never left to reach the draw. A row of logits that
are all NaN is a broken model, not a sampling choice: it raises NonFiniteLogits (the server ends that sequence alone
with finish 'error'; a batch job stops with the message)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from runner.engine.sampling_params import SamplingParams

__all__ = ["SamplingParams", "Sampler", "NonFiniteLogits", "greedy_ids"]


class NonFiniteLogits(RuntimeError):
    """The model's logits hold NaN: its weights or activations are not finite (a corrupt checkpoint, an overflow)."""

FLOAT_MAX = torch.finfo(torch.float32).max


def greedy_ids(logits: torch.Tensor) -> list:
    """The index of each row's largest logit (the first where tied) of logits [B, V]: numpy's argmax on CPU (a torch
    call right after a decode step costs several times more than numpy's), torch's elsewhere."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return (logits.detach() if logits.requires_grad else logits).numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


class Sampler:
    """One sequence's sampling: greedy at temperature 0, else from softmax(logits / temperature) cut to the top k, the
    top p and min p, drawn with the sequence's own seeded generator. `history`: the sequence's tokens (its prompt's
    `prompt_len` first, then what it generated; the caller's list, read at each draw), which the penalties count."""

    def __init__(self, params: SamplingParams, history: Optional[Sequence[int]] = None, prompt_len: int = 0):
        self.params, self.history, self.prompt_len = params, history, prompt_len
        self.gen = torch.Generator() if params.temperature != 0 else None  # (greedy draws nothing)
        if self.gen is not None and params.seed is not None:
            self.gen.manual_seed(params.seed)
        elif self.gen is not None:
            self.gen.seed()

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the model's logits as they are (what a batch's greedy rows take at once)."""
        return self.params.temperature == 0 and not self.params.adjusts

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> float32 CPU logits after the bias and the penalties, every value finite or -inf (an
        overflow to +inf reads as the largest float, NaN as -inf); a row of NaN alone raises NonFiniteLogits."""
        p = self.params
        out = logits.float().cpu()
        nan_rows = out.isnan().all(-1)  # (a row with no number in it has nothing to draw from)
        if nan_rows.any():
            raise NonFiniteLogits(f"the model's logits are all NaN in {int(nan_rows.sum())} of {out.shape[0]} "
                                  "row(s): its weights or activations are not finite (check the checkpoint, or try "
                                  "--dtype float32)")
        if not p.adjusts:
            return out
        out = out.clone()
        vocab = out.shape[-1]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.long)
            out[:, ids] += torch.tensor([b for t, b in p.logit_bias if t < vocab])
        hist = [t for t in (self.history or ()) if 0 <= t < vocab]
        if hist and p.repetition_penalty != 1:
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[torch.tensor(hist, dtype=torch.long)] = True
            r = p.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
        gen = hist[min(self.prompt_len, len(hist)):] if hist else []
        if gen and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(gen, dtype=torch.long), minlength=vocab).float()
            out = out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        return out.nan_to_num(nan=float("-inf"), posinf=FLOAT_MAX)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> the distribution [B, V] float32 (CPU) that a token is drawn from (temperature > 0)."""
        p = self.params
        raw = self.adjust(logits)
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
        if p.min_p > 0:  # (the largest probability is at least 1 / V: the cut never empties a row)
            probs = probs.masked_fill(probs < p.min_p * probs.amax(-1, keepdim=True), 0.0)
        if p.top_p < 1:
            sorted_p, idx = probs.sort(-1, descending=True)
            mass = p.top_p if p.min_p == 0 else p.top_p * sorted_p.sum(-1, keepdim=True)  # (min_p took some away)
            drop = sorted_p.cumsum(-1) - sorted_p > mass  # keep the smallest prefix whose mass reaches top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        bad = ~(probs.isfinite().all(-1) & (probs.sum(-1) > 0))  # rows of inf logits, or every logit -inf
        if bad.any():  # such a row takes its greedy token (NaN read as -inf), never an exception that ends the step
            best = raw[bad].nan_to_num(nan=float("-inf")).argmax(-1)
            probs[bad] = torch.nn.functional.one_hot(best, probs.shape[-1]).to(probs.dtype)
        if p.top_p < 1 or p.min_p > 0:  # (what the cuts kept sums to 1 again: verify reads probabilities)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] float32 -> next tokens [B] int64."""
        if self.params.temperature == 0:
            return self.adjust(logits).argmax(-1) if self.params.adjusts else logits.argmax(-1)
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
