"""`scripts/Export.py` / `python -m runner export`: one ONNX model per rank, in ppl.pmx's layout.

    torchrun --nproc_per_node N scripts/Export.py --ckpt_dir PMX_N --export_path OUT [ppl.pmx's flags]
    mpirun -np N python scripts/Export.py ...

writes `OUT/model_slice_{rank}/model.onnx` per rank (weights as initializers, or as ONNX external data in
`model.onnx.data` past the protobuf's 2 GB) and `OUT/params.json` (ppl.pmx's ModelParams keys, and ours). The world
size must equal the model's shard count. `--opset opmx` (default) writes ppl.pmx's operators (runner.onnx.opmx);
`--opset standard` a one-rank model of standard ONNX operators only (runner.onnx.standard) that a stock onnxruntime
session runs. Every file passes onnx.checker before the export is renamed into place; a failure on any rank leaves
nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import torch

from runner.args import CkptDir, Fields, OneOf, Overwrite, Progress, TokenizerPath
from runner.config import EngineConfig
from runner.engine.model import load_shard, random_shard
from runner.engine.session import check_world_size, pick_dtype
from runner.errors import PmxError
from runner.kernels.reference import PAGE_SIZE, QUANT_GROUP, rope_type
from runner.onnx.graph import save
from runner.onnx.opmx import OpmxExport, exportable
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
        "num_experts_per_token": max(p.num_experts_per_token, 1), "sliding_window": p.sliding_window or 0,
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


def _build(p: PmxParams, weights: dict, c: EngineConfig, dtype: torch.dtype, opset: str, rank: int):
    if opset == "standard":
        from runner.onnx.standard import StandardExport
        return StandardExport(p, weights, c, dtype).build().model("pmx-runner standard-ops export")
    return OpmxExport(p, weights, c, dtype, rank).build().model("pmx-runner opmx export (ppl.pmx operators)")


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
           engine: Annotated[EngineConfig, Fields(*EXPORT_FLAGS)] = EngineConfig()) -> None:
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
    exportable(params)
    engine.check_model(params.head_dim)
    out = _check_export_path(export_path, ckpt_dir, overwrite)
    tok_src = Path(tokenizer_path) if tokenizer_path else Path(ckpt_dir)
    tok_src = tok_src.parent if tok_src.is_file() else tok_src
    set_cpu_threads(env)
    dev = torch.device("cpu")
    dtype = pick_dtype(engine.dtype if engine.dtype != "auto" else params.dtype, params.dtype, dev)
    comm = make_comm(env, dev, engine.comm_backend, collective_timeout(engine.collective_timeout))
    try:
        weights = random_shard(params, env.rank, dev, dtype) if empty_weight else \
            load_shard(Path(ckpt_dir), env.rank, dev, dtype)[1]
        comm.sync()
        tmp = _shared_tmp(out, comm, env.rank)
        error = None
        try:
            model = _build(params, weights, replace(engine, dtype=dtype_name(dtype)), dtype, opset, env.rank)
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
                (tmp / PARAMS_JSON).write_text(json.dumps(export_params(params, engine, dtype, opset), indent=1) + "\n")
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
