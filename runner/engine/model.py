"""The transformer of a PMX model, one tensor-parallel rank of it, with ppl.pmx's dynamic-batching step.

Built from `pmx_params.json` alone (no family names): biases, GQA, q/k norms, rope settings and the
sliding window come from the params. Each rank holds its shard: heads H/N (KV heads KV/N, or one
replicated KV head), intermediate F/N, vocabulary V/N, embedding columns D/N.

A step is a plan made on the host (`runner.engine.plan`) and the device step `Transformer.step`,
which reads only the plan, the weights and the cache. The step where every sequence decodes one
token has static structure (shapes vary, control flow does not): on CPU it is one C++ call over the same kernels
(runner.engine.fused_decode) where the engine allows, else it runs under `torch.compile(fullgraph=True)`; on
CUDA with the Triton kernels it replays from CUDA graphs (one per batch bucket, runner.engine.graphs); every
other step runs eagerly through the same modules (at TP > 1 on CPU, sequence-parallel between the row-parallel
linears: SeqParallel).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FunctionType, MethodType
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from runner.engine.cache import KVCache, new_cache
from runner.engine.fused_decode import fused_decode
from runner.engine.graphs import DecodeGraphs
from runner.engine.plan import DecodeBuffers, StepPlan, make_plan, plan_from_inputs
from runner.errors import PmxError
from runner.kernels import reference as ref
from runner.kernels import torch_ops
from runner.kernels.linear import Linear
from runner.kernels.quant_linear import CPU_KERNEL_MAX_ROWS, cat_weights, make_linear, packed_args, pop_weight
from runner.parallel.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from runner.pmx.params import PmxParams, shard_file
from runner.pmx.quant import is_quant_tensor, quantize, scheme_of, tensor_dtype
from runner.pmx.schema import pmx_tensors
from runner.pmx.shard import shard_shape
from runner.pmx.store import SafetensorsReader


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs (the Demo.py switches of ppl.pmx, each with a real effect)."""
    fused_qkv: bool = True        # one GEMM for q, k and v (weights concatenated at load)
    fused_ffn_glu: bool = True    # one GEMM for gate and up (weights concatenated at load)
    fused_kvcache: bool = True    # attention reads K/V straight from the cache, batched over sequences;
                                  # False: materialise packed K/V (ppl.pmx KeyValueCache) and attend per sequence
    friendly_gqa: bool = False    # repeat K/V heads to the query heads before attention
    auto_causal: bool = True      # causal mask made by attention; False: an explicit attn_mask input is used
    quantized_cache: bool = False  # int8 KV cache, groups of 8, float16 scales
    cache_layout: int = 0         # 0..3, see runner.kernels.reference.cache_shape
    cache_mode: int = 0           # 0 offset, 1 paged (page size 128)
    prepack: bool = True          # CPU float32: weights repacked once for the CPU linear kernel (runner.kernels.linear)
    kernels: str = "auto"         # auto (Triton on CUDA, fast torch elsewhere), triton, torch, reference (the spec)
    compile: str = "auto"         # torch.compile the decode step: on, off, auto (on CPU for models of at least
                                  # COMPILE_MIN_PARAMS parameters per rank, where it pays for its compile time)
    cuda_graphs: bool = True      # CUDA with the Triton kernels: capture the decode step in a CUDA graph per batch
                                  # bucket and replay it (runner.engine.graphs); no effect elsewhere
    decode_linears: bool = True   # CUDA with the Triton kernels, float16 / bfloat16: one-row (batch-1 decode)
                                  # linears on triton_ops.decode_linear (the down projection fused with SwiGLU)
    fused_decode: bool = True     # CPU float32: a step where every sequence decodes one token runs as one C++ call
                                  # (runner.engine.fused_decode) where the model allows; False: the torch step
                                  # (compiled per --compile, or eager)
    seq_parallel: bool = True     # CPU float32, TP > 1 on shared memory: steps on the torch path keep the residual
                                  # stream cut by rows between the ranks (SeqParallel); the same bits either way

    def __post_init__(self):
        if self.cache_layout not in (0, 1, 2, 3):
            raise PmxError(f"--cache_layout must be 0, 1, 2 or 3, got {self.cache_layout}")
        if self.cache_mode not in (0, 1):
            raise PmxError(f"--cache_mode must be 0 (offset) or 1 (paged), got {self.cache_mode}")
        if self.kernels not in ("auto", "triton", "torch", "reference"):
            raise PmxError(f"--kernels must be auto, triton, torch or reference, got {self.kernels!r}")
        if self.compile not in ("auto", "on", "off"):
            raise PmxError(f"--compile must be auto, on or off, got {self.compile!r}")
        if not self.auto_causal and self.fused_kvcache:
            raise PmxError("--auto_causal False needs --fused_kvcache False (the explicit mask is applied by "
                           "the unfused attention)")


