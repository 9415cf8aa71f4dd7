#!/usr/bin/env python3
"""CPU generation speed: pmx-runner at TP=1 and TP=2 (mpirun) against transformers, same weights/threads.

A random-weight Llama of about 100M parameters (dim 768, 12 layers, 12 heads, vocab 32000, fp32):
decode tokens/s at batch 1 and 16 (after an 8-token prompt), prefill tokens/s for 512 tokens.

    python benchmarks/cpu_generate.py [--workdir /tmp/pmx-cpu-bench] [--decode_tokens 32]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import fire
import torch

HERE = Path(__file__).resolve().parent


def _engine_numbers(ckpt: str, decode_tokens: int) -> dict:
    """Runs on every rank; returns rank 0's timings."""
    from runner.engine.generator import Generator
    from runner.engine.session import open_session
    sess = open_session(ckpt)
    g = torch.Generator().manual_seed(0)
    res = {"threads": torch.get_num_threads()}
    for b in (1, 16):
        prompts = [torch.randint(3, 32000, (8,), generator=g).tolist() for _ in range(b)]
        Generator(sess.model).generate(prompts, 4)  # warm-up
        t0 = time.perf_counter()
        Generator(sess.model).generate(prompts, 1)
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        Generator(sess.model).generate(prompts, decode_tokens + 1)
        res[f"decode_b{b}"] = b * decode_tokens / (time.perf_counter() - t0 - t_prefill)
    long = [torch.randint(3, 32000, (512,), generator=g).tolist()]
    Generator(sess.model).generate(long, 1)
    t0 = time.perf_counter()
    for _ in range(3):
        Generator(sess.model).generate(long, 1)
    res["prefill_512"] = 3 * 512 / (time.perf_counter() - t0)
    sess.close()
    return res


@torch.inference_mode()
def _hf_numbers(hf_dir: str, decode_tokens: int, threads: int) -> dict:
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    res = {}
    for b in (1, 16):
        ids = torch.randint(3, 32000, (b, 8), generator=g)
        kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=decode_tokens + 1, min_new_tokens=decode_tokens + 1, **kw)
        res[f"decode_b{b}"] = b * decode_tokens / (time.perf_counter() - t0 - t_prefill)
    long = torch.randint(3, 32000, (1, 512), generator=g)
    model(long)
    t0 = time.perf_counter()
    for _ in range(3):
        model(long)
    res["prefill_512"] = 3 * 512 / (time.perf_counter() - t0)
    return res


def worker(ckpt: str, out: str, decode_tokens: int = 32) -> None:
    from runner.parallel.launch import detect
    res = _engine_numbers(ckpt, decode_tokens)
    if detect().rank == 0:
        Path(out).write_text(json.dumps(res))


def main(workdir: str = "/tmp/pmx-cpu-bench", decode_tokens: int = 32) -> None:
    from runner.pmx.convert import convert
    from runner.pmx.random_model import make_random_model
    work = Path(workdir)
    hf = work / "hf"
    if not (hf / "config.json").exists():
        make_random_model(str(hf), hidden_dim=768, intermediate_dim=2048, num_layers=12, num_heads=12, num_kv_heads=12,
                          vocab_size=32000, overwrite=True)
    for n in (1, 2):
        if not (work / f"pmx{n}" / "pmx_params.json").exists():
            convert(str(hf), str(work / f"pmx{n}"), num_shards=n, overwrite=True, progress=False)
    rows = {}
    for n in (1, 2):
        out = work / f"tp{n}.json"
        cmd = [sys.executable, __file__, "worker", "--ckpt", str(work / f"pmx{n}"), "--out", str(out),
               "--decode_tokens", str(decode_tokens)]
        if n > 1:
            cmd = [str(HERE.parent / "scripts" / "mpirun.sh"), "-np", str(n)] + cmd
        subprocess.run(cmd, check=True)
        rows[f"pmx-runner TP={n}"] = json.loads(out.read_text())
    threads = rows["pmx-runner TP=1"]["threads"]
    rows[f"transformers ({threads} threads)"] = _hf_numbers(str(hf), decode_tokens, threads)
    print(f"{'':28s} {'decode b=1 tok/s':>17s} {'decode b=16 tok/s':>18s} {'prefill 512 tok/s':>18s}")
    for name, r in rows.items():
        print(f"{name:28s} {r['decode_b1']:17.1f} {r['decode_b16']:18.1f} {r['prefill_512']:18.1f}")


if __name__ == "__main__":
    fire.Fire({"main": main, "worker": worker} if len(sys.argv) > 1 and sys.argv[1] == "worker" else main)
