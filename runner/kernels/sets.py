"""Kernel sets: the ops a model step calls, with what each set can do declared (no probing of modules).

`runner.kernels.reference` is the specification; `torch_ops` the fast torch path (with this project's C++ kernels
on CPU float32); `triton_ops` the fused Triton kernels on CUDA. :func:`kernel_set` picks one for a device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from runner.errors import PmxError
from runner.kernels import reference, torch_ops

KERNEL_KINDS = ("auto", "triton", "torch", "reference")


@dataclass(frozen=True)
class KernelSet:
    """The ops of one kernel set (reference.py's signatures), and the optional ones it has (None where not)."""
    name: str
    skip_rms_norm: Callable
    apply_rotary: Callable
    swiglu: Callable
    kv_store: Callable
    kv_load: Callable
    attend: Callable
    rotary_kv_store: Optional[Callable] = None         # rotates q, k in place and stores k, v: one kernel
    decode_attention: Optional[Callable] = None        # walks the cache from cachestarts / kvlens (graph-safe)
    prefill_attention: Optional[Callable] = None       # flash attention of prefill groups over the cache
    decode_attention_rows: Optional[Callable] = None   # reads each history's rows in place (CPU)
    decode_linear: Optional[Callable] = None           # batch-1 decode GEMV on a plain half-precision weight
    decode_linear_rows: int = 0
    quant_embedding: Optional[Callable] = None         # a quantised embedding's rows, dequantised as gathered

    @property
    def reads_history_in_place(self) -> bool:
        """Decode attention needs no gathered rows: cachestarts and kvlens are all it reads."""
        return self.decode_attention is not None or self.decode_attention_rows is not None


def _spec(name: str, m, **extra) -> KernelSet:
    return KernelSet(name, m.skip_rms_norm, m.apply_rotary, m.swiglu, m.kv_store, m.kv_load, m.attend, **extra)


def kernel_set(kind: str, device: torch.device, dtype: torch.dtype) -> KernelSet:
    """The kernel set for `kind` (auto: Triton on CUDA, fast torch elsewhere) on `device` in `dtype`."""
    if kind not in KERNEL_KINDS:
        raise PmxError(f"--kernels must be one of {', '.join(KERNEL_KINDS)}, got {kind!r}")
    if kind == "reference":
        return _spec("reference", reference)
    if kind == "torch" or (kind == "auto" and device.type != "cuda"):
        rows = torch_ops.decode_attention_rows if torch_ops.cpu_kernels_for(device, dtype) else None
        return _spec("torch", torch_ops, decode_attention_rows=rows)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise PmxError("--kernels triton runs on CUDA devices (or on CPU under TRITON_INTERPRET=1, slowly)")
    try:
        from runner.kernels import triton_ops, triton_quant
    except ImportError as e:
        raise PmxError(f"--kernels {kind} on {device.type} needs Triton ({e}); install it (pip install triton) or "
                       f"run with --kernels torch / reference") from None
    t = triton_ops
    return KernelSet("triton", t.skip_rms_norm, t.apply_rotary, t.swiglu, t.kv_store, torch_ops.kv_load,
                     torch_ops.attend, t.rotary_kv_store, t.decode_attention, t.prefill_attention,
                     decode_linear=t.decode_linear, decode_linear_rows=t.DECODE_LINEAR_ROWS,
                     quant_embedding=triton_quant.quant_embedding)
