"""The KV cache of one rank: ppl.pmx's tensor (and int8 scales) in one of four layouts, with the kernel
backend that reads and writes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
