"""The one scheduler (runner.engine.scheduler): continuous batching over a paged or an offset KV cache, prefill in
chunks within the step's budgets, preemption when pages run out; pure Python, no model."""

from __future__ import annotations

import random

import pytest

from runner.engine.scheduler import OffsetAllocator, PageAllocator, Scheduler, Sequence
from runner.kernels.reference import PAGE_SIZE


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE)


def simulate(sched: Scheduler, seqs: list, check=lambda batch: None) -> int:
    """Runs the scheduler to the end, each sequence "sampling" token 7 until max_len; returns the steps."""
    for s in seqs:
        sched.add(s)
    steps, alloc = 0, sched.allocator
    while sched.has_work():
        batch = sched.schedule()
        assert batch, "a step with work but nothing to run"
        check(batch)
        nd = batch.num_decoding
        assert all(s.decoding for s, _ in batch.items[:nd]) and not any(s.decoding for s, _ in batch.items[nd:])
        assert len(batch.items) <= sched.max_batch
        assert sum(n for _, n in batch.items) <= (sched.max_step_tokens or 1 << 30)
        assert sum(n for s, n in batch.items if not s.decoding) <= (sched.prefill_chunk or 1 << 30)
        if alloc.paged:  # the pages cover every position written this step, and no page is shared
            for s, n in batch.items:
                assert len(s.region) == pages_for(s.computed + n)
            owned = [p for s in sched.running for p in s.region]
            assert len(owned) == len(set(owned)) == alloc.used
        else:  # each running sequence holds a region of its max_len rows; regions never overlap
            regions = sorted(s.region for s in sched.running)
            assert all(n == s.max_len for s, (_, n) in zip(sorted(sched.running, key=lambda s: s.region), regions))
            assert all(a + n <= b for (a, n), (b, _) in zip(regions, regions[1:]))
            assert sum(n for _, n in regions) == alloc.used
        for s in sched.advance(batch):
            s.tokens.append(7)
            if len(s.tokens) >= s.max_len:
                sched.remove(s)
        steps += 1
        assert steps < 10_000
    assert alloc.used == 0
    return steps


def test_pages_grow_one_by_one_and_chunks_respect_the_budget():
    sched = Scheduler(PageAllocator(8 * PAGE_SIZE), max_batch=4, max_step_tokens=64)
    seqs = [Sequence(i, [1] * 100, 100, 100 + 200, arrival=i) for i in range(2)]
    seen = []
    simulate(sched, seqs, lambda b: seen.append([(s.seq_id, n, len(s.region)) for s, n in b.items]))
    assert seen[0] == [(0, 64, 1)]                   # chunk 1 of sequence 0 fills the budget
    assert seen[1] == [(0, 36, 1), (1, 28, 1)]       # its rest, then sequence 1 starts beside it
    for sid in (0, 1):  # grown page by page, as the sequence grows, to 300 tokens
        counts = [p for step in seen for i, _, p in step if i == sid]
        assert counts[0] == 1 and counts[-1] == 3 and all(b - a in (0, 1) for a, b in zip(counts, counts[1:]))
    assert sched.preemptions == 0


def test_prefill_chunk_leaves_decoding_sequences_their_token():
    """ppl.pmx's context chunking: at most `prefill_chunk` prefill tokens a step, beside every decoding sequence."""
    sched = Scheduler(OffsetAllocator(1000), max_batch=4, prefill_chunk=16)
    seqs = [Sequence(0, [1] * 3, 3, 40), Sequence(1, [1] * 50, 50, 60, arrival=1)]
    seen = []
    simulate(sched, seqs, lambda b: seen.append([(s.seq_id, n) for s, n in b.items]))
    assert seen[:4] == [[(0, 3), (1, 13)], [(0, 1), (1, 16)], [(0, 1), (1, 16)], [(0, 1), (1, 5)]]


