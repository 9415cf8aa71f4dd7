#!/usr/bin/env python3
"""GPU decode speed against the memory-bandwidth roofline, beside transformers, in one run.

A Llama-2-7B-shaped random fp16 model (dim 4096, 32 layers, 32 heads, intermediate 11008, vocab
32000; no checkpoint needed): batch-1 decode tokens/s and the bandwidth it implies (weight bytes x
tokens/s) against the GPU's peak, throughput for a list of batch sizes, and transformers generating
with random weights of the same shapes on the same GPU. Prints a Markdown table and writes it, with
the GPU name, driver and torch version, to benchmarks/results/gpu-<gpu>.md.

    python benchmarks/gpu_generate.py [--layers 32] [--batches "1 8 32 128 256"] [--gen_len 128]
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import fire
import torch

PEAK_TBS = {"H100": 3.35, "H200": 4.8, "A100": 2.0}  # HBM bandwidth, TB/s (SXM parts)


def _params(layers: int, work: Path) -> Path:
    from runner.pmx.params import PmxParams
    p = PmxParams(model_type="llama", hidden_dim=4096, intermediate_dim=11008, num_layers=layers, num_heads=32,
                  num_kv_heads=32, head_dim=128, vocab_size=32000, norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=4096, dtype="float16")
    work.mkdir(parents=True, exist_ok=True)
    p.save(work)
    return work / "pmx_params.json"


def _hf_decode_tps(layers: int, batch: int, gen_len: int) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).half().eval()
    ids = torch.randint(3, 32000, (batch, 8), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=gen_len + 1, min_new_tokens=gen_len + 1, **kw)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return batch * gen_len / (total - prefill)


def main(layers: int = 32, batches: str = "1 8 32 128 256", gen_len: int = 128, work: str = "/tmp/pmx-gpu-bench",
         kernels: str = "auto") -> None:
    from runner.engine.bench import bench
    if not torch.cuda.is_available():
        raise SystemExit("gpu_generate.py needs a CUDA GPU")
    name = torch.cuda.get_device_name()
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip()
    rows = bench(str(_params(layers, Path(work))), random_weights=True, batch_sizes=batches,
                 gen_len=gen_len, device="cuda", dtype="float16", kernels=kernels)
    weight_bytes = 2 * (layers * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 32000 * 4096)  # read once per decode step
    peak = next((v for k, v in PEAK_TBS.items() if k in name), None)
    hf1 = _hf_decode_tps(layers, 1, gen_len)
    lines = [f"# GPU decode, {name} (driver {driver}), torch {torch.__version__}, {time.strftime('%Y-%m-%d')}", "",
             f"Llama-2-7B shape, {layers} layers, fp16, random weights; gen_len {gen_len}; kernels={kernels}.", "",
             "| batch | decode ms/step | tokens/s | GB/s (weights) | % of peak |", "|---|---|---|---|---|"]
    for r in rows:
        gbs = weight_bytes / (r["decode_ms"] / 1e3) / 1e9
        pct = f"{100 * gbs / (peak * 1e3):.0f}%" if peak else "?"
        lines.append(f"| {r['batch']} | {r['decode_ms']:.2f} | {r['batch'] * 1e3 / r['decode_ms']:.1f} | {gbs:.0f} | {pct} |")
    b1 = 1e3 / rows[0]["decode_ms"] if rows and rows[0]["batch"] == 1 else float("nan")
    lines += ["", f"transformers batch-1 decode: {hf1:.1f} tokens/s; pmx-runner: {b1:.1f} ({b1 / hf1:.1f}x)"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).resolve().parent / "results" / f"gpu-{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-')}.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    fire.Fire(main)
