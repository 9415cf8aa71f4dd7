"""What a client sees of the engine's token deltas (runner.serve.engine.TokenDelta): each completion's text, decoded
token by token, its stop strings, and the deltas handed out, held back while a stop string may be forming; and the
results of the offline API, in vLLM's shape (RequestOutput, CompletionOutput, Logprob).

The server runs this in its front-end process, beside the HTTP handlers (the engine process only samples tokens):
a completion that a stop string ends is over for its client at once, and the engine is told to cancel it (it may
have run a step or two more by then; those tokens are dropped). The offline API runs it in-process, cancelling
before the next step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Union

from runner.serve.params import SamplingParams


@dataclass
class TokenDelta:
    """What one step added to one completion (choice) of a request, in tokens: the engine's side of a delta (the text,
    stop strings and what a client sees are runner.serve.output's)."""
    request_id: str
    index: int
    token_ids: list
    logprobs: list                       # per new token: (token_id, logprob, [(id, logprob), ...]); [] if not asked
    finish_reason: Optional[str] = None  # stop (EOS or a stop id) | length | abort | error
    stop_reason: Optional[int] = None    # the stop id that ended it (None for EOS)
    done: bool = False                   # the request's last delta: every part of it has finished in the engine
    prompt_logprobs: Optional[list] = None  # on the last delta, where asked: per prompt position after the first,
                                            # (token_id, logprob, [(id, logprob), ...])
    error: Optional[str] = None          # finish_reason "error": what failed

    def wire(self) -> tuple:
        """As a tuple, for a message to another process (runner.serve.channel); TokenDelta(*t) reads it back."""
        return (self.request_id, self.index, self.token_ids, self.logprobs, self.finish_reason, self.stop_reason,
                self.done, self.prompt_logprobs, self.error)


class IncrementalDetokenizer:
    """The new text of each new token, decoding a short window (a few tokens before the new ones) rather
    than the whole text: the window's first token decodes the same way in both halves, so their
    difference is exact; an incomplete UTF-8 character waits for the next token."""
    CONTEXT = 5

    def __init__(self, tokenizer, prompt_ids: list):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-(self.CONTEXT + 1):])
        self.prefix, self.read = max(len(self.ids) - self.CONTEXT, 0), len(self.ids)

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        if self.prefix > 64:  # keep the window short
            self.ids = self.ids[self.prefix:]
            self.prefix, self.read = 0, len(self.ids)
        return after[len(before):]


@dataclass
class Delta:
    """What one step added to one completion (choice) of a request, as its client sees it."""
    request_id: str
    index: int
    text: str
    token_ids: list
    logprobs: list                       # per new token: (token_id, logprob, [(id, logprob), ...]); [] if not asked
    finish_reason: Optional[str] = None  # stop | length | abort | error
    stop_reason: Union[str, int, None] = None
    usage: Optional[tuple] = None        # (prompt_tokens, completion_tokens) on the request's last delta
    prompt_logprobs: Optional[list] = None  # on the last delta, where asked: per prompt position after the first,
                                            # (token_id, logprob, [(id, logprob), ...])
    error: Optional[str] = None          # finish_reason "error": what failed


@dataclass
class Logprob:
    """vLLM's shape: one token's log-probability, its rank among the vocabulary, its text."""
    logprob: float
    rank: int
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list] = None      # per token: {token_id: Logprob}, the chosen token and the top ones
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's result (vLLM's shape): `outputs[i].text` and `.token_ids` per completion."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    outputs: list
    finished: bool = False
    prompt_logprobs: Optional[list] = None  # per prompt token: None for the first, then {token_id: Logprob}

    def apply(self, d: Delta, token_text: Callable[[int], str]) -> None:
        """Adds a delta of this request to its completion."""
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = [None] + [_entry(tid, lp, top, token_text) for tid, lp, top in d.prompt_logprobs]
        out = self.outputs[d.index]
        out.text += d.text
        out.token_ids += d.token_ids
        if d.logprobs:
            out.logprobs = out.logprobs or []
            for tid, lp, top in d.logprobs:
                out.logprobs.append(_entry(tid, lp, top, token_text))
                out.cumulative_logprob = (out.cumulative_logprob or 0.0) + lp
        if d.finish_reason:
            out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
        self.finished = all(o.finished() for o in self.outputs)


def _entry(tid: int, lp: float, top: list, token_text: Callable[[int], str]) -> dict:
    """{token_id: Logprob} of one position: the top ones ranked 1.., the chosen one (rank -1 when not among them)."""
    entry = {i: Logprob(v, r + 1, token_text(i)) for r, (i, v) in enumerate(top)}
    if tid not in entry:
        entry[tid] = Logprob(lp, -1, token_text(tid))
    return entry


@dataclass(eq=False)
class _Completion:
    index: int
    detok: IncrementalDetokenizer
    text: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    sent_text: int = 0
    sent_tokens: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None
    error: Optional[str] = None
    last_token_at: Optional[float] = None


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_len: int
    params: SamplingParams
    arrival: float
    completions: list
    prompt_logprobs: Optional[list] = None
    engine_done: bool = False  # the engine's last delta came (with the prompt logprobs, where asked)


