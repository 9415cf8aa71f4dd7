"""The kernel set of `Export.py --opset opmx`: the engine's model traced into ppl.pmx's operators.

Each op is a custom operator (torch.library, namespace `opmx_export`) whose TorchScript symbolic function writes one
node of ppl.pmx's opmx / opmx.dynamic_batching domains with ppl.pmx's name, inputs and attributes (ppl.pmx's
torch_function/*.py and docs/operators/*.md), so pplnn could read the graph. As in ppl.pmx, an op's eager body only
gives outputs of the right shapes and dtypes for the tracer (zeros, a tensor of its own each): the values are
onnxruntime's (runner.onnx.ort computes every op) or pplnn's. Weights are the layers' buffers (ONNX initializers) under the names
ppl.pmx's modules give them (`layers.0.attention.wqkv.weight`, ...: :attr:`OpmxLayer.pmx_names`).

The ops (the model calls them through the kernel set, runner.kernels.sets.KernelSet; the layers are built by
:func:`layers`):

- skip_rms_norm / rms_norm: RMSNorm (skip_term 1 with the residual add and two outputs; 0 for the q/k norms);
- swiglu_packed / swiglu: SwiGLU of a fused gate/up output (beta 1), SiLU(gate, up) of separate ones;
- geglu / geglu_packed: GELU(gate, up) with approximate 1 (GELU's tanh form times up; a fused output's halves
  sliced first);
- rotary_step: dynamic_batching RotaryPositionEmbedding(q, k, seqstarts, start_pos, max_seqlen);
- cache_attention: dynamic_batching MultiHeadCacheAttention (fused_kvcache), or KeyValueCache then
  MultiHeadAttention (fused_kvcache off: the history gathered, GQA heads repeated where friendly_gqa);
- the layers: ParallelEmbedding; ColumnParallelLinear / RowParallelLinear, their Woqu* forms for the weight-only
  schemes ppl.pmx's Woqu linears take (int8 per channel or in groups of `group_size` columns, symmetric int4); MoE
  as ppl.pmx's model_zoo/mixtral writes it (router Linear, MoeSelect, MoeColumnParallelLinear, SwiGLU / SiLU,
  MoeRowParallelLinear, MoeReduce).

What ppl.pmx's operators cannot say is an attribute of ours beside ppl.pmx's (pplnn would ignore it, so a model that
needs one runs right only here; absent reads as the neutral value):
- `sliding_window` on the attention operators (0: none);
- `rope_scaling` (the HF dict as JSON) on RotaryPositionEmbedding for rope types other than linear and dynamic
  (llama3, yarn, ...), which `scaling_type` / `scaling_factor` cannot describe;
- `alibi_num_heads` and `alibi_head_offset` on the attention operators: whose slopes a rank's heads take. ppl.pmx
  derives the slopes from the operator's `num_heads`, the rank's head count, which is right at TP=1 only; this rank's
  heads are heads offset .. offset + num_heads - 1 of a model of alibi_num_heads (0: num_heads, ppl.pmx's reading);
- `logn_scaling` on the attention operators (Qwen's use_logn_attn, which ppl.pmx's Qwen export leaves out): L > 0
  scales the query at position p by log(p + 1) / log(L) where p + 1 > L;
- `softcap` on the attention operators (Gemma 2's attn_logit_softcapping): c > 0 caps the scores to c tanh(s / c)
  before the mask;
- per layer, each attention operator's `sliding_window` and each RotaryPositionEmbedding's theta and `rope_scaling`
  are its layer's (Gemma's sliding and full layers; LongRoPE's short / long switch is `rope_scaling`'s, by each
  sequence's length in the step).
The model's own scalings (an embedding or query multiplier, the soft cap of the logits) are plain torch in the model,
traced as standard ONNX operators (Mul, Div, Tanh); a norm's offset (Gemma's 1 + w) is in its weight initializer.
ALiBi itself is ppl.pmx's reading: no RotaryPositionEmbedding and `is_alibi` 1 on the attention operators; a
partial rotary (ChatGLM) is RotaryPositionEmbedding's `rotary_dim` (0: the whole head). A quantised token embedding
is dequantised into a float initializer, element for element what the engine computes as it gathers rows (ppl.pmx's
ParallelEmbedding has no quantised form). So is a linear of int4 with offsets (GGUF's Q4_1, W = nibble * scale +
offset), into a plain Column/RowParallelLinear: ppl.pmx's Woqu zero point is an integer nibble subtracted before the
scale ((nibble - z) * scale), which a float offset per group is not (z = -offset / scale would round), and pplnn would
read a float offset passed there otherwise. Weights of one layer stored alike are fused as the engine fuses them
(runner.engine.model.stored_alike); where a GGUF stores them differently (q and k in Q4_0, v in Q8_0), they are
separate linears in the engine and in the graph.

MoE beside the engine's (runner.engine.model.MoE): MoeSelect takes the top k router logits and their softmax, the
engine softmax over all experts, the top k, renormalised (the same numbers up to rounding); MoeRowParallelLinear
all-reduces each token's k expert rows [T, k, D] where the engine all-reduces the weighted sum [T, D] once (the same
sum up to rounding). Refused in one line: quantised experts (ppl.pmx has no weight-only quantised Moe* linear).

An op the model calls that this set lacks (runner.kernels.sets.lacking) is an error naming it.
"""

