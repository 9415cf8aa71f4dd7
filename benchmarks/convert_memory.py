#!/usr/bin/env python3
"""Peak memory and speed of streaming conversion, split and merge on a generated ~1.5 GB checkpoint, against `cp -r`.

Writes a random-weight Llama-shaped HF checkpoint (bf16, 12 layers of dim 2048: 1.50 GB) with the project's
random-model writer, tensor by tensor, then times `convert`, `split` and `merge`, each in its own process so that its peak RSS
(VmHWM) is its own, and `cp -r` of the same input directory just before it (both after a `sync`, so that
neither pays for the other's dirty pages; inputs are in the page cache). Each pair runs `--repeats` times; the
medians are printed: the process's wall time, the step's own time inside it (without the ~1 s of Python and
torch start-up), cp's time and their ratio. Targets: peak RSS <= 2 x largest tensor + 400 MB, the step
within 2 x cp.

    python benchmarks/convert_memory.py [--workdir /tmp/pmx-bench] [--layers 12] [--repeats 5] [--keep]
"""

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

from runner.pmx.random_model import make_random_model
from runner.pmx.store import SafetensorsReader

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


def make_checkpoint(d: Path, layers: int, dim: int, inter: int, vocab: int, heads: int, kv_heads: int
                    ) -> tuple[int, int]:
    """Writes the checkpoint with the project's random-model writer (`python -m runner make_random_model`, bf16, one
    model.safetensors); returns (total tensor bytes, largest tensor bytes)."""
    make_random_model(str(d), hidden_dim=dim, intermediate_dim=inter, num_layers=layers, num_heads=heads,
                      num_kv_heads=kv_heads, vocab_size=vocab, dtype="bfloat16")
    r = SafetensorsReader(d / "model.safetensors")
    nbytes = [r.nbytes(k) for k in r.keys()]
    return sum(nbytes), max(nbytes)


def timed(args) -> tuple[float, str]:
    """(wall seconds, stdout) of a command started after a sync."""
    os.sync()
    t0 = time.perf_counter()
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - t0, out


def main(workdir: str = "/tmp/pmx-bench", layers: int = 12, dim: int = 2048, inter: int = 5632, vocab: int = 32000,
         heads: int = 16, kv_heads: int = 16, shards: int = 2, repeats: int = 5, keep: bool = False) -> None:
    work = Path(workdir)
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.perf_counter()
    total, largest = make_checkpoint(work / "hf", layers, dim, inter, vocab, heads, kv_heads)
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