def load_shard(ckpt_dir: Path, rank: int, device: torch.device, dtype: torch.dtype,
               on_tensor=None) -> tuple[PmxParams, dict]:
    """Params and rank `rank`'s tensors, with strict checks: every expected tensor, no other, right shapes.
    `on_tensor(nbytes)`, when given, is called after each tensor is read (progress)."""
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
            weights[name] = rd.get(name).to(device=device, dtype=dtype)
        if on_tensor is not None:
            on_tensor(rd.nbytes(name))
    return params, weights


def random_shard(params: PmxParams, rank: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict:
    """Random weights in the shapes of rank `rank`'s shard (for benchmarks without a checkpoint): matrices
    N(0, 0.02^2), norms 1, biases 0, so activations stay in range as in a trained model."""
    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    out, scheme, fp = {}, scheme_of(params), params.replace(quantization=None)
    for name, full in pmx_tensors(fp).items():
        shape = shard_shape(fp, name, full)
        if "norm" in name:
            out[name] = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shape, dtype=dtype, device=device)
        elif scheme is not None and scheme.quantizes(name):  # a quantised model: this rank's part, quantised
            base = name[: -len(".weight")]
            out[f"{base}.qweight"], out[f"{base}.scale"] = quantize(torch.randn(shape, generator=g, device=device)
                                                                    * 0.02, scheme)
        else:
            out[name] = (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype)
    return out


COMPILE_MIN_PARAMS = 32_000_000  # below this a step is so short that compiling (~1 min here) never pays back


def pick_kernels(kind: str, device: torch.device):
    """The kernel module the engine calls (skip_rms_norm, apply_rotary, swiglu, kv_store, kv_load, attend and,
    for Triton, decode_attention): Triton's on CUDA, fast torch elsewhere, the reference when asked for."""
    if kind == "reference":
        return ref
    if kind == "torch" or (kind == "auto" and device.type != "cuda"):
        return torch_ops
    try:
        from runner.kernels import triton_ops
    except ImportError as e:
        raise PmxError(f"--kernels {kind} on {device.type} needs Triton ({e}); install it (pip install triton) or "
                       f"run with --kernels torch / reference") from None
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise PmxError("--kernels triton runs on CUDA devices (or on CPU under TRITON_INTERPRET=1, slowly)")
    return triton_ops


