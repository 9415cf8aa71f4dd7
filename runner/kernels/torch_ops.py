"""The engine's ops in fast torch: few dispatches in eager mode, and plain enough for torch.compile's inductor to fuse
them into a handful of C++ kernels per layer (the CPU path). Same signatures and meaning as `runner.kernels.reference`
(the specification), against which the tests check them:

- skip_rms_norm, swiglu, geglu, apply_rotary, kv_store: eagerly on float32 CPU tensors this project's C++
  (cpu_step.cpp: one pass each; rotary and the int8 quantiser are the one-call decode step's), rotary in place where
  the fused qkv GEMM left q and k; else the spec's arithmetic (inductor fuses it), rotary as a complex multiply and
  one index_put_.
- kv_load: one index_select over a strided view of the cache, any layout (int8: dequantised by the reference).
- attend: decode as two batched GEMVs per KV head group; prefill of a fresh prompt in float32 on CPU with this
  project's flash attention (cpu_step.cpp), else torch's scaled_dot_product_attention; GQA without repeating K/V.
- decode_attention_rows: decode attention reading the history rows where they lie in a float32 or int8 cache (C++,
  cpu_step.cpp), for float32 engines on CPU (:func:`cpu_kernels_for`); elsewhere kv_load, then attend.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from runner.kernels import reference as ref
from runner.kernels.cpu_ext import cpu_ops
from runner.kernels.reference import cache_view


def cpu_kernels_for(device: torch.device, dtype: torch.dtype) -> bool:
    """This project's C++ CPU kernels (built here) take float32 CPU tensors."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_ops() is not None


def _cpu_kernel_takes(*ts: Optional[torch.Tensor]) -> bool:
    """Eager, and every tensor given one the C++ CPU kernels take."""
    return not torch.compiler.is_compiling() and all(t is None or cpu_kernels_for(t.device, t.dtype) for t in ts)


