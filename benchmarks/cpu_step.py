#!/usr/bin/env python3
"""Engine step latency on CPU, through ppl.pmx's step contract (`Transformer.forward`), so the same script
times any version of the engine:

- decode steps at batch 1, 16 and 64 (history of 64 tokens each),
- a 512-token prefill,
- a mixed step: 64 decoding sequences and one 512-token prompt chunk, against the two run apart,
- with --profile, the torch profiler's view of a batch-1 decode step: op calls per step and where the time goes.

    python benchmarks/cpu_step.py --ckpt PMX_DIR [--options '{"compile": "off"}'] [--profile] [--json OUT]

PMX_DIR is an unsplit PMX model (e.g. the one benchmarks/cpu_generate.py writes); one process, the
threads torch picks (set OMP_NUM_THREADS to choose). The steps are built here (`decode_inputs`, `prefill_inputs`,
`mixed_inputs`) and nowhere else: `cpu_peers.py versions` times the mixed step and the two apart with them.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import fire
import torch

HIST, CHUNK, DECODERS = 64, 512, 64  # the decoders' history, the prompt chunk, the decoders of the mixed step
ROWS = 1024                          # cache rows between two sequences' starts


def cache_rows(rows: int = ROWS) -> int:
    """Cache rows the steps below need: DECODERS sequences `rows` apart, then the prompt chunk."""
    return DECODERS * rows + max(rows, CHUNK)


def _inputs(vocab, seqlens, start, caches, n_dec, g):
    kvlens = [s + n for s, n in zip(start, seqlens)]
    return dict(token_ids=torch.randint(3, vocab, (sum(seqlens),), generator=g), attn_mask=torch.empty(0),
                seqstarts=torch.tensor([0] + seqlens).cumsum(0), kvstarts=torch.tensor([0] + kvlens).cumsum(0),
                cachestarts=torch.tensor(caches), decoding_batches=torch.tensor([n_dec]),
                start_pos=torch.tensor(start), max_seqlen=torch.tensor([max(seqlens)]),
                max_kvlen=torch.tensor([max(kvlens)]))


def decode_inputs(vocab: int, b: int, g, rows: int = ROWS) -> dict:
    """ppl.pmx step inputs of `b` sequences decoding one token each after HIST tokens of history."""
    return _inputs(vocab, [1] * b, [HIST] * b, [i * rows for i in range(b)], b, g)


def prefill_inputs(vocab: int, g, rows: int = ROWS) -> dict:
    """One CHUNK-token prompt, where the mixed step puts it."""
    return _inputs(vocab, [CHUNK], [0], [DECODERS * rows], 0, g)


def mixed_inputs(vocab: int, g, rows: int = ROWS) -> dict:
    """DECODERS decoding sequences (as decode_inputs) and the prompt chunk (as prefill_inputs) in one step."""
    return _inputs(vocab, [1] * DECODERS + [CHUNK], [HIST] * DECODERS + [0],
                   [i * rows for i in range(DECODERS + 1)], DECODERS, g)


def time_steps(forward, steps: dict, cache, reps, warmup=3) -> dict:
    """{name: median seconds} of `forward(**inputs, kv_cache=, kv_scale=)` for each of `steps` ({name: inputs}) over
    `reps` calls after `warmup`, the steps taking turns call by call (so a swing of the box's speed falls on all)."""
    kv_cache, kv_scale = cache
    for _ in range(warmup):
        for inputs in steps.values():
            forward(**inputs, kv_cache=kv_cache, kv_scale=kv_scale)
    times = {name: [] for name in steps}
    for _ in range(reps):
        for name, inputs in steps.items():
            t0 = time.perf_counter()
            forward(**inputs, kv_cache=kv_cache, kv_scale=kv_scale)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def time_step(forward, inputs, cache, reps, warmup=3) -> float:
    """Median seconds of one step (time_steps)."""
    return time_steps(forward, {"step": inputs}, cache, reps, warmup)["step"]


def main(ckpt: str, options: str = "{}", profile: bool = False, json_out: str = "", reps: int = 10) -> None:
    from cpu_peers import open_engine
    options = json.loads(options) if isinstance(options, str) else dict(options)  # fire may parse the JSON itself
    eng = open_engine(ckpt, options)
    V, g = eng.vocab_size, torch.Generator().manual_seed(0)
    cache = eng.new_cache(cache_rows())
    prefill = prefill_inputs(V, g)
    mixed = mixed_inputs(V, g)
    res = {"threads": torch.get_num_threads(), "options": options}
    for b in (1, 16, 64):
        res[f"decode_b{b}_ms"] = time_step(eng.forward, decode_inputs(V, b, g), cache, reps) * 1e3
    res["prefill_512_ms"] = time_step(eng.forward, prefill, cache, max(3, reps // 3)) * 1e3
    res["mixed_64_plus_512_ms"] = time_step(eng.forward, mixed, cache, max(3, reps // 3)) * 1e3
    res["mixed_over_apart"] = res["mixed_64_plus_512_ms"] / (res["decode_b64_ms"] + res["prefill_512_ms"])
    res["load_avg"] = os.getloadavg()[0]
    for k, v in res.items():
        print(f"{k:24s} {v:.3f}" if isinstance(v, float) else f"{k:24s} {v}")
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof
        inputs = decode_inputs(V, 1, g)
        with prof(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(5):
                eng.forward(**inputs, kv_cache=cache[0], kv_scale=cache[1])
        res["top_level_ops_per_decode_step"] = sum(1 for e in p.events() if e.cpu_parent is None) / 5
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        print(f"top-level op calls per batch-1 decode step: {res['top_level_ops_per_decode_step']:.0f}")
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))
    eng.close()


if __name__ == "__main__":
    fire.Fire(main)
