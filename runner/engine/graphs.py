"""CUDA graphs of the decode step: one captured graph per batch-size bucket, replayed over persistent inputs.

A step where every sequence decodes one token has fixed structure, and on CUDA with the Triton kernels it
reads only the plan's per-sequence tensors (tokens, cache slots, rotary angles, cache starts, lengths): the
decode attention kernel walks the cache itself and takes its split count from the batch size, never from the
history lengths. So the step is captured once per bucket of batch sizes (1, 2, 4, 8, ...: the next power of
two at or above the batch) into a CUDA graph over persistent input buffers of the bucket's size, and every
later decode step of that bucket copies its plan into those buffers and replays the graph: one launch
instead of a few hundred, with the all-reduces (NCCL) inside the graph.

A batch smaller than its bucket is padded: padding rows decode token 0 at cache slot -1 (their K/V are not
stored) with a history of length 0 (their attention is 0), and their logits are dropped. A graph holds the
addresses of the KV cache it was captured with, so the graphs are kept for one cache at a time (a new cache
tensor, e.g. the next `generate` call's, recaptures; one allocated where the previous one was reuses them).

The buffer handling (:func:`bucket_of`, :class:`StaticDecodeInputs`) runs on any device and is tested on CPU;
the capture itself needs CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from runner.engine.plan import DecodeAttention, StepPlan
from runner.kernels.reference import PAGE_SIZE


def bucket_of(batch: int) -> int:
    """The batch-size bucket of a decode step: the next power of two at or above `batch`."""
    if batch < 1:
        raise ValueError(f"a decode step has at least one sequence, got {batch}")
    return 1 << (batch - 1).bit_length()


class StaticDecodeInputs:
    """The persistent inputs of a decode step padded to `size` sequences, and the plan that reads them.

    `max_pages`: page-table width of a paged cache (None: offset cache, one start per sequence). The ints (token
    ids, cache slots, history lengths, cache starts) live in one int64 buffer and cos/sin in one float32 buffer,
    each mirrored by a host buffer (pinned on CUDA): :meth:`stage` writes a decode step's ints there with numpy
    and moves them with two copies, where :meth:`load` copies a plan made by ``make_plan`` field by field."""

    def __init__(self, size: int, half_dim: int, max_pages: Optional[int], device: torch.device):
        self.size, self.max_pages, self.half_dim = size, max_pages, half_dim
        width = max_pages if max_pages is not None else 1
        pin = device.type == "cuda"
        self._ints = torch.zeros((3 + width) * size, dtype=torch.int64, device=device)
        self._floats = torch.zeros(2 * size * half_dim, dtype=torch.float32, device=device)
        self._host_ints = torch.zeros(self._ints.shape, dtype=torch.int64, pin_memory=pin)
        self._host_floats = torch.zeros(self._floats.shape, dtype=torch.float32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None   # the last stage's copies out of the host buffers
        self.tokens, self.slots, self.kvlens = self._ints[: 3 * size].view(3, size)
        cs = self._ints[3 * size:]
        self.cachestarts = cs.view(size, max_pages) if max_pages is not None else cs
        self.cos, self.sin = self._floats.view(2, size, half_dim)
        self.slots.fill_(-1)
        self.plan = StepPlan(self.slots, self.cos, self.sin, None,
                             DecodeAttention(None, None, self.cachestarts, self.kvlens))
        self.staged = 0  # sequences of the step staged last (0: none)

    def fits(self, tokens: torch.Tensor, plan: StepPlan) -> bool:
        """Whether this decode step's plan fits the buffers (batch and page-table width)."""
        d = plan.decode
        if not plan.decode_only or tokens.shape[0] > self.size or tokens.shape[0] != d.batch:
            return False
        paged = d.cachestarts.dim() == 2
        return paged == (self.max_pages is not None) and (not paged or d.cachestarts.shape[1] <= self.max_pages)

    def load(self, tokens: torch.Tensor, plan: StepPlan) -> None:
        """Copies a decode step's tokens and plan into the buffers; the rows past its batch become padding."""
        if not self.fits(tokens, plan):
            raise ValueError(f"a decode step of {tokens.shape[0]} sequences does not fit static inputs of "
                             f"{self.size} (page table {self.max_pages})")
        B, d = tokens.shape[0], plan.decode
        self.staged = 0
        for buf, src, pad in ((self.tokens, tokens, 0), (self.slots, plan.slots, -1), (self.cos, plan.cos, 0),
                              (self.sin, plan.sin, 0), (self.kvlens, d.kvlens, 0)):
            buf[:B].copy_(src, non_blocking=True)
            buf[B:].fill_(pad)
        if self.max_pages is None:
            self.cachestarts[:B].copy_(d.cachestarts, non_blocking=True)
            self.cachestarts[B:].zero_()
        else:
            P = d.cachestarts.shape[1]
            self.cachestarts[:B, :P].copy_(d.cachestarts, non_blocking=True)
            self.cachestarts[:B, P:].zero_()
            self.cachestarts[B:].zero_()

    def stage(self, tokens: Sequence[int], start_pos: Sequence[int], caches: Sequence, cos_table: np.ndarray,
              sin_table: np.ndarray) -> bool:
        """Writes the decode step of len(start_pos) sequences (token ids, each one's position and cache: an offset,
        or its page starts) into the buffers: the ints with numpy on the host, then one copy of each buffer.
        False where it does not fit (too many sequences, a wider page table, a position past the rotary tables)."""
        B, S = len(start_pos), self.size
        if not 0 < B <= S or max(start_pos) >= cos_table.shape[0] or (
                self.max_pages is not None and max(map(len, caches)) > self.max_pages):
            return False
        if self._copied is not None:
            self._copied.synchronize()  # the previous stage's copies have left the host buffers
        ints, floats = self._host_ints.numpy(), self._host_floats.numpy()
        tok, slots, kvlens = ints[: 3 * S].reshape(3, S)
        start = np.asarray(start_pos, dtype=np.int64)
        tok[:B], tok[B:] = tokens, 0
        kvlens[:B], kvlens[B:] = start + 1, 0
        slots[B:] = -1                                                   # padding rows store no K/V
        cs = ints[3 * S:]
        cs[:] = 0
        if self.max_pages is None:
            cs[:B] = caches
            slots[:B] = cs[:B] + start
        else:
            cs = cs.reshape(S, self.max_pages)
            for b, pages in enumerate(caches):
                cs[b, : len(pages)] = pages
            slots[:B] = cs[np.arange(B), start // PAGE_SIZE] + start % PAGE_SIZE
        cos, sin = floats.reshape(2, S, self.half_dim)
        np.take(cos_table, start, axis=0, out=cos[:B])
        np.take(sin_table, start, axis=0, out=sin[:B])
        cos[B:], sin[B:] = 0.0, 0.0
        self._ints.copy_(self._host_ints, non_blocking=True)
        self._floats.copy_(self._host_floats, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.staged = B
        return True


@dataclass
class _Captured:
    graph: object                 # torch.cuda.CUDAGraph
    logits: torch.Tensor          # [bucket, vocab], written by each replay


def _cache_key(cache) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) if t is not None else None
                 for t in (cache.data, cache.scale))


