"""The serving engine: continuous batching over the model step, under the server and the offline API.

Rank 0 owns the requests. Each step it asks the scheduler (`runner.serve.scheduler`) what runs,
sends that step (new tokens, lengths, positions, cache pages) to the other ranks as one small JSON
message (`StepChannel`), runs the step with them, then samples, detokenizes and checks the stops of
the sequences whose next token is due. The other ranks run :meth:`Engine.follow`: receive a step,
run it, until rank 0 sends something else (stop, or the offline API's results). Only rank 0 samples:
the tokens it samples reach the other ranks inside the next step, so every rank feeds the same
tokens by construction, whatever each request's sampling settings.

While idle, rank 0 sends a heartbeat every second, so the other ranks (waiting in a broadcast
under the communicator's watchdog) know it is alive.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from runner.engine.sampler import Sampler, greedy_ids
from runner.kernels.reference import PAGE_SIZE
from runner.serve.params import ParamError, SamplingParams, is_int
from runner.serve.scheduler import Scheduler, Sequence, pages_for, step_lengths

HEARTBEAT_S = 1.0
LOGPROB_FLOOR = -9999.0  # JSON has no -inf


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

    def apply(self, d: Delta, token_text: Callable[[int], str]) -> None:
        """Adds a delta of this request to its completion."""
        out = self.outputs[d.index]
        out.text += d.text
        out.token_ids += d.token_ids
        if d.logprobs:
            out.logprobs = out.logprobs or []
            for tid, lp, top in d.logprobs:
                entry = {i: Logprob(v, r + 1, token_text(i)) for r, (i, v) in enumerate(top)}
                if tid not in entry:
                    entry[tid] = Logprob(lp, -1, token_text(tid))
                out.logprobs.append(entry)
                out.cumulative_logprob = (out.cumulative_logprob or 0.0) + lp
        if d.finish_reason:
            out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
        self.finished = all(o.finished() for o in self.outputs)

    def to_json(self) -> dict:
        return {"request_id": self.request_id, "prompt": self.prompt, "prompt_token_ids": self.prompt_token_ids,
                "finished": self.finished,
                "outputs": [{"index": o.index, "text": o.text, "token_ids": o.token_ids,
                             "cumulative_logprob": o.cumulative_logprob, "finish_reason": o.finish_reason,
                             "stop_reason": o.stop_reason,
                             "logprobs": None if o.logprobs is None else
                             [[[i, lp.logprob, lp.rank, lp.decoded_token] for i, lp in e.items()] for e in o.logprobs]}
                            for o in self.outputs]}

    @classmethod
    def from_json(cls, d: dict) -> "RequestOutput":
        outs = [CompletionOutput(o["index"], o["text"], o["token_ids"], o["cumulative_logprob"],
                                 None if o["logprobs"] is None else
                                 [{i: Logprob(lp, r, t) for i, lp, r, t in e} for e in o["logprobs"]],
                                 o["finish_reason"], o["stop_reason"]) for o in d["outputs"]]
        return cls(d["request_id"], d["prompt"], d["prompt_token_ids"], outs, d["finished"])


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_ids: list
    params: SamplingParams
    arrival_time: float
    choices: list = field(default_factory=list)
    unfinished: int = 0


@dataclass(eq=False)
class _Choice:
    """A completion's state beside its scheduler `Sequence` (kept in `Sequence.state`)."""
    request: _Request
    index: int
    max_tokens: int
    sampler: Sampler
    detok: IncrementalDetokenizer
    text: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    sent_text: int = 0
    sent_tokens: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None
    last_token_at: Optional[float] = None


