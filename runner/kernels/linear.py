"""Dense layer y = x W^T + b with the fastest weight format the device has.

On CPU, with float32 activations, the weight is repacked once, at load, for one of two kernels (`Linear.kernel`):

- `pmx` (the default): this project's GEMM (runner/kernels/cpu_gemm.cpp, `pmx_cpu::linear_f32`) on blocks of 64
  output channels, k-major, in the weight's own width: float32, or bfloat16 / float16 widened to float32 in registers
  (a half-precision checkpoint decodes reading half the bytes), accumulated in float32. It streams the weight in one
  pass at decode sizes and runs register tiles of 6 rows for prefill (benchmarks/RESULTS.md).
- `onednn`: a float32 weight reordered into oneDNN's blocked layout and applied with oneDNN's matmul, where the
  extension cannot be built (no compiler).

Weights under PREPACK_MIN_NUMEL elements stay plain `F.linear` (MKL), as do GPU, a torch without either kernel and
`prepack=False`; a plain weight narrower than its input is widened to the input's dtype on each call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from runner.kernels import torch_ops
from runner.kernels.cpu_ext import bf16_k_pairs, cpu_ops, pack_blocks, unpack_blocks

PREPACK_MIN_NUMEL = 1 << 14  # below this (128 x 128) plain F.linear is as fast


@torch.library.custom_op("pmx::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """x [M, in] @ W^T (+ b) with W prepacked by oneDNN; an op of its own so torch.compile calls it as it is
    (inductor would only take oneDNN weights it packed itself, a second copy of the model)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, packed, bias, out_features):
    return x.new_empty(x.shape[0], out_features)


def _onednn_usable() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the weights `pmx` takes (cpu_gemm.cpp)


def pick_kernel(weight: torch.Tensor, prepack: bool = True, min_numel: Optional[int] = None) -> str:
    """pmx | onednn | plain for a float weight [out, in] (plain under `min_numel` elements, default
    PREPACK_MIN_NUMEL). `pmx` takes float32 and half-precision weights (for float32 inputs), `onednn` float32."""
    min_numel = PREPACK_MIN_NUMEL if min_numel is None else min_numel
    if not (prepack and weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and weight.dim() == 2
            and weight.numel() >= min_numel):
        return "plain"
    if cpu_ops() is not None:
        return "pmx"
    return "onednn" if _onednn_usable() and weight.dtype == torch.float32 else "plain"


@dataclass(frozen=True)
class RotaryStore:
    """The qkv linear's epilogue (a small-rows kernel's `rotary`: runner.kernels.triton_ops.decode_linear; this
    project's CPU kernel at any rows, linear_f32_qkv): rotate q and k of each row at cos / sin [rows, R/2] (the first R
    dims of each head), write the rotated k and v into cache rows `slots` of layer `layer` (int8 in groups of
    reference.QUANT_GROUP with `scale`, as reference.kv_store), as rotary_kv_store does after the linear."""
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    cache: torch.Tensor
    scale: Optional[torch.Tensor]
    layout: int
    layer: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class QuantRows:
    """A weight-only quantised weight as a small-rows kernel streams it (runner.pmx.quant's stored layout): int8
    [N, K] with `scale` [N] (group_size 0: per output channel) or [N, K/G], or int4 bytes [N, K/2] with `scale` (and
    `offset`, where the scheme has offsets) [N, K/G]."""
    scale: torch.Tensor
    offset: Optional[torch.Tensor]
    method: str
    group_size: int


