"""Opens a PMX model for serving on this rank: session, tokenizer, chat template, KV-cache budget, LLMEngine."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from runner.config import EngineConfig
from runner.engine.session import open_session
from runner.engine.tokenizer import Tokenizer
from runner.pmx.params import PmxParams
from runner.serve.chat import ChatTemplate
from runner.serve.engine import LLMEngine


@dataclass
class Loaded:
    session: object
    engine: LLMEngine
    tokenizer: object
    chat_template: Optional[ChatTemplate]
    eos_ids: list


def load(ckpt_dir: str, tokenizer_path: Optional[str], config: EngineConfig, stats=None, progress: bool = False,
         chat_template: Optional[str] = None, random_weights: bool = False) -> Loaded:
    """This rank's engine over `ckpt_dir` (split into as many shards as ranks; with `random_weights` only its
    pmx_params.json is read), with a KV cache of --kv_cache_tokens, else room for max_batch full-length sequences
    within the memory budget; the chat template of `chat_template` (a jinja file), else the tokenizer's."""
    params = PmxParams.load(Path(ckpt_dir))
    tok_dir = tokenizer_path or ckpt_dir
    tok = Tokenizer(tok_dir, params.bos_token_id, params.eos_ids[0] if params.eos_ids else None)
    template = ChatTemplate.load(Path(tok_dir), chat_template) or \
        (ChatTemplate.load(Path(ckpt_dir)) if tokenizer_path else None)
    eos = sorted(set(params.eos_ids) | ({tok.eos_id} if tok.eos_id is not None else set()))
    sess = open_session(ckpt_dir, config, random_weights=random_weights, progress=progress)
    core = sess.core
    core.reserve(core.budget_rows(config.max_batch * core.max_model_len))
    t0 = time.perf_counter()
    core.touch_cache()  # (a long-lived pool: its first touches paid now, not by the requests' steps)
    if progress and sess.is_main and core.cache.data.device.type == "cpu":
        print(f"KV cache: {core.cache.rows} tokens, {core.cache_bytes() / 2 ** 30:.2f} GiB on this rank (a draft "
              f"model's included; --kv_cache_tokens), written once in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
    return Loaded(sess, LLMEngine(core, tok, eos, stats), tok, template, eos)
