"""Command line: `python -m runner <command>` / `pmx-runner <command>`.

Commands: convert, split, merge (PMX layer); generate, replay, compare, bench (engine). Each is a plain, typed function;
fire turns it into flags, so `--input_dir X` and `--input-dir X` both work. A :class:`PmxError`
ends the program with its message on stderr and exit status 2, without a traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable, Optional

from runner.engine.demo import generate
from runner.errors import PmxError


def convert(input_dir: str, output_dir: str, dtype: str = "auto", num_shards: int = 1, overwrite: bool = False,
            progress: bool = True, quantize: Optional[str] = None, group_size: int = 128,
            quantize_output: bool = False) -> None:
    """Convert a HuggingFace checkpoint directory into a PMX directory.

    Args:
        input_dir: HF directory with config.json and model.safetensors / sharded safetensors / pytorch_model.bin.
        output_dir: PMX directory to create (pmx_params.json, model.XX.safetensors, tokenizer files).
        dtype: auto (the checkpoint's), float32, float16 or bfloat16.
        num_shards: split into this many tensor-parallel shards while converting.
        overwrite: replace a non-empty output_dir.
        progress: show a progress bar on stderr for large models.
        quantize: int8 (per output channel) or int4 (groups along the input dim): weight-only quantised linears.
        group_size: int4 input columns per scale.
        quantize_output: quantise the lm head (output.weight) too.
    """
    from runner.pmx.convert import convert as _convert
    from runner.pmx.quant import scheme_from_flags
    quant = scheme_from_flags(quantize, group_size, quantize_output)
    p = _convert(input_dir, output_dir, dtype=dtype, num_shards=num_shards, overwrite=overwrite, progress=progress,
                 quant=quant)
    print(f"converted {input_dir} ({p.architecture}, {p.num_layers} layers, {p.dtype}"
          f"{', ' + quant.method + ' weights' if quant else ''}) -> {output_dir} "
          f"({p.num_shards} shard{'s' if p.num_shards > 1 else ''})")


def quantize(input_dir: str, output_dir: str, quantize: str = "int8", group_size: int = 128,
             quantize_output: bool = False, num_shards: Optional[int] = None, overwrite: bool = False,
             progress: bool = True) -> None:
    """Weight-only quantise a float PMX model (split or not): int8 per output channel or int4 in groups.

    Args:
        input_dir: float PMX directory.
        output_dir: PMX directory to create.
        quantize: int8 or int4.
        group_size: int4 input columns per scale (a multiple of 2 that divides every input dim).
        quantize_output: quantise the lm head (output.weight) too.
        num_shards: shards of the output (default: as many as the input has).
        overwrite: replace a non-empty output_dir.
        progress: show a progress bar on stderr for large models.
    """
    from runner.pmx.convert import quantize_model
    from runner.pmx.quant import scheme_from_flags
    quant = scheme_from_flags(quantize, group_size, quantize_output)
    p = quantize_model(input_dir, output_dir, quant, num_shards=num_shards, overwrite=overwrite, progress=progress)
    print(f"quantized {input_dir} -> {output_dir} ({quant.method}"
          f"{f', groups of {quant.group_size}' if quant.group_size else ''}"
          f"{', output too' if quant.quantize_output else ''}; {p.num_shards} shard{'s' if p.num_shards > 1 else ''})")


def split(input_dir: str, num_shards: int, output_dir: str, overwrite: bool = False, progress: bool = True) -> None:
    """Cut a PMX model into `num_shards` tensor-parallel shards (an already split model is re-cut).

    Args:
        input_dir: PMX directory.
        num_shards: number of ranks the output is for.
        output_dir: PMX directory to create.
        overwrite: replace a non-empty output_dir.
        progress: show a progress bar on stderr for large models.
    """
    from runner.pmx.convert import reshard
    p = reshard(input_dir, output_dir, num_shards, overwrite=overwrite, progress=progress)
    pads = f", padded {p.padded_dims}" if p.padded_dims else ""
    reps = f", each KV head on {p.kv_replication} ranks" if p.kv_replication > 1 else ""
    print(f"split {input_dir} -> {output_dir} ({p.num_shards} shards{reps}{pads})")


def merge(input_dir: str, num_shards: int, output_dir: str, overwrite: bool = False, progress: bool = True) -> None:
    """Put the `num_shards` shards of a split PMX model back into one, bit for bit.

    Args:
        input_dir: split PMX directory.
        num_shards: how many shards input_dir holds (checked against its pmx_params.json).
        output_dir: PMX directory to create (one shard, model.00.safetensors).
        overwrite: replace a non-empty output_dir.
        progress: show a progress bar on stderr for large models.
    """
    from runner.pmx.convert import reshard
    reshard(input_dir, output_dir, 1, overwrite=overwrite, progress=progress, expect_input_shards=num_shards)
    print(f"merged {input_dir} ({num_shards} shards) -> {output_dir}")


def make_random_model(output_dir: str, hidden_dim: int = 128, intermediate_dim: int = 344, num_layers: int = 2,
                      num_heads: int = 8, num_kv_heads: int = 4, vocab_size: int = 512, dtype: str = "float32",
                      seed: int = 0, overwrite: bool = False) -> None:
    """Write a random-weight HF Llama checkpoint with a small BPE tokenizer.json (for demos and benchmarks)."""
    from runner.pmx.random_model import make_random_model as _make
    _make(output_dir, hidden_dim, intermediate_dim, num_layers, num_heads, num_kv_heads, vocab_size, dtype, seed,
          overwrite)
    print(f"wrote a random-weight Llama checkpoint to {output_dir}")


def replay(ckpt_dir: str, dump_dir: str, step: int, output_dir: str = "out/replay", warmup: int = 2,
           min_profiling_seconds: float = 1.0, device: str = "auto", dtype: Optional[str] = None,
           cache_layout: Optional[int] = None, min_snr: float = 60.0, min_cosine: float = 0.9999) -> None:
    """Replay a dumped step on every rank (run it under the same mpirun -np N as the dump); time it and
    check its logits against the dump. Exit status 1 when a rank is beyond tolerance.

    Args:
        ckpt_dir: the PMX directory the dump was made with (split into N shards).
        dump_dir: the --dump_tensor_path of the run; rank r reads dump_dir/rank_r.
        step: the step to replay.
        output_dir: each rank writes its logits (float32 .bin) to output_dir/rank_r.
        warmup: untimed iterations before profiling.
        min_profiling_seconds: profile for at least this long (at least one iteration).
        device: auto, cpu or cuda.
        dtype: compute dtype (default: the dumped run's).
        cache_layout: override the cache layout (when a dump without engine.json is ambiguous).
        min_snr: pass threshold in dB (identical logits always pass).
        min_cosine: pass threshold for the cosine similarity.
    """
    from runner.engine.replay import replay as _replay
    status = _replay(ckpt_dir, dump_dir, step, output_dir, warmup, min_profiling_seconds, device, dtype, cache_layout,
                     min_snr, min_cosine)
    if status:
        sys.exit(status)


def compare(dir_a: str, dir_b: str, metric: str = "snr", threshold: Optional[float] = None, csv: Optional[str] = None,
            tensors: Optional[str] = None, steps: Optional[str] = None) -> None:
    """Compare two dump trees tensor by tensor (A is the reference); exit status 1 when one fails.

    Args:
        dir_a: a dump root (with rank_r folders) or one rank's folder, e.g. a TP=1 run's dump.
        dir_b: the same for the other run, e.g. a TP=2 run's dump, or replay's output_dir.
        metric: snr (dB, higher is better), cosine or mse (lower is better) decides the verdict.
        threshold: pass mark for the metric (default: snr 40, cosine 0.999, mse 1e-4).
        csv: also write the table to this CSV file.
        tensors: only these tensors, comma-separated (e.g. logits).
        steps: only these steps, comma-separated.
    """
    from runner.engine.compare import compare as _compare
    status = _compare(dir_a, dir_b, metric, threshold, csv, tensors, steps)
    if status:
        sys.exit(status)


def bench(model: str, random_weights: bool = False, batch_sizes: str = "1 2 4 8 16 32 64 128 256",
          input_len: int = 8, tokens_file: Optional[str] = None, gen_len: int = 256, warmup_loops: int = 1,
          benchmark_loops: int = 1, quantized_cache: bool = False, cache_layout: int = 0, cache_mode: int = 0,
          device: str = "auto", dtype: str = "auto", seed: int = 0, csv: Optional[str] = None,
          progress: bool = True, kernels: str = "auto", compile: str = "auto") -> None:
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
        quantized_cache: int8 KV cache.
        cache_layout: 0..3.
        cache_mode: 0 offset, 1 paged.
        device: auto, cpu or cuda.
        dtype: auto, float32, float16 or bfloat16.
        seed: seed of the random prompts and weights.
        csv: also write the CSV to this file.
        progress: progress lines on stderr.
        kernels: auto (Triton on CUDA, fast torch elsewhere), triton, torch or reference.
        compile: torch.compile the decode step: auto, on or off (see generate).
    """
    from runner.engine.bench import bench as _bench
    _bench(model, random_weights, batch_sizes, input_len, tokens_file, gen_len, warmup_loops, benchmark_loops,
           quantized_cache, cache_layout, cache_mode, device, dtype, seed, csv, progress, kernels, compile)


def perplexity(ckpt_dir: str, text_file: str, tokenizer_path: Optional[str] = None, window: int = 256,
               stride: Optional[int] = None, max_tokens: Optional[int] = None, device: str = "auto",
               dtype: str = "auto", kernels: str = "auto") -> None:
    """Perplexity (sliding window) and tokens/s of a PMX model, float or quantised, over a text file.

    Args:
        ckpt_dir: PMX directory split into as many shards as ranks (mpirun / torchrun for N > 1).
        text_file: a UTF-8 text file.
        tokenizer_path: tokenizer.model or tokenizer.json (default: the one in ckpt_dir).
        window: tokens per forward pass (at most max_position_embeddings).
        stride: tokens between window starts (default window / 2); every token is scored once.
        max_tokens: use only the first max_tokens tokens of the text.
        device: auto, cpu or cuda.
        dtype: auto, float32, float16 or bfloat16.
        kernels: auto, triton, torch or reference.
    """
    from runner.engine.perplexity import perplexity as _perplexity
    _perplexity(ckpt_dir, text_file, tokenizer_path, window, stride, max_tokens, device, dtype, kernels)


COMMANDS: dict[str, Callable] = {"make_random_model": make_random_model, "convert": convert, "split": split, "merge": merge, "generate": generate,
                               "replay": replay, "compare": compare, "bench": bench, "quantize": quantize,
                               "perplexity": perplexity}


def run(component, argv: list[str] | None = None) -> None:
    """Runs `component` under fire. A user error becomes `error: ...` (with `rank r: ` before it when
    several ranks run) and exit status 2; under MPI the whole job is aborted, so that no peer waits
    for a collective that will never come."""
    import fire
    try:
        fire.Fire(component, command=argv)
    except Exception as e:  # noqa: BLE001 (every rank reports its own error, then the job ends)
        from runner.parallel.launch import detect, under_mpi
        env = detect() if ("RANK" in os.environ or under_mpi()) else None
        who = f"rank {env.rank}: " if env and env.world_size > 1 else ""
        if not isinstance(e, PmxError):
            traceback.print_exc()
        print(f"{who}error: {e if isinstance(e, PmxError) else f'{type(e).__name__}: {e}'}", file=sys.stderr,
              flush=True)
        if env and env.launcher == "mpi" and env.world_size > 1:
            from mpi4py import MPI
            MPI.COMM_WORLD.Abort(2)
        sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    run(COMMANDS, argv)
