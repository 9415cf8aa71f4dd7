#!/usr/bin/env python3
"""Engine step latency on CPU, through ppl.pmx's step contract (`Transformer.forward`), so the same script
times any version of the engine:

- decode steps at batch 1, 16 and 64 (history of 64 tokens each),
- a 512-token prefill,
- a mixed step: 64 decoding sequences and one 512-token prompt chunk, against the two run apart,
- with --profile, the torch profiler's view of a batch-1 decode step: op calls per step and where the time goes.

    python benchmarks/cpu_step.py --ckpt PMX_DIR [--options '{"compile": "off"}'] [--profile] [--json OUT]

PMX_DIR is an unsplit PMX model (e.g. the one benchmarks/cpu_generate.py writes); one process, the
threads torch picks (set OMP_NUM_THREADS to choose).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import fire
import torch


def _inputs(model, seqlens, start, caches, n_dec, g):
    kvlens = [s + n for s, n in zip(start, seqlens)]
    V = model.params.vocab_size
    return dict(token_ids=torch.randint(3, V, (sum(seqlens),), generator=g), attn_mask=torch.empty(0),
                seqstarts=torch.tensor([0] + seqlens).cumsum(0), kvstarts=torch.tensor([0] + kvlens).cumsum(0),
                cachestarts=torch.tensor(caches), decoding_batches=torch.tensor([n_dec]),
                start_pos=torch.tensor(start), max_seqlen=torch.tensor([max(seqlens)]),
                max_kvlen=torch.tensor([max(kvlens)]))


def _time(model, inputs, cache, reps, warmup=3) -> float:
    kv_cache, kv_scale = cache
    for _ in range(warmup):
        model.forward(**inputs, kv_cache=kv_cache, kv_scale=kv_scale)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.forward(**inputs, kv_cache=kv_cache, kv_scale=kv_scale)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(ckpt: str, options: str = "{}", profile: bool = False, json_out: str = "", reps: int = 10) -> None:
    from runner.engine.model import EngineOptions
    from runner.engine.session import open_session
    options = json.loads(options) if isinstance(options, str) else dict(options)  # fire may parse the JSON itself
    sess = open_session(ckpt, EngineOptions(**options))
    model, g = sess.model, torch.Generator().manual_seed(0)
    hist, chunk, rows = 64, 512, 1024
    cache = model.new_cache(65 * rows)
    dec = lambda b: _inputs(model, [1] * b, [hist] * b, [i * rows for i in range(b)], b, g)  # noqa: E731
    prefill = _inputs(model, [chunk], [0], [64 * rows], 0, g)
    mixed = _inputs(model, [1] * 64 + [chunk], [hist] * 64 + [0], [i * rows for i in range(65)], 64, g)
    res = {"threads": torch.get_num_threads(), "options": options}
    for b in (1, 16, 64):
        res[f"decode_b{b}_ms"] = _time(model, dec(b), cache, reps) * 1e3
    res["prefill_512_ms"] = _time(model, prefill, cache, max(3, reps // 3)) * 1e3
    res["mixed_64_plus_512_ms"] = _time(model, mixed, cache, max(3, reps // 3)) * 1e3
    res["mixed_over_apart"] = res["mixed_64_plus_512_ms"] / (res["decode_b64_ms"] + res["prefill_512_ms"])
    res["load_avg"] = os.getloadavg()[0]
    for k, v in res.items():
        print(f"{k:24s} {v:.3f}" if isinstance(v, float) else f"{k:24s} {v}")
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof
        inputs = dec(1)
        with prof(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(5):
                model.forward(**inputs, kv_cache=cache[0], kv_scale=cache[1])
        res["top_level_ops_per_decode_step"] = sum(1 for e in p.events() if e.cpu_parent is None) / 5
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        print(f"top-level op calls per batch-1 decode step: {res['top_level_ops_per_decode_step']:.0f}")
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))
    sess.close()


if __name__ == "__main__":
    fire.Fire(main)
