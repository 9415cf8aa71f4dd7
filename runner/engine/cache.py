"""The KV cache of one rank: ppl.pmx's tensor (and int8 scales) in one of four layouts, with the kernel
backend that reads and writes it (:class:`KVCache`), and its memory budget (:class:`CacheBudget`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from runner.kernels import reference as ref
from runner.kernels.cpu_ext import huge_page_zeros


@dataclass
class KVCache:
    data: torch.Tensor                 # ppl.pmx cache tensor, see reference.cache_shape
    scale: Optional[torch.Tensor]      # int8 cache: float16 scales per group of 8, same layout; else None
    layout: int
    ops: object                        # the kernel set (runner.kernels.sets.KernelSet)

    @property
    def rows(self) -> int:
        return self.data.shape[self.layout]  # layout k keeps its MaxT rows in dim k (reference.cache_shape)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Writes k, v [T, KV, D] into rows `slots` [T] of layer `layer`."""
        self.ops.kv_store(self.data, self.scale, self.layout, layer, k, v, slots)

    def gather(self, layer: int, slots: torch.Tensor, dtype: torch.dtype):
        """k, v [*slots.shape, KV, D] in `dtype` at rows `slots` of layer `layer`."""
        return self.ops.kv_load(self.data, self.scale, self.layout, layer, slots, dtype)


def new_cache(layout: int, layers: int, max_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device, quantized: bool):
    """Zeroed (kv_cache, kv_scale) for `max_tokens` rows (scale None unless int8); on CPU in transparent huge pages
    (a decode step reads a row of each position of each history: on 4 KiB pages, nearly every one a TLB miss), taken
    as they are first written."""
    def zeros(shape, dt):
        return huge_page_zeros(shape, dt) if device.type == "cpu" else torch.zeros(shape, dtype=dt, device=device)

    shape = ref.cache_shape(layout, layers, max_tokens, kv_heads, head_dim)
    if not quantized:
        return zeros(shape, dtype), None
    sshape = ref.cache_shape(layout, layers, max_tokens, kv_heads, head_dim // ref.QUANT_GROUP)
    return zeros(shape, torch.int8), zeros(sshape, torch.float16)


CPU_CACHE_MEMORY_FRACTION = 0.25  # default KV budget on CPU: at most this share of the available memory


class CacheBudget:
    """This rank's KV cache as memory: how many rows fit (:meth:`rows`, from the device's free memory, /proc/meminfo
    on CPU), the tensors that hold them (:meth:`reserve`) and their first write (:meth:`touch`). `model` is a
    runner.engine.model.Transformer, `make(kv_cache, kv_scale)` wraps its tensors as a KVCache (the Stepper's)."""

    def __init__(self, model, config, make):
        self.model, self.config, self.make, self.comm = model, config, make, model.comm
        self.cache: Optional[KVCache] = None

    def page_bytes(self) -> int:
        """Bytes of one page of cache on this rank (keys, values and int8 scales of every layer)."""
        m = self.model
        values = m.params.num_layers * 2 * m.kv_heads * m.head_dim * ref.PAGE_SIZE
        return values + values // ref.QUANT_GROUP * 2 if self.config.quantized_cache else values * m.dtype.itemsize

    def rows(self, wanted: int, alongside: Sequence["CacheBudget"] = ()) -> int:
        """Cache rows: --kv_cache_tokens, else `wanted` (whole pages in paged mode) within a share of the device's
        memory (the same on every rank: the smallest GPU's reading, or rank 0's of the host memory, shared by the
        ranks on each host), the caches `alongside` (a draft model's) of as many rows counted in."""
        c, dev = self.config, self.model.device
        if c.kv_cache_tokens is not None:
            return c.kv_cache_tokens
        page = ref.PAGE_SIZE if c.paged else 1
        if dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(dev)
            budget = total * c.gpu_memory_utilization - (total - free)
        else:
            per_host = -(-self.comm.world_size // max(self.comm.machines, 1))  # (the ranks of the fullest host)
            budget = available_memory() * CPU_CACHE_MEMORY_FRACTION / per_host
        page_bytes = self.page_bytes() + sum(b.page_bytes() for b in alongside)
        fit = int(budget // page_bytes * ref.PAGE_SIZE) // page * page
        rows = torch.tensor([max(page, min(-(-wanted // page) * page, fit))])
        if self.comm.world_size > 1:
            rows = self.comm.all_gather(rows.to(dev)).min() if dev.type == "cuda" else self.comm.broadcast_(rows)
        return int(rows)

    def reserve(self, rows: int) -> KVCache:
        """A cache of at least `rows` rows: the current one where it is large enough, else a new one (the old one
        freed first)."""
        if self.cache is None or self.cache.rows < rows:
            self.cache = None
            self.cache = self.make(*self.model.new_cache(rows))
        return self.cache

    def touch(self) -> None:
        """Writes every page of the cache once. A server's cache is a pool its requests walk through over minutes
        (prefix caching keeps freed pages while untouched ones remain); on CPU its memory is taken as it is first
        written, a page fault per page, which on a virtual machine whose host backs guest memory lazily costs up to
        milliseconds per MiB, inside the steps. Touched at start-up, no step pays for it."""
        for t in (self.cache.data, self.cache.scale) if self.cache is not None else ():
            if t is not None and t.device.type == "cpu":
                t.zero_()

    def nbytes(self) -> int:
        """Bytes of the cache's tensors (0 before reserve)."""
        c = self.cache
        return 0 if c is None else sum(t.numel() * t.element_size() for t in (c.data, c.scale) if t is not None)


def available_memory() -> int:
    """Bytes of host memory available (MemAvailable of /proc/meminfo, else the physical memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
