"""Fused Triton kernels for the engine's hot path; `runner.kernels.reference` is their specification.

Each op has the reference's signature and meaning:

- skip_rms_norm: residual add and RMSNorm in one pass over each row; the warps grow with the row width
  (about 16 elements per thread), so wide rows do not spill.
- rotary_kv_store: one launch per layer rotates q and k in place (interleaved pairs, loaded as contiguous
  pairs; the first cos.shape[-1] pairs of a head, the rest pass through: a partial rotary) and writes the rotated
  k and v into the cache, quantised to int8 (groups of 8, one scale per
  group) when the cache is; any cache layout, offset or paged, with the cache's own strides. apply_rotary
  and kv_store are the same kernel with the cache store, or the rotation, switched off.
- swiglu / geglu: silu(gate) * up / gelu_tanh(gate) * up in one pass (one kernel, the activation a constexpr).
- decode_linear: y = x W^T (+ b) for the one row of a batch-1 decode step, streaming W once with no split-K
  reduction kernel after it; with `swiglu`, x is a fused gate/up output and silu(gate) * up is computed as it is
  loaded (the down projection takes the MLP's activation: one launch fewer per layer).
- decode_attention: one query token per sequence against its cached keys/values. One program per
  (sequence, KV head, split) takes the whole query group of that KV head (padded to 16 rows for `tl.dot`),
  so each key/value row is read once per KV head, not once per query head. The split count comes from the
  SM count and the batch size only (:func:`decode_splits`), never from the history lengths, so a captured
  CUDA graph stays valid as sequences grow; each program finds its key range from the sequence's length on
  the device. The splits are merged by a second Triton kernel (none when there is one split).
- decode_attention and prefill_attention add ALiBi's slope_h x (j - i) to the scores where given the slopes, and
  soft-cap them (cap tanh(s / cap), Gemma 2) where given a cap.
- prefill_attention: flash attention of n sequences of S new tokens each over their keys in the cache
  (causal, offset by each sequence's start, optional sliding window, int8 or float, offset or paged): for
  continued chunks and other prefill that reads the cache. Fresh prompts of one length attend with torch's
  SDPA (torch_ops.attend in the Triton kernel set: flash attention on GPU, causal without a mask).

Every int8 scale is loaded once per group of 8 values. Offsets that can pass 2^31 (cache row x row stride,
token x token stride) are computed in 64 bits. Rows whose cache slot is negative are not written and
sequences of length 0 attend to nothing (output 0): that is how a batch is padded to a CUDA graph's bucket.

Each wrapper takes `launch`, the function that launches a kernel (by default: launch it). The ahead-of-time
compile checks (`runner.kernels.aot`) pass one that records the launch instead, so they compile exactly the
specialisations the wrappers pick. On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1,
set before Triton is imported), which is how CI tests them.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from runner.kernels.linear import QuantRows, RotaryStore
from runner.kernels.reference import PAGE_SIZE, QUANT_GROUP, DecodeSplits, ScoreMods, cache_view

DEFAULT_SM_COUNT = 16   # what decode_splits assumes off CUDA (the interpreter, ahead-of-time compiles)
MAX_SPLITS = 32
LOG2E = 1.4426950408889634


def _launch(kernel, grid, *args, **kwargs) -> None:
    kernel[grid](*args, **kwargs)


Launch = Callable[..., None]


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (DEFAULT_SM_COUNT off CUDA)."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


# --- skip RMSNorm -------------------------------------------------------------------------------
def norm_warps(block: int) -> int:
    """Warps for a row of `block` elements: about 16 elements per thread, 1 to 16 warps."""
    return max(1, min(16, block // 512))


@triton.jit
def _skip_rms_norm_kernel(x_ptr, skip_ptr, w_ptr, y_ptr, r_ptr, D, eps, HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * D
    offs = tl.arange(0, BLOCK)
    m = offs < D
    xf = tl.load(x_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_SKIP:  # the residual is rounded to the input dtype, as the reference's x + skip
        r = (xf + tl.load(skip_ptr + row + offs, mask=m, other=0.0).to(tl.float32)).to(r_ptr.dtype.element_ty)
        tl.store(r_ptr + row + offs, r, mask=m)
        xf = r.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    y = (xf * inv).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row + offs, (w * y).to(y_ptr.dtype.element_ty), mask=m)


def skip_rms_norm(x: torch.Tensor, skip: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                  launch: Launch = _launch):
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    y = torch.empty_like(x2)
    block = _pow2(D)
    if skip is None:
        r = x
        launch(_skip_rms_norm_kernel, (x2.shape[0],), x2, x2, weight, y, x2, D, eps, HAS_SKIP=False, BLOCK=block,
               num_warps=norm_warps(block))
    else:
        s2 = skip.reshape(-1, D).contiguous()
        r2 = torch.empty_like(x2)
        launch(_skip_rms_norm_kernel, (x2.shape[0],), x2, s2, weight, y, r2, D, eps, HAS_SKIP=True, BLOCK=block,
               num_warps=norm_warps(block))
        r = r2.view(x.shape)
    return y.view(x.shape), r


# --- rotary + KV cache store ----------------------------------------------------------------------
@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _rotate(x, cos_ptr, sin_ptr, t, ROT, BLOCK: tl.constexpr):
    """x (BLOCK, 2): pairs (a, b) of one head at token t -> (a cos - b sin, a sin + b cos), float32, for the first ROT
    pairs (cos, sin [T, ROT]); the pairs past them pass through (cos 1, sin 0: a partial rotary)."""
    j = tl.arange(0, BLOCK)
    c = tl.load(cos_ptr + t * ROT + j, mask=j < ROT, other=1.0)
    s = tl.load(sin_ptr + t * ROT + j, mask=j < ROT, other=0.0)
    a, b = tl.split(x.to(tl.float32))
    return tl.join(a * c - b * s, a * s + b * c)


@triton.jit
def _store_row(c_ptr, s_ptr, slot, head, x, c_t, c_h, s_t, s_h, D,
               QUANT: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """Writes one head's row x (BLOCK, 2) into cache row `slot` (int8: quantised per group of GROUP values,
    one float16 scale per group); nothing when slot < 0."""
    D = tl.where(slot >= 0, D, 0)  # (a mask `& (slot >= 0)` trips the interpreter on the scalar)
    if QUANT:
        NG: tl.constexpr = 2 * BLOCK // GROUP
        g = tl.reshape(x.to(tl.float32), (NG, GROUP))                       # (NG, GROUP): element gi * GROUP + e
        scale = tl.maximum(tl.max(tl.abs(g), axis=1) / 127.0, 1e-5)        # (NG,)
        q = tl.minimum(tl.maximum(_round_half_even(g / scale[:, None]), -127.0), 127.0)
        gi = tl.arange(0, NG)
        d = gi[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        tl.store(c_ptr + slot * c_t + head * c_h + d, q.to(tl.int8), mask=d < D)
        tl.store(s_ptr + slot * s_t + head * s_h + gi, scale.to(tl.float16), mask=gi * GROUP < D)
    else:
        d = 2 * tl.arange(0, BLOCK)[:, None] + tl.arange(0, 2)[None, :]
        tl.store(c_ptr + slot * c_t + head * c_h + d, x.to(c_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _rotary_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                      sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, c_t, c_h, s_t, s_h, NQ, HALF, ROT,
                      ROTATE: tl.constexpr, STORE: tl.constexpr, QUANT: tl.constexpr,
                      BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """Program (t, h): h < NQ rotates query head h of token t in place; h >= NQ takes KV head h - NQ:
    rotates k in place (ROTATE) and writes k and v into the cache (STORE). A head has HALF pairs, the first ROT of
    which rotate."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = 2 * tl.arange(0, BLOCK)[:, None] + tl.arange(0, 2)[None, :]     # (BLOCK, 2): element 2j + p of a head
    m = d < 2 * HALF
    if h < NQ:
        qp = q_ptr + t * sq_t + h * sq_h + d
        tl.store(qp, _rotate(tl.load(qp, mask=m, other=0.0), cos_ptr, sin_ptr, t, ROT, BLOCK)
                 .to(q_ptr.dtype.element_ty), mask=m)
    else:
        kh = (h - NQ).to(tl.int64)
        kp = k_ptr + t * sk_t + kh * sk_h + d
        k = tl.load(kp, mask=m, other=0.0)
        if ROTATE:
            k = _rotate(k, cos_ptr, sin_ptr, t, ROT, BLOCK).to(k_ptr.dtype.element_ty)
            tl.store(kp, k, mask=m)
        if STORE:
            slot = tl.load(slots_ptr + t)
            v = tl.load(v_ptr + t * sv_t + kh * sv_h + d, mask=m, other=0.0)
            _store_row(kc_ptr, ks_ptr, slot, kh, k, c_t, c_h, s_t, s_h, 2 * HALF, QUANT, BLOCK, GROUP)
            _store_row(vc_ptr, vs_ptr, slot, kh, v, c_t, c_h, s_t, s_h, 2 * HALF, QUANT, BLOCK, GROUP)


