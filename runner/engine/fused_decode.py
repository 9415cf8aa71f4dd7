"""The decode step of a CPU engine in one C++ call: runner/kernels/cpu_decode.cpp, class `pmx_cpu.DecodeModel`.

A batch-1 decode step on CPU streams every weight once (memory-bound); anything else it does is per-call cost. After the
weights have gone through the caches every torch call is a cold one (15-40 us on the project's CPU), and the compiled
step still made about ten per layer (custom ops through the dispatcher, inductor kernels, the wrapper). Here the step,
from token ids to logits, is one call into C++ that chains this project's CPU kernels (the same ones the eager step
runs, on the same packed weights) without coming back to Python or to torch's dispatcher between two of them; the
tensor-parallel all-reduces and all-gathers go through the ranks' shared-memory workspace from C++ as well.

It serves the steps where every sequence decodes one token and the history is read in place (the plans of
`Transformer.step_inputs` and `forward` for such steps), on engines that :func:`fused_decode` accepts: CPU, float32
activations, the packed float32 / int8 / int4 linears, fused qkv and gate/up, no mixture of experts, one rank or ranks
that share memory. Every other step, and every other engine, runs the torch step (compiled or eager).
`EngineConfig(fused_decode=False)` (--fused_decode false) turns it off.
"""

from __future__ import annotations

from typing import Optional

import torch

from runner.kernels import reference as ref
from runner.kernels.cpu_ext import cpu_ops, pack_blocks
from runner.kernels.linear import PREPACK_MIN_NUMEL, Linear
from runner.kernels.quant_linear import CPU_KERNEL_MAX_ROWS, packed_args

_NONE = torch.empty(0)  # "no tensor" in the class's tensor lists (no scale, no bias, no q/k norm)


def _kind(lin) -> Optional[int]:
    """The C++ kernel kind of a linear layer: 32 float32, 8 int8, 4 int4; None where it has none. A float32 weight left
    plain for its size (under PREPACK_MIN_NUMEL elements: MKL is as fast on it alone, but not worth a call of its own
    here) is taken too, packed into a copy."""
    if isinstance(lin, Linear) and lin.kernel == "plain" and lin.weight.dtype == torch.float32 \
            and lin.weight.numel() < PREPACK_MIN_NUMEL:
        return 32
    args = packed_args(lin)
    return None if args is None else args[2]


def _packed(lin) -> tuple:
    """(packed weight, scale, kind, group) of a linear that has a :func:`_kind`."""
    return packed_args(lin) or (pack_blocks(lin.weight), _NONE, 32, 0)


def why_not(model) -> Optional[str]:
    """Why `model` (a runner.engine.model.Transformer) cannot run its decode step in one call, or None if it can."""
    c, p = model.config, model.params
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return f"{model.device.type} {model.dtype}: it runs float32 on CPU"
    if cpu_ops() is None:
        return "this project's CPU extension could not be built"
    if model.ops.decode_attention_rows is None or not c.fused_kvcache:
        return f"--kernels {c.kernels} / fused_kvcache={c.fused_kvcache}: decode does not read the cache in place"
    if p.num_experts:
        return "mixture-of-experts layers"
    if model.comm.world_size > 1 and model.comm.shm is None:
        return "ranks that do not share a shared-memory workspace"
    for layer in model.layers:
        a, f = layer.attention, layer.feed_forward
        if len(a.qkv) != 1 or len(f.gate_up) != 1:
            return "unfused qkv or gate/up linears (fused_qkv / fused_ffn_glu off)"
        if any(_kind(m.linear) is None for m in (a.qkv[0], a.wo, f.gate_up[0], f.w2)):
            return "a linear layer on a kernel other than the packed CPU ones (prepack off)"
    if _kind(model.output.linear) is None:
        return "the vocabulary projection is not on a packed CPU kernel"
    return None


class OneCallDecode:
    """Step runner: a model's decode step as one `pmx_cpu.DecodeModel.step` call (see the module's docstring). The
    C++ object points at the engine's packed weights (and keeps them alive); only float32 weights too small to have
    been packed at load get packed copies of their own."""
    name = "one-call C++ step"
    why_not = staticmethod(why_not)

    def __init__(self, model):
        p, comm = model.params, model.comm
        norms, lins, row_bias = [], [], []
        for layer in model.layers:
            a, f = layer.attention, layer.feed_forward
            norms += [layer.attention_norm.weight, layer.ffn_norm.weight,
                      _NONE if a.q_norm is None else a.q_norm.float().contiguous(),
                      _NONE if a.k_norm is None else a.k_norm.float().contiguous()]
            lins += [a.qkv[0].linear, a.wo.linear, f.gate_up[0].linear, f.w2.linear]
            row_bias += [None, a.wo.bias, None, f.w2.bias]  # row-parallel biases: added after the all-reduce
        norms.append(model.norm.weight)
        lins.append(model.output.linear)
        row_bias.append(None)
        packed = [_packed(lin) for lin in lins]
        biases = [rb if rb is not None else (lin.bias if lin.bias is not None else _NONE)
                  for lin, rb in zip(lins, row_bias)]
        shm = comm.shm if comm.world_size > 1 else None
        self.comm = comm
        self.vocab_size = p.vocab_size
        self.paged = model.config.paged
        self.layout = model.config.cache_layout
        self._model = torch.classes.pmx_cpu.DecodeModel(
            model.tok_embeddings.weight.contiguous(), norms, [w for w, _, _, _ in packed], [s for _, s, _, _ in packed],
            [b.float().contiguous() if b.numel() else b for b in biases], [k for _, _, k, _ in packed],
            [g for _, _, _, g in packed],
            [p.num_layers, p.hidden_dim, model.heads, model.kv_heads, model.head_dim, p.sliding_window or 0,
             CPU_KERNEL_MAX_ROWS, model.output.linear.out_features],
            float(p.norm_eps), _NONE.to(torch.uint8) if shm is None else shm.workspace, comm.rank, comm.world_size,
            0.0 if shm is None else float(shm.deadline_s))

    def accepts(self, plan, cache) -> bool:
        return (plan.decode_only and plan.decode.kv_slots is None
                and cache.data.dtype == (torch.int8 if cache.scale is not None else torch.float32))

    def __call__(self, tokens: torch.Tensor, plan, cache) -> torch.Tensor:
        """Logits [B, vocab] float32 of a decode-only plan whose history is read in place (plan.decode.kv_slots None)."""
        d = plan.decode
        with self.comm.guard("decode step"):
            logits = self._model.step(tokens, cache.data, cache.scale, self.layout, plan.slots, plan.cos, plan.sin,
                                      d.cachestarts, d.kvlens, ref.PAGE_SIZE if self.paged else 0)
        return logits if logits.shape[1] == self.vocab_size else logits[:, : self.vocab_size]

