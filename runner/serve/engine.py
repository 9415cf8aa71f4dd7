"""Requests over the engine core, for the server and the offline API: each completion (choice) of a request is a
sequence of the core (runner.engine.core), which batches, runs and samples them; here its text is detokenized,
stop strings and logprobs applied, and what each step added handed out as deltas.

Every rank runs the same LLMEngine on the same requests in the same order (the core samples the same tokens on
every rank). The offline API makes the same calls on every rank; the server's requests reach rank 0 only, so
before each step rank 0 sends the other ranks that step's events (requests added, cancelled) in one broadcast
(:class:`StepChannel`), and every rank applies them, then steps (:meth:`LLMEngine.follow` on ranks 1..N-1).
While idle, rank 0 sends a heartbeat every second, so the other ranks (waiting in a broadcast under the
communicator's watchdog) know it is alive.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Union

import torch

from runner.engine.core import EngineCore
from runner.engine.outputs import Output, logprobs
from runner.engine.scheduler import Sequence
from runner.engine.structured import Grammars, SpecError
from runner.errors import PmxError
from runner.kernels.reference import PAGE_SIZE
from runner.serve.params import ParamError, SamplingParams

HEARTBEAT_S = 1.0


class StepChannel:
    """Rank 0 -> every rank: a JSON message in one fixed-size broadcast (a second one for the rest of a long one)."""
    HEAD = 4096

    def __init__(self, comm, device: torch.device):
        self.comm, self.device = comm, device

    def _bcast(self, buf: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # NCCL moves device tensors only
            return self.comm.broadcast_(buf.to(self.device)).cpu()
        return self.comm.broadcast_(buf)

    def send(self, msg: dict) -> None:
        if self.comm.world_size == 1:
            return
        data = json.dumps(msg, separators=(",", ":")).encode()
        head = bytearray(self.HEAD)
        head[:8] = len(data).to_bytes(8, "little")
        first = data[:self.HEAD - 8]
        head[8:8 + len(first)] = first
        self._bcast(torch.frombuffer(head, dtype=torch.uint8))
        if len(data) > len(first):
            self._bcast(torch.frombuffer(bytearray(data[len(first):]), dtype=torch.uint8))

    def recv(self) -> dict:
        head = self._bcast(torch.zeros(self.HEAD, dtype=torch.uint8)).numpy().tobytes()
        n = int.from_bytes(head[:8], "little")
        data = head[8:8 + min(n, self.HEAD - 8)]
        if n > len(data):
            data += self._bcast(torch.zeros(n - len(data), dtype=torch.uint8)).numpy().tobytes()
        return json.loads(data)


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
    """What one step added to one completion (choice) of a request."""
    request_id: str
    index: int
    text: str
    token_ids: list
    logprobs: list                       # per new token: (token_id, logprob, [(id, logprob), ...]); [] if not asked
    finish_reason: Optional[str] = None  # stop | length | abort
    stop_reason: Union[str, int, None] = None
    usage: Optional[tuple] = None        # (prompt_tokens, completion_tokens) on the request's last delta
    prompt_logprobs: Optional[list] = None  # on the last delta, where asked: per prompt position after the first,
                                            # (token_id, logprob, [(id, logprob), ...])


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
class _Request:
    request_id: str
    prompt_ids: list
    params: SamplingParams
    arrival_time: float
    choices: list = field(default_factory=list)
    unfinished: int = 0           # completions (and the prompt's scoring, where prompt_logprobs) not yet done
    prompt_logprobs: Optional[list] = None  # the scored positions so far (prompt_logprobs)
    scoring: Optional[Sequence] = None      # the core sequence that scores the prompt


@dataclass(eq=False)
class _Choice:
    """A completion's state beside its core `Sequence` (kept in `Sequence.state`)."""
    request: _Request
    index: int
    detok: IncrementalDetokenizer
    text: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    sent_text: int = 0
    sent_tokens: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None
    last_token_at: Optional[float] = None