def _rotary_kv(q, k, v, cos, sin, cache, scale, layout, layer, slots, rotate: bool, launch: Launch) -> None:
    """The one kernel behind rotary_kv_store, apply_rotary (cache None) and kv_store (rotate False)."""
    heads = [t for t in (q, k, v) if t is not None]
    T, D = heads[0].shape[0], heads[0].shape[2]
    if any(t.stride(-1) != 1 for t in heads):
        raise ValueError("the rotary / cache-store kernel needs contiguous head_dim rows")
    if T == 0:
        return
    nq, nkv = (q.shape[1] if q is not None else 0), (k.shape[1] if k is not None else 0)
    store = cache is not None
    block = _pow2(D // 2)
    if scale is not None:
        block = max(block, QUANT_GROUP // 2)
    if store:
        view = cache_view(cache, layout)[layer]                          # (2, MaxT, KV, D)
        sview = cache_view(scale, layout)[layer] if scale is not None else view
        kc, vc, ks, vs = view[0], view[1], sview[0], sview[1]
        c_t, c_h, s_t, s_h = view.stride(1), view.stride(2), sview.stride(1), sview.stride(2)
        slots = slots.contiguous()
    else:
        kc = vc = ks = vs = slots = heads[0]
        c_t = c_h = s_t = s_h = 0
    q_, k_, v_ = (t if t is not None else heads[0] for t in (q, k, v))
    if rotate:
        cos, sin = cos.contiguous(), sin.contiguous()
        if 2 * cos.shape[-1] > D:
            raise ValueError(f"rotary over {2 * cos.shape[-1]} dims of heads of {D}")
    else:
        cos = sin = heads[0]
    launch(_rotary_kv_kernel, (T, nq + nkv), q_, k_, v_, cos, sin, slots, kc, vc, ks, vs,
           q_.stride(0), q_.stride(1), k_.stride(0), k_.stride(1), v_.stride(0), v_.stride(1), c_t, c_h, s_t, s_h,
           nq, D // 2, cos.shape[-1] if rotate else 0, ROTATE=rotate, STORE=store, QUANT=scale is not None,
           BLOCK=block, GROUP=QUANT_GROUP, num_warps=1 if block <= 64 else 2)


def rotary_kv_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    cache: torch.Tensor, scale: Optional[torch.Tensor], layout: int, layer: int, slots: torch.Tensor,
                    launch: Launch = _launch) -> None:
    """reference.apply_rotary on q [T, H, D] and k [T, KV, D] (in place; cos, sin [T, R/2]: the first R dims of each
    head, R <= D), then reference.kv_store of the rotated k and v [T, KV, D] into rows `slots` of layer `layer`: one
    launch. Any token / head strides (the views of a fused qkv GEMM output); rows with a negative slot are rotated
    but not stored."""
    _rotary_kv(q, k, v, cos, sin, cache, scale, layout, layer, slots, True, launch)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, launch: Launch = _launch) -> torch.Tensor:
    """In place on x [T, heads, D] (any token / head strides, contiguous last dim); returns x."""
    _rotary_kv(x, None, None, cos, sin, None, None, 0, 0, None, True, launch)
    return x


