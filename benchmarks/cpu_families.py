#!/usr/bin/env python3
"""Decode bandwidth of the families with layers of their own (Gemma 3, Phi-4-mini) against a Llama of their size,
on the CPU decode step (the one-call C++ step: each model's runner is printed).

Each model is random weights in its published shapes (bfloat16 weights, computed in float32, as a CPU engine runs
a bfloat16 checkpoint): Gemma 3 1B (26 layers, 4 heads of 256 over 1 KV head, 5 local layers of window 512 to 1
global, two ropes, q/k norms, post norms, GeGLU, 262k tied vocabulary) and Phi-4-mini cut to 8 of its 32 layers (its
whole 200k tied vocabulary: partial rotary, LongRoPE, GQA), each against its Llama twin: the same sizes (layers,
heads, head_dim, intermediate, vocabulary: the same bytes a step) with Llama's layer (one rope over whole heads, two
norms, SwiGLU, no window), so that the ratio is the cost of the family's features and nothing else (a Llama 3.2 1B,
16 layers of 2048, reads 2.47 GB a step where Gemma 3 1B reads 2.00 GB in 26 layers: per-layer costs would mix in).

Both models of a pair are loaded in one process and their batch-1 decode steps (ppl.pmx's step contract, a history
of HIST tokens, benchmarks/cpu_step.py's decode_inputs) take turns step by step, A B, B A, ..., so that a swing of a
shared box's speed falls on both; the figure is the ratio of their median steps, with the ratio of each A B pair's
steps (their spread says how steady the box was).

    python benchmarks/cpu_families.py [--steps 20] [--json_out OUT]

Bytes per step: every weight a decode step reads (the linears and the vocabulary projection at their stored width;
the embedding row, the norms and the KV cache of a short history are left out: < 0.1%). Bandwidth = bytes per step
/ the median decode step.
"""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import fire
import torch

from cpu_step import HIST, decode_inputs
from runner.config import EngineConfig
from runner.engine.session import open_session
from runner.pmx.params import PmxParams
from runner.pmx.schema import pmx_tensors

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
    return sum(2 * s[0] * s[1] for name, s in pmx_tensors(p).items() if len(s) == 2 and name != "tok_embeddings.weight")


def main(steps: int = 20, warmup: int = 3, json_out: str = "") -> None:
    tmp = Path(tempfile.mkdtemp(prefix="cpu_families_"))
    results = []
    for family, llama in PAIRS:
        models = {}
        for name in (family, llama):
            (tmp / name).mkdir()
            PmxParams(dtype="bfloat16", **SHAPES[name]).save(tmp / name)
            sess = open_session(str(tmp / name / "pmx_params.json"), EngineConfig(), random_weights=True)
            g = torch.Generator().manual_seed(0)
            models[name] = (sess, decode_inputs(sess.model.params.vocab_size, 1, g),
                            sess.model.new_cache(2 * HIST), step_bytes(sess.model.params))
            print(f"{name}: {sess.stepper.describe()}", flush=True)
        times = {name: [] for name in models}
        for k in range(warmup + steps):
            for name in (family, llama) if k % 2 else (llama, family):  # A B, then B A: neither always goes first
                sess, inputs, (kv, scale), _ = models[name]
                t0 = time.perf_counter()
                sess.stepper.forward(**inputs, kv_cache=kv, kv_scale=scale)
                if k >= warmup:
                    times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t) for name, t in times.items()}
        gbs = {name: models[name][3] / med[name] / 1e9 for name in models}
        pairs = [a / b for a, b in zip(times[llama], times[family])]  # family's bandwidth / the twin's, per A B pair
        for name in models:
            print(f"{name:>24}: decode {med[name] * 1e3:8.1f} ms/token (median of {steps}), "
                  f"{models[name][3] / 1e9:.2f} GB a step, {gbs[name]:.2f} GB/s", flush=True)
        ratio = gbs[family] / gbs[llama]
        q = statistics.quantiles(pairs, n=4)
        print(f"{family} / {llama}: bandwidth ratio {ratio:.3f} (A B pairs: median {statistics.median(pairs):.3f}, "
              f"quartiles {q[0]:.3f} .. {q[2]:.3f})", flush=True)
        results.append({"family": family, "llama": llama, "steps_s": times, "median_s": med, "gb_per_s": gbs,
                        "bytes_per_step": {n: models[n][3] for n in models}, "ratio": ratio, "pair_ratios": pairs})
        for sess, *_ in models.values():
            sess.close()
        del models, sess
        gc.collect()
    if json_out:
        Path(json_out).write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    fire.Fire(main)