class SmallRows:
    """A linear layer whose inputs of 1..max_rows rows may go to a small-rows kernel (runner.kernels.triton_ops.
    decode_linear on CUDA), which also fuses work around the product: `swiglu` (x is a fused gate/up output, activated
    as it loads), `norm` ((weight, eps): x is the residual stream, normalised as it loads), `residual` (added to the
    output) and `rotary` (the qkv linear's rotary + cache-store epilogue): the layer calls
    kernel(x, weight, bias, swiglu=, norm=, residual=, rotary=, **self._small_rows_weight())."""

    in_features: int
    _small_rows: Optional[tuple[Callable, int]] = None

    def use_small_rows(self, kernel: Callable, max_rows: int) -> None:
        self._small_rows = (kernel, max_rows)

    def small_rows(self, x: torch.Tensor) -> bool:
        """Whether x goes to the small-rows kernel (which takes swiglu, norm, residual and rotary)."""
        return self._small_rows is not None and x.dim() == 2 and 0 < x.shape[0] <= self._small_rows[1]

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether forward(x, norm=, residual=) runs (and swiglu, rotary): x goes to the small-rows kernel."""
        return self.small_rows(x)

    def takes_swiglu(self, x: torch.Tensor) -> bool:
        """Whether forward(x, swiglu=True) runs: x [rows, 2 in] (gate | up) within the small-rows kernel's rows."""
        return self.small_rows(x) and x.shape[1] == 2 * self.in_features

    def takes_rotary(self, x: torch.Tensor) -> bool:
        """Whether forward(x, rotary=...) runs (the qkv linear's rotary + cache-store epilogue): the small-rows
        kernel's rows."""
        return self.small_rows(x)

    def _small_rows_weight(self) -> dict:
        """What the kernel takes besides the weight tensor (a quantised weight's scales)."""
        return {}

    def _small(self, x: torch.Tensor, weight: torch.Tensor, swiglu: bool, norm, residual, rotary):
        """The small-rows kernel's product, or a ValueError when x does not go there and fused work was asked for."""
        if self.small_rows(x):
            return self._small_rows[0](x, weight, self.bias, swiglu=swiglu, norm=norm, residual=residual,
                                       rotary=rotary, **self._small_rows_weight())
        if swiglu or norm is not None or residual is not None or rotary is not None:
            raise ValueError(f"swiglu / norm / residual / rotary need a small-rows kernel and "
                             f"[rows, {2 * self.in_features if swiglu else self.in_features}] input; got "
                             f"{tuple(x.shape)}")
        return None