def test_decode_chunk_keeps_steps_small_while_sequences_decode():
    """A prompt that arrives while others decode is prefilled `decode_chunk` tokens a step (their next tokens wait
    for no long chunk); alone, it takes whole `prefill_chunk`s."""
    sched = Scheduler(OffsetAllocator(1000), max_batch=4, prefill_chunk=64, decode_chunk=8)
    seqs = [Sequence(0, [1] * 100, 100, 110), Sequence(1, [1] * 30, 30, 40, arrival=1)]
    seen = []
    simulate(sched, seqs, lambda b: seen.append([(s.seq_id, n) for s, n in b.items]))
    assert seen[:4] == [[(0, 64)], [(0, 36), (1, 28)], [(0, 1), (1, 2)], [(0, 1), (1, 1)]]
    sched = Scheduler(OffsetAllocator(1000), max_batch=4, prefill_chunk=64, decode_chunk=8)
    seqs = [Sequence(0, [1] * 3, 3, 40), Sequence(1, [1] * 30, 30, 40, arrival=1)]
    seen = []
    simulate(sched, seqs, lambda b: seen.append([(s.seq_id, n) for s, n in b.items]))
    assert seen[:5] == [[(0, 3), (1, 30)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]
    sched = Scheduler(OffsetAllocator(1000), max_batch=4, prefill_chunk=64, decode_chunk=8)
    seqs = [Sequence(0, [1] * 3, 3, 40), Sequence(1, [1] * 30, 30, 40, arrival=1)]
    sched.add(seqs[0])
    sched.advance(sched.schedule())
    seqs[0].tokens.append(7)
    sched.add(seqs[1])
    assert [(s.seq_id, n) for s, n in sched.schedule().items] == [(0, 1), (1, 8)]


def test_verifying_sequences_take_their_guesses_beside_the_decoding_ones():
    """A sequence with speculative guesses is scheduled with them, outside the prefill chunk's budget."""
    sched = Scheduler(OffsetAllocator(1000), max_batch=4, prefill_chunk=6, decode_chunk=2)
    a, b, c = Sequence(0, [1] * 3, 3, 40), Sequence(1, [1] * 3, 3, 40, arrival=1), Sequence(2, [1] * 9, 9, 40,
                                                                                             arrival=2)
    for s in (a, b):
        sched.add(s)
    sched.advance(sched.schedule())
    a.tokens.append(7)
    b.tokens += [7, 8, 9, 10]
    b.proposal = [8, 9, 10]
    sched.add(c)
    batch = sched.schedule()
    assert [(s.seq_id, n) for s, n in batch.items] == [(0, 1), (1, 4), (2, 2)] and batch.num_decoding == 1


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "offset"])
def test_a_cache_too_small_for_all_runs_everything_in_turn(paged):
    """More work than the cache holds at once: paged preempts the latest arrivals (their tokens prefilled again
    later), offset admits a sequence only when a region of its max_len is free; every sequence finishes."""
    rng = random.Random(0)
    rows = 4 * PAGE_SIZE
    sched = Scheduler(PageAllocator(rows) if paged else OffsetAllocator(rows), max_batch=6, max_step_tokens=96)
    seqs = [Sequence(i, [1] * rng.randint(1, 200), 0, 0, arrival=i) for i in range(12)]
    for s in seqs:
        s.prompt_len, s.max_len = len(s.tokens), min(len(s.tokens) + rng.randint(1, 300), rows)
    simulate(sched, seqs)
    assert (sched.preemptions > 0) == paged
    assert all(len(s.tokens) == s.max_len for s in seqs)


def test_offset_regions_are_first_fit_and_merge_when_freed():
    alloc = OffsetAllocator(100)
    a, b, c = (Sequence(i, [1], 1, n) for i, n in enumerate((30, 30, 40)))
    assert all(alloc.grow(s, 1) for s in (a, b, c)) and (a.region, b.region, c.region) == ((0, 30), (30, 30), (60, 40))
    alloc.release(a)
    alloc.release(c)
    d = Sequence(3, [1], 1, 45)
    assert not alloc.grow(d, 1) and alloc.free == 70   # 30 + 40, apart
    alloc.release(b)
    assert alloc.grow(d, 1) and d.region == (0, 45)      # all three merged back into one region


def test_a_sequence_larger_than_the_cache_is_refused():
    sched = Scheduler(PageAllocator(2 * PAGE_SIZE), max_batch=2, max_step_tokens=8)
    assert sched.allocator.fits(2 * PAGE_SIZE) and not sched.allocator.fits(2 * PAGE_SIZE + 1)
    with pytest.raises(ValueError, match="does not fit a KV cache of 2 pages"):
        sched.add(Sequence(0, [1], 1, 2 * PAGE_SIZE + 1))
    with pytest.raises(ValueError, match="at least max_batch"):
        Scheduler(PageAllocator(2 * PAGE_SIZE), max_batch=8, max_step_tokens=4)


