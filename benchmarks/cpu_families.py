#!/usr/bin/env python3
"""Decode bandwidth of the families with layers of their own (Gemma 3, Phi-4-mini) against a Llama of their size,
on the CPU decode step (the one-call C++ step: `runner bench` says which runner served the decode steps).

Each model is random weights in its published shapes (bfloat16 weights, computed in float32, as a CPU engine runs
a bfloat16 checkpoint): Gemma 3 1B (26 layers, 4 heads of 256 over 1 KV head, 5 local layers of window 512 to 1
global, two ropes, q/k norms, post norms, GeGLU, 262k tied vocabulary) and Phi-4-mini cut to 8 of its 32 layers (its
whole 200k tied vocabulary: partial rotary, LongRoPE, GQA), each against its Llama twin: the same sizes (layers,
heads, head_dim, intermediate, vocabulary: the same bytes a step) with Llama's layer (one rope over whole heads, two
norms, SwiGLU, no window), so that the ratio is the cost of the family's features and nothing else (a Llama 3.2 1B,
16 layers of 2048, reads 2.47 GB a step where Gemma 3 1B reads 2.00 GB in 26 layers: per-layer costs would mix in).
One process per run, `runner bench` at batch 1 (an 8-token prompt, GEN tokens); the runs take turns A B, B A, so a
swing of a shared box's speed falls on both, and each pair gives a ratio.

    python benchmarks/cpu_families.py [--pairs 3] [--gen 24] [--json OUT]

Bytes per step: every weight a decode step reads (the linears and the vocabulary projection at their stored width;
the embedding row, the norms and the KV cache of a short history are left out: < 0.1%). Bandwidth = bytes per step
/ the mean decode step. The figure is each family's bandwidth over the Llama's in the same pair.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import fire

from runner.pmx.params import PmxParams
from runner.pmx.schema import pmx_tensors

ROOT = Path(__file__).resolve().parents[1]

LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 4096,
            "short_factor": [1.0 + 0.05 * i for i in range(48)], "long_factor": [1.0 + 0.5 * i for i in range(48)]}
SHAPES = {
    "gemma-3-1b": dict(model_type="gemma3", hidden_dim=1152, intermediate_dim=6912, num_layers=26, num_heads=4,
                       num_kv_heads=1, head_dim=256, vocab_size=262144, norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=4096, sliding_window=512,
                       layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(26)],
                       sliding_rope_theta=10000.0, qk_norm=True, norm_offset=1.0, post_norms=True,
                       embedding_scale=1152 ** 0.5, attention_scale=256 ** -0.5, hidden_act="gelu_pytorch_tanh",
                       tie_word_embeddings=True),
    "phi-4-mini-8l": dict(model_type="phi3", hidden_dim=3072, intermediate_dim=8192, num_layers=8, num_heads=24,
                          num_kv_heads=8, head_dim=128, rotary_dim=96, vocab_size=200064, norm_eps=1e-5,
                          rope_theta=10000.0, rope_scaling=LONGROPE, max_position_embeddings=131072,
                          sliding_window=262144, tie_word_embeddings=True),
}
SIZES = ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
         "max_position_embeddings", "tie_word_embeddings")
for _family in list(SHAPES):  # each family's Llama twin
    SHAPES[f"llama-as-{_family}"] = dict(model_type="llama", norm_eps=1e-5, rope_theta=500000.0,
                                         **{k: SHAPES[_family][k] for k in SIZES})
PAIRS = tuple((family, f"llama-as-{family}") for family in ("gemma-3-1b", "phi-4-mini-8l"))


def step_bytes(p: PmxParams) -> int:
    """Bytes of the weights one decode step reads: every matrix but the embedding (one row of it), at 2 bytes."""
    return sum(2 * a * b for name, (a, b, *_) in ((n, s) for n, s in pmx_tensors(p).items() if len(s) == 2)
               if name != "tok_embeddings.weight")


def run(params: Path, gen: int) -> dict:
    """One `runner bench` at batch 1: its decode step (ms) and which runner served the decode steps."""
    cmd = [sys.executable, "-m", "runner", "bench", str(params), "--random_weights", "--batch_sizes", "1",
           "--input_len", "8", "--gen_len", str(gen), "--warmup_loops", "1", "--benchmark_loops", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    row = res.stdout.strip().splitlines()[-1].split(",")
    runner = next((ln.split("decode steps: ")[1].split(",")[0] for ln in res.stderr.splitlines()
                   if "decode steps: " in ln), "?")
    return {"decode_ms": float(row[2]), "mem_gib": float(row[5]), "runner": runner}


def main(pairs: int = 3, gen: int = 24, json_out: str = "") -> None:
    tmp = Path(tempfile.mkdtemp(prefix="cpu_families_"))
    params = {}
    for name, shape in SHAPES.items():
        params[name] = PmxParams(dtype="bfloat16", **shape)
        (tmp / name).mkdir()
        params[name].save(tmp / name)
    results = []
    for family, llama in PAIRS:
        for k in range(pairs):
            pair = {}
            for name in (llama, family) if k % 2 else (family, llama):  # A B, then B A: neither always goes first
                r = run(tmp / name / "pmx_params.json", gen)
                r["gb_per_s"] = step_bytes(params[name]) / r["decode_ms"] / 1e6
                pair[name] = r
                print(f"{name:>14}: decode {r['decode_ms']:8.1f} ms/token, {step_bytes(params[name]) / 1e9:.2f} GB "
                      f"a step, {r['gb_per_s']:.2f} GB/s ({r['runner']}, peak {r['mem_gib']:.1f} GiB)", flush=True)
            ratio = pair[family]["gb_per_s"] / pair[llama]["gb_per_s"]
            print(f"   pair {k + 1}: {family} / {llama} bandwidth {ratio:.3f}", flush=True)
            results.append({"family": family, "llama": llama, **{n: pair[n] for n in pair}, "ratio": ratio})
    for family, llama in PAIRS:
        ratios = [r["ratio"] for r in results if r["family"] == family]
        print(f"{family} / {llama}: bandwidth ratio median {statistics.median(ratios):.3f} "
              f"(pairs {', '.join(f'{x:.3f}' for x in ratios)})")
    if json_out:
        Path(json_out).write_text(json.dumps({"gen": gen, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    fire.Fire(main)
