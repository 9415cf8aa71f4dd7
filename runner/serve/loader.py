"""Opens a PMX model for serving on this rank: session, tokenizer, chat template, KV-cache budget, engine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from runner.errors import PmxError
from runner.kernels.reference import PAGE_SIZE
from runner.serve.chat import ChatTemplate
from runner.serve.engine import Engine
from runner.serve.params import is_int, is_number

CPU_CACHE_MEMORY_FRACTION = 0.25  # default KV budget on CPU: at most this share of the available memory


@dataclass
class EngineArgs:
    """What the server and the offline API take beside the checkpoint (their flags, with these defaults)."""
    tokenizer_path: Optional[str] = None
    max_batch: int = 64
    max_num_batched_tokens: int = 512
    kv_cache_tokens: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    device: str = "auto"
    dtype: str = "auto"
    kernels: str = "auto"
    compile: str = "auto"
    quantized_cache: bool = False
    cache_layout: int = 0
    cuda_graphs: bool = True
    fused_decode: bool = True

    def check(self) -> None:
        for flag in ("max_batch", "max_num_batched_tokens", "kv_cache_tokens", "cache_layout"):
            value = getattr(self, flag)
            if not (is_int(value) or (value is None and flag == "kv_cache_tokens")):
                raise PmxError(f"--{flag} must be an integer, got {value!r}")
        if not is_number(self.gpu_memory_utilization):
            raise PmxError(f"--gpu_memory_utilization must be a number, got {self.gpu_memory_utilization!r}")
        if self.max_batch < 1:
            raise PmxError(f"--max_batch must be >= 1, got {self.max_batch}")
        if self.max_num_batched_tokens < self.max_batch:
            raise PmxError(f"--max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least --max_batch "
                           f"({self.max_batch}): every running sequence decodes in every step")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < PAGE_SIZE:
            raise PmxError(f"--kv_cache_tokens must be at least one page ({PAGE_SIZE}), got {self.kv_cache_tokens}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise PmxError(f"--gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class Loaded:
    session: object
    engine: Engine
    tokenizer: object
    chat_template: Optional[ChatTemplate]
    eos_ids: list


def page_bytes(model) -> int:
    """Bytes of one cache page on this rank (keys, values and int8 scales of every layer)."""
    kv, scale = model.new_cache(PAGE_SIZE)
    return kv.numel() * kv.element_size() + (0 if scale is None else scale.numel() * scale.element_size())


def kv_cache_pages(model, comm, args: EngineArgs) -> int:
    """Pages of the KV cache: --kv_cache_tokens, else a share of the device's memory (the same on every rank)."""
    if args.kv_cache_tokens is not None:
        return args.kv_cache_tokens // PAGE_SIZE
    per_page = page_bytes(model)
    if model.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(model.device)
        budget = total * args.gpu_memory_utilization - (total - free)
    else:
        budget = _available_memory() * CPU_CACHE_MEMORY_FRACTION
    wanted = -(-args.max_batch * model.params.max_position_embeddings // PAGE_SIZE)
    pages = torch.tensor([max(1, min(wanted, int(budget // per_page)))], dtype=torch.int64)
    if comm.world_size > 1 and model.device.type == "cuda":  # each device has its own free memory: the smallest
        pages = comm.all_gather(pages.to(model.device)).min()
    elif comm.world_size > 1:  # host memory: rank 0's reading for all
        pages = comm.broadcast_(pages)
    return int(pages)


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def load(ckpt_dir: str, args: EngineArgs, metrics=None) -> Loaded:
    """This rank's engine over `ckpt_dir` (split into as many shards as ranks)."""
    from runner.engine.model import EngineOptions
    from runner.engine.session import open_session
    from runner.engine.tokenizer import Tokenizer
    from runner.pmx.params import PmxParams

    args.check()
    params = PmxParams.load(Path(ckpt_dir))
    tok_dir = args.tokenizer_path or ckpt_dir
    tok = Tokenizer(tok_dir, params.bos_token_id, params.eos_ids[0] if params.eos_ids else None)
    template = ChatTemplate.load(Path(tok_dir)) or (ChatTemplate.load(Path(ckpt_dir)) if args.tokenizer_path else None)
    eos = sorted(set(params.eos_ids) | ({tok.eos_id} if tok.eos_id is not None else set()))
    options = EngineOptions(cache_mode=1, quantized_cache=args.quantized_cache, cache_layout=args.cache_layout,
                            kernels=args.kernels, compile=args.compile, cuda_graphs=args.cuda_graphs,
                            fused_decode=args.fused_decode)
    sess = open_session(ckpt_dir, options, device=args.device, dtype=args.dtype)
    pages = kv_cache_pages(sess.model, sess.comm, args)
    engine = Engine(sess.model, sess.comm, tok, eos, pages, args.max_batch, args.max_num_batched_tokens, metrics)
    return Loaded(sess, engine, tok, template, eos)
