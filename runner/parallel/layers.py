"""Tensor-parallel layers (Megatron style). Each takes its communicator explicitly; with one rank
they do no communication at all. A weight is a float tensor or a weight-only quantised
runner.kernels.quant_linear.QuantWeight (cut the same way). :class:`SeqParallel` is Megatron's sequence
parallelism between the row-parallel layers, on the ranks' shared memory."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from runner.kernels.quant_linear import CPU_KERNEL_MAX_ROWS, QuantWeight, make_linear, packed_args, quant_embedding


class _OnLinear(nn.Module):
    """What a parallel layer's kernel can do, asked of its `linear` (runner.kernels.linear / quant_linear)."""

    def _can(self, what: str, x: torch.Tensor) -> bool:
        return getattr(self.linear, what, None) is not None and getattr(self.linear, what)(x)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether forward(x, norm=...) runs, or the kernel adds `residual` in its epilogue (SmallRows.fuses)."""
        return self._can("fuses", x)

    @property
    def dot_bf16(self) -> bool:
        """Whether its kernel takes bfloat16 dot products (and so a bfloat16 x: runner.kernels.linear.Linear)."""
        return getattr(self.linear, "dot_bf16", False)


class ColumnParallelLinear(_OnLinear):
    """y_r = x W_r^T + b_r with W cut by output rows; the output stays cut unless gather_output. `norm` and `rotary`:
    work the small-rows kernel does around the product (runner.kernels.linear.SmallRows)."""

    def __init__(self, weight, bias: Optional[torch.Tensor], comm, gather_output: bool = False,
                 prepack: bool = True):
        super().__init__()
        self.linear, self.comm, self.gather_output = make_linear(weight, bias, prepack), comm, gather_output

    def takes_rotary(self, x: torch.Tensor) -> bool:
        """Whether forward(x, rotary=...) runs (the qkv epilogue: runner.kernels.linear.Linear.takes_rotary)."""
        return self._can("takes_rotary", x)

    def takes_glu_out(self, x: torch.Tensor) -> bool:
        """Whether forward(x, glu_out=True) runs (runner.kernels.linear.Linear.takes_glu_out: this rank's gate | up
        columns, activated as they are stored)."""
        return not self.gather_output and self._can("takes_glu_out", x)

    def forward(self, x: torch.Tensor, norm: Optional[tuple] = None, rotary=None, glu_out: bool = False
                ) -> torch.Tensor:
        if glu_out:
            return self.linear(x, norm=norm, glu_out=True)
        y = self.linear(x) if norm is None and rotary is None else self.linear(x, norm=norm, rotary=rotary)
        return self.comm.all_gather(y, dim=-1) if self.gather_output else y


class RowParallelLinear(_OnLinear):
    """y = sum_r x_r W_r^T (+ b once): W cut by input columns, partial sums all-reduced."""

    def __init__(self, weight, bias: Optional[torch.Tensor], comm, prepack: bool = True):
        super().__init__()
        self.linear, self.comm = make_linear(weight, None, prepack), comm
        self.register_buffer("bias", bias, persistent=False)

    def takes_swiglu(self, x: torch.Tensor) -> bool:
        """Whether forward(x, swiglu=True) runs: x is a fused gate/up output its kernel activates as it loads."""
        return self._can("takes_swiglu", x)

    def forward(self, x: torch.Tensor, swiglu: bool = False, sp=None, residual: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """x W_r^T, all-reduced, plus the bias (and `residual`: by rank 0's kernel before the all-reduce where it
        fuses, else after); with `sp` (:class:`SeqParallel`: no bias) this rank's partial sum, which sp's next norm
        reduces (written straight into its shared area where the kernel can)."""
        if sp is not None and (self.bias is not None or residual is not None):
            raise ValueError("a row-parallel linear with a bias or a residual adds it after the all-reduce: no "
                             "sequence parallelism")
        if sp is not None and not swiglu:
            return sp.partial(self.linear, x)
        fused_res = residual if residual is not None and self.comm.rank == 0 and self.fuses(x) else None
        y = self.linear(x, swiglu=swiglu, residual=fused_res) if swiglu or fused_res is not None else self.linear(x)
        if sp is not None:
            return y
        y = self.comm.all_reduce_(y)
        y = y if self.bias is None else y + self.bias
        return y + residual if residual is not None and not self.fuses(x) else y


class ParallelEmbedding(nn.Module):
    """Embedding cut by hidden columns (as ppl.pmx): look up the local columns, all-gather, drop padding. A weight-only
    quantised embedding (a QuantWeight: int8 rows with a scale each or per group of columns, int4 rows with a scale
    (and an offset) per group of columns), or a float one narrower than `dtype` (a half-precision table of a float32
    engine on CPU), is widened to `dtype` as its rows are gathered, a quantised one by `quant_rows` (a kernel set's
    quant_embedding, signature of runner.kernels.quant_linear.quant_embedding, the spec used where it is None)."""

    def __init__(self, weight, hidden_dim: int, comm, dtype: torch.dtype = torch.float32, quant_rows=None):
        super().__init__()
        if isinstance(weight, QuantWeight):
            self.weight, self.quant_rows = weight, quant_rows or quant_embedding
        else:
            self.register_buffer("weight", weight, persistent=False)
        self.hidden_dim, self.comm, self.dtype = hidden_dim, comm, dtype

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's columns of rows `ids`."""
        w = self.weight
        if not isinstance(w, QuantWeight):
            return F.embedding(ids, w).to(self.dtype)  # (rows of a half-precision table widened to the compute dtype)
        return self.quant_rows(ids, w.qweight, w.scale, w.scheme.method, w.scheme.group_size, self.dtype, w.offset)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.comm.all_gather(self.lookup(ids), dim=-1)
        return x[..., : self.hidden_dim].contiguous() if x.shape[-1] != self.hidden_dim else x


class SeqParallel:
    """Sequence parallelism between the row-parallel linears, on the ranks' shared memory (comm.shm): each rank keeps
    the residual stream of its own rows only (shm.rows), and the all-reduce of a row-parallel linear's partial sums,
    the residual add and the next RMSNorm become one `reduce_norm`, whose output every rank's next linear reads in
    place. A rank moves a third of the bytes of all-reduce + norm and norms 1/N of the rows; the logits are the same
    bits. Used by the eager step on CPU float32 at TP > 1 (runner.engine.runners)."""

    def __init__(self, comm, skip_rms_norm):
        self.shm, self.comm, self.skip_rms_norm = comm.shm, comm, skip_rms_norm

    def partial(self, lin, x: torch.Tensor) -> torch.Tensor:
        """x W_r^T of a row-parallel layer's linear `lin`: this rank's partial sum, written straight into its shared
        area where the kernel takes an output buffer (else reduce_norm copies it there)."""
        args, m = packed_args(lin), x.shape[0]
        if args is None or x.dim() != 2 or not self.shm.fits(m, lin.out_features):
            return lin(x)
        out = self.shm.partial(m, lin.out_features)
        torch.ops.pmx_cpu.linear_into_(x.contiguous(), *args, lin.out_features, CPU_KERNEL_MAX_ROWS, out)
        return out

    def norm(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
        """(rms_norm(sum of x + residual) of every row, this rank's rows of that residual); residual None: x is
        the embedding, whole on every rank."""
        if residual is None:
            y, r = self.skip_rms_norm(x, None, weight, eps)
            return y, r[self.shm.rows(x.shape[0])].contiguous()
        with self.comm.guard("reduce_norm"):
            return self.shm.reduce_norm(x, residual, weight, eps), residual