class DecodeGraphs:
    """Captures `run(tokens, plan, cache) -> logits` for each batch bucket on first use and replays it.

    `run` must only read the plan's tensors that StaticDecodeInputs provides, sync nothing with the host and
    allocate only from torch's caching allocator (the engine's step on the Triton kernels does). A decode step
    comes either as a plan from ``make_plan`` (copied into the bucket's buffers) or staged straight from the
    step's ints (:meth:`stage`: the bucket's own plan, nothing to copy)."""

    def __init__(self, run: Callable, half_dim: int, max_pages: Optional[int], device: torch.device,
                 cos_table: torch.Tensor, sin_table: torch.Tensor):
        """`cos_table` / `sin_table`: the host rotary tables [positions, half_dim] (reference.Rotary's)."""
        self.run, self.half_dim, self.max_pages, self.device = run, half_dim, max_pages, device
        self._tables = (cos_table.numpy(), sin_table.numpy())
        self._inputs: dict[int, StaticDecodeInputs] = {}   # per bucket; they outlive caches
        self._graphs: dict[int, _Captured] = {}             # per bucket, for the cache of _key
        self._key: Optional[tuple] = None
        self._pool = None

    def _inputs_of(self, size: int) -> StaticDecodeInputs:
        inputs = self._inputs.get(size)
        if inputs is None:
            inputs = self._inputs[size] = StaticDecodeInputs(size, self.half_dim, self.max_pages, self.device)
        return inputs

    def stage(self, tokens: Sequence[int], start_pos: Sequence[int], caches: Sequence
              ) -> Optional[tuple[torch.Tensor, StepPlan]]:
        """(token ids, plan) of a decode step written into its bucket's buffers, for :meth:`__call__`; None where
        they do not take it (a position past the rotary tables, a wider page table). The plan holds until the
        bucket's next step is staged."""
        if not start_pos:
            return None
        inputs = self._inputs_of(bucket_of(len(start_pos)))
        if not inputs.stage(tokens, start_pos, caches, *self._tables):
            return None
        return inputs.tokens[: len(start_pos)], inputs.plan

    def __call__(self, tokens: torch.Tensor, plan: StepPlan, cache) -> Optional[torch.Tensor]:
        """The step's logits [B, vocab] from the bucket's graph, or None when the plan does not fit one (the
        caller runs the step eagerly)."""
        B = tokens.shape[0]
        size = bucket_of(B)
        key = _cache_key(cache)
        if key != self._key:  # the graphs read the cache they were captured with
            self._graphs.clear()
            self._pool = None   # a pool whose graphs are all gone is released: capturing into it again fails
            self._key = key
        inputs = self._inputs_of(size)
        if not (plan is inputs.plan and inputs.staged == B):   # a plan from make_plan: copied into the buffers
            if not inputs.fits(tokens, plan):
                return None
            inputs.load(tokens, plan)
        cap = self._graphs.get(size)
        if cap is None:
            cap = self._graphs[size] = self._capture(inputs, cache)
        cap.graph.replay()
        return cap.logits[:B].clone()

    @property
    def buckets(self) -> list[int]:
        """The buckets captured so far (for the current cache)."""
        return sorted(self._graphs)

    def _capture(self, inputs: StaticDecodeInputs, cache) -> _Captured:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up: compiles the Triton kernels, sets cuBLAS up (writes the same K/V)
            self.run(inputs.tokens, inputs.plan, cache)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # one memory pool for every bucket's graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.run(inputs.tokens, inputs.plan, cache)
        return _Captured(graph, logits)
