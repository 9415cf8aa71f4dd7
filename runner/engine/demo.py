"""Text generation from the command line: `scripts/Demo.py` / `python -m runner generate`.

Runs as one process, under `mpirun -np N` or under `torchrun --nproc_per_node N`; the model must be
split into N shards. The flags are ppl.pmx's Demo.py flags (its engine switches are EngineConfig's, shared by
every command) plus --prompt, --prompts_file, --seed.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

from runner.args import CkptDir, Count, PositiveInt, Progress, Range, TokenizerPath, int_list
from runner.config import EngineConfig
from runner.engine.dump import TensorDumper
from runner.engine.layer_dump import LayerDumper
from runner.engine.sampler import SamplingParams
from runner.engine.session import check_world_size, open_session
from runner.engine.tokenizer import Tokenizer
from runner.errors import PmxError
from runner.parallel.launch import detect
from runner.pmx.params import PmxParams
from runner.pmx.store import dtype_name
from runner.progress import GenerationProgress

DEFAULT_PROMPT = "I believe the meaning of life is"
UNALIGNED_PROMPTS = (  # ppl.pmx's unaligned batch: prompts of different lengths in one batch
    "I believe the meaning of life is",
    "Simply put, the theory of relativity states that ",
    "A brief message congratulating the team on the launch:\n\nHi everyone,\n\nI just ",
    "Translate English to French:\n\nsea otter => loutre de mer\npeppermint => menthe poivrée\n"
    "plush girafe => girafe peluche\ncheese =>",
)


def run_meta(sess) -> dict:
    """What a replay needs to run a dumped step as it ran: engine config, dtype (compute, and the linear weights'),
    device, ranks."""
    return {"options": asdict(sess.model.config), "dtype": dtype_name(sess.model.dtype),
            "weight_dtype": dtype_name(sess.model.weight_dtype),
            "device": sess.device.type, "world_size": sess.env.world_size,
            "kv_replication": sess.model.params.kv_replication}


def generate(
    ckpt_dir: CkptDir,
    tokenizer_path: TokenizerPath = None,
    prompt: Optional[str] = None,
    prompts_file: Optional[str] = None,
    temperature: Annotated[float, Range(0)] = 0.0,
    top_p: Annotated[float, Range(0, 1, lo_open=True)] = 0.95,
    top_k: Count = 0,
    seed: Optional[int] = None,
    batch: Optional[PositiveInt] = None,
    seqlen_scale_up: PositiveInt = 1,
    unaligned_batch: bool = False,
    max_gen_len: PositiveInt = 256,
    dynamic_batching: bool = True,
    dump_tensor_path: Optional[str] = None,
    dump_steps: Optional[str] = None,
    dump_layers: bool = False,
    show_ids: bool = False,
    chat: bool = False,
    progress: Progress = True,
    config: EngineConfig = EngineConfig(),
) -> None:
    """Generate text with a PMX model on 1 or N ranks (mpirun / torchrun).

    Args:
        prompt: the prompt (default: ppl.pmx's "I believe the meaning of life is").
        prompts_file: a file with one prompt per line (instead of --prompt).
        temperature: 0 is greedy; > 0 samples from softmax(logits / temperature).
        top_p: nucleus sampling mass (used when temperature > 0).
        top_k: keep the k most likely tokens, 0 for all (used when temperature > 0).
        seed: random seed for sampling (sequence i uses seed + i).
        batch: number of sequences; the prompts are repeated to fill it (default: one per prompt).
        seqlen_scale_up: repeat the prompt's tokens this many times (longer prefill, as ppl.pmx).
        unaligned_batch: use ppl.pmx's four prompts of different lengths.
        max_gen_len: new tokens per sequence at most (stops earlier on EOS).
        dynamic_batching: must stay true (this engine always batches dynamically).
        dump_tensor_path: write each chosen step's inputs and logits under this directory, per rank.
        dump_steps: steps to dump, e.g. 0,1,39 (default: every step when dump_tensor_path is set).
        dump_layers: with dump_tensor_path, also each layer's op outputs of the dumped steps (layer{i}_{op}: norm, q k
            v, attention, o, ffn, residual), for `compare --per_layer`; those steps run on the eager runner (the
            one-call C++ decode step and CUDA graphs have no per-layer values).
        show_ids: also print the generated token ids.
        chat: each prompt is one user message in the model's chat template (its tokenizer_config.json's
            chat_template), and only the reply is printed.
    """
    if not dynamic_batching:
        raise PmxError("--dynamic_batching False (static batching) is not supported: this engine always batches "
                       "dynamically, which gives the same tokens")
    if prompt is not None and (prompts_file or unaligned_batch):
        raise PmxError("give one of --prompt, --prompts_file, --unaligned_batch")
    steps = int_list(dump_steps, "dump_steps")
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    env = detect()
    params = PmxParams.load(Path(ckpt_dir))
    check_world_size(ckpt_dir, params, env)
    if dump_layers and not dump_tensor_path:
        raise PmxError("--dump_layers needs --dump_tensor_path (where the layers' values go)")
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
    if chat:
        from runner.serve.chat import ChatTemplate
        template = ChatTemplate.load(Path(tokenizer_path or ckpt_dir))
        if template is None:
            raise PmxError(f"{tokenizer_path or ckpt_dir}: --chat needs a chat_template in tokenizer_config.json (or a "
                           f"chat_template.jinja); this model has none")
        prompts = [template.encode(tok, template.render([{"role": "user", "content": t}])) for t in texts]
    else:
        prompts = [tok.encode(t) for t in texts]
    if seqlen_scale_up > 1:
        prompts = [p * seqlen_scale_up for p in prompts]
    n = batch or len(prompts)
    prompts = [prompts[i % len(prompts)] for i in range(n)]
    if env.rank == 0:
        print(f"prepared {len(prompts)} prompts", flush=True)

    sess = open_session(ckpt_dir, config, progress=progress)
    if dump_layers:
        dumper = LayerDumper(dump_tensor_path, env.rank, sess.model, sess.stepper, steps)
    if dumper is not None:
        dumper.meta = run_meta(sess)
    eos = set(params.eos_ids) | ({tok.eos_id} if tok.eos_id is not None else set())
    stats: dict = {}
    bar = GenerationProgress(len(prompts), show=progress and sess.is_main)
    t0 = time.perf_counter()
    try:
        outs = sess.core.generate(prompts, max_gen_len, sampling, sorted(eos), dumper, stats, bar)
    finally:
        bar.close()
    dt = time.perf_counter() - t0
    if bar.shown and not sys.stderr.isatty():  # forwarded by a launcher, stderr's last bar line and this text may
        sess.log()                             # arrive in either order: keep the text off the bar's line
    for text, pr, out in zip(texts * (len(prompts) // len(texts) + 1), prompts, outs):
        sess.log(f"{text}\n-> {tok.decode(out)}" if chat else tok.decode(pr + out))
        if show_ids:
            sess.log(f"ids: {out}")
        sess.log("\n==================================\n")
    new = sum(len(o) for o in outs)
    if sess.is_main:
        print(f"[{sess.env.world_size} rank(s), {sess.device}] {len(prompts)} sequences, {new} new tokens in "
              f"{dt:.2f}s ({new / dt:.1f} tokens/s, {stats['steps']} steps)", file=sys.stderr, flush=True)
    sess.close()