def kv_store(cache: torch.Tensor, scale: Optional[torch.Tensor], layout: int, layer: int,
             k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, launch: Launch = _launch) -> None:
    _rotary_kv(None, k, v, None, None, cache, scale, layout, layer, slots, False, launch)


# --- SwiGLU / GeGLU -------------------------------------------------------------------------------
@triton.jit
def _gate_act(g, GELU: tl.constexpr):
    """silu(g), or GELU's tanh form g sigmoid(2 sqrt(2 / pi) (g + 0.044715 g^3)) (= g (1 + tanh(..)) / 2), float32."""
    if GELU:
        a = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    else:
        a = g * tl.sigmoid(g)
    return a


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, o_ptr, F, stride_g, stride_u, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = col < F
    g = tl.load(g_ptr + row * stride_g + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + col, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * F + col, (_gate_act(g, GELU) * u).to(o_ptr.dtype.element_ty), mask=m)


def geglu(gate: torch.Tensor, up: torch.Tensor, launch: Launch = _launch) -> torch.Tensor:
    """gelu_tanh(gate) * up, as :func:`swiglu`."""
    return swiglu(gate, up, launch, gelu=True)


def swiglu(gate: torch.Tensor, up: torch.Tensor, launch: Launch = _launch, gelu: bool = False) -> torch.Tensor:
    """gate, up [rows, F] (e.g. the two halves of a fused gate/up GEMM output: row strides allowed); `gelu`: GeGLU."""
    F_ = gate.shape[-1]
    g2, u2 = gate.reshape(-1, F_), up.reshape(-1, F_)
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        g2, u2 = g2.contiguous(), u2.contiguous()
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    block = min(_pow2(F_), 1024)
    if g2.shape[0]:
        launch(_swiglu_kernel, (g2.shape[0], triton.cdiv(F_, block)), g2, u2, out, F_, g2.stride(0), u2.stride(0),
               GELU=gelu, BLOCK=block, num_warps=4)
    return out.view(gate.shape)


# --- decode linears ------------------------------------------------------------------------------
DECODE_LINEAR_ROWS = 1    # rows up to which decode_linear replaces cuBLAS: a batch-1 decode step (several rows are
                          # faster on cuBLAS than on a 16-row tl.dot tile: benchmarks/RESULTS.md, GPU)

try:  # Programmatic Dependent Launch (sm_90+), in Triton since 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # (an older Triton: decode_linear(pdl=True) refuses)
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """With programmatic dependent launch: wait for the kernels before this one (their outputs are its inputs), then
    let the next kernel launch, so that its start overlaps this one's tail."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _exact_float(u, bias: tl.constexpr):
    """u - bias as float32 for integers 0 <= u < 2^23: u in the mantissa of 2^23, then 2^23 + bias subtracted (exact).
    An OR and an add at the full rate, where an int-to-float conversion runs at a quarter of it or less: the integer
    weights' dequantisation is otherwise what bounds a GEMV that streams half or a quarter of float16's bytes."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)


