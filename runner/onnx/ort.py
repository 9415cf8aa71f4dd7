"""The opmx operators for onnxruntime on CPU, as onnxruntime-extensions' Python custom operators, and a runner of one
rank's opmx export (:class:`OpmxSession`).

Each operator computes what ppl.pmx's operator documents, with this project's reference kernels
(runner.kernels.reference, runner.pmx.quant): the same arithmetic the engine is tested against. The collectives of
the parallel operators go through the rank's communicator (runner.parallel), the one the engine uses.

What onnxruntime-extensions' Python operators cannot do, and what is done about it (measured with onnxruntime
1.32 / onnxruntime-extensions 0.15):
- they receive *copies* of their inputs, so an operator cannot update the KV cache in place through its input. The
  session binds the caller's cache tensors for the duration of a run (:meth:`OpmxSession.run`), and the cache
  operators write those (after checking them against the input they were given), as pplnn writes its input buffer;
- an operator has one input count and no optional inputs: before the session is made, a copy of the graph in
  memory gets empty tensors for the inputs ppl.pmx leaves out (a bias, the first SkipRMSNorm's skip), a second
  output for an RMSNorm without skip, and the neutral value of each attribute a node leaves out (0, 0.0, "": a graph
  written without this project's attributes); the file is not changed;
- no float16: kv_scale (float16) reaches the operators through a Cast to float32 (they write the bound float16 scale);
  a float16 or bfloat16 export is refused (it runs in pplnn, not here).
- an operator declares the type of each output (OPS): float32, but int64 for MoeSelect's invert_permutation and
  expert_offset, as ppl.pmx's docs/operators/MoeSelect.md types them.
The operators are registered once per process (onnxruntime-extensions keeps one registry per process); a run looks
up the session that is running through a context variable, so sessions never share state.
"""

from __future__ import annotations

import contextvars
import json
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from runner.errors import PmxError
from runner.kernels import reference as ref
from runner.pmx.quant import dequantize

OPMX, DB = "opmx", "opmx.dynamic_batching"
_RUNNING: contextvars.ContextVar = contextvars.ContextVar("opmx_session")

