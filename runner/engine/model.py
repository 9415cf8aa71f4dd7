"""The transformer of a PMX model, one tensor-parallel rank of it: the modules and their forward, nothing else.

Built from `pmx_params.json` alone (no family names): biases, GQA, q/k norms, rope settings, each layer's kind
(full attention or a sliding window, with a rope of its own), the norms' offset and the post norms, the embedding
and attention scales, the soft caps, the MLP's activation and experts come from the params. Each rank holds its
shard: heads H/N (KV heads KV/N, or one replicated KV head), intermediate F/N, vocabulary V/N, embedding columns
D/N. `forward(tokens, plan, cache)` reads only the step's plan (runner.engine.plan), the weights and the cache; how
a step is run (eagerly, compiled, as one C++ call, from a CUDA graph) is runner.engine.runners' business.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from runner.config import EngineConfig
from runner.engine.cache import KVCache, new_cache
from runner.engine.plan import StepPlan
from runner.errors import PmxError
from runner.kernels import reference as ref
from runner.kernels.cpu_ext import bf16_k_pairs
from runner.kernels.linear import Linear, RotaryStore
from runner.kernels.quant_linear import QuantLinear, cat_weights, make_linear, pop_weight, stored_alike
from runner.kernels.sets import KernelSet, Layers, kernel_set
from runner.parallel.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, SeqParallel
from runner.pmx.params import PmxParams, shard_file
from runner.pmx.quant import is_matrix_weight, is_quant_tensor, quant_parts, quantize, scheme_of, tensor_dtype
from runner.pmx.schema import pmx_tensors
from runner.pmx.shard import shard_shape
from runner.pmx.store import SafetensorsReader


def load_shard(ckpt_dir: Path, rank: int, device: torch.device, dtype: torch.dtype,
               on_tensor=None, matrix_dtype: Optional[torch.dtype] = None) -> tuple[PmxParams, dict]:
    """Params and rank `rank`'s tensors, with strict checks: every expected tensor, no other, right shapes. Float
    tensors in `dtype`, the linear layers', output's and embedding's weights (quant.is_matrix_weight) in `matrix_dtype`
    where given. `on_tensor(nbytes)`, when given, is called after each tensor is read (progress)."""
    params = PmxParams.load(ckpt_dir)
    if params.num_shards <= rank:
        raise PmxError(f"{ckpt_dir}: holds {params.num_shards} shard(s), rank {rank} has none; split the model "
                       f"for this many ranks (scripts/Split.py --num_shards N)")
    rd = SafetensorsReader(Path(ckpt_dir) / shard_file(rank))
    expected = {n: shard_shape(params, n, s) for n, s in pmx_tensors(params).items()}
    missing, extra = sorted(set(expected) - set(rd.keys())), sorted(set(rd.keys()) - set(expected))
    if missing or extra:
        raise PmxError(f"{rd.path}: tensors do not match pmx_params.json: missing {missing[:5]}, "
                       f"unexpected {extra[:5]}")
    weights = {}
    for name, shape in expected.items():
        if rd.shape(name) != shape:
            raise PmxError(f"{rd.path}: tensor {name!r} has shape {list(rd.shape(name))}, expected {list(shape)}")
        if is_quant_tensor(name):  # quantised weights keep their stored dtypes
            if rd.dtype(name) != tensor_dtype(params, name, dtype):
                raise PmxError(f"{rd.path}: tensor {name!r} is {rd.dtype(name)}, expected "
                               f"{tensor_dtype(params, name, dtype)} for {params.quantization}")
            weights[name] = rd.get(name).to(device=device)
        else:
            weights[name] = rd.get(name).to(device=device, dtype=matrix_dtype if matrix_dtype is not None
                                            and is_matrix_weight(name) else dtype)
        if on_tensor is not None:
            on_tensor(rd.nbytes(name))
    return params, weights


def random_shard(params: PmxParams, rank: int, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 matrix_dtype: Optional[torch.dtype] = None) -> dict:
    """Random weights in the shapes of rank `rank`'s shard (for benchmarks without a checkpoint): matrices
    N(0, 0.02^2) (in `matrix_dtype` where given, as load_shard), norms 1, biases 0, so activations stay in range as in
    a trained model."""
    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    out, scheme, fp = {}, scheme_of(params), params.replace(quantization=None)
    for name, full in pmx_tensors(fp).items():
        shape = shard_shape(fp, name, full)
        if "norm" in name:
            out[name] = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shape, dtype=dtype, device=device)
        elif scheme is not None and scheme.quantizes(name):  # a quantised model: this rank's part, quantised
            base, leaf = name[: -len(".weight")], scheme.for_tensor(name)
            parts = quantize(torch.randn(shape, generator=g, device=device) * 0.02, leaf)
            out.update({f"{base}.{part}": t for part, t in zip(quant_parts(leaf), parts)})
        else:
            out[name] = (torch.randn(shape, generator=g, device=device) * 0.02).to(
                matrix_dtype if matrix_dtype is not None and is_matrix_weight(name) else dtype)
    return out


class SkipRMSNorm(nn.Module):
    """(norm(x + residual), x + residual): the residual add fused with RMSNorm; with `sp`, x holds the ranks'
    partial sums and the residual this rank's rows (SeqParallel.norm)."""

    def __init__(self, weight: torch.Tensor, eps: float, ops):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, sp: Optional[SeqParallel] = None):
        if sp is not None:
            return sp.norm(x, residual, self.weight, self.eps)
        return self.ops.skip_rms_norm(x, residual, self.weight, self.eps)