@triton.jit
def _weight_tile(w_ptr, s_ptr, o_ptr, rn, mn, k0, K, G, WEIGHT: tl.constexpr, GROUPED: tl.constexpr,
                 OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GPT: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """Rows rn, columns k0 .. k0 + BLOCK_K of W in float32: WEIGHT 16 a float weight; 8 int8 (times its group's scale
    when GROUPED; a per-channel scale is applied to the sums instead); 4 int4 nibbles, minus 8 (times the group's
    scale) or, with OFFSET, times the scale plus the group's offset. GPT: groups per tile (0: a group spans the
    tile)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    rows = rn.to(tl.int64)[:, None]
    if WEIGHT == 4:
        rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        if EVEN_K:
            b = tl.load(w_ptr + rows * (K // 2) + rb[None, :], mask=mn[:, None], other=0).to(tl.int32)
        else:
            b = tl.load(w_ptr + rows * (K // 2) + rb[None, :], mask=mn[:, None] & (rb < K // 2)[None, :],
                        other=0).to(tl.int32)
        q = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK_N, BLOCK_K))                  # column 2j low, 2j+1 high
        w = _exact_float(q, 0.0 if OFFSET else 8.0)                                  # nibble (- 8)
    elif WEIGHT == 8:
        if EVEN_K:
            b = tl.load(w_ptr + rows * K + rk[None, :], mask=mn[:, None], other=0)
        else:
            b = tl.load(w_ptr + rows * K + rk[None, :], mask=mn[:, None] & (rk < K)[None, :], other=0)
        w = _exact_float(b.to(tl.uint8, bitcast=True).to(tl.int32) ^ 128, 128.0)     # (q + 128) - 128
    elif EVEN_K:
        w = tl.load(w_ptr + rows * K + rk[None, :], mask=mn[:, None], other=0).to(tl.float32)
    else:
        w = tl.load(w_ptr + rows * K + rk[None, :], mask=mn[:, None] & (rk < K)[None, :], other=0).to(tl.float32)
    if GROUPED:
        if GPT == 0:          # one group over the whole tile: a scale per row
            at = rn.to(tl.int64) * (K // G) + k0 // G
            w = w * tl.load(s_ptr + at, mask=mn, other=0.0).to(tl.float32)[:, None]
            if OFFSET:
                w = w + tl.load(o_ptr + at, mask=mn, other=0.0).to(tl.float32)[:, None]
        else:                 # GPT groups of G columns
            gi = k0 // G + tl.arange(0, GPT)
            at = rows * (K // G) + gi[None, :]
            gm = mn[:, None] & (gi < K // G)[None, :]
            s = tl.load(s_ptr + at, mask=gm, other=0.0).to(tl.float32)
            w3 = tl.reshape(w, (BLOCK_N, GPT, BLOCK_K // GPT)) * s[:, :, None]
            if OFFSET:
                w3 = w3 + tl.load(o_ptr + at, mask=gm, other=0.0).to(tl.float32)[:, :, None]
            w = tl.reshape(w3, (BLOCK_N, BLOCK_K))
    return w


@triton.jit
def _rope_epilogue(y, y_ptr, row0, cos_ptr, sin_ptr, slots_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, c_t, c_h, s_t, s_h, N,
                   QD, KD, D, ROT, CACHE_QUANT: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """Rows row0 .. row0 + BLOCK_N of the qkv output y (float32, rounded to the output dtype): q and k rotated in
    interleaved pairs (the first ROT pairs of a head), the k and v rows written into cache row slots[0] (nothing
    when it is negative). Returns the rotated rows."""
    HALF: tl.constexpr = BLOCK_N // 2
    pr = row0 + 2 * tl.arange(0, HALF)                                  # the even row of each pair
    pj = (pr % D) // 2
    turn = (pr < QD + KD) & (pj < ROT)
    c = tl.load(cos_ptr + pj, mask=turn, other=1.0)
    s = tl.load(sin_ptr + pj, mask=turn, other=0.0)
    a, b = tl.split(tl.reshape(y, (HALF, 2)))
    y = tl.reshape(tl.join(a * c - b * s, a * s + b * c), (BLOCK_N,))
    y = y.to(y_ptr.dtype.element_ty).to(tl.float32)                    # q, k as stored; k and v quantised from that
    rn = row0 + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr).to(tl.int64)
    lim = tl.where(slot >= 0, N, 0)                                     # (padding rows: nothing stored)
    is_k = (rn >= QD) & (rn < QD + KD) & (rn < lim)
    is_v = (rn >= QD + KD) & (rn < lim)
    kvh = tl.where(rn < QD + KD, rn - QD, rn - QD - KD) // D
    at = slot * c_t + kvh.to(tl.int64) * c_h + rn % D
    if CACHE_QUANT:
        NG: tl.constexpr = BLOCK_N // GROUP
        g = tl.reshape(y, (NG, GROUP))
        scale = tl.maximum(tl.max(tl.abs(g), axis=1) / 127.0, 1e-5)
        q = tl.reshape(tl.minimum(tl.maximum(_round_half_even(g / scale[:, None]), -127.0), 127.0),
                       (BLOCK_N,)).to(tl.int8)
        tl.store(kc_ptr + at, q, mask=is_k)
        tl.store(vc_ptr + at, q, mask=is_v)
        gr = row0 + GROUP * tl.arange(0, NG)                            # each group's first row
        gkvh = tl.where(gr < QD + KD, gr - QD, gr - QD - KD) // D
        sat = slot * s_t + gkvh.to(tl.int64) * s_h + (gr % D) // GROUP
        tl.store(ks_ptr + sat, scale.to(ks_ptr.dtype.element_ty), mask=(gr >= QD) & (gr < QD + KD) & (gr < lim))
        tl.store(vs_ptr + sat, scale.to(vs_ptr.dtype.element_ty), mask=(gr >= QD + KD) & (gr < lim))
    else:
        tl.store(kc_ptr + at, y.to(kc_ptr.dtype.element_ty), mask=is_k)
        tl.store(vc_ptr + at, y.to(vc_ptr.dtype.element_ty), mask=is_v)
    return y


@triton.jit
def _decode_linear_kernel(x_ptr, w_ptr, s_ptr, o_ptr, b_ptr, g_ptr, r_ptr, y_ptr, N, K, G, eps,
                          cos_ptr, sin_ptr, slots_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, c_t, c_h, s_t, s_h, QD, KD, D,
                          ROT, WEIGHT: tl.constexpr, GROUPED: tl.constexpr, OFFSET: tl.constexpr,
                          HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                          ROPE: tl.constexpr, CACHE_QUANT: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GPT: tl.constexpr, GROUP: tl.constexpr):
    """y[N] = W[N, K] a[K] (+ b) for the one row of a decode step, W streamed once (BLOCK_N rows a program), the float32
    products summed along K (one row: no tensor cores). a = x, or silu(x[:K]) * x[K:] (SWIGLU: the fused gate/up
    output, activated as it is loaded), or with NORM g * x / rms(x): the row's sum of squares is summed from the same
    loads and its 1 / rms scales the sums at the end (a scalar of the whole row, so no program reads the row twice).
    Then + r (RESIDUAL: the residual stream the next norm takes), or ROPE: the qkv epilogue (_rope_epilogue)."""
    _pdl_start(PDL)
    row0 = tl.program_id(0) * BLOCK_N
    rn = row0 + tl.arange(0, BLOCK_N)
    mn = rn < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(x_ptr + rk).to(tl.float32)
        else:
            a = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        if SWIGLU:                                  # rounded to x's dtype, as the swiglu kernel's output would be
            u = tl.load(x_ptr + K + rk, mask=rk < K, other=0.0).to(tl.float32)
            a = (a * tl.sigmoid(a) * u).to(x_ptr.dtype.element_ty).to(tl.float32)
        if NORM:
            ss += a * a
            a = a * tl.load(g_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        w = _weight_tile(w_ptr, s_ptr, o_ptr, rn, mn, k0, K, G, WEIGHT, GROUPED, OFFSET, BLOCK_N, BLOCK_K, GPT,
                         EVEN_K)
        acc += w * a[None, :]
    y = tl.sum(acc, axis=1)
    if NORM:
        y = y / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    if WEIGHT == 8 and not GROUPED:                 # int8 per output channel
        y = y * tl.load(s_ptr + rn, mask=mn, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=mn, other=0.0).to(tl.float32)
    y = y.to(y_ptr.dtype.element_ty).to(tl.float32)  # the linear's output, as the unfused layers round it
    if RESIDUAL:
        y += tl.load(r_ptr + rn, mask=mn, other=0.0).to(tl.float32)
    if ROPE:
        y = _rope_epilogue(y, y_ptr, row0, cos_ptr, sin_ptr, slots_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, c_t, c_h, s_t,
                           s_h, N, QD, KD, D, ROT, CACHE_QUANT, BLOCK_N, GROUP)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=mn)


def decode_blocks_linear(n: int, k: int, method: Optional[str]) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of decode_linear. Float weights: from benchmarks/gpu_gemv.py on an
    H100 (Llama-2-7B's shapes): 8 weight rows (16 for N >= 16384) of 512 columns a program, 4 warps, 4 stages.
    Quantised weights: the same rows of 1024 columns on 8 warps (as many bytes a step as float16's tile)."""
    bn = 16 if n >= 16384 else 8
    return (bn, 512, 4, 4) if method is None else (bn, 1024, 8, 4)


def takes_quant(method: str, group_size: int, k: int) -> bool:
    """Whether decode_linear streams a weight of this scheme: int8 per channel, or groups of a power of two from 16
    that divide K (a tile holds whole groups, or one group spans it)."""
    if method == "int8" and group_size == 0:
        return True
    g = group_size
    return g >= 16 and g & (g - 1) == 0 and k % g == 0


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, swiglu: bool = False,
                  norm: Optional[tuple] = None, residual: Optional[torch.Tensor] = None,
                  rotary: Optional[RotaryStore] = None, quant: Optional[QuantRows] = None, pdl: bool = False,
                  launch: Launch = _launch, blocks: Optional[tuple[int, int, int, int]] = None) -> torch.Tensor:
    """x [1, K] (or [1, 2K] with `swiglu`: gate | up) @ W^T (+ bias) -> [1, N] in x's dtype, W = `weight` [N, K] or,
    with `quant`, the quantised weight it stores. `norm` (weight [K], eps): x is the residual stream and the product
    is of reference.rms_norm(x) (one launch for norm and linear); `residual` [1, N]: added to the output (the
    residual add of the norm after); `rotary`: the qkv linear's epilogue (RotaryStore); `pdl`: launched with
    programmatic dependent launch (sm_90+); `blocks`: (BLOCK_N, BLOCK_K, warps, stages) instead of
    decode_blocks_linear's (benchmarks/gpu_gemv.py's sweep)."""
    method = None if quant is None else quant.method
    N = weight.shape[0]
    K = weight.shape[1] * (2 if method == "int4" else 1)
    if x.dim() != 2 or x.shape[0] != DECODE_LINEAR_ROWS or x.shape[1] != (2 * K if swiglu else K):
        raise ValueError(f"decode_linear takes {DECODE_LINEAR_ROWS} row of {2 * K if swiglu else K} columns; "
                         f"got {tuple(x.shape)}")
    if not weight.is_contiguous():
        raise ValueError("decode_linear streams a contiguous weight (rows of K)")
    if quant is not None and not takes_quant(method, quant.group_size, K):
        raise ValueError(f"decode_linear: {method} groups of {quant.group_size} over {K} columns")
    if pdl and gdc_wait is None:
        raise ValueError(f"decode_linear(pdl=True) needs Triton's programmatic dependent launch (3.3+), not "
                         f"{triton.__version__}")
    bn, bk, warps, stages = blocks or decode_blocks_linear(N, K, method)
    x = x.contiguous()
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    dummy = weight
    group = quant.group_size if quant is not None else 0
    gpt = 0 if not group or group >= bk else bk // group
    if rotary is not None:
        r = rotary
        H, KV, D = r.heads, r.kv_heads, r.head_dim
        if N != (H + 2 * KV) * D or residual is not None or D % 2 or (r.scale is not None and D % QUANT_GROUP):
            raise ValueError(f"decode_linear's rotary epilogue: {N} rows for {H} + 2 x {KV} heads of {D}")
        view = cache_view(r.cache, r.layout)[r.layer]                    # (2, MaxT, KV, D)
        sview = cache_view(r.scale, r.layout)[r.layer] if r.scale is not None else view
        rope = (r.cos.contiguous(), r.sin.contiguous(), r.slots.contiguous(), view[0], view[1], sview[0], sview[1],
                view.stride(1), view.stride(2), sview.stride(1), sview.stride(2), H * D, KV * D, D, r.cos.shape[-1])
    else:
        rope = (dummy,) * 7 + (0,) * 4 + (0, 0, 1, 0)
    norm_w, eps = norm if norm is not None else (dummy, 0.0)
    extra = {"launch_pdl": True} if pdl else {}
    launch(_decode_linear_kernel, (triton.cdiv(N, bn),), x, weight,
           quant.scale if quant is not None else dummy,
           quant.offset if quant is not None and quant.offset is not None else dummy,
           bias if bias is not None else dummy, norm_w, residual if residual is not None else dummy, y, N, K,
           max(group, 1), float(eps), *rope,
           WEIGHT={None: 16, "int8": 8, "int4": 4}[method], GROUPED=group > 0,
           OFFSET=quant is not None and quant.offset is not None, HAS_BIAS=bias is not None, SWIGLU=swiglu,
           NORM=norm is not None, RESIDUAL=residual is not None, ROPE=rotary is not None,
           CACHE_QUANT=rotary is not None and rotary.scale is not None, PDL=pdl, BLOCK_N=bn, BLOCK_K=bk,
           EVEN_K=K % bk == 0, GPT=gpt, GROUP=QUANT_GROUP, num_warps=warps, num_stages=stages, **extra)
    return y


