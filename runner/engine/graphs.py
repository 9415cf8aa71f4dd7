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
from typing import Callable, Optional

import torch

from runner.engine.plan import DecodeAttention, StepPlan


def bucket_of(batch: int) -> int:
    """The batch-size bucket of a decode step: the next power of two at or above `batch`."""
    if batch < 1:
        raise ValueError(f"a decode step has at least one sequence, got {batch}")
    return 1 << (batch - 1).bit_length()


class StaticDecodeInputs:
    """The persistent inputs of a decode step padded to `size` sequences, and the plan that reads them.

    `max_pages`: page-table width of a paged cache (None: offset cache, one start per sequence)."""

    def __init__(self, size: int, half_dim: int, max_pages: Optional[int], device: torch.device):
        z = dict(dtype=torch.int64, device=device)
        self.size, self.max_pages = size, max_pages
        self.tokens = torch.zeros(size, **z)
        self.slots = torch.full((size,), -1, **z)
        self.cos = torch.zeros(size, half_dim, dtype=torch.float32, device=device)
        self.sin = torch.zeros(size, half_dim, dtype=torch.float32, device=device)
        self.cachestarts = torch.zeros((size, max_pages) if max_pages is not None else (size,), **z)
        self.kvlens = torch.zeros(size, **z)
        self.plan = StepPlan(self.slots, self.cos, self.sin, None,
                             DecodeAttention(None, None, self.cachestarts, self.kvlens))

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


@dataclass
class _Captured:
    graph: object                 # torch.cuda.CUDAGraph
    inputs: StaticDecodeInputs
    logits: torch.Tensor          # [bucket, vocab], written by each replay


def _cache_key(cache) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) if t is not None else None
                 for t in (cache.data, cache.scale))


class DecodeGraphs:
    """Captures `run(tokens, plan, cache) -> logits` for each batch bucket on first use and replays it.

    `run` must only read the plan's tensors that StaticDecodeInputs provides, sync nothing with the host and
    allocate only from torch's caching allocator (the engine's step on the Triton kernels does)."""

    def __init__(self, run: Callable, half_dim: int, max_pages: Optional[int], device: torch.device):
        self.run, self.half_dim, self.max_pages, self.device = run, half_dim, max_pages, device
        self._graphs: dict[int, _Captured] = {}
        self._key: Optional[tuple] = None
        self._pool = None

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
        cap = self._graphs.get(size)
        if cap is None:
            inputs = StaticDecodeInputs(size, self.half_dim, self.max_pages, self.device)
            if not inputs.fits(tokens, plan):
                return None
            cap = self._graphs[size] = self._capture(inputs, tokens, plan, cache)
        elif not cap.inputs.fits(tokens, plan):
            return None
        cap.inputs.load(tokens, plan)
        cap.graph.replay()
        return cap.logits[:B].clone()

    @property
    def buckets(self) -> list[int]:
        """The buckets captured so far (for the current cache)."""
        return sorted(self._graphs)

    def _capture(self, inputs: StaticDecodeInputs, tokens, plan, cache) -> _Captured:
        inputs.load(tokens, plan)
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
        return _Captured(graph, inputs, logits)
