"""EngineConfig: every engine flag, defined once (type, default, one line of help), validated in one place.

Every command that runs the engine (generate, bench, perplexity, serve, replay) takes these flags, and
`LLM(ckpt_dir, **fields)` takes them as keyword arguments: :mod:`runner.args` spreads the fields into a
command's flags and gathers them back into one EngineConfig.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Optional

from runner.args import (CacheLayout, CacheMode, CommBackend, Compile, Device, Dtype, Kernels, OneOf, PositiveInt,
                         Range, Seconds, check_fields, flag)
from runner.errors import PmxError
from runner.kernels.reference import PAGE_SIZE, QUANT_GROUP


@dataclass(frozen=True)
class EngineConfig:
    # where and in what precision
    device: Device = flag("auto", "auto, cpu or cuda (rank r uses cuda:local_rank)")
    dtype: Dtype = flag("auto", "compute dtype: auto (the checkpoint's on GPU; on CPU float32, with a bfloat16 / "
                                "float16 checkpoint's linear weights kept at their width; replay: the dumped run's), "
                                "float32 (weights too), float16, bfloat16")
    comm_backend: CommBackend = flag("auto", "auto (none for one rank, mpi4py on CPU under mpirun, else NCCL on CUDA / "
                                             "gloo on CPU), mpi, torch, nccl or gloo (gloo lets ranks share a GPU)")
    collective_timeout: Optional[Seconds] = flag(None, "seconds a collective may wait for the other ranks (default "
                                                       "$PMX_COLLECTIVE_TIMEOUT or 30)")
    # the model's kernels and the KV cache (ppl.pmx's Demo.py switches)
    kernels: Kernels = flag("auto", "auto (Triton on CUDA, fast torch elsewhere), triton, torch or reference (the "
                                    "spec)")
    fused_qkv: bool = flag(True, "one GEMM for q, k and v")
    fused_ffn_glu: bool = flag(True, "one GEMM for gate and up")
    fused_kvcache: bool = flag(True, "attention reads K/V straight from the cache (false: ppl.pmx's packed K/V, "
                                     "then attention per sequence)")
    friendly_gqa: bool = flag(False, "repeat K/V heads to the query heads before attention")
    auto_causal: bool = flag(True, "attention makes the causal mask (false: an explicit mask is passed; needs "
                                   "--fused_kvcache false)")
    quantized_cache: bool = flag(False, "int8 KV cache (groups of 8, float16 scales)")
    cache_layout: CacheLayout = flag(0, "ppl.pmx's KV cache layout, 0..3")
    cache_mode: CacheMode = flag(0, "0 offset (a region per sequence), 1 paged (pages of 128 tokens)")
    prepack: bool = flag(True, "CPU float32: weights repacked once at load for this project's linear kernel (false: "
                               "plain float32 F.linear)")
    decode_linears: bool = flag(True, "CUDA: batch-1 decode linears (float16 / bfloat16, int8, int4) on the Triton "
                                      "GEMV kernel")
    norm_in_linears: bool = flag(True, "each RMSNorm inside the linear after it (the row's RMS summed as it loads "
                                       "the row), the residual added by the linear before it: no norm kernels. CUDA: "
                                       "batch-1 steps with --decode_linears; CPU: bfloat16 weights with AVX512-BF16, "
                                       "any rows")
    rotary_in_qkv: bool = flag(True, "rotary and the K/V cache store as the qkv linear's epilogue (CUDA: batch-1 "
                                     "steps with --decode_linears; CPU: this project's kernel, any rows)")
    merge_in_attention: bool = flag(True, "CUDA decode attention: the key splits merged by the last program of each "
                                          "(sequence, KV head) to finish, not by a kernel of their own")
    pdl: bool = flag(False, "CUDA sm_90+, with --decode_linears: the decode linears launched with programmatic "
                            "dependent launch (each starts while the kernel before it drains)")
    # how steps run (runner.engine.runners)
    fused_decode: bool = flag(True, "CPU float32: a decode step as one C++ call, collectives included")
    compile: Compile = flag("auto", "torch.compile the decode step where the one-call step does not run it: auto "
                                    "(on CPU for 32M+ parameters per rank), on, off")
    cuda_graphs: bool = flag(True, "CUDA with the Triton kernels: replay decode steps from a CUDA graph per batch "
                                   "bucket")
    seq_parallel: bool = flag(True, "CPU float32 at TP > 1: prefill and mixed steps keep the residual stream cut by "
                                    "rows (the same bits)")
    # continuous batching (runner.engine.scheduler) and the cache budget
    max_batch: PositiveInt = flag(256, "sequences in one step at most; the rest wait")
    context_chunking: bool = flag(True, "cut long prefills into chunks of --context_chunk_size tokens per step")
    context_chunk_size: PositiveInt = flag(512, "prefill tokens per step when --context_chunking")
    decode_chunk_size: PositiveInt = flag(48, "prefill tokens per step while sequences decode, when "
                                              "--context_chunking (a long chunk delays their next tokens)")
    max_num_batched_tokens: Optional[PositiveInt] = flag(None, "tokens in one step at most, decoding ones included "
                                                               "(vLLM's; at least --max_batch)")
    speculative: Annotated[str, OneOf("off", "ngram", "draft")] = flag(
        "off", "speculative decoding: ngram guesses a decoding sequence's next tokens from where its last ones "
               "occurred before (prompt lookup), draft from a small model of the same tokenizer "
               "(--speculative_model); verified in one step, the same tokens as without")
    speculative_model: Optional[str] = flag(None, "--speculative draft: the draft model, a PMX directory of one shard "
                                                  "with the target's tokenizer (each rank runs it whole)")
    num_speculative_tokens: PositiveInt = flag(4, "tokens guessed a step per sequence (--speculative)")
    prompt_lookup_max: PositiveInt = flag(4, "--speculative ngram: the longest n-gram matched (longest first)")
    prompt_lookup_min: PositiveInt = flag(1, "--speculative ngram: the shortest n-gram matched")
    enable_prefix_caching: bool = flag(True, "--cache_mode 1: sequences share the KV pages of a common prefix (chat "
                                             "turns, system prompts), kept until their room is needed")
    kv_cache_tokens: Optional[PositiveInt] = flag(None, "KV-cache budget in tokens (default: what the work needs, "
                                                        "within --gpu_memory_utilization of a GPU or a quarter of "
                                                        "free host memory)")
    gpu_memory_utilization: Annotated[float, Range(0, 1, lo_open=True)] = flag(
        0.9, "on CUDA, the share of the device memory weights and cache may use")

    def __post_init__(self):
        check_fields(self)
        if not self.auto_causal and self.fused_kvcache:
            raise PmxError("--auto_causal false needs --fused_kvcache false (the explicit mask is applied by the "
                           "unfused attention)")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_batch:
            raise PmxError(f"--max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least --max_batch "
                           f"({self.max_batch}): every running sequence decodes in every step")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise PmxError(f"--prompt_lookup_min ({self.prompt_lookup_min}) must be at most --prompt_lookup_max "
                           f"({self.prompt_lookup_max})")
        if (self.speculative == "draft") != (self.speculative_model is not None):
            raise PmxError("--speculative draft and --speculative_model DIR go together (the draft model's PMX "
                           f"directory); got --speculative {self.speculative} and --speculative_model "
                           f"{self.speculative_model}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < PAGE_SIZE:
            raise PmxError(f"--kv_cache_tokens must be at least one page ({PAGE_SIZE}), got {self.kv_cache_tokens}")

    @property
    def paged(self) -> bool:
        return self.cache_mode == 1

    @property
    def prefill_chunk(self) -> Optional[int]:
        """Prefill tokens per step at most (None: no limit)."""
        return self.context_chunk_size if self.context_chunking else None

    @property
    def decode_chunk(self) -> Optional[int]:
        """Prefill tokens per step at most while sequences decode (None: no limit)."""
        return min(self.decode_chunk_size, self.context_chunk_size) if self.context_chunking else None

    def check_model(self, head_dim: int) -> None:
        """What the model must allow for these settings."""
        if self.quantized_cache and head_dim % QUANT_GROUP:
            raise PmxError(f"--quantized_cache needs head_dim divisible by {QUANT_GROUP}; this model has "
                           f"head_dim={head_dim}")


def serving_config(**fields) -> EngineConfig:
    """The engine settings the server and the `LLM` API start from (`fields` override them): a paged cache (a budget
    of pages shared by the requests, with prefix caching) in layout 2 ([L, 2, MaxT, KV, D]: a layer's rows of
    consecutive positions are adjacent, so decode attention streams each history; in ppl.pmx's layout 0 they are a
    whole token's layers apart, and a step of 16 sequences at 230 positions took 32 ms instead of 16 on the 134M
    benchmark model). Demo, bench and the other ppl.pmx commands keep ppl.pmx's defaults (layout 0, offset)."""
    return EngineConfig(**{"cache_mode": 1, "cache_layout": 2, **fields})

