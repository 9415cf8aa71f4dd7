#!/usr/bin/env python3
"""Peak memory and speed of streaming conversion, split and merge on a generated ~2 GB checkpoint, against `cp -r`.

Writes a random-weight Llama-shaped HF checkpoint (bf16, two safetensors files + index) tensor by
tensor, then times `convert`, `split` and `merge`, each in its own process so that its peak RSS
(VmHWM) is its own, and `cp -r` of the same input directory just before it (both after a `sync`, so that
neither pays for the other's dirty pages; inputs are in the page cache). Each pair runs `--repeats` times; the
medians are printed: the process's wall time, the step's own time inside it (without the ~1 s of Python and
torch start-up), cp's time and their ratio. Targets: peak RSS <= 2 x largest tensor + 400 MB, the step
within 2 x cp.

    python benchmarks/convert_memory.py [--workdir /tmp/pmx-bench] [--layers 16] [--repeats 5] [--keep]
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import fire
import torch

from runner.pmx.store import SafetensorsWriter

STEP = """
import sys, time
from runner.pmx.convert import convert, reshard
kind, src, dst = sys.argv[1:4]
t0 = time.perf_counter()
if kind == "convert":
    convert(src, dst, progress=False)
else:
    reshard(src, dst, int(sys.argv[4]), progress=False)
# VmHWM is this process image's own peak; ru_maxrss would include the parent's, kept across fork + exec
print(time.perf_counter() - t0, next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                                     if l.startswith("VmHWM:")))
"""


def make_checkpoint(d: Path, layers: int, dim: int, inter: int, vocab: int) -> tuple[int, int]:
    """Writes the checkpoint; returns (total bytes, largest tensor bytes)."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=dim, intermediate_size=inter,
               num_hidden_layers=layers, num_attention_heads=dim // 128, num_key_value_heads=dim // 128,
               vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
               torch_dtype="bfloat16", tie_word_embeddings=False, hidden_act="silu")
    (d / "config.json").write_text(json.dumps(cfg))
    shapes = {"model.embed_tokens.weight": (vocab, dim)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (dim,), f"{p}.post_attention_layernorm.weight": (dim,),
                       **{f"{p}.self_attn.{x}_proj.weight": (dim, dim) for x in "qkvo"},
                       f"{p}.mlp.gate_proj.weight": (inter, dim), f"{p}.mlp.up_proj.weight": (inter, dim),
                       f"{p}.mlp.down_proj.weight": (dim, inter)})
    shapes.update({"model.norm.weight": (dim,), "lm_head.weight": (vocab, dim)})
    names = list(shapes)
    files = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    g = torch.Generator().manual_seed(0)
    for fname, keys in files.items():
        w = SafetensorsWriter(d / fname, [(k, torch.bfloat16, shapes[k]) for k in keys], {"format": "pt"})
        for k in keys:
            w.write(k, (torch.randn(shapes[k], generator=g) * 0.02).bfloat16())
        w.close()
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, ks in files.items() for k in ks}}))
    nbytes = {k: 2 * torch.Size(s).numel() for k, s in shapes.items()}
    return sum(nbytes.values()), max(nbytes.values())


def timed(args) -> tuple[float, str]:
    """(wall seconds, stdout) of a command started after a sync."""
    os.sync()
    t0 = time.perf_counter()
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - t0, out


def main(workdir: str = "/tmp/pmx-bench", layers: int = 16, dim: int = 2048, inter: int = 5632, vocab: int = 32000,
         shards: int = 2, repeats: int = 5, keep: bool = False) -> None:
    work = Path(workdir)
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.perf_counter()
    total, largest = make_checkpoint(work / "hf", layers, dim, inter, vocab)
    print(f"generated {total / 1e9:.2f} GB checkpoint in {time.perf_counter() - t0:.1f}s; "
          f"largest tensor {largest / 1e6:.0f} MB; medians of {repeats} runs", flush=True)
    limit = 2 * largest + 400e6
    ok = True
    steps = [("convert", work / "hf", work / "pmx", None), ("split", work / "pmx", work / f"pmx{shards}", shards),
             ("merge", work / f"pmx{shards}", work / "merged", 1)]
    for kind, src, dst, n in steps:
        args = [sys.executable, "-c", STEP, kind, str(src), str(dst)] + ([str(n)] if n else [])
        subprocess.run(["cat", *map(str, src.iterdir())], check=True, stdout=subprocess.DEVNULL)  # page-cached
        walls, inner, cps, rss = [], [], [], 0
        for _ in range(repeats):
            shutil.rmtree(work / "cp", ignore_errors=True)
            shutil.rmtree(dst, ignore_errors=True)
            cps.append(timed(["cp", "-r", str(src), str(work / "cp")])[0])
            wall, out = timed(args)
            secs, peak = out.strip().splitlines()[-1].split()
            walls.append(wall)
            inner.append(float(secs))
            rss = max(rss, int(peak))
        shutil.rmtree(work / "cp", ignore_errors=True)
        wall, secs, cp = statistics.median(walls), statistics.median(inner), statistics.median(cps)
        good = rss <= limit and secs <= 2 * cp
        ok &= good
        print(f"{kind:8s} {total / 1e9:.2f} GB: process {wall:5.2f}s, step {secs:5.2f}s = {total / secs / 1e9:4.2f} GB/s;"
              f" cp -r {cp:4.2f}s; step / cp {secs / cp:4.2f}x   peak RSS {rss / 1e6:4.0f} MB (limit {limit / 1e6:.0f} MB)"
              f"  {'ok' if good else 'MISSED'}", flush=True)
    merged = (work / "merged" / "model.00.safetensors").read_bytes() == (work / "pmx" / "model.00.safetensors").read_bytes()
    print(f"merge(split(m)) bit-identical: {merged}")
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if ok and merged else 1)


if __name__ == "__main__":
    fire.Fire(main)
