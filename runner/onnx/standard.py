"""A one-rank model of standard ONNX operators only (`Export.py --opset standard`): a stock onnxruntime
InferenceSession runs it, with no custom operator.

Inputs are ppl.pmx's step inputs (token_ids, attn_mask, seqstarts, kvstarts, cachestarts, decoding_batches,
start_pos, max_seqlen, max_kvlen, kv_cache); outputs `logits[batch, vocab]` float32 of each sequence's last token
and `kv_cache_out`, the cache with the step's keys and values written (the cache is an explicit input and output:
standard operators cannot update an input in place). Everything is decomposed into opset-17 operators, which every
onnxruntime of the last years runs: RMSNorm as ReduceMean / Sqrt / Div, interleaved-pair rotary as Gather from
cos / sin tables by position and Mul / Sub / Add, the cache write as ScatterND, and attention as each token's
history gathered from the cache (Gather), MatMul by KV-head groups, a causal (and sliding-window) mask (Where) and
Softmax. (onnxruntime 1.32's opset-23 RMSNormalization / RotaryEmbedding / Attention would shorten the graph;
the decomposition keeps the model runnable by older runtimes and is what the tests measure.)

Supported: the float KV cache in layout 0 and offset mode (cache_mode 0), static rope kinds (default, linear,
llama3, yarn), a partial rotary (the first rotary_dim dims of each head, ChatGLM's), ALiBi (the slope x distance term
added to the scores, Baichuan-13B's), logn scaling of the queries (Qwen's: log(p + 1) / log(L) past position L,
computed in float64 in the graph), GQA, biases, q/k norms, the sliding window, float and weight-only quantised
checkpoints (the weights and the embedding dequantised into the graph). Refused in one line: more than one rank, an
int8 cache, other cache layouts or modes, dynamic NTK rope, MoE, and an explicit attn_mask (auto_causal false).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from onnx import TensorProto

from runner.config import EngineConfig
from runner.errors import PmxError
from runner.kernels.reference import Rotary, alibi_slopes, cache_shape, rope_type
from runner.onnx.graph import Graph
from runner.pmx.params import PmxParams
from runner.pmx.quant import dequantize, scheme_of

OPSET = 17


class StandardExport:
    def __init__(self, p: PmxParams, w: dict, config: EngineConfig, dtype: torch.dtype):
        c = config
        why = ("more than one rank" if p.num_shards != 1 else "--quantized_cache true" if c.quantized_cache else
               f"--cache_layout {c.cache_layout}" if c.cache_layout != 0 else "--cache_mode 1" if c.cache_mode else
               "--auto_causal false" if not c.auto_causal else "dynamic rope scaling" if rope_type(p.rope_scaling)
               == "dynamic" else "mixture-of-experts" if p.num_experts else
               f"--dtype {dtype}" if dtype != torch.float32 else None)
        if why:
            raise PmxError(f"--opset standard does not take {why} (it exports one rank, float32, a float cache in "
                           f"layout 0 and offset mode; use --opset opmx)")
        self.p, self.w, self.c = p, w, c
        self.scheme = scheme_of(p)
        self.g = Graph("pmx_standard", {"": OPSET})

    def _weight(self, name: str) -> torch.Tensor:
        """Float weight `name` (a `.weight`), dequantised where the checkpoint holds it quantised."""
        base = name[: -len(".weight")]
        leaf = None if self.scheme is None else self.scheme.for_tensor(name)
        if leaf is not None:
            return dequantize(self.w.pop(f"{base}.qweight"), self.w.pop(f"{base}.scale"), leaf.method,
                              offset=self.w.pop(f"{base}.offset", None))
        return self.w.pop(name).float()

    def _linear(self, x: str, base: str, bias: bool) -> str:
        g = self.g
        y = g.op("MatMul", [x, g.weight(f"{base}.weight_t", self._weight(f"{base}.weight").t().contiguous())])[0]
        return g.op("Add", [y, g.weight(f"{base}.bias", self.w.pop(f"{base}.bias").float())])[0] if bias else y

    def _norm(self, x: str, weight: torch.Tensor, name: str, out=None) -> str:
        g = self.g
        ms = g.op("ReduceMean", [g.op("Mul", [x, x])[0]], axes=[-1], keepdims=1)[0]
        rms = g.op("Sqrt", [g.op("Add", [ms, g.const("eps", [self.p.norm_eps], np.float32)])[0]])[0]
        y = g.op("Div", [x, rms])[0]
        return g.op("Mul", [y, g.weight(name, weight.float())], [out] if out else 1)[0]

    def _rotate(self, x: str, cos: str, sin: str, heads: int) -> str:
        """Interleaved pairs of the first R = rotary_dims dims of each head rotated; the other hd - R pass."""
        g, hd, R = self.g, self.p.head_dim, self.p.rotary_dims
        rot, rest = (x, None) if R == hd else g.op("Split", [x, g.const("parts", [R, hd - R])], 2, axis=2)
        pairs = g.op("Reshape", [rot, g.const("pairs", [0, heads, R // 2, 2])])[0]      # (T, h, R/2, 2)
        a, b = g.op("Split", [pairs, g.const("halves", [1, 1])], 2, axis=3)
        a, b = (g.op("Squeeze", [t, g.const("ax", [3])])[0] for t in (a, b))            # (T, h, R/2)
        ra = g.op("Sub", [g.op("Mul", [a, cos])[0], g.op("Mul", [b, sin])[0]])[0]
        rb = g.op("Add", [g.op("Mul", [a, sin])[0], g.op("Mul", [b, cos])[0]])[0]
        both = [g.op("Unsqueeze", [t, g.const("ax", [3])])[0] for t in (ra, rb)]
        out = g.op("Reshape", [g.op("Concat", both, axis=3)[0], g.const("heads", [0, heads, R])])[0]
        return out if rest is None else g.op("Concat", [out, rest], axis=2)[0]         # (T, h, hd)

    def _logn(self, pos: str) -> str:
        """Qwen's logn factor of each query (T, 1, 1): log(p + 1) / log(L) where p + 1 > L, else 1, in float64 as
        runner.kernels.reference.logn_scale computes it."""
        g, L = self.g, self.p.logn_scaling
        n = g.op("Add", [pos, g.const("one", 1)])[0]
        f = g.op("Div", [g.op("Log", [g.op("Cast", [n], to=TensorProto.DOUBLE)[0]])[0],
                         g.const("logL", math.log(L), np.float64)])[0]
        f = g.op("Where", [g.op("Greater", [n, g.const("L", L)])[0], f, g.const("one", 1.0, np.float64)])[0]
        return g.op("Unsqueeze", [g.op("Cast", [f], to=TensorProto.FLOAT)[0], g.const("ax", [1, 2])])[0]

    def _alibi(self, pcol: str, jj: str) -> str:
        """ALiBi's term of the scores (T, KV, G, N): slope_h x (j - position), heads h = kv G + g."""
        g, p = self.g, self.p
        rel = g.op("Cast", [g.op("Sub", [jj, pcol])[0]], to=TensorProto.FLOAT)[0]               # (T, N)
        rel = g.op("Unsqueeze", [rel, g.const("ax", [1, 2])])[0]                                 # (T, 1, 1, N)
        slopes = np.asarray(alibi_slopes(p.num_heads), np.float32).reshape(1, p.num_kv_heads, -1, 1)
        return g.op("Mul", [g.const("slopes", slopes, np.float32), rel])[0]

    def build(self) -> Graph:
        p, c, g = self.p, self.c, self.g
        H, KV, hd, D, L = p.num_heads, p.num_kv_heads, p.head_dim, p.hidden_dim, p.num_layers
        for n, dt, shape in (("token_ids", torch.int64, ["total_seqlen"]), ("attn_mask", torch.float32, [0]),
                             ("seqstarts", torch.int64, ["batch_1"]), ("kvstarts", torch.int64, ["batch_1"]),
                             ("cachestarts", torch.int64, ["batch"]), ("decoding_batches", torch.int64, [1]),
                             ("start_pos", torch.int64, ["batch"]), ("max_seqlen", torch.int64, [1]),
                             ("max_kvlen", torch.int64, [1])):
            g.input(n, dt, shape)
        cdims = ["max_tokens", *cache_shape(0, L, 1, KV, hd)[1:]]
        g.input("kv_cache", torch.float32, cdims)
        # each token's sequence, position and cache row
        T = g.op("Gather", [g.op("Shape", ["token_ids"])[0], g.const("zero", 0)], axis=0)[0]
        t = g.op("Range", [g.const("zero", 0), T, g.const("one", 1)])[0]                        # (T,)
        ends = g.op("Slice", ["seqstarts", g.const("one", [1]), g.const("end", [2 ** 62]), g.const("ax", [0])])[0]
        past = g.op("LessOrEqual", [g.op("Unsqueeze", [ends, g.const("ax", [0])])[0],
                                    g.op("Unsqueeze", [t, g.const("ax", [1])])[0]])[0]          # (T, B)
        seq = g.op("ReduceSum", [g.op("Cast", [past], to=TensorProto.INT64)[0], g.const("ax", [1])], keepdims=0)[0]
        pos = g.op("Add", [g.op("Gather", ["start_pos", seq], axis=0)[0],
                           g.op("Sub", [t, g.op("Gather", ["seqstarts", seq], axis=0)[0]])[0]])[0]
        base = g.op("Gather", ["cachestarts", seq], axis=0)[0]                                   # (T,)
        slot = g.op("Unsqueeze", [g.op("Add", [base, pos])[0], g.const("ax", [1])])[0]          # (T, 1)
        cos = sin = None
        if p.position_embedding == "rotary":
            rot = Rotary(p.rotary_dims, p.rope_theta, p.rope_scaling, p.max_position_embeddings, torch.device("cpu"))
            cos, sin = (g.op("Unsqueeze", [g.op("Gather", [g.weight(f"rope_{n}", table), pos], axis=0)[0],
                                           g.const("ax", [1])])[0]                               # (T, 1, R/2)
                        for n, table in (("cos", rot.cos_table), ("sin", rot.sin_table)))
        # attention's view of the histories: rows cachestarts[b] + j, j < max_kvlen, seen where j <= pos (window)
        maxt = g.op("Gather", [g.op("Shape", ["kv_cache"])[0], g.const("zero", 0)], axis=0)[0]
        j = g.op("Range", [g.const("zero", 0), g.op("Squeeze", ["max_kvlen", g.const("ax", [0])])[0],
                           g.const("one", 1)])[0]                                                # (N,)
        jj = g.op("Unsqueeze", [j, g.const("ax", [0])])[0]
        rows = g.op("Add", [g.op("Unsqueeze", [base, g.const("ax", [1])])[0], jj])[0]           # (T, N)
        rows = g.op("Min", [rows, g.op("Sub", [maxt, g.const("one", 1)])[0]])[0]
        pcol = g.op("Unsqueeze", [pos, g.const("ax", [1])])[0]
        seen = g.op("LessOrEqual", [jj, pcol])[0]
        if p.sliding_window:
            seen = g.op("And", [seen, g.op("Greater", [jj, g.op("Sub", [pcol, g.const("w", p.sliding_window)])[0]])[0]])[0]
        seen = g.op("Unsqueeze", [seen, g.const("ax", [1, 2])])[0]                              # (T, 1, 1, N)
        alibi = self._alibi(pcol, jj) if p.position_embedding == "alibi" else None
        logn = self._logn(pos) if p.logn_scaling else None
        cache = "kv_cache"
        h = g.op("Gather", [g.weight("tok_embeddings.weight", self._weight("tok_embeddings.weight")), "token_ids"],
                 axis=0)[0]
        ffn = None
        for i in range(L):
            a, m = f"layers.{i}.attention", f"layers.{i}.feed_forward"
            if ffn is not None:
                h = g.op("Add", [h, ffn])[0]
            x = self._norm(h, self.w.pop(f"layers.{i}.attention_norm.weight"), f"layers.{i}.attention_norm.weight",
                           f"layer{i}_attention_norm")
            q, k, v = (g.op("Reshape", [self._linear(x, f"{a}.{n}", p.qkv_bias), g.const("heads", [0, -1, hd])],
                            [f"layer{i}_{n[1]}"])[0] for n in ("wq", "wk", "wv"))
            if p.qk_norm:
                q = self._norm(q, self.w.pop(f"{a}.q_norm.weight"), f"{a}.q_norm.weight")
                k = self._norm(k, self.w.pop(f"{a}.k_norm.weight"), f"{a}.k_norm.weight")
            if cos is not None:
                q, k = self._rotate(q, cos, sin, H), self._rotate(k, cos, sin, KV)
            if logn is not None:
                q = g.op("Mul", [q, logn])[0]
            for which, val in ((0, k), (1, v)):   # cache[slot, i, which] = k / v
                idx = g.op("Concat", [slot, g.op("Add", [g.op("Mul", [slot, g.const("zero", [[0]])])[0],
                                                         g.const("li", [[i]])])[0],
                                      g.op("Add", [g.op("Mul", [slot, g.const("zero", [[0]])])[0],
                                                   g.const("wi", [[which]])])[0]], axis=1)[0]    # (T, 3)
                cache = g.op("ScatterND", [cache, idx, val])[0]
            layer = g.op("Gather", [cache, g.const("li", i)], axis=1)[0]                         # (MaxT, 2, KV, hd)
            kh, vh = (g.op("Gather", [g.op("Gather", [layer, g.const("wi", w)], axis=1)[0], rows], axis=0)[0]
                      for w in (0, 1))                                                           # (T, N, KV, hd)
            qg = g.op("Reshape", [q, g.const("groups", [0, KV, H // KV, hd])])[0]               # (T, KV, G, hd)
            kt = g.op("Transpose", [kh], perm=[0, 2, 3, 1])[0]                                   # (T, KV, hd, N)
            s = g.op("Mul", [g.op("MatMul", [qg, kt])[0], g.const("scale", 1 / math.sqrt(hd), np.float32)])[0]
            if alibi is not None:
                s = g.op("Add", [s, alibi])[0]
            s = g.op("Where", [seen, s, g.const("ninf", -np.inf, np.float32)])[0]
            pr = g.op("Softmax", [s], axis=-1)[0]                                                # (T, KV, G, N)
            o = g.op("MatMul", [pr, g.op("Transpose", [vh], perm=[0, 2, 1, 3])[0]])[0]           # (T, KV, G, hd)
            o = g.op("Reshape", [o, g.const("heads", [0, H, hd])], [f"layer{i}_attention"])[0]
            o = self._linear(g.op("Reshape", [o, g.const("flat", [0, -1])])[0], f"{a}.wo", p.o_bias)
            g.op("Identity", [o], [f"layer{i}_o"])
            h = g.op("Add", [h, o], [f"layer{i}_residual"])[0]
            x = self._norm(h, self.w.pop(f"layers.{i}.ffn_norm.weight"), f"layers.{i}.ffn_norm.weight",
                           f"layer{i}_ffn_norm")
            gate, up = self._linear(x, f"{m}.w1", p.ffn_bias), self._linear(x, f"{m}.w3", p.ffn_bias)
            act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])[0]])[0], up])[0]
            ffn = g.op("Identity", [self._linear(act, f"{m}.w2", p.ffn_bias)], [f"layer{i}_ffn"])[0]
        h = g.op("Add", [h, ffn])[0]
        last = g.op("Gather", [h, g.op("Sub", [ends, g.const("one", [1])])[0]], axis=0)[0]
        x = self._norm(last, self.w.pop("norm.weight"), "norm.weight")
        logits = g.op("MatMul", [x, g.weight("output.weight_t", self._weight("output.weight").t().contiguous())],
                      ["logits"])[0]
        g.op("Identity", [cache], ["kv_cache_out"])
        g.output(logits, torch.float32, ["batch", "vocab_size"])
        g.output("kv_cache_out", torch.float32, cdims)
        if self.w:
            raise PmxError(f"tensors left unplaced by the export: {sorted(self.w)[:5]}")
        return g
