"""How steps run: step runners behind one interface, chained by the Stepper.

A runner is any object with a `name`, `accepts(plan, cache) -> bool` and `__call__(tokens, plan, cache) -> logits`
(:class:`StepRunner`). The Stepper plans a step (runner.engine.plan) and hands it to the first runner of its chain
that accepts it; the last one, :class:`Eager`, accepts every step, so a runner that lacks a feature declines and
the step still runs. The chain is built once from what the engine declares (EngineConfig, the kernel set's
optional ops, the communicator's shared memory and graph capture), most specialised first:

- CUDA graphs of the decode step, one per batch bucket (runner.engine.graphs);
- the CPU decode step as one C++ call (runner.engine.fused_decode);
- torch.compile of the decode step (:class:`Compiled`);
- eager, with sequence parallelism between the row-parallel layers at TP > 1 on CPU (:class:`Eager`).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from types import FunctionType, MethodType
from typing import Optional, Protocol

import torch

from runner.config import EngineConfig
from runner.engine.cache import KVCache
from runner.engine.fused_decode import OneCallDecode
from runner.engine.graphs import CudaGraphs, bucket_of
from runner.engine.model import Transformer
from runner.engine.plan import DecodeInputs, PlanSpec, StepLengths, StepPlan, causal_mask, lengths_of_inputs, make_plan
from runner.errors import PmxError
from runner.parallel.layers import SeqParallel

COMPILE_MIN_PARAMS = 32_000_000  # compile="auto" compiles models of this many parameters per rank (CPU) and up


class StepRunner(Protocol):
    name: str

    def accepts(self, plan: StepPlan, cache: KVCache) -> bool: ...

    def __call__(self, tokens: torch.Tensor, plan: StepPlan, cache: KVCache) -> torch.Tensor: ...


class Eager:
    """Every step, module by module; sequence-parallel where `sp` is given and the step's rows fit its workspace.
    `fuse` False: every module runs for every step (no norms inside the linears), as per-layer hooks need."""

    def __init__(self, model: Transformer, sp: Optional[SeqParallel], fuse: bool = True):
        self.model, self.sp, self.fuse = model, sp, fuse
        self.name = "eager, sequence-parallel" if sp is not None else "eager"

    def accepts(self, plan: StepPlan, cache: KVCache) -> bool:
        return True

    def __call__(self, tokens, plan, cache):
        sp = self.sp if self.sp is not None and self.sp.shm.fits(tokens.shape[0], self.model.params.hidden_dim) \
            else None
        return self.model(tokens, plan, cache, sp, self.fuse)


class Compiled:
    """The decode step under torch.compile(fullgraph=True): one graph serves every batch size and history length
    (their dims are marked dynamic), recompiled only for the variants whose structure differs."""
    name = "torch.compile"

    def __init__(self, model: Transformer, required: bool):
        self.model, self.required, self.variants = model, required, set()
        self.fn, self.failed = None, False  # made on the first step it takes (torch.compile loads dynamo: ~3 s)

    def accepts(self, plan, cache) -> bool:
        return not self.failed and plan.decode_only

    def _compile(self):
        # Guards on the module tree (~1000 attributes, checked every call) are dropped: they never change after load.
        # Dynamo keys graphs by code object, so this engine compiles a code object of its own: another engine in the
        # process (other constants, same shapes) never reuses its graphs. cpp_wrapper: the graph's kernel calls are
        # made from C++.
        run = MethodType(FunctionType(Transformer.forward.__code__.replace(), Transformer.forward.__globals__,
                                      "forward", Transformer.forward.__defaults__), self.model)
        return torch.compile(run, fullgraph=True, options={
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "cpp_wrapper": True})

    def __call__(self, tokens, plan, cache):
        if self.fn is None:
            self.fn = self._compile()
        d = plan.decode
        variant = (d.batch == 1, d.kv_slots is None, tuple(m is None for m in d.masks.values()),
                   d.cachestarts.dim() == 2 and d.cachestarts.shape[1] == 1)
        try:
            if variant in self.variants:
                with self.model.comm.guard("decode step"):
                    return self.fn(tokens, plan, cache)
            _mark_dynamic(tokens, plan, cache)  # this call compiles: no collective timeout on it
            logits = self.fn(tokens, plan, cache)
            self.variants.add(variant)
            return logits
        except Exception as e:  # noqa: BLE001 - compile="auto": a machine that cannot compile runs eagerly
            if self.required or not _is_compile_error(e):
                raise
            print(f"rank {self.model.comm.rank}: warning: torch.compile of the decode step failed, running it "
                  f"eagerly ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", file=sys.stderr,
                  flush=True)
            self.failed = True
            return self.model(tokens, plan, cache)


def _mark_dynamic(tokens: torch.Tensor, plan: StepPlan, cache: KVCache) -> None:
    """The dims of a decode step that vary from step to step (batch, history length, cache rows); heads, head_dim
    and layers stay static, so the kernels are specialised to them."""
    mark, d = torch._dynamo.maybe_mark_dynamic, plan.decode
    for t in (tokens, plan.slots, d.cachestarts, d.kvlens):
        mark(t, 0)
    for t in (plan.cos, plan.sin):  # [ropes, B, D/2]
        mark(t, 1)
    if d.kv_slots is not None:
        mark(d.kv_slots, 0)
        mark(d.kv_slots, 1)
    if d.cachestarts.dim() == 2:
        mark(d.cachestarts, 1)
    for mask in d.masks.values():
        if mask is not None:
            mark(mask, 0)
            mark(mask, 3)
    for t in (cache.data, cache.scale):
        if t is not None:
            mark(t, cache.layout)  # layout k keeps its MaxT rows in dim k (reference.cache_shape)


def _is_compile_error(e: Exception) -> bool:
    mod = type(e).__module__ or ""
    return mod.startswith("torch._dynamo") or mod.startswith("torch._inductor") or "CppCompileError" in type(e).__name__


def seq_parallel(model: Transformer, config: EngineConfig) -> Optional[SeqParallel]:
    """Sequence parallelism for the eager step, or None: it needs TP > 1 on the ranks' shared memory, float32 on CPU
    with the torch kernels, and a dense model without row-parallel biases (a bias is added once, after the
    all-reduce) or post norms (which norm the attention's and the MLP's whole outputs, not partial sums)."""
    p, comm = model.params, model.comm
    if (not config.seq_parallel or comm.shm is None or comm.world_size == 1 or model.device.type != "cpu"
            or model.dtype != torch.float32 or model.ops.name != "torch" or p.o_bias or p.ffn_bias or p.num_experts
            or p.post_norms):
        return None
    return SeqParallel(comm, model.ops.skip_rms_norm)


def compiled(model: Transformer, config: EngineConfig) -> Optional[Compiled]:
    """torch.compile of the decode step per config.compile (auto: on CPU for dense models of COMPILE_MIN_PARAMS+)."""
    if config.compile == "off" or (config.compile == "auto" and (
            model.device.type != "cpu" or model.params.num_experts or model.num_params < COMPILE_MIN_PARAMS)):
        return None
    if model.params.num_experts:
        raise PmxError("--compile on: mixture-of-experts steps route tokens by value and do not compile; use "
                       "--compile off")
    return Compiled(model, required=config.compile == "on")


class Stepper:
    """Plans the steps of one model and runs each on the first runner of its chain that accepts it."""

    def __init__(self, model: Transformer, config: EngineConfig):
        c, ops, comm = config, model.ops, model.comm
        self.model, self.config = model, c
        p = model.params
        self.spec = PlanSpec(tuple(model.rotaries), model.device, c.paged,
                             tuple(sorted({p.layer_window(i) for i in range(p.num_layers)})), not c.fused_kvcache,
                             c.quantized_cache, ops.prefill_attention is None, not ops.reads_history_in_place,
                             p.logn_scaling)
        graphs = (c.cuda_graphs and model.device.type == "cuda" and ops.decode_attention is not None
                  and not model.params.num_experts and comm.captures_cuda_graphs)
        in_place = not self.spec.gather_decode and c.fused_kvcache
        self.decode_inputs = DecodeInputs(self.spec, bucket_of if graphs else int) if in_place else None
        one_call = OneCallDecode(model) if OneCallDecode.why_not(model) is None else None
        runners = [CudaGraphs(model, self.decode_inputs) if graphs else None, one_call, compiled(model, c),
                   Eager(model, seq_parallel(model, c))]
        self.runners: list[StepRunner] = [r for r in runners if r is not None]
        self.force_eager = False   # set while a per-layer dump runs a step (runner.engine.layer_dump)
        self.eager = Eager(model, None, fuse=False)

    def describe(self) -> str:
        """Which runner serves which kind of step (said once at start-up)."""
        decode = [r.name for r in self.runners[:-1]]
        return f"decode steps: {', else '.join(decode + [self.runners[-1].name])}; other steps: {self.runners[-1].name}"

    def plan(self, b: StepLengths, attn_mask: Optional[torch.Tensor] = None, spec: Optional[PlanSpec] = None
             ) -> tuple[torch.Tensor, StepPlan]:
        """(token ids, plan) of a step; a decode step is written into the persistent decode inputs where the engine
        reads histories in place (that plan holds until the next step of its size is planned), as is a rowwise one
        (speculative verification: a decoding row per new token, every row's logits)."""
        if spec is None and self.decode_inputs is not None and (b.num_decoding == len(b.seqlens) or b.rowwise):
            got = self.decode_inputs.write(b.tokens, *((b.start, b.caches) if not b.rowwise else b.rows()))
            if got is not None:
                return got
        if attn_mask is None:
            attn_mask = self.mask(b)
        return torch.tensor(b.tokens, dtype=torch.int64), make_plan(b, spec or self.spec, attn_mask)

    def mask(self, b: StepLengths) -> Optional[torch.Tensor]:
        """The explicit causal mask a step takes with auto_causal off (None otherwise): with the window where every
        layer has it (layers of both kinds cut their own windows on top of a plain causal one)."""
        return None if self.config.auto_causal else causal_mask(b, self.model.params.uniform_window, self.model.dtype)

    def run(self, tokens: torch.Tensor, plan: StepPlan, cache: KVCache) -> torch.Tensor:
        """float32 logits of the plan's wanted rows; the cache updated in place. (No autograd: no tensor of the model
        requires a gradient, so a step needs no inference-mode guard, whose entry alone costs tens of us cold.)"""
        tokens = tokens.to(self.model.device)
        if self.force_eager:  # module by module, every row on every rank: what per-layer hooks see
            return self.eager(tokens, plan, cache)
        for runner in self.runners:
            if runner.accepts(plan, cache):
                return runner(tokens, plan, cache)
        raise AssertionError("the eager runner accepts every step")

    def cache(self, kv_cache: torch.Tensor, kv_scale: Optional[torch.Tensor]) -> KVCache:
        if self.config.quantized_cache != (kv_scale is not None):
            raise PmxError("kv_scale must be given exactly when the cache is quantised")
        return KVCache(kv_cache, kv_scale, self.config.cache_layout, self.model.ops)

    def forward(self, token_ids, attn_mask, seqstarts, kvstarts, cachestarts, decoding_batches, start_pos, max_seqlen,
                max_kvlen, kv_cache, kv_scale=None) -> torch.Tensor:
        """ppl.pmx's dynamic-batching step: float32 logits [B, vocab] of each sequence's last token.

        token_ids [T] new tokens, seqstarts/kvstarts [B+1] prefix sums of new / total lengths, cachestarts [B]
        (offset) or [B, MaxP] (paged), decoding_batches: how many leading sequences decode one token, start_pos [B]
        position of each sequence's first new token, max_seqlen / max_kvlen: maxima of the lengths, kv_cache /
        kv_scale: the cache, updated in place. Planned and run exactly as the engine's own steps."""
        cache, spec = self.cache(kv_cache, kv_scale), None
        if self.model.ops.decode_attention_rows is not None and kv_cache.dtype not in (torch.float32, torch.int8):
            spec = replace(self.spec, gather_decode=True)  # (e.g. a GPU dump's float16 cache: rows gathered and cast)
        try:
            b = lengths_of_inputs(seqstarts, kvstarts, cachestarts, decoding_batches, start_pos, token_ids)
            tokens, plan = self.plan(b, None if attn_mask is None or not attn_mask.numel() else
                                     attn_mask.to(self.model.device), spec)
        except ValueError as e:
            raise PmxError(f"bad step inputs: {e}") from None
        return self.run(tokens, plan, cache)