class TextProcessor:
    """Token deltas -> text deltas, for the requests `add`ed to it. `metrics`: the front end's
    (runner.serve.metrics.FrontendMetrics: time to first token, inter-token latency, requests by finish reason), or
    None."""

    def __init__(self, tokenizer, metrics=None):
        self.tok, self.metrics = tokenizer, metrics
        self.requests: dict[str, _Request] = {}

    def add(self, request_id: str, prompt_ids: list, params: SamplingParams, arrival: Optional[float] = None) -> None:
        self.requests[request_id] = _Request(
            request_id, len(prompt_ids), params, time.monotonic() if arrival is None else arrival,
            [_Completion(i, IncrementalDetokenizer(self.tok, prompt_ids)) for i in range(params.n)])

    def forget(self, request_id: str, reason: Optional[str] = "abort") -> None:
        """Drops a request before its end (its client went away, the engine is told to cancel it: it counts as
        finished for `reason`; None: it never ran)."""
        if self.requests.pop(request_id, None) is not None and self.metrics is not None and reason is not None:
            self.metrics.finished(reason)

    def __len__(self) -> int:
        return len(self.requests)

    def process(self, token_deltas: Iterable[TokenDelta], now: Optional[float] = None
                ) -> tuple[list[Delta], list[tuple[str, int]]]:
        """The text deltas of a step's token deltas, and the completions (request id, index) that a stop string
        ended here while the engine still runs them: they are to be cancelled there."""
        now = time.monotonic() if now is None else now
        deltas, cancels = [], []
        for td in token_deltas:
            req = self.requests.get(td.request_id)
            if req is None:  # (finished here, or forgotten: the engine's last words on it)
                continue
            if td.done:
                req.engine_done, req.prompt_logprobs = True, td.prompt_logprobs
            c = req.completions[td.index] if 0 <= td.index < len(req.completions) else None
            d = None
            if c is not None and c.finish_reason is None:
                self._tokens(req, c, td, now)
                if c.finish_reason is None and td.finish_reason is not None:
                    c.finish_reason, c.stop_reason, c.error = td.finish_reason, td.stop_reason, td.error
                elif c.finish_reason is not None and td.finish_reason is None and not td.done:
                    cancels.append((req.request_id, c.index))
                d = self._delta(c, req)
            if td.done:  # an error or abort of the request as a whole ends every completion
                for other in req.completions:
                    if other.finish_reason is None:
                        other.finish_reason, other.error = td.finish_reason or "abort", td.error
                        deltas.append(self._delta(other, req))
            if d is not None:
                deltas.append(d)
            if all(x.finish_reason is not None for x in req.completions) and \
                    (req.params.prompt_logprobs is None or req.engine_done):
                last = deltas[-1] if deltas and deltas[-1].request_id == req.request_id else None
                done = self._done(req, last)
                if done is not last:
                    deltas.append(done)
        return deltas, cancels

    def _tokens(self, req: _Request, c: _Completion, td: TokenDelta, now: float) -> None:
        """Takes a delta's tokens into completion `c`, up to the one that completes a stop string."""
        p = req.params
        if self.metrics is not None and td.token_ids:
            self.metrics.observe_latency(ttft=now - req.arrival if c.last_token_at is None else None,
                                         itl=None if c.last_token_at is None else now - c.last_token_at,
                                         more=len(td.token_ids) - 1)
        if td.token_ids:
            c.last_token_at = now
        for k, token in enumerate(td.token_ids):
            c.token_ids.append(token)
            if td.logprobs:
                c.logprobs.append(td.logprobs[k])
            new = c.detok.add(token)
            c.text += new
            if p.stop and new and self._match_stop(c, p, len(new)):
                return

    @staticmethod
    def _match_stop(c: _Completion, p: SamplingParams, new_len: int) -> bool:
        longest = max(len(s) for s in p.stop)
        start = max(0, len(c.text) - new_len - longest + 1)
        hits = [(i, s) for s in p.stop for i in [c.text.find(s, start)] if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        c.text = c.text[:i + (len(s) if p.include_stop_str_in_output else 0)]
        c.finish_reason, c.stop_reason = "stop", s
        return True

    @staticmethod
    def _delta(c: _Completion, req: _Request) -> Optional[Delta]:
        p = req.params
        hold = 0 if c.finish_reason or not p.stop else max(len(s) for s in p.stop) - 1  # a stop may be forming
        upto = max(c.sent_text, len(c.text) - hold)
        text, ids, lps = c.text[c.sent_text:upto], c.token_ids[c.sent_tokens:], c.logprobs[c.sent_tokens:]
        c.sent_text, c.sent_tokens = upto, len(c.token_ids)
        if not (text or ids or c.finish_reason):
            return None
        return Delta(req.request_id, c.index, text, ids, lps, c.finish_reason, c.stop_reason, error=c.error)

    def _done(self, req: _Request, last: Optional[Delta]) -> Delta:
        """The request's last delta (`last`, or an empty one where it has none of its own this step): its usage and
        prompt logprobs; the request is forgotten."""
        del self.requests[req.request_id]
        d = last if last is not None else Delta(req.request_id, 0, "", [], [])
        d.usage = (req.prompt_len, sum(len(c.token_ids) for c in req.completions))
        d.prompt_logprobs = req.prompt_logprobs
        if self.metrics is not None:
            reasons = {c.finish_reason for c in req.completions}
            self.metrics.finished(next(r for r in ("error", "abort", "length", "stop") if r in reasons))
        return d
