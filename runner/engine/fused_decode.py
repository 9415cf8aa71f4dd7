"""The decode step of a CPU engine in one C++ call (runner/kernels/cpu_decode.cpp): the eager step's kernels on the same
packed weights, chained without Python or torch's dispatcher between them (their per-call cost is what it saves), driven
by a description of the model's own layers. Each layer's :class:`LayerFeatures` name what it computes and
`DecodeModel.features()` what the C++ step does; a model with a feature outside them keeps the torch step
(:meth:`OneCallDecode.why_not` names it). `--fused_decode false` turns it off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch
from torch import nn

from runner.kernels import reference as ref
from runner.kernels.cpu_ext import cpu_ops, pack_blocks
from runner.kernels.linear import PACKED_DTYPES, PREPACK_MIN_NUMEL, Linear
from runner.kernels.quant_linear import CPU_KERNEL_MAX_ROWS, QuantWeight, packed_args
from runner.parallel.layers import RowParallelLinear


@dataclass(frozen=True)
class LayerFeatures:
    """What one decoder layer computes, read from its modules; :meth:`names`: what a runner must support to run it."""
    position: str         # "rotary": interleaved pairs of all head_dim; "rotary_partial": of its first dims; "alibi":
                          # no rotary, a bias per head on the scores
    mlp: str              # "swiglu" or "geglu" (FeedForward), or "moe"
    linears: str          # "packed_linears": this project's CPU kernels (float32, bf16, fp16, int8, int4); else
                          # "other_linears"
    split_qkv: bool       # q, k, v in linears of their own (fused_qkv off)
    split_gate_up: bool   # gate and up in linears of their own (fused_ffn_glu off)
    qkv_bias: bool
    o_bias: bool
    ffn_bias: bool
    qk_norm: bool         # per-head RMSNorm of q and k before rotary
    post_norms: bool      # the attention's and the MLP's outputs RMS-normed before the residual adds
    sliding_window: bool
    attn_softcap: bool    # the scores soft-capped

    def names(self) -> list[str]:
        """Field by field: a str field's value, a true bool field's name."""
        return [v if isinstance(v, str) else f.name for f in fields(self) if (v := getattr(self, f.name))]


def _packable(lin) -> bool:
    """On this project's packed CPU kernels (float32, bfloat16, float16, int8, int4), or a float weight left plain for
    its size (packed here)."""
    return packed_args(lin) is not None or (isinstance(lin, Linear) and lin.kernel == "plain" and lin.weight.dtype
                                            in PACKED_DTYPES and lin.weight.numel() < PREPACK_MIN_NUMEL)


def layer_features(model, i: int) -> LayerFeatures:
    """The features of decoder layer i of `model` (a runner.engine.model.Transformer)."""
    layer, moe = model.layers[i], model.params.num_experts > 0
    a, f = layer.attention, layer.feed_forward
    rotary_dims = 2 * model.rotary.inv_freq.numel()  # the dims rotated: as many pairs as frequencies
    lins = [*(m.linear for m in a.qkv), a.wo.linear] + ([] if moe else [*(m.linear for m in f.gate_up), f.w2.linear])
    position = "alibi" if a.alibi is not None else "rotary" if rotary_dims == a.head_dim else "rotary_partial"
    return LayerFeatures(
        position=position, mlp="moe" if moe else "geglu" if f.gelu else "swiglu",
        linears="packed_linears" if all(map(_packable, lins)) else "other_linears",
        split_qkv=len(a.qkv) != 1, split_gate_up=not moe and len(f.gate_up) != 1,
        qkv_bias=any(m.linear.bias is not None for m in a.qkv), o_bias=a.wo.bias is not None,
        ffn_bias=not moe and (f.w2.bias is not None or any(m.linear.bias is not None for m in f.gate_up)),
        qk_norm=a.q_norm is not None, post_norms=not isinstance(layer.post_attention_norm, nn.Identity),
        sliding_window=bool(a.window), attn_softcap=bool(a.softcap))


def first_unsupported(features: list[LayerFeatures], supported) -> Optional[str]:
    """Which layer first has a feature outside `supported`, and which feature; None where every one is in."""
    return next((f"layer {i} has {n}, which it does not support" for i, lf in enumerate(features) for n in lf.names()
                 if n not in supported), None)


def decode_reads_cache_in_place(model) -> bool:
    """Whether decode attention reads the history in place from the cache (plans carry no row table), as here."""
    return model.config.fused_kvcache and model.ops.decode_attention_rows is not None


def _linear(m, what: str):
    """The pmx_cpu.Linear of a column- or row-parallel layer `m` (row-parallel: its bias added after the sum)."""
    reduced, bias = isinstance(m, RowParallelLinear), m.bias if isinstance(m, RowParallelLinear) else m.linear.bias
    w, scale, kind, group = packed_args(m.linear) or (
        pack_blocks(m.linear.weight), torch.empty(0), 32 if m.linear.weight.dtype == torch.float32 else 16, 0)
    return torch.classes.pmx_cpu.Linear(weight=w, scale=scale, bias=None if bias is None else bias.float().contiguous(),
                                        kind=kind, group=group, out_features=m.linear.out_features, reduced=reduced,
                                        what=what)


class OneCallDecode:
    """Step runner: a model's decode steps as `pmx_cpu.DecodeModel.step` calls, on the engine's packed weights (kept
    alive), under the communicator's watchdog (the collectives run inside the call)."""

    name = "one-call C++ decode"

    @staticmethod
    def why_not(model) -> Optional[str]:
        """Why `model` (a runner.engine.model.Transformer) cannot run its decode steps here, or None if it can."""
        o, comm = model.config, model.comm
        if not o.fused_decode:
            return "turned off (fused_decode=False)"
        if model.device.type != "cpu" or model.dtype != torch.float32:
            return f"{model.device.type} {model.dtype}: it runs float32 on CPU"
        if cpu_ops() is None:
            return "this project's CPU extension could not be built"
        if not decode_reads_cache_in_place(model):
            return f"--kernels {o.kernels} / fused_kvcache={o.fused_kvcache}: decode does not read the cache in place"
        if comm.world_size > 1 and comm.shm is None:
            return "ranks that do not share a shared-memory workspace"
        why = first_unsupported([layer_features(model, i) for i in range(len(model.layers))],
                                torch.classes.pmx_cpu.DecodeModel.features())
        return why if why is not None or _packable(model.output.linear) else "output has other_linears"

    def __init__(self, model):
        self.comm = comm = model.comm
        shm = comm.shm if comm.world_size > 1 else None
        layers = []
        for i, layer in enumerate(model.layers):
            a = layer.attention
            qkv, wo, gate_up, w2 = (_linear(layer.get_submodule(p), f"layers.{i}.{p}") for p in (
                "attention.qkv.0", "attention.wo", "feed_forward.gate_up.0", "feed_forward.w2"))
            post = [None if isinstance(n, nn.Identity) else n.weight
                    for n in (layer.post_attention_norm, layer.post_ffn_norm)]
            layers.append(torch.classes.pmx_cpu.Layer(
                index=i, attention_norm=layer.attention_norm.weight, ffn_norm=layer.ffn_norm.weight, q_norm=a.q_norm,
                k_norm=a.k_norm, qkv=qkv, wo=wo, gate_up=gate_up, w2=w2, heads=a.heads, kv_heads=a.kv_heads,
                head_dim=a.head_dim, window=a.window or 0, eps=layer.attention_norm.eps,
                rotary_dim=2 * model.rotary.inv_freq.numel(), alibi=a.alibi, post_attention_norm=post[0],
                post_ffn_norm=post[1], gelu=layer.feed_forward.gelu, scale=a.q_mult / math.sqrt(a.head_dim),
                softcap=a.softcap, rope=a.rope))
        self.vocab_size, self.layout, self.paged = model.params.vocab_size, model.config.cache_layout, model.config.paged
        emb = model.tok_embeddings.weight  # float32, or a QuantWeight dequantised as its rows are gathered
        quant = isinstance(emb, QuantWeight)
        scale = None if not quant else emb.scale.float() if emb.offset is None else \
            torch.stack((emb.scale.float(), emb.offset.float()))  # offsets ride with the scales (cpu_decode.cpp)
        self._model = torch.classes.pmx_cpu.DecodeModel(
            embedding=(emb.qweight if quant else emb).contiguous(),
            embedding_scale=None if scale is None else scale.contiguous(),
            embedding_group=emb.scheme.group_size if quant else 0, layers=layers, norm=model.norm.weight,
            eps=model.norm.eps, output=_linear(model.output, "output"), dequant_above=CPU_KERNEL_MAX_ROWS,
            workspace=torch.empty(0, dtype=torch.uint8) if shm is None else shm.workspace, rank=comm.rank,
            world=comm.world_size, deadline_s=0.0 if shm is None else float(shm.deadline_s),
            embedding_multiplier=model.embedding_scale, final_softcap=model.final_softcap or 0.0)

    @staticmethod
    def accepts(plan, cache) -> bool:
        """A step where every sequence decodes one token, its history read in place, on a float32 or int8 cache, with
        no logn scaling of its queries (a step past a logn model's length runs on the next runner)."""
        return (plan.decode_only and plan.decode.kv_slots is None and plan.q_scale is None
                and cache.data.dtype == (torch.int8 if cache.scale is not None else torch.float32))

    def __call__(self, tokens: torch.Tensor, plan, cache) -> torch.Tensor:
        """Logits [B, vocab] float32 of a step it :meth:`accepts`."""
        d = plan.decode
        with self.comm.guard("decode step"):
            logits = self._model.step(tokens, cache.data, cache.scale, self.layout, plan.slots, plan.cos, plan.sin,
                                      d.cachestarts, d.kvlens, ref.PAGE_SIZE if self.paged else 0)
        return logits if logits.shape[1] == self.vocab_size else logits[:, : self.vocab_size]