# --- attention over the cache ---------------------------------------------------------------------
def exact_dot(dtype: torch.dtype) -> bool:
    """Whether tl.dot runs on float32 copies of its operands, exactly (ieee): for float32 tensors (no tf32), and
    for bfloat16 under the interpreter, whose tl.dot multiplies the raw bits of bfloat16 values (the copies are
    exact, so the products are those of a GPU's bfloat16 tensor cores, accumulated in float32 as there)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and triton.knobs.runtime.interpret)


@triton.jit
def dot_acc(a, b, EXACT: tl.constexpr):
    """a @ b accumulated in float32 (see exact_dot)."""
    if EXACT:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, ty, EXACT: tl.constexpr):
    """One key block of flash attention: scores s (rows, BN) in log2 units (-inf where masked) and values v
    (BN, BD) folded into the running max m_i, sum l_i and output acc of each row. A row that has seen no key
    yet (max still -inf) stays at l = 0, acc = 0."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot_acc(p.to(ty), v, EXACT)
    return m_new, l_i, acc


@triton.jit
def _scores(q, k, qk_scale, softcap, EXACT: tl.constexpr, SOFTCAP: tl.constexpr):
    """q k^T in log2 units (qk_scale: log2(e) / sqrt(D)); SOFTCAP: the natural scores s soft-capped first,
    softcap tanh(s / softcap) (tanh(x) = 2 sigmoid(2x) - 1)."""
    s = dot_acc(q, tl.trans(k), EXACT)
    if SOFTCAP:
        s = s * (qk_scale / 1.4426950408889634)
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * 1.4426950408889634
    else:
        s = s * qk_scale
    return s


