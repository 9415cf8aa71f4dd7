"""`scripts/Export.py` / `python -m runner export`: one ONNX model per rank, in ppl.pmx's layout.

    torchrun --nproc_per_node N scripts/Export.py --ckpt_dir PMX_N --export_path OUT [ppl.pmx's flags]
    mpirun -np N python scripts/Export.py ...

writes `OUT/model_slice_{rank}/model.onnx` per rank (weights as initializers, or as ONNX external data in
`model.onnx.data` past the protobuf's 2 GB) and `OUT/params.json` (ppl.pmx's ModelParams keys, and ours). The world
size must equal the model's shard count. Every file passes onnx.checker before the export is renamed into place; a
failure on any rank leaves nothing behind.

The graph is the engine's own model (runner.engine.model.Transformer) traced over one step whose inputs are
ppl.pmx's dynamic-batching step inputs (runner.engine.plan.StepInputs), through an export kernel set: `--opset
opmx` (default) runner.kernels.opmx_export, whose ops are custom operators written as ppl.pmx's opmx nodes; `--opset
standard` runner.kernels.standard_export, plain torch written as standard ONNX operators (one rank; the cache an
input and an output) that a stock onnxruntime session runs. A model feature is written once, in the model; an op
the model calls that the export kernel set lacks is an error naming it. The tracer is torch.onnx's TorchScript
exporter (`dynamo=False`): with torch 2.13 the dynamo exporter needs an ONNX schema registered for every op of a
custom domain and cannot translate a custom op that writes its input in place (the KV cache), both of which this
graph has.

After tracing, the graph is put in ppl.pmx's form: initializers take the names of ppl.pmx's modules (the layers'
`pmx_names`), a Reshape by a constant shape becomes opmx::Reshape (opmx), every step input is declared (unused ones
too; with --auto_causal false attn_mask is [T, sum kvlens], or [0, 0] for a step that needs none: every sequence
decoding), and
each layer's values carry the names of the layer dumps (`layer{i}_attention_norm`, `_qkv` or `_q` `_k` `_v`,
`_attention`, `_o`, `_ffn_norm`, `_residual`, `_ffn`; runner.onnx.replay --dump_layers), marked while tracing by
hooks on the model's modules.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from runner.args import CkptDir, Fields, OneOf, Overwrite, Progress, TokenizerPath
from runner.config import EngineConfig
from runner.engine.cache import KVCache
from runner.engine.model import Transformer, load_shard, random_shard
from runner.engine.plan import StepInputs, StepLengths, StepPlan, causal_mask, step_inputs
from runner.engine.session import check_world_size, pick_dtype
from runner.errors import PmxError
from runner.kernels import opmx_export, standard_export
from runner.kernels.reference import PAGE_SIZE, QUANT_GROUP, rope_type
from runner.onnx.graph import TORCH_TO_ONNX, save
from runner.parallel.comm import collective_timeout, make_comm
from runner.parallel.launch import detect, set_cpu_threads
from runner.pmx.params import PmxParams
from runner.pmx.store import check_apart, copy_tokenizer_files, dtype_name

PARAMS_JSON = "params.json"
SLICE_DIR = "model_slice_{}"
PATH_BYTES = 4096


def export_params(p: PmxParams, c: EngineConfig, dtype: torch.dtype, opset: str) -> dict:
    """params.json: ppl.pmx's ModelParams keys (what pplnn reads), then this project's (`pmx_params`: the whole
    pmx_params.json of the shards; `engine`: the flags the graph was built with)."""
    kind = rope_type(p.rope_scaling)
    return {
        "hidden_dim": p.hidden_dim, "intermediate_dim": p.intermediate_dim, "num_layers": p.num_layers,
        "num_heads": p.num_heads, "num_kv_heads": p.num_kv_heads, "vocab_size": p.vocab_size, "norm_eps": p.norm_eps,
        "cache_quant_bit": 8 if c.quantized_cache else 0, "cache_quant_group": QUANT_GROUP if c.quantized_cache else 0,
        "cache_layout": c.cache_layout, "cache_mode": c.cache_mode, "page_size": PAGE_SIZE, "dynamic_batching": True,
        "auto_causal": c.auto_causal, "rope_theta": p.rope_theta,
        "rope_scaling_type": "" if kind == "default" else kind,
        "rope_scaling_factor": float((p.rope_scaling or {}).get("factor") or 1.0),
        "max_position_embeddings": p.max_position_embeddings, "num_experts": max(p.num_experts, 1),
        "num_experts_per_token": max(p.num_experts_per_token, 1), "sliding_window": p.uniform_window or 0,
        "head_dim": p.head_dim, "num_shards": p.num_shards, "dtype": dtype_name(dtype), "opset": opset,
        "engine": {k: getattr(c, k) for k in EXPORT_FLAGS if k not in ("dtype", "comm_backend", "collective_timeout")},
        "pmx_params": p.to_dict(),
    }


EXPORT_FLAGS = ("dtype", "friendly_gqa", "fused_qkv", "fused_kvcache", "fused_ffn_glu", "auto_causal",
                "quantized_cache", "cache_layout", "cache_mode", "comm_backend", "collective_timeout")


def _check_export_path(export_path: str, ckpt_dir: str, overwrite: bool) -> Path:
    out = Path(export_path)
    check_apart(out, {"--ckpt_dir": Path(ckpt_dir)}, out_flag="--export_path")
    if out.exists():
        if not out.is_dir():
            raise PmxError(f"--export_path {export_path}: exists and is not a directory")
        if any(out.iterdir()) and not overwrite:
            raise PmxError(f"--export_path {export_path}: exists and is not empty (pass --overwrite to replace it)")
    for parent in out.resolve().parents:
        if parent.exists():
            if not parent.is_dir():
                raise PmxError(f"--export_path {export_path}: {parent} is not a directory")
            break
    return out


STEP_INPUTS = ("token_ids", "attn_mask", "seqstarts", "kvstarts", "cachestarts", "decoding_batches", "start_pos",
               "max_seqlen", "max_kvlen", "kv_cache", "kv_scale")
PPL_STANDARD_OPS = {"Split", "Slice", "Sub", "Gather", "Cast", "Constant"}  # the standard ops ppl.pmx's exports hold
TAP = "pmx_tap"  # the domain of the nodes that mark a layer's values while tracing (removed after)


def exportable(p: PmxParams, opset: str) -> None:
    """Refuses, in one line, a model this export cannot write (before its weights are read)."""
    if p.num_experts and p.quantization is not None and opset == "opmx":
        raise PmxError(f"a mixture-of-experts model with {p.quantization['method']} weights cannot be exported: "
                       f"ppl.pmx has no weight-only quantised MoeColumnParallelLinear / MoeRowParallelLinear (export the "
                       f"float model)")
    if p.num_experts and p.ffn_bias:
        raise PmxError("a mixture-of-experts model with MLP biases cannot be exported (the engine does not run one)")


def export_model(p: PmxParams, weights: dict, c: EngineConfig, comm, opset: str) -> Transformer:
    """The model an export traces: the engine's Transformer over rank `comm.rank`'s shard `weights` (consumed),
    built with the export kernel set of `opset` and unpacked weights."""
    if opset == "standard":
        ops = standard_export.kernel_set()
    else:
        ops = opmx_export.kernel_set(c, p.num_layers, weights["norm.weight"].dtype)  # the Transformer's dtype
    return Transformer(p, weights, comm, replace(c, prepack=False, decode_linears=False), ops)


@torch.library.custom_op(f"{TAP}::tap", mutates_args=())
def _tap(x: torch.Tensor, name: str) -> torch.Tensor:
    """Marks x as the layer value `name` in the traced graph (a node the export removes, naming its input)."""
    return x.clone()


def _tap_symbolic(g, x, name):
    from torch.onnx import symbolic_helper as sh
    out = g.op(f"{TAP}::Tap", x, name_s=sh._get_const(name, "s", "name"))
    out.setType(x.type())
    return out


torch.onnx.register_custom_op_symbolic(f"{TAP}::tap", _tap_symbolic, 1)


def tap_layers(model: Transformer) -> list:
    """Hooks that mark each layer's values (the names of runner.engine.layer_dump, the fused qkv output as
    `layer{i}_qkv`) while the model is traced; returns their handles."""
    handles = []

    def out_hook(*names):
        def hook(mod, args, out):
            outs = out if isinstance(out, tuple) else (out,)
            marked = tuple(_tap(o, n) if n else o for o, n in zip(outs, names))
            return marked if isinstance(out, tuple) else marked[0]
        return hook

    for i, layer in enumerate(model.layers):
        a = layer.attention
        hooked = [(layer.attention_norm, out_hook(f"layer{i}_attention_norm", None)),
                  (layer.ffn_norm, out_hook(f"layer{i}_ffn_norm", f"layer{i}_residual")),
                  (a.wo, out_hook(f"layer{i}_o")), (layer.feed_forward, out_hook(f"layer{i}_ffn"))]
        hooked += [(a.qkv[0], out_hook(f"layer{i}_qkv"))] if len(a.qkv) == 1 else \
            [(lin, out_hook(f"layer{i}_{n}")) for n, lin in zip("qkv", a.qkv)]
        handles += [m.register_forward_hook(h) for m, h in hooked]
        handles.append(a.wo.register_forward_pre_hook(
            lambda m, args, i=i: (_tap(args[0], f"layer{i}_attention"), *args[1:])))
    return handles


class TracedStep(nn.Module):
    """One step of `model` as ppl.pmx's step contract: the step inputs in, logits [B, vocab] float32 of each
    sequence's last token out (and, where `cache_out`, the written cache: the standard-ops export's kv_cache_out)."""

    def __init__(self, model: Transformer, cache_out: bool):
        super().__init__()
        self.model, self.cache_out = model, cache_out

    def forward(self, token_ids, attn_mask, seqstarts, kvstarts, cachestarts, decoding_batches, start_pos, max_seqlen,
                max_kvlen, kv_cache, kv_scale=None):
        inputs = StepInputs(seqstarts, kvstarts, cachestarts, decoding_batches, start_pos, max_seqlen, max_kvlen,
                            attn_mask)
        cache = KVCache(kv_cache, kv_scale, self.model.config.cache_layout, self.model.ops)
        logits = self.model(token_ids, StepPlan.traced(inputs), cache)
        return (logits, cache.data) if self.cache_out else logits


def _example(model: Transformer) -> dict:
    """A step to trace: one sequence decoding at position 2, one prefilling 3 tokens; every tensor's dims that vary
    from step to step marked (the dynamic axes)."""
    c = model.config
    b = StepLengths([1, 2, 3, 4], [1, 3], [2, 0], [[0], [PAGE_SIZE]] if c.paged else [0, 8], 1)
    mask = None if c.auto_causal else causal_mask(replace(b, num_decoding=0), model.params.uniform_window,
                                                  model.dtype)
    t = step_inputs(b, mask, model.dtype)
    t["kv_cache"], t["kv_scale"] = model.new_cache(2 * PAGE_SIZE)
    if t["kv_scale"] is None:
        del t["kv_scale"]
    return t


def _dynamic_axes(t: dict, c: EngineConfig) -> dict:
    axes = {"token_ids": {0: "total_seqlen"}, "seqstarts": {0: "batch_1"}, "kvstarts": {0: "batch_1"},
            "cachestarts": {0: "batch", 1: "max_pages"} if c.paged else {0: "batch"}, "start_pos": {0: "batch"},
            "kv_cache": {c.cache_layout: "max_tokens"}, "logits": {0: "batch"}, "kv_cache_out": {0: "max_tokens"}}
    if "kv_scale" in t:
        axes["kv_scale"] = {c.cache_layout: "max_tokens"}
    if t["attn_mask"].dim() == 2:
        axes["attn_mask"] = {0: "total_seqlen", 1: "total_kvlen"}
    return axes


def trace(model: Transformer, opset: str) -> onnx.ModelProto:
    """The ONNX graph of one step of `model` (built by :func:`export_model`, or a model like it), in ppl.pmx's
    form (see the module docstring)."""
    standard = opset == "standard"
    t = _example(model)
    step = TracedStep(model, cache_out=standard).eval()
    for m in step.modules():  # every tensor of the model an initializer named by its path, not an anonymous constant
        m._non_persistent_buffers_set.clear()
    outputs = ["logits", "kv_cache_out"] if standard else ["logits"]
    handles = tap_layers(model)
    try:
        with tempfile.TemporaryDirectory(prefix="pmx-trace-") as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the TorchScript exporter's deprecation notice, tracer notes)
            path = Path(tmp) / "traced.onnx"
            torch.onnx.export(step, tuple(t.values()), str(path), input_names=list(t), output_names=outputs,
                              dynamic_axes=_dynamic_axes(t, model.config), dynamo=False,
                              opset_version=standard_export.OPSET if standard else opmx_export.OPSET,
                              custom_opsets={**({} if standard else opmx_export.DOMAINS), TAP: 1},
                              do_constant_folding=True)
            graph_model = onnx.load(str(path))
    finally:
        for h in handles:
            h.remove()
    g = graph_model.graph
    _untap(g)
    _name_initializers(g, step)
    if not standard:
        _opmx_reshapes(g)
    _declare_inputs(g, t)
    del graph_model.opset_import[:]
    graph_model.opset_import.extend([helper.make_opsetid("", standard_export.OPSET if standard else opmx_export.OPSET)]
                                    + ([] if standard else [helper.make_opsetid(d, v)
                                                            for d, v in opmx_export.DOMAINS.items()]))
    graph_model.producer_name = "pmx-runner"
    graph_model.doc_string = ("pmx-runner standard-ops export" if standard else
                              "pmx-runner opmx export (ppl.pmx operators)")
    graph_model.ir_version = min(graph_model.ir_version, 10)  # readable by onnxruntime releases of the last two years
    return graph_model


def _untap(g: onnx.GraphProto) -> None:
    """Removes the Tap nodes, naming the value each marks."""
    taps = [n for n in g.node if n.domain == TAP]
    rename = {}
    for n in taps:
        name = onnx.helper.get_attribute_value(n.attribute[0]).decode()
        src = rename.get(n.input[0], n.input[0])
        if src in rename.values():  # (marked twice: the first name stays)
            rename[n.output[0]] = src
            continue
        rename[src], rename[n.output[0]] = name, name
    for n in taps:
        g.node.remove(n)
    for n in g.node:
        n.input[:] = [rename.get(x, x) for x in n.input]
        n.output[:] = [rename.get(x, x) for x in n.output]
    for v in (*g.output, *g.value_info):
        v.name = rename.get(v.name, v.name)


def _name_initializers(g: onnx.GraphProto, step: TracedStep) -> None:
    """Initializers named as ppl.pmx names the model's tensors: a layer's `pmx_names`, else the module path."""
    names = {f"{path}.{attr}": new for path, m in step.named_modules() for attr, new in getattr(m, "pmx_names",
                                                                                                  {}).items()}
    inits = {t.name: t for t in g.initializer}
    for n in [n for n in g.node if n.op_type == "Identity" and n.input[0] in inits]:  # (the tracer shares equal
        copy = onnx.TensorProto()                                                      # tensors: each its own)
        copy.CopyFrom(inits[n.input[0]])
        copy.name = n.output[0]
        g.initializer.append(copy)
        g.node.remove(n)
    rename = {}
    for t in g.initializer:
        new = names.get(t.name, t.name[len("model."):] if t.name.startswith("model.") else t.name)
        rename[t.name], t.name = new, new
    for n in g.node:
        n.input[:] = [rename.get(x, x) for x in n.input]


def _opmx_reshapes(g: onnx.GraphProto) -> None:
    """A Reshape by a constant shape as ppl.pmx writes it: opmx::Reshape (0 keeps a dim, -1 is the rest)."""
    consts = {t.name for t in g.initializer} | {o for n in g.node if n.op_type == "Constant" for o in n.output}
    for n in g.node:
        if n.op_type == "Reshape" and n.domain == "" and n.input[1] in consts:
            n.domain = opmx_export.OPMX
            del n.attribute[:]


def _declare_inputs(g: onnx.GraphProto, t: dict) -> None:
    """Every step input declared in ppl.pmx's order, those the graph does not read too (the standard-ops export reads
    no attn_mask), the dims of those the tracer left out named."""
    have = {i.name: i for i in g.input}
    dims = {"token_ids": ["total_seqlen"], "seqstarts": ["batch_1"], "kvstarts": ["batch_1"], "start_pos": ["batch"],
            "cachestarts": ["batch"] if t["cachestarts"].dim() == 1 else ["batch", "max_pages"],
            "decoding_batches": [1], "max_seqlen": [1], "max_kvlen": [1]}
    inputs = []
    for name in (n for n in STEP_INPUTS if n in t):
        if name == "attn_mask":  # (an empty [0, 0] where a step needs no mask; empty [0] without --auto_causal)
            inputs.append(helper.make_tensor_value_info(name, TORCH_TO_ONNX[t[name].dtype], [0] if t[name].dim() == 1
                                                        else ["mask_rows", "mask_cols"]))
        elif name in have:
            inputs.append(have[name])
        else:
            inputs.append(helper.make_tensor_value_info(name, TORCH_TO_ONNX[t[name].dtype], dims[name]))
    del g.input[:]
    g.input.extend(inputs)


def _shared_tmp(out: Path, comm, rank: int) -> Path:
    """A temporary directory beside `out`, made by rank 0 and named to every rank."""
    buf = torch.zeros(PATH_BYTES, dtype=torch.uint8)
    if rank == 0:
        out.resolve().parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.resolve().parent)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the export is an ordinary directory
        tmp = tmp.encode()
        buf[: len(tmp)] = torch.frombuffer(bytearray(tmp), dtype=torch.uint8)
    buf = comm.broadcast_(buf)
    return Path(bytes(buf[buf != 0].tolist()).decode())


def _replace(tmp: Path, out: Path) -> None:
    out = out.resolve()
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.replace(old / "x")
        tmp.replace(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.replace(out)


def export(ckpt_dir: CkptDir, export_path: str, tokenizer_path: TokenizerPath = None,
           opset: Annotated[str, OneOf("opmx", "standard")] = "opmx", dynamic_batching: bool = True,
           empty_weight: bool = False, overwrite: Overwrite = False, progress: Progress = True,
           config: Annotated[EngineConfig, Fields(*EXPORT_FLAGS)] = EngineConfig()) -> None:
    """Export the model as one ONNX file per rank (ppl.pmx's Export.py; run under the same mpirun / torchrun -np N
    as the model's shards).

    Args:
        export_path: directory to create: model_slice_{rank}/model.onnx per rank and params.json.
        opset: opmx (ppl.pmx's operators, pplnn's; onnxruntime with this project's custom operators) or standard
            (standard ONNX operators only, one rank, the KV cache an explicit input and output).
        dynamic_batching: must stay true (ppl.pmx's dynamic-batching graph is the one exported).
        empty_weight: random weights in the model's shapes instead of the checkpoint's (ppl.pmx's flag).
    """
    if not dynamic_batching:
        raise PmxError("--dynamic_batching false (ppl.pmx's static-batching graph) cannot be exported: the graph "
                       "takes the dynamic-batching step inputs")
    env = detect()
    params = PmxParams.load(Path(ckpt_dir))
    if opset == "standard" and params.num_shards != 1:
        raise PmxError(f"--opset standard exports one rank: {ckpt_dir} is split into {params.num_shards} shards "
                       f"(merge it with scripts/Merge.py)")
    check_world_size(ckpt_dir, params, env)
    exportable(params, opset)
    config.check_model(params.head_dim)
    dev = torch.device("cpu")
    dtype = pick_dtype(config.dtype if config.dtype != "auto" else params.dtype, params.dtype, dev)
    if opset == "standard":
        why = standard_export.refusal(params, config, dtype)
        if why:
            raise PmxError(f"--opset standard does not take {why} (it exports one rank, float32, a float cache in "
                           f"layout 0 and offset mode; use --opset opmx)")
    out = _check_export_path(export_path, ckpt_dir, overwrite)
    tok_src = Path(tokenizer_path) if tokenizer_path else Path(ckpt_dir)
    tok_src = tok_src.parent if tok_src.is_file() else tok_src
    set_cpu_threads(env)
    comm = make_comm(env, dev, config.comm_backend, collective_timeout(config.collective_timeout))
    try:
        weights = random_shard(params, env.rank, dev, dtype) if empty_weight else \
            load_shard(Path(ckpt_dir), env.rank, dev, dtype)[1]
        comm.sync()
        tmp = _shared_tmp(out, comm, env.rank)
        error = None
        try:
            model = trace(export_model(params, weights, replace(config, dtype=dtype_name(dtype)), comm, opset), opset)
            del weights
            slice_dir = tmp / SLICE_DIR.format(env.rank)
            slice_dir.mkdir()
            save(model, slice_dir)
        except Exception as e:  # noqa: BLE001 - every rank learns of the failure before anything is renamed
            error = e
        failed = comm.all_gather(torch.tensor([int(error is not None)]), dim=0).tolist()
        if any(failed):
            if env.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if error is not None:
                raise error
            raise PmxError(f"rank(s) {[r for r, f in enumerate(failed) if f]} failed to export; nothing was written")
        if env.rank == 0:
            try:
                (tmp / PARAMS_JSON).write_text(json.dumps(export_params(params, config, dtype, opset), indent=1) + "\n")
                copy_tokenizer_files(tok_src, tmp)
                _replace(tmp, out)
            except OSError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise PmxError(f"--export_path {export_path}: cannot write the export ({e.strerror or e})") from None
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        comm.barrier()
    finally:
        comm.close()
    if env.rank == 0:
        print(f"exported {ckpt_dir} ({params.num_layers} layers, {dtype_name(dtype)}"
              f"{', ' + params.quantization['method'] + ' weights' if params.quantization else ''}, {opset} operators) "
              f"-> {export_path} ({env.world_size} slice{'s' if env.world_size > 1 else ''})", flush=True)