class SeqParallel:
    """Sequence parallelism between the row-parallel linears (as Megatron's, on the ranks' shared memory), for the
    steps of the torch path at TP > 1 on CPU: each rank keeps the residual stream of its own rows only
    (comm.SharedMemory.rows), and the all-reduce of a row-parallel linear's partial sums, the residual add and the
    next RMSNorm become one `reduce_norm`, whose output every rank's next linear reads in place. A rank moves about a
    third of the bytes of all-reduce + norm and norms 1/N of the rows; the logits are the same bits."""

    def __init__(self, shm, comm, ops):
        self.shm, self.comm, self.ops = shm, comm, ops

    def partial(self, lin, x: torch.Tensor) -> torch.Tensor:
        """x W_r^T of a row-parallel layer's linear `lin`: this rank's partial sum, written straight into its shared
        area where the kernel takes an output buffer (else reduce_norm copies it there)."""
        args, m = packed_args(lin), x.shape[0]
        if args is None or x.dim() != 2 or not self.shm.fits(m, lin.out_features):
            return lin(x)
        out = self.shm.partial(m, lin.out_features)
        torch.ops.pmx_cpu.linear_into_(x.contiguous(), *args, lin.out_features, CPU_KERNEL_MAX_ROWS, out)
        return out

    def norm(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
        """(rms_norm(sum of x + residual) of every row, this rank's rows of that residual); residual None: x is
        the embedding, whole on every rank."""
        if residual is None:
            y, r = self.ops.skip_rms_norm(x, None, weight, eps)
            return y, r[self.shm.rows(x.shape[0])].contiguous()
        with self.comm.guard("reduce_norm"):
            return self.shm.reduce_norm(x, residual, weight, eps), residual


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


class Attention(nn.Module):
    """Self-attention of one layer over the step's packed tokens, reading and writing the KV cache."""

    def __init__(self, layer: int, qkv: list, wo, q_norm, k_norm, heads: int, kv_heads: int, head_dim: int,
                 eps: float, sliding_window: Optional[int], options: EngineOptions, ops, rows_in_place: bool = False):
        super().__init__()
        self.layer, self.heads, self.kv_heads, self.head_dim = layer, heads, kv_heads, head_dim
        self.rows_in_place = rows_in_place  # decode reads the history rows in place (ops.decode_attention_rows)
        self.qkv, self.wo = nn.ModuleList(qkv), wo
        self.register_buffer("q_norm", q_norm, persistent=False)
        self.register_buffer("k_norm", k_norm, persistent=False)
        self.eps, self.window, self.options, self.ops = eps, sliding_window, options, ops

    def forward(self, x: torch.Tensor, plan: StepPlan, cache: KVCache, sp: Optional[SeqParallel] = None
                ) -> torch.Tensor:
        q, k, v = self._qkv_stored(x, plan, cache)                                # (T, H|KV|KV, D)
        if plan.packed is not None:
            out = self._packed(q, plan, cache)
        else:
            parts = []
            if plan.decode is not None:
                parts.append(self._decode(q[: plan.decode.batch], plan.decode, cache))
            for g in plan.prefill:
                rows = slice(g.row0, g.row0 + g.n * g.seqlen)
                parts.append(self._prefill(q[rows], k[rows], v[rows], g, cache))
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.wo(out, sp=sp)                                                # (T, hidden)

    def _qkv_stored(self, x, plan, cache):
        """q, k, v (T, H|KV|KV, D) of the new tokens, q and k rotated, k and v written to the cache."""
        if hasattr(self.ops, "rotary_kv_store"):  # one kernel rotates q, k in place and writes k, v to the cache
            q, k, v = self._qkv(x)
            self.ops.rotary_kv_store(q, k, v, plan.cos, plan.sin, cache.data, cache.scale, cache.layout, self.layer,
                                     plan.slots)
        else:
            q, k, v = self._qkv_rotated(x, plan)
            cache.store(self.layer, k, v, plan.slots)
        return q, k, v

    def _qkv(self, x):
        """q, k, v (T, H|KV|KV, D) before rotary: views of the fused GEMM's output where fused; q/k normed
        when the model has q/k norms."""
        T, H, KV, D = x.shape[0], self.heads, self.kv_heads, self.head_dim
        if len(self.qkv) == 1:
            q, k, v = self.qkv[0](x).split([H * D, KV * D, KV * D], dim=-1)
        else:
            q, k, v = (lin(x) for lin in self.qkv)
        q, k, v = q.view(T, H, D), k.view(T, KV, D), v.view(T, KV, D)
        if self.q_norm is not None:
            q, k = ref.rms_norm(q, self.q_norm, self.eps), ref.rms_norm(k, self.k_norm, self.eps)
        return q, k, v

    def _qkv_rotated(self, x, plan):
        T, H, KV, D = x.shape[0], self.heads, self.kv_heads, self.head_dim
        if len(self.qkv) == 1 and self.q_norm is None:  # q and k side by side: rotate both in one pass
            qkv = self.qkv[0](x)                                                  # (T, (H + 2 KV) D)
            qk = self.ops.apply_rotary(qkv[:, : (H + KV) * D].view(T, H + KV, D), plan.cos, plan.sin)
            return qk[:, :H], qk[:, H:], qkv[:, (H + KV) * D:].view(T, KV, D)
        q, k, v = self._qkv(x)
        return self.ops.apply_rotary(q, plan.cos, plan.sin), self.ops.apply_rotary(k, plan.cos, plan.sin), v

    def _repeat_kv(self, k, v, dim):
        if not self.options.friendly_gqa or self.heads == self.kv_heads:
            return k, v
        g = self.heads // self.kv_heads
        return k.repeat_interleave(g, dim=dim), v.repeat_interleave(g, dim=dim)

    def _decode(self, q, d, cache):
        """q (Bd, H, D): one token per sequence against its whole history in the cache."""
        Bd = q.shape[0]
        if hasattr(self.ops, "decode_attention"):  # a kernel that walks the cache itself
            out = self.ops.decode_attention(q, cache.data, cache.scale, cache.layout, self.layer, d.cachestarts,
                                            d.kvlens, self.options.cache_mode, self.window)
        elif self.rows_in_place and cache.data.dtype in self.ops.ROWS_IN_PLACE_CACHE_DTYPES:  # rows read in place
            if d.kv_slots is not None:                                            # from the plan's row table
                rows, page_size = d.kv_slots, 0
            else:                                                                 # from the offsets / page starts
                rows, page_size = d.cachestarts, ref.PAGE_SIZE if d.cachestarts.dim() == 2 else 0
            out = self.ops.decode_attention_rows(q, cache.data, cache.scale, cache.layout, self.layer, rows,
                                                 d.kvlens, self.window, page_size)
        elif d.kv_slots is None:
            raise PmxError(f"a {cache.data.dtype} cache needs the decode plan's cache rows (kv_slots); this plan "
                           f"was made for a cache the engine reads in place")
        else:
            k, v = cache.gather(self.layer, d.kv_slots, q.dtype)                  # (Bd, N, KV, D)
            k, v = self._repeat_kv(k.transpose(1, 2), v.transpose(1, 2), 1)       # (Bd, KV, N, D)
            out = self.ops.attend(q[:, :, None], k, v, d.mask, causal=False)      # (Bd, H, 1, D)
        return out.reshape(Bd, self.heads * self.head_dim)

    def _prefill(self, q, k, v, g, cache):
        """g.n sequences of g.seqlen new tokens: q, k, v (n S, heads, D)."""
        n, S, D = g.n, g.seqlen, self.head_dim
        if hasattr(self.ops, "prefill_attention") and not g.plain_causal:
            out = self.ops.prefill_attention(q, cache.data, cache.scale, cache.layout, self.layer, g.cachestarts,
                                             g.kvlens, self.options.cache_mode, S, self.window)   # over the cache
            return out.reshape(n * S, self.heads * D)
        if g.kv_slots is None:                                                    # a fresh prompt's own keys
            k, v = k.reshape(n, S, self.kv_heads, D), v.reshape(n, S, self.kv_heads, D)
        else:
            k, v = cache.gather(self.layer, g.kv_slots, q.dtype)                  # (n, N, KV, D)
        k, v = self._repeat_kv(k.transpose(1, 2), v.transpose(1, 2), 1)
        out = self.ops.attend(q.reshape(n, S, self.heads, D).transpose(1, 2), k, v, g.mask, causal=True)
        return out.transpose(1, 2).reshape(n * S, self.heads * D)                 # (n S, H D)

    def _packed(self, q, plan, cache):
        """ppl.pmx's unfused path: each sequence against its packed history (reference attention)."""
        p = plan.packed
        kh, vh = cache.gather(self.layer, p.kv_slots, q.dtype)                   # (Tkv, KV, D)
        kh, vh = self._repeat_kv(kh, vh, 1)
        out = ref.attention_packed(q, kh, vh, p.seqstarts, p.kvstarts, p.start_pos, p.attn_mask, self.window)
        return out.reshape(q.shape[0], self.heads * self.head_dim)


class FeedForward(nn.Module):
    """w2(silu(w1 x) * w3 x): gate and up in one GEMM when fused."""

    def __init__(self, gate_up: list, w2, ops):
        super().__init__()
        self.gate_up, self.w2, self.ops = nn.ModuleList(gate_up), w2, ops

    def forward(self, x: torch.Tensor, sp: Optional[SeqParallel] = None) -> torch.Tensor:
        w2 = self.w2 if sp is None else partial(self.w2, sp=sp)  # (sp: w2 is row-parallel; an expert's is plain)
        if len(self.gate_up) == 1:
            gate_up = self.gate_up[0](x)
            if getattr(self.w2, "takes_swiglu", None) is not None and self.w2.takes_swiglu(gate_up):
                return w2(gate_up, swiglu=True)  # SwiGLU computed as the down projection loads its input
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = (lin(x) for lin in self.gate_up)
        return w2(self.ops.swiglu(gate, up))


class MoE(nn.Module):
    """Mixtral's sparse MLP: softmax over the router logits, the top k experts per token with their
    probabilities renormalised to sum 1, sum_k p_k * expert_k(h). Each rank holds every expert's F/N
    slice, so the weighted partial sums are all-reduced once."""

    def __init__(self, router: torch.Tensor, experts: list, top_k: int, comm):
        super().__init__()
        self.register_buffer("router", router, persistent=False)
        self.experts, self.top_k, self.comm = nn.ModuleList(experts), top_k, comm

    def forward(self, h: torch.Tensor, sp: None = None) -> torch.Tensor:  # (a MoE model runs without SeqParallel)
        probs = F.linear(h, self.router).float().softmax(-1)                     # (T, E)
        weight, chosen = probs.topk(self.top_k, dim=-1)                           # (T, k)
        weight = (weight / weight.sum(-1, keepdim=True)).to(h.dtype)
        out = torch.zeros_like(h)
        for e in chosen.unique().tolist():
            tok, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, tok, self.experts[e](h[tok]) * weight[tok, slot, None])
        return self.comm.all_reduce_(out)