from __future__ import annotations

import json
from typing import Callable, Optional

import torch
from torch import nn

from runner.config import EngineConfig
from runner.errors import PmxError
from runner.kernels.quant_linear import QuantWeight
from runner.kernels.reference import PAGE_SIZE, QUANT_GROUP, AttentionSpec, Rotary, rope_type
from runner.kernels.sets import KernelSet, Layers, lacking
from runner.pmx.quant import QuantScheme

OPMX, DB = "opmx", "opmx.dynamic_batching"
DOMAINS = {OPMX: 1, DB: 1}
OPSET = 11                      # ppl.pmx exports with opset 11
NAMESPACE = "opmx_export"       # the custom operators' torch.library namespace

_LIB = torch.library.Library(NAMESPACE, "DEF")


def _zeros(like: torch.Tensor, *shape, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype or like.dtype, device=like.device)


def _kind(v) -> str:
    """The suffix torch.onnx's g.op takes for an attribute of Python value v (a bool is an int, as ONNX has none)."""
    return "_s" if isinstance(v, str) else "_f" if isinstance(v, float) else "_i"


def _symbolic(domain: str, op_type: str, outs: tuple) -> Callable:
    """The TorchScript symbolic function of an op: one `domain::op_type` node over the op's tensors (a missing
    optional tensor before a present one becomes an empty float tensor, ppl.pmx's way to leave an input out; trailing
    missing ones are dropped), its JSON `attrs` as typed attributes; `outs` the outputs' dtypes (an int: the dtype of
    that input)."""
    from torch.onnx import symbolic_helper as sh

    def symbolic(g, *args):
        *tensors, attrs = args
        attrs = json.loads(sh._get_const(attrs, "s", "attrs"))
        present = [not sh._is_none(t) for t in tensors]
        last = max(i for i, p in enumerate(present) if p)
        inputs = [t if p else g.op("Constant", value_t=torch.zeros(0)) for t, p in zip(tensors[: last + 1], present)]
        nodes = g.op(f"{domain}::{op_type}", *inputs, outputs=len(outs),
                     **{f"{k}{_kind(v)}": int(v) if isinstance(v, bool) else v for k, v in attrs.items()})
        nodes = nodes if len(outs) > 1 else (nodes,)
        for node, dt in zip(nodes, outs):
            dtype = tensors[dt].type().dtype() if isinstance(dt, int) else dt
            node.setType(torch._C.TensorType.get().with_dtype(dtype))
        return nodes if len(outs) > 1 else nodes[0]
    return symbolic


