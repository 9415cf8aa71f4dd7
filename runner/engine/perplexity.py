"""Perplexity of a PMX model over a text file, with a sliding window: `python -m runner perplexity`.

The text is tokenized (BOS first) and cut into windows of `window` tokens that start every `stride`
tokens; each window is a prompt of its own, prefilled by the engine core's continuous batching (any rank count,
any weights: float or quantised) with the logits of every position kept, and scores the tokens no earlier window
scored, so every token after the first is predicted once, from up to `window - stride` tokens of context
(transformers' perplexity recipe). With `--scoring chunks`, llama.cpp's `llama-perplexity` recipe instead: whole
chunks of `window` tokens one after the other (a shorter rest left out), each scoring its tokens after its middle
(positions window / 2 + 1 .. window - 1, each from the chunk's tokens before it), each chunk's first token BOS where
the tokenizer adds one; the same number as llama-perplexity -c WINDOW on the same tokens. Reports exp(mean negative
log-likelihood) and the forward tokens/s.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Annotated, Optional

import torch
import torch.nn.functional as F

from runner.args import CkptDir, OneOf, PositiveInt, TokenizerPath
from runner.config import EngineConfig
from runner.engine.session import open_session
from runner.engine.tokenizer import Tokenizer
from runner.errors import PmxError
from runner.pmx.params import PmxParams


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


def chunks(n: int, window: int):
    """(begin, end, first) as :func:`windows`, of llama-perplexity's chunks: ids[i window, (i + 1) window) for every
    whole chunk, its targets from position window / 2 + 1 on."""
    for begin in range(0, n - window + 1, window):
        yield begin, begin + window, begin + window // 2 + 1


def evaluate(core, ids: list[int], window: int, stride: int, scoring: str = "sliding",
             bos: Optional[int] = None) -> dict:
    """{"perplexity", "nll", "tokens" (scored), "forward_tokens", "seconds"} of `ids` under the engine core: every
    window (`scoring` sliding) or chunk (chunks: its first token `bos` where given) a prompt of its own, scored by
    continuous batching."""
    spans = list(windows(len(ids), window, stride) if scoring == "sliding" else chunks(len(ids), window))
    nll = [0.0]

    def add(i: int, first: int, logits: torch.Tensor) -> None:  # logits row r predicts position first + r + 1
        begin, end, scored = spans[i]
        lo, hi = max(scored - begin - 1, first), min(end - begin - 1, first + logits.shape[0])
        if lo < hi:
            targets = torch.tensor(ids[begin + lo + 1: begin + hi + 1], device=logits.device)
            nll[0] += float(F.cross_entropy(logits[lo - first: hi - first], targets, reduction="sum"))

    t0 = time.perf_counter()
    prompts = [ids[b:e] for b, e, _ in spans]
    if scoring == "chunks" and bos is not None:
        prompts = [[bos] + p[1:] for p in prompts]
    core.score(prompts, add)
    seconds = time.perf_counter() - t0
    scored = sum(e - f for _, e, f in spans)
    return {"perplexity": math.exp(nll[0] / scored), "nll": nll[0] / scored, "tokens": scored,
            "forward_tokens": sum(e - b for b, e, _ in spans), "seconds": seconds}


def perplexity(ckpt_dir: CkptDir, text_file: str, tokenizer_path: TokenizerPath = None, window: PositiveInt = 256,
               stride: Optional[PositiveInt] = None, max_tokens: Optional[PositiveInt] = None,
               scoring: Annotated[str, OneOf("sliding", "chunks")] = "sliding",
               config: EngineConfig = EngineConfig()) -> dict:
    """Perplexity (sliding window) and tokens/s of a PMX model, float or quantised, over a text file. Prints one
    line on rank 0 and returns the numbers.

    Args:
        text_file: a UTF-8 text file.
        window: tokens per forward pass (at most max_position_embeddings).
        stride: tokens between window starts (default window / 2); every token is scored once.
        max_tokens: use only the first max_tokens tokens of the text.
        scoring: sliding (the windows above) or chunks (llama.cpp's llama-perplexity: whole chunks of `window`
            tokens, the second half of each scored; stride unused).
    """
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
    if scoring == "chunks" and len(ids) < window:
        raise PmxError(f"{text_file}: holds {len(ids)} tokens, fewer than one chunk of --window {window} "
                       f"(--scoring chunks scores whole chunks)")
    sess = open_session(ckpt_dir, config)
    sess.core.score([ids[: min(len(ids), 8)]], lambda *_: None)  # warm-up (kernel set-up) outside the timing
    bos = ids[0] if tok.bos_id is not None and ids[0] == tok.bos_id else None  # the tokenizer adds BOS
    res = evaluate(sess.core, ids, window, stride, scoring, bos)
    quant = params.quantization["method"] if params.quantization else params.dtype
    if sess.is_main:
        print(f"perplexity {res['perplexity']:.4f} over {res['tokens']} tokens of {text_file} ({ckpt_dir}, {quant}, "
              f"{sess.env.world_size} rank(s), window {window}, "
              f"{f'stride {stride}' if scoring == 'sliding' else 'chunks'}); {res['forward_tokens']} tokens "
              f"forward in {res['seconds']:.2f} s ({res['forward_tokens'] / res['seconds']:.1f} tokens/s)", flush=True)
    sess.close()
    return res
