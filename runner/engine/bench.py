"""Throughput benchmark after ppl.llm.serving's benchmark_llama: `python -m runner bench`.

For each batch size: `batch` sequences of `input_len` prompt tokens (from a tokens file, or random)
generate `gen_len` tokens each, greedy, with no early stop; warm-up loops, then benchmark loops,
averaged. One CSV line per batch size on stdout:

    batch,prefill(ms),decode(ms),avg(ms),tps,mem(gib)

prefill: the steps until every sequence has its first token (one step of all prompts unless chunked);
decode: mean time of a later step (one token for every sequence); avg: whole generation / gen_len; tps: batch x gen_len / whole generation in seconds;
mem: peak memory of rank 0 (CUDA: max allocated; CPU: peak resident set). Progress goes to stderr.
Run it under `mpirun -np N` for tensor parallelism; with `--random_weights` a bare pmx_params.json
(or a PMX directory) gives the shapes and no checkpoint is read.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch

from runner.args import Count, PositiveInt, Progress, int_list
from runner.config import EngineConfig
from runner.engine.session import open_session
from runner.errors import PmxError
from runner.pmx.store import atomic_file

CSV_HEADER = "batch,prefill(ms),decode(ms),avg(ms),tps,mem(gib)"


def read_tokens_file(path: str, vocab_size: int) -> list[list[int]]:
    """Prompts as token ids, one per line, ids separated by commas or spaces (ppl.llm.serving's tokens_input_N)."""
    try:
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    except OSError as e:
        raise PmxError(f"{path}: cannot read the tokens file ({e.strerror})") from None
    prompts = []
    for i, ln in enumerate(lines, 1):
        try:
            ids = [int(x) for x in ln.replace(",", " ").split()]
        except ValueError:
            raise PmxError(f"{path}:{i}: expected token ids separated by commas or spaces, got {ln[:40]!r}") from None
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise PmxError(f"{path}:{i}: token ids {bad[:3]} outside the vocabulary [0, {vocab_size})")
        prompts.append(ids)
    if not prompts:
        raise PmxError(f"{path}: holds no token ids")
    return prompts


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 2**30
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def bench(model: str, random_weights: bool = False, batch_sizes: str = "1 2 4 8 16 32 64 128 256",
          input_len: PositiveInt = 8, tokens_file: Optional[str] = None, gen_len: PositiveInt = 256,
          warmup_loops: Count = 1, benchmark_loops: PositiveInt = 1, seed: int = 0, csv: Optional[str] = None,
          progress: Progress = True, config: EngineConfig = EngineConfig()) -> list[dict]:
    """Throughput per batch size (ppl.llm.serving's benchmark_llama); one CSV line per batch size:
    batch,prefill(ms),decode(ms),avg(ms),tps,mem(gib). Run under mpirun -np N for tensor parallelism.

    Args:
        model: a PMX directory split into N shards; with --random_weights also a bare pmx_params.json.
        random_weights: random weights in the model's shapes (no checkpoint read; any N the shapes allow).
        batch_sizes: batch sizes, e.g. "1 2 4" or 1,2,4.
        input_len: prompt tokens per sequence (random ids) when no tokens_file.
        tokens_file: prompts as token ids, one per line (e.g. tokens_input_8).
        gen_len: tokens generated per sequence (no early stop).
        warmup_loops: untimed generations per batch size.
        benchmark_loops: timed generations per batch size, averaged.
        seed: seed of the random prompts and weights.
        csv: also write the CSV to this file.
    """
    batches = int_list(batch_sizes, "batch_sizes", minimum=1, allow_empty=False)
    sess = open_session(model, config, random_weights=random_weights, seed=seed, progress=progress)
    p = sess.model.params
    if tokens_file:
        pool = read_tokens_file(tokens_file, p.vocab_size)
    else:
        g = torch.Generator().manual_seed(seed)
        pool = [torch.randint(0, p.vocab_size, (input_len,), generator=g).tolist() for _ in range(max(batches))]
    if max(len(x) for x in pool) + gen_len > p.max_position_embeddings:
        raise PmxError(f"prompt + --gen_len exceed the model's {p.max_position_embeddings} positions")

    def say(msg: str) -> None:
        if progress and sess.is_main:
            print(f"bench: {msg}", file=sys.stderr, flush=True)

    say(f"{sess.env.world_size} rank(s), {sess.device}, {sess.model.dtype}, {p.num_layers} layers, "
        f"dim {p.hidden_dim}, batches {batches}, input {len(pool[0]) if tokens_file else input_len}, gen {gen_len}")
    results, lines = [], [CSV_HEADER]
    if sess.is_main:
        print(CSV_HEADER, flush=True)
    for bi, b in enumerate(batches):
        prompts = [pool[i % len(pool)] for i in range(b)]
        runs = []
        for loop in range(warmup_loops + benchmark_loops):
            warm = loop < warmup_loops
            k, of = (loop + 1, warmup_loops) if warm else (loop - warmup_loops + 1, benchmark_loops)
            say(f"batch {b} ({bi + 1}/{len(batches)}) {'warm-up' if warm else 'run'} {k}/{of}")
            stats: dict = {}
            sess.core.generate(prompts, gen_len, stats=stats)
            if not warm:
                runs.append((stats["step_seconds"], stats["prefill_steps"]))
        if any(len(r) != gen_len + k - 1 for r, k in runs):
            raise PmxError(f"batch {b}: the sequences did not decode together (--max_batch, or the KV cache)")
        prefill = sum(sum(r[:k]) for r, k in runs) / len(runs)
        decode = sum(sum(r[k:]) / max(len(r) - k, 1) for r, k in runs) / len(runs)
        total = sum(sum(r) for r, _ in runs) / len(runs)
        row = dict(batch=b, prefill_ms=prefill * 1e3, decode_ms=decode * 1e3, avg_ms=total / gen_len * 1e3,
                   tps=b * gen_len / total, mem_gib=peak_memory_gib(sess.device))
        results.append(row)
        line = (f"{b},{row['prefill_ms']:.3f},{row['decode_ms']:.3f},{row['avg_ms']:.3f},{row['tps']:.2f},"
                f"{row['mem_gib']:.3f}")
        lines.append(line)
        if sess.is_main:
            print(line, flush=True)
    if csv and sess.is_main:
        with atomic_file(Path(csv), "the CSV") as tmp:
            tmp.write_text("\n".join(lines) + "\n")
    sess.close()
    return results
