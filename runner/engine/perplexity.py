"""Perplexity of a PMX model over a text file, with a sliding window: `python -m runner perplexity`.

The text is tokenized (BOS first) and cut into windows of `window` tokens that start every `stride`
tokens; each window runs as one prefill step of the engine (any rank count, any weights: float or
quantised), with the logits of every position kept, and scores the tokens no earlier window scored, so
every token after the first is predicted once, from up to `window - stride` tokens of context
(transformers' perplexity recipe). Reports exp(mean negative log-likelihood) and the forward tokens/s.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from runner.errors import PmxError


def all_logits(model, ids: list[int]) -> torch.Tensor:
    """float32 logits [T, vocab] of every position of one sequence, from a fresh cache (one prefill step)."""
    kv_cache, kv_scale = model.new_cache(len(ids))
    plan = model.plan([len(ids)], [0], [0], 0)
    return model.step(torch.tensor(ids, dtype=torch.int64), dataclasses.replace(plan, last=None), kv_cache, kv_scale)


def windows(n: int, window: int, stride: int):
    """(begin, end, first): window ids[begin:end] scores targets ids[first:end] (first > begin), each once."""
    scored = 1  # the first token (BOS) is never a target
    for begin in range(0, n - 1, stride):
        end = min(begin + window, n)
        if end > scored:
            yield begin, end, scored
            scored = end
        if end == n:
            break


def evaluate(model, ids: list[int], window: int, stride: int) -> dict:
    """{"perplexity", "nll", "tokens" (scored), "forward_tokens", "seconds"} of `ids` under `model`."""
    nll, scored, forward = 0.0, 0, 0
    t0 = time.perf_counter()
    for begin, end, first in windows(len(ids), window, stride):
        chunk = ids[begin:end]
        logits = all_logits(model, chunk)                                          # (T, V)
        targets = torch.tensor(chunk[first - begin:], device=logits.device)
        nll += float(F.cross_entropy(logits[first - begin - 1: -1], targets, reduction="sum"))
        scored, forward = scored + len(targets), forward + len(chunk)
    seconds = time.perf_counter() - t0
    return {"perplexity": math.exp(nll / scored), "nll": nll / scored, "tokens": scored, "forward_tokens": forward,
            "seconds": seconds}


def perplexity(ckpt_dir: str, text_file: str, tokenizer_path: Optional[str] = None, window: int = 256,
               stride: Optional[int] = None, max_tokens: Optional[int] = None, device: str = "auto",
               dtype: str = "auto", kernels: str = "auto") -> dict:
    """Perplexity and tokens/s of the PMX model in `ckpt_dir` over `text_file` (run under mpirun / torchrun
    for a split model). Prints one line on rank 0 and returns the numbers.

    Args:
        ckpt_dir: PMX directory (float or weight-only quantised), split into as many shards as ranks.
        text_file: a UTF-8 text file.
        tokenizer_path: tokenizer.model or tokenizer.json (default: the one in ckpt_dir).
        window: tokens per forward pass (at most the model's max_position_embeddings).
        stride: tokens between window starts (default window / 2); each token is scored once.
        max_tokens: use only the first max_tokens tokens of the text.
        device: auto, cpu or cuda.
        dtype: compute dtype: auto, float32, float16, bfloat16.
        kernels: auto, triton, torch or reference.
    """
    from runner.engine.model import EngineOptions
    from runner.engine.session import open_session
    from runner.engine.tokenizer import Tokenizer
    from runner.pmx.params import PmxParams

    params = PmxParams.load(Path(ckpt_dir))
    stride = window // 2 if stride is None else stride
    if not isinstance(window, int) or not 2 <= window <= params.max_position_embeddings:
        raise PmxError(f"--window must be an integer in [2, {params.max_position_embeddings}] (the model's "
                       f"max_position_embeddings), got {window!r}")
    if not isinstance(stride, int) or not 1 <= stride <= window - 1:
        raise PmxError(f"--stride must be an integer in [1, window - 1 = {window - 1}], got {stride!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 2):
        raise PmxError(f"--max_tokens must be an integer >= 2, got {max_tokens!r}")
    try:
        text = Path(text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PmxError(f"{text_file}: cannot read a UTF-8 text file ({getattr(e, 'strerror', None) or e})") from None
    tok = Tokenizer(tokenizer_path or ckpt_dir, params.bos_token_id, params.eos_ids[0] if params.eos_ids else None)
    ids = tok.encode(text)[:max_tokens]
    if len(ids) < 2:
        raise PmxError(f"{text_file}: too short, it holds {len(ids)} token(s); perplexity needs at least 2")
    sess = open_session(ckpt_dir, EngineOptions(kernels=kernels, compile="off"), device=device, dtype=dtype)
    all_logits(sess.model, ids[: min(len(ids), 8)])  # warm-up (kernel set-up) outside the timing
    res = evaluate(sess.model, ids, window, stride)
    quant = params.quantization["method"] if params.quantization else params.dtype
    if sess.is_main:
        print(f"perplexity {res['perplexity']:.4f} over {res['tokens']} tokens of {text_file} ({ckpt_dir}, {quant}, "
              f"{sess.env.world_size} rank(s), window {window}, stride {stride}); {res['forward_tokens']} tokens "
              f"forward in {res['seconds']:.2f} s ({res['forward_tokens'] / res['seconds']:.1f} tokens/s)", flush=True)
    sess.close()
    return res
