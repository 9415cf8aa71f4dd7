"""Throughput benchmark after ppl.llm.serving's benchmark_llama: `python -m runner bench`.

For each batch size: `batch` sequences of `input_len` prompt tokens (from a tokens file, or random)
generate `gen_len` tokens each, greedy, with no early stop; warm-up loops, then benchmark loops,
averaged. One CSV line per batch size on stdout:

    batch,prefill(ms),decode(ms),avg(ms),tps,mem(gib)

prefill: the first step (all prompts); decode: mean time of a later step (one token for every
sequence); avg: whole generation / gen_len; tps: batch x gen_len / whole generation in seconds;
mem: peak memory of rank 0 (CUDA: max allocated; CPU: peak resident set). Progress goes to stderr.
Run it under `mpirun -np N` for tensor parallelism; with `--random_weights` a bare pmx_params.json
(or a PMX directory) gives the shapes and no checkpoint is read.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from runner.args import int_list
from runner.errors import PmxError
from runner.pmx.store import atomic_file

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
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


def bench(model: str, random_weights: bool = False, batch_sizes: Union[str, int, Sequence[int]] = DEFAULT_BATCHES,
          input_len: int = 8, tokens_file: Optional[str] = None, gen_len: int = 256, warmup_loops: int = 1,
          benchmark_loops: int = 1, quantized_cache: bool = False, cache_layout: int = 0, cache_mode: int = 0,
          device: str = "auto", dtype: str = "auto", seed: int = 0, csv: Optional[str] = None,
          progress: bool = True, kernels: str = "auto", collective_timeout: Optional[float] = None,
          compile: str = "auto", cuda_graphs: bool = True, fused_decode: bool = True,
          comm_backend: str = "auto") -> list[dict]:
    from runner.engine.generator import Generator
    from runner.engine.model import EngineOptions
    from runner.engine.session import open_session

    batches = int_list(batch_sizes, "batch_sizes", minimum=1, allow_empty=False)
    options = EngineOptions(quantized_cache=quantized_cache, cache_layout=cache_layout, cache_mode=cache_mode,
                            kernels=kernels, compile=compile, cuda_graphs=cuda_graphs, fused_decode=fused_decode)
    sess = open_session(model, options, device=device, dtype=dtype, random_weights=random_weights, seed=seed,
                        timeout_s=collective_timeout, comm_backend=comm_backend, progress=progress)
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
            kind = "warm-up" if loop < warmup_loops else "run"
            k = loop + 1 if loop < warmup_loops else loop - warmup_loops + 1
            say(f"batch {b} ({bi + 1}/{len(batches)}) {kind} {k}/{warmup_loops if loop < warmup_loops else benchmark_loops}")
            stats: dict = {}
            Generator(sess.model, max_batch=b).generate(prompts, gen_len, stats=stats)
            if loop >= warmup_loops:
                runs.append(stats["step_seconds"])
        if any(len(r) != gen_len for r in runs):
            raise PmxError(f"batch {b}: expected {gen_len} steps per run, got {[len(r) for r in runs]} "
                           f"(the cache could not hold the whole batch at once)")
        prefill = sum(r[0] for r in runs) / len(runs)
        decode = sum(sum(r[1:]) / max(len(r) - 1, 1) for r in runs) / len(runs)
        total = sum(sum(r) for r in runs) / len(runs)
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
