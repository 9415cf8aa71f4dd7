"""The kernel set of `Export.py --opset standard`: the engine's model traced into standard ONNX operators only, a
graph a stock onnxruntime InferenceSession runs with no custom operator.

Every op is plain torch that the TorchScript exporter writes as opset-17 operators (which every onnxruntime of the
last years runs): the norms, SwiGLU and the linears as the spec computes them (runner.kernels.reference; weights
dequantised into float initializers), and the two step ops from ppl.pmx's step inputs:

- rotary_step: each token's sequence and position worked out from seqstarts / start_pos (a comparison against the
  sequence ends and a sum), cos / sin of position x inv_freq (times yarn's / LongRoPE's scale; LongRoPE's long
  frequencies for the tokens of a sequence that reaches past original_max_position_embeddings), interleaved pairs of
  the first rotary dims rotated (a partial rotary passes the rest);
- cache_attention: the step's keys and values scattered into the cache (ScatterND: standard operators cannot update
  an input in place, so the cache is the graph's input `kv_cache` and output `kv_cache_out`), each token's history
  gathered from the cache (rows cachestarts[b] + j, j < max_kvlen), scores by KV-head groups, the causal (and
  sliding-window) rule as a mask, ALiBi's slope x distance added, logn's factor on the queries (in float64, as
  reference.logn_scale), the scores soft-capped where the layer has a cap, softmax.

It takes what the decomposition covers: one rank, float32, the float KV cache in layout 0 and offset mode, the
causal rule (auto_causal), static rope kinds, dense MLPs; anything else is refused in one line (:func:`refusal`).
An op the model calls that this set lacks is an error naming it (runner.kernels.sets.lacking).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from runner.config import EngineConfig
from runner.errors import PmxError
from runner.kernels import reference as ref
from runner.kernels.quant_linear import QuantWeight
from runner.kernels.sets import KernelSet, Layers, lacking

OPSET = 17


def refusal(params, config: EngineConfig, dtype: torch.dtype) -> Optional[str]:
    """What of a model (PmxParams) and its flags this export cannot write, or None."""
    c, p = config, params
    return ("more than one rank" if p.num_shards != 1 else "--quantized_cache true" if c.quantized_cache else
            f"--cache_layout {c.cache_layout}" if c.cache_layout != 0 else "--cache_mode 1" if c.cache_mode else
            "--auto_causal false" if not c.auto_causal else
            "dynamic rope scaling" if ref.rope_type(p.rope_scaling) == "dynamic" else
            "mixture-of-experts" if p.num_experts else f"--dtype {dtype}" if dtype != torch.float32 else None)


def _float(weight) -> torch.Tensor:
    return weight.dequantize(torch.float32) if isinstance(weight, QuantWeight) else weight.float()


class Linear(nn.Module):
    """y = x W^T (+ b) as MatMul over the transposed weight (`{name}.weight_t`) and Add."""

    def __init__(self, weight, bias: Optional[torch.Tensor], comm, gather_output: bool = False, prepack: bool = True,
                 names=()):
        super().__init__()
        name = names[0] if len(names) == 1 else "_".join(names)
        self.register_buffer("weight_t", _float(weight).t().contiguous())
        self.register_buffer("bias", None if bias is None else bias.float())
        self.pmx_names = {"weight_t": f"{name}.weight_t", **({"bias": f"{name}.bias"} if bias is not None else {})}

    def forward(self, x: torch.Tensor, swiglu: bool = False, sp=None) -> torch.Tensor:
        if swiglu or sp is not None:
            raise PmxError("the standard-ops export runs no sequence parallelism and no SwiGLU fused into a linear")
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


class Embedding(nn.Module):
    def __init__(self, weight, hidden_dim: int, comm, dtype: torch.dtype, quant_rows=None, names=()):
        super().__init__()
        self.register_buffer("weight", _float(weight))
        self.pmx_names = {"weight": f"{names[0]}.weight"}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def _no_moe(*args, **kwargs):
    raise PmxError("--opset standard does not take mixture-of-experts (use --opset opmx)")


LAYERS = Layers(column=Linear, row=lambda w, b, comm, prepack=True, names=(): Linear(w, b, comm, names=names),
                embedding=Embedding, moe=_no_moe)


def positions(inputs, T) -> tuple[torch.Tensor, torch.Tensor]:
    """(position, sequence) [T] of each of the step's T new tokens, from seqstarts and start_pos."""
    t = torch.arange(T)
    seq = (inputs.seqstarts[1:][None, :] <= t[:, None]).long().sum(1)
    return inputs.start_pos[seq] + t - inputs.seqstarts[seq], seq


