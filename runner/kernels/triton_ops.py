"""Fused Triton kernels for the engine's hot path; `runner.kernels.reference` is their specification.

Each op has the reference's signature and meaning:

- skip_rms_norm: residual add and RMSNorm in one pass over each row.
- apply_rotary: rotates q or k of packed tokens in place (interleaved pairs), strided, so q and k
  are rotated where the fused qkv GEMM left them.
- swiglu: silu(gate) * up in one pass.
- kv_store: quantise (int8, groups of 8, float16 scales) and store K/V rows into any cache layout,
  offset or paged, with the cache's own strides.
- decode_attention: one query token per sequence against its cached keys/values (int8 or float,
  offset or paged, GQA, sliding window), flash-decoding style: the keys are cut into splits that
  run in parallel, each keeping a running max / sum, and the splits are merged at the end.

They run on CUDA, and on CPU under the Triton interpreter (TRITON_INTERPRET=1, set before Triton is
imported), which is how CI tests them. Prefill attention stays torch SDPA (flash attention on GPU).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from runner.kernels.reference import PAGE_SIZE, QUANT_GROUP, cache_view
from runner.kernels.torch_ops import attend, kv_load  # noqa: F401  (prefill attention: torch SDPA)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# --- skip RMSNorm -------------------------------------------------------------------------------
@triton.jit
def _skip_rms_norm_kernel(x_ptr, skip_ptr, w_ptr, y_ptr, r_ptr, D, eps, HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    xf = tl.load(x_ptr + row * D + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_SKIP:  # the residual is rounded to the input dtype, as the reference's x + skip
        r = (xf + tl.load(skip_ptr + row * D + offs, mask=m, other=0.0).to(tl.float32)).to(r_ptr.dtype.element_ty)
        tl.store(r_ptr + row * D + offs, r, mask=m)
        xf = r.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    y = (xf * inv).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + offs, (w * y).to(y_ptr.dtype.element_ty), mask=m)


def skip_rms_norm(x: torch.Tensor, skip: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    y = torch.empty_like(x2)
    if skip is None:
        r = x
        _skip_rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, y, x2, D, eps, HAS_SKIP=False, BLOCK=_pow2(D))
    else:
        s2 = skip.reshape(-1, D).contiguous()
        r2 = torch.empty_like(x2)
        _skip_rms_norm_kernel[(x2.shape[0],)](x2, s2, weight, y, r2, D, eps, HAS_SKIP=True, BLOCK=_pow2(D))
        r = r2.view(x.shape)
    return y.view(x.shape), r


# --- rotary ---------------------------------------------------------------------------------------
@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, stride_t, stride_h, HALF, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.arange(0, BLOCK)
    m = j < HALF
    base = x_ptr + t * stride_t + h * stride_h
    a = tl.load(base + 2 * j, mask=m, other=0.0).to(tl.float32)
    b = tl.load(base + 2 * j + 1, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * HALF + j, mask=m, other=0.0)
    s = tl.load(sin_ptr + t * HALF + j, mask=m, other=0.0)
    tl.store(base + 2 * j, (a * c - b * s).to(x_ptr.dtype.element_ty), mask=m)
    tl.store(base + 2 * j + 1, (a * s + b * c).to(x_ptr.dtype.element_ty), mask=m)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place on x [T, heads, D] (any token / head strides, contiguous last dim); returns x."""
    T, nh, D = x.shape
    if x.stride(-1) != 1:
        raise ValueError("apply_rotary needs a contiguous last dim")
    if T:
        _rotary_kernel[(T, nh)](x, cos.contiguous(), sin.contiguous(), x.stride(0), x.stride(1), D // 2,
                                BLOCK=_pow2(D // 2))
    return x


# --- SwiGLU ---------------------------------------------------------------------------------------
@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, o_ptr, F, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = col < F
    g = tl.load(g_ptr + row * stride_g + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + col, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * F + col, (g * tl.sigmoid(g) * u).to(o_ptr.dtype.element_ty), mask=m)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [rows, F] (e.g. the two halves of a fused gate/up GEMM output: row strides allowed)."""
    F_ = gate.shape[-1]
    g2, u2 = gate.reshape(-1, F_), up.reshape(-1, F_)
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        g2, u2 = g2.contiguous(), u2.contiguous()
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    block = min(_pow2(F_), 1024)
    if g2.shape[0]:
        _swiglu_kernel[(g2.shape[0], triton.cdiv(F_, block))](g2, u2, out, F_, g2.stride(0), u2.stride(0), BLOCK=block)
    return out.view(gate.shape)


# --- KV cache store -------------------------------------------------------------------------------
@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _kv_store_kernel(x_ptr, slots_ptr, c_ptr, s_ptr, stride_xt, stride_xh, c_t, c_h, s_t, s_h, D,
                     QUANT: tl.constexpr, BLOCK_G: tl.constexpr, GROUP: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    g = tl.arange(0, BLOCK_G)
    d = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # (BLOCK_G, GROUP)
    m = d < D
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=m, other=0.0).to(tl.float32)
    dst = c_ptr + slot * c_t + h * c_h + d
    if QUANT:
        scale = tl.maximum(tl.max(tl.abs(x), axis=1) / 127.0, 1e-5)  # (BLOCK_G,)
        q = _round_half_even(x / scale[:, None])
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(dst, q.to(tl.int8), mask=m)
        tl.store(s_ptr + slot * s_t + h * s_h + g, scale.to(tl.float16), mask=g * GROUP < D)
    else:
        tl.store(dst, x.to(c_ptr.dtype.element_ty), mask=m)


def kv_store(cache: torch.Tensor, scale: Optional[torch.Tensor], layout: int, layer: int,
             k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    view = cache_view(cache, layout)[layer]  # (2, MaxT, KV, D)
    T, KV, D = k.shape
    if T == 0:
        return
    slots = slots.contiguous()
    sview = cache_view(scale, layout)[layer] if scale is not None else None
    group = QUANT_GROUP if scale is not None else _pow2(D)
    for i, x in enumerate((k, v)):
        c, s = view[i], (sview[i] if sview is not None else view[i])
        if c.stride(-1) != 1 or x.stride(-1) != 1:
            raise ValueError("kv_store needs contiguous head_dim rows")
        _kv_store_kernel[(T, KV)](x, slots, c, s, x.stride(0), x.stride(1), c.stride(0), c.stride(1),
                                  s.stride(0), s.stride(1), D, QUANT=scale is not None,
                                  BLOCK_G=_pow2(triton.cdiv(D, group)), GROUP=group)


# --- decode attention (flash decoding) ------------------------------------------------------------
@triton.jit
def _decode_attn_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, starts_ptr, kvlens_ptr,
                        acc_ptr, m_ptr, l_ptr,
                        stride_qb, stride_qh, c_t, c_h, s_t, s_h, stride_sb,
                        sm_scale, window, GQA, H, D, SPLIT_LEN, NUM_SPLITS,
                        PAGED: tl.constexpr, QUANT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    kvlen = tl.load(kvlens_ptr + b)
    kvh = h // GQA
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=dm, other=0.0).to(tl.float32)
    start = sp * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, kvlen)
    lo = 0
    if HAS_WINDOW:
        lo = kvlen - window  # the query sits at kvlen - 1 and sees keys j > kvlen - 1 - window
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        inside = j < end
        valid = inside & (j >= lo)
        if PAGED:
            slot = tl.load(starts_ptr + b * stride_sb + j // PAGE, mask=inside, other=0) + j % PAGE
        else:
            slot = tl.load(starts_ptr + b) + j
        mask2 = valid[:, None] & dm[None, :]
        kk = tl.load(k_ptr + slot[:, None] * c_t + kvh * c_h + d[None, :], mask=mask2, other=0.0).to(tl.float32)
        vv = tl.load(v_ptr + slot[:, None] * c_t + kvh * c_h + d[None, :], mask=mask2, other=0.0).to(tl.float32)
        if QUANT:
            sidx = slot[:, None] * s_t + kvh * s_h + (d // GROUP)[None, :]
            kk = kk * tl.load(ks_ptr + sidx, mask=mask2, other=0.0).to(tl.float32)
            vv = vv * tl.load(vs_ptr + sidx, mask=mask2, other=0.0).to(tl.float32)
        s = tl.sum(q[None, :] * kk, axis=1) * sm_scale
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * vv, axis=0)
        m_i = m_new
    row = (b * H + h) * NUM_SPLITS + sp
    tl.store(acc_ptr + row * D + d, acc, mask=dm)
    tl.store(m_ptr + row, m_i)
    tl.store(l_ptr + row, l_i)


def decode_attention(q: torch.Tensor, cache: torch.Tensor, scale: Optional[torch.Tensor], layout: int, layer: int,
                     cachestarts: torch.Tensor, kvlens: torch.Tensor, cache_mode: int,
                     sliding_window: Optional[int] = None, max_kvlen: Optional[int] = None,
                     split_len: Optional[int] = None, block_n: int = 32) -> torch.Tensor:
    """q [B, H, D]: one new token per sequence, already in the cache at position kvlens[b] - 1.
    Returns [B, H, D] in q's dtype; the math of reference.attention_packed for decoding sequences."""
    B, H, D = q.shape
    view = cache_view(cache, layout)[layer]          # (2, MaxT, KV, D)
    KV = view.shape[2]
    max_kv = int(max_kvlen if max_kvlen is not None else kvlens.max())
    if split_len is None:  # enough programs to fill the GPU, each with a few blocks of keys
        target = max(1, 256 // max(B * H, 1))
        split_len = max(block_n, triton.cdiv(triton.cdiv(max_kv, target), block_n) * block_n)
    splits = triton.cdiv(max(max_kv, 1), split_len)
    acc = torch.empty(B * H * splits, D, dtype=torch.float32, device=q.device)
    m = torch.empty(B * H * splits, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    sview = cache_view(scale, layout)[layer] if scale is not None else view
    starts = cachestarts.contiguous()
    _decode_attn_kernel[(B, H, splits)](
        q, view[0], view[1], sview[0], sview[1], starts, kvlens.contiguous(), acc, m, lsum,
        q.stride(0), q.stride(1), view.stride(1), view.stride(2), sview.stride(1), sview.stride(2),
        starts.stride(0) if starts.dim() == 2 else 0, 1.0 / math.sqrt(D), int(sliding_window or 0), H // KV, H, D,
        split_len, splits, PAGED=cache_mode == 1, QUANT=scale is not None, HAS_WINDOW=bool(sliding_window),
        BLOCK_N=block_n, BLOCK_D=_pow2(D), PAGE=PAGE_SIZE, GROUP=QUANT_GROUP)
    m, lsum, acc = m.view(B, H, splits), lsum.view(B, H, splits), acc.view(B, H, splits, D)
    mx = m.amax(-1, keepdim=True)                    # merge the splits: rescale each to the common max
    w = torch.where(m == float("-inf"), torch.zeros_like(m), torch.exp(m - mx))
    out = (acc * w[..., None]).sum(2) / (lsum * w).sum(-1, keepdim=True)
    return out.to(q.dtype)
