"""Requests over the engine core, for the server and the offline API: each completion (choice) of a request is a
sequence of the core (runner.engine.core), which batches, runs and samples them; here their logprobs are taken and
what each step added handed out as token deltas (their text, stop strings and what a client sees:
runner.serve.output, in the server's front-end process).

Every rank runs the same LLMEngine on the same requests in the same order (the core samples the same tokens on
every rank). The offline API makes the same calls on every rank; the server's requests reach rank 0 only, so
before each step rank 0 sends the other ranks that step's events (requests added, cancelled) in one broadcast
(:class:`StepChannel`), and every rank applies them, then steps (:meth:`LLMEngine.follow` on ranks 1..N-1).
While idle, rank 0 sends a heartbeat every second, so the other ranks (waiting in a broadcast under the
communicator's watchdog) know it is alive.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from runner.engine.core import EngineCore
from runner.engine.outputs import Output, logprobs
from runner.engine.scheduler import Sequence
from runner.engine.structured import Grammars, SpecError
from runner.errors import PmxError
from runner.kernels.reference import PAGE_SIZE
from runner.serve.output import TokenDelta
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
        return self.comm.wait_broadcast_(buf)  # (ranks 1..N-1 wait here while the server idles)

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


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_ids: list
    params: SamplingParams
    choices: list = field(default_factory=list)
    unfinished: int = 0           # completions (and the prompt's scoring, where prompt_logprobs) not yet done
    prompt_logprobs: Optional[list] = None  # the scored positions so far (prompt_logprobs)
    scoring: Optional[Sequence] = None      # the core sequence that scores the prompt


@dataclass(eq=False)
class _Choice:
    """A completion's state beside its core `Sequence` (kept in `Sequence.state`): what the step added to it."""
    request: _Request
    index: int
    new: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None
    error: Optional[str] = None


