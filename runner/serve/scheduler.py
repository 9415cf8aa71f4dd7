"""Continuous batching over a fixed budget of KV-cache pages.

Each step the scheduler picks what runs: every running sequence that decodes (one token each), then
prefill chunks of running sequences within the step's token budget, then waiting sequences admitted
in arrival order while the batch, the budget and the free pages allow. Pages (`PAGE_SIZE` rows of
the paged cache) are handed out one by one as a sequence grows. When a running sequence needs a
page and none is free, the most recently arrived running sequence is preempted: its pages are
freed and it goes back to the front of the queue, to be prefilled again over its prompt and what it
has generated so far (recompute). A sequence never needs more pages than the cache has (the server
refuses such requests), so every sequence finishes.

Pure Python and ints: no tensors, no model. The engine (`runner.serve.engine`) runs the steps.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from runner.kernels.reference import PAGE_SIZE


def pages_for(tokens: int) -> int:
    """Cache pages that `tokens` rows take."""
    return math.ceil(tokens / PAGE_SIZE)


@dataclass(eq=False)
class Sequence:
    """One sequence (one choice of one request) as the scheduler sees it."""
    seq_id: int
    tokens: list                 # prompt, then generated ids
    prompt_len: int
    max_len: int                 # prompt_len + max_tokens: the cache rows it may need at most
    arrival: int = 0             # order of arrival (priority: lower runs first, is preempted last)
    computed: int = 0            # tokens whose keys and values are in the cache
    pages: list = field(default_factory=list)   # page indices, in position order
    preemptions: int = 0
    state: Any = None            # what the engine keeps beside (sampler, text, ...)

    @property
    def pending(self) -> int:
        """Tokens known but not yet in the cache (the prompt, or the last sampled token)."""
        return len(self.tokens) - self.computed

    @property
    def decoding(self) -> bool:
        return self.computed > 0 and self.pending == 1


class PagePool:
    """A fixed number of cache pages; page i is rows [i * PAGE_SIZE, (i + 1) * PAGE_SIZE)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"the KV cache needs at least one page ({PAGE_SIZE} tokens), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # popped from the end: low pages first

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_pages - len(self._free)

    def grow(self, seq: Sequence, tokens: int) -> bool:
        """Gives `seq` pages for its first `tokens` positions; False (and nothing taken) if too few are free."""
        need = pages_for(tokens) - len(seq.pages)
        if need > len(self._free):
            return False
        for _ in range(max(need, 0)):
            seq.pages.append(self._free.pop())
        return True

    def release(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.pages))
        seq.pages = []


@dataclass
class StepBatch:
    """What one step runs: (sequence, new tokens) with the decoding sequences first."""
    items: list
    num_decoding: int
    preempted: list              # sequences preempted while this step was planned

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(self, num_pages: int, max_batch: int = 64, max_step_tokens: int = 512):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_step_tokens < max_batch:
            raise ValueError(f"the step token budget ({max_step_tokens}) must be at least max_batch ({max_batch}), "
                             f"so that every running sequence can decode in every step")
        self.pool = PagePool(num_pages)
        self.max_batch, self.max_step_tokens = max_batch, max_step_tokens
        self.waiting: list[Sequence] = []   # by arrival
        self.running: list[Sequence] = []   # by arrival
        self.preemptions = 0

    # -- queue -----------------------------------------------------------------------------------
    def fits(self, max_len: int) -> bool:
        """Whether a sequence of `max_len` tokens can ever run alone in this cache."""
        return pages_for(max_len) <= self.pool.num_pages

    def add(self, seq: Sequence) -> None:
        if not self.fits(seq.max_len):
            raise ValueError(f"a sequence of {seq.max_len} tokens needs {pages_for(seq.max_len)} pages; the cache "
                             f"has {self.pool.num_pages}")
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        keys = [s.arrival for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.arrival), seq)

    def remove(self, seq: Sequence) -> None:
        """Takes `seq` out (finished or cancelled) and frees its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> StepBatch:
        budget = self.max_step_tokens
        chosen: dict[int, int] = {}          # seq_id -> new tokens this step
        preempted: list[Sequence] = []

        def place(seq: Sequence, n: int) -> bool:
            """Pages for seq's next n tokens, preempting later arrivals (or seq itself) when short."""
            while not self.pool.grow(seq, seq.computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    return False
                nonlocal budget
                budget += chosen.pop(victim.seq_id, 0)
            return True

        for seq in [s for s in self.running if s.decoding]:
            if seq in self.running and place(seq, 1):
                chosen[seq.seq_id] = 1
                budget -= 1
        for seq in [s for s in self.running if not s.decoding]:
            if budget <= 0:
                break
            n = min(seq.pending, budget)
            if seq in self.running and place(seq, n):
                chosen[seq.seq_id] = n
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            n = min(seq.pending, budget)
            if not self.pool.grow(seq, seq.computed + n):
                break  # arrival order: no later request overtakes it
            self.waiting.pop(0)
            self.running.append(seq)
            chosen[seq.seq_id] = n
            budget -= n
        items = [(s, chosen[s.seq_id]) for s in self.running if s.seq_id in chosen]
        items.sort(key=lambda it: not it[0].decoding)  # stable: decoding first, arrival order kept
        return StepBatch(items, sum(1 for s, _ in items if s.decoding), preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self._enqueue(seq)

    def advance(self, batch: StepBatch) -> list[Sequence]:
        """After the step ran: the cache holds the new tokens. Returns the sequences whose last token's
        logits are the next-token distribution (all their known tokens are now cached)."""
        ready = []
        for seq, n in batch.items:
            seq.computed += n
            if seq.pending == 0:
                ready.append(seq)
        return ready

    def waiting_count(self) -> int:
        return len(self.waiting)


def step_lengths(batch: StepBatch) -> tuple[list[int], list[int], list[int]]:
    """(tokens, seqlens, start positions) of a step, as the engine plan takes them."""
    tokens, seqlens, start = [], [], []
    for seq, n in batch.items:
        tokens.extend(seq.tokens[seq.computed:seq.computed + n])
        seqlens.append(n)
        start.append(seq.computed)
    return tokens, seqlens, start
