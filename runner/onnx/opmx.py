"""One rank's model as ppl.pmx exports it: the opmx / opmx.dynamic_batching operators with ppl.pmx's names,
domains, inputs and attributes (ppl.pmx's torch_function/*.py and docs/operators/*.md), so pplnn could read it.

The graph takes ppl.pmx's dynamic-batching step inputs (named as the dump files: token_ids, attn_mask, seqstarts,
kvstarts, cachestarts, decoding_batches, start_pos, max_seqlen, max_kvlen, kv_cache, and kv_scale when the cache is
int8) and gives `logits[batch, vocab]` float32 of each sequence's last token. The collectives are implicit in the
parallel operators (ParallelEmbedding and a gathered ColumnParallelLinear all-gather, RowParallelLinear
all-reduces); the KV cache is written in place by the attention operators, not an output. Weights are initializers
named as ppl.pmx's modules name them (`layers.0.attention.wqkv.weight`, ...).

The graph is built from the params, the engine flags and the rank's shard, making the choices
runner/engine/model.py makes from the same params (biases, GQA, q/k norms, rope scaling, partial rotary, ALiBi, logn
scaling, the sliding window, weight-only quantised linears). Positions as ppl.pmx's model_zoo writes them: a partial
rotary (ChatGLM2/3) is RotaryPositionEmbedding's `rotary_dim` (the first dims of each head, interleaved pairs; 0:
the whole head); ALiBi (Baichuan-13B) is no RotaryPositionEmbedding and `is_alibi` 1 on the attention operators.
A quantised token embedding (`quantize_embedding`) is dequantised into a float initializer, as the engine dequantises
the rows it gathers (ppl.pmx's ParallelEmbedding has no quantised form).

What ppl.pmx's operators cannot say is added as attributes of ours, with neutral defaults, beside ppl.pmx's (pplnn
would ignore them, so a model that needs one runs right only here):
- `sliding_window` on the attention operators;
- `rope_scaling` (the HF dict as JSON) on RotaryPositionEmbedding for the llama3 and yarn rope types;
- `alibi_num_heads` and `alibi_head_offset` on the attention operators: whose slopes a rank's heads take. ppl.pmx
  derives the slopes from the operator's `num_heads`, the rank's head count, which is right at TP=1 only; this rank's
  heads are heads offset .. offset + num_heads - 1 of a model of alibi_num_heads (0: num_heads, ppl.pmx's reading);
- `logn_scaling` on the attention operators (Qwen's use_logn_attn, ppl.pmx's Qwen export leaves it out): L > 0
  scales the query at position p by log(p + 1) / log(L) where p + 1 > L (0: off).

A mixture-of-experts layer (Mixtral: `num_experts`, `num_experts_per_token`) is written as ppl.pmx's
model_zoo/mixtral writes it: the router `opmx::Linear` (`layers.{i}.feed_forward.gate.weight`, replicated) gives the
scores; `MoeSelect(X, scores) -> (X_expand_permute, expert_weights, invert_permutation, expert_offset)` picks each
token's top k experts and sorts the k copies of the tokens by expert; `MoeColumnParallelLinear(X, expert_offset, W)`
(the stacked experts, `feed_forward.wu.weight` [E, 2 F/N, D] = each expert's w1 rows then its w3 rows, or `w1` and
`w3` unfused), SwiGLU (or SiLU), `MoeRowParallelLinear(X, expert_offset, W)` (`feed_forward.w2.weight` [E, D, F/N],
all-reduced), and `MoeReduce(Y, expert_weights, invert_permutation)` the weighted sum back in token order. How this
sits beside the engine (runner.engine.model.MoE):
- the expert weights: the engine takes softmax over all experts' router logits, the top k, renormalised to sum 1;
  MoeSelect takes the top k logits and their softmax. The two are the same numbers (softmax over the chosen logits
  is the renormalised softmax), up to rounding; the engine has no flag for top-k weights left unrenormalised (HF's
  norm_topk_prob false), which MoeSelect could not say either;
- the collective: the engine all-reduces once, after the weighted sum [T, D]; MoeRowParallelLinear all-reduces its
  output, each token's k expert rows [T, k, D] (ppl.pmx's operator, kept as it is: k times the bytes, the same sum
  up to rounding);
- MoeSelect's outputs are in the order of ppl.pmx's symbolic() and docs/operators/MoeSelect.md (its forward's
  export-time placeholder returns them in another order); expert_weights are float, the other two int64;
- refused in one line: weight-only quantised experts (ppl.pmx has no quantised Moe*ParallelLinear; the int8 of its
  operators' type constraints is int8 activations) and MoE MLP biases (the engine runs neither).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from runner.config import EngineConfig
from runner.errors import PmxError
from runner.kernels.reference import PAGE_SIZE, QUANT_GROUP, cache_shape, rope_type
from runner.onnx.graph import Graph
from runner.pmx.params import PmxParams
from runner.pmx.quant import QuantScheme, dequantize, scheme_of

OPMX, DB = "opmx", "opmx.dynamic_batching"
OPSET = 11                       # ppl.pmx exports with opset 11
PPL_STANDARD_OPS = {"Split", "Slice", "Sub", "Gather", "Cast", "Constant"}  # the standard ops ppl.pmx's exports hold
STEP_INPUTS = ("token_ids", "attn_mask", "seqstarts", "kvstarts", "cachestarts", "decoding_batches", "start_pos",
               "max_seqlen", "max_kvlen", "kv_cache", "kv_scale")
ROPE_TYPES = {"default": "", "linear": "linear", "dynamic": "dynamic", "llama3": "llama3", "yarn": "yarn"}


@dataclass(frozen=True)
class RankShape:
    """One rank's sizes, as runner.engine.model.Transformer cuts them."""
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, p: PmxParams) -> "RankShape":
        n = p.num_shards
        return cls(p.num_heads // n, max(p.num_kv_heads // n, 1), p.head_dim)


def exportable(p: PmxParams) -> None:
    """Refuses, in one line, what this export cannot write."""
    if p.num_experts and p.quantization is not None:
        raise PmxError(f"a mixture-of-experts model with {p.quantization['method']} weights cannot be exported: "
                       f"ppl.pmx has no weight-only quantised MoeColumnParallelLinear / MoeRowParallelLinear (export "
                       f"the float model)")
    if p.num_experts and p.ffn_bias:
        raise PmxError("a mixture-of-experts model with MLP biases cannot be exported (the engine does not run one)")
    if rope_type(p.rope_scaling) not in ROPE_TYPES:
        raise PmxError(f"rope_scaling type {rope_type(p.rope_scaling)!r} cannot be exported")


def _woqu_weight(q: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The stored qweight as the W input of ppl.pmx's Woqu*ParallelLinear: int8 [N, K]; int4 the bytes of the
    column packing read as int32 [N, K/8] (int16 [N, K/4] or int8 [N, K/2] where K does not divide so)."""
    if scheme.method == "int8":
        return q
    for dt, per in ((torch.int32, 4), (torch.int16, 2)):
        if q.shape[-1] % per == 0:
            return q.contiguous().view(dt)
    return q.contiguous().view(torch.int8)


class OpmxExport:
    """Builds rank `rank`'s graph. `w` is the rank's shard (runner.engine.model.load_shard), consumed as it is
    placed."""

    def __init__(self, p: PmxParams, w: dict, config: EngineConfig, dtype: torch.dtype, rank: int = 0):
        exportable(p)
        self.p, self.w, self.c, self.dtype, self.rank = p, w, config, dtype, rank
        self.r = RankShape.of(p)
        self.scheme = scheme_of(p)
        self.g = Graph(f"pmx_rank", {"": OPSET, OPMX: 1, DB: 1})

    # -- weights ---------------------------------------------------------------------------------------------------
    def _pop(self, name: str) -> torch.Tensor:
        t = self.w.pop(name)
        return t if t.dtype in (torch.int8, torch.uint8) or name.endswith(".scale") else t.to(self.dtype)

    def _leaf(self, base: str) -> Optional[QuantScheme]:
        return None if self.scheme is None else self.scheme.for_tensor(f"{base}.weight")

    def _float_weight(self, base: str) -> torch.Tensor:
        """Weight `base` as a float tensor: a quantised one dequantised (the engine's values, element for element)."""
        leaf = self._leaf(base)
        if leaf is None:
            return self._pop(f"{base}.weight")
        return dequantize(self.w.pop(f"{base}.qweight"), self.w.pop(f"{base}.scale"), leaf.method, self.dtype,
                          self.w.pop(f"{base}.offset", None))

    def _linear_weights(self, names: list[str], onnx_name: str, bias: bool):
        """(weight or (qweight, scale, leaf scheme), bias or None) of `names` fused along the output rows, as
        initializers: the
        Woqu form where they share one scheme ppl.pmx's Woqu linears take (int8 per channel or in groups, symmetric
        int4), else float (dequantised: int4 with offsets, GGUF's Q4_1, or weights stored differently)."""
        leaves = {self._leaf(n) for n in names}
        leaf = leaves.pop() if len(leaves) == 1 else None
        if leaf is not None and not leaf.offset:
            q = torch.cat([self._pop(f"{n}.qweight") for n in names])
            s = torch.cat([self._pop(f"{n}.scale") for n in names])
            ws = (self.g.weight(f"{onnx_name}.qweight", _woqu_weight(q, leaf)),
                  self.g.weight(f"{onnx_name}.scale", s.float()), leaf)
        else:
            ws = self.g.weight(f"{onnx_name}.weight", torch.cat([self._float_weight(n) for n in names]))
        b = self.g.weight(f"{onnx_name}.bias", torch.cat([self._pop(f"{n}.bias") for n in names])) if bias else None
        return ws, b

    def _linear(self, x: str, names: list[str], onnx_name: str, bias: bool, row: bool, in_features: int,
                out_features: int, out: Optional[str] = None, gather: bool = False) -> str:
        """ColumnParallelLinear / RowParallelLinear, or their weight-only quantised Woqu* forms."""
        ws, b = self._linear_weights(names, onnx_name, bias)
        kind = "RowParallelLinear" if row else "ColumnParallelLinear"
        attrs = dict(in_features=in_features, out_features=out_features, bias_term=int(b is not None))
        attrs.update(input_is_parallel=1) if row else attrs.update(gather_output=int(gather))
        if isinstance(ws, tuple):
            *ws, s = ws
            attrs.update(quant_data_type=s.method, quant_method="weight_only", quant_axis=1, group_size=s.group_size,
                         has_zeropoint=0, float_zeropoint=0)
            inputs = [x, *ws] + ([self.g.const("zeropoint", [], np.float32), b] if b else [])
            kind = "Woqu" + kind
        else:
            inputs = [x, ws] + ([b] if b else [])
        return self.g.op(kind, inputs, [out or self.g.fresh(onnx_name)], domain=OPMX, **attrs)[0]

    def _embedding_weight(self) -> torch.Tensor:
        """The rank's embedding columns as a float tensor: a quantised embedding dequantised whole, element for
        element what the engine's row lookup (runner.kernels.quant_linear.quant_embedding) computes."""
        return self._float_weight("tok_embeddings")

    # -- the graph -------------------------------------------------------------------------------------------------
    def inputs(self) -> dict:
        p, c, r, g = self.p, self.c, self.r, self.g
        cache_dt = torch.int8 if c.quantized_cache else self.dtype
        names = {}
        for n, dt, shape in (("token_ids", torch.int64, ["total_seqlen"]), ("attn_mask", self.dtype, [0] if c.auto_causal else ["total_seqlen", "total_kvlen"]),
                             ("seqstarts", torch.int64, ["batch_1"]), ("kvstarts", torch.int64, ["batch_1"]),
                             ("cachestarts", torch.int64, ["batch", "max_pages"] if c.paged else ["batch"]),
                             ("decoding_batches", torch.int64, [1]), ("start_pos", torch.int64, ["batch"]),
                             ("max_seqlen", torch.int64, [1]), ("max_kvlen", torch.int64, [1]),
                             ("kv_cache", cache_dt, self._cache_dims(r.head_dim))):
            names[n] = g.input(n, dt, shape)
        if c.quantized_cache:
            names["kv_scale"] = g.input("kv_scale", torch.float16, self._cache_dims(r.head_dim // QUANT_GROUP))
        return names

    def _cache_dims(self, last: int) -> list:
        shape = list(cache_shape(self.c.cache_layout, self.p.num_layers, -1, self.r.kv_heads, last))
        shape[self.c.cache_layout] = "max_tokens"
        return shape

    def cache_attrs(self, layer: int) -> dict:
        c = self.c
        return dict(num_layer=self.p.num_layers, layer_idx=layer, quant_bit=8 if c.quantized_cache else 0,
                    quant_group=QUANT_GROUP if c.quantized_cache else 0, cache_mode=c.cache_mode,
                    cache_layout=c.cache_layout, page_size=PAGE_SIZE)

    def rope_attrs(self) -> dict:
        p = self.p
        kind = rope_type(p.rope_scaling)
        factor = float((p.rope_scaling or {}).get("factor") or 1.0)
        extra = json.dumps(p.rope_scaling, sort_keys=True) if kind in ("llama3", "yarn") else ""
        return dict(rotary_dim=0 if p.rotary_dims == p.head_dim else p.rotary_dims, theta=float(p.rope_theta),
                    bypass_key=0, max_position_embeddings=p.max_position_embeddings, scaling_type=ROPE_TYPES[kind],
                    scaling_factor=factor, rope_scaling=extra)

    def attention_attrs(self) -> dict:
        """The attention operators' position attributes: ppl.pmx's is_alibi, and ours (see the module docstring)."""
        p, alibi = self.p, self.p.position_embedding == "alibi"
        return dict(is_alibi=int(alibi), alibi_num_heads=p.num_heads if alibi else 0,
                    alibi_head_offset=self.rank * self.r.heads if alibi else 0, logn_scaling=p.logn_scaling or 0)

    def build(self):
        p, c, r, g = self.p, self.c, self.r, self.g
        self.inputs()
        D, hd = p.hidden_dim, r.head_dim
        h = g.op("ParallelEmbedding", ["token_ids", g.weight("tok_embeddings.weight", self._embedding_weight())],
                 ["embedding"], domain=OPMX, num_embeddings=p.vocab_size, embedding_dims=D, padding_idx=-1,
                 max_norm=0.0, norm_type=2.0)[0]
        skip = None
        for i in range(p.num_layers):
            pre = f"layers.{i}"
            norm, h = g.op("RMSNorm", [h, g.weight(f"{pre}.attention_norm.weight", self._pop(f"{pre}.attention_norm.weight"))]
                           + ([skip] if skip else []), [f"layer{i}_attention_norm", f"layer{i}_stream"], domain=OPMX,
                           axis=-1, eps=float(p.norm_eps), skip_term=1)
            attn = self.attention(i, norm)
            norm, h = g.op("RMSNorm", [h, g.weight(f"{pre}.ffn_norm.weight", self._pop(f"{pre}.ffn_norm.weight")), attn],
                           [f"layer{i}_ffn_norm", f"layer{i}_residual"], domain=OPMX, axis=-1, eps=float(p.norm_eps),
                           skip_term=1)
            skip = self.feed_forward(i, norm)
        last, _ = g.op("RMSNorm", [h, g.weight("norm.weight", self._pop("norm.weight")), skip], 2, domain=OPMX, axis=-1,
                       eps=float(p.norm_eps), skip_term=1)
        ends = g.op("Slice", ["seqstarts", g.const("one", [1]), g.const("end", [2 ** 62]), g.const("axis", [0])])[0]
        rows = g.op("Gather", [last, g.op("Sub", [ends, g.const("one", [1])])[0]], axis=0)[0]   # each last token
        V, Vp = p.vocab_size, p.padded("vocab_size")
        logits = self._linear(rows, ["output"], "output", False, False, D, Vp, gather=True)
        if Vp != V:  # the vocabulary was padded to divide among the ranks
            logits = g.op("Slice", [logits, g.const("zero", [0]), g.const("vocab", [V]), g.const("axis", [1])])[0]
        if self.dtype != torch.float32:
            logits = g.op("Cast", [logits], to=1)[0]
        self._rename(logits, "logits")
        g.output("logits", torch.float32, ["batch", "vocab_size"])
        if self.w:
            raise PmxError(f"tensors left unplaced by the export: {sorted(self.w)[:5]}")
        return g

    def _rename(self, old: str, new: str) -> None:
        """Names the value `old` (one node's output) `new`."""
        for node in self.g.nodes:
            for j, o in enumerate(node.output):
                if o == old:
                    node.output[j] = new

    def attention(self, i: int, norm: str) -> str:
        p, c, r, g = self.p, self.c, self.r, self.g
        H, KV, hd, D = r.heads, r.kv_heads, r.head_dim, p.hidden_dim
        a = f"layers.{i}.attention"
        full_q, full_kv = p.num_heads * hd, p.num_kv_heads * hd
        shape = g.const("shape", [0, -1, hd])
        if c.fused_qkv:
            qkv = self._linear(norm, [f"{a}.wq", f"{a}.wk", f"{a}.wv"], f"{a}.wqkv", p.qkv_bias, False, D,
                               full_q + 2 * full_kv)
            qkv = g.op("Reshape", [qkv, shape], 1, domain=OPMX)[0]                    # (T, H + 2 KV, hd)
            q, k, v = g.op("Split", [qkv], [f"layer{i}_q", f"layer{i}_k", f"layer{i}_v"], axis=-2, split=[H, KV, KV])
        else:
            q, k, v = (g.op("Reshape", [self._linear(norm, [f"{a}.{n}"], f"{a}.{n}", p.qkv_bias, False, D, rows), shape],
                            [f"layer{i}_{n[1]}"], domain=OPMX)[0]
                       for n, rows in (("wq", full_q), ("wk", full_kv), ("wv", full_kv)))
        if p.qk_norm:
            q = g.op("RMSNorm", [q, g.weight(f"{a}.q_norm.weight", self._pop(f"{a}.q_norm.weight"))], 1, domain=OPMX,
                     axis=-1, eps=float(p.norm_eps), skip_term=0)[0]
            k = g.op("RMSNorm", [k, g.weight(f"{a}.k_norm.weight", self._pop(f"{a}.k_norm.weight"))], 1, domain=OPMX,
                     axis=-1, eps=float(p.norm_eps), skip_term=0)[0]
        if p.position_embedding == "rotary":   # (ALiBi: positions enter the attention's scores)
            q, k = g.op("RotaryPositionEmbedding", [q, k, "seqstarts", "start_pos", "max_seqlen"], 2, domain=DB,
                        **self.rope_attrs())
        window = int(p.sliding_window or 0)
        heads = dict(num_heads=H, head_dim=hd, is_causal=int(c.auto_causal), **self.attention_attrs())
        if c.fused_kvcache:
            scale = "kv_scale" if c.quantized_cache else g.const("empty_scale", [], np.float32)
            out = g.op("MultiHeadCacheAttention", [q, k, v, "seqstarts", "kvstarts", "cachestarts", "start_pos",
                                                  "decoding_batches", "max_seqlen", "max_kvlen", "kv_cache", scale,
                                                  "attn_mask"], [f"layer{i}_attention"], domain=DB, **heads,
                       num_kv_heads=KV, **self.cache_attrs(i), sliding_window=window)[0]
        else:
            rep = H // KV if c.friendly_gqa else 1
            keys, values = g.op("KeyValueCache", [k, v, "seqstarts", "kvstarts", "cachestarts", "start_pos",
                                                  "max_seqlen", "max_kvlen", "kv_cache"]
                                + (["kv_scale"] if c.quantized_cache else []), 2, domain=DB, **self.cache_attrs(i),
                                num_repeat=rep)
            out = g.op("MultiHeadAttention", [q, keys, values, "seqstarts", "kvstarts", "decoding_batches",
                                              "max_seqlen", "max_kvlen", "attn_mask"], [f"layer{i}_attention"],
                       domain=DB, **heads, num_kv_heads=0 if c.friendly_gqa else KV, sliding_window=window)[0]
        out = g.op("Reshape", [out, g.const("shape", [0, -1])], 1, domain=OPMX)[0]   # (T, H hd)
        return self._linear(out, [f"{a}.wo"], f"{a}.wo", p.o_bias, True, full_q, D, out=f"layer{i}_o")

    def feed_forward(self, i: int, norm: str) -> str:
        if self.p.num_experts:
            return self.moe(i, norm)
        p, c, g = self.p, self.c, self.g
        m, D, F = f"layers.{i}.feed_forward", p.hidden_dim, p.padded("intermediate_dim")
        if c.fused_ffn_glu:
            x13 = self._linear(norm, [f"{m}.w1", f"{m}.w3"], f"{m}.wu", p.ffn_bias, False, D, 2 * F)
            act = g.op("SwiGLU", [x13], 1, domain=OPMX, beta=1.0)[0]
        else:
            x1 = self._linear(norm, [f"{m}.w1"], f"{m}.w1", p.ffn_bias, False, D, F)
            x3 = self._linear(norm, [f"{m}.w3"], f"{m}.w3", p.ffn_bias, False, D, F)
            act = g.op("SiLU", [x1, x3], 1, domain=OPMX)[0]
        return self._linear(act, [f"{m}.w2"], f"{m}.w2", p.ffn_bias, True, F, D, out=f"layer{i}_ffn")

    def moe(self, i: int, norm: str) -> str:
        """ppl.pmx's MoeFeedForward: router Linear, MoeSelect, the experts' Moe*ParallelLinear, MoeReduce."""
        p, c, g = self.p, self.c, self.g
        m, D, F = f"layers.{i}.feed_forward", p.hidden_dim, p.padded("intermediate_dim")
        E, k = p.num_experts, p.num_experts_per_token
        scores = g.op("Linear", [norm, g.weight(f"{m}.gate.weight", self._pop(f"{m}.gate.weight"))],
                      [f"layer{i}_ffn_gate_score"], domain=OPMX, in_features=D, out_features=E, bias_term=0)[0]
        x, weights, inverse, offset = g.op(
            "MoeSelect", [norm, scores], [f"layer{i}_ffn_moe_{n}" for n in ("expanded_x", "expert_weights", "inv_perm",
                                                                           "expert_offset")],
            domain=OPMX, num_experts=E, num_experts_per_token=k)                   # (T, k, D) (T, k) (T, k) (E + 1)

        def experts(names: list[str], onnx_name: str, row: bool, inp: str, in_f: int, out_f: int) -> str:
            w = g.weight(f"{onnx_name}.weight", torch.cat([self._pop(f"{m}.{n}.weight") for n in names], dim=1))
            kind, par = ("MoeRowParallelLinear", dict(input_is_parallel=1)) if row else \
                ("MoeColumnParallelLinear", dict(gather_output=0))
            return g.op(kind, [inp, offset, w], [g.fresh(onnx_name)], domain=OPMX, num_experts=E, in_features=in_f,
                        out_features=out_f, bias_term=0, **par)[0]

        if c.fused_ffn_glu:   # each expert's w1 rows then its w3 rows: [E, 2 F/N, D]
            act = g.op("SwiGLU", [experts(["w1", "w3"], f"{m}.wu", False, x, D, 2 * F)], 1, domain=OPMX, beta=1.0)[0]
        else:
            act = g.op("SiLU", [experts(["w1"], f"{m}.w1", False, x, D, F), experts(["w3"], f"{m}.w3", False, x, D, F)],
                       1, domain=OPMX)[0]                                          # (T, k, F/N)
        y = experts(["w2"], f"{m}.w2", True, act, F, D)                            # (T, k, D), all-reduced
        return g.op("MoeReduce", [y, weights, inverse], [f"layer{i}_ffn"], domain=OPMX, num_experts_per_token=k)[0]