def rotary_step(q: torch.Tensor, k: torch.Tensor, inputs, rotary: ref.Rotary):
    pos, seq = positions(inputs, q.shape[0])
    freqs = pos.float()[:, None] * rotary.inv_freq.float()[None, :]
    if rotary.long_from is not None:  # LongRoPE: by each token's sequence's end in the step
        ends = inputs.start_pos + inputs.seqstarts[1:] - inputs.seqstarts[:-1]
        long = pos.float()[:, None] * rotary.long_inv_freq.float()[None, :]
        freqs = torch.where((ends[seq] > rotary.long_from)[:, None], long, freqs)
    cos, sin = freqs.cos(), freqs.sin()
    if rotary.scale != 1.0:
        cos, sin = cos * rotary.scale, sin * rotary.scale
    return ref.apply_rotary(q, cos, sin), ref.apply_rotary(k, cos, sin)


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs, cache, spec: ref.AttentionSpec):
    """Writes k, v to the cache (rebinding cache.data to the written cache) and attends (see the module docstring)."""
    H, KV, D = spec.heads, spec.kv_heads, spec.head_dim
    pos, seq = positions(inputs, q.shape[0])
    base = inputs.cachestarts[seq]                                                    # (T,)
    slots = base + pos
    layer, zero = torch.full_like(slots, spec.layer), torch.zeros_like(slots)
    data = torch.index_put(cache.data, (slots, layer, zero), k)                       # (MaxT, L, 2, KV, D)
    data = torch.index_put(data, (slots, layer, zero + 1), v)
    cache.data = data
    j = torch.arange(inputs.max_kvlen[0])                                             # (N,)
    rows = torch.minimum(base[:, None] + j[None, :], torch.tensor(data.shape[0]) - 1)  # (T, N)
    kh, vh = data[:, spec.layer, 0][rows], data[:, spec.layer, 1][rows]               # (T, N, KV, D)
    seen = j[None, :] <= pos[:, None]
    if spec.sliding_window:
        seen = seen & (j[None, :] > pos[:, None] - spec.sliding_window)
    if spec.logn_scaling:
        n = pos.double() + 1
        factor = torch.where(n > spec.logn_scaling, torch.log(n) / math.log(spec.logn_scaling), torch.ones_like(n))
        q = q * factor.float()[:, None, None]
    qg = q.reshape(-1, KV, H // KV, D)                                               # (T, KV, G, D)
    scores = ref.soft_cap(qg @ kh.permute(0, 2, 3, 1) * (1.0 / math.sqrt(D)), spec.softcap)  # (T, KV, G, N)
    slopes = spec.alibi_slopes()
    if slopes is not None:
        rel = (j[None, :] - pos[:, None]).float()[:, None, None, :]                   # (T, 1, 1, N)
        scores = scores + slopes.reshape(1, KV, H // KV, 1) * rel
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    out = scores.softmax(-1) @ vh.permute(0, 2, 1, 3)                                 # (T, KV, G, D)
    return out.reshape(-1, H, D)


def kernel_set() -> KernelSet:
    """The standard-ops export's kernel set."""
    name = "onnx export (standard operators)"
    why = "the standard-ops export traces steps from ppl.pmx's inputs"
    return KernelSet(name, ref.skip_rms_norm, lacking(name, "apply_rotary", why), ref.swiglu,
                     lacking(name, "kv_store", why), lacking(name, "kv_load", why), lacking(name, "attend", why),
                     rms_norm=ref.rms_norm, geglu=ref.geglu, rotary_step=rotary_step,
                     cache_attention=cache_attention, layers=LAYERS)