class LLMEngine:
    """Requests over an engine core; see the module docstring."""

    def __init__(self, core: EngineCore, tokenizer, eos_ids, metrics=None):
        self.core, self.tok, self.metrics = core, tokenizer, metrics
        self.eos_ids = frozenset(eos_ids)
        self.max_model_len = core.max_model_len
        self.channel = StepChannel(core.comm, core.model.device)
        self.requests: dict[str, _Request] = {}
        self._counted: dict[str, int] = {}
        self._grammars: Optional[Grammars] = None
        if metrics is not None:
            metrics.set(kv_pages_total=core.cache.rows // PAGE_SIZE, kv_page_tokens=PAGE_SIZE)
            self._gauges()

    # -- requests ----------------------------------------------------------------------------------------------
    def check(self, prompt_ids: list, params: SamplingParams) -> int:
        """The max_tokens a request gets; ParamError when it cannot run here. Reads only constants, so the
        HTTP thread may call it."""
        p = len(prompt_ids)
        if p >= self.max_model_len:
            raise ParamError("prompt", f"this model's maximum context length is {self.max_model_len} tokens; the "
                                       f"prompt has {p}, which leaves no room for a completion")
        try:
            self.core.check_prompt(prompt_ids, "the prompt")
        except PmxError as e:
            raise ParamError("prompt", str(e)) from None
        max_tokens = self.max_model_len - p if params.max_tokens is None else params.max_tokens
        if p + max_tokens > self.max_model_len:
            raise ParamError("max_tokens", f"this model's maximum context length is {self.max_model_len} tokens; "
                                           f"{p} in the prompt and {max_tokens} to generate make {p + max_tokens}")
        cache = self.core.scheduler.allocator
        if params.structured_outputs is not None:
            try:
                self.grammars().constraint(params.structured_outputs)
            except SpecError as e:
                raise ParamError("structured_outputs", str(e)) from None
        if not cache.fits(p + max_tokens):
            need, have = ((-(-(p + max_tokens) // PAGE_SIZE), cache.num_pages) if cache.paged else
                          (p + max_tokens, cache.rows))
            unit = f"KV-cache pages of {PAGE_SIZE} tokens" if cache.paged else "KV-cache rows"
            raise ParamError("max_tokens", f"{p} prompt tokens and {max_tokens} new ones need {need} {unit}; this "
                                           f"server's cache has {have} (--kv_cache_tokens)")
        return max_tokens

    def add_request(self, request_id: str, prompt_ids: list, params: SamplingParams,
                    arrival_time: Optional[float] = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        max_tokens = self.check(prompt_ids, params)
        req = _Request(request_id, list(prompt_ids), params,
                       time.monotonic() if arrival_time is None else arrival_time)
        seed = self.core.next_seed()  # (drawn on every rank alike, whether or not the request has its own)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        for i in range(params.n):
            choice = _Choice(req, i, IncrementalDetokenizer(self.tok, prompt_ids))
            constraint = None if params.structured_outputs is None else \
                self.grammars().constraint(params.structured_outputs)
            req.choices.append(self.core.add(prompt_ids, max_tokens, params.for_choice(i, seed), stops, state=choice,
                                             constraint=constraint))
        req.unfinished = params.n
        if params.prompt_logprobs is not None and len(prompt_ids) > 1:  # scored once, beside its completions
            req.prompt_logprobs = []
            req.scoring = self.core.add(prompt_ids, 0, all_logits=True, state=req)
            req.unfinished += 1
        elif params.prompt_logprobs is not None:
            req.prompt_logprobs = []
        self.requests[request_id] = req
        if self.metrics is not None:
            self.metrics.inc("prompt_tokens_total", len(prompt_ids) * params.n)
            self._gauges()

    def grammars(self) -> Grammars:
        """The structured-output compiler of this model's tokenizer (made on first use: it loads xgrammar)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tok, self.core.model.params.vocab_size, sorted(self.eos_ids))
        return self._grammars

    def cancel(self, request_id: str) -> list[Delta]:
        """Ends a request's unfinished completions with finish_reason "abort", freeing their cache."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        out = []
        if req.scoring is not None and req.scoring.finish_reason is None:
            self.core.finish(req.scoring, "abort")
            req.unfinished -= 1
            if req.unfinished == 0:  # (its completions were done)
                return [self._done(req, Delta(request_id, 0, "", [], []))]
        for seq in req.choices:
            if seq.state.finish_reason is None:
                seq.state.finish_reason = "abort"
                out.append(self._finish(seq))
        return out

    def cancel_all(self) -> list[Delta]:
        return [d for rid in list(self.requests) for d in self.cancel(rid)]

    def has_work(self) -> bool:
        return self.core.has_work()

    def num_waiting(self) -> int:
        return len(self.core.scheduler.waiting)

    # -- steps -------------------------------------------------------------------------------------------------
    def step(self) -> list[Delta]:
        """Runs one step; returns the completions' new text and tokens."""
        outs = self.core.step()
        now = time.monotonic()
        last = {o.seq.seq_id: i for i, o in enumerate(outs)}  # a sequence's step's last output hands on its text
        deltas = [d for d in (self._score(o) if o.seq.all_logits else self._accept(o, now, last[o.seq.seq_id] == i)
                              for i, o in enumerate(outs) if o.seq.all_logits or o.seq.state.finish_reason is None)
                  if d is not None]  # (a stop string may end a choice mid-step)
        if self.metrics is not None:
            s = self.core.scheduler
            self._count(preemptions_total=s.preemptions, prefix_cache_queries_total=s.allocator.queries,
                        prefix_cache_hits_total=s.allocator.hits, prefix_cache_tokens_saved_total=s.allocator.hits * PAGE_SIZE,
                        spec_decode_draft_tokens_total=self.core.proposed,
                        spec_decode_accepted_tokens_total=self.core.accepted)
            self.metrics.inc("steps_total")
            self._gauges()
        return deltas

    def apply(self, events: list) -> list[Delta]:
        """A step's events, on every rank: ("add", request id, prompt ids, SamplingParams[, arrival time]) or
        ("cancel", request id)."""
        out = []
        for e in events:
            if e[0] == "add":
                self.add_request(*e[1:])
            else:
                out += self.cancel(e[1])
        return out

    def step_with(self, events: list) -> list[Delta]:
        """Rank 0 of the server: sends the step's events to the other ranks, applies them, runs the step."""
        self.channel.send({"k": "step", "e": [["add", e[1], e[2], asdict(e[3])] if e[0] == "add" else list(e)
                                              for e in events]})
        deltas = self.apply(events)
        return deltas + (self.step() if self.has_work() else [])

    def heartbeat(self) -> None:
        self.channel.send({"k": "idle"})

    def _accept(self, o: Output, now: float, last: bool = True) -> Optional[Delta]:
        """One output token into its choice (o.finish: the sequence's finish reason at this token); `last`: the
        step's last output of the sequence, the one that hands on the step's text (a speculative step gives a
        sequence several tokens, then may finish it)."""
        seq, token = o.seq, o.token
        ch: _Choice = seq.state
        p = ch.request.params
        if self.metrics is not None:
            if ch.last_token_at is None:
                self.metrics.observe(ttft=[now - ch.request.arrival_time])
            else:
                self.metrics.observe(itl=[now - ch.last_token_at])
            self.metrics.inc("generation_tokens_total")
        ch.last_token_at = now
        if o.finish == "stop":  # a stop id or EOS: not part of the completion
            ch.finish_reason, ch.stop_reason = "stop", (token if token in p.stop_token_ids else None)
            return self._finish(seq)
        ch.token_ids.append(token)
        if p.logprobs is not None:
            ch.logprobs += logprobs(o.logits, [token], p.logprobs)
        new = ch.detok.add(token)
        ch.text += new
        if p.stop and new:
            self._match_stop(ch, len(new))
        if ch.finish_reason is None and o.finish == "length":
            ch.finish_reason = "length"
        if ch.finish_reason is not None:
            return self._finish(seq)
        return self._delta(ch) if last else None  # one delta a choice and step (a stream chunk holds it whole)

    def _score(self, o: Output) -> Optional[Delta]:
        """A chunk of a request's scored prompt (prompt_logprobs): row r of its logits predicts the token after
        position first + r; the request's last delta when the scoring was the last of it to finish."""
        seq, req = o.seq, o.seq.state
        logits = o.logits
        first = seq.computed - logits.shape[0]
        have = len(req.prompt_logprobs)  # (a preempted prompt is scored again from its start: only new rows count)
        end = min(seq.computed, len(req.prompt_ids) - 1)
        if end > have:
            req.prompt_logprobs += logprobs(logits[have - first: end - first], req.prompt_ids[have + 1: end + 1],
                                             req.params.prompt_logprobs)
        if seq.finish_reason is None:
            return None
        req.unfinished -= 1
        return self._done(req, Delta(req.request_id, 0, "", [], [])) if req.unfinished == 0 else None

    @staticmethod
    def _match_stop(ch: _Choice, new_len: int) -> None:
        p = ch.request.params
        longest = max(len(s) for s in p.stop)
        start = max(0, len(ch.text) - new_len - longest + 1)
        hits = [(i, s) for s in p.stop for i in [ch.text.find(s, start)] if i >= 0]
        if hits:
            i, s = min(hits)
            ch.text = ch.text[:i + (len(s) if p.include_stop_str_in_output else 0)]
            ch.finish_reason, ch.stop_reason = "stop", s

    def _delta(self, ch: _Choice) -> Optional[Delta]:
        p = ch.request.params
        hold = 0 if ch.finish_reason or not p.stop else max(len(s) for s in p.stop) - 1  # a stop may be forming
        upto = max(ch.sent_text, len(ch.text) - hold)
        text, ids, lps = ch.text[ch.sent_text:upto], ch.token_ids[ch.sent_tokens:], ch.logprobs[ch.sent_tokens:]
        ch.sent_text, ch.sent_tokens = upto, len(ch.token_ids)
        if not (text or ids or ch.finish_reason):
            return None
        return Delta(ch.request.request_id, ch.index, text, ids, lps, ch.finish_reason, ch.stop_reason)

    def _finish(self, seq: Sequence) -> Delta:
        ch: _Choice = seq.state
        req = ch.request
        self.core.finish(seq, ch.finish_reason)  # (a stop string or a cancel: the core still runs it)
        req.unfinished -= 1
        d = self._delta(ch)
        if req.unfinished == 0:
            self._done(req, d)
        if self.metrics is not None:
            self._gauges()
        return d

    def _done(self, req: _Request, d: Delta) -> Delta:
        """`d` becomes the request's last delta: its usage (and prompt logprobs); the request is forgotten."""
        del self.requests[req.request_id]
        d.usage = (len(req.prompt_ids), sum(len(s.state.token_ids) for s in req.choices))
        d.prompt_logprobs = req.prompt_logprobs
        if self.metrics is not None:
            reasons = {s.state.finish_reason for s in req.choices}
            self.metrics.inc("requests_total", label=next(r for r in ("abort", "length", "stop") if r in reasons))
        return d

    def _count(self, **totals: int) -> None:
        """Counters from the core's running totals: what they gained since the last step."""
        for name, total in totals.items():
            if total > self._counted.get(name, 0):
                self.metrics.inc(name, total - self._counted.get(name, 0))
            self._counted[name] = total

    def _gauges(self) -> None:
        s = self.core.scheduler
        unit = 1 if s.allocator.paged else PAGE_SIZE  # (an offset cache counts rows: in pages of PAGE_SIZE rows here)
        self.metrics.set(requests_waiting=len(s.waiting), requests_running=len(s.running),
                         kv_pages_used=s.allocator.used // unit, kv_pages_free=s.allocator.free // unit)

    # -- the other ranks of a server ---------------------------------------------------------------------------
    def follow(self, should_quit: Callable[[], bool] = lambda: False) -> dict:
        """Applies rank 0's events and runs its steps until it sends anything else, which is returned."""
        while True:
            msg = self.channel.recv()
            if msg["k"] == "step":
                self.apply([[*e[:3], SamplingParams(**e[3])] if e[0] == "add" else e for e in msg["e"]])
                if self.has_work():
                    self.step()
            elif msg["k"] != "idle":
                return msg
            if should_quit():
                return {"k": "quit"}
