"""The transformer of a PMX model, one tensor-parallel rank of it, with ppl.pmx's dynamic-batching step.

Built from `pmx_params.json` alone (no family names): biases, GQA, q/k norms, rope settings and the
sliding window come from the params. Each rank holds its shard: heads H/N (KV heads KV/N, or one
replicated KV head), intermediate F/N, vocabulary V/N, embedding columns D/N.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from runner.errors import PmxError
from runner.kernels import reference as ref
from runner.kernels.linear import Linear
from runner.parallel.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from runner.pmx.params import PmxParams, shard_file
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
    prepack: bool = True          # CPU float32: weights reordered once for oneDNN (runner.kernels.linear)
    kernels: str = "auto"         # auto (Triton on CUDA, reference elsewhere), triton, reference

    def __post_init__(self):
        if self.cache_layout not in (0, 1, 2, 3):
            raise PmxError(f"--cache_layout must be 0, 1, 2 or 3, got {self.cache_layout}")
        if self.cache_mode not in (0, 1):
            raise PmxError(f"--cache_mode must be 0 (offset) or 1 (paged), got {self.cache_mode}")
        if self.kernels not in ("auto", "triton", "reference"):
            raise PmxError(f"--kernels must be auto, triton or reference, got {self.kernels!r}")
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
        weights[name] = rd.get(name).to(device=device, dtype=dtype)
        if on_tensor is not None:
            on_tensor(rd.nbytes(name))
    return params, weights


def random_shard(params: PmxParams, rank: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict:
    """Random weights in the shapes of rank `rank`'s shard (for benchmarks without a checkpoint): matrices
    N(0, 0.02^2), norms 1, biases 0, so activations stay in range as in a trained model."""
    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    out = {}
    for name, full in pmx_tensors(params).items():
        shape = shard_shape(params, name, full)
        if "norm" in name:
            out[name] = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shape, dtype=dtype, device=device)
        else:
            out[name] = (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype)
    return out


class DecodePlan(NamedTuple):
    """A step where every sequence decodes one token: attention runs straight on the cache."""
    cachestarts: torch.Tensor
    kvlens: torch.Tensor
    max_kvlen: int


def pick_kernels(kind: str, device: torch.device):
    """The module whose skip_rms_norm / apply_rotary / swiglu / kv_store the engine calls: Triton's fused
    kernels on CUDA (when Triton is installed), the torch reference elsewhere or when asked for."""
    if kind == "reference" or (kind == "auto" and device.type != "cuda"):
        return ref
    try:
        from runner.kernels import triton_ops
    except ImportError:
        if kind == "triton":
            raise PmxError("--kernels triton needs the triton package (pip install triton)") from None
        return ref
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise PmxError("--kernels triton runs on CUDA devices (or on CPU under TRITON_INTERPRET=1, slowly)")
    return triton_ops


class Transformer:
    """One rank of the model. `forward` is ppl.pmx's dynamic-batching step.

    The engine takes ownership of `weights`: tensors are popped from the dict as they are placed, so
    fusing and prepacking never hold two copies of the whole model.
    """

    def __init__(self, params: PmxParams, weights: dict, comm, options: EngineOptions = EngineOptions()):
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
        self.ops = pick_kernels(o.kernels, self.device)
        self._scratch = None  # reused K/V gather buffer (see _load_history)
        self.embed = ParallelEmbedding(w.pop("tok_embeddings.weight"), p.hidden_dim, comm)
        self.rotary = ref.Rotary(p.head_dim, p.rope_theta, p.rope_scaling, p.max_position_embeddings, self.device)

        column, row = partial(ColumnParallelLinear, comm=comm), partial(RowParallelLinear, comm=comm)

        def take(names, bias_on):
            """Pops the weights (and biases, when the model has them) of `names`."""
            return [w.pop(f"{n}.weight") for n in names], [w.pop(f"{n}.bias") for n in names] if bias_on else None

        def linears(kind, ws, bs, fuse=True):
            """One GEMM over the concatenated weights `ws` when `fuse`, else one GEMM each."""
            parts = [(torch.cat(ws), torch.cat(bs) if bs else None)] if fuse and len(ws) > 1 else \
                list(zip(ws, bs or [None] * len(ws)))
            return [kind(wt, bt, prepack=o.prepack) for wt, bt in parts]

        self.layers = []
        for i in range(p.num_layers):
            a, m = f"layers.{i}.attention", f"layers.{i}.feed_forward"
            layer = dict(
                attn_norm=w.pop(f"layers.{i}.attention_norm.weight"), ffn_norm=w.pop(f"layers.{i}.ffn_norm.weight"),
                q_norm=w.pop(f"{a}.q_norm.weight", None), k_norm=w.pop(f"{a}.k_norm.weight", None),
                qkv=linears(column, *take([f"{a}.wq", f"{a}.wk", f"{a}.wv"], p.qkv_bias), o.fused_qkv),
                wo=linears(row, *take([f"{a}.wo"], p.o_bias))[0],
            )
            if p.num_experts:  # each expert cut like a dense MLP; the MoE block all-reduces once, not per expert
                w1, w3, w2 = (w.pop(f"{m}.{x}.weight") for x in ("w1", "w3", "w2"))  # [E, F/n, D], [E, D, F/n]
                layer.update(router=w.pop(f"{m}.gate.weight"), experts=[
                    dict(gate_up=linears(Linear, [w1[e], w3[e]], None, o.fused_ffn_glu),
                         w2=linears(Linear, [w2[e]], None)[0]) for e in range(p.num_experts)])
            else:
                layer.update(gate_up=linears(column, *take([f"{m}.w1", f"{m}.w3"], p.ffn_bias), o.fused_ffn_glu),
                             w2=linears(row, *take([f"{m}.w2"], p.ffn_bias))[0])
            self.layers.append(layer)
        self.norm = w.pop("norm.weight")
        self.output = ColumnParallelLinear(w.pop("output.weight"), None, comm, gather_output=True, prepack=o.prepack)

    # -- cache ----------------------------------------------------------------------------------
    def new_cache(self, max_tokens: int):
        """Zeroed (kv_cache, kv_scale) for `max_tokens` rows in this engine's layout (scale None unless int8)."""
        p, o = self.params, self.options
        shape = ref.cache_shape(o.cache_layout, p.num_layers, max_tokens, self.kv_heads, self.head_dim)
        if not o.quantized_cache:
            return torch.zeros(shape, dtype=self.dtype, device=self.device), None
        sshape = ref.cache_shape(o.cache_layout, p.num_layers, max_tokens, self.kv_heads,
                                 self.head_dim // ref.QUANT_GROUP)
        return (torch.zeros(shape, dtype=torch.int8, device=self.device),
                torch.zeros(sshape, dtype=torch.float16, device=self.device))

    # -- the step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, token_ids, attn_mask, seqstarts, kvstarts, cachestarts, decoding_batches, start_pos,
                max_seqlen, max_kvlen, kv_cache, kv_scale=None) -> torch.Tensor:
        """One engine step over packed sequences; returns float32 logits [B, vocab] of each last token.

        token_ids [T] new tokens, seqstarts/kvstarts [B+1] prefix sums of new / total lengths,
        cachestarts [B] (offset) or [B, MaxP] (paged), start_pos [B] position of each sequence's first
        new token, decoding_batches: how many leading sequences decode one token, max_seqlen /
        max_kvlen: maxima of the lengths, kv_cache / kv_scale: the cache, updated in place.
        """
        p, o = self.params, self.options
        if self.options.quantized_cache != (kv_scale is not None):
            raise PmxError("kv_scale must be given exactly when the cache is quantised")
        dev = self.device
        seqstarts, kvstarts, start_pos, cachestarts = (t.to(dev) for t in
                                                       (seqstarts, kvstarts, start_pos, cachestarts))
        B, T = start_pos.shape[0], token_ids.shape[0]
        seqlens = seqstarts[1:] - seqstarts[:-1]
        kvlens = kvstarts[1:] - kvstarts[:-1]
        max_s, max_kv = int(max_seqlen), int(max_kvlen)
        bot = torch.repeat_interleave(torch.arange(B, device=dev), seqlens, output_size=T)  # batch of token
        offs = torch.arange(T, device=dev) - seqstarts[bot]
        positions = start_pos[bot] + offs
        slots = ref.token_slots(cachestarts, positions, bot, o.cache_mode)
        cos, sin = self.rotary.cos_sin(positions)
        if o.fused_kvcache and max_s == 1 and self.ops is not ref:  # every sequence decodes: the fused kernel
            plan = DecodePlan(cachestarts, kvlens, max_kv)
        elif o.fused_kvcache:  # what each sequence's padded query rows may see, and where its history lies
            kv_pos = torch.arange(max_kv, device=dev)[None, :].expand(B, max_kv)
            hist_slots = ref.token_slots(cachestarts, torch.minimum(kv_pos, (kvlens - 1)[:, None]),
                                         torch.arange(B, device=dev)[:, None].expand(B, max_kv), o.cache_mode)
            q_pos = start_pos[:, None] + torch.arange(max_s, device=dev)[None, :]             # (B, S)
            allowed = (kv_pos[:, None, :] <= q_pos[:, :, None]) & (kv_pos < kvlens[:, None])[:, None, :]
            if p.sliding_window:
                allowed &= kv_pos[:, None, :] > q_pos[:, :, None] - p.sliding_window
            allowed |= (torch.arange(max_s, device=dev)[None, :] >= seqlens[:, None])[:, :, None] & (kv_pos == 0)[:, None, :]
            plan = (hist_slots, allowed[:, None], bot * max_s + offs, B * max_s)               # mask (B,1,S,KV)
        else:
            kv_bot = torch.repeat_interleave(torch.arange(B, device=dev), kvlens, output_size=int(kvstarts[-1]))
            kv_positions = torch.arange(int(kvstarts[-1]), device=dev) - kvstarts[kv_bot]
            plan = ref.token_slots(cachestarts, kv_positions, kv_bot, o.cache_mode)
        x = self.embed(token_ids.to(dev))
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = self.ops.skip_rms_norm(x, residual, layer["attn_norm"], p.norm_eps)
            attn = self._attention(i, layer, h, cos, sin, slots, plan, kv_cache, kv_scale, attn_mask, seqstarts,
                                   kvstarts, start_pos)
            h, residual = self.ops.skip_rms_norm(layer["wo"](attn), residual, layer["ffn_norm"], p.norm_eps)
            x = self._moe(layer, h) if "experts" in layer else layer["w2"](self._glu(layer, h))
        last = seqstarts[1:] - 1
        h, _ = self.ops.skip_rms_norm(x[last], residual[last], self.norm, p.norm_eps)
        return self.output(h)[:, : p.vocab_size].float()

    def _load_history(self, kv_cache, kv_scale, i, slots, dtype):
        """k, v (B, S, KV, D) at cache rows `slots` (B, S) of layer i: `reference.kv_load`, except that a float
        cache in layouts 0-2 is gathered whole rows at a time into a buffer kept across steps and layers
        (a fresh multi-MB tensor per layer costs more in page faults than the copy itself)."""
        layout = self.options.cache_layout
        if kv_scale is not None or layout == 3 or kv_cache.dtype != dtype:
            return ref.kv_load(kv_cache, kv_scale, layout, i, slots, dtype)
        view = ref.cache_view(kv_cache, layout)[i]                              # (2, MaxT, KV, D)
        B, S = slots.shape
        n, row = B * S, view.shape[2] * view.shape[3]
        if self._scratch is None or self._scratch.numel() < 2 * n * row or self._scratch.dtype != dtype:
            self._scratch = torch.empty(2 * n * row, dtype=dtype, device=kv_cache.device)
        flat = slots.reshape(-1)
        if layout == 2:  # k rows and v rows each contiguous
            out = self._scratch[: 2 * n * row].view(2, n, row)
            for w in (0, 1):
                torch.index_select(view[w].flatten(1), 0, flat, out=out[w])
            k, v = out.view(2, B, S, *view.shape[2:]).unbind(0)
        else:  # layouts 0, 1: one token's k and v together form one contiguous row
            out = self._scratch[: 2 * n * row].view(n, 2 * row)
            torch.index_select(view.transpose(0, 1).flatten(1), 0, flat, out=out)
            k, v = out.view(B, S, 2, *view.shape[2:]).unbind(2)
        return k, v

    def _moe(self, layer, h):
        """Mixtral's sparse MLP: softmax over the router logits, the top k experts per token with their
        probabilities renormalised to sum 1, sum_k p_k * expert_k(h). Each rank holds every expert's
        F/N slice, so the weighted partial sums are all-reduced once."""
        probs = F.linear(h, layer["router"]).float().softmax(-1)                  # (T, E)
        weight, chosen = probs.topk(self.params.num_experts_per_token, dim=-1)    # (T, k)
        weight = (weight / weight.sum(-1, keepdim=True)).to(h.dtype)
        out = torch.zeros_like(h)
        for e in chosen.unique().tolist():
            tok, slot = (chosen == e).nonzero(as_tuple=True)
            expert = layer["experts"][e]
            out.index_add_(0, tok, expert["w2"](self._glu(expert, h[tok])) * weight[tok, slot, None])
        return self.comm.all_reduce_(out)

    def _glu(self, layer, h):
        if len(layer["gate_up"]) == 1:
            gate, up = layer["gate_up"][0](h).chunk(2, dim=-1)
        else:
            gate, up = (lin(h) for lin in layer["gate_up"])
        return self.ops.swiglu(gate, up)

    def _attention(self, i, layer, h, cos, sin, slots, plan, kv_cache, kv_scale, attn_mask, seqstarts, kvstarts,
                   start_pos):
        o, T, hd = self.options, h.shape[0], self.head_dim
        H, KV = self.heads, self.kv_heads
        if len(layer["qkv"]) == 1:
            q, k, v = layer["qkv"][0](h).split([H * hd, KV * hd, KV * hd], dim=-1)
        else:
            q, k, v = (lin(h) for lin in layer["qkv"])
        q, k, v = q.view(T, H, hd), k.view(T, KV, hd), v.view(T, KV, hd)
        if layer["q_norm"] is not None:
            q = ref.rms_norm(q, layer["q_norm"], self.params.norm_eps)
            k = ref.rms_norm(k, layer["k_norm"], self.params.norm_eps)
        q, k = self.ops.apply_rotary(q, cos, sin), self.ops.apply_rotary(k, cos, sin)
        self.ops.kv_store(kv_cache, kv_scale, o.cache_layout, i, k, v, slots)
        if not o.fused_kvcache:  # ppl.pmx KeyValueCache (packed history) + MultiHeadAttention
            kh, vh = ref.kv_load(kv_cache, kv_scale, o.cache_layout, i, plan, h.dtype)
            if o.friendly_gqa:
                kh, vh = kh.repeat_interleave(H // KV, dim=1), vh.repeat_interleave(H // KV, dim=1)
            out = ref.attention_packed(q, kh, vh, seqstarts, kvstarts, start_pos, attn_mask,
                                       self.params.sliding_window)
            return out.reshape(T, H * hd)
        if isinstance(plan, DecodePlan):  # q (B, H, D): one token per sequence
            out = self.ops.decode_attention(q, kv_cache, kv_scale, o.cache_layout, i, plan.cachestarts, plan.kvlens,
                                            o.cache_mode, self.params.sliding_window, plan.max_kvlen)
            return out.reshape(T, H * hd)
        hist_slots, mask, flat_idx, rows = plan
        kh, vh = self._load_history(kv_cache, kv_scale, i, hist_slots, h.dtype)             # (B, KVlen, KV, D)
        B = hist_slots.shape[0]
        qp = q.new_zeros(rows, H, hd)
        qp[flat_idx] = q
        qp = qp.view(B, rows // B, H, hd).transpose(1, 2)                                 # (B, H, S, D)
        kh, vh = kh.transpose(1, 2), vh.transpose(1, 2)                                   # (B, KV, KVlen, D)
        if o.friendly_gqa:
            kh, vh = kh.repeat_interleave(H // KV, dim=1), vh.repeat_interleave(H // KV, dim=1)
        out = F.scaled_dot_product_attention(qp, kh, vh, attn_mask=mask, enable_gqa=not o.friendly_gqa and H != KV)
        return out.transpose(1, 2).reshape(rows, H * hd)[flat_idx]                        # (T, H*D)