@triton.jit
def _cache_rows(starts_ptr, b, j, valid, stride_sb, PAGED: tl.constexpr, PAGE: tl.constexpr):
    """Cache rows (int64) of key positions j [N] of sequence b (offset: start + j; paged: page start + j % PAGE)."""
    if PAGED:
        rows = tl.load(starts_ptr + b * stride_sb + j // PAGE, mask=valid, other=0) + j % PAGE
    else:
        rows = tl.load(starts_ptr + b) + j
    return rows


@triton.jit
def _kv_tile(c_ptr, s_ptr, slot, head, valid, c_t, c_h, s_t, s_h, D, out_ty: tl.constexpr, QUANT: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr):
    """Rows `slot` [BLOCK_N] of KV head `head` -> (BLOCK_N, BLOCK_D) in out_ty (int8: q * scale, one scale per
    group of GROUP values, as reference.dequantize_int8)."""
    d = tl.arange(0, BLOCK_D)
    m = valid[:, None] & (d < D)[None, :]
    x = tl.load(c_ptr + slot[:, None] * c_t + head * c_h + d[None, :], mask=m, other=0)
    if QUANT:
        NG: tl.constexpr = BLOCK_D // GROUP
        gi = tl.arange(0, NG)
        sc = tl.load(s_ptr + slot[:, None] * s_t + head * s_h + gi[None, :],
                     mask=valid[:, None] & (gi * GROUP < D)[None, :], other=0.0).to(tl.float32)    # (BLOCK_N, NG)
        x = tl.reshape(tl.reshape(x.to(tl.float32), (BLOCK_N, NG, GROUP)) * sc[:, :, None], (BLOCK_N, BLOCK_D))
    return x.to(out_ty)


@triton.jit
def _decode_attn_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, starts_ptr, kvlens_ptr, out_ptr, part_ptr, slopes_ptr,
                        count_ptr, stride_qb, stride_qh, c_t, c_h, s_t, s_h, stride_sb, qk_scale, softcap, window, G,
                        H, D, NUM_SPLITS, PAGED: tl.constexpr, QUANT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                        SPLIT: tl.constexpr, MERGE: tl.constexpr, EXACT: tl.constexpr, ALIBI: tl.constexpr,
                        SOFTCAP: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                        GROUP: tl.constexpr):
    """Program (b, kvh, sp): the G query heads of KV head kvh of sequence b against split sp of its keys (ALIBI: plus
    slope_h x (j - (kvlen - 1)) on each score). With MERGE, the last program of (b, kvh) to finish its split (a ticket
    from count_ptr) merges the splits' partials into the output and resets the count for the next launch."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    kvlen = tl.load(kvlens_ptr + b).to(tl.int32)
    lo = 0
    if HAS_WINDOW:  # the query sits at kvlen - 1 and sees keys j > kvlen - 1 - window
        lo = tl.maximum(kvlen - window, 0)
    per = tl.cdiv(tl.cdiv(kvlen - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N  # keys per split, whole blocks
    start = lo + sp * per
    end = tl.minimum(start + per, kvlen)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * G + g
    qm = (g < G)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qm, other=0.0)  # (BG, BD)
    ty = q_ptr.dtype.element_ty
    if ALIBI:  # each head's slope, in log2 units as the scores
        slope = tl.load(slopes_ptr + heads, mask=g < G, other=0.0).to(tl.float32) * 1.4426950408889634
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        inside = j < end
        slot = _cache_rows(starts_ptr, b, j, inside, stride_sb, PAGED, PAGE)
        k = _kv_tile(k_ptr, ks_ptr, slot, kvh, inside, c_t, c_h, s_t, s_h, D, ty, QUANT, BLOCK_N, BLOCK_D, GROUP)
        v = _kv_tile(v_ptr, vs_ptr, slot, kvh, inside, c_t, c_h, s_t, s_h, D, ty, QUANT, BLOCK_N, BLOCK_D, GROUP)
        s = _scores(q, k, qk_scale, softcap, EXACT, SOFTCAP)
        if ALIBI:
            s += slope[:, None] * (j - (kvlen - 1)).to(tl.float32)[None, :]
        s = tl.where(inside[None, :], s, float("-inf"))                   # (BG, BN), log2 units
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, ty, EXACT)
    if SPLIT:  # partials [B, H, NUM_SPLITS, D + 2]: acc, then the running max (log2) and sum
        row = ((b * H + heads) * NUM_SPLITS + sp) * (D + 2)
        tl.store(part_ptr + row[:, None] + d[None, :], acc, mask=qm)
        tl.store(part_ptr + row + D, m_i, mask=g < G)
        tl.store(part_ptr + row + D + 1, l_i, mask=g < G)
        if MERGE:
            # every thread's partials written before the ticket (the atomic releases them, gpu scope), and read
            # after it (acquire) from L2: the pattern of a grid-wide barrier
            tl.debug_barrier()
            count = count_ptr + b * tl.num_programs(1) + kvh
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
                _merge_partials(part_ptr, out_ptr, b * H + kvh * G, G, D, NUM_SPLITS, BLOCK_G, BLOCK_D)
                tl.store(count, 0)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]             # l == 0: no keys (a padding row)
        tl.store(out_ptr + (b * H + heads[:, None]) * D + d[None, :], out.to(ty), mask=qm)


@triton.jit(noinline=True)
def _merge_partials(part_ptr, out_ptr, head0, G, D, NUM_SPLITS, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[head0 + g] for g < G (heads of [B x H] rows of D) from their NUM_SPLITS partials (rows of D + 2: acc, max,
    sum): sum_s acc_s 2^(m_s - m) / sum_s l_s 2^(m_s - m), walking the splits with a running max. A call of its own
    (noinline): its registers are not those of the attention loop before it."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm, dm = g < G, d < D
    heads = head0 + g
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    den = tl.zeros((BLOCK_G,), tl.float32)
    num = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for sp in tl.range(0, NUM_SPLITS, num_stages=1):
        base = (heads * NUM_SPLITS + sp) * (D + 2)
        m_s = tl.load(part_ptr + base + D, mask=gm, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(part_ptr + base + D + 1, mask=gm, other=0.0, cache_modifier=".cg")
        acc = tl.load(part_ptr + base[:, None] + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0,
                      cache_modifier=".cg")
        m_new = tl.maximum(m, m_s)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)          # splits with no key weigh 0
        a_old, a_s = tl.math.exp2(m - safe), tl.math.exp2(m_s - safe)
        den = den * a_old + l_s * a_s
        num = num * a_old[:, None] + acc * a_s[:, None]
        m = m_new
    out = num / tl.where(den == 0.0, 1.0, den)[:, None]
    tl.store(out_ptr + heads[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=gm[:, None] & dm[None, :])


@triton.jit
def _merge_splits_kernel(part_ptr, out_ptr, H, D, NUM_SPLITS, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, h): out[b, h] = sum_s acc_s 2^(m_s - m) / sum_s l_s 2^(m_s - m), m = max_s m_s."""
    bh = tl.program_id(0).to(tl.int64) * H + tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sm = s < NUM_SPLITS
    base = (bh * NUM_SPLITS + s) * (D + 2)
    m = tl.load(part_ptr + base + D, mask=sm, other=float("-inf"))
    lsum = tl.load(part_ptr + base + D + 1, mask=sm, other=0.0)
    mx = tl.max(m, axis=0)
    w = tl.math.exp2(m - tl.where(mx == float("-inf"), 0.0, mx))        # empty splits weigh 0
    acc = tl.load(part_ptr + base[:, None] + d[None, :], mask=sm[:, None] & (d < D)[None, :], other=0.0)
    den = tl.sum(lsum * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + bh * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def _slopes(alibi: Optional[torch.Tensor], heads: int, dummy: torch.Tensor) -> torch.Tensor:
    """The ALiBi slopes a kernel reads (checked: contiguous float32 [heads]), or `dummy` where there are none."""
    if alibi is None:
        return dummy
    if alibi.dtype != torch.float32 or alibi.shape != (heads,) or not alibi.is_contiguous():
        raise ValueError(f"alibi must be the contiguous float32 slopes [{heads}], got {alibi.dtype} "
                         f"{tuple(alibi.shape)}")
    return alibi


def decode_splits(batch: int, kv_heads: int, sms: int) -> int:
    """Key splits per (sequence, KV head) of decode attention: enough programs for two per SM, at most
    MAX_SPLITS. A function of the batch size (a CUDA graph's bucket) and the device only."""
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * sms, max(batch * kv_heads, 1))))