# op -> (input kinds, output kinds, {attr: type}); kinds: f float32, i int64, c cache (float32 / int8), w woqu weight
_I, _F, _S = "int", "float", "str"
# this project's attributes of the attention operators beside ppl.pmx's (runner.kernels.opmx_export); absent: 0
POSITION_ATTRS = dict(sliding_window=_I, alibi_num_heads=_I, alibi_head_offset=_I, logn_scaling=_I, softcap=_F)
ATTR_DEFAULTS = {_I: 0, _F: 0.0, _S: ""}
OPS = {
    (OPMX, "ParallelEmbedding"): ("if", "f", dict(num_embeddings=_I, embedding_dims=_I, padding_idx=_I, max_norm=_F,
                                                norm_type=_F)),
    (OPMX, "ColumnParallelLinear"): ("fff", "f", dict(in_features=_I, out_features=_I, bias_term=_I, gather_output=_I)),
    (OPMX, "RowParallelLinear"): ("fff", "f", dict(in_features=_I, out_features=_I, bias_term=_I,
                                                   input_is_parallel=_I)),
    (OPMX, "WoquColumnParallelLinear"): ("fwfff", "f", dict(
        in_features=_I, out_features=_I, bias_term=_I, gather_output=_I, quant_data_type=_S, quant_method=_S,
        quant_axis=_I, group_size=_I, has_zeropoint=_I, float_zeropoint=_I)),
    (OPMX, "WoquRowParallelLinear"): ("fwfff", "f", dict(
        in_features=_I, out_features=_I, bias_term=_I, input_is_parallel=_I, quant_data_type=_S, quant_method=_S,
        quant_axis=_I, group_size=_I, has_zeropoint=_I, float_zeropoint=_I)),
    (OPMX, "Linear"): ("fff", "f", dict(in_features=_I, out_features=_I, bias_term=_I)),
    (OPMX, "MoeSelect"): ("ff", "ffii", dict(num_experts=_I, num_experts_per_token=_I)),
    (OPMX, "MoeColumnParallelLinear"): ("fiff", "f", dict(num_experts=_I, in_features=_I, out_features=_I,
                                                          bias_term=_I, gather_output=_I)),
    (OPMX, "MoeRowParallelLinear"): ("fiff", "f", dict(num_experts=_I, in_features=_I, out_features=_I, bias_term=_I,
                                                       input_is_parallel=_I)),
    (OPMX, "MoeReduce"): ("ffi", "f", dict(num_experts_per_token=_I)),
    (OPMX, "RMSNorm"): ("fff", "ff", dict(axis=_I, eps=_F, skip_term=_I)),
    (OPMX, "SwiGLU"): ("f", "f", dict(beta=_F)),
    (OPMX, "SiLU"): ("ff", "f", {}),
    (OPMX, "GELU"): ("ff", "f", dict(approximate=_I)),
    (OPMX, "Reshape"): ("fi", "f", {}),
    (DB, "RotaryPositionEmbedding"): ("ffiii", "ff", dict(rotary_dim=_I, theta=_F, bypass_key=_I,
                                                       max_position_embeddings=_I, scaling_type=_S,
                                                       scaling_factor=_F, rope_scaling=_S)),
    (DB, "MultiHeadCacheAttention"): ("fffiiiiiiicff", "f", dict(
        num_heads=_I, head_dim=_I, is_causal=_I, is_alibi=_I, num_kv_heads=_I, num_layer=_I, layer_idx=_I,
        quant_bit=_I, quant_group=_I, cache_mode=_I, cache_layout=_I, page_size=_I, **POSITION_ATTRS)),
    (DB, "KeyValueCache"): ("ffiiiiiicf", "ff", dict(num_layer=_I, layer_idx=_I, quant_bit=_I, quant_group=_I,
                                                  num_repeat=_I, cache_mode=_I, cache_layout=_I, page_size=_I)),
    (DB, "MultiHeadAttention"): ("fffiiiiif", "f", dict(num_heads=_I, head_dim=_I, is_causal=_I, is_alibi=_I,
                                                      num_kv_heads=_I, **POSITION_ATTRS)),
}
KIND_DTYPES = {"f": ("float32",), "i": ("int64",), "c": ("float32", "int8"), "w": ("int8", "int16", "int32", "uint8")}
NP_TO_ONNX = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64, "int8": TensorProto.INT8,
              "int16": TensorProto.INT16, "int32": TensorProto.INT32, "uint8": TensorProto.UINT8}


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _session() -> "OpmxSession":
    s = _RUNNING.get(None)
    if s is None:
        raise RuntimeError("an opmx operator ran outside OpmxSession.run")
    return s


# --- the operators (numpy in, numpy out) ------------------------------------------------------------------------
def parallel_embedding(ids, w, num_embeddings=0, embedding_dims=0, **_):
    x = _session().comm.all_gather(F.embedding(_t(ids), _t(w)), dim=-1)
    return x[..., :embedding_dims].contiguous().numpy()


def _linear(x, w, b, gather=False, reduce=False):
    y = F.linear(x, w)
    if reduce:
        y = _session().comm.all_reduce_(y)
    if b is not None and b.numel():
        y = y + b
    return (_session().comm.all_gather(y, dim=-1) if gather else y).numpy()


def column_parallel_linear(x, w, b, gather_output=0, bias_term=0, **_):
    return _linear(_t(x), _t(w), _t(b) if bias_term else None, gather=bool(gather_output))


def row_parallel_linear(x, w, b, bias_term=0, **_):
    return _linear(_t(x), _t(w), _t(b) if bias_term else None, reduce=True)


