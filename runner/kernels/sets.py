"""Kernel sets: the ops a model step calls, with what each set can do declared (no probing of modules).

`runner.kernels.reference` is the specification; `torch_ops` the fast torch path (with this project's C++ kernels
on CPU float32); `triton_ops` the fused Triton kernels on CUDA. :func:`kernel_set` picks one for a device.

The ONNX exports are kernel sets too (runner.kernels.opmx_export: ppl.pmx's operators; runner.kernels.onnx_export:
standard ONNX operators): the export traces the engine's own model through one of them. A set also says how the
layers that hold weights are built (:class:`Layers`; None: the engine's), and it may lack an op: calling one it
lacks is an error naming the op (:func:`lacking`), never a silently different computation.
"""

from __future__ import annotations

import os
from dataclasses import KW_ONLY, dataclass
from typing import Callable, Optional

import torch

from runner.errors import PmxError
from runner.kernels import reference, torch_ops

KERNEL_KINDS = ("auto", "triton", "torch", "reference")


@dataclass(frozen=True)
class Layers:
    """How a kernel set builds the layers that hold weights, each given the PMX names of its tensors (`names`: the
    bases, e.g. ["layers.0.attention.wq", ...], several where the layer fuses them):

    - column(weight, bias, comm, gather_output=False, prepack=True, names=()) -> module(x)
    - row(weight, bias, comm, prepack=True, names=()) -> module(x, swiglu=False, sp=None)
    - embedding(weight, hidden_dim, comm, dtype, quant_rows, names=()) -> module(ids)
    - moe(router, w1, w3, w2, top_k, comm, fused_glu, prepack, ops, names=()) -> module(h): the mixture of experts,
      the experts' weights stacked ([E, F, D], [E, F, D], [E, D, F]; float or QuantWeight)

    A weight is a float tensor or a runner.kernels.quant_linear.QuantWeight, cut for this rank."""
    column: Callable
    row: Callable
    embedding: Callable
    moe: Callable


@dataclass(frozen=True)
class KernelSet:
    """The ops of one kernel set (reference.py's signatures), and the optional ones it has (None where not).

    `rotary_step` and `cache_attention` are the ops of a traced step (runner.engine.plan.StepInputs: ppl.pmx's step
    inputs as tensors, nothing planned on the host), which the export sets have:
    rotary_step(q, k, inputs, rotary) -> (q, k) rotated at each token's position (rotary: reference.Rotary);
    cache_attention(q, k, v, inputs, cache, spec) -> [T, H, D]: k, v written to the cache (a KVCache, which an
    export whose cache is an output rebinds), then each query attends over its history (spec:
    reference.AttentionSpec)."""
    name: str
    skip_rms_norm: Callable
    apply_rotary: Callable
    swiglu: Callable
    kv_store: Callable
    kv_load: Callable
    attend: Callable
    _: KW_ONLY                                         # (the optional ops by name only: no op lands in another's field)
    rms_norm: Callable = reference.rms_norm            # (x, weight, eps): q/k norms, post norms
    swiglu_packed: Optional[Callable] = None           # (gate_up) -> swiglu of its halves (None: swiglu on chunks)
    geglu: Optional[Callable] = None                   # (gate, up) -> gelu_tanh(gate) * up (None: the set lacks it)
    geglu_packed: Optional[Callable] = None            # (gate_up) -> geglu of its halves (None: geglu on chunks)
    rotary_step: Optional[Callable] = None
    cache_attention: Optional[Callable] = None
    layers: Optional[Layers] = None                    # None: the engine's (runner.engine.model)
    rotary_kv_store: Optional[Callable] = None         # rotates q, k in place and stores k, v: one kernel
    decode_attention: Optional[Callable] = None        # walks the cache from cachestarts / kvlens (graph-safe)
    prefill_attention: Optional[Callable] = None       # flash attention of prefill groups over the cache
    decode_attention_rows: Optional[Callable] = None   # reads each history's rows in place (CPU)
    decode_linear: Optional[Callable] = None           # batch-1 decode GEMV (runner.kernels.linear.SmallRows)
    decode_linear_rows: int = 0
    interpreted: bool = False                          # Triton kernels run by its interpreter (CPU tests)
    quant_embedding: Optional[Callable] = None         # a quantised embedding's rows, dequantised as gathered

    def __post_init__(self):
        if self.geglu is None:
            object.__setattr__(self, "geglu", lacking(self.name, "geglu"))
        for op in ("swiglu", "geglu"):
            if getattr(self, f"{op}_packed") is None:
                object.__setattr__(self, f"{op}_packed", _on_halves(getattr(self, op)))
        for op in ("rotary_step", "cache_attention"):
            if getattr(self, op) is None:
                object.__setattr__(self, op, lacking(self.name, op, "the engine plans its steps on the host"))

    @property
    def reads_history_in_place(self) -> bool:
        """Decode attention needs no gathered rows: cachestarts and kvlens are all it reads."""
        return self.decode_attention is not None or self.decode_attention_rows is not None


def _on_halves(glu: Callable) -> Callable:
    def packed(gate_up: torch.Tensor) -> torch.Tensor:
        """The gated activation of gate_up [.., 2F] = gate | up (a fused gate/up GEMM's output)."""
        return glu(*gate_up.chunk(2, dim=-1))
    return packed


def lacking(set_name: str, op: str, why: str = "") -> Callable:
    """An op kernel set `set_name` does not have: calling it raises an error that names it."""
    def missing(*args, **kwargs):
        raise PmxError(f"kernel set {set_name!r} has no {op!r} op{f' ({why})' if why else ''}: the model called it; "
                       f"give the set its form of the op (runner/kernels)")
    missing.__name__ = f"lacking_{op}"
    return missing


def _spec(name: str, m, **extra) -> KernelSet:
    return KernelSet(name, m.skip_rms_norm, m.apply_rotary, m.swiglu, m.kv_store, m.kv_load, m.attend, **extra)


def kernel_set(kind: str, device: torch.device, dtype: torch.dtype) -> KernelSet:
    """The kernel set for `kind` (auto: Triton on CUDA, fast torch elsewhere) on `device` in `dtype`."""
    if kind not in KERNEL_KINDS:
        raise PmxError(f"--kernels must be one of {', '.join(KERNEL_KINDS)}, got {kind!r}")
    if kind == "reference":
        return _spec("reference", reference, geglu=reference.geglu)
    if kind == "torch" or (kind == "auto" and device.type != "cuda"):
        rows = torch_ops.decode_attention_rows if torch_ops.cpu_kernels_for(device, dtype) else None
        return _spec("torch", torch_ops, rms_norm=torch_ops.rms_norm, geglu=torch_ops.geglu,
                     decode_attention_rows=rows)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise PmxError("--kernels triton runs on CUDA devices (or on CPU under TRITON_INTERPRET=1, slowly)")
    try:
        from runner.kernels import triton_ops, triton_quant
    except ImportError as e:
        raise PmxError(f"--kernels {kind} on {device.type} needs Triton ({e}); install it (pip install triton) or "
                       f"run with --kernels torch / reference") from None
    t = triton_ops
    return KernelSet("triton", t.skip_rms_norm, t.apply_rotary, t.swiglu, t.kv_store, torch_ops.kv_load,
                     torch_ops.attend, geglu=t.geglu, rotary_kv_store=t.rotary_kv_store,
                     decode_attention=t.decode_attention, prefill_attention=t.prefill_attention,
                     decode_linear=t.decode_linear, decode_linear_rows=t.DECODE_LINEAR_ROWS,
                     interpreted=device.type != "cuda",
                     quant_embedding=triton_quant.quant_embedding)