def decode_blocks(head_dim: int, quantized: bool) -> tuple[int, int, int]:
    """(BLOCK_G, BLOCK_N, BLOCK_D) of decode attention: the query group padded to 16 rows (tl.dot's least),
    64 keys per step (32 from head_dim 128 with an int8 cache, whose dequantised tiles are float32 for a while,
    and above head_dim 128: more spills registers), head_dim padded to a power of two (at least 16)."""
    block_d = max(16, _pow2(head_dim))
    return 16, 64 if block_d < 128 or (block_d == 128 and not quantized) else 32, block_d


def decode_attention(q: torch.Tensor, cache: torch.Tensor, scale: Optional[torch.Tensor], layout: int, layer: int,
                     cachestarts: torch.Tensor, kvlens: torch.Tensor, cache_mode: int,
                     sliding_window: Optional[int] = None, splits: DecodeSplits = DecodeSplits(),
                     launch: Launch = _launch, mods: ScoreMods = ScoreMods()) -> torch.Tensor:
    """q [B, H, D]: one new token per sequence, already in the cache at position kvlens[b] - 1; `mods`
    (reference.ScoreMods): ALiBi slopes, a soft cap. Returns [B, H, D] in q's dtype; the
    math of reference.attention_packed for decoding sequences. No host sync and no shape that depends on the history
    lengths (capturable in a CUDA graph). `splits` (reference.DecodeSplits): the split count (default:
    decode_splits') and the tickets of a merge inside the kernel."""
    B, H, D = q.shape
    alibi, softcap = mods.alibi, mods.softcap
    if q.stride(-1) != 1:
        raise ValueError("decode_attention needs a contiguous head_dim")
    view = cache_view(cache, layout)[layer]          # (2, MaxT, KV, D)
    KV = view.shape[2]
    num_splits = splits.count if splits.count is not None else decode_splits(B, KV, sm_count(q.device))
    split_counts = splits.tickets
    block_g, block_n, block_d = decode_blocks(D, scale is not None)
    G = H // KV
    if G > block_g:
        block_g = _pow2(G)
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    split = num_splits > 1
    merge = split and split_counts is not None and split_counts.numel() >= B * KV
    if merge and split_counts.dtype != torch.int32:
        raise ValueError(f"the split tickets must be int32, got {split_counts.dtype}")
    part = torch.empty(B * H * num_splits * (D + 2) if split else 1, dtype=torch.float32, device=q.device)
    sview = cache_view(scale, layout)[layer] if scale is not None else view
    starts = cachestarts.contiguous()
    launch(_decode_attn_kernel, (B, KV, num_splits), q, view[0], view[1], sview[0], sview[1], starts,
           kvlens.contiguous(), out, part, _slopes(alibi, H, q), split_counts if merge else kvlens, q.stride(0),
           q.stride(1), view.stride(1), view.stride(2), sview.stride(1), sview.stride(2),
           starts.stride(0) if starts.dim() == 2 else 0, LOG2E / math.sqrt(D), float(softcap or 1.0),
           int(sliding_window or 0), G, H, D, num_splits, PAGED=cache_mode == 1, QUANT=scale is not None,
           HAS_WINDOW=bool(sliding_window), SPLIT=split, MERGE=merge, EXACT=exact_dot(q.dtype), ALIBI=alibi is not None,
           SOFTCAP=bool(softcap), BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, PAGE=PAGE_SIZE, GROUP=QUANT_GROUP,
           num_warps=4, num_stages=3)
    if split and not merge:
        launch(_merge_splits_kernel, (B, H), part, out, H, D, num_splits, BLOCK_S=_pow2(num_splits),
               BLOCK_D=block_d, num_warps=1 if block_d <= 64 else 2)
    return out


