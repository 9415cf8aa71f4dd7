"""Tensor-parallel layers (Megatron style). Each takes its communicator explicitly; with one rank
they do no communication at all. A weight is a float tensor or a weight-only quantised
runner.kernels.quant_linear.QuantWeight (cut the same way)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from runner.kernels.quant_linear import make_linear


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r with W cut by output rows; the output stays cut unless gather_output."""

    def __init__(self, weight, bias: Optional[torch.Tensor], comm, gather_output: bool = False,
                 prepack: bool = True):
        super().__init__()
        self.linear, self.comm, self.gather_output = make_linear(weight, bias, prepack), comm, gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return self.comm.all_gather(y, dim=-1) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T (+ b once): W cut by input columns, partial sums all-reduced."""

    def __init__(self, weight, bias: Optional[torch.Tensor], comm, prepack: bool = True):
        super().__init__()
        self.linear, self.comm = make_linear(weight, None, prepack), comm
        self.register_buffer("bias", bias, persistent=False)

    def takes_swiglu(self, x: torch.Tensor) -> bool:
        """Whether forward(x, swiglu=True) runs: x is a fused gate/up output its kernel activates as it loads."""
        return getattr(self.linear, "takes_swiglu", None) is not None and self.linear.takes_swiglu(x)

    def forward(self, x: torch.Tensor, swiglu: bool = False, sp=None) -> torch.Tensor:
        """x W_r^T, all-reduced, plus the bias; with `sp` (runner.engine.model.SeqParallel: no bias) this rank's
        partial sum, which sp's next norm reduces (written straight into its shared area where the kernel can)."""
        if sp is not None and self.bias is not None:
            raise ValueError("a row-parallel linear with a bias adds it after the all-reduce: no sequence parallelism")
        if sp is not None and not swiglu:
            return sp.partial(self.linear, x)
        y = self.linear(x, swiglu=True) if swiglu else self.linear(x)
        if sp is not None:
            return y
        y = self.comm.all_reduce_(y)
        return y if self.bias is None else y + self.bias


class ParallelEmbedding(nn.Module):
    """Embedding cut by hidden columns (as ppl.pmx): look up the local columns, all-gather, drop padding."""

    def __init__(self, weight: torch.Tensor, hidden_dim: int, comm):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.hidden_dim, self.comm = hidden_dim, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.comm.all_gather(F.embedding(ids, self.weight), dim=-1)
        return x[..., : self.hidden_dim].contiguous() if x.shape[-1] != self.hidden_dim else x
