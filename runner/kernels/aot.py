"""Ahead-of-time compiles of the Triton kernels for NVIDIA GPUs, on a machine without one.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` runs Triton's whole pipeline down to
ptxas (which ships in the triton wheel) with no driver, which catches what the interpreter cannot: code that
does not compile for a real GPU, and register spills. The specialisations compiled are the engine's own:
each op's wrapper is called on meta tensors shaped as the engine's tensors are (models with head_dim 64, 128 and
256, float16 and bfloat16, every cache layout, offset and paged, float and int8 caches, decode and prefill
batches, a partial rotary (ChatGLM3), ALiBi (Baichuan2-13B), GeGLU and soft-capped scores (Gemma 2), the windowed
and full layers of Gemma 3, the batch-1 decode linears plain and with their fusions: norms inside, residuals added,
the qkv's rotary + cache-store epilogue, int8 / int4 weights, programmatic dependent launch on sm_90; decode
attention merging its splits inside or with the merge kernel), with a `launch` that records the kernel, its
arguments and the block sizes / warps the wrapper picked instead of launching; each recorded launch is specialised
exactly as a launch on a GPU would be (Triton's own argument binder: types, 16-byte alignment and divisibility of
the integers) and compiled for each target.

    python -m runner.kernels.aot [--arch 80,90] [--json FILE] [--cover 2]

prints one line per distinct compile (kernel, registers, spill bytes, what it serves) and exits 1 if a
kernel spills or a Triton kernel of runner.kernels.triton_ops / triton_quant was not compiled. Must run
without TRITON_INTERPRET (under the interpreter the kernels are not compilable objects). tests/test_triton_aot.py
runs it with `--cover 2` (every pair of choices made together compiled, in about a third of the time).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, KernelInterface, create_function_from_signature

from runner.engine.cache import new_cache
from runner.kernels import triton_ops, triton_quant
from runner.kernels.linear import QuantRows, RotaryStore
from runner.kernels.reference import DecodeSplits, ScoreMods

META = torch.device("meta")
H100_SMS = 132            # the split count of decode attention follows the SM count (triton_ops.decode_splits)


@dataclass(frozen=True)
class ModelShape:
    """The per-rank shapes of a model the engine runs."""
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int = 32
    window: Optional[int] = None
    rotary_dim: Optional[int] = None   # a partial rotary's dims (None: all of head_dim)
    alibi: bool = False                # ALiBi instead of rotary (the attention kernels add the slopes' bias)
    gelu: bool = False                 # GeGLU (its own kernel: the down projection takes no fused SwiGLU input)
    softcap: float = 0.0               # the scores soft-capped (Gemma 2)
    full_layers: bool = False          # layers without the window too (Gemma's global ones)


MODELS = (
    ModelShape("llama-2-7b", 4096, 32, 32, 128, 11008),
    ModelShape("llama-3-8b", 4096, 32, 8, 128, 14336),
    ModelShape("llama-3.2-1b", 2048, 32, 8, 64, 8192, layers=16),
    ModelShape("mistral-7b-window", 4096, 32, 8, 128, 14336, window=4096),
    ModelShape("chatglm3-6b", 4096, 32, 2, 128, 13696, layers=28, rotary_dim=64),
    ModelShape("baichuan2-13b-alibi", 5120, 40, 40, 128, 13696, layers=40, alibi=True),
    ModelShape("gemma-2-9b", 3584, 16, 8, 256, 14336, layers=42, window=4096, gelu=True, softcap=50.0,
               full_layers=True),
    ModelShape("gemma-3-4b", 2560, 8, 4, 256, 10240, layers=34, window=1024, gelu=True, full_layers=True),
)
WIDE_NORMS = (8192, 16384)   # hidden sizes of 70B / 405B models: the norm's warps grow with the width
DTYPES = (torch.float16, torch.bfloat16)
BF16_MODELS = ("llama-3-8b", "llama-3.2-1b")  # bfloat16 on one model per head_dim (keeps CI's compile time down)
CACHE_ROWS = 65536


@dataclass
class Launch:
    kernel: Any
    grid: tuple
    args: tuple
    kwargs: dict
    labels: list = field(default_factory=list)
    min_arch: int = 0          # compiled for targets from this compute capability (PDL: 90)


def record(op, *args, **kwargs) -> list[Launch]:
    """The kernel launches `op(*args, **kwargs)` makes, recorded instead of launched."""
    out: list[Launch] = []
    op(*args, **kwargs, launch=lambda kernel, grid, *a, **kw: out.append(Launch(kernel, grid, a, kw)))
    return out


def engine_launches(models=MODELS, dtypes=DTYPES) -> list[Launch]:
    """Every launch the engine's Triton ops make over the given models and dtypes, labelled."""
    found: list[Launch] = []

    def add(label: str, op, *args, **kwargs):
        for ln in record(op, *args, **kwargs):
            ln.labels.append(label)
            ln.min_arch = 90 if kwargs.get("pdl") else 0
            found.append(ln)

    for dt in dtypes:
        name = str(dt).replace("torch.", "")
        for width in WIDE_NORMS:
            x = torch.empty(4, width, dtype=dt, device=META)
            add(f"norm {width} {name}", triton_ops.skip_rms_norm, x, x, x[0], 1e-5)
        for m in models:
            if dt == torch.bfloat16 and m.name not in BF16_MODELS:
                continue
            H, KV, D = m.heads, m.kv_heads, m.head_dim
            tag = f"{m.name} {name}"
            for T in (1, 512):      # decode and prefill rows
                x = torch.empty(T, m.hidden, dtype=dt, device=META)
                add(f"{tag} norm", triton_ops.skip_rms_norm, x, x, x[0], 1e-5)
                add(f"{tag} norm (no residual)", triton_ops.skip_rms_norm, x, None, x[0], 1e-5)
                gate_up = torch.empty(T, 2 * m.intermediate, dtype=dt, device=META)
                glu = triton_ops.geglu if m.gelu else triton_ops.swiglu
                add(f"{tag} {'geglu' if m.gelu else 'swiglu'}", glu, *gate_up.chunk(2, dim=-1))
                # int8 in groups of 32 and int4 with offsets: GGUF's Q8_0 and Q4_1
                for method, group, offset in (("int8", 0, False), ("int4", 128, False), ("int4", 16, False),
                                              ("int8", 32, False), ("int4", 32, True)):
                    qw = torch.empty(m.hidden, m.hidden // (2 if method == "int4" else 1), device=META,
                                     dtype=torch.uint8 if method == "int4" else torch.int8)
                    scale = torch.empty((m.hidden, m.hidden // group) if group else (m.hidden,), device=META)
                    off = scale if offset else None
                    kind = f"{method} g{group}{' offsets' if offset else ''}"
                    add(f"{tag} {kind} linear, {T} rows", triton_quant.quant_matmul, x, qw, scale, method, group, off)
                    ids = torch.empty(T, dtype=torch.int64, device=META)
                    emb = torch.empty(32000, qw.shape[1], dtype=qw.dtype, device=META)
                    es = torch.empty((32000, m.hidden // group) if group else (32000,), device=META)
                    add(f"{tag} {kind} embedding, {T} rows", triton_quant.quant_embedding, ids, emb, es, method, group,
                        dt, es if offset else None)
            _decode_linears(add, m, dt, tag)
            slots = torch.empty(512, dtype=torch.int64, device=META)
            cos = torch.empty(512, (m.rotary_dim or D) // 2, dtype=torch.float32, device=META)
            counts = torch.empty(256 * KV, dtype=torch.int32, device=META)   # (max_batch x KV heads)
            alibi = torch.empty(H, dtype=torch.float32, device=META) if m.alibi else None
            mods = ScoreMods(alibi, m.softcap)
            qkv = torch.empty(512, (H + 2 * KV) * D, dtype=dt, device=META)
            q, k, v = (t.view(512, -1, D) for t in qkv.split([H * D, KV * D, KV * D], dim=-1))
            add(f"{tag} rotary", triton_ops.apply_rotary, q, cos, cos)
            for layout in range(4):
                for quant in (False, True):
                    cache, scale = new_cache(layout, m.layers, CACHE_ROWS, KV, D, dt, META, quant)
                    ctag = f"{tag} layout {layout}{' int8' if quant else ''}"
                    add(f"{ctag} rotary+store", triton_ops.rotary_kv_store, q, k, v, cos, cos, cache, scale, layout,
                        3, slots)
                    add(f"{ctag} store", triton_ops.kv_store, cache, scale, layout, 3, k, v, slots)
                    for mode, window in ((mode, w) for mode in (0, 1)
                                         for w in ((m.window, None) if m.full_layers else (m.window,))):
                        full = " full layer" if m.full_layers and not window else ""
                        mtag = f"{ctag} {'paged' if mode else 'offset'}{full}"
                        # batch 1 splits the keys: merged inside in the serving set-up (layout 2, paged), else by
                        # the merge kernel (the merge adds no specialisation the layouts would not share)
                        for B, merge in ((1, layout == 2 and mode == 1), (64, False)):
                            starts = torch.empty((B, 32) if mode else (B,), dtype=torch.int64, device=META)
                            kvlens = torch.empty(B, dtype=torch.int64, device=META)
                            qd = torch.empty(B, (H + 2 * KV) * D, dtype=dt, device=META)[:, : H * D].view(B, H, D)
                            add(f"{mtag} decode B={B}{' merge inside' if merge else ''}", triton_ops.decode_attention,
                                qd, cache, scale, layout, 3, starts, kvlens, mode, window, mods=mods,
                                splits=DecodeSplits(triton_ops.decode_splits(B, KV, H100_SMS),
                                                    counts if merge else None))
                        starts = torch.empty((2, 32) if mode else (2,), dtype=torch.int64, device=META)
                        add(f"{mtag} prefill", triton_ops.prefill_attention, q, cache, scale, layout, 3, starts,
                            torch.empty(2, dtype=torch.int64, device=META), mode, 256, window, mods=mods)
    return found


QUANT_DECODE = (("int8", 0, False), ("int8", 32, False), ("int4", 128, False), ("int4", 32, True))
QUANT_DECODE_MODELS = ("llama-2-7b",)   # the quantised decode linears on one model (keeps CI's compile time down)


def _decode_linears(add, m: ModelShape, dt: torch.dtype, tag: str) -> None:
    """The batch-1 decode linears (triton_ops.decode_linear) as the engine calls them: unfused (qkv with its bias, o,
    gate/up, down taking the SwiGLU input, the output head), with the norms inside (qkv, gate/up, head) and the
    residual added (o, down), the qkv's rotary + cache-store epilogue (float and int8 caches), PDL (sm_90), and the
    quantised weights (o with its residual, gate/up with its norm: their weight tiles) on QUANT_DECODE_MODELS."""
    H, KV, D = m.heads, m.kv_heads, m.head_dim
    rows = triton_ops.DECODE_LINEAR_ROWS
    qkv_n = (H + 2 * KV) * D
    norm = (torch.empty(m.hidden, dtype=dt, device=META), 1e-5)
    res = torch.empty(rows, m.hidden, dtype=dt, device=META)
    bias = torch.empty(qkv_n, dtype=dt, device=META)
    slots = torch.empty(rows, dtype=torch.int64, device=META)
    cos = torch.empty(rows, (m.rotary_dim or D) // 2, dtype=torch.float32, device=META)

    def rotaries():
        for quant in (False, True):
            cache, scale = new_cache(2, m.layers, CACHE_ROWS, KV, D, dt, META, quant)
            yield quant, RotaryStore(cos, cos, slots, cache, scale, 2, 3, H, KV, D)

    def linears(weight, quant=None, kind=""):
        """(label, x, weight, options) of each call; `weight(n, k)` makes the stored weight, `quant(n, k)` its
        QuantRows."""
        shapes = {"qkv": (qkv_n, m.hidden), "o": (m.hidden, H * D), "gate_up": (2 * m.intermediate, m.hidden),
                  "down": (m.hidden, m.intermediate), "head": (32000, m.hidden)}

        def call(name, label, **kw):
            n, k = shapes[name]
            x = torch.empty(rows, 2 * k if kw.get("swiglu") else k, dtype=dt, device=META)
            q = {} if quant is None else {"quant": quant(n, k)}
            add(f"{tag}{kind} decode linear {name} {n}x{k}{label}", triton_ops.decode_linear, x, weight(n, k),
                **q, **kw)
        if quant is None:  # unfused
            call("qkv", " + bias", bias=bias)
            for name in ("o", "gate_up", "head"):
                call(name, "")
            call("down", "", swiglu=False) if m.gelu else call("down", " swiglu", swiglu=True)
            call("o", " + residual, pdl", residual=res, pdl=True)
        call("o", " + residual", residual=res)
        call("gate_up", " norm", norm=norm)
        if quant is not None:  # (the fusions around the product are the float weights' code)
            return
        if not m.alibi:
            for cq, rot in rotaries():
                call("qkv", f" norm + bias + rotary epilogue{' int8 cache' if cq else ''}", bias=bias, norm=norm,
                     rotary=rot)
        call("qkv", " norm + bias", bias=bias, norm=norm)
        call("down", f"{'' if m.gelu else ' swiglu'} + residual", swiglu=not m.gelu, residual=res)
        call("head", " norm", norm=norm)

    linears(lambda n, k: torch.empty(n, k, dtype=dt, device=META))
    if m.name in QUANT_DECODE_MODELS and dt == torch.float16:
        for method, group, offset in QUANT_DECODE:
            def qweight(n, k, method=method):
                return torch.empty(n, k // (2 if method == "int4" else 1), device=META,
                                   dtype=torch.uint8 if method == "int4" else torch.int8)

            def qrows(n, k, method=method, group=group, offset=offset):
                s = torch.empty((n, k // group) if group else (n,), device=META)
                return QuantRows(s, s if offset else None, method, group)
            linears(qweight, qrows, f" {method} g{group}{' offsets' if offset else ''}")


def all_kernels() -> list[str]:
    """Names of the Triton kernels (not the jit helpers they call) in triton_ops and triton_quant."""
    return sorted(name for mod in (triton_ops, triton_quant) for name, v in vars(mod).items()
                  if isinstance(v, KernelInterface) and name.endswith("_kernel"))


def specialise(launch: Launch, target: GPUTarget):
    """(signature, constexprs, attrs, options) of `launch` on `target`, as JITFunction.run works them out."""
    kernel = launch.kernel
    if not isinstance(kernel, JITFunction):
        raise RuntimeError(f"{kernel} is not a JITFunction: run the ahead-of-time compiles without TRITON_INTERPRET")
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, dict(launch.kwargs), bound, spec, opts)
    return signature, constexprs, attrs, options


@dataclass
class Compiled:
    kernel: str
    arch: int
    num_warps: int
    constexprs: dict
    registers: int
    spill_stores: int
    spill_loads: int
    seconds: float
    labels: list


_USED = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_for(launch: Launch, arch: int, signature, constexprs, attrs, options) -> Compiled:
    """Compiles one specialisation for sm_<arch>; registers and spills from ptxas's own report."""
    target = GPUTarget("cuda", arch, 32)
    log = io.StringIO()
    t0 = time.perf_counter()
    with triton.knobs.nvidia.scope(), triton.knobs.compilation.scope(), contextlib.redirect_stdout(log):
        triton.knobs.nvidia.dump_ptxas_log = True      # ptxas -v's report, printed after each compile
        triton.knobs.compilation.always_compile = True  # never a cache hit (it would skip ptxas and its report)
        ck = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                            options=options.__dict__)
    seconds = time.perf_counter() - t0
    text = log.getvalue()
    used, spill = _USED.search(text), _SPILL.search(text)
    if not ck.asm.get("cubin") or used is None or spill is None:
        raise RuntimeError(f"{launch.kernel.__name__} for sm_{arch}: no cubin or no ptxas report:\n{text[-2000:]}")
    names = launch.kernel.arg_names
    return Compiled(launch.kernel.__name__, arch, ck.metadata.num_warps,
                    {names[k[0]]: v for k, v in constexprs.items() if isinstance(v, (int, bool))},
                    int(used.group(1)), int(spill.group(1)), int(spill.group(2)), seconds, list(launch.labels))


def distinct(launches: list[Launch], arch: int) -> list[tuple]:
    """Each distinct specialisation among `launches` for sm_<arch> (from the launch's min_arch): (the first launch
    that makes it, its specialisation (signature, constexprs, attrs, options), the labels of every launch that
    shares it)."""
    seen: dict = {}
    for ln in launches:
        if arch < ln.min_arch:
            continue
        spec = specialise(ln, GPUTarget("cuda", arch, 32))
        signature, constexprs, attrs, options = spec
        key = (ln.kernel.__name__, json.dumps(signature, sort_keys=True), repr(sorted(constexprs.items())),
               repr(sorted(attrs.items())), repr(sorted(options.__dict__.items())))
        if key in seen:
            seen[key][2].extend(ln.labels)
        else:
            seen[key] = (ln, spec, list(ln.labels))
    return list(seen.values())


def choices(ln: Launch, spec) -> frozenset:
    """The choices a specialisation is made of: each constexpr's value, the pointers' dtypes, warps and stages."""
    signature, constexprs, _, options = spec
    names = ln.kernel.arg_names
    out = {f"{names[k[0]]}={v}" for k, v in constexprs.items() if isinstance(v, (int, bool))}
    pointers = sorted({v for v in signature.values() if isinstance(v, str) and v.startswith("*")})
    return frozenset(out | {f"pointers={pointers}", f"warps={options.num_warps}", f"stages={options.num_stages}"})


def covering(specs: list[tuple], order: int) -> list[tuple]:
    """A subset of `specs` (distinct's) in which, for each kernel, every combination of `order` choices that some
    specialisation makes is made by one (order 2: every pair of choices; greedy, deterministic): what compiles in a
    fraction of the time while every choice meets every other, so that a value that fails to compile or spills with
    another shows."""
    chosen = []
    for kernel in dict.fromkeys(ln.kernel.__name__ for ln, _, _ in specs):
        mine = [(x, {c for c in itertools.combinations(sorted(choices(x[0], x[1])), order)})
                for x in specs if x[0].kernel.__name__ == kernel]
        need = set().union(*(combos for _, combos in mine))
        while need:
            best, combos = max(mine, key=lambda m: len(m[1] & need))
            need -= combos
            chosen.append(best)
    return chosen


def compile_all(launches: list[Launch], archs, cover: int = 0) -> list[Compiled]:
    """Each distinct specialisation among `launches`, compiled once per arch; `cover` n > 0: only a subset in which
    every n choices any specialisation makes together are made by one (:func:`covering`)."""
    results = []
    for arch in archs:
        specs = distinct(launches, arch)
        for ln, (signature, constexprs, attrs, options), labels in (covering(specs, cover) if cover else specs):
            res = compile_for(ln, arch, signature, constexprs, attrs, options)
            res.labels = labels
            results.append(res)
    return results


def main(arch: str = "80,90", json_out: Optional[str] = None, canary: bool = False, cover: int = 0) -> int:
    """Compiles every engine specialisation for each arch (`cover` n: a subset in which every n choices made
    together are, :func:`covering`); `canary` adds one deliberately spilling compile (a 16384-wide norm row on one
    warp) to show that spills are detected."""
    archs = [int(a) for a in str(arch).split(",") if a.strip()]
    launches = engine_launches()
    results = compile_all(launches, archs, cover)
    extra = []
    if canary:
        x = torch.empty(1, 16384, dtype=torch.float16, device=META)
        ln = record(triton_ops.skip_rms_norm, x, x, x[0], 1e-5)[0]
        ln.kwargs["num_warps"] = 1
        ln.labels.append("canary: 16384-wide row on one warp")
        extra = compile_all([ln], archs[-1:])
    for r in results + extra:
        consts = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in r.constexprs.items())
        print(f"sm_{r.arch} {r.kernel:<24} warps {r.num_warps:>2} regs {r.registers:>3} spill {r.spill_stores}/"
              f"{r.spill_loads} {r.seconds:5.2f}s [{consts}] {r.labels[0]} (+{len(r.labels) - 1})")
    missing = sorted(set(all_kernels()) - {r.kernel for r in results})
    spilled = [r for r in results if r.spill_stores or r.spill_loads]
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"kernels": all_kernels(), "missing": missing, "results": [vars(r) for r in results],
                       "launches": [lab for ln in launches for lab in ln.labels],
                       "canary": [vars(r) for r in extra]}, f, indent=1)
    print(f"{len(results)} compiles, {sum(r.seconds for r in results):.1f}s; missing: {missing or 'none'}; "
          f"spilling: {[(r.kernel, r.arch, r.labels[0]) for r in spilled] or 'none'}")
    return 1 if missing or spilled else 0


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="80,90", help="compute capabilities, e.g. 80,90")
    ap.add_argument("--json", dest="json_out", help="write the results to this JSON file")
    ap.add_argument("--canary", action="store_true", help="also compile a deliberately spilling kernel")
    ap.add_argument("--cover", type=int, default=0,
                    help="compile only a subset in which every N choices (constexprs, dtypes, warps) made together "
                         "are (2: every pair, about a third of the compiles); 0: every specialisation")
    sys.exit(main(**vars(ap.parse_args())))
