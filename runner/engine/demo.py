"""Text generation from the command line: `scripts/Demo.py` / `python -m runner generate`.

Runs as one process, under `mpirun -np N` or under `torchrun --nproc_per_node N`; the model must be
split into N shards. The flags are ppl.pmx's Demo.py flags plus --prompt, --prompts_file, --seed,
--device and --dtype.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

from runner.args import (CacheLayout, CacheMode, CommBackend, Compile, Count, Device, Dtype, Kernels, PositiveInt,
                         Range, Seconds, int_list)
from runner.errors import PmxError

DEFAULT_PROMPT = "I believe the meaning of life is"
UNALIGNED_PROMPTS = (  # ppl.pmx's unaligned batch: prompts of different lengths in one batch
    "I believe the meaning of life is",
    "Simply put, the theory of relativity states that ",
    "A brief message congratulating the team on the launch:\n\nHi everyone,\n\nI just ",
    "Translate English to French:\n\nsea otter => loutre de mer\npeppermint => menthe poivrée\n"
    "plush girafe => girafe peluche\ncheese =>",
)


def run_meta(sess) -> dict:
    """What a replay needs to run a dumped step as it ran: engine options, dtype, device, ranks."""
    from dataclasses import asdict

    from runner.pmx.store import dtype_name
    return {"options": asdict(sess.model.options), "dtype": dtype_name(sess.model.dtype),
            "device": sess.device.type, "world_size": sess.env.world_size}


def generate(
    ckpt_dir: str,
    tokenizer_path: Optional[str] = None,
    prompt: Optional[str] = None,
    prompts_file: Optional[str] = None,
    temperature: Annotated[float, Range(0)] = 0.0,
    top_p: Annotated[float, Range(0, 1, lo_open=True)] = 0.95,
    top_k: Count = 0,
    seed: Optional[int] = None,
    batch: Optional[PositiveInt] = None,
    max_batch: PositiveInt = 256,
    seqlen_scale_up: PositiveInt = 1,
    unaligned_batch: bool = False,
    max_gen_len: PositiveInt = 256,
    friendly_gqa: bool = False,
    fused_qkv: bool = True,
    fused_kvcache: bool = True,
    fused_ffn_glu: bool = True,
    auto_causal: bool = True,
    quantized_cache: bool = False,
    cache_layout: CacheLayout = 0,
    cache_mode: CacheMode = 0,
    dynamic_batching: bool = True,
    context_chunking: bool = True,
    context_chunk_size: PositiveInt = 512,
    dump_tensor_path: Optional[str] = None,
    dump_steps: Optional[str] = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    kernels: Kernels = "auto",
    compile: Compile = "auto",
    cuda_graphs: bool = True,
    fused_decode: bool = True,
    show_ids: bool = False,
    progress: bool = True,
    collective_timeout: Optional[Seconds] = None,
    comm_backend: CommBackend = "auto",
) -> None:
    """Generate text with a PMX model on 1 or N ranks (mpirun / torchrun).

    Args:
        ckpt_dir: PMX directory split into as many shards as ranks are started.
        tokenizer_path: tokenizer.model or tokenizer.json (default: the one in ckpt_dir).
        prompt: the prompt (default: ppl.pmx's "I believe the meaning of life is").
        prompts_file: a file with one prompt per line (instead of --prompt).
        temperature: 0 is greedy; > 0 samples from softmax(logits / temperature).
        top_p: nucleus sampling mass (used when temperature > 0).
        top_k: keep the k most likely tokens, 0 for all (used when temperature > 0).
        seed: random seed for sampling.
        batch: number of sequences; the prompts are repeated to fill it (default: one per prompt).
        max_batch: at most this many sequences in one step; the rest join as others finish.
        seqlen_scale_up: repeat the prompt's tokens this many times (longer prefill, as ppl.pmx).
        unaligned_batch: use ppl.pmx's four prompts of different lengths.
        max_gen_len: new tokens per sequence at most (stops earlier on EOS).
        friendly_gqa: repeat K/V heads to the query heads before attention.
        fused_qkv: one GEMM for q, k, v.
        fused_kvcache: attention reads K/V straight from the cache (False: packed K/V, then attention).
        fused_ffn_glu: one GEMM for gate and up.
        auto_causal: the attention makes the causal mask (False: an explicit mask is built and passed; needs
            --fused_kvcache False).
        quantized_cache: int8 KV cache (groups of 8, float16 scales).
        cache_layout: 0..3, ppl.pmx's cache layouts.
        cache_mode: 0 offset, 1 paged (page size 128).
        dynamic_batching: must stay True (this engine always batches dynamically).
        context_chunking: cut long prefills into chunks of context_chunk_size tokens per step.
        context_chunk_size: prefill tokens per step when context_chunking.
        dump_tensor_path: write each chosen step's inputs and logits under this directory, per rank.
        dump_steps: steps to dump, e.g. 0,1,39 (default: every step when dump_tensor_path is set).
        device: auto, cpu or cuda (rank r uses cuda:local_rank).
        dtype: compute dtype: auto (float32 on CPU, the checkpoint's on GPU), float32, float16, bfloat16.
        kernels: auto (fused Triton kernels on CUDA, fast torch ops elsewhere), triton, torch or reference (the spec).
        compile: torch.compile the decode step (where --fused_decode does not run it): auto (on CPU, for models of
            32M+ parameters per rank), on, off.
        cuda_graphs: on CUDA with the Triton kernels, replay the decode step from a CUDA graph per batch bucket
            (1, 2, 4, ...); false runs every step eagerly.
        fused_decode: on CPU (float32), run each decode step as one C++ call, from token ids to logits, collectives
            included (runner.engine.fused_decode); false runs the torch step (compiled per --compile, or eager).
        show_ids: also print the generated token ids.
        progress: progress bars on stderr (rank 0): loading, then sequences done and tokens/s.
        collective_timeout: seconds a collective may wait for the other ranks (default $PMX_COLLECTIVE_TIMEOUT or 30).
        comm_backend: auto (none for one rank, mpi4py on CPU under mpirun, else NCCL on CUDA / gloo on CPU), mpi,
            torch, nccl or gloo (that torch.distributed backend even for one rank; gloo lets several ranks share
            one GPU, which NCCL refuses).
    """
    from runner.engine.dump import TensorDumper
    from runner.engine.generator import Generator
    from runner.engine.model import EngineOptions
    from runner.engine.sampler import SamplingParams
    from runner.engine.session import check_world_size, open_session
    from runner.engine.tokenizer import Tokenizer
    from runner.parallel.launch import detect
    from runner.pmx.params import PmxParams
    from runner.progress import GenerationProgress

    if not dynamic_batching:
        raise PmxError("--dynamic_batching False (static batching) is not supported: this engine always batches "
                       "dynamically, which gives the same tokens")
    if prompt is not None and (prompts_file or unaligned_batch):
        raise PmxError("give one of --prompt, --prompts_file, --unaligned_batch")
    steps = int_list(dump_steps, "dump_steps")
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    options = EngineOptions(fused_qkv=fused_qkv, fused_ffn_glu=fused_ffn_glu, fused_kvcache=fused_kvcache,
                            friendly_gqa=friendly_gqa, auto_causal=auto_causal, quantized_cache=quantized_cache,
                            cache_layout=cache_layout, cache_mode=cache_mode, kernels=kernels,
                            compile=compile, cuda_graphs=cuda_graphs, fused_decode=fused_decode)
    env = detect()
    params = PmxParams.load(Path(ckpt_dir))
    check_world_size(ckpt_dir, params.num_shards, env)
    dumper = TensorDumper(dump_tensor_path, env.rank, steps) if dump_tensor_path else None
    tok = Tokenizer(tokenizer_path or ckpt_dir, params.bos_token_id, params.eos_ids[0] if params.eos_ids else None,
                    vocab_size=params.vocab_size)
    if prompts_file:
        try:
            texts = [ln for ln in Path(prompts_file).read_text().splitlines() if ln.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise PmxError(f"{prompts_file}: cannot read prompts ({getattr(e, 'strerror', None) or e})") from None
        if not texts:
            raise PmxError(f"{prompts_file}: holds no prompts")
    elif unaligned_batch:
        texts = list(UNALIGNED_PROMPTS)
    else:
        texts = [DEFAULT_PROMPT if prompt is None else prompt]
    prompts = [tok.encode(t) for t in texts]
    if seqlen_scale_up > 1:
        prompts = [p * seqlen_scale_up for p in prompts]
    n = batch or len(prompts)
    prompts = [prompts[i % len(prompts)] for i in range(n)]
    if env.rank == 0:
        print(f"prepared {len(prompts)} prompts", flush=True)

    sess = open_session(ckpt_dir, options, device=device, dtype=dtype, timeout_s=collective_timeout,
                        comm_backend=comm_backend, progress=progress)
    if dumper is not None:
        dumper.meta = run_meta(sess)
    gen = Generator(sess.model, max_batch=max_batch, context_chunk=context_chunk_size if context_chunking else None,
                    dumper=dumper)
    eos = set(params.eos_ids) | ({tok.eos_id} if tok.eos_id is not None else set())
    stats: dict = {}
    bar = GenerationProgress(len(prompts), show=progress and sess.is_main)
    t0 = time.perf_counter()
    try:
        outs = gen.generate(prompts, max_gen_len, sampling, eos_ids=sorted(eos), stats=stats, progress=bar)
    finally:
        bar.close()
    dt = time.perf_counter() - t0
    if bar.shown and not sys.stderr.isatty():  # forwarded by a launcher, stderr's last bar line and this text may
        sess.log()                             # arrive in either order: keep the text off the bar's line
    for pr, out in zip(prompts, outs):
        sess.log(tok.decode(pr + out))
        if show_ids:
            sess.log(f"ids: {out}")
        sess.log("\n==================================\n")
    new = sum(len(o) for o in outs)
    if sess.is_main:
        print(f"[{sess.env.world_size} rank(s), {sess.device}] {len(prompts)} sequences, {new} new tokens in "
              f"{dt:.2f}s ({new / dt:.1f} tokens/s, {stats['steps']} steps)", file=sys.stderr, flush=True)
    sess.close()