@triton.jit
def _prefill_attn_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, starts_ptr, kvlens_ptr, out_ptr, slopes_ptr,
                         stride_qt, stride_qh, c_t, c_h, s_t, s_h, stride_sb, qk_scale, softcap, window, S, G, H, D,
                         PAGED: tl.constexpr, QUANT: tl.constexpr, HAS_WINDOW: tl.constexpr, EXACT: tl.constexpr,
                         ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr):
    """Program (blk, b, kvh): rows blk * BLOCK_M .. of the (token, query head of kvh) pairs of sequence b,
    row r = token r // G, head kvh * G + r % G; the tokens sit at positions kvlen - S ...; flash attention
    over the keys each may see (ALIBI: plus slope_head x (j - position) on each score)."""
    blk = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    kvh = tl.program_id(2).to(tl.int64)
    kvlen = tl.load(kvlens_ptr + b).to(tl.int32)
    p0 = kvlen - S                                                      # position of the first new token
    r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = r < S * G
    i = r // G
    pos = p0 + i
    heads = kvh * G + r % G
    tok = b * S + i
    d = tl.arange(0, BLOCK_D)
    qm = rm[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qm, other=0.0)
    ty = q_ptr.dtype.element_ty
    if ALIBI:  # each row's head's slope, in log2 units as the scores
        slope = tl.load(slopes_ptr + heads, mask=rm, other=0.0).to(tl.float32) * 1.4426950408889634
    hi = tl.minimum(p0 + (tl.minimum(blk * BLOCK_M + BLOCK_M, S * G) - 1) // G + 1, kvlen)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(p0 + (blk * BLOCK_M) // G - window + 1, 0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        inside = j < hi
        slot = _cache_rows(starts_ptr, b, j, inside, stride_sb, PAGED, PAGE)
        k = _kv_tile(k_ptr, ks_ptr, slot, kvh, inside, c_t, c_h, s_t, s_h, D, ty, QUANT, BLOCK_N, BLOCK_D, GROUP)
        v = _kv_tile(v_ptr, vs_ptr, slot, kvh, inside, c_t, c_h, s_t, s_h, D, ty, QUANT, BLOCK_N, BLOCK_D, GROUP)
        s = _scores(q, k, qk_scale, softcap, EXACT, SOFTCAP)
        if ALIBI:
            s += slope[:, None] * (j[None, :] - pos[:, None]).to(tl.float32)
        seen = inside[None, :] & (j[None, :] <= pos[:, None])
        if HAS_WINDOW:
            seen = seen & (j[None, :] > pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, ty, EXACT)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (tok[:, None] * H + heads[:, None]) * D + d[None, :], out.to(ty), mask=qm)


def prefill_blocks(head_dim: int, quantized: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps) of prefill attention. head_dim 256 (Gemma): 16 keys a step for 64 rows,
    or over an int8 cache (whose dequantised tiles are float32 a while) 32 rows on 4 warps; 64 x 32 spilled registers
    on sm_80 and sm_90 (runner.kernels.aot)."""
    block_d = max(16, _pow2(head_dim))
    if block_d <= 64:
        return 64, 64, block_d, 4
    if block_d <= 128:
        return 64, 64, block_d, 8
    return (32, 32, block_d, 4) if quantized else (64, 16, block_d, 8)


def prefill_attention(q: torch.Tensor, cache: torch.Tensor, scale: Optional[torch.Tensor], layout: int, layer: int,
                      cachestarts: torch.Tensor, kvlens: torch.Tensor, cache_mode: int, seqlen: int,
                      sliding_window: Optional[int] = None, launch: Launch = _launch,
                      mods: ScoreMods = ScoreMods()) -> torch.Tensor:
    """q [n * seqlen, H, D]: seqlen new tokens of each of n sequences (already in the cache, the last at
    kvlens[b] - 1), each attending causally over its keys in the cache (and within the sliding window; `mods`
    (reference.ScoreMods): ALiBi slopes, a soft cap). Returns [n * seqlen, H, D]
    in q's dtype: reference.attention_packed for these sequences."""
    T, H, D = q.shape
    alibi, softcap = mods.alibi, mods.softcap
    if q.stride(-1) != 1:
        raise ValueError("prefill_attention needs a contiguous head_dim")
    n = kvlens.shape[0]
    if n * seqlen != T:
        raise ValueError(f"prefill_attention: {T} query rows for {n} sequences of {seqlen} tokens")
    view = cache_view(cache, layout)[layer]
    KV = view.shape[2]
    G = H // KV
    block_m, block_n, block_d, warps = prefill_blocks(D, scale is not None)
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    sview = cache_view(scale, layout)[layer] if scale is not None else view
    starts = cachestarts.contiguous()
    launch(_prefill_attn_kernel, (triton.cdiv(seqlen * G, block_m), n, KV), q, view[0], view[1], sview[0], sview[1],
           starts, kvlens.contiguous(), out, _slopes(alibi, H, q), q.stride(0), q.stride(1), view.stride(1),
           view.stride(2), sview.stride(1), sview.stride(2), starts.stride(0) if starts.dim() == 2 else 0,
           LOG2E / math.sqrt(D), float(softcap or 1.0), int(sliding_window or 0), seqlen, G, H, D,
           PAGED=cache_mode == 1, QUANT=scale is not None, HAS_WINDOW=bool(sliding_window), EXACT=exact_dot(q.dtype),
           ALIBI=alibi is not None, SOFTCAP=bool(softcap), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
           PAGE=PAGE_SIZE, GROUP=QUANT_GROUP, num_warps=warps, num_stages=2)
    return out
