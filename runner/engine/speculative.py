"""Speculative decoding's proposers: guesses of the next few tokens of a decoding sequence, which the engine core
verifies in one step over all of them (runner.engine.core; acceptance in runner.engine.sampler.Sampler.verify).

- :class:`NgramProposer` (prompt lookup, as vLLM's "ngram" and llama.cpp's lookup decoding): the tokens that followed
  the most recent earlier occurrence of the sequence's last n tokens, longest n first. Free to compute; it pays where
  text repeats (editing, extraction, code).
- :class:`DraftProposer` (a draft model, as vLLM's draft_model and llama.cpp's --model-draft): a small model of the
  same tokenizer decodes k tokens greedily. It pays where the draft agrees with the target often and costs far less.

Both guess deterministically (the draft greedily), so the sampler verifies them as one-hot drafts: at temperature 0
the tokens are the target's own, above it rejection sampling keeps the target's distribution.
"""

from __future__ import annotations

from array import array
from typing import Optional

import torch

from runner.config import EngineConfig
from runner.engine.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0)


class NgramProposer:
    def __init__(self, k: int, n_max: int, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"prompt lookup needs 1 <= min <= max n-gram sizes, got {n_min} and {n_max}")
        self.k, self.n_max, self.n_min = k, n_max, n_min

    def propose(self, tokens: list) -> list:
        """Up to k tokens after the latest earlier match of tokens' last n (n from n_max down to n_min)."""
        hay = array("i", tokens).tobytes()  # token ids as 4-byte words: bytes.rfind searches in C
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            needle, end = hay[-4 * n:], 4 * (len(tokens) - 1)  # a match ends before the last token
            while (b := hay.rfind(needle, 0, end)) >= 0:
                if b % 4 == 0:  # on a token boundary
                    return tokens[b // 4 + n: b // 4 + n + self.k]
                end = b + 4 * n - 1
        return []

    def propose_all(self, seqs: list) -> list:
        return [self.propose(s.tokens) for s in seqs]

    def reserve(self, rows: int) -> None:
        pass


class DraftProposer:
    """Guesses from a draft model's own engine core (runner.engine.core.EngineCore over the whole draft model on
    this rank: no collective). It keeps a draft sequence per target sequence; before each guess the draft sequence
    takes the target's tokens, keeping in its cache the rows they still agree on (after a rejection, the tail is
    computed again), then the draft core runs k greedy steps for all of them at once. The ranks may differ in the
    last bit of a float, so rank 0's guesses are broadcast: every rank verifies the same ones."""

    def __init__(self, draft, k: int, comm):
        self.draft, self.k, self.comm = draft, k, comm
        self._of: dict = {}  # target seq_id -> its draft Sequence

    def reserve(self, rows: int) -> None:
        """The target's cache was made anew (between runs): the draft's too, as many rows."""
        for d in self._of.values():
            if d.finish_reason is None:
                self.draft.finish(d, "abort")
        self._of.clear()
        self.draft.reserve(rows)

    def propose_all(self, seqs: list) -> list:
        want = {s.seq_id for s in seqs}
        for sid, d in list(self._of.items()):  # targets that ended, or that do not guess this step
            if sid not in want or d.finish_reason is not None:
                if d.finish_reason is None:
                    self.draft.finish(d, "abort")
                del self._of[sid]
        for s in seqs:
            d = self._of.get(s.seq_id)
            if d is None:
                if len(s.tokens) >= self.draft.max_model_len:
                    continue
                try:
                    self._of[s.seq_id] = self.draft.add(s.tokens, s.max_len - len(s.tokens), GREEDY)
                except ValueError:  # more than the draft's cache holds: no guesses for it
                    pass
                continue
            same = _common_prefix(d.tokens, s.tokens)
            d.tokens[:] = s.tokens
            d.computed = min(d.computed, same)
        for _ in range(self.k):  # (a sequence that is new to the draft spends its first step on its prompt)
            if not self.draft.has_work():
                break
            self.draft.step()
        out = [self._of[s.seq_id].tokens[len(s.tokens): len(s.tokens) + self.k] if s.seq_id in self._of else []
               for s in seqs]
        return self._agreed(out)

    def _agreed(self, out: list) -> list:
        if self.comm.world_size == 1:
            return out
        t = torch.full((len(out), self.k), -1, dtype=torch.int64)
        for i, g in enumerate(out):
            t[i, :len(g)] = torch.tensor(g, dtype=torch.int64)
        dev = self.draft.model.device
        t = self.comm.broadcast_(t.to(dev) if dev.type == "cuda" else t).cpu()
        return [[x for x in row if x >= 0] for row in t.tolist()]


def _common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def propose(proposer, running: list) -> list:
    """Each decoding sequence's guessed tokens, appended to its tokens (the step verifies them); returns the sequences
    that guessed. Sequences that score a prompt, follow a grammar, adjust their logits by the tokens so far
    (penalties) or are at their max_len do not guess."""
    cands = [s for s in running  # (penalties count the tokens so far: no guesses among them)
             if s.decoding and not s.all_logits and s.constraint is None and not s.sampler.params.adjusts
             and s.max_len - len(s.tokens) > 0]
    proposing = []
    for s, guess in zip(cands, proposer.propose_all(cands) if cands else ()):
        s.proposal = guess[: s.max_len - len(s.tokens)]
        if s.proposal:
            s.tokens += s.proposal
            proposing.append(s)
    return proposing


def drop_unscheduled(batch, proposing: list) -> None:
    """Guesses the step does not take (its budget cut them, or the sequence was preempted) are dropped."""
    fed = {s.seq_id: n for s, n in batch.items}
    for s in proposing:
        keep = max(fed.get(s.seq_id, 0) - 1, 0)
        if keep < len(s.proposal):
            del s.tokens[len(s.tokens) - len(s.proposal) + keep:]
            s.proposal = s.proposal[:keep]


def make_proposer(config: EngineConfig, comm, draft=None) -> Optional[object]:
    """The proposer --speculative asks for (None: off); `draft` is the draft model's engine core."""
    if config.speculative == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)
    if config.speculative == "draft":
        return DraftProposer(draft, config.num_speculative_tokens, comm)
    return None
