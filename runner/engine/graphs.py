"""CUDA graphs of the decode step: one captured graph per batch-size bucket, replayed over persistent inputs.

A step where every sequence decodes one token has fixed structure, and on CUDA with the Triton kernels it reads
only the plan's per-sequence tensors (tokens, cache slots, rotary angles, cache starts, lengths): the decode
attention kernel walks the cache itself and takes its split count from the batch size, never from the history
lengths. So the step is captured once per bucket of batch sizes (1, 2, 4, 8, ...: the next power of two at or
above the batch) over the bucket's persistent inputs (runner.engine.plan.DecodeInputs, which writes each decode
step there, padded), and every later decode step of that bucket replays it: one launch instead of a few hundred,
with the all-reduces (NCCL) inside the graph. Padding rows decode token 0 at cache slot -1 (nothing stored) with
a history of length 0, and their logits are dropped. A graph holds the addresses of the KV cache it was captured
with, so the graphs are kept for one cache at a time (another cache tensor recaptures).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from runner.engine.plan import DecodeInputs


def bucket_of(batch: int) -> int:
    """The batch-size bucket of a decode step: the next power of two at or above `batch`."""
    if batch < 1:
        raise ValueError(f"a decode step has at least one sequence, got {batch}")
    return 1 << (batch - 1).bit_length()


@dataclass
class _Captured:
    graph: object                 # torch.cuda.CUDAGraph
    logits: torch.Tensor          # [bucket, vocab], written by each replay


def _cache_key(cache) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) if t is not None else None
                 for t in (cache.data, cache.scale))


class CudaGraphs:
    """Step runner: captures `model(tokens, plan, cache)` for each bucket on first use and replays it. It takes the
    decode steps `inputs` wrote (their plans are the buckets' static inputs). The model's step must sync nothing
    with the host and allocate only from torch's caching allocator (the step on the Triton kernels does)."""
    name = "CUDA graphs"

    def __init__(self, model, inputs: DecodeInputs):
        self.run, self.inputs, self.device = model, inputs, model.device
        self._graphs: dict[int, _Captured] = {}             # per bucket, for the cache of _key
        self._key: Optional[tuple] = None
        self._pool = None

    def accepts(self, plan, cache) -> bool:
        return self.inputs.owner(plan) is not None

    def __call__(self, tokens: torch.Tensor, plan, cache) -> torch.Tensor:
        buf = self.inputs.owner(plan)
        key = _cache_key(cache)
        if key != self._key:  # the graphs read the cache they were captured with
            self._graphs.clear()
            self._pool = None   # a pool whose graphs are all gone is released: capturing into it again fails
            self._key = key
        cap = self._graphs.get(buf.size)
        if cap is None:
            cap = self._graphs[buf.size] = self._capture(buf, cache)
        cap.graph.replay()
        return cap.logits[: tokens.shape[0]].clone()

    @property
    def buckets(self) -> list[int]:
        """The buckets captured so far (for the current cache)."""
        return sorted(self._graphs)

    def _capture(self, buf, cache) -> _Captured:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up: compiles the Triton kernels, sets cuBLAS up (writes the same K/V)
            self.run(buf.tokens, buf.plan, cache)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # one memory pool for every bucket's graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.run(buf.tokens, buf.plan, cache)
        return _Captured(graph, logits)
