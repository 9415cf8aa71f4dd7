"""Reference operators in plain torch: the specification every fused kernel is tested against.

Shapes use T for packed tokens (all sequences of a step back to back), B for sequences, H / KV for
query / key-value heads of this rank, D for head_dim, L for layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

QUANT_GROUP = 8
PAGE_SIZE = 128


# --- normalisation ---------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 and cast back to x's dtype (as HF Llama)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def skip_rms_norm(x: torch.Tensor, skip: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
    """Residual add fused with RMSNorm: r = x + skip (or x); returns (rms_norm(r), r)."""
    r = x if skip is None else x + skip
    return rms_norm(r, weight, eps), r


# --- rotary embedding ------------------------------------------------------------------------
def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict] = None, max_position_embeddings: int = 0,
                  seq_len: int = 0) -> torch.Tensor:
    """inv_freq[j] = theta^(-2j/D), j < D/2, adjusted by the HF `rope_scaling` dict (`rope_type`):

    - linear: inv_freq / factor (positions are divided by factor).
    - dynamic (NTK): for a sequence of seq_len > max_position_embeddings (M) tokens the base becomes
      theta * (factor * seq_len / M - (factor - 1)) ^ (D / (D - 2)); unchanged up to M.
    - llama3: wavelengths above original_max / low_freq_factor are divided by factor, those below
      original_max / high_freq_factor are kept, and the band between is interpolated smoothly.
    - yarn: dims rotating fewer than beta_slow (1) times over original_max positions are interpolated
      (inv_freq / factor), those rotating more than beta_fast (32) times are kept, with a linear ramp
      between (correction range floored / ceiled unless truncate is false); cos and sin are also
      scaled by :func:`rope_attention_scale`.
    - longrope (Phi-3's "su"): inv_freq[j] / short_factor[j] for a sequence of seq_len <= original_max positions,
      / long_factor[j] beyond (:class:`Rotary` picks per sequence); cos and sin scaled by
      :func:`rope_attention_scale`.
    """
    ar = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    kind = rope_type(scaling)
    if kind == "dynamic":
        m = max_position_embeddings
        if not m:
            raise ValueError("dynamic rope scaling needs max_position_embeddings")
        seq_len = max(seq_len, m)
        theta = theta * ((float(scaling["factor"]) * seq_len / m) - (float(scaling["factor"]) - 1)) ** (
            head_dim / (head_dim - 2))
        return 1.0 / (theta ** ar)
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, max_position_embeddings)
    if kind == "longrope":
        long = seq_len > int(scaling["original_max_position_embeddings"])
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / float(scaling["factor"])).float()
    if kind == "llama3":
        factor, lo, hi = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()
    raise NotImplementedError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def _yarn_factor(scaling: dict, max_position_embeddings: int) -> float:
    factor = scaling.get("factor")
    return float(factor) if factor is not None else max_position_embeddings / float(
        scaling["original_max_position_embeddings"])


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict, max_position_embeddings: int) -> torch.Tensor:
    factor = _yarn_factor(scaling, max_position_embeddings)
    old = float(scaling.get("original_max_position_embeddings") or max_position_embeddings)
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations):  # the dim that turns `rotations` times over `old` positions
        return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_attention_scale(scaling: Optional[dict], max_position_embeddings: int = 0) -> float:
    """The factor cos and sin are multiplied by: 1, except for yarn: attention_factor, or
    0.1 ln(factor) + 1 (with mscale / mscale_all_dim: the ratio of those two such terms); and for longrope:
    attention_factor, or sqrt(1 + ln(factor) / ln(original_max)) for factor (max_position_embeddings / original_max
    where not given) > 1."""
    kind = rope_type(scaling)
    if kind == "longrope":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        old = int(scaling["original_max_position_embeddings"])
        factor = float(scaling.get("factor") or max_position_embeddings / old)
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
    if kind != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_position_embeddings)

    def mscale(m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(m) / mscale(m_all)) if m and m_all else mscale()


def rope_type(scaling: Optional[dict]) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0):
    """cos, sin of positions[T] x inv_freq[D/2] (times `scale`) -> two [T, D/2] float32 tensors."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    if scale == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * scale, freqs.sin() * scale


ROTARY_TABLE_POSITIONS = 8192  # cos/sin kept in tables for the positions below this (and max_position_embeddings)


class Rotary:
    """The rotary tables of one rope: cos/sin for the positions of a step.

    Static kinds precompute inv_freq once, and cos/sin of the first positions (below ROTARY_TABLE_POSITIONS and
    max_position_embeddings) in host tables that a step's plan indexes; a step with a position past them computes
    its cos/sin. Dynamic NTK recomputes inv_freq from the step's longest sequence (max position + 1) once that
    passes max_position_embeddings, as transformers does in each forward call of a growing sequence (below it,
    inv_freq and so the tables are the static ones). LongRoPE takes the long factors for the tokens of a sequence
    that reaches past original_max_position_embeddings in the step (its `seq_end`), the short ones otherwise, as
    transformers switches per forward call: a decoding token at position p is long from p + 1 > original_max on
    (the tables' rows from original_max on are the long ones), a prompt longer than that is long from its first
    token.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict], max_position_embeddings: int,
                 device: torch.device):
        """`head_dim`: the dims rotated (the rotary dims of a partial rotary; 0: none, the tables are [n, 0])."""
        self.head_dim, self.theta, self.scaling, self.max_pos = head_dim, theta, scaling, max_position_embeddings
        self.dynamic = rope_type(scaling) == "dynamic" and head_dim > 0
        self.inv_freq = (rope_inv_freq(head_dim, theta, scaling, max_position_embeddings) if head_dim
                         else torch.zeros(0)).to(device)
        self.long_from: Optional[int] = None   # longrope: sequences longer than this take long_inv_freq
        self.long_inv_freq: Optional[torch.Tensor] = None
        if rope_type(scaling) == "longrope" and head_dim:
            self.long_from = int(scaling["original_max_position_embeddings"])
            self.long_inv_freq = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings,
                                               self.long_from + 1).to(device)
        self.scale = rope_attention_scale(scaling, max_position_embeddings)
        n = max(1, min(max_position_embeddings, ROTARY_TABLE_POSITIONS))
        self.cos_table, self.sin_table = self._at(torch.arange(n), torch.arange(n) + 1)  # [n, D/2]

    def _at(self, positions: torch.Tensor, seq_end: torch.Tensor, inv: Optional[torch.Tensor] = None):
        """cos, sin computed at `positions` of sequences that reach `seq_end` (each token's; longrope only)."""
        inv = (self.inv_freq if inv is None else inv).to(positions.device)
        if self.long_from is None:
            return rope_cos_sin(positions, inv, self.scale)
        long = (seq_end > self.long_from)[:, None]
        (cs, ss), (cl, sl) = (rope_cos_sin(positions, f.to(positions.device), self.scale)
                              for f in (inv, self.long_inv_freq))
        return torch.where(long, cl, cs), torch.where(long, sl, ss)

    def cos_sin(self, positions: torch.Tensor, end: Optional[int] = None, seq_end: Optional[torch.Tensor] = None):
        """cos, sin [T, D/2] float32 at `positions` [T] (on their device); `end`, where the caller knows it: one past
        the largest position (saves reading it from the tensor); `seq_end` [T]: one past the last position of each
        token's sequence in the step (None: each token's own position + 1, a decoding token's)."""
        if positions.numel() == 0:
            return rope_cos_sin(positions, self.inv_freq, self.scale)
        end = int(positions.max()) + 1 if end is None else end
        if self.long_from is not None and seq_end is not None and bool(
                ((positions < self.long_from) & (seq_end > self.long_from)).any()):
            return self._at(positions, seq_end)  # a prompt that passes original_max: long from its first token
        if end <= self.cos_table.shape[0] and positions.device.type == "cpu":
            return self.cos_table[positions], self.sin_table[positions]
        inv = self.inv_freq
        if self.dynamic and end > self.max_pos:
            inv = rope_inv_freq(self.head_dim, self.theta, self.scaling, self.max_pos, end)
        return self._at(positions, positions + 1, inv)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates interleaved pairs (x[2j], x[2j+1]) of x[T, heads, D] by angle positions x inv_freq[j], j < R/2 for
    cos, sin [T, R/2]: the first R dims of each head (all of them when R = D; a partial rotary, as ChatGLM's, when
    R < D); the other D - R dims pass through unchanged.

    (a, b) -> (a cos - b sin, a sin + b cos); this is ppl.pmx's layout, HF's rotate-half rows are
    permuted into it at conversion.
    """
    T, nh, D = x.shape
    R = 2 * cos.shape[-1]
    xf = x[..., :R].float().reshape(T, nh, R // 2, 2)  # (T, nh, R/2, 2)
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).view(T, nh, R).to(x.dtype)
    return rot if R == D else torch.cat((rot, x[..., R:]), dim=-1)


def logn_scale(positions: torch.Tensor, length: int) -> torch.Tensor:
    """Qwen's logn attention scaling (`use_logn_attn`): the factor [T] float32 a query at position p is multiplied
    by, log(p + 1) / log(length) where p + 1 > length, else 1."""
    n = positions.to(torch.float64) + 1
    return torch.where(n > length, torch.log(n) / math.log(length), torch.ones_like(n)).float()


# --- ALiBi -----------------------------------------------------------------------------------
def alibi_slopes(heads: int) -> list[float]:
    """The ALiBi slope of each head (Press et al.; Baichuan's `_get_interleave`): for a power of two n,
    s_h = 2^(-8 (h + 1) / n); otherwise the slopes of the power of two below n, then every other slope of twice
    that power until there are n."""
    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(heads).is_integer():
        return power_of_2(heads)
    below = 2 ** math.floor(math.log2(heads))
    return power_of_2(below) + alibi_slopes(2 * below)[0::2][: heads - below]


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, n_keys: int) -> torch.Tensor:
    """The ALiBi term of the scores, [B, H, S, N] float32: slope_h x (j - q_pos[b, s]) for key position j < n_keys
    (0 on the diagonal, negative for keys behind; softmax takes it as Baichuan's slope_h x j, which differs by a
    constant per query row)."""
    rel = torch.arange(n_keys, device=q_pos.device)[None, None, :] - q_pos[:, :, None]        # (B, S, N)
    return slopes.float()[None, :, None, None] * rel[:, None].float()


# --- feed forward ----------------------------------------------------------------------------
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, silu(g) = g * sigmoid(g)."""
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up with GELU's tanh form, gelu(g) = g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
    (transformers' gelu_pytorch_tanh)."""
    return F.gelu(gate, approximate="tanh") * up


def soft_cap(scores: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """cap * tanh(scores / cap) (Gemma 2's soft cap of attention scores and logits); scores unchanged without a cap."""
    return scores if not cap else torch.tanh(scores / cap) * cap


# --- KV cache --------------------------------------------------------------------------------
def quantize_int8(x: torch.Tensor, group: int = QUANT_GROUP):
    """Per-group symmetric int8: scale = max|x| / 127 over `group` consecutive values (floor 1e-5),
    q = clamp(round(x / scale), -127, 127). Returns (q int8 [..., D], scale float16 [..., D/group])."""
    g = x.float().unflatten(-1, (-1, group))  # (..., D/group, group)
    scale = (g.abs().amax(-1) / 127.0).clamp_min(1e-5)
    q = torch.round(g / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.flatten(-2), scale.to(torch.float16)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, group: int = QUANT_GROUP):
    """Inverse of :func:`quantize_int8`: q * scale, per group."""
    return (q.float().unflatten(-1, (-1, group)) * scale.float()[..., None]).flatten(-2).to(dtype)


def cache_shape(layout: int, layers: int, max_tokens: int, kv_heads: int, last: int) -> tuple:
    """ppl.pmx cache shapes: 0 (MaxT,L,2,H,Dh), 1 (L,MaxT,2,H,Dh), 2 (L,2,MaxT,H,Dh), 3 (L,2,H,MaxT,Dh).
    `last` is head_dim for the cache, head_dim / 8 for the scale."""
    return {0: (max_tokens, layers, 2, kv_heads, last), 1: (layers, max_tokens, 2, kv_heads, last),
            2: (layers, 2, max_tokens, kv_heads, last), 3: (layers, 2, kv_heads, max_tokens, last)}[layout]


def cache_view(cache: torch.Tensor, layout: int) -> torch.Tensor:
    """A (L, 2, MaxT, H, last) view of a cache (or scale) tensor of `layout`; writes go through."""
    perm = {0: (1, 2, 0, 3, 4), 1: (0, 2, 1, 3, 4), 2: (0, 1, 2, 3, 4), 3: (0, 1, 3, 2, 4)}[layout]
    return cache.permute(perm)


def token_slots(cachestarts: torch.Tensor, positions: torch.Tensor, batch_of_token: torch.Tensor,
                cache_mode: int, page_size: int = PAGE_SIZE) -> torch.Tensor:
    """Cache row (index into MaxT) of each token from its sequence's cachestarts and its position.

    cache_mode 0 (offset): cachestarts[B], row = cachestarts[b] + pos.
    cache_mode 1 (paged):  cachestarts[B, MaxP] page starts, row = cachestarts[b, pos // page] + pos % page.
    """
    if cache_mode == 0:
        return cachestarts[batch_of_token] + positions
    if cache_mode == 1:
        return cachestarts[batch_of_token, positions // page_size] + positions % page_size
    raise ValueError(f"cache_mode must be 0 or 1, got {cache_mode}")


def kv_store(cache: torch.Tensor, scale: Optional[torch.Tensor], layout: int, layer: int,
             k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Writes k, v [T, KV, D] into rows `slots` of layer `layer` (quantised when `scale` is given)."""
    view = cache_view(cache, layout)[layer]  # (2, MaxT, KV, D)
    kv = torch.stack((k, v))                  # (2, T, KV, D)
    if scale is not None:
        kv, s = quantize_int8(kv)
        cache_view(scale, layout)[layer][:, slots] = s.to(scale.dtype)
    view[:, slots] = kv.to(cache.dtype)


def kv_load(cache: torch.Tensor, scale: Optional[torch.Tensor], layout: int, layer: int,
            slots: torch.Tensor, dtype: torch.dtype):
    """Reads rows `slots` of layer `layer` -> k, v of shape slots.shape + (KV, D), dequantised to dtype."""
    kv = cache_view(cache, layout)[layer][:, slots]  # (2, *slots.shape, KV, D)
    if scale is not None:
        kv = dequantize_int8(kv, cache_view(scale, layout)[layer][:, slots], dtype)
    else:
        kv = kv.to(dtype)
    return kv[0], kv[1]


# --- attention -------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeSplits:
    """How a decode attention kernel (runner.kernels.triton_ops.decode_attention) cuts each history: `count` key
    splits per (sequence, KV head) (None: the kernel's choice for the batch and the device), merged by the last program
    of each (sequence, KV head) to finish where `tickets` is given (zeroed int32 of at least batch x KV heads, left
    zeroed), else by a merge kernel of their own."""
    count: Optional[int] = None
    tickets: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class ScoreMods:
    """What an attention kernel (runner.kernels.triton_ops' decode / prefill attention) does to its scores past
    q.k / sqrt(D): ALiBi's `alibi` slopes [H] float32 times the key's distance added (None: none), then a soft cap
    c tanh(s / c) (`softcap` c, 0: none; Gemma 2)."""
    alibi: Optional[torch.Tensor] = None
    softcap: float = 0.0


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention beside its weights, on one rank: what an attention op needs to know of it."""
    layer: int
    heads: int                   # this rank's query heads (H)
    kv_heads: int                # this rank's key-value heads (KV)
    head_dim: int
    sliding_window: int = 0      # a query sees only the last this many positions (0: all)
    alibi_heads: tuple = ()      # ALiBi: (the model's heads, this rank's first head), whose slopes bias the scores
    logn_scaling: int = 0        # Qwen's logn: queries past this position scaled by logn_scale (0: off)
    softcap: float = 0.0         # the scores soft-capped, cap * tanh(scores / cap) (0: not capped)

    def alibi_slopes(self) -> Optional[torch.Tensor]:
        """The slopes [H] float32 of this rank's heads, or None without ALiBi."""
        if not self.alibi_heads:
            return None
        total, first = self.alibi_heads
        return torch.tensor(alibi_slopes(total), dtype=torch.float32)[first: first + self.heads]


def attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqstarts: torch.Tensor,
                     kvstarts: torch.Tensor, start_pos: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                     sliding_window: Optional[int] = None, alibi: Optional[torch.Tensor] = None,
                     softcap: float = 0.0) -> torch.Tensor:
    """Multi-head attention over packed variable-length sequences, one sequence at a time (the spec).

    q [T, H, D] holds the new tokens of every sequence (seqstarts), k/v [Tkv, KV, D] every sequence's
    whole key/value history including the new tokens (kvstarts). Query i of sequence b sits at
    position start_pos[b] + i and sees key positions j <= that (causal; a decoding sequence sees its
    whole cache), and j > pos - sliding_window when a window is set. H / KV query heads share one
    KV head (GQA). An explicit additive attn_mask [T, Tkv] replaces the causal rule (the window still applies). With
    `softcap` the scores are soft-capped (:func:`soft_cap`) before the mask; with `alibi` (the slopes [H]),
    slope_h x (j - position) is added to head h's scores (:func:`alibi_bias`). Output [T, H, D].
    """
    H, KV, D = q.shape[1], k.shape[1], q.shape[2]
    out = torch.empty_like(q)
    for b in range(len(start_pos)):
        s0, s1, k0, k1 = int(seqstarts[b]), int(seqstarts[b + 1]), int(kvstarts[b]), int(kvstarts[b + 1])
        qb = q[s0:s1].transpose(0, 1).float()                                      # (H, S, D)
        kb = k[k0:k1].transpose(0, 1).float().repeat_interleave(H // KV, dim=0)    # (H, Skv, D)
        vb = v[k0:k1].transpose(0, 1).float().repeat_interleave(H // KV, dim=0)
        scores = soft_cap(qb @ kb.transpose(1, 2) / math.sqrt(D), softcap)          # (H, S, Skv)
        if alibi is not None:
            qpos = int(start_pos[b]) + torch.arange(s1 - s0, device=q.device)
            scores = scores + alibi_bias(alibi, qpos[None], k1 - k0)[0]
        qpos = int(start_pos[b]) + torch.arange(s1 - s0, device=q.device)[:, None]
        kpos = torch.arange(k1 - k0, device=q.device)[None, :]
        if attn_mask is not None and attn_mask.numel():
            scores = scores + attn_mask[s0:s1, k0:k1].float()
            allowed = torch.ones_like(kpos <= qpos)
        else:
            allowed = kpos <= qpos
        if sliding_window:
            allowed &= kpos > qpos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[s0:s1] = (scores.softmax(-1) @ vb).transpose(0, 1).to(q.dtype)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
           causal: bool, softcap: float = 0.0, bf16: bool = False, bf16_out: bool = False) -> torch.Tensor:
    """softmax(soft_cap(q k^T / sqrt(D)) + mask) v in float32, for q [B, H, S, D] and k, v [B, KV, N, D]: each group
    of H / KV query heads shares one KV head. mask [B, 1, S, N] bool (True: the key is seen), or an additive float
    mask [B, 1 or H, S, N] (-inf: not seen; e.g. an ALiBi bias); without a mask, `causal` lets query i see keys
    j <= i (S == N), else every key is seen. `softcap`: the scores' soft cap (:func:`soft_cap`; 0: none). `bf16`:
    an implementation may multiply q k and p v in bfloat16 (inputs rounded to nearest, float32 sums: within ~5e-3
    of the largest output here, the rounding's spread); this one computes in float32. `bf16_out`: an implementation
    may return bfloat16 (for a linear that rounds its input so); this one returns float32. Returns [B, H, S, D]."""
    H, KV, S, N = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    kf, vf = k.float().repeat_interleave(H // KV, dim=1), v.float().repeat_interleave(H // KV, dim=1)
    scores = soft_cap(q.float() @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1]), softcap)  # (B, H, S, N)
    if mask is None and causal:
        mask = torch.ones(S, N, dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.dtype != torch.bool:
        scores = scores + mask.float()
    elif mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ vf).to(q.dtype)