class Block(nn.Module):
    def __init__(self, attention_norm, attention, ffn_norm, feed_forward):
        super().__init__()
        self.attention_norm, self.attention = attention_norm, attention
        self.ffn_norm, self.feed_forward = ffn_norm, feed_forward

    def forward(self, x, residual, plan: StepPlan, cache: KVCache, sp: Optional[SeqParallel] = None):
        """(the MLP's output, the residual stream): with `sp`, partial sums the next norm reduces and this rank's
        rows of the residual."""
        h, residual = self.attention_norm(x, residual, sp)
        h, residual = self.ffn_norm(self.attention(h, plan, cache, sp), residual, sp)
        return self.feed_forward(h, sp), residual


class Transformer(nn.Module):
    """One rank of the model. `forward` is ppl.pmx's dynamic-batching step; `plan` + `step` its two halves.

    The engine takes ownership of `weights`: tensors are popped from the dict as they are placed, so
    fusing and prepacking never hold two copies of the whole model.
    """

    def __init__(self, params: PmxParams, weights: dict, comm, options: EngineOptions = EngineOptions()):
        super().__init__()
        p, o = params, options
        self.params, self.comm, self.options = p, comm, o
        n = p.num_shards
        if comm.world_size != n:
            raise PmxError(f"the model is split into {n} shards but {comm.world_size} ranks were started; "
                           f"launch with -np {n} (or split it for {comm.world_size})")
        self.heads, self.kv_heads, self.head_dim = p.num_heads // n, max(p.num_kv_heads // n, 1), p.head_dim
        if o.quantized_cache and p.head_dim % ref.QUANT_GROUP:
            raise PmxError(f"--quantized_cache needs head_dim divisible by {ref.QUANT_GROUP}; this model has "
                           f"head_dim={p.head_dim}")
        if p.sliding_window is not None and p.sliding_window <= 0:
            raise PmxError(f"sliding_window must be positive, got {p.sliding_window}")
        w = weights
        self.dtype = w["norm.weight"].dtype
        self.device = w["norm.weight"].device
        if p.num_experts and p.ffn_bias:
            raise PmxError("mixture-of-experts models with MLP biases are not supported")
        num_params = sum(t.numel() for t in w.values())
        self.ops = ops = pick_kernels(o.kernels, self.device)
        self._gathers = not hasattr(ops, "decode_attention")  # attention over gathered K/V (else kernels walk the cache)
        # decode attention reads the history in place from the plan's cachestarts (CPU kernel; prefill gathers)
        self._rows_in_place = rows_in_place = (hasattr(ops, "reads_rows_in_place")
                                               and ops.reads_rows_in_place(self.device, self.dtype))
        self.rotary = ref.Rotary(p.head_dim, p.rope_theta, p.rope_scaling, p.max_position_embeddings, self.device)
        self._decode_buffers = DecodeBuffers(self.rotary, o.cache_mode == 1, -(-p.max_position_embeddings
                                                                               // ref.PAGE_SIZE)) \
            if rows_in_place else None
        self.tok_embeddings = ParallelEmbedding(w.pop("tok_embeddings.weight"), p.hidden_dim, comm)
        column, row = partial(ColumnParallelLinear, comm=comm), partial(RowParallelLinear, comm=comm)
        scheme = scheme_of(p)
        weight = partial(pop_weight, w, scheme=scheme, kernels=o.kernels)  # float, or weight-only quantised

        def take(names, bias_on):
            """Pops the weights (and biases, when the model has them) of `names`."""
            return [weight(n) for n in names], [w.pop(f"{n}.bias") for n in names] if bias_on else None

        def linears(kind, ws, bs, fuse=True):
            """One GEMM over the concatenated weights `ws` when `fuse`, else one GEMM each."""
            parts = [(cat_weights(ws), torch.cat(bs) if bs else None)] if fuse and len(ws) > 1 else \
                list(zip(ws, bs or [None] * len(ws)))
            return [kind(wt, bt, prepack=o.prepack) for wt, bt in parts]

        layers = []
        for i in range(p.num_layers):
            a, m = f"layers.{i}.attention", f"layers.{i}.feed_forward"
            attention = Attention(
                i, linears(column, *take([f"{a}.wq", f"{a}.wk", f"{a}.wv"], p.qkv_bias), o.fused_qkv),
                linears(row, *take([f"{a}.wo"], p.o_bias))[0], w.pop(f"{a}.q_norm.weight", None),
                w.pop(f"{a}.k_norm.weight", None), self.heads, self.kv_heads, self.head_dim, p.norm_eps,
                p.sliding_window, o, ops, rows_in_place)
            if p.num_experts:  # each expert cut like a dense MLP; the MoE block all-reduces once, not per expert
                w1, w3, w2 = (weight(f"{m}.{x}") for x in ("w1", "w3", "w2"))  # [E, F/n, D], [E, D, F/n]
                ffn = MoE(w.pop(f"{m}.gate.weight"), [
                    FeedForward(linears(make_linear, [w1[e], w3[e]], None, o.fused_ffn_glu),
                                linears(make_linear, [w2[e]], None)[0], ops) for e in range(p.num_experts)],
                          p.num_experts_per_token, comm)
            else:
                ffn = FeedForward(linears(column, *take([f"{m}.w1", f"{m}.w3"], p.ffn_bias), o.fused_ffn_glu),
                                  linears(row, *take([f"{m}.w2"], p.ffn_bias))[0], ops)
            layers.append(Block(SkipRMSNorm(w.pop(f"layers.{i}.attention_norm.weight"), p.norm_eps, ops), attention,
                                SkipRMSNorm(w.pop(f"layers.{i}.ffn_norm.weight"), p.norm_eps, ops), ffn))
        self.layers = nn.ModuleList(layers)
        self.norm = SkipRMSNorm(w.pop("norm.weight"), p.norm_eps, ops)
        self.output = ColumnParallelLinear(weight("output"), None, comm, gather_output=True, prepack=o.prepack)
        if o.decode_linears and self.device.type == "cuda" and hasattr(ops, "decode_linear"):
            for m in self.modules():
                if isinstance(m, Linear) and m.kernel == "plain" and m.weight.dtype in (torch.float16, torch.bfloat16):
                    m.use_small_rows(ops.decode_linear, ops.DECODE_LINEAR_ROWS)
        self._fused = fused_decode(self)  # the decode step in one C++ call (CPU), or None
        self._sp = self._seq_parallel()
        self._compiled = self._compile_decode(num_params)
        # (B == 1, no row table, no mask, one page): the graphs compiled so far (size 1 specialises)
        self._compiled_variants = set()
        self._graphs = self._cuda_graphs()

    # -- cache ----------------------------------------------------------------------------------
    def new_cache(self, max_tokens: int):
        """Zeroed (kv_cache, kv_scale) for `max_tokens` rows in this engine's layout (scale None unless int8)."""
        return new_cache(self.options.cache_layout, self.params.num_layers, max_tokens, self.kv_heads, self.head_dim,
                         self.dtype, self.device, self.options.quantized_cache)

    # -- the step -------------------------------------------------------------------------------
    def plan(self, seqlens, start_pos, caches, num_decoding: int, attn_mask: Optional[torch.Tensor] = None
             ) -> StepPlan:
        """The host half of a step, from Python ints: see :func:`runner.engine.plan.make_plan`."""
        o = self.options
        return make_plan(seqlens, start_pos, caches, num_decoding, paged=o.cache_mode == 1, rotary=self.rotary,
                         device=self.device, sliding_window=self.params.sliding_window,
                         fused_kvcache=o.fused_kvcache, read_cache_in_prefill=o.quantized_cache,
                         gather_rows=self._gathers, attn_mask=attn_mask,
                         decode_rows=self._decode_rows(torch.int8 if o.quantized_cache else self.dtype))

    def step_inputs(self, tokens, seqlens, start_pos, caches, num_decoding: int,
                    attn_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, StepPlan]:
        """(token ids, plan) of a step for :meth:`step`, from Python ints. A step where every sequence decodes one
        token, on an engine that reads the history in place, is written into persistent buffers
        (runner.engine.plan.DecodeBuffers: no torch call on the host; with CUDA graphs, the bucket's input buffers:
        runner.engine.graphs.DecodeGraphs.stage); that plan holds until the next call."""
        if num_decoding == len(seqlens) and self.options.fused_kvcache:
            if self._graphs is not None:  # CUDA graphs: straight into the bucket's buffers (two copies)
                got = self._graphs.stage(tokens, start_pos, caches)
            elif self._decode_buffers is not None:
                got = self._decode_buffers.plan(tokens, start_pos, caches)
            else:
                got = None
            if got is not None:
                return got
        return (torch.tensor(tokens, dtype=torch.int64),
                self.plan(seqlens, start_pos, caches, num_decoding, attn_mask))

    def _decode_rows(self, cache_dtype: torch.dtype) -> bool:
        """Whether the decoding sequences' attention reads a row table (kv_slots) and masks from the plan."""
        return self._gathers and not (self._rows_in_place and cache_dtype in self.ops.ROWS_IN_PLACE_CACHE_DTYPES)

    @torch.inference_mode()
    def forward(self, token_ids, attn_mask, seqstarts, kvstarts, cachestarts, decoding_batches, start_pos,
                max_seqlen, max_kvlen, kv_cache, kv_scale=None) -> torch.Tensor:
        """One engine step over packed sequences; returns float32 logits [B, vocab] of each last token.

        token_ids [T] new tokens, seqstarts/kvstarts [B+1] prefix sums of new / total lengths,
        cachestarts [B] (offset) or [B, MaxP] (paged), start_pos [B] position of each sequence's first
        new token, decoding_batches: how many leading sequences decode one token, max_seqlen /
        max_kvlen: maxima of the lengths, kv_cache / kv_scale: the cache, updated in place.
        """
        o = self.options
        try:
            plan = plan_from_inputs(seqstarts, kvstarts, cachestarts, decoding_batches, start_pos,
                                    paged=o.cache_mode == 1, rotary=self.rotary, device=self.device,
                                    sliding_window=self.params.sliding_window, fused_kvcache=o.fused_kvcache,
                                    read_cache_in_prefill=o.quantized_cache, gather_rows=self._gathers,
                                    decode_rows=self._decode_rows(kv_cache.dtype),
                                    attn_mask=None if attn_mask is None else attn_mask.to(self.device))
        except ValueError as e:
            raise PmxError(f"bad step inputs: {e}") from None
        return self.step(token_ids, plan, kv_cache, kv_scale)

    @torch.inference_mode()
    def step(self, token_ids: torch.Tensor, plan: StepPlan, kv_cache: torch.Tensor,
             kv_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The device half: logits [B, vocab] float32 of each sequence's last token; the cache updated in place."""
        if self.options.quantized_cache != (kv_scale is not None):
            raise PmxError("kv_scale must be given exactly when the cache is quantised")
        tokens, cache = token_ids.to(self.device), KVCache(kv_cache, kv_scale, self.options.cache_layout, self.ops)
        if self._graphs is not None and plan.decode_only:
            logits = self._graphs(tokens, plan, cache)  # replays (captures on a bucket's first step) asynchronously
            if logits is not None:
                return logits
        if (self._fused is not None and plan.decode_only and plan.decode.kv_slots is None
                and cache.data.dtype == (torch.int8 if kv_scale is not None else torch.float32)):
            with self.comm.guard("decode step"):
                return self._fused(tokens, plan, cache)
        if self._compiled is not None and plan.decode_only:
            d = plan.decode
            variant = (d.batch == 1, d.kv_slots is None, d.mask is None,
                       d.cachestarts.dim() == 2 and d.cachestarts.shape[1] == 1)
            if variant not in self._compiled_variants:  # this call compiles a graph: no collective timeout on it
                _mark_dynamic(tokens, plan, cache)  # (marks matter to the compile only; the graph's guards then
                logits = self._compiled(tokens, plan, cache)  # take every size it was compiled for)
                self._compiled_variants.add(variant)
                return logits
            with self.comm.guard("decode step"):
                return self._compiled(tokens, plan, cache)
        sp = self._sp if self._sp is not None and self._sp.shm.fits(tokens.shape[0], self.params.hidden_dim) else None
        return self._run(tokens, plan, cache, sp)

    def _run(self, tokens: torch.Tensor, plan: StepPlan, cache: KVCache, sp: Optional[SeqParallel] = None
             ) -> torch.Tensor:
        x, residual = self.tok_embeddings(tokens), None                            # (T, hidden)
        for layer in self.layers:
            x, residual = layer(x, residual, plan, cache, sp)
        if sp is not None:  # the final norm reduces the last partial sums (every row, each rank its own)
            h, _ = self.norm(x, residual, sp)
            h = h if plan.last is None else h[plan.last]                           # (B, hidden)
        else:
            if plan.last is not None:
                x, residual = x[plan.last], residual[plan.last]                     # (B, hidden)
            h, _ = self.norm(x, residual)
        return self.output(h)[:, : self.params.vocab_size].float()

    def _seq_parallel(self) -> Optional[SeqParallel]:
        """Sequence parallelism for the torch path's steps (EngineOptions.seq_parallel), or None: it needs TP > 1 on
        the ranks' shared memory, float32 on CPU with the fast torch kernels, and row-parallel linears without
        biases (a bias is added once, after the all-reduce) in a dense model."""
        p, shm = self.params, getattr(self.comm, "shm", None)
        if (not self.options.seq_parallel or shm is None or self.comm.world_size == 1 or self.device.type != "cpu"
                or self.dtype != torch.float32 or self.ops is not torch_ops or p.o_bias or p.ffn_bias
                or p.num_experts):
            return None
        return SeqParallel(shm, self.comm, self.ops)

    def _cuda_graphs(self) -> Optional[DecodeGraphs]:
        """The CUDA graphs of the decode step, or None: they need CUDA, the Triton kernels (the decode attention
        kernel reads no history-length-shaped tensor), a dense model (MoE routes by value on the host) and a
        communicator whose collectives a graph can hold (NCCL, or one rank)."""
        o, p = self.options, self.params
        if (not o.cuda_graphs or self.device.type != "cuda" or not hasattr(self.ops, "decode_attention")
                or p.num_experts or not getattr(self.comm, "captures_cuda_graphs", False)):
            return None
        max_pages = -(-p.max_position_embeddings // ref.PAGE_SIZE) if o.cache_mode == 1 else None
        return DecodeGraphs(self._run, self.head_dim // 2, max_pages, self.device, self.rotary.cos_table,
                            self.rotary.sin_table)

    def _compile_decode(self, num_params: int):
        """torch.compile of the decode step, or None (see EngineOptions.compile)."""
        o = self.options
        if o.compile == "off" or (o.compile == "auto" and (self.device.type != "cpu" or self.params.num_experts
                                                           or num_params < COMPILE_MIN_PARAMS)):
            return None
        if self.params.num_experts:
            raise PmxError("--compile on: mixture-of-experts steps route tokens by value and do not compile; "
                           "use --compile off")
        # The dims that vary are marked in `step`. Guards: Dynamo would check ~1000 attributes of the module tree
        # on every call (0.5 ms a step, measured); they never change after load, so those guards are dropped and
        # only the inputs' (tokens, plan, cache) are kept. Dynamo keys its graphs by code object, so this engine
        # gets a code object of its own: another engine in the process (other constants, same shapes) can never
        # reuse its graphs. cpp_wrapper: the graph's ~110 kernel and op calls are made from C++, not Python
        # (another ~0.3 ms a step, measured; the same cold compile time).
        run = MethodType(FunctionType(Transformer._run.__code__.replace(), Transformer._run.__globals__, "_run",
                                      Transformer._run.__defaults__), self)
        compiled = torch.compile(run, fullgraph=True,
                                 options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                                          "cpp_wrapper": True})
        if o.compile == "on":
            return compiled

        def guarded(*args):  # auto: a machine that cannot compile (no C++ compiler, ...) runs eagerly
            try:
                return compiled(*args)
            except Exception as e:  # noqa: BLE001 - any compile failure falls back to the eager step
                if not _is_compile_error(e):
                    raise
                print(f"rank {self.comm.rank}: warning: torch.compile of the decode step failed, running it "
                      f"eagerly ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                      file=sys.stderr, flush=True)
                self._compiled = None
                return self._run(*args)
        return guarded


def _mark_dynamic(tokens: torch.Tensor, plan: StepPlan, cache: KVCache) -> None:
    """The dims of a decode step that vary from step to step (batch, history length, cache rows): one graph
    serves them all. The rest (heads, head_dim, layers) stay static, so the kernels are specialised to them."""
    mark, d = torch._dynamo.maybe_mark_dynamic, plan.decode
    for t in (tokens, plan.slots, plan.cos, plan.sin, d.cachestarts, d.kvlens):
        mark(t, 0)
    if d.kv_slots is not None:  # (None for kernels that walk the cache themselves)
        mark(d.kv_slots, 0)
        mark(d.kv_slots, 1)
    if d.cachestarts.dim() == 2:
        mark(d.cachestarts, 1)
    if d.mask is not None:
        mark(d.mask, 0)
        mark(d.mask, 3)
    for t in (cache.data, cache.scale):
        if t is not None:
            mark(t, cache.layout)  # layout k keeps its MaxT rows in dim k (reference.cache_shape)


def _is_compile_error(e: Exception) -> bool:
    mod = type(e).__module__ or ""
    return mod.startswith("torch._dynamo") or mod.startswith("torch._inductor") or "CppCompileError" in type(e).__name__