class Engine:
    """Continuous batching of requests over one model; see the module docstring. On ranks other than 0
    only :meth:`follow` (and the channel) is used."""

    def __init__(self, model, comm, tokenizer, eos_ids, num_pages: int, max_batch: int = 64,
                 max_step_tokens: int = 512, metrics=None):
        if model.options.cache_mode != 1 or not model.options.auto_causal:
            raise ValueError("the serving engine needs a paged cache (cache_mode=1) and auto_causal")
        self.model, self.comm, self.tok, self.metrics = model, comm, tokenizer, metrics
        self.eos_ids = frozenset(eos_ids)
        self.num_pages = num_pages
        self.max_model_len = model.params.max_position_embeddings
        self.kv_cache, self.kv_scale = model.new_cache(num_pages * PAGE_SIZE)
        self.channel = StepChannel(comm, model.device)
        self.scheduler = Scheduler(num_pages, max_batch, max_step_tokens)
        self.requests: dict[str, _Request] = {}
        self._arrivals = itertools.count()
        self._seeds = random.Random()
        if metrics is not None:
            metrics.set(kv_pages_total=num_pages, kv_page_tokens=PAGE_SIZE)
            self._gauges()

    # -- requests (rank 0) ------------------------------------------------------------------------
    def check(self, prompt_ids: list, params: SamplingParams) -> int:
        """The max_tokens a request gets; ParamError when it cannot run here. Reads only constants, so the
        HTTP thread may call it."""
        p, vocab = len(prompt_ids), self.model.params.vocab_size
        if p == 0:
            raise ParamError("prompt", "the prompt is empty")
        bad = [t for t in prompt_ids if not (is_int(t) and 0 <= t < vocab)]
        if bad:
            raise ParamError("prompt", f"the prompt holds token ids {bad[:3]} outside the vocabulary [0, {vocab})")
        if p >= self.max_model_len:
            raise ParamError("prompt", f"this model's maximum context length is {self.max_model_len} tokens; the "
                                       f"prompt has {p}, which leaves no room for a completion")
        max_tokens = self.max_model_len - p if params.max_tokens is None else params.max_tokens
        if p + max_tokens > self.max_model_len:
            raise ParamError("max_tokens", f"this model's maximum context length is {self.max_model_len} tokens; "
                                           f"{p} in the prompt and {max_tokens} to generate make {p + max_tokens}")
        if not self.scheduler.fits(p + max_tokens):
            raise ParamError("max_tokens", f"{p} prompt tokens and {max_tokens} new ones need "
                                           f"{pages_for(p + max_tokens)} KV-cache pages of {PAGE_SIZE} tokens; this "
                                           f"server's cache has {self.num_pages} (--kv_cache_tokens)")
        return max_tokens

    def add_request(self, request_id: str, prompt_ids: list, params: SamplingParams,
                    arrival_time: Optional[float] = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        max_tokens = self.check(prompt_ids, params)
        req = _Request(request_id, list(prompt_ids), params,
                       time.monotonic() if arrival_time is None else arrival_time)
        seed = self._seeds.getrandbits(62)
        for i in range(params.n):
            choice = _Choice(req, i, max_tokens, Sampler(params.for_choice(i, seed)),
                             IncrementalDetokenizer(self.tok, prompt_ids))
            order = next(self._arrivals)
            seq = Sequence(order, list(prompt_ids), len(prompt_ids), len(prompt_ids) + max_tokens, arrival=order,
                           state=choice)
            self.scheduler.add(seq)
            req.choices.append(seq)
        req.unfinished = params.n
        self.requests[request_id] = req
        if self.metrics is not None:
            self.metrics.inc("prompt_tokens_total", len(prompt_ids) * params.n)
            self._gauges()

    def cancel(self, request_id: str) -> list[Delta]:
        """Ends a request's unfinished completions with finish_reason "abort", freeing their pages."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        out = []
        for seq in req.choices:
            if seq.state.finish_reason is None:
                seq.state.finish_reason = "abort"
                out.append(self._finish(seq))
        return out

    def cancel_all(self) -> list[Delta]:
        return [d for rid in list(self.requests) for d in self.cancel(rid)]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- steps (rank 0) ---------------------------------------------------------------------------
    def step(self) -> list[Delta]:
        """Runs one step over the ranks; returns the completions' new text and tokens."""
        batch = self.scheduler.schedule()
        if self.metrics is not None and batch.preempted:
            self.metrics.inc("preemptions_total", len(batch.preempted))
        if not batch:
            return []
        tokens, seqlens, start = step_lengths(batch)
        msg = {"k": "step", "t": tokens, "n": seqlens, "p": start, "c": [s.pages for s, _ in batch.items],
               "d": batch.num_decoding}
        self.channel.send(msg)
        logits = self._run(msg)
        rows = {s.seq_id: k for k, (s, _) in enumerate(batch.items)}
        ready = self.scheduler.advance(batch)
        deltas = []
        if ready:
            lg = logits[[rows[s.seq_id] for s in ready]]
            now = time.monotonic()
            for seq, token, row in zip(ready, self._sample(ready, lg), lg):
                deltas.append(self._accept(seq, token, row, now))
        if self.metrics is not None:
            self.metrics.inc("steps_total")
            self._gauges()
        return [d for d in deltas if d is not None]

    def heartbeat(self) -> None:
        self.channel.send({"k": "idle"})

    def _run(self, msg: dict) -> torch.Tensor:
        caches = [[p * PAGE_SIZE for p in pages] for pages in msg["c"]]
        tokens, plan = self.model.step_inputs(msg["t"], msg["n"], msg["p"], caches, msg["d"])
        return self.model.step(tokens, plan, self.kv_cache, self.kv_scale)

    def _sample(self, seqs: list, logits: torch.Tensor) -> list[int]:
        greedy = [k for k, s in enumerate(seqs) if s.state.sampler.params.temperature == 0]
        out = [0] * len(seqs)
        if greedy:
            for k, t in zip(greedy, greedy_ids(logits[greedy] if len(greedy) < len(seqs) else logits)):
                out[k] = t
        for k, s in enumerate(seqs):
            if s.state.sampler.params.temperature != 0:
                out[k] = int(s.state.sampler(logits[k:k + 1])[0])
        return out

    def _accept(self, seq: Sequence, token: int, row: torch.Tensor, now: float) -> Optional[Delta]:
        ch: _Choice = seq.state
        p = ch.request.params
        if self.metrics is not None:
            if ch.last_token_at is None:
                self.metrics.observe(ttft=[now - ch.request.arrival_time])
            else:
                self.metrics.observe(itl=[now - ch.last_token_at])
            self.metrics.inc("generation_tokens_total")
        ch.last_token_at = now
        if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
            ch.finish_reason, ch.stop_reason = "stop", (token if token in p.stop_token_ids else None)
            return self._finish(seq)
        seq.tokens.append(token)
        ch.token_ids.append(token)
        if p.logprobs is not None:
            lp = torch.log_softmax(row.float(), -1)
            top = lp.topk(p.logprobs) if p.logprobs else None
            ch.logprobs.append((token, max(float(lp[token]), LOGPROB_FLOOR),
                                [] if top is None else [(i, max(v, LOGPROB_FLOOR)) for i, v in
                                                        zip(top.indices.tolist(), top.values.tolist())]))
        new = ch.detok.add(token)
        ch.text += new
        if p.stop and new:
            self._match_stop(ch, len(new))
        if ch.finish_reason is None and (len(ch.token_ids) >= ch.max_tokens or len(seq.tokens) >= self.max_model_len):
            ch.finish_reason = "length"
        if ch.finish_reason is not None:
            return self._finish(seq)
        return self._delta(ch)

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
        self.scheduler.remove(seq)
        req.unfinished -= 1
        d = self._delta(ch)
        if req.unfinished == 0:
            del self.requests[req.request_id]
            d.usage = (len(req.prompt_ids), sum(len(s.state.token_ids) for s in req.choices))
            if self.metrics is not None:
                reasons = {s.state.finish_reason for s in req.choices}
                self.metrics.inc("requests_total", label=next(r for r in ("abort", "length", "stop") if r in reasons))
        if self.metrics is not None:
            self._gauges()
        return d

    def _gauges(self) -> None:
        s = self.scheduler
        self.metrics.set(requests_waiting=len(s.waiting), requests_running=len(s.running),
                         kv_pages_used=s.pool.used, kv_pages_free=s.pool.free)

    # -- the other ranks --------------------------------------------------------------------------
    def follow(self, should_quit: Callable[[], bool] = lambda: False) -> dict:
        """Runs rank 0's steps until it sends anything else, which is returned ({"k": "stop"}, ...)."""
        while True:
            msg = self.channel.recv()
            if msg["k"] == "step":
                self._run(msg)
            elif msg["k"] != "idle":
                return msg
            if should_quit():
                return {"k": "quit"}