def skip_rms_norm(x: torch.Tensor, skip: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
    """Residual add fused with RMSNorm (see reference.skip_rms_norm): returns (rms_norm(x + skip), x + skip)."""
    if not (_cpu_kernel_takes(x, skip, weight) and x.is_contiguous() and (skip is None or skip.is_contiguous())):
        return ref.skip_rms_norm(x, skip, weight, eps)
    y, r = torch.ops.pmx_cpu.skip_rms_norm(x, skip, weight.contiguous(), eps)
    return y, (x if skip is None else r)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x (see reference.rms_norm): the C++ kernel's pass where x is contiguous float32 on CPU
    (a post norm's input), else the spec (the q/k heads, views of a fused GEMM's output)."""
    if not (_cpu_kernel_takes(x, weight) and x.is_contiguous()):
        return ref.rms_norm(x, weight, eps)
    return torch.ops.pmx_cpu.skip_rms_norm(x, None, weight.contiguous(), eps)[0]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (see reference.swiglu)."""
    if not (_cpu_kernel_takes(gate, up) and gate.shape == up.shape and gate.stride(-1) == 1 and up.stride(-1) == 1):
        return ref.swiglu(gate, up)
    return torch.ops.pmx_cpu.swiglu(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (see reference.geglu)."""
    if not (_cpu_kernel_takes(gate, up) and gate.shape == up.shape and gate.stride(-1) == 1 and up.stride(-1) == 1):
        return ref.geglu(gate, up)
    return torch.ops.pmx_cpu.geglu(gate, up)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates interleaved pairs of the first 2 cos.shape[-1] dims of x [T, heads, D] (see reference.apply_rotary;
    the rest pass through); in place where it can (a partial rotary works on the view of the rotated dims)."""
    T, nh, D = x.shape
    R = 2 * cos.shape[-1]
    if _cpu_kernel_takes(x, cos, sin) and x.stride(-1) == 1:
        torch.ops.pmx_cpu.rotary_(x[..., :R], cos.contiguous(), sin.contiguous())
        return x
    if (torch.compiler.is_compiling() or x.dtype != torch.float32 or x.stride(-1) != 1
            or x.stride(0) % 2 or x.stride(1) % 2):
        return ref.apply_rotary(x, cos, sin)
    xc = torch.view_as_complex(x[..., :R].view(T, nh, R // 2, 2))   # (T, nh, R/2) complex views of the pairs
    xc.mul_(torch.complex(cos, sin)[:, None, :])
    return x


_KV_STORE_CACHES = ((torch.float32, None), (torch.int8, torch.float16))  # (cache, scale) dtypes of pmx_cpu.kv_store_


def kv_store(cache: torch.Tensor, scale: Optional[torch.Tensor], layout: int, layer: int,
             k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Writes k, v [T, KV, D] into rows `slots` of layer `layer` (see reference.kv_store)."""
    if (_cpu_kernel_takes(k, v) and cache.device.type == "cpu" and slots.dtype == torch.int64
            and (cache.dtype, None if scale is None else scale.dtype) in _KV_STORE_CACHES):
        k, v = (k, v) if k.stride() == v.stride() and k.stride(-1) == 1 else (k.contiguous(), v.contiguous())
        torch.ops.pmx_cpu.kv_store_(cache, scale, layout, layer, k, v, slots.contiguous())
        return
    kv = torch.stack((k, v))                                                      # (2, T, KV, D)
    if scale is not None:
        kv, s = ref.quantize_int8(kv)
        _put(scale, layout, layer, slots, s.to(scale.dtype))
    _put(cache, layout, layer, slots, kv.to(cache.dtype))


def _put(base: torch.Tensor, layout: int, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """base[layer, k|v, rows `slots`] = kv (2, T, KV, X), one index_put_ on the cache tensor itself (not on a
    view of it: that way torch.compile writes the rows in place instead of copying the layer)."""
    at = torch.full((), layer, dtype=torch.int64, device=slots.device)
    if layout in (0, 1):                                     # (MaxT, L, 2, KV, X) / (L, MaxT, 2, KV, X)
        base.index_put_((slots, at) if layout == 0 else (at, slots), kv.transpose(0, 1))
    else:                                                    # (L, 2, MaxT, KV, X) / (L, 2, KV, MaxT, X)
        which = torch.arange(2, device=slots.device)[:, None]
        if layout == 2:
            base.index_put_((at, which, slots[None, :]), kv)
        else:
            heads = torch.arange(kv.shape[2], device=slots.device)[:, None]
            base.index_put_((at, which[:, :, None], heads, slots), kv.permute(0, 2, 1, 3))     # (2, KV, T, X)


def kv_load(cache: torch.Tensor, scale: Optional[torch.Tensor], layout: int, layer: int,
            slots: torch.Tensor, dtype: torch.dtype):
    """Gathers whole rows along the cache's own row dim (an index_select along a dim of a permuted view
    would first copy the whole layer)."""
    if scale is not None:
        return ref.kv_load(cache, scale, layout, layer, slots, dtype)
    flat = slots.reshape(-1)
    if layout in (0, 1):                                     # a token's k and v: one row of 2 KV D
        rows = cache[:, layer] if layout == 0 else cache[layer]                    # (MaxT, 2, KV, D)
        kv = rows.flatten(1).index_select(0, flat).view(-1, *rows.shape[1:]).transpose(0, 1)  # (2, n, KV, D)
    elif layout == 2:                                        # (2, MaxT, KV, D), contiguous
        kv = cache[layer].index_select(1, flat)
    else:                                                    # (2, KV, MaxT, D), contiguous
        kv = cache[layer].index_select(2, flat).transpose(1, 2)
    kv = kv.reshape(2, *slots.shape, *kv.shape[2:]).to(dtype)                   # (2, *slots, KV, D)
    return kv[0], kv[1]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
           causal: bool, softcap: float = 0.0, bf16: bool = False, bf16_out: bool = False) -> torch.Tensor:
    """q [B, H, S, D] against k, v [B, KV, N, D] (H a multiple of KV); mask [B, 1, S, N] bool (True: seen) or
    additive float [B, 1 or H, S, N], else causal (query i sees keys j <= i) or everything; `softcap`: the scores'
    soft cap (0: none); `bf16`: bfloat16 products allowed, `bf16_out`: a bfloat16 output allowed (reference.attend).
    Returns [B, H, S, D]: float32, or bfloat16 where `bf16_out` and the bfloat16 products ran.

    One query per sequence (decode): two batched GEMVs and a softmax over each KV head's query group, which
    costs a tenth of SDPA's flash kernel at these sizes. Longer queries without a mask, float32 on CPU: this
    project's flash attention in C++ (cpu_step.cpp: 3.6x SDPA's at 512 tokens on Zen 5, soft cap included; with
    `bf16` where the CPU has AVX512-BF16 and head_dim is a multiple of 16, its products in bfloat16, 1.5x faster
    again); else SDPA (flash attention), or with a soft cap (which SDPA cannot apply) the reference's arithmetic."""
    B, H, S, D = q.shape
    KV = k.shape[1]
    if S == 1:
        qg = q.reshape(B, KV, H // KV, D)                                          # (B, KV, G, D)
        scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(1.0 / math.sqrt(D))   # (B, KV, G, N)
        if softcap:
            scores = ref.soft_cap(scores, softcap)
        if mask is not None and mask.dtype != torch.bool:                         # (B, 1 | H, 1, N) additive
            scores = scores.add_(mask.to(scores.dtype).expand(B, H, 1, -1).reshape(B, KV, H // KV, -1))
        elif mask is not None:
            scores = scores.masked_fill_(~mask, float("-inf"))                    # mask (B, 1, 1, N)
        return torch.matmul(scores.softmax(-1), v).view(B, H, 1, D)
    if mask is None and (not causal or S == k.shape[2]) and D <= 256 and _cpu_kernel_takes(q, k, v) and \
            q.stride(-1) == k.stride(-1) == v.stride(-1) == 1:  # (a fresh prompt's own keys) flash attention in C++
        bf16 = bf16 and D % 16 == 0 and D <= 240 and torch.ops.pmx_cpu.prefill_attention_bf16()
        return torch.ops.pmx_cpu.prefill_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   1.0 / math.sqrt(D), causal, softcap, bf16,
                                                   bf16 and bf16_out).transpose(1, 2)
    if softcap:
        return ref.attend(q, k, v, mask, causal, softcap)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          enable_gqa=H != KV)


def decode_attention_rows(q: torch.Tensor, cache: torch.Tensor, scale: Optional[torch.Tensor], layout: int,
                          layer: int, rows: torch.Tensor, kvlens: torch.Tensor,
                          sliding_window: Optional[int], page_size: int = 0,
                          alibi: Optional[torch.Tensor] = None, softcap: float = 0.0) -> torch.Tensor:
    """q [B, H, D], one new token per sequence, against the first kvlens[b] positions of its history (the last
    `sliding_window` of them where set), read in place from layer `layer` of a cache of `layout`: float32, or int8
    with its float16 `scale`. The history's cache rows: `rows` [B, N] lists them; or, as the plan's cachestarts,
    `rows` [B] holds each sequence's offset (page_size 0) or [B, MaxP] its page starts (page_size rows a page).
    `alibi`: the slopes [H] of an ALiBi model (reference.alibi_bias added to the scores); `softcap`: the scores' soft
    cap (0: none). Returns [B, H, D] float32:
    the math of `attend` over the gathered (and dequantised) rows, without gathering them."""
    return torch.ops.pmx_cpu.decode_attention(q.contiguous(), cache, scale, layout, layer, rows, kvlens,
                                              sliding_window or 0, 1.0 / math.sqrt(q.shape[-1]), page_size, alibi,
                                              softcap)
