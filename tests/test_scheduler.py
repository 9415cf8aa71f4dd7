"""The one scheduler (runner.engine.scheduler): continuous batching over a paged or an offset KV cache, prefill in
chunks within the step's budgets, preemption when pages run out; pure Python, no model."""

from __future__ import annotations

import random

import pytest

from runner.engine.scheduler import OffsetCache, PagedCache, Scheduler, Sequence
from runner.kernels.reference import PAGE_SIZE


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE)


def simulate(sched: Scheduler, seqs: list, check=lambda batch: None) -> int:
    """Runs the scheduler to the end, each sequence "sampling" token 7 until max_len; returns the steps."""
    for s in seqs:
        sched.add(s)
    steps, cache = 0, sched.cache
    while sched.has_work():
        batch = sched.schedule()
        assert batch, "a step with work but nothing to run"
        check(batch)
        nd = batch.num_decoding
        assert all(s.decoding for s, _ in batch.items[:nd]) and not any(s.decoding for s, _ in batch.items[nd:])
        assert len(batch.items) <= sched.max_batch
        assert sum(n for _, n in batch.items) <= (sched.max_step_tokens or 1 << 30)
        assert sum(n for s, n in batch.items if not s.decoding) <= (sched.prefill_chunk or 1 << 30)
        if cache.paged:  # the pages cover every position written this step, and no page is shared
            for s, n in batch.items:
                assert len(s.cache) == pages_for(s.computed + n)
            owned = [p for s in sched.running for p in s.cache]
            assert len(owned) == len(set(owned)) == cache.used
        else:  # each running sequence holds a region of its max_len rows; regions never overlap
            regions = sorted(s.cache for s in sched.running)
            assert all(n == s.max_len for s, (_, n) in zip(sorted(sched.running, key=lambda s: s.cache), regions))
            assert all(a + n <= b for (a, n), (b, _) in zip(regions, regions[1:]))
            assert sum(n for _, n in regions) == cache.used
        for s in sched.advance(batch):
            s.tokens.append(7)
            if len(s.tokens) >= s.max_len:
                sched.remove(s)
        steps += 1
        assert steps < 10_000
    assert cache.used == 0
    return steps


def test_pages_grow_one_by_one_and_chunks_respect_the_budget():
    sched = Scheduler(PagedCache(8 * PAGE_SIZE), max_batch=4, max_step_tokens=64)
    seqs = [Sequence(i, [1] * 100, 100, 100 + 200, arrival=i) for i in range(2)]
    seen = []
    simulate(sched, seqs, lambda b: seen.append([(s.seq_id, n, len(s.cache)) for s, n in b.items]))
    assert seen[0] == [(0, 64, 1)]                   # chunk 1 of sequence 0 fills the budget
    assert seen[1] == [(0, 36, 1), (1, 28, 1)]       # its rest, then sequence 1 starts beside it
    for sid in (0, 1):  # grown page by page, as the sequence grows, to 300 tokens
        counts = [p for step in seen for i, _, p in step if i == sid]
        assert counts[0] == 1 and counts[-1] == 3 and all(b - a in (0, 1) for a, b in zip(counts, counts[1:]))
    assert sched.preemptions == 0


def test_prefill_chunk_leaves_decoding_sequences_their_token():
    """ppl.pmx's context chunking: at most `prefill_chunk` prefill tokens a step, beside every decoding sequence."""
    sched = Scheduler(OffsetCache(1000), max_batch=4, prefill_chunk=16)
    seqs = [Sequence(0, [1] * 3, 3, 40), Sequence(1, [1] * 50, 50, 60, arrival=1)]
    seen = []
    simulate(sched, seqs, lambda b: seen.append([(s.seq_id, n) for s, n in b.items]))
    assert seen[:4] == [[(0, 3), (1, 13)], [(0, 1), (1, 16)], [(0, 1), (1, 16)], [(0, 1), (1, 5)]]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "offset"])
def test_a_cache_too_small_for_all_runs_everything_in_turn(paged):
    """More work than the cache holds at once: paged preempts the latest arrivals (their tokens prefilled again
    later), offset admits a sequence only when a region of its max_len is free; every sequence finishes."""
    rng = random.Random(0)
    rows = 4 * PAGE_SIZE
    sched = Scheduler(PagedCache(rows) if paged else OffsetCache(rows), max_batch=6, max_step_tokens=96)
    seqs = [Sequence(i, [1] * rng.randint(1, 200), 0, 0, arrival=i) for i in range(12)]
    for s in seqs:
        s.prompt_len, s.max_len = len(s.tokens), min(len(s.tokens) + rng.randint(1, 300), rows)
    simulate(sched, seqs)
    assert (sched.preemptions > 0) == paged
    assert all(len(s.tokens) == s.max_len for s in seqs)


def test_offset_regions_are_first_fit_and_merge_when_freed():
    cache = OffsetCache(100)
    a, b, c = (Sequence(i, [1], 1, n) for i, n in enumerate((30, 30, 40)))
    assert all(cache.grow(s, 1) for s in (a, b, c)) and (a.cache, b.cache, c.cache) == ((0, 30), (30, 30), (60, 40))
    cache.release(a)
    cache.release(c)
    d = Sequence(3, [1], 1, 45)
    assert not cache.grow(d, 1) and cache.free == 70   # 30 + 40, apart
    cache.release(b)
    assert cache.grow(d, 1) and d.cache == (0, 45)      # all three merged back into one region


def test_a_sequence_larger_than_the_cache_is_refused():
    sched = Scheduler(PagedCache(2 * PAGE_SIZE), max_batch=2, max_step_tokens=8)
    assert sched.cache.fits(2 * PAGE_SIZE) and not sched.cache.fits(2 * PAGE_SIZE + 1)
    with pytest.raises(ValueError, match="does not fit a KV cache of 2 pages"):
        sched.add(Sequence(0, [1], 1, 2 * PAGE_SIZE + 1))
    with pytest.raises(ValueError, match="at least max_batch"):
        Scheduler(PagedCache(2 * PAGE_SIZE), max_batch=8, max_step_tokens=4)
