"""Weight-only quantised linear layers: y = x dequant(W)^T + b, with the fastest kernel each device has.

The spec is :func:`reference_linear`: dequantise W (runner.pmx.quant.dequantize), then `F.linear`.
Kernels, each tested against it (tests/test_quant_engine.py: every kernel and scheme, compiled, TP 2/4, MoE;
tests/test_quant.py: the format, convert, split and merge):

- CPU (`cpu`): this project's kernels (runner/kernels/cpu_linear.cpp, ops `pmx_cpu::linear_int8 /
  linear_int8_group / linear_int4`), built on first use for the machine (-march=native) and cached by torch. The
  weight is repacked once at load into blocks of 64 output channels, k-major, and converted to floats in registers;
  scales per group (and int4's offsets, riding in the same tensor) as :func:`pack_group_scales` lays them out.
  torch's own weight-only CPU ops (`aten._weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`, what
  gpt-fast uses) are the fallback (`aten`) where the extension cannot be built. Above CPU_KERNEL_MAX_ROWS
  rows (prefill) each block of 64 channels is dequantised once per call into a buffer of its own and the float
  GEMM's tiles run on it (`linear_dequant`), which is faster there; on AVX2 without AVX-512 the streaming kernels
  (one row of x at a time there) do so themselves from 4 rows on (cpu_linear.cpp, avx2::ROWS_MAX).
- CUDA (`triton`): Triton W8A16 / W4A16 (runner/kernels/triton_quant.py), dequantising in registers.
- `--kernels reference`, or a scheme or shape no kernel takes: the spec, dequantising on every call.

Every kernel is an op of its own under torch.compile (a fake implementation gives its output shape), so
the compiled decode step calls it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from runner.kernels.cpu_ext import CPU_BLOCK, cpu_ops, huge_page_copy, pack_blocks, pad_rows
from runner.kernels.linear import Linear, SmallRows
from runner.pmx.quant import QuantScheme, dequantize, unpack_int4

CPU_KERNEL_MAX_ROWS = 32  # above this many rows of x, dequantise per block + float GEMM beats the streaming kernel
INT4_ATEN_GROUPS = (32, 64, 128, 256)  # the group sizes aten._weight_int4pack_mm_for_cpu takes (N % 16 == 0 too)


@dataclass
class QuantWeight:
    """A quantised weight as stored (qweight, scale[, offset]) with its leaf scheme and the kernel set that should run
    it. Concatenates along output rows (fused qkv / gate-up) and indexes the leading expert dim like a tensor."""
    qweight: torch.Tensor
    scale: torch.Tensor
    scheme: QuantScheme
    kernels: str = "auto"
    offset: Optional[torch.Tensor] = None  # int4 with offsets (scheme.offset): one per group, the scale's shape

    @property
    def shape(self) -> tuple:
        """The float weight's shape [.., N, K]."""
        k = self.qweight.shape[-1] * (2 if self.scheme.method == "int4" else 1)
        return (*self.qweight.shape[:-1], k)

    def __getitem__(self, i) -> "QuantWeight":
        return QuantWeight(self.qweight[i], self.scale[i], self.scheme, self.kernels,
                           None if self.offset is None else self.offset[i])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.qweight, self.scale, self.scheme.method, dtype, self.offset)


def stored_alike(ws: list) -> bool:
    """Whether weights can be concatenated into one: all float of one dtype, or all quantised with one scheme."""
    if isinstance(ws[0], QuantWeight):
        return all(isinstance(w, QuantWeight) and w.scheme == ws[0].scheme for w in ws)
    return not any(isinstance(w, QuantWeight) or w.dtype != ws[0].dtype for w in ws)


def cat_weights(ws: list):
    """Concatenates float weights or QuantWeights (of one scheme) along the output rows (fused qkv, gate/up)."""
    if not isinstance(ws[0], QuantWeight):
        return torch.cat(ws)
    return QuantWeight(torch.cat([w.qweight for w in ws]), torch.cat([w.scale for w in ws]), ws[0].scheme,
                       ws[0].kernels, None if ws[0].offset is None else torch.cat([w.offset for w in ws]))


def pop_weight(weights: dict, base: str, scheme: Optional[QuantScheme], kernels: str = "auto"):
    """Removes and returns the weight of linear `base` from a shard's tensors: `base.weight`, or its quantised parts
    (`base.qweight`, `base.scale`[, `base.offset`]) as a QuantWeight of the scheme `scheme` gives it."""
    leaf = None if scheme is None else scheme.for_tensor(f"{base}.weight")
    if leaf is None:
        return weights.pop(f"{base}.weight")
    return QuantWeight(weights.pop(f"{base}.qweight"), weights.pop(f"{base}.scale"), leaf, kernels,
                       weights.pop(f"{base}.offset", None))


