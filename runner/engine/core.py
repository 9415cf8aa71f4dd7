"""The engine core: continuous batching over one model rank, for every command that batches and for the server.

It is four parts, each with a small interface of its own, and a step that reads as their sequence (:meth:`step`):

- the cache budget (runner.engine.cache.CacheBudget): how many KV-cache rows fit, the tensors, their first write;
- the scheduler (runner.engine.scheduler.Scheduler): which sequences run this step and how many tokens each, over an
  allocator of the cache's rows;
- the Stepper (runner.engine.runners): plans the step and runs it on the first runner that accepts it;
- the output processor (runner.engine.outputs.OutputProcessor): speculative guesses verified, tokens sampled, finish
  reasons.

Every rank runs the same core on the same sequences and samples the same tokens: the logits are gathered whole on
every rank, each sequence has its own sampler, and its seed is derived from a base seed the ranks share (drawn once by
rank 0). So the ranks agree on every token by construction, with no message per step. Callers end sequences for their
own reasons (stop strings, cancellation) with :meth:`EngineCore.finish`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Callable, Optional, Sequence as Seq

import torch

from runner.config import EngineConfig
from runner.engine.cache import CacheBudget, KVCache
from runner.engine.dump import TensorDumper
from runner.engine.outputs import Output, OutputProcessor
from runner.engine.plan import StepLengths, step_inputs
from runner.engine.runners import Stepper
from runner.engine.sampler import Sampler, SamplingParams
from runner.engine.scheduler import OffsetAllocator, PageAllocator, Scheduler, Sequence, StepBatch
from runner.engine.speculative import drop_unscheduled, make_proposer, propose
from runner.errors import PmxError
from runner.kernels.reference import PAGE_SIZE

__all__ = ["EngineCore", "Output"]


class EngineCore:
    def __init__(self, model, stepper: Stepper, config: EngineConfig, draft: Optional["EngineCore"] = None):
        """`draft`: --speculative draft's draft model, an engine core of its own."""
        self.model, self.stepper, self.config, self.comm = model, stepper, config, model.comm
        self.max_model_len = model.params.max_position_embeddings
        self.budget = CacheBudget(model, config, stepper.cache)
        self.scheduler: Optional[Scheduler] = None
        self.outputs = OutputProcessor()
        self.dumper: Optional[TensorDumper] = None
        self.steps = 0                        # steps of the current run (what dumps count)
        self._ids = itertools.count()
        self.base_seed = self._shared_seed()
        self._seeds = itertools.count()
        self.proposer = make_proposer(config, self.comm, draft)

    # -- the cache -----------------------------------------------------------------------------------------------
    @property
    def cache(self) -> Optional[KVCache]:
        """This rank's KV cache (None before :meth:`reserve`)."""
        return self.budget.cache

    def budget_rows(self, wanted: int) -> int:
        """Cache rows for `wanted` within the memory budget (CacheBudget.rows), a draft model's cache counted in."""
        draft = self.draft()
        return self.budget.rows(wanted, [draft.budget] if draft is not None else [])

    def reserve(self, rows: int) -> None:
        """A cache of `rows` rows (the tensors kept when large enough) and a scheduler over it. Only between runs:
        nothing may be running."""
        if self.scheduler is not None and self.scheduler.has_work():
            raise RuntimeError("the KV cache cannot change while sequences run")
        c = self.config
        self.budget.reserve(rows)
        alloc = PageAllocator(rows, c.enable_prefix_caching) if c.paged else OffsetAllocator(rows)
        self.scheduler = Scheduler(alloc, c.max_batch, c.max_num_batched_tokens, c.prefill_chunk, c.decode_chunk)
        if self.proposer is not None:
            self.proposer.reserve(rows)

    def draft(self) -> Optional["EngineCore"]:
        """--speculative draft's draft model's core, or None."""
        return getattr(self.proposer, "draft", None)

    def cache_bytes(self) -> int:
        """Bytes of this rank's KV cache, a draft model's included (0 before reserve)."""
        draft = self.draft()
        return self.budget.nbytes() + (draft.cache_bytes() if draft is not None else 0)

    def touch_cache(self) -> None:
        """Writes every page of the KV cache (and a draft model's) once (CacheBudget.touch)."""
        self.budget.touch()
        if self.draft() is not None:
            self.draft().touch_cache()

    @property
    def proposed(self) -> int:
        """Speculative decoding: guessed tokens verified so far."""
        return self.outputs.proposed

    @property
    def accepted(self) -> int:
        """Speculative decoding: guessed tokens accepted so far."""
        return self.outputs.accepted

    # -- sequences -----------------------------------------------------------------------------------------------
    def check_prompt(self, ids: Seq[int], what: str = "prompt", room: int = 1) -> None:
        """A prompt of known token ids leaving `room` positions free; PmxError naming `what` otherwise."""
        vocab = self.model.params.vocab_size
        if not ids:
            raise PmxError(f"{what} is empty")
        if len(ids) + room > self.max_model_len:
            raise PmxError(f"{what} has {len(ids)} tokens; the model takes at most {self.max_model_len} positions")
        bad = [t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)]
        if bad:
            raise PmxError(f"{what} holds token ids {bad[:3]} outside the vocabulary [0, {vocab})")

    def add(self, prompt: Seq[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
            stop_ids: Seq[int] = (), all_logits: bool = False, state=None, constraint=None) -> Sequence:
        """Queues a sequence: `prompt` then at most `max_new_tokens` (within the model's positions) sampled with
        `sampling` (its seed, or one derived from the shared base seed) and masked by `constraint` (structured
        output); `all_logits`: score the prompt instead."""
        seed = sampling.seed if sampling.seed is not None else self.next_seed()
        i, tokens = next(self._ids), list(prompt)
        seq = Sequence(i, tokens, len(prompt), min(len(prompt) + max_new_tokens, self.max_model_len), arrival=i,
                       stop_ids=frozenset(stop_ids), sampler=Sampler(replace(sampling, seed=seed), tokens, len(prompt)),
                       all_logits=all_logits, state=state, constraint=constraint)
        self.scheduler.add(seq)
        return seq

    def next_seed(self) -> int:
        """The next seed derived from the ranks' shared base seed (the same on every rank, call for call)."""
        return self.base_seed + next(self._seeds)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends `seq` now (a stop string, a cancelled request) and frees its cache."""
        seq.finish_reason = seq.finish_reason or reason
        self.scheduler.remove(seq)

    def has_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_work()

    # -- one step ------------------------------------------------------------------------------------------------
    def step(self) -> list[Output]:
        """Runs one step; returns what it gave each sequence, in order: its new tokens (several where speculative
        decoding guessed right), or a scored prompt's logits."""
        guessing = propose(self.proposer, self.scheduler.running) if self.proposer is not None else []
        batch = self.scheduler.schedule()
        drop_unscheduled(batch, guessing)
        if not batch:
            return []
        lengths = self._lengths(batch, bool(guessing))
        logits = self._run(lengths)
        return self.outputs.process(batch, logits, lengths.all_rows, self.scheduler)

    def _lengths(self, batch: StepBatch, guessing: bool) -> StepLengths:
        """The step's batch as ints: each sequence's new tokens, position and cache; `all_rows` where a sequence
        wants a row per new token (a scored prompt, a sequence with guesses); rowwise where every sequence decodes
        (with its guesses, trimmed to the step)."""
        items, starts = batch.items, self.scheduler.allocator.starts
        wide = tuple(s.all_logits or bool(s.proposal) for s, _ in items) if any(
            s.all_logits or s.proposal for s, _ in items) else ()
        return StepLengths([t for s, n in items for t in s.tokens[s.computed:s.computed + n]], [n for _, n in items],
                           [s.computed for s, _ in items], [starts(s) for s, _ in items], batch.num_decoding, wide,
                           guessing and all(s.decoding or s.verifying for s, _ in items))

    def _run(self, b: StepLengths) -> torch.Tensor:
        """The step's logits; a step the dumper wants is planned as ppl.pmx's inputs say it (as benchmark.sh replays
        it) and its inputs, cache and logits are dumped."""
        n, self.steps = self.steps, self.steps + 1
        if self.dumper is None or not self.dumper.wants(n):
            return self.stepper.run(*self.stepper.plan(b), self.cache)
        b = replace(b, rowwise=False)
        mask = self.stepper.mask(b)
        self.dumper.dump(n, {**step_inputs(b, mask, self.model.dtype), "kv_cache": self.cache.data,
                             "kv_scale": self.cache.scale})
        logits = self.stepper.run(*self.stepper.plan(b, mask), self.cache)
        self.dumper.dump(n, {"logits": logits})
        return logits

    # -- whole runs ----------------------------------------------------------------------------------------------
    def start_run(self, needs: Seq[int], dumper: Optional[TensorDumper] = None) -> None:
        """A new run of sequences needing `needs` cache rows each: the cache sized for all of them at once (within
        the budget), its steps counted from 0 for the dumper."""
        page = PAGE_SIZE if self.config.paged else 1
        self.reserve(self.budget_rows(sum(-(-n // page) * page for n in needs)))  # (each sequence whole pages)
        self.dumper, self.steps = dumper, 0

    def generate(self, prompts: Seq[Seq[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 stop_ids: Seq[int] = (), dumper: Optional[TensorDumper] = None, stats: Optional[dict] = None,
                 progress: Optional[Callable[[int, int], None]] = None) -> list[list[int]]:
        """The ids each prompt generates (stop ids excluded), greedy or sampled: prompt i's seed is sampling.seed
        + i, or without one the shared base seed's next. `stats` receives "steps", "step_seconds" (wall time of
        each step) and "prefill_steps" (the steps until every sequence had its first token); `progress(new tokens,
        sequences done)` is called after each step."""
        if max_new_tokens < 1:
            raise PmxError(f"--max_gen_len must be >= 1, got {max_new_tokens}")
        for i, p in enumerate(prompts):
            self.check_prompt(p, f"prompt {i}")
        self.start_run([min(len(p) + max_new_tokens, self.max_model_len) for p in prompts], dumper)
        seqs = []
        for i, p in enumerate(prompts):
            s = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i)
            try:
                seqs.append(self.add(p, max_new_tokens, s, stop_ids))
            except ValueError:
                raise PmxError(f"the KV cache ({self.cache.rows} rows) cannot hold prompt {i} and its "
                               f"{max_new_tokens} new tokens") from None
        times = stats.setdefault("step_seconds", []) if stats is not None else None
        done, started = 0, set()
        while self.has_work():
            t0 = time.perf_counter()
            outs = self.step()
            if times is not None:  # the sampled tokens have reached the host: the step is over
                times.append(time.perf_counter() - t0)
                if len(started) < len(seqs):
                    started.update(o.seq.seq_id for o in outs)
                    stats["prefill_steps"] = len(times)
            failed = next((o for o in outs if o.finish == "error"), None)
            if failed is not None:  # (a batch job has no one to hand one sequence's failure to: it ends the job)
                raise PmxError(f"prompt {seqs.index(failed.seq)} could not go on: {failed.error}")
            if progress is not None:
                done += sum(o.finish is not None for o in outs)
                progress(sum(o.token is not None and o.finish != "stop" for o in outs), done)
        if stats is not None:
            stats["steps"] = self.steps
        self.dumper = None
        return [s.generated for s in seqs]

    def score(self, prompts: Seq[Seq[int]], on_logits: Callable[[int, int, torch.Tensor], None]) -> None:
        """Runs each prompt's prefill and hands its logits over as they come: on_logits(prompt index, first
        position, logits [rows, vocab]) for every chunk (row r predicts the token after position first + r)."""
        for i, p in enumerate(prompts):
            self.check_prompt(p, f"prompt {i}", room=0)
        self.start_run([len(p) for p in prompts])
        for i, p in enumerate(prompts):
            self.add(p, 0, all_logits=True, state=i)
        handed = [0] * len(prompts)  # positions handed over (a preempted prompt is prefilled again)
        while self.has_work():
            for o in self.step():
                i, first = o.seq.state, o.seq.computed - o.logits.shape[0]
                if handed[i] < o.seq.computed:
                    on_logits(i, handed[i], o.logits[handed[i] - first:])
                    handed[i] = o.seq.computed

    def _shared_seed(self) -> int:
        """A base seed every rank shares: rank 0 draws it (one broadcast at start-up)."""
        seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64)
        if self.comm.world_size > 1:
            dev = self.model.device
            seed = self.comm.broadcast_(seed.to(dev) if dev.type == "cuda" else seed)
        return int(seed[0])