class Linear(SmallRows, torch.nn.Module):
    """y = x W^T + b for W [out, in] on `kernel` (pmx | onednn | plain; default: :func:`pick_kernel`'s). The packed
    kernels take float32 inputs and give float32 outputs whatever the weight's width; a plain weight of half
    precision may take a small-rows kernel (:class:`SmallRows`)."""

    KERNELS = ("pmx", "onednn", "plain")

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, prepack: bool = True,
                 kernel: Optional[str] = None, min_numel: Optional[int] = None):
        super().__init__()
        if kernel not in (None, *self.KERNELS):
            raise ValueError(f"kernel must be one of {self.KERNELS}, got {kernel!r}")
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel or pick_kernel(weight, prepack, min_numel)
        self.register_buffer("bias", bias, persistent=False)
        packed = None
        if self.kernel in ("pmx", "onednn") and weight.dtype not in (PACKED_DTYPES if self.kernel == "pmx"
                                                                     else (torch.float32,)):
            raise ValueError(f"kernel {self.kernel!r} does not take {weight.dtype} weights")
        if self.kernel == "onednn":
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
            except RuntimeError:  # an unusual oneDNN build: keep the plain path
                self.kernel = "plain"
        elif self.kernel == "pmx":
            if cpu_ops() is None:
                raise RuntimeError("kernel 'pmx' needs this project's CPU extension, which could not be built here")
            packed = pack_blocks(weight)
        self.register_buffer("packed", packed, persistent=False)
        # this project's kernel on bfloat16 blocks with AVX512-BF16: bfloat16 dot products, on x rounded to bfloat16
        self.dot_bf16 = self.kernel == "pmx" and packed.dtype == torch.bfloat16 and bf16_k_pairs()
        self.register_buffer("weight", weight if self.kernel == "plain" else None, persistent=False)

    def use_small_rows(self, kernel: Callable, max_rows: int) -> None:
        if self.kernel != "plain":
            raise ValueError(f"a {self.kernel} layer has no plain weight for a small-rows kernel")
        super().use_small_rows(kernel, max_rows)

    def _pmx_takes(self, x: torch.Tensor, width: int) -> bool:
        """Whether this project's kernel takes x eagerly as float32 [rows, width]."""
        return (self.kernel == "pmx" and x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] == width
                and not torch.compiler.is_compiling())

    def takes_swiglu(self, x: torch.Tensor) -> bool:
        """Whether forward(x, swiglu=True) runs: the small-rows kernel's rows, or any rows on this project's kernel
        (linear_f32_fused: on bfloat16 weights with AVX512-BF16 the activation is computed as x is converted)."""
        return super().takes_swiglu(x) or self._pmx_takes(x, 2 * self.in_features)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether forward(x, norm=, residual=, swiglu=) runs with that work inside the product: the small-rows
        kernel's rows, or any rows where `dot_bf16`, the norm computed as x is converted for the dot products and the
        residual added as the output is stored (x float32, or bfloat16 as `takes_glu_out` leaves it; on other weights
        linear_f32_fused takes them too, as passes of their own around the product, so they are not asked for)."""
        return super().fuses(x) or (self.dot_bf16 and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16)
                                    and not torch.compiler.is_compiling())

    def takes_rotary(self, x: torch.Tensor) -> bool:
        """Whether forward(x, rotary=...) runs with rotary and the cache store as the product's epilogue: the
        small-rows kernel's rows, or any rows of this project's kernel (no bias: it goes before the rotation)."""
        return super().takes_rotary(x) or (self.bias is None and self._pmx_takes(x, self.in_features))

    def takes_glu_out(self, x: torch.Tensor) -> bool:
        """Whether forward(x, glu_out=True) runs: this is a fused gate | up layer (out = 2 F, F a multiple of 64, no
        bias) on this project's kernel, which returns silu(gate) * up [rows, F] without the [rows, 2 F] output going
        through memory: in bfloat16 where `dot_bf16` (the down projection's x as its dot products round it; for a
        down projection that is `dot_bf16` too), else float32."""
        return self.bias is None and self.out_features % 128 == 0 and self._pmx_takes(x, self.in_features)

    def _qkv_rotary(self, x: torch.Tensor, norm: Optional[tuple], r: RotaryStore) -> torch.Tensor:
        """forward(x, norm=, rotary=r) on this project's kernel: linear_f32_qkv (a float32 or int8 cache; another
        cache's dtype: the product, then torch_ops' rotary and store)."""
        if self.bias is not None:
            raise ValueError("a qkv layer with a bias adds it before the rotation: no rotary epilogue")
        if r.cache.dtype not in (torch.float32, torch.int8):
            y = self(x) if norm is None else self(x, norm=norm)
            H, KV = r.heads, r.kv_heads
            qkv = y.view(-1, H + 2 * KV, r.head_dim)
            qkv[:, : H + KV] = torch_ops.apply_rotary(qkv[:, : H + KV], r.cos, r.sin)
            torch_ops.kv_store(r.cache, r.scale, r.layout, r.layer, qkv[:, H: H + KV], qkv[:, H + KV:], r.slots)
            return y
        return torch.ops.pmx_cpu.linear_f32_qkv(
            x.contiguous(), self.packed, self.out_features, None if norm is None else norm[0].float().contiguous(),
            0.0 if norm is None else float(norm[1]), r.cos.float().contiguous(), r.sin.float().contiguous(), r.cache,
            r.scale, r.layout, r.layer, r.slots.contiguous())

    def dense_weight(self) -> torch.Tensor:
        """W [out, in] as a plain tensor (a copy for the packed kernels)."""
        if self.kernel == "pmx":
            return unpack_blocks(self.packed, self.out_features)
        if self.kernel == "onednn":
            return self.packed.to_dense() if self.packed.is_mkldnn else self.packed
        return self.weight

    def forward(self, x: torch.Tensor, swiglu: bool = False, norm: Optional[tuple] = None,
                residual: Optional[torch.Tensor] = None, rotary=None, glu_out: bool = False) -> torch.Tensor:
        if self.kernel == "pmx" and rotary is not None:
            return self._qkv_rotary(x, norm, rotary)
        if self.kernel == "pmx" and (swiglu or norm is not None or residual is not None or glu_out
                                     or x.dtype == torch.bfloat16):
            # (swiglu: x is gate | up, takes_swiglu; norm: x is the residual stream; glu_out: takes_glu_out)
            res = None if residual is None else residual.reshape(-1, self.out_features)
            y = torch.ops.pmx_cpu.linear_f32_fused(
                x.reshape(-1, x.shape[-1]).contiguous(), self.packed, self.out_features, swiglu,
                None if norm is None else norm[0].float().contiguous(), 0.0 if norm is None else float(norm[1]),
                None if res is None else res.float().contiguous(), glu_out)
            y = y if self.bias is None else y + self.bias
            return y.view(*x.shape[:-1], y.shape[-1])
        y = self._small(x, self.weight, swiglu, norm, residual, rotary)
        if y is not None:
            return y
        if self.kernel == "plain":
            w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)  # (a small half weight)
            return F.linear(x, w, self.bias)
        if x.dtype != torch.float32:
            raise TypeError(f"this layer's {self.kernel} kernel takes float32 inputs; got {x.dtype}")
        x2 = x.reshape(-1, self.in_features).contiguous()
        if self.kernel == "pmx":
            y = torch.ops.pmx_cpu.linear_f32(x2, self.packed, self.out_features)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = onednn_linear(x2, self.packed, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)
