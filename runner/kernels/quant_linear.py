"""Weight-only quantised linear layers: y = x dequant(W)^T + b, with the fastest kernel each device has.

The spec is :func:`reference_linear`: dequantise W (runner.pmx.quant.dequantize) then `F.linear`.
Kernels, tested against it (tests/test_quant_kernels.py):

- CPU: int8 through `torch.ops.aten._weight_int8pack_mm` (int8 [N, K] and float scales [N]); int4
  through `torch.ops.aten._weight_int4pack_mm_for_cpu` on the weight repacked once at load by
  `_convert_weight_to_int4pack_for_cpu` with scales and (zero) offsets [K/group, N, 2]: the kernels
  gpt-fast uses. Both are ops of their own under torch.compile. Measured against the alternatives in
  benchmarks/RESULTS.md ("Weight-only kernels").
- CUDA: Triton W8A16 / W4A16 (runner/kernels/triton_quant.py), dequantising in registers.
- `--kernels reference` (or a shape a kernel does not take): the spec, dequantising on every call.

The stored format (runner.pmx.quant) is device-neutral; each kernel's own layout is made at load.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from runner.kernels.linear import Linear
from runner.pmx.quant import QuantScheme, dequantize, unpack_int4


@dataclass
class QuantWeight:
    """A quantised weight as stored (qweight, scale) with its scheme and the kernel set that should run it.
    Concatenates along output rows (fused qkv / gate-up) and indexes the leading expert dim like a tensor."""
    qweight: torch.Tensor
    scale: torch.Tensor
    scheme: QuantScheme
    kernels: str = "auto"

    @property
    def shape(self) -> tuple:
        """The float weight's shape [.., N, K]."""
        k = self.qweight.shape[-1] * (2 if self.scheme.method == "int4" else 1)
        return (*self.qweight.shape[:-1], k)

    def __getitem__(self, i) -> "QuantWeight":
        return QuantWeight(self.qweight[i], self.scale[i], self.scheme, self.kernels)

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight":
        p = parts[0]
        return QuantWeight(torch.cat([x.qweight for x in parts]), torch.cat([x.scale for x in parts]), p.scheme,
                           p.kernels)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.qweight, self.scale, self.scheme.method, dtype)


def reference_linear(x: torch.Tensor, w: QuantWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The spec: dequantise, then an ordinary float linear."""
    return F.linear(x, w.dequantize(x.dtype), bias)


# -- CPU --------------------------------------------------------------------------------------------

CPU_BLOCK = 64  # output channels per block of the packed CPU weights (runner/kernels/cpu_quant.cpp)


@functools.lru_cache(maxsize=None)
def cpu_ops():
    """torch.ops.pmx_cpu_quant (runner/kernels/cpu_quant.cpp), built on first use with this machine's
    compiler and vector instructions (-march=native) and cached by torch under ~/.cache/torch_extensions;
    None where it cannot be built (then the aten kernels run)."""
    from torch.utils.cpp_extension import load
    try:
        load(name="pmx_cpu_quant", sources=[str(Path(__file__).with_name("cpu_quant.cpp"))],
             extra_cflags=["-O3", "-march=native"], is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler / ninja: the slower aten kernels still work
        print(f"warning: the CPU int8/int4 kernels could not be built ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}); using torch's aten kernels", file=sys.stderr)
        return None
    return torch.ops.pmx_cpu_quant


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def pack_int8_blocks(qweight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [N/64, K, 64]: blocks of 64 channels, k-major inside a block (rows padded with 0)."""
    n, k = qweight.shape
    nb = -(-n // CPU_BLOCK)
    return _pad_rows(qweight, nb * CPU_BLOCK).view(nb, CPU_BLOCK, k).transpose(1, 2).contiguous()


def pack_int4_blocks(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored int4 ([N, K/2] bytes, scales [N, K/G]) -> ([N/64, K, 32] bytes: channel j of a block in the low
    nibble of byte j, channel j + 32 in the high one; scales [K/G, N/64*64])."""
    n = qweight.shape[0]
    nb = -(-n // CPU_BLOCK)
    nib = _pad_rows(unpack_int4(qweight), nb * CPU_BLOCK)                             # (Np, K)
    blocks = nib.view(nb, CPU_BLOCK, -1).transpose(1, 2)                             # (nb, K, 64)
    half = CPU_BLOCK // 2
    packed = (blocks[..., :half] | (blocks[..., half:] << 4)).contiguous()
    return packed, _pad_rows(scale.float(), nb * CPU_BLOCK).t().contiguous()

INT4_CPU_GROUPS = (32, 64, 128, 256)  # the group sizes _weight_int4pack_mm_for_cpu takes


def pack_int4_cpu(qweight: torch.Tensor, scale: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored int4 (packed nibbles [N, K/2], scales [N, K/G]) -> the CPU kernel's (weight, scales_and_zeros
    [K/G, N, 2]). Symmetric: W = (nibble - 8) * scale, so every zero (the kernel's additive offset) is 0."""
    nib = unpack_int4(qweight).to(torch.int32)                                     # (N, K)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nib.contiguous(), 2)
    s = scale.float().t().contiguous()                                             # (K/G, N)
    return packed, torch.stack((s, torch.zeros_like(s)), dim=-1).contiguous()


def _cpu_kernel(w: QuantWeight) -> Optional[str]:
    if w.qweight.device.type != "cpu" or w.kernels == "reference":
        return None
    if w.scheme.method == "int8":
        return "int8"
    n, k = w.shape
    return "int4" if w.scheme.group_size in INT4_CPU_GROUPS and k % w.scheme.group_size == 0 else None


class QuantLinear(torch.nn.Module):
    """y = x dequant(W)^T + b for a :class:`QuantWeight` [out, in], on the device's kernel."""

    def __init__(self, weight: QuantWeight, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.scheme = weight.scheme
        self.register_buffer("bias", bias, persistent=False)
        dev = weight.qweight.device
        self.kernel = "reference"
        if dev.type == "cpu":
            self.kernel = _cpu_kernel(weight) or "reference"
        elif dev.type == "cuda" and weight.kernels in ("auto", "triton"):
            self.kernel = "triton"
        if self.kernel == "int4":
            a, b = pack_int4_cpu(weight.qweight, weight.scale, weight.scheme.group_size)
        elif self.kernel == "int8":
            a, b = weight.qweight.contiguous(), weight.scale.float().contiguous()
        else:
            a, b = weight.qweight.contiguous(), weight.scale.contiguous()
        self.register_buffer("qweight", a, persistent=False)
        self.register_buffer("scale", b, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scale.to(x.dtype))
        elif self.kernel == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), self.qweight, self.scheme.group_size,
                                                           self.scale.to(x.dtype))
        elif self.kernel == "triton":
            from runner.kernels.triton_quant import quant_matmul
            y = quant_matmul(x2, self.qweight, self.scale, self.scheme.method, self.scheme.group_size)
        else:
            y = F.linear(x2, dequantize(self.qweight, self.scale, self.scheme.method, x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def make_linear(weight, bias: Optional[torch.Tensor] = None, prepack: bool = True) -> torch.nn.Module:
    """The layer for `weight`: a float tensor (runner.kernels.linear.Linear) or a :class:`QuantWeight`."""
    if isinstance(weight, QuantWeight):
        return QuantLinear(weight, bias)
    return Linear(weight, bias, prepack)
