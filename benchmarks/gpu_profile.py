#!/usr/bin/env python3
"""Where a CUDA decode step's time goes: the Llama-2-7B shape (random fp16 weights), batch 1 (or --batch), the
decode steps of one generation run eagerly under torch.profiler (CUDA graphs would hide the kernels), then the
same generation with CUDA graphs timed per step, with the decode linears on Triton (decode_linear) and on cuBLAS.

Prints the kernels by total GPU time, the GPU time per step against the step's wall time (the gap is host
time: launches, plan, sampling), and the roofline of the step's weight bytes at --hbm_tbs.

    python benchmarks/gpu_profile.py [--layers 32] [--batch 1] [--gen_len 48] [--hbm_tbs 3.35] [--top 25]
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import fire
import torch


def main(layers: int = 32, batch: int = 1, gen_len: int = 48, hbm_tbs: float = 3.35, top: int = 25,
         dtype: str = "float16", kernels: str = "auto") -> None:
    from gpu_generate import Shape, _params_file, step_bytes
    from runner.config import EngineConfig
    from runner.engine.session import open_session
    if not torch.cuda.is_available():
        raise SystemExit("gpu_profile.py needs a CUDA GPU")
    s = Shape(layers=layers)
    work = Path(tempfile.mkdtemp(prefix="pmx-gpu-prof-"))
    params = str(_params_file(s, work))
    prompts = [[1 + i, 2, 3, 4, 5, 6, 7, 8] for i in range(batch)]
    floor_ms = step_bytes(s, batch, 8 + gen_len / 2) / (hbm_tbs * 1e12) * 1e3
    for graphs, linears in ((False, True), (True, True), (True, False), (True, True)):
        sess = open_session(params, EngineConfig(kernels=kernels, cuda_graphs=graphs, decode_linears=linears,
                                                 device="cuda", dtype=dtype, max_batch=batch), random_weights=True)
        gen = sess.core
        gen.generate(prompts, 8)                                     # warm-up: Triton compiles, graphs captured
        if not graphs:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                stats: dict = {}
                gen.generate(prompts, gen_len, stats=stats)
            events = prof.key_averages()
            print(events.table(sort_by="cuda_time_total" if hasattr(events[0], "cuda_time_total")
                               else "device_time_total", row_limit=top, max_name_column_width=70))
            gpu_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events
                         if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type))
            print(f"eager: GPU kernel time {gpu_us / gen_len / 1e3:.3f} ms per step (all {gen_len} steps, prefill "
                  f"included)")
        stats = {}
        gen.generate(prompts, gen_len, stats=stats)
        decode = stats["step_seconds"][1:]
        med = statistics.median(decode) * 1e3
        print(f"{'graphs' if graphs else 'eager'}, linears on {'Triton' if linears else 'cuBLAS'}: decode step "
              f"median {med:.3f} ms, min {min(decode) * 1e3:.3f} ms; "
              f"roofline {floor_ms:.3f} ms ({100 * floor_ms / med:.1f}% of it)")
        sess.close()
        del sess, gen
        torch.cuda.empty_cache()


if __name__ == "__main__":
    fire.Fire(main)
