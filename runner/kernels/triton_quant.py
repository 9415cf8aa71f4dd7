"""Triton W8A16 / W4A16 GEMM for CUDA: y = x dequant(W)^T, the weight dequantised in registers.

Reads the stored layout (runner.pmx.quant) as it is: int8 [N, K] with one scale per output row or per group of G
input columns, or int4 bytes [N, K/2] (column 2j in the low nibble, 2j+1 in the high one) with one scale (and, with
offsets, one offset) per group of G input columns. Each program computes a [BLOCK_M, BLOCK_N] tile of y, walking K in
steps of BLOCK_K = 32. Groups take sizes that are multiples of 16: a group of 32 or more covers a whole step with one
scale per row; groups of 16 take a scale per column (a 16-wide step of one group each gave wrong float16 products on
an H100 with Triton 3.6, and half-filled the tensor cores). Activations in
float16 / bfloat16 / float32; accumulation in float32. Small M (decoding) runs the same kernel with a
16-row tile (the smallest `tl.dot` takes). On CPU it runs under the Triton interpreter (tests).
The spec is runner.kernels.quant_linear.reference_linear (dequantise, then matmul).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from runner.kernels.triton_ops import dot_acc, exact_dot


@triton.jit
def _quant_matmul_kernel(x_ptr, w_ptr, s_ptr, o_ptr, y_ptr, M, N, K, G, INT4: tl.constexpr, GROUPED: tl.constexpr,
                         OFFSET: tl.constexpr, EXACT: tl.constexpr, SCALE_PER_COLUMN: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)   # row x K, row x N can pass 2^31 (a large
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)   # vocabulary x hidden)
    mm, mn = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if not GROUPED:
        scale = tl.load(s_ptr + rn, mask=mn, other=0.0).to(tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mk = rk < K
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        if INT4:
            rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)                          # bytes of this step
            b = tl.load(w_ptr + rn[:, None] * (K // 2) + rb[None, :], mask=mn[:, None] & (rb < K // 2)[None, :],
                        other=0).to(tl.int32)
            q = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK_N, BLOCK_K))        # (BN, BK): 2j low, 2j+1 high
            w = q.to(tl.float32) if OFFSET else q.to(tl.float32) - 8.0
        else:
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=mn[:, None] & mk[None, :], other=0).to(tl.float32)
        if GROUPED:
            if SCALE_PER_COLUMN:                                               # groups narrower than the step
                at = rn[:, None] * (K // G) + (rk // G)[None, :]
                s2 = tl.load(s_ptr + at, mask=mn[:, None] & mk[None, :], other=0.0).to(tl.float32)
                w = w * s2
                if OFFSET:
                    w = w + tl.load(o_ptr + at, mask=mn[:, None] & mk[None, :], other=0.0).to(tl.float32)
            else:
                at1 = rn * (K // G) + k0 // G
                w = w * tl.load(s_ptr + at1, mask=mn, other=0.0).to(tl.float32)[:, None]
                if OFFSET:
                    w = w + tl.load(o_ptr + at1, mask=mn, other=0.0).to(tl.float32)[:, None]
        acc += dot_acc(x, tl.trans(w.to(x.dtype)), EXACT)  # float32 activations: exact products, no tf32
    if not GROUPED:
        acc = acc * scale[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def _launch(kernel, grid, *args, **kwargs) -> None:
    kernel[grid](*args, **kwargs)


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, method: str, group_size: int = 0,
                 offset: Optional[torch.Tensor] = None, launch=_launch) -> torch.Tensor:
    """x [M, K] @ dequant(qweight, scale[, offset])^T -> [M, N] in x's dtype (group_size 0: int8 with a scale per
    output row). `launch` launches the kernel (see runner.kernels.triton_ops: the ahead-of-time compile checks record
    the launch instead)."""
    x = x.contiguous()
    M, K = x.shape
    N = qweight.shape[0]
    int4 = method == "int4"
    if (int4 or group_size) and group_size % 16:
        raise ValueError(f"{method} group_size {group_size}: the Triton kernel takes multiples of 16")
    block_k = 32
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    block_m = 16 if M <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    scale = scale.contiguous()
    launch(_quant_matmul_kernel, grid, x, qweight.contiguous(), scale, scale if offset is None else offset.contiguous(),
           y, M, N, K, max(group_size, 1), INT4=int4, GROUPED=group_size > 0, OFFSET=offset is not None,
           EXACT=exact_dot(x.dtype), SCALE_PER_COLUMN=group_size > 0 and group_size % block_k != 0, BLOCK_M=block_m,
           BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return y


def takes_group(scheme) -> bool:
    """Whether the kernel runs a weight of this (leaf) QuantScheme: per-channel int8, or groups of a multiple of 16
    (a step of K holds whole groups)."""
    return not scheme.grouped or scheme.group_size % 16 == 0


@triton.jit
def _quant_embedding_kernel(ids_ptr, w_ptr, s_ptr, o_ptr, y_ptr, D, G, INT4: tl.constexpr, GROUPED: tl.constexpr,
                            OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    """y[t, c] = column c of row ids[t] of the quantised embedding, dequantised: q * scale (int8: the row's scale or
    its group's; int4: the nibble - 8, times its group's scale; with offsets the nibble times the scale plus the
    offset), computed in float32 as runner.pmx.quant.dequantize does."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < D
    row = tl.load(ids_ptr + t).to(tl.int64)                       # row x D can pass 2^31 (vocabulary x hidden)
    if INT4:
        b = tl.load(w_ptr + row * (D // 2) + cols // 2, mask=m, other=0).to(tl.int32)
        q = tl.where(cols % 2 == 0, b & 15, b >> 4)
        if not OFFSET:
            q = q - 8
    else:
        q = tl.load(w_ptr + row * D + cols, mask=m, other=0).to(tl.int32)
    if GROUPED:
        s = tl.load(s_ptr + row * (D // G) + cols // G, mask=m, other=0.0).to(tl.float32)
    else:
        s = tl.load(s_ptr + row).to(tl.float32)
    v = q.to(tl.float32) * s
    if OFFSET:
        v = v + tl.load(o_ptr + row * (D // G) + cols // G, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * D + cols, v.to(y_ptr.dtype.element_ty), mask=m)


def quant_embedding(ids: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, method: str, group_size: int,
                    dtype: torch.dtype, offset: Optional[torch.Tensor] = None, launch=_launch) -> torch.Tensor:
    """Rows `ids` of a quantised embedding (int8 [V, D] with scale [V] or [V, D/G]; int4 bytes [V, D/2] with scale
    [V, D/G], and offsets [V, D/G] where it has them), dequantised as they are gathered: [*ids.shape, D] in `dtype`.
    The spec is runner.kernels.quant_linear.quant_embedding."""
    int4 = method == "int4"
    flat = ids.reshape(-1).contiguous()
    d = qweight.shape[-1] * (2 if int4 else 1)
    y = torch.empty(flat.numel(), d, device=qweight.device, dtype=dtype)
    block = min(1024, triton.next_power_of_2(d))
    scale = scale.contiguous()
    if flat.numel():
        launch(_quant_embedding_kernel, (flat.numel(), triton.cdiv(d, block)), flat, qweight.contiguous(), scale,
               scale if offset is None else offset.contiguous(), y, d, max(group_size, 1), INT4=int4,
               GROUPED=group_size > 0, OFFSET=offset is not None, BLOCK=block, num_warps=4,
               enable_fp_fusion=False)  # q * s + o rounded twice, as the spec: an FMA (CUDA's default) rounds once
    return y.view(*ids.shape, d)