class LLMEngine:
    """Requests over an engine core, in tokens; see the module docstring. `stats`: the engine's counters and gauges
    (runner.serve.metrics.EngineStats), or None."""

    MAX_FAILED_STEPS = 3  # steps in a row that raise before the engine gives up (one is a request's bad luck)

    def __init__(self, core: EngineCore, tokenizer, eos_ids, stats=None):
        self.core, self.tok, self.stats = core, tokenizer, stats
        self.eos_ids = frozenset(eos_ids)
        self.max_model_len = core.max_model_len
        self.vocab_size = core.model.params.vocab_size
        self.channel = StepChannel(core.comm, core.model.device)
        self.requests: dict[str, _Request] = {}
        self._counted: dict[str, int] = {}
        self._grammars: Optional[Grammars] = None
        self._failed_steps = 0
        if stats is not None:
            stats.set(kv_pages_total=core.cache.rows // PAGE_SIZE, kv_page_tokens=PAGE_SIZE)
            self._gauges()

    # -- requests ----------------------------------------------------------------------------------------------
    def check(self, prompt_ids: list, params: SamplingParams) -> int:
        """The max_tokens a request gets; ParamError when it cannot run here (it could never be admitted)."""
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
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias or ()]),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ParamError(name, f"{name} holds token ids {bad[:3]} outside the vocabulary [0, "
                                       f"{self.vocab_size})")
        alloc = self.core.scheduler.allocator
        if params.structured_outputs is not None:
            try:
                self.grammars().constraint(params.structured_outputs)
            except SpecError as e:
                raise ParamError("structured_outputs", str(e)) from None
        if not alloc.fits(p + max_tokens):
            need, have = ((-(-(p + max_tokens) // PAGE_SIZE), alloc.num_pages) if alloc.paged else
                          (p + max_tokens, alloc.rows))
            unit = f"KV-cache pages of {PAGE_SIZE} tokens" if alloc.paged else "KV-cache rows"
            raise ParamError("max_tokens", f"{p} prompt tokens and {max_tokens} new ones need {need} {unit}; this "
                                           f"server's cache has {have} (--kv_cache_tokens)")
        return max_tokens

    def add_request(self, request_id: str, prompt_ids: list, params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        max_tokens = self.check(prompt_ids, params)
        req = _Request(request_id, list(prompt_ids), params)
        seed = self.core.next_seed()  # (drawn on every rank alike, whether or not the request has its own)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        constraints = [None if params.structured_outputs is None else
                       self.grammars().constraint(params.structured_outputs) for _ in range(params.n)]
        for i, constraint in enumerate(constraints):  # (what may fail is done: nothing is left half-added)
            req.choices.append(self.core.add(prompt_ids, max_tokens, params.for_choice(i, seed), stops,
                                             state=_Choice(req, i), constraint=constraint))
        req.unfinished = params.n
        if params.prompt_logprobs is not None and len(prompt_ids) > 1:  # scored once, beside its completions
            req.prompt_logprobs = []
            req.scoring = self.core.add(prompt_ids, 0, all_logits=True, state=req)
            req.unfinished += 1
        elif params.prompt_logprobs is not None:
            req.prompt_logprobs = []
        self.requests[request_id] = req
        if self.stats is not None:
            self.stats.inc("prompt_tokens_total", len(prompt_ids) * params.n)
            self._gauges()

    def grammars(self) -> Grammars:
        """The structured-output compiler of this model's tokenizer (made on first use: it loads xgrammar)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tok, self.vocab_size, sorted(self.eos_ids))
        return self._grammars

    def cancel(self, request_id: str, index: Optional[int] = None) -> list[TokenDelta]:
        """Ends a request's unfinished completions (or only completion `index`: a stop string ended it) with
        finish_reason "abort", freeing their cache."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        if index is not None:
            return [self._flush(req.choices[index].state, "abort")] if 0 <= index < len(req.choices) and \
                req.choices[index].state.finish_reason is None else []
        if req.scoring is not None and req.scoring.finish_reason is None:
            self.core.finish(req.scoring, "abort")
            req.unfinished -= 1
            if req.unfinished == 0:  # (its completions were done)
                return [self._done(req, TokenDelta(request_id, 0, [], []))]
        return [self._flush(seq.state, "abort") for seq in req.choices if seq.state.finish_reason is None]

    def cancel_all(self) -> list[TokenDelta]:
        return [d for rid in list(self.requests) for d in self.cancel(rid)]

    def fail(self, request_id: str, error: str) -> list[TokenDelta]:
        """Ends a request's unfinished completions with finish_reason "error"."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        if req.scoring is not None and req.scoring.finish_reason is None:
            self.core.finish(req.scoring, "abort")
            req.unfinished -= 1
        out = [self._flush(seq.state, "error", error) for seq in req.choices if seq.state.finish_reason is None]
        if req.request_id in self.requests and req.unfinished == 0:
            out.append(self._done(req, TokenDelta(request_id, 0, [], [], "error", error=error)))
        return out

    def has_work(self) -> bool:
        return self.core.has_work()

    def num_waiting(self) -> int:
        return len(self.core.scheduler.waiting)

    # -- steps -------------------------------------------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        """Runs one step; returns each completion's new tokens. A sequence whose sampling fails ends with finish
        "error" (the others go on); a step that fails as a whole ends every request so (the engine goes on),
        unless MAX_FAILED_STEPS fail in a row."""
        try:
            outs = self.core.step()
        except Exception as e:  # noqa: BLE001 - the step as a whole: no one request is to blame
            self._failed_steps += 1
            if self._failed_steps >= self.MAX_FAILED_STEPS:
                raise
            traceback.print_exc()
            why = f"the engine step failed: {type(e).__name__}: {e}"
            return [d for rid in list(self.requests) for d in self.fail(rid, why)]
        self._failed_steps = 0
        touched: dict[int, _Choice] = {}
        deltas = []
        for o in outs:
            if o.seq.all_logits:
                d = self._score(o)
                if d is not None:
                    deltas.append(d)
                continue
            ch: _Choice = o.seq.state
            if ch.finish_reason is not None:  # (cancelled: the step had it already)
                continue
            touched[id(ch)] = ch
            if o.finish == "error":
                ch.finish_reason, ch.error = "error", o.error
                continue
            if self.stats is not None:
                self.stats.inc("generation_tokens_total")
            p = ch.request.params
            if o.finish == "stop":  # a stop id or EOS: not part of the completion
                ch.finish_reason, ch.stop_reason = "stop", (o.token if o.token in p.stop_token_ids else None)
                continue
            ch.new.append(o.token)
            if p.logprobs is not None:
                ch.logprobs += logprobs(o.logits, [o.token], p.logprobs)
            if o.finish == "length":
                ch.finish_reason = "length"
        deltas += [self._flush(ch) for ch in touched.values()]  # one delta a choice and step
        if self.stats is not None:
            s = self.core.scheduler
            a = s.allocator
            self._count(preemptions_total=s.preemptions, prefix_cache_queries_total=a.queries,
                        prefix_cache_hits_total=a.hits, prefix_cache_tokens_saved_total=a.hits * PAGE_SIZE,
                        spec_decode_draft_tokens_total=self.core.proposed,
                        spec_decode_accepted_tokens_total=self.core.accepted)
            self.stats.inc("steps_total")
            self._gauges()
        return deltas

    def apply(self, events: list) -> list[TokenDelta]:
        """A step's events, on every rank: ("add", request id, prompt ids, SamplingParams) or ("cancel", request
        id[, completion index]). An add that fails ends its request with finish "error" (the same on every rank)."""
        out = []
        for e in events:
            if e[0] == "add":
                try:
                    self.add_request(*e[1:4])
                except Exception as exc:  # noqa: BLE001 - one request's failure, not the engine's
                    out.append(TokenDelta(e[1], 0, [], [], "error", done=True,
                                          error=f"the request could not be added: {type(exc).__name__}: {exc}"))
            else:
                out += self.cancel(e[1], e[2] if len(e) > 2 else None)
        return out

    def step_with(self, events: list) -> list[TokenDelta]:
        """Rank 0 of the server: sends the step's events to the other ranks, applies them, runs the step."""
        self.channel.send({"k": "step", "e": [["add", e[1], e[2], asdict(e[3])] if e[0] == "add" else list(e)
                                              for e in events]})
        deltas = self.apply(events)
        return deltas + (self.step() if self.has_work() else [])

    def heartbeat(self) -> None:
        self.channel.send({"k": "idle"})

    def _score(self, o: Output) -> Optional[TokenDelta]:
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
        if seq.finish_reason is None or req.request_id not in self.requests:
            return None
        req.unfinished -= 1
        return self._done(req, TokenDelta(req.request_id, 0, [], [])) if req.unfinished == 0 else None

    def _flush(self, ch: _Choice, finish: Optional[str] = None, error: Optional[str] = None) -> TokenDelta:
        """The delta of what the step added to `ch` (and its end: `finish`, where it is ended now)."""
        if finish is not None and ch.finish_reason is None:
            ch.finish_reason, ch.error = finish, error
        req = ch.request
        d = TokenDelta(req.request_id, ch.index, ch.new, ch.logprobs, ch.finish_reason, ch.stop_reason,
                       error=ch.error)
        ch.new, ch.logprobs = [], []
        if ch.finish_reason is not None:
            self.core.finish(req.choices[ch.index], ch.finish_reason)  # (a cancel: the core still runs it)
            req.unfinished -= 1
            if req.unfinished == 0:
                self._done(req, d)
            if self.stats is not None:
                self._gauges()
        return d

    def _done(self, req: _Request, d: TokenDelta) -> TokenDelta:
        """`d` becomes the request's last delta (with its prompt logprobs); the request is forgotten."""
        del self.requests[req.request_id]
        d.done, d.prompt_logprobs = True, req.prompt_logprobs
        return d

    def _count(self, **totals: int) -> None:
        """Counters from the core's running totals: what they gained since the last step."""
        for name, total in totals.items():
            if total > self._counted.get(name, 0):
                self.stats.inc(name, total - self._counted.get(name, 0))
            self._counted[name] = total

    def _gauges(self) -> None:
        s = self.core.scheduler
        unit = 1 if s.allocator.paged else PAGE_SIZE  # (an offset cache counts rows: in pages of PAGE_SIZE rows here)
        self.stats.set(requests_waiting=len(s.waiting), requests_running=len(s.running),
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
