"""Dynamic-batching text generation over the engine step.

Each step packs the active sequences, decoding ones first (one token each), then those still in
prefill (their prompt, or its next chunk when context chunking limits a step's prefill tokens).
Sequences join while there is room in the batch and the cache, and leave (freeing their cache)
on EOS or at max_gen_len. Each step is planned from the Python ints kept here (`Transformer.plan`)
and run by the device step; a dumped step goes through ppl.pmx's step inputs instead
(`Transformer.forward`), which make the same plan. Every rank samples from the same all-gathered
logits with the same seeded generator, so the ranks agree on each token without a broadcast.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from runner.engine.dump import TensorDumper
from runner.engine.model import Transformer
from runner.engine.sampler import Sampler, SamplingParams
from runner.errors import PmxError
from runner.kernels.reference import PAGE_SIZE


@dataclass
class _Seq:
    index: int                  # position in the caller's prompt list
    tokens: list                # prompt, then generated ids
    prompt_len: int
    max_len: int                # prompt_len + max_gen_len, capped by the model's positions
    cache: object               # offset (int) or list of page starts
    done_prefill: int = 0       # prompt tokens already in the cache
    generated: list = field(default_factory=list)

    @property
    def decoding(self) -> bool:
        return self.done_prefill >= self.prompt_len


class _CacheRows:
    """Hands out cache rows: contiguous regions (offset mode) or 128-row pages (paged mode)."""

    def __init__(self, total_rows: int, paged: bool):
        self.paged = paged
        if paged:
            self.free_pages = list(range(0, total_rows, PAGE_SIZE))
        else:
            self.free = [(0, total_rows)]  # (start, length), first fit

    def take(self, rows: int):
        if self.paged:
            n = math.ceil(rows / PAGE_SIZE)
            if n > len(self.free_pages):
                return None
            pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
            return pages
        for i, (s, length) in enumerate(self.free):
            if length >= rows:
                self.free[i] = (s + rows, length - rows)
                return (s, rows)
        return None

    def give(self, handle) -> None:
        if self.paged:
            self.free_pages.extend(handle)
        else:
            self.free.append(handle)
            self.free.sort()
            merged = [self.free[0]]
            for s, n in self.free[1:]:
                if merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((s, n))
            self.free = merged


class Generator:
    def __init__(self, model: Transformer, max_batch: int = 256, context_chunk: Optional[int] = None,
                 dumper: Optional[TensorDumper] = None, cache_rows: Optional[int] = None):
        self.model, self.max_batch, self.context_chunk, self.dumper = model, max_batch, context_chunk, dumper
        self.cache_rows = cache_rows
        self.comm = model.comm
        self.paged = model.options.cache_mode == 1

    def _rows_needed(self, s_len: int) -> int:
        return math.ceil(s_len / PAGE_SIZE) * PAGE_SIZE if self.paged else s_len

    def generate(self, prompts: Sequence[Sequence[int]], max_gen_len: int, sampling: SamplingParams = SamplingParams(),
                 eos_ids: Sequence[int] = (), stats: Optional[dict] = None,
                 progress: Optional[Callable[[int, int], None]] = None) -> list[list[int]]:
        """Generated ids (prompt excluded, EOS excluded) for each prompt.

        `stats`, when given, receives "steps" (engine steps run) and "step_seconds" (wall time of each).
        `progress`, when given, is called after each step with (tokens sampled in it, sequences done so far).
        """
        p = self.model.params
        if max_gen_len < 1:
            raise PmxError(f"--max_gen_len must be >= 1, got {max_gen_len}")
        limit = p.max_position_embeddings
        for i, pr in enumerate(prompts):
            if not pr:
                raise PmxError(f"prompt {i} is empty")
            if len(pr) >= limit:
                raise PmxError(f"prompt {i} has {len(pr)} tokens; the model takes at most {limit} positions")
            bad = [t for t in pr if not 0 <= t < p.vocab_size]
            if bad:
                raise PmxError(f"prompt {i} holds token ids {bad[:3]} outside the vocabulary [0, {p.vocab_size})")
        lens = [min(len(pr) + max_gen_len, limit) for pr in prompts]
        rows = self.cache_rows or sum(self._rows_needed(n) for n in lens)
        kv_cache, kv_scale = self.model.new_cache(rows)
        alloc = _CacheRows(rows, self.paged)
        sampler = Sampler(self._shared_seed(sampling))
        waiting = [(i, list(pr), n) for i, (pr, n) in enumerate(zip(prompts, lens))]
        active: list[_Seq] = []
        results: list[list[int]] = [[] for _ in prompts]
        step, eos = 0, set(eos_ids)
        step_seconds = stats.setdefault("step_seconds", []) if stats is not None else None
        while waiting or active:
            t_step = time.perf_counter()
            while waiting and len(active) < self.max_batch:
                i, pr, n = waiting[0]
                handle = alloc.take(self._rows_needed(n))
                if handle is None:
                    if not active:
                        raise PmxError(f"the KV cache ({rows} rows) cannot hold prompt {i} ({n} rows)")
                    break
                waiting.pop(0)
                active.append(_Seq(i, pr, len(pr), n, handle))
            batch = self._plan(active)
            lens = self._lengths(batch)
            if self.dumper is not None and self.dumper.wants(step):
                inputs = self._inputs(lens, kv_cache, kv_scale)
                self.dumper.dump(step, inputs)
                logits = self.model.forward(**inputs)
                self.dumper.dump(step, {"logits": logits})
            else:
                tokens, plan = self.model.step_inputs(lens.tokens, lens.seqlens, lens.start, lens.caches,
                                                      lens.num_decoding, self._causal_mask(lens))
                logits = self.model.step(tokens, plan, kv_cache, kv_scale)
            step += 1
            ready = [k for k, (s, n) in enumerate(batch) if s.done_prefill + n >= s.prompt_len]
            for s, n in batch:
                s.done_prefill = min(s.done_prefill + n, s.prompt_len) if not s.decoding else s.done_prefill
            if ready:  # every rank samples the same tokens from the same logits and generator state
                nxt = sampler.ids(logits[ready] if len(ready) < len(batch) else logits)
                for k, t in zip(ready, nxt):
                    s = batch[k][0]
                    if t in eos:
                        s.max_len = 0  # finished
                    else:
                        s.generated.append(t)
                        s.tokens.append(t)
            if step_seconds is not None:  # the sampled token has reached the host: the step is over
                step_seconds.append(time.perf_counter() - t_step)
            for s in list(active):
                if s.max_len == 0 or len(s.tokens) >= s.max_len or len(s.generated) >= max_gen_len:
                    results[s.index] = s.generated
                    alloc.give(s.cache)
                    active.remove(s)
            if progress is not None:
                progress(len(ready), len(prompts) - len(waiting) - len(active))
        if stats is not None:
            stats["steps"] = step
        return results

    def _plan(self, active: list[_Seq]) -> list[tuple[_Seq, int]]:
        """(sequence, new tokens this step): decoding sequences first, then prefill (chunked to the budget)."""
        active.sort(key=lambda s: not s.decoding)  # stable: decoding first, arrival order kept
        batch = [(s, 1) for s in active if s.decoding]
        budget = self.context_chunk
        for s in active:
            if s.decoding:
                continue
            n = s.prompt_len - s.done_prefill
            if budget is not None:
                if budget <= 0:
                    break
                n = min(n, budget)
                budget -= n
            batch.append((s, n))
        return batch

    def _shared_seed(self, sampling: SamplingParams) -> SamplingParams:
        """Sampling with a seed every rank shares: the given one, or one rank 0 draws (one broadcast)."""
        if sampling.seed is not None or sampling.temperature == 0 or self.comm.world_size == 1:
            return sampling
        seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64)
        dev = self.model.device
        seed = int(self.comm.broadcast_(seed.to(dev) if dev.type == "cuda" else seed)[0])
        return replace(sampling, seed=seed)

    @staticmethod
    def _lengths(batch) -> "_StepLengths":
        tokens, seqlens, start, caches = [], [], [], []
        for s, n in batch:
            pos = s.done_prefill if not s.decoding else len(s.tokens) - 1
            tokens.extend(s.tokens[pos:pos + n])
            seqlens.append(n)
            start.append(pos)
            caches.append(s.cache if isinstance(s.cache, list) else s.cache[0])
        return _StepLengths(tokens, seqlens, start, caches, sum(1 for s, _ in batch if s.decoding))

    def _causal_mask(self, lens: "_StepLengths") -> Optional[torch.Tensor]:
        """--auto_causal False: the explicit additive causal (and sliding-window) mask [T, sum kvlens] of a step
        with sequences in prefill; None otherwise."""
        if self.model.options.auto_causal or lens.num_decoding == len(lens.seqlens):
            return None
        window, dtype = self.model.params.sliding_window, self.model.dtype
        kvlens = [p + n for p, n in zip(lens.start, lens.seqlens)]
        mask = torch.zeros(sum(lens.seqlens), sum(kvlens), dtype=dtype)
        s0 = k0 = 0
        for n, kv, p0 in zip(lens.seqlens, kvlens, lens.start):
            qpos = p0 + torch.arange(n)[:, None]
            kpos = torch.arange(kv)[None, :]
            bad = (kpos > qpos) | ((kpos <= qpos - window) if window else torch.zeros_like(kpos, dtype=torch.bool))
            mask[s0:s0 + n, k0:k0 + kv] = torch.zeros(bad.shape, dtype=dtype).masked_fill(bad, float("-inf"))
            s0, k0 = s0 + n, k0 + kv
        return mask

    def _inputs(self, lens: "_StepLengths", kv_cache, kv_scale) -> dict:
        """The step as ppl.pmx's dynamic-batching inputs (what a dump holds)."""
        kvlens = [p + n for p, n in zip(lens.start, lens.seqlens)]
        seqstarts = torch.tensor([0] + lens.seqlens, dtype=torch.int64).cumsum(0)
        kvstarts = torch.tensor([0] + kvlens, dtype=torch.int64).cumsum(0)
        if self.paged:
            maxp = max(len(c) for c in lens.caches)
            cachestarts = torch.tensor([c + [0] * (maxp - len(c)) for c in lens.caches], dtype=torch.int64)
        else:
            cachestarts = torch.tensor(lens.caches, dtype=torch.int64)
        mask = self._causal_mask(lens)
        return dict(token_ids=torch.tensor(lens.tokens, dtype=torch.int64),
                    attn_mask=torch.empty(0, dtype=self.model.dtype) if mask is None else mask,
                    seqstarts=seqstarts, kvstarts=kvstarts, cachestarts=cachestarts,
                    decoding_batches=torch.tensor([lens.num_decoding], dtype=torch.int64),
                    start_pos=torch.tensor(lens.start, dtype=torch.int64),
                    max_seqlen=torch.tensor([max(lens.seqlens)], dtype=torch.int64),
                    max_kvlen=torch.tensor([max(kvlens)], dtype=torch.int64), kv_cache=kv_cache, kv_scale=kv_scale)


@dataclass
class _StepLengths:
    """One step's batch as Python ints: new tokens, new lengths, start positions, caches (offset or pages)."""
    tokens: list
    seqlens: list
    start: list
    caches: list
    num_decoding: int