def _define(name: str, schema: str, domain: str, op_type: str, outs: tuple, shapes: Callable) -> Callable:
    """Defines op `name` (`schema`: its arguments; a last `str attrs` is added) and registers its symbolic; `shapes`
    is its eager body (outputs of the right shapes for the tracer). Returns torch.ops.opmx_export.name."""
    ret = "Tensor" if len(outs) == 1 else "(" + ", ".join(["Tensor"] * len(outs)) + ")"
    _LIB.define(f"{name}({schema}, str attrs) -> {ret}")
    _LIB.impl(name, shapes, "CompositeExplicitAutograd")
    torch.onnx.register_custom_op_symbolic(f"{NAMESPACE}::{name}", _symbolic(domain, op_type, outs), OPSET)
    return getattr(getattr(torch.ops, NAMESPACE), name)


def _attrs(**kw) -> str:
    return json.dumps(kw, sort_keys=True)


F32, I64 = torch.float32, torch.int64
# -- the operators -------------------------------------------------------------------------------------------------
parallel_embedding = _define(
    "parallel_embedding", "Tensor ids, Tensor weight", OPMX, "ParallelEmbedding", (1,),
    lambda ids, w, a: _zeros(w, *ids.shape, json.loads(a)["embedding_dims"]))


def _linear_shape(x, rows, a):
    a = json.loads(a)
    return _zeros(x, *x.shape[:-1], a["out_features"] if a.get("gather_output") or a.get("input_is_parallel") else
                  rows)


column_parallel_linear = _define(
    "column_parallel_linear", "Tensor x, Tensor weight, Tensor? bias", OPMX, "ColumnParallelLinear", (0,),
    lambda x, w, b, a: _linear_shape(x, w.shape[0], a))
row_parallel_linear = _define(
    "row_parallel_linear", "Tensor x, Tensor weight, Tensor? bias", OPMX, "RowParallelLinear", (0,),
    lambda x, w, b, a: _linear_shape(x, w.shape[0], a))
woqu_column_parallel_linear = _define(
    "woqu_column_parallel_linear", "Tensor x, Tensor weight, Tensor scale, Tensor? zeropoint, Tensor? bias", OPMX,
    "WoquColumnParallelLinear", (0,), lambda x, w, s, z, b, a: _linear_shape(x, w.shape[0], a))
woqu_row_parallel_linear = _define(
    "woqu_row_parallel_linear", "Tensor x, Tensor weight, Tensor scale, Tensor? zeropoint, Tensor? bias", OPMX,
    "WoquRowParallelLinear", (0,), lambda x, w, s, z, b, a: _linear_shape(x, w.shape[0], a))
linear = _define(
    "linear", "Tensor x, Tensor weight, Tensor? bias", OPMX, "Linear", (0,),
    lambda x, w, b, a: _zeros(x, *x.shape[:-1], w.shape[0]))
skip_rms_norm_op = _define(
    "skip_rms_norm", "Tensor x, Tensor weight, Tensor? skip", OPMX, "RMSNorm", (0, 0),
    lambda x, w, s, a: (torch.zeros_like(x), torch.zeros_like(x)))
rms_norm_op = _define(
    "rms_norm", "Tensor x, Tensor weight", OPMX, "RMSNorm", (0,), lambda x, w, a: torch.zeros_like(x))