def quant_embedding(ids: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, method: str, group_size: int,
                    dtype: torch.dtype, offset: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The spec of a quantised embedding's lookup: rows `ids` of (qweight, scale[, offset]), dequantised as they are
    gathered, [*ids.shape, columns] in `dtype` (runner.kernels.triton_quant.quant_embedding on CUDA, cpu_decode.cpp's
    Embedding in the one-call decode step)."""
    return dequantize(qweight[ids], scale[ids], method, dtype, None if offset is None else offset[ids])


def reference_linear(x: torch.Tensor, w: QuantWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The spec: dequantise, then an ordinary float linear."""
    return F.linear(x, w.dequantize(x.dtype), bias)


# -- CPU --------------------------------------------------------------------------------------------

def pack_group_scales(scale: torch.Tensor, offset: Optional[torch.Tensor], rows: int) -> torch.Tensor:
    """Scales per group [N, K/G] (and offsets) -> what the CPU kernels read: [K/G, rows] (rows: N padded to whole
    blocks of 64 channels), and with offsets [2, K/G, rows]: the scales, then the offsets (cpu_kernels.h)."""
    s = pad_rows(scale.float(), rows).t().contiguous()
    return s if offset is None else torch.stack((s, pad_rows(offset.float(), rows).t())).contiguous()


def pack_int4_blocks(qweight: torch.Tensor, scale: torch.Tensor, layout: int = 0,
                     offset: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored int4 ([N, K/2] bytes, scales [N, K/G]) -> (packed blocks of 64 channels, :func:`pack_group_scales`).
    layout 0: [N/64, K, 32], channel j of a block in the low nibble of byte j, channel j + 32 in the high one;
    layout 1 (AVX512-VNNI): [N/64, K/2, 64], row 2 q + h holds at byte 4 c + t channel 32 h + c (low nibble) and
    32 h + 16 + c (high nibble) of k = 4 q + t, for c < 16, t < 4 (cpu_linear.cpp, block_int4_vnni)."""
    nb = -(-qweight.shape[0] // CPU_BLOCK)
    nib = pad_rows(unpack_int4(qweight), nb * CPU_BLOCK)                             # (Np, K)
    blocks = nib.view(nb, CPU_BLOCK, -1).transpose(1, 2)                             # (nb, K, 64)
    if layout == 1:
        v = blocks.unflatten(1, (-1, 4)).unflatten(3, (2, 2, 16))                     # (nb, K/4, t, h, u, c)
        v = v.permute(0, 1, 3, 5, 2, 4)                                               # (nb, K/4, h, c, t, u)
        packed = (v[..., 0] | (v[..., 1] << 4)).reshape(nb, -1, CPU_BLOCK)
    else:
        half = CPU_BLOCK // 2
        packed = blocks[..., :half] | (blocks[..., half:] << 4)
    return huge_page_copy(packed), pack_group_scales(scale, offset, nb * CPU_BLOCK)


def pack_int4_aten(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored int4 -> aten._weight_int4pack_mm_for_cpu's (weight, scales_and_zeros [K/G, N, 2]). Symmetric:
    W = (nibble - 8) * scale, so every zero (the kernel's additive offset) is 0."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(qweight).to(torch.int32).contiguous(), 2)
    s = scale.float().t().contiguous()                                             # (K/G, N)
    return packed, torch.stack((s, torch.zeros_like(s)), dim=-1).contiguous()


def pick_kernel(w: QuantWeight) -> str:
    """cpu | aten | triton | reference, for this weight's device, scheme, shape and kernel set."""
    dev = w.qweight.device.type
    if w.kernels == "reference":
        return "reference"
    if dev == "cuda":
        from runner.kernels.triton_quant import takes_group
        return "triton" if takes_group(w.scheme) else "reference"
    if dev != "cpu":
        return "reference"
    if cpu_ops() is not None:
        return "cpu"
    aten = (w.scheme.method == "int8" and not w.scheme.grouped) or aten_int4_takes(w)
    return "aten" if aten else "reference"


def aten_int4_takes(w: QuantWeight) -> bool:
    """aten._weight_int4pack_mm_for_cpu: symmetric int4 in groups of 32..256, N a multiple of 16."""
    n, k = w.shape[-2:]
    s = w.scheme
    return s.method == "int4" and not s.offset and s.group_size in INT4_ATEN_GROUPS and k % s.group_size == 0 \
        and n % 16 == 0


class QuantLinear(SmallRows, torch.nn.Module):
    """y = x dequant(W)^T + b for a :class:`QuantWeight` [out, in], on `kernel` (default: :func:`pick_kernel`'s); on
    `triton`, a scheme decode_linear streams may take it for small rows (:class:`SmallRows`)."""

    KERNELS = ("cpu", "aten", "triton", "reference")

    def __init__(self, weight: QuantWeight, bias: Optional[torch.Tensor] = None, kernel: Optional[str] = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.method, self.group_size = weight.scheme.method, weight.scheme.group_size
        if kernel not in (None, *self.KERNELS):
            raise ValueError(f"kernel must be one of {self.KERNELS}, got {kernel!r}")
        self.kernel = kernel or pick_kernel(weight)
        self.register_buffer("bias", bias, persistent=False)
        q, s, o = weight.qweight, weight.scale, weight.offset
        self.layout = int(torch.ops.pmx_cpu.int4_layout(self.group_size)) \
            if self.kernel == "cpu" and self.method == "int4" else 0
        if self.kernel == "cpu":  # offsets ride with the scales (pack_group_scales)
            if self.method == "int4":
                q, s = pack_int4_blocks(q, s, self.layout, o)
            else:
                q = pack_blocks(q)
                s = pack_group_scales(s, None, q.shape[0] * CPU_BLOCK) if self.group_size else s.float().contiguous()
            o = None
        elif self.kernel == "aten":
            q, s = (q.contiguous(), s.float().contiguous()) if self.method == "int8" else pack_int4_aten(q, s)
        self.register_buffer("qweight", q.contiguous(), persistent=False)
        self.register_buffer("scale", s.contiguous(), persistent=False)
        self.register_buffer("offset", None if o is None else o.contiguous(), persistent=False)

    def use_small_rows(self, kernel, max_rows: int) -> None:
        from runner.kernels.triton_ops import takes_quant
        if self.kernel != "triton" or not takes_quant(self.method, self.group_size, self.in_features):
            raise ValueError(f"a {self.method} layer (groups of {self.group_size}) on {self.kernel} has no "
                             f"small-rows kernel")
        super().use_small_rows(kernel, max_rows)

    def _small_rows_weight(self) -> dict:
        from runner.kernels.triton_ops import QuantRows
        return {"quant": QuantRows(self.scale, self.offset, self.method, self.group_size)}

    def takes_small_rows(self) -> bool:
        """Whether :meth:`use_small_rows` takes this layer."""
        from runner.kernels.triton_ops import takes_quant
        return self.kernel == "triton" and takes_quant(self.method, self.group_size, self.in_features)

    def forward(self, x: torch.Tensor, swiglu: bool = False, norm: Optional[tuple] = None,
                residual: Optional[torch.Tensor] = None, rotary=None) -> torch.Tensor:
        y = self._small(x, self.qweight, swiglu, norm, residual, rotary)
        if y is not None:
            return y
        x2 = x.reshape(-1, self.in_features)
        y = getattr(self, f"_{self.kernel}")(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _cpu(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().contiguous()
        ops = torch.ops.pmx_cpu  # loaded by pick_kernel (cpu_ops) before this layer was made
        if x.shape[0] > CPU_KERNEL_MAX_ROWS:  # prefill: each block dequantised once, then the float GEMM tiles
            return ops.linear_dequant(xf, self.qweight, self.scale, 8 if self.method == "int8" else 4,
                                      self.group_size, self.out_features).to(x.dtype)
        if self.method == "int4":
            y = ops.linear_int4(xf, self.qweight, self.scale, self.group_size, self.out_features)
        elif self.group_size:
            y = ops.linear_int8_group(xf, self.qweight, self.scale, self.group_size, self.out_features)
        else:
            y = ops.linear_int8(xf, self.qweight, self.scale, self.out_features)
        return y.to(x.dtype)

    def _aten(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().contiguous()
        y = torch.ops.aten._weight_int8pack_mm(xf, self.qweight, self.scale) if self.method == "int8" else \
            torch.ops.aten._weight_int4pack_mm_for_cpu(xf, self.qweight, self.group_size, self.scale)
        return y.to(x.dtype)

    def _triton(self, x: torch.Tensor) -> torch.Tensor:
        from runner.kernels.triton_quant import quant_matmul
        return quant_matmul(x, self.qweight, self.scale, self.method, self.group_size, self.offset)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.qweight, self.scale, self.method, x.dtype, self.offset))


def packed_args(lin) -> Optional[tuple]:
    """(packed weight, scale, kind, group) of a linear layer on this project's packed CPU kernels, as the C++ callers
    take them (runner/kernels/cpu_kernels.h, PackedLinear: kind 32 float32 and 16 bfloat16 / float16 with an empty
    scale, 8 int8 (group 0: a scale per channel), 4 int4; a grouped kind's scales (and offsets) as
    :func:`pack_group_scales` lays them out), or None for a layer on another kernel."""
    if isinstance(lin, Linear) and lin.kernel == "pmx":
        return lin.packed, _NO_SCALE, 32 if lin.packed.dtype == torch.float32 else 16, 0
    if isinstance(lin, QuantLinear) and lin.kernel == "cpu":
        return lin.qweight, lin.scale, 8 if lin.method == "int8" else 4, lin.group_size
    return None


_NO_SCALE = torch.empty(0)


def make_linear(weight, bias: Optional[torch.Tensor] = None, prepack: bool = True) -> torch.nn.Module:
    """The layer for `weight`: a float tensor (runner.kernels.linear.Linear) or a :class:`QuantWeight`."""
    if isinstance(weight, QuantWeight):
        return QuantLinear(weight, bias)
    return Linear(weight, bias, prepack)