def run_to_end(sched: Scheduler, seqs: list) -> None:
    """simulate() for sequences added later to a scheduler that already ran others."""
    for s in seqs:
        sched.add(s)
    while sched.has_work():
        batch = sched.schedule()
        for s in sched.advance(batch):
            s.tokens.append(7)
            if len(s.tokens) >= s.max_len:
                sched.remove(s)


def test_prefix_caching_shares_the_pages_of_a_common_prefix():
    """A second sequence whose first 2.5 pages equal a finished one's takes its first two (full) pages and computes
    only the rest; a prompt that is all cached still computes its last token; the pages stay until room is needed."""
    alloc = PageAllocator(8 * PAGE_SIZE, prefix_caching=True)
    sched = Scheduler(alloc, max_batch=4)
    common = list(range(1, 2 * PAGE_SIZE + 60))
    first = Sequence(0, common + [5], len(common) + 1, len(common) + 3)
    run_to_end(sched, [first])
    assert alloc.used == 0 and alloc.free == 8 and len(alloc._evictable) == 2   # two full pages kept, evictable
    second = Sequence(1, common + [9, 9], len(common) + 2, len(common) + 4, arrival=1)
    sched.add(second)
    batch = sched.schedule()
    assert batch.items == [(second, len(common) + 2 - 2 * PAGE_SIZE)] and second.computed == 2 * PAGE_SIZE
    assert second.region[:2] == first_pages(alloc, common, 2) and (alloc.queries, alloc.hits) == (1 + 2, 2)  # (first missed at once)
    run_to_end(sched, [])
    whole = Sequence(2, list(range(1, 2 * PAGE_SIZE + 1)), 2 * PAGE_SIZE, 2 * PAGE_SIZE + 1, arrival=2)
    sched.add(whole)
    assert sched.schedule().items == [(whole, PAGE_SIZE)]   # page 2 is not reused: its last token is computed again
    sched.remove(whole)


def first_pages(alloc: PageAllocator, tokens: list, n: int) -> list:
    from runner.engine.scheduler import _page_key
    key, pages = None, []
    for i in range(n):
        key = _page_key(key, tokens, i)
        pages.append(alloc._page_of[key])
    return pages


def test_prefix_pages_are_shared_by_count_and_evicted_least_recently_used():
    """Two running sequences hold one cached page together; it is evicted only once neither holds it, after older
    cached pages; a twin page (same content computed twice at once) stays unkeyed and frees normally."""
    alloc = PageAllocator(7 * PAGE_SIZE, prefix_caching=True)
    sched = Scheduler(alloc, max_batch=4)
    a = list(range(1, PAGE_SIZE + 1))
    old = Sequence(0, [3] * PAGE_SIZE + [1], PAGE_SIZE + 1, PAGE_SIZE + 2)
    run_to_end(sched, [old])                                     # one cached page of 3s
    twins = [Sequence(i, a + [i], PAGE_SIZE + 1, PAGE_SIZE + 40, arrival=i) for i in (1, 2)]
    for s in twins:
        sched.add(s)
    sched.advance(sched.schedule())                              # both prefill page `a` at once: twins
    assert len({s.region[0] for s in twins}) == 2 and sum(p in alloc._key_of for p in (t.region[0] for t in twins)) == 1
    later = Sequence(3, a + [8], PAGE_SIZE + 1, PAGE_SIZE + 40, arrival=3)
    sched.add(later)
    sched.schedule()
    keyed = next(t.region[0] for t in twins if t.region[0] in alloc._key_of)
    assert later.region[0] == keyed and alloc._refs[keyed] == 2  # shared by count
    for s in twins + [later]:
        sched.remove(s)
    assert list(alloc._evictable) == [old_page := next(p for p, k in alloc._key_of.items() if k[1][0] == 3), keyed]
    grab = Sequence(9, [1], 1, 6 * PAGE_SIZE)
    assert alloc.grow(grab, 6 * PAGE_SIZE) and old_page in grab.region and keyed not in grab.region  # oldest first