swiglu_op = _define(
    "swiglu", "Tensor x", OPMX, "SwiGLU", (0,), lambda x, a: _zeros(x, *x.shape[:-1], x.shape[-1] // 2))
silu_op = _define(
    "silu", "Tensor x, Tensor gate", OPMX, "SiLU", (0,), lambda x, gate, a: torch.zeros_like(x))
gelu_op = _define(
    "gelu", "Tensor x, Tensor gate", OPMX, "GELU", (0,), lambda x, gate, a: torch.zeros_like(x))


def _halves_symbolic(g, x, attrs):
    """One standard Split (opset 11: sizes as an attribute) of the last dim into two halves of `size`."""
    from torch.onnx import symbolic_helper as sh
    n = json.loads(sh._get_const(attrs, "s", "attrs"))["size"]
    return g.op("Split", x, axis_i=-1, split_i=[n, n], outputs=2)


_LIB.define("halves(Tensor x, str attrs) -> (Tensor, Tensor)")
_LIB.impl("halves", lambda x, a: tuple(x[..., :json.loads(a)["size"]].clone() for _ in range(2)),
          "CompositeExplicitAutograd")
torch.onnx.register_custom_op_symbolic(f"{NAMESPACE}::halves", _halves_symbolic, OPSET)
halves_op = torch.ops.opmx_export.halves
rotary_position_embedding = _define(
    "rotary_position_embedding", "Tensor q, Tensor k, Tensor seqstarts, Tensor start_pos, Tensor max_seqlen", DB,
    "RotaryPositionEmbedding", (0, 1), lambda q, k, *_: (torch.zeros_like(q), torch.zeros_like(k)))
multi_head_cache_attention = _define(
    "multi_head_cache_attention", "Tensor q, Tensor k, Tensor v, Tensor seqstarts, Tensor kvstarts, "
    "Tensor cachestarts, Tensor start_pos, Tensor decoding_batches, Tensor max_seqlen, Tensor max_kvlen, "
    "Tensor(a!) cache, Tensor(b!)? scale, Tensor attn_mask", DB, "MultiHeadCacheAttention", (0,),
    lambda q, *_: torch.zeros_like(q))
key_value_cache = _define(
    "key_value_cache", "Tensor k, Tensor v, Tensor seqstarts, Tensor kvstarts, Tensor cachestarts, Tensor start_pos, "
    "Tensor max_seqlen, Tensor max_kvlen, Tensor(a!) cache, Tensor(b!)? scale", DB, "KeyValueCache", (0, 0),
    lambda k, v, seqstarts, kvstarts, *rest: tuple(  # (two tensors: the tracer tells outputs apart by identity)
        _zeros(k, int(kvstarts[-1]), k.shape[1] * json.loads(rest[-1])["num_repeat"], k.shape[2]) for _ in range(2)))
multi_head_attention = _define(
    "multi_head_attention", "Tensor q, Tensor keys, Tensor values, Tensor seqstarts, Tensor kvstarts, "
    "Tensor decoding_batches, Tensor max_seqlen, Tensor max_kvlen, Tensor attn_mask", DB, "MultiHeadAttention", (0,),
    lambda q, *_: torch.zeros_like(q))
moe_select = _define(
    "moe_select", "Tensor x, Tensor scores", OPMX, "MoeSelect", (0, 1, I64, I64),
    lambda x, s, a: (_zeros(x, x.shape[0], json.loads(a)["num_experts_per_token"], x.shape[1]),
                     _zeros(s, s.shape[0], json.loads(a)["num_experts_per_token"]),
                     _zeros(x, s.shape[0], json.loads(a)["num_experts_per_token"], dtype=I64),
                     _zeros(x, json.loads(a)["num_experts"] + 1, dtype=I64)))
moe_column_parallel_linear = _define(
    "moe_column_parallel_linear", "Tensor x, Tensor expert_offset, Tensor weight, Tensor? bias", OPMX,
    "MoeColumnParallelLinear", (0,), lambda x, off, w, b, a: _zeros(x, *x.shape[:-1], w.shape[1]))
moe_row_parallel_linear = _define(
    "moe_row_parallel_linear", "Tensor x, Tensor expert_offset, Tensor weight, Tensor? bias", OPMX,
    "MoeRowParallelLinear", (0,), lambda x, off, w, b, a: _zeros(x, *x.shape[:-1], w.shape[1]))
moe_reduce = _define(
    "moe_reduce", "Tensor y, Tensor expert_weights, Tensor invert_permutation", OPMX, "MoeReduce", (0,),
    lambda y, wt, inv, a: _zeros(y, y.shape[0], y.shape[-1]))


# -- the layers that hold weights ----------------------------------------------------------------------------------
FUSED_NAMES = {("wq", "wk", "wv"): "wqkv", ("w1", "w3"): "wu"}  # ppl.pmx's names of fused linears


def pmx_name(names) -> str:
    """The PMX name of a layer over the tensors `names` (one name, or ppl.pmx's name of their fusion)."""
    if len(names) == 1:
        return names[0]
    base, tails = names[0].rsplit(".", 1)[0], tuple(n.rsplit(".", 1)[1] for n in names)
    return f"{base}.{FUSED_NAMES.get(tails, '_'.join(tails))}"


class OpmxLayer(nn.Module):
    """A layer whose tensors are ONNX initializers: buffers kept with their PMX names (`pmx_names`: buffer ->
    initializer name, which the export gives them)."""

    def __init__(self):
        super().__init__()
        self.pmx_names: dict[str, str] = {}

    def keep(self, attr: str, t: Optional[torch.Tensor], name: str) -> None:
        self.register_buffer(attr, t)
        if t is not None:
            self.pmx_names[attr] = name


def woqu_weight(q: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The stored qweight as the W input of ppl.pmx's Woqu*ParallelLinear: int8 [N, K]; int4 the bytes of the
    column packing read as int32 [N, K/8] (int16 [N, K/4] or int8 [N, K/2] where K does not divide so)."""
    if scheme.method == "int8":
        return q
    for dt, per in ((torch.int32, 4), (torch.int16, 2)):
        if q.shape[-1] % per == 0:
            return q.contiguous().view(dt)
    return q.contiguous().view(torch.int8)


def woqu_takes(scheme: QuantScheme) -> bool:
    """Whether ppl.pmx's Woqu*ParallelLinear says a weight of leaf scheme `scheme` as it is stored (no float
    offsets)."""
    return not scheme.offset


class ParallelLinear(OpmxLayer):
    """ColumnParallelLinear (cut by output rows; gathered when gather_output) or RowParallelLinear (cut by input
    columns, all-reduced, the bias added once), and their Woqu* forms for a QuantWeight whose scheme they take (else
    the weight dequantised to `dtype`, the export's)."""

    def __init__(self, weight, bias: Optional[torch.Tensor], comm, row: bool, gather_output: bool = False,
                 names=(), dtype: torch.dtype = torch.float32):
        super().__init__()
        name, n = pmx_name(names), comm.world_size
        rows, cols = weight.shape[-2:]
        if isinstance(weight, QuantWeight) and not woqu_takes(weight.scheme):
            weight = weight.dequantize(dtype)  # element for element the engine's reference dequantisation
        self.quant = isinstance(weight, QuantWeight)
        if self.quant:
            s = weight.scheme
            self.keep("weight", woqu_weight(weight.qweight, s), f"{name}.qweight")
            self.keep("scale", weight.scale.float(), f"{name}.scale")
        else:
            self.keep("weight", weight, f"{name}.weight")
        self.keep("bias", bias, f"{name}.bias")
        attrs = dict(in_features=cols * (n if row else 1), out_features=rows * (1 if row else n),
                     bias_term=bias is not None)
        attrs.update(input_is_parallel=True) if row else attrs.update(gather_output=gather_output)
        if self.quant:
            attrs.update(quant_data_type=s.method, quant_method="weight_only", quant_axis=1, group_size=s.group_size,
                         has_zeropoint=0, float_zeropoint=0)
        self.attrs, self.row = _attrs(**attrs), row

    def forward(self, x: torch.Tensor, swiglu: bool = False, sp=None) -> torch.Tensor:
        if swiglu or sp is not None:
            raise PmxError("the opmx export runs no sequence parallelism and no SwiGLU fused into a linear")
        if self.quant:
            op = woqu_row_parallel_linear if self.row else woqu_column_parallel_linear
            return op(x, self.weight, self.scale, None, self.bias, self.attrs)
        return (row_parallel_linear if self.row else column_parallel_linear)(x, self.weight, self.bias, self.attrs)


class ParallelEmbedding(OpmxLayer):
    """ppl.pmx's ParallelEmbedding: this rank's columns, all-gathered (a quantised embedding dequantised whole)."""

    def __init__(self, weight, hidden_dim: int, comm, dtype: torch.dtype, quant_rows=None, names=()):
        super().__init__()
        w = weight.dequantize(dtype) if isinstance(weight, QuantWeight) else weight
        self.keep("weight", w, f"{pmx_name(names)}.weight")
        self.attrs = _attrs(num_embeddings=w.shape[0], embedding_dims=hidden_dim, padding_idx=-1, max_norm=0.0,
                            norm_type=2.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return parallel_embedding(ids, self.weight, self.attrs)


class MoE(OpmxLayer):
    """ppl.pmx's MoeFeedForward: router Linear, MoeSelect, the experts' Moe*ParallelLinear (the stacked experts:
    `wu` [E, 2 F/N, D] = each expert's w1 rows then its w3 rows when fused, else `w1` and `w3`; `w2` [E, D, F/N],
    all-reduced), SwiGLU / SiLU, MoeReduce."""

    def __init__(self, router: torch.Tensor, w1, w3, w2, top_k: int, comm, fused_glu: bool, prepack: bool, ops,
                 names=()):
        super().__init__()
        if any(isinstance(t, QuantWeight) for t in (w1, w3, w2)):
            raise PmxError(f"a mixture-of-experts model with {w1.scheme.method} weights cannot be exported: ppl.pmx "
                           f"has no weight-only quantised MoeColumnParallelLinear / MoeRowParallelLinear (export the "
                           f"float model)")
        gate, n1, n3, n2 = names
        E, F, D = w1.shape
        n = comm.world_size
        self.keep("router", router, f"{gate}.weight")
        if fused_glu:
            self.keep("wu", torch.cat([w1, w3], dim=1), f"{pmx_name([n1, n3])}.weight")
        else:
            self.keep("w1", w1, f"{n1}.weight")
            self.keep("w3", w3, f"{n3}.weight")
        self.keep("w2", w2, f"{n2}.weight")
        self.fused, self.ops = fused_glu, ops
        self.router_attrs = _attrs(in_features=D, out_features=E, bias_term=False)
        self.select_attrs = _attrs(num_experts=E, num_experts_per_token=top_k)
        self.up_attrs = _attrs(num_experts=E, in_features=D, out_features=F * n * (2 if fused_glu else 1),
                               bias_term=False, gather_output=False)
        self.down_attrs = _attrs(num_experts=E, in_features=F * n, out_features=D, bias_term=False,
                                 input_is_parallel=True)
        self.reduce_attrs = _attrs(num_experts_per_token=top_k)

    def forward(self, h: torch.Tensor, sp=None) -> torch.Tensor:
        scores = linear(h, self.router, None, self.router_attrs)                          # (T, E)
        x, weights, inverse, offset = moe_select(h, scores, self.select_attrs)             # (T, k, D) ...
        if self.fused:
            act = self.ops.swiglu_packed(moe_column_parallel_linear(x, offset, self.wu, None, self.up_attrs))
        else:
            act = self.ops.swiglu(moe_column_parallel_linear(x, offset, self.w1, None, self.up_attrs),
                                  moe_column_parallel_linear(x, offset, self.w3, None, self.up_attrs))
        y = moe_row_parallel_linear(act, offset, self.w2, None, self.down_attrs)           # (T, k, D)
        return moe_reduce(y, weights, inverse, self.reduce_attrs)


def layers(dtype: torch.dtype) -> Layers:
    """The layers of an export in `dtype` (a weight dequantised for it takes that dtype)."""
    def column(weight, bias, comm, gather_output=False, prepack=True, names=()):
        return ParallelLinear(weight, bias, comm, False, gather_output, names, dtype)

    def row(weight, bias, comm, prepack=True, names=()):
        return ParallelLinear(weight, bias, comm, True, names=names, dtype=dtype)

    return Layers(column=column, row=row, embedding=ParallelEmbedding, moe=MoE)


# -- the kernel set ------------------------------------------------------------------------------------------------
def rope_attrs(rotary: Rotary, head_dim: int) -> dict:
    """RotaryPositionEmbedding's attributes for `rotary` (its head_dim: the dims rotated)."""
    kind = rope_type(rotary.scaling)
    return dict(rotary_dim=0 if rotary.head_dim == head_dim else rotary.head_dim, theta=float(rotary.theta),
                bypass_key=0, max_position_embeddings=rotary.max_pos, scaling_type="" if kind == "default" else kind,
                scaling_factor=float((rotary.scaling or {}).get("factor") or 1.0),
                rope_scaling="" if kind in ("default", "linear", "dynamic") else json.dumps(rotary.scaling,
                                                                                           sort_keys=True))


def kernel_set(config: EngineConfig, num_layers: int, dtype: torch.dtype = torch.float32) -> KernelSet:
    """The opmx export's kernel set for a model of `num_layers` layers exported with `config`'s flags in `dtype` (the
    model's compute dtype: what a weight its Woqu form cannot say is dequantised to)."""
    c = config

    def skip_rms_norm(x, skip, weight, eps):
        return tuple(skip_rms_norm_op(x, weight, skip, _attrs(axis=-1, eps=float(eps), skip_term=True)))

    def rms_norm(x, weight, eps):
        return rms_norm_op(x, weight, _attrs(axis=-1, eps=float(eps), skip_term=False))

    def rotary_step(q, k, inputs, rotary):
        return tuple(rotary_position_embedding(q, k, inputs.seqstarts, inputs.start_pos, inputs.max_seqlen,
                                               _attrs(**rope_attrs(rotary, q.shape[-1]))))

    def cache_attention(q, k, v, inputs, cache, spec: AttentionSpec):
        i, alibi = inputs, bool(spec.alibi_heads)
        position = dict(is_alibi=alibi, alibi_num_heads=spec.alibi_heads[0] if alibi else 0,
                        alibi_head_offset=spec.alibi_heads[1] if alibi else 0, logn_scaling=spec.logn_scaling,
                        sliding_window=spec.sliding_window, softcap=float(spec.softcap))
        stored = dict(num_layer=num_layers, layer_idx=spec.layer, quant_bit=8 if cache.scale is not None else 0,
                      quant_group=QUANT_GROUP if cache.scale is not None else 0, cache_mode=c.cache_mode,
                      cache_layout=cache.layout, page_size=PAGE_SIZE)
        heads = dict(num_heads=spec.heads, head_dim=spec.head_dim, is_causal=c.auto_causal, **position)
        if c.fused_kvcache:
            return multi_head_cache_attention(
                q, k, v, i.seqstarts, i.kvstarts, i.cachestarts, i.start_pos, i.decoding_batches, i.max_seqlen,
                i.max_kvlen, cache.data, cache.scale, i.attn_mask,
                _attrs(**heads, num_kv_heads=spec.kv_heads, **stored))
        rep = spec.heads // spec.kv_heads if c.friendly_gqa else 1
        keys, values = key_value_cache(k, v, i.seqstarts, i.kvstarts, i.cachestarts, i.start_pos, i.max_seqlen,
                                       i.max_kvlen, cache.data, cache.scale, _attrs(**stored, num_repeat=rep))
        return multi_head_attention(q, keys, values, i.seqstarts, i.kvstarts, i.decoding_batches, i.max_seqlen,
                                    i.max_kvlen, i.attn_mask,
                                    _attrs(**heads, num_kv_heads=0 if c.friendly_gqa else spec.kv_heads))

    def geglu(gate, up):
        return gelu_op(gate, up, _attrs(approximate=True))

    def geglu_packed(gate_up):  # the halves of a fused output as one Split of constant sizes (chunk traces shapes)
        return geglu(*halves_op(gate_up, _attrs(size=int(gate_up.shape[-1]) // 2)))

    name = "onnx export (opmx)"
    why = "the opmx export traces steps as ppl.pmx's operators"
    return KernelSet(
        name, skip_rms_norm, lacking(name, "apply_rotary", why), lambda gate, up: silu_op(gate, up, _attrs()),
        lacking(name, "kv_store", why), lacking(name, "kv_load", why), lacking(name, "attend", why),
        rms_norm=rms_norm, swiglu_packed=lambda gate_up: swiglu_op(gate_up, _attrs(beta=1.0)), geglu=geglu,
        geglu_packed=geglu_packed,
        rotary_step=rotary_step, cache_attention=cache_attention, layers=layers(dtype))