class RMSNorm(nn.Module):
    """rms_norm(x) * weight (the post norms: the attention's and the MLP's outputs, before the residual add)."""

    def __init__(self, weight: torch.Tensor, eps: float, ops):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


def bf16_products(linears) -> bool:
    """Whether these (column- or row-parallel, or plain) linears multiply in bfloat16: this project's kernel on
    bfloat16 blocks where the CPU has AVX512-BF16 (cpu_gemm.cpp)."""
    for m in linears:
        lin = getattr(m, "linear", m)
        packed = getattr(lin, "packed", None)
        if getattr(lin, "kernel", None) == "pmx" and packed is not None and packed.dtype == torch.bfloat16:
            return bf16_k_pairs()
    return False


class Attention(nn.Module):
    """Self-attention of one layer over the step's packed tokens, reading and writing the KV cache.

    Positions enter as rotary (q and k rotated on the plan's cos / sin of this layer's rope, `rope`: its index in the
    plan's ropes; their width says how many dims turn) or, where the spec has ALiBi heads, as ALiBi's bias
    slope_h x (j - i) on the scores; with the plan's `q_scale` (logn scaling) each query is scaled by its position's
    factor. The scores are q k / sqrt(head_dim) (`q_mult` != 1: the queries multiplied by it first, a model's own
    scale), soft-capped where the spec has a cap, and a sliding layer sees the last `window` positions. A traced step
    (plan.inputs: an export) rotates and attends with the kernel set's step ops, which read ppl.pmx's step inputs
    themselves."""

    def __init__(self, spec: ref.AttentionSpec, qkv: list, wo, q_norm, k_norm, eps: float,
                 rotary: Optional[ref.Rotary], rope: int, q_mult: float, config: EngineConfig, ops,
                 device: torch.device):
        super().__init__()
        self.spec, self.layer, self.heads, self.kv_heads, self.head_dim = (spec, spec.layer, spec.heads,
                                                                           spec.kv_heads, spec.head_dim)
        self.qkv, self.wo = nn.ModuleList(qkv), wo
        self.register_buffer("q_norm", q_norm, persistent=False)
        self.register_buffer("k_norm", k_norm, persistent=False)
        alibi = spec.alibi_slopes()
        self.register_buffer("alibi", None if alibi is None else alibi.to(device), persistent=False)     # (H,)
        self.eps, self.window, self.rotary, self.rope, self.ops = eps, spec.sliding_window or None, rotary, rope, ops
        self.q_mult, self.softcap = q_mult, spec.softcap
        # prefill's q k and p v may be bfloat16 products (attend's `bf16`) where the qkv linear's are
        self.bf16_products = bf16_products(self.qkv)
        self.friendly_gqa, self.cache_mode = config.friendly_gqa, config.cache_mode
        self.rotary_in_qkv = config.rotary_in_qkv and alibi is None and q_norm is None and len(qkv) == 1
        self.split_counts: Optional[torch.Tensor] = None   # decode attention's (the Transformer's, shared)

    @property
    def mods(self) -> ref.ScoreMods:
        """What the Triton attention kernels do to the scores: ALiBi's slopes, the soft cap."""
        return ref.ScoreMods(self.alibi, self.softcap)

    def forward(self, x: torch.Tensor, plan: StepPlan, cache: KVCache, sp: Optional[SeqParallel] = None,
                norm: Optional[tuple] = None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The attention output projected by wo; `norm` (weight, eps): x is the residual stream and the qkv linear
        normalises it, `residual`: added by wo (both where the linears' small-rows kernel takes x: runner.kernels.
        linear.SmallRows)."""
        if plan.inputs is not None:                                               # a traced step
            q, k, v = self._qkv(x)
            if self.alibi is None:
                q, k = self.ops.rotary_step(q, k, plan.inputs, self.rotary)
            if self.q_mult != 1.0:
                q = q * self.q_mult
            out = self.ops.cache_attention(q, k, v, plan.inputs, cache, self.spec)
            return self.wo(out.reshape(-1, self.heads * self.head_dim), sp=sp)
        q, k, v = self._qkv_stored(x, plan, cache, norm)                          # (T, H|KV|KV, D)
        if plan.q_scale is not None:                                              # logn scaling of the queries
            q = q * plan.q_scale[:, None, None].to(q.dtype)
        if self.q_mult != 1.0:                                                    # the model's own score scale
            q = q * self.q_mult
        if plan.packed is not None:
            out = self._packed(q, plan, cache)
        else:
            parts = []
            if plan.decode is not None:
                parts.append(self._decode(q[: plan.decode.batch], plan.decode, cache))
            # one prefill group's output may come in bfloat16 for a wo of bfloat16 dot products (not sp's partial sums)
            bf16_out = sp is None and not parts and len(plan.prefill) == 1 and getattr(self.wo, "dot_bf16", False)
            for g in plan.prefill:
                rows = slice(g.row0, g.row0 + g.n * g.seqlen)
                parts.append(self._prefill(q[rows], k[rows], v[rows], g, cache, bf16_out))
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
        if residual is not None:
            return self.wo(out, residual=residual)
        return self.wo(out, sp=sp)                                                # (T, hidden)

    def _qkv_stored(self, x, plan, cache, norm=None):
        """q, k, v (T, H|KV|KV, D) of the new tokens, q and k rotated, k and v written to the cache."""
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        if self.rotary_in_qkv and plan.q_scale is None and self.qkv[0].takes_rotary(x):  # the qkv linear's epilogue
            rot = RotaryStore(plan.cos[self.rope], plan.sin[self.rope], plan.slots, cache.data, cache.scale,
                              cache.layout, self.layer, H, KV, D)
            q, k, v = self.qkv[0](x, norm=norm, rotary=rot).split([H * D, KV * D, KV * D], dim=-1)
            return q.view(-1, H, D), k.view(-1, KV, D), v.view(-1, KV, D)
        if self.alibi is not None:  # no rotary: positions enter the scores
            q, k, v = self._qkv(x, norm)
            cache.store(self.layer, k, v, plan.slots)
        elif self.ops.rotary_kv_store is not None:  # one kernel rotates q, k in place and writes k, v to the cache
            q, k, v = self._qkv(x, norm)
            self.ops.rotary_kv_store(q, k, v, plan.cos[self.rope], plan.sin[self.rope], cache.data, cache.scale,
                                     cache.layout, self.layer, plan.slots)
        else:
            q, k, v = self._qkv_rotated(x, plan, norm)
            cache.store(self.layer, k, v, plan.slots)
        return q, k, v

    def _qkv(self, x, norm=None):
        """q, k, v (T, H|KV|KV, D) before rotary: views of the fused GEMM's output where fused; q/k normed
        when the model has q/k norms (`norm`: of x, by the linears)."""
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        kw = {} if norm is None else {"norm": norm}
        if len(self.qkv) == 1:
            q, k, v = self.qkv[0](x, **kw).split([H * D, KV * D, KV * D], dim=-1)
        else:
            q, k, v = (lin(x, **kw) for lin in self.qkv)
        q, k, v = q.view(-1, H, D), k.view(-1, KV, D), v.view(-1, KV, D)
        if self.q_norm is not None:
            q, k = self.ops.rms_norm(q, self.q_norm, self.eps), self.ops.rms_norm(k, self.k_norm, self.eps)
        return q, k, v

    def _qkv_rotated(self, x, plan, norm=None):
        T, H, KV, D = x.shape[0], self.heads, self.kv_heads, self.head_dim
        cos, sin = plan.cos[self.rope], plan.sin[self.rope]
        if len(self.qkv) == 1 and self.q_norm is None:  # q and k side by side: rotate both in one pass
            qkv = self.qkv[0](x) if norm is None else self.qkv[0](x, norm=norm)  # (T, (H + 2 KV) D)
            qk = self.ops.apply_rotary(qkv[:, : (H + KV) * D].view(T, H + KV, D), cos, sin)
            return qk[:, :H], qk[:, H:], qkv[:, (H + KV) * D:].view(T, KV, D)
        q, k, v = self._qkv(x, norm)
        return self.ops.apply_rotary(q, cos, sin), self.ops.apply_rotary(k, cos, sin), v

    def _repeat_kv(self, k, v, dim):
        if not self.friendly_gqa or self.heads == self.kv_heads:
            return k, v
        g = self.heads // self.kv_heads
        return k.repeat_interleave(g, dim=dim), v.repeat_interleave(g, dim=dim)

    def _decode(self, q, d, cache):
        """q (Bd, H, D): one token per sequence against its whole history in the cache."""
        Bd = q.shape[0]
        if self.ops.decode_attention is not None:  # a kernel that walks the cache itself
            kw = {} if self.split_counts is None else {"splits": ref.DecodeSplits(tickets=self.split_counts)}
            out = self.ops.decode_attention(q, cache.data, cache.scale, cache.layout, self.layer, d.cachestarts,
                                            d.kvlens, self.cache_mode, self.window, mods=self.mods, **kw)
        elif self.ops.decode_attention_rows is not None and d.kv_slots is None:  # rows read in place
            out = self.ops.decode_attention_rows(q, cache.data, cache.scale, cache.layout, self.layer, d.cachestarts,
                                                 d.kvlens, self.window,
                                                 ref.PAGE_SIZE if d.cachestarts.dim() == 2 else 0, alibi=self.alibi,
                                                 softcap=self.softcap)
        else:
            k, v = cache.gather(self.layer, d.kv_slots, q.dtype)                  # (Bd, N, KV, D)
            k, v = self._repeat_kv(k.transpose(1, 2), v.transpose(1, 2), 1)       # (Bd, KV, N, D)
            mask = self._with_alibi(d.masks[self.spec.sliding_window], (d.kvlens - 1)[:, None], k.shape[2], False)
            out = self.ops.attend(q[:, :, None], k, v, mask, causal=False, softcap=self.softcap)  # (Bd, H, 1, D)
        return out.reshape(Bd, self.heads * self.head_dim)

    def _prefill(self, q, k, v, g, cache, bf16_out: bool = False):
        """g.n sequences of g.seqlen new tokens: q, k, v (n S, heads, D); `bf16_out`: the output may be bfloat16."""
        n, S, D, window = g.n, g.seqlen, self.head_dim, self.spec.sliding_window
        if self.ops.prefill_attention is not None and not g.plain_for(window):
            out = self.ops.prefill_attention(q, cache.data, cache.scale, cache.layout, self.layer, g.cachestarts,
                                             g.kvlens, self.cache_mode, S, self.window, mods=self.mods)
            return out.reshape(n * S, self.heads * D)                              # (over the cache)
        if g.kv_slots is None:                                                    # a fresh prompt's own keys
            k, v = k.reshape(n, S, self.kv_heads, D), v.reshape(n, S, self.kv_heads, D)
        else:
            k, v = cache.gather(self.layer, g.kv_slots, q.dtype)                  # (n, N, KV, D)
        k, v = self._repeat_kv(k.transpose(1, 2), v.transpose(1, 2), 1)
        mask = g.masks[window]
        if self.alibi is not None:  # (the queries' positions: only ALiBi's bias needs them)
            mask = self._with_alibi(mask, g.kvlens[:, None] - S + torch.arange(S, device=q.device), k.shape[2], True)
        out = self.ops.attend(q.reshape(n, S, self.heads, D).transpose(1, 2), k, v, mask, causal=True,
                              softcap=self.softcap, bf16=self.bf16_products, bf16_out=bf16_out)
        return out.transpose(1, 2).reshape(n * S, self.heads * D)                 # (n S, H D)

    def _with_alibi(self, mask: Optional[torch.Tensor], q_pos: torch.Tensor, n_keys: int, causal: bool):
        """The mask `attend` takes: `mask` as it is without ALiBi; with it, the bias slope_h x (j - i) of queries at
        q_pos [B, S] over keys 0..n_keys-1 (-inf where `mask`, else the causal rule when `causal`, hides a key)."""
        if self.alibi is None:
            return mask
        bias = ref.alibi_bias(self.alibi, q_pos, n_keys)                          # (B, H, S, N) float32
        if mask is None and causal:
            mask = torch.arange(n_keys, device=q_pos.device)[None, None, None, :] <= q_pos[:, None, :, None]
        return bias if mask is None else bias.masked_fill(~mask, float("-inf"))

    def _packed(self, q, plan, cache):
        """ppl.pmx's unfused path: each sequence against its packed history (reference attention)."""
        p = plan.packed
        kh, vh = cache.gather(self.layer, p.kv_slots, q.dtype)                   # (Tkv, KV, D)
        kh, vh = self._repeat_kv(kh, vh, 1)
        out = ref.attention_packed(q, kh, vh, p.seqstarts, p.kvstarts, p.start_pos, p.attn_mask, self.window,
                                   self.alibi, self.softcap)
        return out.reshape(q.shape[0], self.heads * self.head_dim)


class FeedForward(nn.Module):
    """w2(act(w1 x) * w3 x), act silu (SwiGLU) or GELU's tanh form (GeGLU, `gelu`): gate and up in one GEMM when
    fused."""

    def __init__(self, gate_up: list, w2, ops, gelu: bool = False):
        super().__init__()
        self.gate_up, self.w2, self.ops, self.gelu = nn.ModuleList(gate_up), w2, ops, gelu
        self.glu, self.glu_packed = (ops.geglu, ops.geglu_packed) if gelu else (ops.swiglu, ops.swiglu_packed)

    def forward(self, x: torch.Tensor, sp: Optional[SeqParallel] = None, norm: Optional[tuple] = None,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`norm` (weight, eps): x is the residual stream, normalised by gate/up; `residual`: added by w2 (where their
        small-rows kernel takes x)."""
        w2 = self.w2 if sp is None else partial(self.w2, sp=sp)  # (sp: w2 is row-parallel; an expert's is plain)
        if residual is not None:
            w2 = partial(self.w2, residual=residual)
        kw = {} if norm is None else {"norm": norm}
        if len(self.gate_up) == 1:
            # SwiGLU as the gate | up projection stores its output (in bfloat16 where it takes bfloat16 dot
            # products: for a down projection that does too): the [rows, 2 F] output never goes through memory
            gu = self.gate_up[0]
            if not self.gelu and sp is None and getattr(gu, "takes_glu_out", None) is not None and \
                    gu.takes_glu_out(x) and (not getattr(gu, "dot_bf16", False) or getattr(self.w2, "dot_bf16", False)):
                return w2(gu(x, glu_out=True, **kw))
            gate_up = self.gate_up[0](x, **kw)
            # SwiGLU computed as the down projection loads its input (under sequence parallelism only where its
            # small-rows kernel runs: elsewhere the partial sum goes straight into sp's shared area, unfused)
            if not self.gelu and getattr(self.w2, "takes_swiglu", None) is not None and \
                    self.w2.takes_swiglu(gate_up) and (sp is None or self.w2.fuses(gate_up)):
                return w2(gate_up, swiglu=True)
            return w2(self.glu_packed(gate_up))
        gate, up = (lin(x, **kw) for lin in self.gate_up)
        return w2(self.glu(gate, up))


class MoE(nn.Module):
    """Mixtral's sparse MLP: softmax over the router logits, the top k experts per token with their
    probabilities renormalised to sum 1, sum_k p_k * expert_k(h). Each rank holds every expert's F/N
    slice, so the weighted partial sums are all-reduced once."""

    def __init__(self, router: torch.Tensor, experts: list, top_k: int, comm):
        super().__init__()
        self.register_buffer("router", router, persistent=False)
        self.experts, self.top_k, self.comm = nn.ModuleList(experts), top_k, comm

    @classmethod
    def build(cls, router: torch.Tensor, w1, w3, w2, top_k: int, comm, fused_glu: bool, prepack: bool, ops,
              names=()) -> "MoE":
        """Each expert cut like a dense MLP (w1, w3 [E, F/n, D], w2 [E, D, F/n]), a plain linear each (the block
        all-reduces once, not per expert)."""
        def linears(ws):
            if fused_glu and len(ws) > 1 and stored_alike(ws):
                return [make_linear(cat_weights(ws), None, prepack)]
            return [make_linear(wt, None, prepack) for wt in ws]
        return cls(router, [FeedForward(linears([w1[e], w3[e]]), linears([w2[e]])[0], ops)
                            for e in range(w1.shape[0])], top_k, comm)

    def forward(self, h: torch.Tensor, sp: None = None) -> torch.Tensor:  # (a MoE model runs without SeqParallel)
        probs = F.linear(h, self.router).float().softmax(-1)                     # (T, E)
        weight, chosen = probs.topk(self.top_k, dim=-1)                           # (T, k)
        weight = (weight / weight.sum(-1, keepdim=True)).to(h.dtype)
        out = torch.zeros_like(h)
        for e in chosen.unique().tolist():
            tok, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, tok, self.experts[e](h[tok]) * weight[tok, slot, None])
        return self.comm.all_reduce_(out)


def _unnamed(kind):
    """The engine's layer `kind`, built without the PMX names the export sets take."""
    def build(*args, names=(), **kwargs):
        return kind(*args, **kwargs)
    return build


ENGINE_LAYERS = Layers(column=_unnamed(ColumnParallelLinear), row=_unnamed(RowParallelLinear),
                       embedding=_unnamed(ParallelEmbedding), moe=MoE.build)


class Block(nn.Module):
    """One decoder layer: x + attention(norm(x)), then + mlp(norm(.)); with post norms (Gemma's sandwich) the
    attention's and the MLP's outputs are normed before their residual adds (nn.Identity where the model has none)."""

    def __init__(self, attention_norm, attention, ffn_norm, feed_forward,
                 post_attention_norm: Optional[nn.Module] = None, post_ffn_norm: Optional[nn.Module] = None):
        super().__init__()
        self.attention_norm, self.attention = attention_norm, attention
        self.ffn_norm, self.feed_forward = ffn_norm, feed_forward
        self.post_attention_norm = post_attention_norm or nn.Identity()
        self.post_ffn_norm = post_ffn_norm or nn.Identity()

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether the norms can run inside the linears after them for input x: every linear of the block takes x's
        rows on its small-rows kernel (runner.kernels.linear.SmallRows), the MLP is dense, no post norms (Gemma's)."""
        a, f = self.attention, self.feed_forward
        no_post = all(isinstance(n, nn.Identity) for n in (self.post_attention_norm, self.post_ffn_norm))
        return (no_post and isinstance(f, FeedForward) and all(getattr(m, "fuses", None) is not None and m.fuses(x)
                                                   for m in (*a.qkv, a.wo, *f.gate_up, f.w2)))

    def forward(self, x, residual, plan: StepPlan, cache: KVCache, sp: Optional[SeqParallel] = None,
                fused: bool = False):
        """(the MLP's output, the residual stream): with `sp`, partial sums the next norm reduces and this rank's
        rows of the residual. `fused` (residual None: x is the residual stream): the norms run inside the linears after
        them and wo and w2 add the residual; returns (the residual stream, None)."""
        if fused:
            n1, n2 = self.attention_norm, self.ffn_norm
            r = self.attention(x, plan, cache, norm=(n1.weight, n1.eps), residual=x)
            return self.feed_forward(r, norm=(n2.weight, n2.eps), residual=r), None
        h, residual = self.attention_norm(x, residual, sp)
        h, residual = self.ffn_norm(self.post_attention_norm(self.attention(h, plan, cache, sp)), residual, sp)
        return self.post_ffn_norm(self.feed_forward(h, sp)), residual


class Transformer(nn.Module):
    """One rank of the model: embedding, blocks, final norm, vocabulary projection.

    The model takes ownership of `weights`: tensors are popped from the dict as they are placed, so fusing and
    prepacking never hold two copies of the whole model.
    """

    def __init__(self, params: PmxParams, weights: dict, comm, config: EngineConfig = EngineConfig(),
                 ops: Optional[KernelSet] = None):
        """`ops`: the kernel set (default: config.kernels' for the weights' device and dtype; an export passes its
        own, runner.onnx.export)."""
        super().__init__()
        p, c = params, config
        self.params, self.comm, self.config = p, comm, c
        n = p.num_shards
        if comm.world_size != n:
            raise PmxError(f"the model is split into {n} shards but {comm.world_size} ranks were started; "
                           f"launch with -np {n} (or split it for {comm.world_size})")
        self.heads, self.kv_heads, self.head_dim = p.num_heads // n, max(p.num_kv_heads // n, 1), p.head_dim
        c.check_model(p.head_dim)
        if p.num_experts and p.ffn_bias:
            raise PmxError("mixture-of-experts models with MLP biases are not supported")
        w = weights
        self.dtype, self.device = w["norm.weight"].dtype, w["norm.weight"].device  # the compute dtype
        # the float matrices' (a CPU engine keeps a half-precision checkpoint's at their width)
        self.weight_dtype = next((t.dtype for n, t in w.items() if is_matrix_weight(n)), self.dtype)
        self.num_params = sum(t.numel() for t in w.values())
        self.ops = ops = ops or kernel_set(c.kernels, self.device, self.dtype)
        kinds = ops.layers or ENGINE_LAYERS
        ropes = [(p.rope_theta, p.rope_scaling)]  # (theta, scaling) of each rope the layers use, the full layers' first
        for i in range(p.num_layers):
            if p.layer_rope(i) not in ropes:
                ropes.append(p.layer_rope(i))
        self.rotaries = [ref.Rotary(p.rotary_dims, theta, scaling, p.max_position_embeddings, self.device)
                         for theta, scaling in ropes]
        self.rotary = self.rotaries[0]
        alibi = (p.num_heads, comm.rank * self.heads) if p.position_embedding == "alibi" else ()  # this rank's heads
        weight = partial(pop_weight, w, scheme=scheme_of(p), kernels=c.kernels)  # float, or weight-only quantised

        def norm(name: str) -> Optional[torch.Tensor]:
            """A norm's weight, popped: offset + w (Gemma's 1 + w), computed in float32."""
            t = w.pop(name, None)
            return t if t is None or not p.norm_offset else (t.float() + p.norm_offset).to(t.dtype)

        self.tok_embeddings = kinds.embedding(weight("tok_embeddings"), p.hidden_dim, comm, self.dtype,
                                              ops.quant_embedding, names=["tok_embeddings"])
        # (transformers multiplies by the scale rounded to the weights' dtype)
        self.embedding_scale = float(torch.tensor(p.embedding_scale, dtype=self.dtype))
        q_mult = 1.0 if p.attention_scale is None else p.attention_scale * p.head_dim ** 0.5

        def linears(kind, names, bias_on, fuse=True, **kw):
            """The layers of the weights (and biases, when the model has them) of `names`, popped: one GEMM over
            their concatenation when `fuse` (and they are stored alike), else one GEMM each."""
            ws, bs = [weight(n) for n in names], [w.pop(f"{n}.bias") for n in names] if bias_on else None
            if fuse and len(ws) > 1 and stored_alike(ws):
                return [kind(cat_weights(ws), torch.cat(bs) if bs else None, comm, prepack=c.prepack, names=names,
                             **kw)]
            return [kind(wt, bt, comm, prepack=c.prepack, names=[nm], **kw)
                    for wt, bt, nm in zip(ws, bs or [None] * len(ws), names)]

        layers = []
        for i in range(p.num_layers):
            a, m = f"layers.{i}.attention", f"layers.{i}.feed_forward"
            spec = ref.AttentionSpec(i, self.heads, self.kv_heads, self.head_dim, p.layer_window(i), alibi,
                                     p.logn_scaling or 0, p.attn_logit_softcapping or 0.0)
            rope = ropes.index(p.layer_rope(i))
            attention = Attention(
                spec, linears(kinds.column, [f"{a}.wq", f"{a}.wk", f"{a}.wv"], p.qkv_bias, c.fused_qkv),
                linears(kinds.row, [f"{a}.wo"], p.o_bias)[0], norm(f"{a}.q_norm.weight"), norm(f"{a}.k_norm.weight"),
                p.norm_eps, None if alibi else self.rotaries[rope], rope, q_mult, c, ops, self.device)
            if p.num_experts:  # the experts' weights stacked: [E, F/n, D], [E, D, F/n]
                ffn = kinds.moe(w.pop(f"{m}.gate.weight"), *(weight(f"{m}.{x}") for x in ("w1", "w3", "w2")),
                                p.num_experts_per_token, comm, c.fused_ffn_glu, c.prepack, ops,
                                names=[f"{m}.{x}" for x in ("gate", "w1", "w3", "w2")])
            else:
                ffn = FeedForward(linears(kinds.column, [f"{m}.w1", f"{m}.w3"], p.ffn_bias, c.fused_ffn_glu),
                                  linears(kinds.row, [f"{m}.w2"], p.ffn_bias)[0], ops,
                                  gelu=p.hidden_act == "gelu_pytorch_tanh")
            post = [RMSNorm(norm(f"layers.{i}.{n}.weight"), p.norm_eps, ops) if p.post_norms else None
                    for n in ("post_attention_norm", "post_ffn_norm")]
            layers.append(Block(SkipRMSNorm(norm(f"layers.{i}.attention_norm.weight"), p.norm_eps, ops), attention,
                                SkipRMSNorm(norm(f"layers.{i}.ffn_norm.weight"), p.norm_eps, ops), ffn, *post))
        self.layers = nn.ModuleList(layers)
        self.norm = SkipRMSNorm(norm("norm.weight"), p.norm_eps, ops)
        self.final_softcap = p.final_logit_softcapping
        self.output = linears(kinds.column, ["output"], False, gather_output=True)[0]
        if c.decode_linears and ops.decode_linear is not None and (self.device.type == "cuda" or ops.interpreted):
            gemv = partial(ops.decode_linear, pdl=True) if c.pdl else ops.decode_linear
            for mod in self.modules():
                if (isinstance(mod, Linear) and mod.kernel == "plain" and mod.weight.dtype in (torch.float16,
                                                                                             torch.bfloat16)) \
                        or (isinstance(mod, QuantLinear) and mod.takes_small_rows()):
                    mod.use_small_rows(gemv, ops.decode_linear_rows)
        # the norms inside the linears after them, for the steps whose rows every linear takes with its norm and
        # residual (SmallRows.fuses: CUDA's small-rows kernel; this project's CPU kernel on bf16 dot products)
        self.norm_in_linears = c.norm_in_linears
        if c.merge_in_attention and ops.decode_attention is not None:  # one ticket counter per (sequence, KV head)
            counts = torch.zeros(c.max_batch * self.kv_heads, dtype=torch.int32, device=self.device)
            for layer in self.layers:
                layer.attention.split_counts = counts

    def new_cache(self, max_tokens: int):
        """Zeroed (kv_cache, kv_scale) for `max_tokens` rows in this engine's layout (scale None unless int8)."""
        c = self.config
        return new_cache(c.cache_layout, self.params.num_layers, max_tokens, self.kv_heads, self.head_dim, self.dtype,
                         self.device, c.quantized_cache)

    def fuses_norms(self, x: torch.Tensor, plan: StepPlan, sp: Optional[SeqParallel]) -> bool:
        """Whether a step on input x runs its norms inside the linears (config.norm_in_linears: every linear takes x's
        rows on its small-rows kernel)."""
        return (self.norm_in_linears and sp is None and plan.inputs is None and getattr(self.output, "fuses", None)
                is not None and self.output.fuses(x) and all(layer.fuses(x) for layer in self.layers))

    def forward(self, tokens: torch.Tensor, plan: StepPlan, cache: KVCache, sp: Optional[SeqParallel] = None,
                fuse: bool = True) -> torch.Tensor:
        """float32 logits [rows, vocab] of the plan's wanted rows (each sequence's last token); the cache updated in
        place. With `sp`, the residual stream between the row-parallel layers is cut by rows (SeqParallel). `fuse`
        False: every module runs (per-layer hooks see each norm; no norms inside the linears)."""
        x, residual = self.tok_embeddings(tokens), None                            # (T, hidden)
        if self.embedding_scale != 1.0:
            x = x * self.embedding_scale
        fused = fuse and self.fuses_norms(x, plan, sp)
        for layer in self.layers:
            x, residual = layer(x, residual, plan, cache, sp, fused)
        if fused:                                                                   # x: the residual stream
            x = x if plan.last is None else x[plan.last]
            logits = self.output(x, norm=(self.norm.weight, self.norm.eps))[:, : self.params.vocab_size].float()
            return logits if self.final_softcap is None else ref.soft_cap(logits, self.final_softcap)
        if sp is not None:  # the final norm reduces the last partial sums (every row, each rank its own)
            h, _ = self.norm(x, residual, sp)
            h = h if plan.last is None else h[plan.last]                           # (B, hidden)
        else:
            if plan.last is not None:
                x, residual = x[plan.last], residual[plan.last]                     # (B, hidden)
            h, _ = self.norm(x, residual)
        logits = self.output(h)[:, : self.params.vocab_size].float()
        return logits if self.final_softcap is None else ref.soft_cap(logits, self.final_softcap)
