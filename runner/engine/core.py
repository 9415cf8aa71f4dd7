"""The engine core: continuous batching over one model rank, for every command that batches and for the server.

Each step the scheduler (runner.engine.scheduler) picks what runs, the Stepper (runner.engine.runners) plans and
runs it, and the sequences whose next token is due sample it. Every rank runs the same core on the same sequences
and samples the same tokens: the logits are gathered whole on every rank, each sequence has its own sampler, and
its seed is derived from a base seed the ranks share (drawn once by rank 0). So the ranks agree on every token by
construction, with no message per step. A sequence ends on a stop id (not appended) or at its max_len
("length"); callers end sequences for their own reasons (stop strings, cancellation) with :meth:`finish`.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence as Seq

import torch

from runner.config import EngineConfig
from runner.engine.cache import KVCache
from runner.engine.dump import TensorDumper
from runner.engine.plan import StepLengths, step_inputs
from runner.engine.runners import Stepper
from runner.engine.sampler import Sampler, SamplingParams, greedy_ids
from runner.engine.scheduler import OffsetCache, PagedCache, Scheduler, Sequence
from runner.engine.speculative import make_proposer
from runner.errors import PmxError
from runner.kernels.reference import PAGE_SIZE, QUANT_GROUP

CPU_CACHE_MEMORY_FRACTION = 0.25  # default KV budget on CPU: at most this share of the available memory


@dataclass
class Output:
    """What one step gave one sequence: its new token (None for a scored prompt) and the logits it came from: rows
    `rows` of the step's logits (indexed only when asked for: a torch call per sequence and step costs). A step
    that verified guesses gives a sequence several, in order: `finish` is the sequence's finish reason at this
    token (None where it goes on past it; the sequence's own finish_reason is that of its last)."""
    seq: Sequence
    token: Optional[int]
    step_logits: torch.Tensor
    rows: object                 # an int, or a slice of a scored prompt's chunk
    finish: Optional[str] = None
    error: Optional[str] = None  # finish "error": why the sequence could not go on (its sampling raised)

    @property
    def logits(self) -> torch.Tensor:
        """[vocab], or [rows, vocab] of a scored prompt's chunk."""
        return self.step_logits[self.rows]


class EngineCore:
    def __init__(self, model, stepper: Stepper, config: EngineConfig, draft: Optional["EngineCore"] = None):
        """`draft`: --speculative draft's draft model, an engine core of its own."""
        self.model, self.stepper, self.config, self.comm = model, stepper, config, model.comm
        self.max_model_len = model.params.max_position_embeddings
        self.cache: Optional[KVCache] = None
        self.scheduler: Optional[Scheduler] = None
        self.dumper: Optional[TensorDumper] = None
        self.steps = 0                        # steps of the current run (what dumps count)
        self._ids = itertools.count()
        self.base_seed = self._shared_seed()
        self._seeds = itertools.count()
        self.proposer = make_proposer(config, self.comm, draft)
        self.proposed = self.accepted = 0     # speculative decoding: guessed tokens verified, and accepted

    # -- the cache -----------------------------------------------------------------------------------------------
    def page_bytes(self) -> int:
        """Bytes of one page of cache on this rank (keys, values and int8 scales of every layer)."""
        m = self.model
        values = m.params.num_layers * 2 * m.kv_heads * m.head_dim * PAGE_SIZE
        return values + values // QUANT_GROUP * 2 if self.config.quantized_cache else values * m.dtype.itemsize

    def budget_rows(self, wanted: int) -> int:
        """Cache rows: --kv_cache_tokens, else `wanted` (whole pages in paged mode) within a share of the device's
        memory (the same on every rank: the smallest GPU's reading, or rank 0's of the host memory, shared by the
        ranks on each host), a draft model's cache of as many rows counted in."""
        c, dev = self.config, self.model.device
        if c.kv_cache_tokens is not None:
            return c.kv_cache_tokens
        page = PAGE_SIZE if c.paged else 1
        if dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(dev)
            budget = total * c.gpu_memory_utilization - (total - free)
        else:
            per_host = -(-self.comm.world_size // max(self.comm.machines, 1))  # (the ranks of the fullest host)
            budget = _available_memory() * CPU_CACHE_MEMORY_FRACTION / per_host
        draft = self.draft()
        page_bytes = self.page_bytes() + (draft.page_bytes() if draft is not None else 0)
        fit = int(budget // page_bytes * PAGE_SIZE) // page * page
        rows = torch.tensor([max(page, min(-(-wanted // page) * page, fit))])
        if self.comm.world_size > 1:
            rows = self.comm.all_gather(rows.to(dev)).min() if dev.type == "cuda" else self.comm.broadcast_(rows)
        return int(rows)

    def reserve(self, rows: int) -> None:
        """A cache of `rows` rows and a scheduler over it; the cache tensor is kept when it is large enough. Only
        between runs: nothing may be running."""
        if self.scheduler is not None and self.scheduler.has_work():
            raise RuntimeError("the KV cache cannot change while sequences run")
        c = self.config
        if self.cache is None or self.cache.rows < rows:
            self.cache = None  # (the old cache goes before the new one is made)
            self.cache = self.stepper.cache(*self.model.new_cache(rows))
        alloc = PagedCache(rows, c.enable_prefix_caching) if c.paged else OffsetCache(rows)
        self.scheduler = Scheduler(alloc, c.max_batch, c.max_num_batched_tokens, c.prefill_chunk,
                                   c.decode_chunk)
        if self.proposer is not None:
            self.proposer.reserve(rows)

    def draft(self) -> Optional["EngineCore"]:
        """--speculative draft's draft model's core, or None."""
        return getattr(self.proposer, "draft", None)

    def cache_bytes(self) -> int:
        """Bytes of this rank's KV cache, a draft model's included (0 before reserve)."""
        draft = self.draft()
        own = sum(t.numel() * t.element_size() for t in (self.cache.data, self.cache.scale) if t is not None) \
            if self.cache is not None else 0
        return own + (draft.cache_bytes() if draft is not None else 0)

    def touch_cache(self) -> None:
        """Writes every page of the KV cache (and a draft model's) once. A server's cache is a pool its requests walk
        through over minutes (prefix caching keeps freed pages while untouched ones remain); on CPU its memory is
        taken as it is first written, a page fault per page, which on a virtual machine whose host backs guest memory
        lazily costs up to milliseconds per MiB, inside the steps. Touched at start-up, no step pays for it."""
        for t in (self.cache.data, self.cache.scale) if self.cache is not None else ():
            if t is not None and t.device.type == "cpu":
                t.zero_()
        if self.draft() is not None:
            self.draft().touch_cache()

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
        proposing = self._propose()
        batch = self.scheduler.schedule()
        if proposing:
            self._trim_proposals(batch, proposing)
        if not batch:
            return []
        items, starts = batch.items, self.scheduler.cache.starts
        wide = tuple(s.all_logits or bool(s.proposal) for s, _ in items) if any(
            s.all_logits or s.proposal for s, _ in items) else ()
        rowwise = bool(proposing) and all(s.decoding or s.verifying for s, _ in items)  # (guesses trimmed to the step)
        b = StepLengths([t for s, n in items for t in s.tokens[s.computed:s.computed + n]], [n for _, n in items],
                        [s.computed for s, _ in items], [starts(s) for s, _ in items], batch.num_decoding, wide,
                        rowwise)
        n, self.steps = self.steps, self.steps + 1
        if self.dumper is not None and self.dumper.wants(n):
            b = replace(b, rowwise=False)  # (planned as ppl.pmx's inputs say it, as benchmark.sh replays it)
            mask = self.stepper.mask(b)
            self.dumper.dump(n, {**step_inputs(b, mask, self.model.dtype), "kv_cache": self.cache.data,
                                 "kv_scale": self.cache.scale})
            logits = self.stepper.run(*self.stepper.plan(b, mask), self.cache)
            self.dumper.dump(n, {"logits": logits})
        else:
            logits = self.stepper.run(*self.stepper.plan(b), self.cache)
        return self._outputs(batch, logits, wide)

    def _propose(self) -> list[Sequence]:
        """Speculative decoding: each decoding sequence's guessed tokens, appended (the step verifies them)."""
        if self.proposer is None:
            return []
        cands = [s for s in self.scheduler.running  # (penalties count the tokens so far: no guesses among them)
                 if s.decoding and not s.all_logits and s.constraint is None and not s.sampler.params.adjusts
                 and s.max_len - len(s.tokens) > 0]
        proposing = []
        for s, guess in zip(cands, self.proposer.propose_all(cands) if cands else ()):
            s.proposal = guess[: s.max_len - len(s.tokens)]
            if s.proposal:
                s.tokens += s.proposal
                proposing.append(s)
        return proposing

    @staticmethod
    def _trim_proposals(batch, proposing: list) -> None:
        """Guesses the step does not take (its budget cut them, or the sequence was preempted) are dropped."""
        fed = {s.seq_id: n for s, n in batch.items}
        for s in proposing:
            keep = max(fed.get(s.seq_id, 0) - 1, 0)
            if keep < len(s.proposal):
                del s.tokens[len(s.tokens) - len(s.proposal) + keep:]
                s.proposal = s.proposal[:keep]

    def _outputs(self, batch, logits: torch.Tensor, wide: tuple) -> list[Output]:
        items, rows, last, kept, verified = batch.items, {}, {}, {}, {}
        row = 0
        for i, (s, n) in enumerate(items):
            k = n if wide and wide[i] else 1
            rows[s.seq_id], last[s.seq_id] = row, row + k - 1
            row += k
            if s.proposal:  # verified now, before the scheduler keys the pages it fills
                a, t = s.sampler.verify(logits[rows[s.seq_id]: row], s.proposal)
                del s.tokens[len(s.tokens) - len(s.proposal) + a:]
                verified[s.seq_id], kept[s.seq_id] = (s.proposal[:a], t), 1 + a
                self.proposed, self.accepted = self.proposed + len(s.proposal), self.accepted + a
                s.proposal = []
        ready = self.scheduler.advance(batch, kept)
        out = []
        for s, n in items:
            if s.all_logits:
                out.append(Output(s, None, logits, slice(rows[s.seq_id], rows[s.seq_id] + n)))
        due = [s for s in ready if not s.all_logits and s.seq_id not in verified]
        for s in [s for s in ready if s.all_logits]:  # a scored prompt is done once it is all in the cache
            self.finish(s, "length")
        if due:
            lg = logits if len(due) == len(items) and not wide else logits[[last[s.seq_id] for s in due]]
            greedy = [k for k, s in enumerate(due) if s.sampler.plain_greedy and s.constraint is None]
            ids = [0] * len(due)
            if greedy:
                for k, t in zip(greedy, greedy_ids(lg if len(greedy) == len(due) else lg[greedy])):
                    ids[k] = t
            for k, s in enumerate(due):
                try:
                    if s.constraint is not None:  # structured output: only what the grammar allows next
                        ids[k] = int(s.sampler(s.constraint.mask(lg[k])[None])[0])
                        self._take(s, ids[k], out, lg, k, stop=s.constraint.accept(ids[k]))
                        continue
                    if not s.sampler.plain_greedy:
                        ids[k] = int(s.sampler(lg[k:k + 1])[0])
                except Exception as e:  # noqa: BLE001 - one sequence's failure ends it, not the step of all
                    self.finish(s, "error")
                    out.append(Output(s, None, lg, k, "error", f"{type(e).__name__}: {e}"))
                    continue
                self._take(s, ids[k], out, lg, k)
        for s in ready:
            if s.seq_id in verified:  # the accepted guesses (already in its tokens), then the verified token
                accepted, t = verified[s.seq_id]
                base, r0 = len(s.tokens) - len(accepted), rows[s.seq_id]
                for j, x in enumerate(accepted):
                    if x in s.stop_ids:  # a guessed stop: the sequence ends before it, as if it had sampled it
                        del s.tokens[base + j:]
                        s.finish_reason = "stop"
                    elif base + j + 1 >= s.max_len:
                        s.finish_reason = "length"
                    out.append(Output(s, x, logits, r0 + j, s.finish_reason))
                    if s.finish_reason is not None:
                        self.scheduler.remove(s)
                        break
                else:
                    self._take(s, t, out, logits, r0 + len(accepted))
        return out

    def _take(self, s: Sequence, t: int, out: list, logits: torch.Tensor, row, stop: bool = False) -> None:
        """Sequence s sampled token t: appended, or a stop; it ends on a stop id (or `stop`) or at its max_len."""
        if stop or t in s.stop_ids:
            s.finish_reason = "stop"
        else:
            s.tokens.append(t)
            if len(s.tokens) >= s.max_len:
                s.finish_reason = "length"
        if s.finish_reason is not None:
            self.scheduler.remove(s)
        out.append(Output(s, t, logits, row, s.finish_reason))

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


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
