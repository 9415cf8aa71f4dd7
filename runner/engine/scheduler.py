"""Continuous batching over a KV-cache allocator: what runs in each step.

Each step takes every running sequence that decodes (one token each, or its guesses with it where speculative
decoding guessed), then prefill chunks of running sequences, then waiting sequences in arrival order, while the
batch (`max_batch`), the step's token budget (`max_step_tokens`, decoding tokens included; `prefill_chunk` prefill
tokens, `decode_chunk` while any sequence decodes: a step that carries a long chunk delays every decoding sequence's
next token by its whole length, so chunks are small while sequences decode) and the cache allow. The cache's rows
are handed out by one of two allocators, as ppl.pmx's cache modes: :class:`OffsetAllocator` reserves a sequence's
whole region when it is admitted; :class:`PageAllocator` hands out pages of PAGE_SIZE rows as it grows, and when a
running sequence needs a page and none is free, the most recently arrived running sequence is preempted (its pages
freed, its tokens prefilled again later). A sequence never needs more than the whole cache (`fits` is checked
when it is added), so every sequence finishes.

Pure Python over ints: no tensors. The engine core (runner.engine.core) runs the steps.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

from runner.kernels.reference import PAGE_SIZE


@dataclass(eq=False)
class Sequence:
    """One sequence (a prompt and what it generates) as the scheduler and the engine see it."""
    seq_id: int
    tokens: list                 # prompt, then generated ids
    prompt_len: int
    max_len: int                 # the length it may reach: the cache rows it needs at most
    arrival: int = 0             # order of arrival: lower runs first and is preempted last
    stop_ids: frozenset = frozenset()  # sampled ids that end it (not appended)
    sampler: Any = None          # runner.engine.sampler.Sampler
    constraint: Any = None       # structured output: runner.engine.structured.Constraint, masks its logits
    all_logits: bool = False     # the logits of every prompt position are wanted (scoring), not a new token
    proposal: list = field(default_factory=list)  # speculative decoding: guessed tokens, appended to `tokens` until
                                                  # the step that verifies them
    computed: int = 0            # tokens whose keys and values are in the cache
    region: Any = None           # its rows of the KV cache, as the allocator hands them out: (first row, rows)
                                 # or a list of pages
    keyed: int = 0               # pages of it keyed for prefix caching, and the last one's key
    last_key: Any = None
    preemptions: int = 0
    finish_reason: Optional[str] = None  # stop | length | abort
    state: Any = None            # what a caller keeps beside (a request's choice, scores, ...)

    @property
    def pending(self) -> int:
        """Tokens known but not yet in the cache (the prompt, or the last sampled token)."""
        return len(self.tokens) - self.computed

    @property
    def decoding(self) -> bool:
        return self.computed > 0 and self.pending == 1

    @property
    def verifying(self) -> bool:
        """Decoding, with guesses of speculative decoding appended to verify in the same step."""
        return bool(self.proposal) and self.computed > 0 and self.pending == 1 + len(self.proposal)

    @property
    def generated(self) -> list:
        return self.tokens[self.prompt_len:]


class PageAllocator:
    """Pages of PAGE_SIZE rows, given to a sequence as it grows; page i is rows [i PAGE_SIZE, (i + 1) PAGE_SIZE).

    With `prefix_caching`, a page whose rows all hold computed tokens is keyed by those tokens and everything before
    them (its parent's key), and kept when its sequences end, so a later sequence with the same prefix takes it
    instead of computing it again (:meth:`match`); a page is shared by reference count and, once no sequence holds it,
    evicted least recently used first when a free page is needed. Keys are exact (the tokens themselves), and every
    rank makes the same choices."""
    paged = True

    def __init__(self, rows: int, prefix_caching: bool = False):
        self.num_pages = rows // PAGE_SIZE
        if self.num_pages < 1:
            raise ValueError(f"the KV cache needs at least one page ({PAGE_SIZE} tokens), got {rows} rows")
        self.prefix_caching = prefix_caching
        self._free = list(range(self.num_pages - 1, -1, -1))  # popped from the end: low pages first
        self._refs = [0] * self.num_pages
        self._key_of: dict[int, tuple] = {}                   # page -> its key, for cached pages
        self._page_of: dict[tuple, int] = {}                  # key -> page
        self._evictable: OrderedDict = OrderedDict()          # cached pages no sequence holds, oldest first
        self.queries = self.hits = 0                          # pages looked up / found at admission

    @property
    def free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        return self.num_pages - self.free

    def fits(self, max_len: int) -> bool:
        return -(-max_len // PAGE_SIZE) <= self.num_pages

    def match(self, seq: Sequence) -> int:
        """Takes the cached pages of seq's longest cached prefix (all its known tokens but the last, whose logits are
        wanted; none for a scored prompt) and marks their tokens computed; returns how many."""
        if not self.prefix_caching or seq.all_logits:  # (a scored prompt wants the logits of every position)
            return 0
        pages, last = [], None
        for i in range((len(seq.tokens) - 1) // PAGE_SIZE):
            key = _page_key(last, seq.tokens, i)
            page = self._page_of.get(key)
            self.queries += 1
            if page is None:
                break
            pages.append(page)
            last = key
        self.hits += len(pages)
        for page in pages:
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1
        seq.region, seq.computed, seq.keyed, seq.last_key = pages, len(pages) * PAGE_SIZE, len(pages), last
        return seq.computed

    def grow(self, seq: Sequence, tokens: int) -> bool:
        """Pages for seq's first `tokens` positions; False (and nothing taken) if too few are free."""
        pages = seq.region if seq.region is not None else []
        need = -(-tokens // PAGE_SIZE) - len(pages)
        if need > self.free:
            return False
        for _ in range(max(need, 0)):
            if self._free:
                page = self._free.pop()
            else:  # the least recently used cached page no sequence holds
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        seq.region = pages
        return True

    def computed(self, seq: Sequence) -> None:
        """seq's tokens up to seq.computed are in the cache: key the pages they fill (prefix caching)."""
        if not self.prefix_caching:
            return
        key = seq.last_key
        for i in range(seq.keyed, seq.computed // PAGE_SIZE):
            key = _page_key(key, seq.tokens, i)
            if key not in self._page_of and seq.region[i] not in self._key_of:  # (a cached page's twin stays unkeyed)
                self._page_of[key], self._key_of[seq.region[i]] = seq.region[i], key
            seq.keyed, seq.last_key = i + 1, key

    def release(self, seq: Sequence) -> None:
        for page in reversed(seq.region or ()):  # a chain's last pages first: they are evicted first
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
        seq.region, seq.keyed, seq.last_key = None, 0, None

    @staticmethod
    def starts(seq: Sequence) -> list:
        """The cache rows where each of the sequence's pages starts (a row of the plan's cachestarts)."""
        return [p * PAGE_SIZE for p in seq.region]


def _page_key(parent: Optional[tuple], tokens: list, i: int) -> tuple:
    """The key of page i of a sequence: its tokens, and its parent page's key (by hash) for everything before."""
    return (hash(parent), tuple(tokens[i * PAGE_SIZE: (i + 1) * PAGE_SIZE]))


class OffsetAllocator:
    """One contiguous region per sequence (ppl.pmx's offset mode), its max_len rows reserved at admission (first
    fit; freed regions merge). Nothing is shared: no prefix caching."""
    paged, queries, hits = False, 0, 0

    def __init__(self, rows: int):
        self.rows = rows
        self._free = [(0, rows)]  # (start, length), by start

    @property
    def free(self) -> int:
        return sum(n for _, n in self._free)

    @property
    def used(self) -> int:
        return self.rows - self.free

    def fits(self, max_len: int) -> bool:
        return max_len <= self.rows

    @staticmethod
    def match(seq: Sequence) -> int:
        return 0

    @staticmethod
    def computed(seq: Sequence) -> None:
        pass

    def grow(self, seq: Sequence, tokens: int) -> bool:
        if seq.region is not None:
            return True
        for i, (s, n) in enumerate(self._free):
            if n >= seq.max_len:
                self._free[i] = (s + seq.max_len, n - seq.max_len)
                seq.region = (s, seq.max_len)
                return True
        return False

    def release(self, seq: Sequence) -> None:
        if seq.region is None:
            return
        merged = []
        for s, n in sorted(self._free + [seq.region]):
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            elif n:
                merged.append((s, n))
        self._free, seq.region = merged, None

    @staticmethod
    def starts(seq: Sequence) -> int:
        return seq.region[0]


@dataclass
class StepBatch:
    """What one step runs: (sequence, new tokens) with the decoding sequences first."""
    items: list
    num_decoding: int
    preempted: list = field(default_factory=list)   # sequences preempted while this step was planned

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(self, allocator, max_batch: int, max_step_tokens: Optional[int] = None,
                 prefill_chunk: Optional[int] = None, decode_chunk: Optional[int] = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_step_tokens is not None and max_step_tokens < max_batch:
            raise ValueError(f"the step token budget ({max_step_tokens}) must be at least max_batch ({max_batch}), "
                             f"so that every running sequence can decode in every step")
        self.allocator, self.max_batch = allocator, max_batch
        self.max_step_tokens, self.prefill_chunk = max_step_tokens, prefill_chunk
        self.decode_chunk = decode_chunk
        self.waiting: list[Sequence] = []   # by arrival
        self.running: list[Sequence] = []   # by arrival
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        if not self.allocator.fits(seq.max_len):
            a = self.allocator
            raise ValueError(f"a sequence of {seq.max_len} tokens does not fit a KV cache of {a.free + a.used} "
                             f"{'pages' if a.paged else 'rows'}")
        keys = [s.arrival for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.arrival), seq)

    def remove(self, seq: Sequence) -> None:
        """Takes `seq` out (finished or cancelled) and frees its cache."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.release(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepBatch:
        big = 1 << 62
        step_budget = big if self.max_step_tokens is None else self.max_step_tokens
        chosen: dict[int, int] = {}          # seq_id -> new tokens this step
        preempted: list[Sequence] = []

        def place(seq: Sequence, n: int) -> bool:
            """Cache for seq's next n tokens, preempting later arrivals (or seq itself) when short."""
            nonlocal step_budget
            while not self.allocator.grow(seq, seq.computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    return False
                step_budget += chosen.pop(victim.seq_id, 0)
            return True

        for seq in [s for s in self.running if s.decoding or s.verifying]:
            n = 1 if seq.decoding else max(1, min(seq.pending, step_budget))  # (guesses past the budget: dropped)
            if seq in self.running and place(seq, n):
                chosen[seq.seq_id] = n
                step_budget -= n
        prefill = big if self.prefill_chunk is None else self.prefill_chunk
        if chosen and self.decode_chunk is not None:
            prefill = min(prefill, self.decode_chunk)
        for seq in [s for s in self.running if not (s.decoding or s.verifying)]:
            n = min(seq.pending, step_budget, prefill)
            if n <= 0:
                break
            if seq in self.running and place(seq, n):
                chosen[seq.seq_id] = n
                step_budget, prefill = step_budget - n, prefill - n
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            self.allocator.match(seq)  # (prefix caching: its cached prefix counts as computed)
            n = min(seq.pending, step_budget, prefill)
            if n <= 0 or not self.allocator.grow(seq, seq.computed + n):
                self.allocator.release(seq)
                seq.computed = 0
                break  # arrival order: no later sequence overtakes it
            self.running.append(self.waiting.pop(0))
            chosen[seq.seq_id] = n
            step_budget, prefill = step_budget - n, prefill - n
        items = [(s, chosen[s.seq_id]) for s in self.running if s.seq_id in chosen]
        items.sort(key=lambda it: not it[0].decoding)  # stable: decoding first, arrival order kept
        return StepBatch(items, sum(1 for s, _ in items if s.decoding), preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.release(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.add(seq)

    def advance(self, batch: StepBatch, kept: Optional[dict] = None) -> list[Sequence]:
        """After the step ran: the cache holds the new tokens (`kept`: {seq_id: how many of a sequence's tokens to
        keep}, where speculative decoding rejected some). Returns the sequences whose last token's logits are the
        next-token distribution (all their known tokens are now cached)."""
        ready = []
        for seq, n in batch.items:
            seq.computed += n if kept is None else kept.get(seq.seq_id, n)
            self.allocator.computed(seq)
            if seq.pending == 0:
                ready.append(seq)
        return ready
