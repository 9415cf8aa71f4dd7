"""The tensors of a PMX model, derived from its params alone: names and unsplit shapes, in file order
(a quantised model's weights as `qweight` + `scale`, see runner/pmx/quant.py)."""

from __future__ import annotations

from runner.pmx.params import PmxParams
from runner.pmx.quant import quantized_tensors, scheme_of


def pmx_tensors(p: PmxParams) -> dict[str, tuple]:
    """{name: unsplit shape} of every tensor a PMX model with params `p` holds, in file order."""
    D, F, V, hd = p.hidden_dim, p.intermediate_dim, p.vocab_size, p.head_dim
    q, kv, E = p.num_heads * hd, p.num_kv_heads * hd, p.num_experts
    ex = (E,) if E else ()  # MoE experts are stacked [E, out, in]
    t: dict[str, tuple] = {"tok_embeddings.weight": (V, D)}
    for i in range(p.num_layers):
        a, m = f"layers.{i}.attention", f"layers.{i}.feed_forward"
        t[f"layers.{i}.attention_norm.weight"] = (D,)
        for name, rows in (("wq", q), ("wk", kv), ("wv", kv)):
            t[f"{a}.{name}.weight"] = (rows, D)
            if p.qkv_bias:
                t[f"{a}.{name}.bias"] = (rows,)
        if p.qk_norm:
            t[f"{a}.q_norm.weight"] = (hd,)
            t[f"{a}.k_norm.weight"] = (hd,)
        t[f"{a}.wo.weight"] = (D, q)
        if p.o_bias:
            t[f"{a}.wo.bias"] = (D,)
        if p.post_norms:
            t[f"layers.{i}.post_attention_norm.weight"] = (D,)
        t[f"layers.{i}.ffn_norm.weight"] = (D,)
        if E:
            t[f"{m}.gate.weight"] = (E, D)
        for name, shape, bias in (("w1", (F, D), (F,)), ("w3", (F, D), (F,)), ("w2", (D, F), (D,))):
            t[f"{m}.{name}.weight"] = ex + shape
            if p.ffn_bias:
                t[f"{m}.{name}.bias"] = ex + bias
        if p.post_norms:
            t[f"layers.{i}.post_ffn_norm.weight"] = (D,)
    t["norm.weight"] = (D,)
    t["output.weight"] = (V, D)
    scheme = scheme_of(p)
    return t if scheme is None else quantized_tensors(scheme, t)
