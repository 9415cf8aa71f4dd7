"""What a step's logits give its sequences (the engine core's output processor): speculative guesses verified, next
tokens sampled, scored prompts' rows handed over, finish reasons set; and the log-probabilities a caller asks for.

A step's logits hold one row per sequence (its last token's), or for a sequence marked `wide` one row per new token
(a scored prompt's chunk, or a decoding sequence with its guesses: the rows after its last token and after each
guess). In that order :meth:`OutputProcessor.process`:

1. verifies each sequence's guesses (runner.engine.sampler.Sampler.verify) and drops the rejected ones from its
   tokens, before the scheduler keys the pages they filled (prefix caching);
2. advances the scheduler (the cache now holds the step's tokens, less the rejected guesses);
3. hands over each scored prompt's rows, and ends a scored prompt once it is all in the cache ("length");
4. samples the next token of every sequence that is due one (the greedy ones together, in one argmax);
5. gives each verified sequence its accepted guesses, then the verified token.

A sequence ends on a stop id (not appended; a guessed stop ends it before the guess), at its max_len ("length"), or
where its sampling raises ("error", with the reason: one sequence's failure ends it, not the step of all); an ended
sequence leaves the scheduler and frees its cache at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from runner.engine.sampler import greedy_ids
from runner.engine.scheduler import Scheduler, Sequence, StepBatch

LOGPROB_FLOOR = -9999.0  # reported log-probabilities go no lower (JSON has no -inf)


@dataclass
class Output:
    """What one step gave one sequence: its new token (None for a scored prompt) and the logits it came from: rows
    `rows` of the step's logits (indexed only when asked for: a torch call per sequence and step costs). A step
    that verified guesses gives a sequence several, in order: `finish` is the sequence's finish reason at this
    token (None where it goes on past it; the sequence's own finish_reason is that of its last)."""
    seq: Sequence
    token: Optional[int]
    step_logits: torch.Tensor
    rows: object                 # an int, or a slice of a scored prompt's chunk
    finish: Optional[str] = None
    error: Optional[str] = None  # finish "error": why the sequence could not go on (its sampling raised)

    @property
    def logits(self) -> torch.Tensor:
        """[vocab], or [rows, vocab] of a scored prompt's chunk."""
        return self.step_logits[self.rows]


class OutputProcessor:
    """Turns a step's logits into its sequences' outputs (see the module docstring); counts speculative guesses
    verified (`proposed`) and accepted (`accepted`)."""

    def __init__(self):
        self.proposed = self.accepted = 0

    def process(self, batch: StepBatch, logits: torch.Tensor, wide: tuple, scheduler: Scheduler) -> list[Output]:
        """The outputs of a step that ran `batch` (`wide[i]`: item i has a row per new token) and gave `logits`."""
        first, last, verified = self._verify(batch, logits, wide)
        ready = scheduler.advance(batch, {sid: 1 + len(a) for sid, (a, _) in verified.items()})
        out = [Output(s, None, logits, slice(first[s.seq_id], first[s.seq_id] + n)) for s, n in batch.items
               if s.all_logits]
        for s in ready:
            if s.all_logits:  # a scored prompt is done once it is all in the cache
                _end(s, "length", scheduler)
        due = [s for s in ready if not s.all_logits and s.seq_id not in verified]
        if due:
            rows = logits if len(due) == len(batch.items) and not wide else logits[[last[s.seq_id] for s in due]]
            self._sample(due, rows, out, scheduler)
        for s in ready:
            if s.seq_id in verified:
                self._verified(s, *verified[s.seq_id], logits, first[s.seq_id], out, scheduler)
        return out

    def _verify(self, batch: StepBatch, logits: torch.Tensor, wide: tuple) -> tuple[dict, dict, dict]:
        """({seq_id: its first row}, {seq_id: its last row}, {seq_id: (accepted guesses, the token after them)}),
        the rejected guesses dropped from each verified sequence's tokens."""
        first, last, verified = {}, {}, {}
        row = 0
        for i, (s, n) in enumerate(batch.items):
            k = n if wide and wide[i] else 1
            first[s.seq_id], last[s.seq_id] = row, row + k - 1
            if s.proposal:
                a, t = s.sampler.verify(logits[row: row + k], s.proposal)
                del s.tokens[len(s.tokens) - len(s.proposal) + a:]
                verified[s.seq_id] = (s.proposal[:a], t)
                self.proposed, self.accepted = self.proposed + len(s.proposal), self.accepted + a
                s.proposal = []
            row += k
        return first, last, verified

    @staticmethod
    def _sample(due: list, logits: torch.Tensor, out: list, scheduler: Scheduler) -> None:
        """The next token of each sequence in `due` from its row of `logits`: greedy rows in one argmax, sampled rows
        by their own samplers, structured output masked by its grammar."""
        greedy = [k for k, s in enumerate(due) if s.sampler.plain_greedy and s.constraint is None]
        ids = [0] * len(due)
        if greedy:
            for k, t in zip(greedy, greedy_ids(logits if len(greedy) == len(due) else logits[greedy])):
                ids[k] = t
        for k, s in enumerate(due):
            try:
                if s.constraint is not None:  # structured output: only what the grammar allows next
                    ids[k] = int(s.sampler(s.constraint.mask(logits[k])[None])[0])
                    _take(s, ids[k], out, logits, k, scheduler, stop=s.constraint.accept(ids[k]))
                    continue
                if not s.sampler.plain_greedy:
                    ids[k] = int(s.sampler(logits[k:k + 1])[0])
            except Exception as e:  # noqa: BLE001 - one sequence's failure ends it, not the step of all
                _end(s, "error", scheduler)
                out.append(Output(s, None, logits, k, "error", f"{type(e).__name__}: {e}"))
                continue
            _take(s, ids[k], out, logits, k, scheduler)

    @staticmethod
    def _verified(s: Sequence, accepted: list, t: int, logits: torch.Tensor, row: int, out: list,
                  scheduler: Scheduler) -> None:
        """A verified sequence's accepted guesses (already in its tokens), then the verified token."""
        base = len(s.tokens) - len(accepted)
        for j, x in enumerate(accepted):
            if x in s.stop_ids:  # a guessed stop: the sequence ends before it, as if it had sampled it
                del s.tokens[base + j:]
                s.finish_reason = "stop"
            elif base + j + 1 >= s.max_len:
                s.finish_reason = "length"
            out.append(Output(s, x, logits, row + j, s.finish_reason))
            if s.finish_reason is not None:
                scheduler.remove(s)
                return
        _take(s, t, out, logits, row + len(accepted), scheduler)


def _take(s: Sequence, t: int, out: list, logits: torch.Tensor, row, scheduler: Scheduler, stop: bool = False) -> None:
    """Sequence s sampled token t: appended, or a stop; it ends on a stop id (or `stop`) or at its max_len."""
    if stop or t in s.stop_ids:
        s.finish_reason = "stop"
    else:
        s.tokens.append(t)
        if len(s.tokens) >= s.max_len:
            s.finish_reason = "length"
    if s.finish_reason is not None:
        scheduler.remove(s)
    out.append(Output(s, t, logits, row, s.finish_reason))


def _end(s: Sequence, reason: str, scheduler: Scheduler) -> None:
    s.finish_reason = s.finish_reason or reason
    scheduler.remove(s)


def logprobs(logits: torch.Tensor, ids: list, k: int) -> list:
    """(token_id, logprob, top k [(id, logprob)]) of ids[r] under logits[r] ([rows, vocab]), each row; a
    log-probability below LOGPROB_FLOOR reads as it."""
    lp = torch.log_softmax(logits.float().reshape(len(ids), -1), -1)
    chosen = lp[torch.arange(len(ids)), torch.tensor(ids)].tolist()
    top = lp.topk(k) if k else None
    return [(t, max(c, LOGPROB_FLOOR), [] if top is None else
             [(i, max(v, LOGPROB_FLOOR)) for i, v in zip(top.indices[r].tolist(), top.values[r].tolist())])
            for r, (t, c) in enumerate(zip(ids, chosen))]