def _woqu(w, scale, quant_data_type: str) -> torch.Tensor:
    q = _t(w)
    if quant_data_type == "int4":   # the packed nibbles, whatever integer type carries them: [N, K/2] bytes
        q = q.view(torch.uint8).reshape(q.shape[0], -1)
    return dequantize(q, _t(scale), quant_data_type)


def woqu_column_parallel_linear(x, w, scale, zero_point, b, quant_data_type="int8", gather_output=0, bias_term=0, **_):
    return _linear(_t(x), _woqu(w, scale, quant_data_type), _t(b) if bias_term else None, gather=bool(gather_output))


def woqu_row_parallel_linear(x, w, scale, zero_point, b, quant_data_type="int8", bias_term=0, **_):
    return _linear(_t(x), _woqu(w, scale, quant_data_type), _t(b) if bias_term else None, reduce=True)


def linear(x, w, b, bias_term=0, **_):
    """ppl.pmx's (not parallel) Linear: the MoE router."""
    return _linear(_t(x), _t(w), _t(b) if bias_term else None)


# --- mixture of experts (ppl.pmx's Moe* operators) -------------------------------------------------------------
def moe_select(x, scores, num_experts=0, num_experts_per_token=0, **_):
    """(X_expand_permute [*, k, K], expert_weights [*, k], invert_permutation [*, k] int64, expert_offset [E + 1]
    int64): each token's k largest scores and their softmax; the token's k copies (token-major, slot-minor) sorted
    stably by expert; row j of the flattened (token, slot) pairs sits at invert_permutation[j] of the sorted rows;
    expert e's rows are expert_offset[e] .. expert_offset[e + 1] - 1."""
    x, s = _t(x), _t(scores)
    E, k, K = int(num_experts), int(num_experts_per_token), x.shape[-1]
    if s.shape[-1] != E or not 0 < k <= E:
        raise RuntimeError(f"MoeSelect: scores [.., {s.shape[-1]}] for num_experts {E}, num_experts_per_token {k}")
    top, chosen = s.reshape(-1, E).topk(k, dim=-1)                      # (T, k)
    order = chosen.reshape(-1).sort(stable=True).indices                 # sorted row i is (token, slot) order[i]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    offset = torch.zeros(E + 1, dtype=torch.int64)
    offset[1:] = torch.bincount(chosen.reshape(-1), minlength=E).cumsum(0)
    lead = x.shape[:-1]
    return (x.reshape(-1, K)[order // k].reshape(*lead, k, K).numpy(), top.softmax(-1).reshape(*lead, k).numpy(),
            inverse.reshape(*lead, k).numpy(), offset.numpy())


def _moe_linear(x, expert_offset, w, b, gather=False, reduce=False):
    """Expert e's F.linear over its rows [expert_offset[e], expert_offset[e + 1]) of X flattened to [rows, K]."""
    x, off, w = _t(x), _t(expert_offset).tolist(), _t(w)
    E = w.shape[0]
    if len(off) != E + 1 or off[0] != 0 or off[-1] != x[..., 0].numel() or any(a > b for a, b in zip(off, off[1:])):
        raise RuntimeError(f"Moe*ParallelLinear: expert_offset {off} does not cut {x[..., 0].numel()} rows among {E} "
                           f"experts")
    xf = x.reshape(-1, x.shape[-1])
    y = xf.new_empty(xf.shape[0], w.shape[1])
    for e in range(E):
        if off[e + 1] > off[e]:
            y[off[e]: off[e + 1]] = F.linear(xf[off[e]: off[e + 1]], w[e])
    if reduce:
        y = _session().comm.all_reduce_(y)
    if b is not None:
        y = y + torch.repeat_interleave(_t(b), torch.tensor(off[1:]) - torch.tensor(off[:-1]), dim=0)
    y = y.reshape(*x.shape[:-1], w.shape[1])
    return (_session().comm.all_gather(y, dim=-1) if gather else y).numpy()


def moe_column_parallel_linear(x, expert_offset, w, b, gather_output=0, bias_term=0, **_):
    return _moe_linear(x, expert_offset, w, b if bias_term else None, gather=bool(gather_output))


def moe_row_parallel_linear(x, expert_offset, w, b, bias_term=0, **_):
    """The rows of every expert, all-reduced, then each row's expert's bias (ppl.pmx's order)."""
    return _moe_linear(x, expert_offset, w, b if bias_term else None, reduce=True)


def moe_reduce(y, expert_weights, invert_permutation, **_):
    """Y_reduced [*, N]: sum over each token's k slots of its row of Y (at invert_permutation) x expert_weights."""
    y, wt, inv = _t(y), _t(expert_weights), _t(invert_permutation)
    rows = y.reshape(-1, y.shape[-1])[inv.reshape(-1)].reshape(*wt.shape, y.shape[-1])   # (*, k, N)
    return (rows * wt.unsqueeze(-1)).sum(-2).numpy()


def rms_norm(x, w, skip, eps=1e-5, skip_term=0, **_):
    x, w, skip = _t(x), _t(w), _t(skip)
    r = x + skip if skip_term and skip.numel() else x
    return ref.rms_norm(r, w, eps).numpy(), r.numpy()


def swiglu(x, beta=1.0, **_):
    gate, up = _t(x).chunk(2, dim=-1)
    return (ref.swiglu(gate, up) if beta == 1.0 else up * gate * torch.sigmoid(beta * gate)).numpy()


def silu(x, gate, **_):
    y, g = F.silu(_t(x)), _t(gate)
    return (y * g if g.numel() else y).numpy()


def gelu(x, gate, approximate=0, **_):
    """ppl.pmx's GELU(x, gate): gelu(x) (its tanh form where approximate) times gate where given."""
    y, g = F.gelu(_t(x), approximate="tanh" if approximate else "none"), _t(gate)
    return (y * g if g.numel() else y).numpy()


def reshape(x, shape, **_):
    dims = [x.shape[i] if d == 0 else int(d) for i, d in enumerate(shape.tolist())]
    return np.ascontiguousarray(x).reshape(dims)


def _positions(seqstarts: torch.Tensor, start_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position, sequence) of each packed token."""
    lens = seqstarts[1:] - seqstarts[:-1]
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
    return start_pos[seq] + torch.arange(int(seqstarts[-1])) - seqstarts[seq], seq


@lru_cache(maxsize=8)
def _rotary(head_dim: int, theta: float, scaling: str, max_pos: int) -> ref.Rotary:
    return ref.Rotary(head_dim, theta, json.loads(scaling) if scaling else None, max_pos, torch.device("cpu"))


def rotary_position_embedding(q, k, seqstarts, start_pos, max_seqlen, theta=10000.0, bypass_key=0,
                              max_position_embeddings=2048, scaling_type="", scaling_factor=1.0, rope_scaling="",
                              rotary_dim=0, **_):
    """ppl.pmx's rotary: interleaved pairs of the first `rotary_dim` dims of each head (0: all), the frequencies those
    dims' (the rest pass through)."""
    q, k = _t(q), _t(k)
    if not rope_scaling and scaling_type:
        rope_scaling = json.dumps({"rope_type": scaling_type, "factor": scaling_factor}, sort_keys=True)
    dims = int(rotary_dim) or q.shape[-1]
    if not (0 < dims <= q.shape[-1] and dims % 2 == 0):
        raise RuntimeError(f"RotaryPositionEmbedding: rotary_dim {rotary_dim} is not an even number in "
                           f"[0, head_dim {q.shape[-1]}]")
    seqstarts, start_pos = _t(seqstarts), _t(start_pos)
    pos, seq = _positions(seqstarts, start_pos)
    seq_end = (start_pos + seqstarts[1:] - seqstarts[:-1])[seq]  # (LongRoPE switches by each sequence's length)
    cos, sin = _rotary(dims, float(theta), rope_scaling, int(max_position_embeddings)).cos_sin(pos, seq_end=seq_end)
    return ref.apply_rotary(q, cos, sin).numpy(), (k if bypass_key else ref.apply_rotary(k, cos, sin)).numpy()


def _cache_history(k, v, seqstarts, kvstarts, cachestarts, start_pos, cache_in, scale_in, attrs, dtype):
    """Writes k, v [T, KV, D] to the bound cache; returns the packed history (kh, vh) [sum kvlens, KV, D]."""
    cache, scale = _session().bound_cache(cache_in, scale_in if attrs["quant_bit"] else None)
    layout, layer, mode, page = attrs["cache_layout"], attrs["layer_idx"], attrs["cache_mode"], attrs["page_size"]
    seqstarts, kvstarts, cs, start_pos = _t(seqstarts), _t(kvstarts), _t(cachestarts), _t(start_pos)
    pos, seq = _positions(seqstarts, start_pos)
    ref.kv_store(cache, scale, layout, layer, _t(k), _t(v), ref.token_slots(cs, pos, seq, mode, page))
    hpos, hseq = _positions(kvstarts, torch.zeros_like(start_pos))
    return ref.kv_load(cache, scale, layout, layer, ref.token_slots(cs, hpos, hseq, mode, page), dtype)


def _alibi(attrs: dict) -> Optional[torch.Tensor]:
    """The slopes [num_heads] of this rank's heads where is_alibi: heads alibi_head_offset.. of a model of
    alibi_num_heads (0: the operator's num_heads, ppl.pmx's reading), as runner.engine.model takes them."""
    if not attrs.get("is_alibi"):
        return None
    H, off = int(attrs["num_heads"]), int(attrs.get("alibi_head_offset", 0))
    total = int(attrs.get("alibi_num_heads", 0)) or H
    if off + H > total:
        raise RuntimeError(f"alibi heads {off}..{off + H - 1} are not heads of a model of {total}")
    return torch.tensor(ref.alibi_slopes(total), dtype=torch.float32)[off: off + H]


def _attend(q, kh, vh, seqstarts, kvstarts, attn_mask, attrs: dict):
    """Attention of the packed queries q [T, H, D] over their histories, with the position attributes of `attrs`:
    ALiBi slopes, the logn scaling of the queries (as the engine's plan.q_scale), the sliding window, the scores'
    soft cap."""
    seqstarts, kvstarts = _t(seqstarts), _t(kvstarts)
    start = (kvstarts[1:] - kvstarts[:-1]) - (seqstarts[1:] - seqstarts[:-1])   # each sequence's history length
    mask = _t(attn_mask) if attn_mask.size else None
    logn = int(attrs.get("logn_scaling", 0))
    if logn:
        q = q * ref.logn_scale(_positions(seqstarts, start)[0], logn)[:, None, None].to(q.dtype)
    return ref.attention_packed(q, kh, vh, seqstarts, kvstarts, start, mask, attrs.get("sliding_window", 0) or None,
                                _alibi(attrs), float(attrs.get("softcap", 0.0))).numpy()


def multi_head_cache_attention(*inputs, **attrs):
    """ppl.pmx's 13 inputs: q, k, v, seqstarts, kvstarts, cachestarts, start_pos, decoding_batches, max_seqlen,
    max_kvlen, cache, scale, attn_mask."""
    q, k, v, seqstarts, kvstarts, cachestarts, start_pos, _, _, _, cache, scale, attn_mask = inputs
    q = _t(q)
    kh, vh = _cache_history(k, v, seqstarts, kvstarts, cachestarts, start_pos, cache, scale, attrs, q.dtype)
    return _attend(q, kh, vh, seqstarts, kvstarts, attn_mask, attrs)


def key_value_cache(k, v, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen, cache, scale, **attrs):
    kh, vh = _cache_history(k, v, seqstarts, kvstarts, cachestarts, start_pos, cache, scale, attrs, torch.float32)
    rep = max(int(attrs.get("num_repeat", 1)), 1)
    if rep > 1:
        kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    return kh.numpy(), vh.numpy()


def multi_head_attention(q, keys, values, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen, attn_mask,
                         **attrs):
    return _attend(_t(q), _t(keys), _t(values), seqstarts, kvstarts, attn_mask, attrs)


IMPLS = {"ParallelEmbedding": parallel_embedding, "ColumnParallelLinear": column_parallel_linear,
         "RowParallelLinear": row_parallel_linear, "WoquColumnParallelLinear": woqu_column_parallel_linear,
         "WoquRowParallelLinear": woqu_row_parallel_linear, "Linear": linear, "MoeSelect": moe_select,
         "MoeColumnParallelLinear": moe_column_parallel_linear, "MoeRowParallelLinear": moe_row_parallel_linear,
         "MoeReduce": moe_reduce, "RMSNorm": rms_norm, "SwiGLU": swiglu, "SiLU": silu, "GELU": gelu,
         "Reshape": reshape, "RotaryPositionEmbedding": rotary_position_embedding,
         "MultiHeadCacheAttention": multi_head_cache_attention, "KeyValueCache": key_value_cache,
         "MultiHeadAttention": multi_head_attention}


@lru_cache(maxsize=1)
def register_ops() -> str:
    """Registers every opmx operator with onnxruntime-extensions (once per process: its registry is the process's);
    returns the path of its custom-op library, which a session's options load."""
    try:
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    except ImportError:
        raise PmxError("running an opmx export needs onnxruntime and onnxruntime-extensions (scripts/install.sh "
                       "installs them)") from None
    dt = {"float32": PyCustomOpDef.dt_float, "int64": PyCustomOpDef.dt_int64, "int8": PyCustomOpDef.dt_int8,
          "int16": PyCustomOpDef.dt_int16, "int32": PyCustomOpDef.dt_int32, "uint8": PyCustomOpDef.dt_uint8}
    at = {_I: PyCustomOpDef.dt_int64, _F: PyCustomOpDef.dt_float, _S: PyCustomOpDef.dt_string}
    for (domain, name), (kinds, outs, attrs) in OPS.items():
        varying = next((k for k in kinds if len(KIND_DTYPES[k]) > 1), None)
        for variant in (KIND_DTYPES[varying] if varying else (None,)):
            ins = [dt[variant if k == varying else KIND_DTYPES[k][0]] for k in kinds]
            onnx_op(op_type=f"{domain}::{name}", inputs=ins, outputs=[dt[KIND_DTYPES[k][0]] for k in outs],
                    attrs={a: at[t] for a, t in attrs.items()})(_wrap(IMPLS[name], outs))
    return get_library_path()


def _wrap(fn, outs: str):
    """`fn` returning its outputs in the dtypes the registration declared (`outs`: their kinds)."""
    dtypes = [KIND_DTYPES[k][0] for k in outs]

    def op(*args, **attrs):
        out = fn(*args, **attrs)
        return tuple(np.ascontiguousarray(o, dtype=d) for o, d in zip(out, dtypes)) if len(outs) > 1 else \
            np.ascontiguousarray(out, dtype=dtypes[0])
    op.__name__ = fn.__name__
    return op


def adapt(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` that onnxruntime-extensions' operators take: every opmx node with all its inputs (empty
    tensors where ppl.pmx leaves one out), two outputs for RMSNorm, kv_scale cast to float32. Refuses float16."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    types = {v.name: v.type.tensor_type.elem_type for v in g.input}
    types.update({t.name: t.data_type for t in g.initializer})
    for name in ("attn_mask", "kv_cache"):
        if types.get(name) in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
            raise PmxError("this export computes in float16/bfloat16, which onnxruntime-extensions' Python operators "
                           "cannot take; export with --dtype float32 to run it here (pplnn runs the float16 one)")
    empties = {}

    def empty(kind: str) -> str:
        dtype = KIND_DTYPES[kind][0]
        if dtype not in empties:
            empties[dtype] = f"opmx_empty_{dtype}"
            g.initializer.append(numpy_helper.from_array(np.zeros(0, dtype=dtype), empties[dtype]))
        return empties[dtype]

    scale32 = None
    for node in g.node:
        spec = OPS.get((node.domain, node.op_type))
        if spec is None:
            continue
        kinds, outs, attr_types = spec
        have = {a.name for a in node.attribute}
        node.attribute.extend(helper.make_attribute(a, ATTR_DEFAULTS[t]) for a, t in attr_types.items()
                              if a not in have)
        for j, name in enumerate(node.input):
            if name == "kv_scale":
                if scale32 is None:
                    scale32 = "kv_scale_float32"
                    g.node.insert(0, helper.make_node("Cast", ["kv_scale"], [scale32], to=TensorProto.FLOAT))
                node.input[j] = scale32
        while len(node.input) < len(kinds):
            node.input.append(empty(kinds[len(node.input)]))
        while len(node.output) < len(outs):
            node.output.append(f"{node.name}_unused_{len(node.output)}")
    return m


class OpmxSession:
    """One rank's opmx export in onnxruntime, its collectives on `comm`. :meth:`run` takes the step's inputs as torch
    tensors; kv_cache (and kv_scale) are updated in place, as the engine and pplnn do."""

    def __init__(self, model_dir: Path, comm, extra_outputs: tuple = (), threads: int = 1):
        import onnxruntime as ort
        lib = register_ops()
        path = Path(model_dir) / "model.onnx"
        model = adapt(onnx.load(str(path)))
        have = {o for n in model.graph.node for o in n.output}
        missing = [n for n in extra_outputs if n not in have]
        if missing:
            raise PmxError(f"{path}: has no values {missing[:3]} to dump")
        for name in extra_outputs:
            model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
        so = ort.SessionOptions()
        so.register_custom_ops_library(lib)
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        self.session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.ranks = {i.name: len(i.shape) for i in self.session.get_inputs()}
        self.outputs = ["logits", *extra_outputs]
        self.comm = comm
        self._cache: Optional[torch.Tensor] = None
        self._scale: Optional[torch.Tensor] = None

    def bound_cache(self, cache_in: np.ndarray, scale_in) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The caller's cache (and scale) for this run, checked against the copies the operator was given."""
        cache, scale = self._cache, self._scale
        if cache is None or tuple(cache.shape) != tuple(cache_in.shape):
            raise RuntimeError(f"kv_cache {list(cache_in.shape)} is not the bound cache "
                               f"{None if cache is None else list(cache.shape)}")
        if scale_in is not None and (scale is None or tuple(scale.shape) != tuple(scale_in.shape)):
            raise RuntimeError("kv_scale is not the bound scale")
        return cache, scale if scale_in is not None else None

    def _fed(self, name: str, t: torch.Tensor) -> np.ndarray:
        """t as the graph takes it: an empty tensor (a step's absent attn_mask, [0]) in the rank the graph declares
        ([0, 0] for an export with --auto_causal false)."""
        if t.numel() == 0 and t.dim() != self.ranks[name]:
            t = t.reshape((0,) * self.ranks[name])
        return t.contiguous().cpu().numpy()

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{output name: tensor} of one step; feeds holds the step's inputs (kv_cache / kv_scale written in place)."""
        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise PmxError(f"the model needs inputs {missing}")
        self._cache, self._scale = feeds["kv_cache"], feeds.get("kv_scale")
        token = _RUNNING.set(self)
        try:
            outs = self.session.run(self.outputs, {n: self._fed(n, feeds[n]) for n in self.inputs})
        finally:
            _RUNNING.reset(token)
            self._cache = self._scale = None
        return {n: torch.from_numpy(o) for n, o in zip(self.outputs, outs)}
