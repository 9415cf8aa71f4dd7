"""The decoder-only transformer mapping shared by Llama-like families (HF -> PMX).

A family is this mapping plus a few switches (biases, sliding window and the layers' kinds, norms, fused HF
tensors, the config defaults transformers' config class fills in); a new Llama-like family is a few lines in its own
folder, not a copy of the pipeline.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from runner.errors import PmxError
from runner.kernels.reference import ROPE_TYPES
from runner.pmx.params import HIDDEN_ACTS, PmxParams
from runner.pmx.schema import pmx_tensors


@dataclass(frozen=True)
class TensorSource:
    """One PMX tensor and where it comes from in the HF checkpoint."""
    pmx_name: str
    hf_names: tuple          # candidates, the first present is used (tied embeddings have two names)
    shape: tuple             # the PMX tensor's shape (and the HF tensor's, unless hf_shape says otherwise)
    rotary_heads: int = 0    # > 0: rows are rotate-half q/k of this many heads; un-permute to interleaved pairs
    rotary_dims: int = 0     # with rotary_heads: the rows of each head rotated (a partial rotary's first ones; 0: all)
    stacked: tuple = ()      # MoE: the HF tensors (one per expert) stacked along a new first axis
    take: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # HF tensor -> this tensor (a part of a fused
                                                                   # q/k/v or gate/up tensor, a normalised head)
    hf_shape: Optional[tuple] = None  # the HF tensor's expected shape where `take` changes it

    @property
    def expected_hf_shape(self) -> tuple:
        return self.shape if self.hf_shape is None else self.hf_shape


def unpermute_rotary(w: torch.Tensor, n_heads: int, out: torch.Tensor | None = None,
                     rotary_dims: int = 0) -> torch.Tensor:
    """HF rotate-half q/k rows -> ppl.pmx / Meta interleaved-pair rows (inverse of HF's `permute`).

    HF row j < r/2 of a head holds the real part of pair j, row r/2 + j its imaginary part (r: the rows rotated,
    `rotary_dims`, the first ones of each head; 0: all of it); PMX stores them side by side (rows 2j, 2j+1); the
    rows past r pass as they are. Works for weights [rows, in] and biases [rows]. With `out` (w's dtype and shape),
    written there (conversion reuses one buffer for every tensor).
    """
    rows = w.shape[0]
    d = rows // n_heads
    r, tail = rotary_dims or d, w.shape[1:]
    heads = w.reshape(n_heads, d, *tail)
    pairs = heads[:, :r].reshape(n_heads, 2, r // 2, *tail).transpose(1, 2)  # (heads, r/2, 2, *tail)
    if out is None:
        out = torch.empty_like(w)
    o = out.view(n_heads, d, *tail)
    o[:, :r].unflatten(1, (r // 2, 2)).copy_(pairs)
    o[:, r:].copy_(heads[:, r:])
    return out


def permute_rotary(w: torch.Tensor, n_heads: int, rotary_dims: int = 0) -> torch.Tensor:
    """Interleaved-pair rows -> HF rotate-half rows (the inverse of :func:`unpermute_rotary`)."""
    rows = w.shape[0]
    d = rows // n_heads
    r, tail = rotary_dims or d, w.shape[1:]
    heads = w.reshape(n_heads, d, *tail)
    rot = heads[:, :r].reshape(n_heads, r // 2, 2, *tail).transpose(1, 2).reshape(n_heads, r, *tail)
    return torch.cat((rot, heads[:, r:]), 1).reshape(rows, *tail)


HF_SUFFIX = {  # PMX module -> HF module inside model.layers.{i}
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm", "post_ffn_norm": "post_feedforward_layernorm",
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
}
TOP_LEVEL = {  # tied embeddings may be stored under either name: the first present is used
    "tok_embeddings.weight": ("model.embed_tokens.weight", "lm_head.weight"),
    "output.weight": ("lm_head.weight", "model.embed_tokens.weight"),
    "norm.weight": ("model.norm.weight",),
}


def hf_names(pmx_name: str) -> tuple:
    """Candidate HF names of a PMX tensor (Llama-style naming)."""
    if pmx_name in TOP_LEVEL:
        return TOP_LEVEL[pmx_name]
    _, i, *rest = pmx_name.split(".")
    return (f"model.layers.{i}.{HF_SUFFIX['.'.join(rest[:-1])]}.{rest[-1]}",)


def _rope(c: dict, head_dim: int, source: str, layer_type: Optional[str] = None
          ) -> tuple[float, Optional[dict], int]:
    """(rope_theta, rope_scaling, rotary dims) from either the transformers<5 or the transformers>=5 config style
    (`rope_parameters`, per layer type where its keys are layer types: pass `layer_type`).

    As transformers does, llama3 / yarn / longrope scaling without `original_max_position_embeddings` takes the
    config's top-level one, else max_position_embeddings, so the params are complete on their own; Phi-3's "su" is
    longrope. The rotary dims are head_dim x partial_rotary_factor (the first ones of each head).
    """
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and layer_type is not None and isinstance(rp.get(layer_type), dict):
        rp = rp[layer_type]
    if isinstance(rp, dict):
        theta = float(rp.get("rope_theta", c.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    else:
        theta, scaling = float(c.get("rope_theta", 10000.0)), dict(c.get("rope_scaling") or {})
    factor = float(scaling.pop("partial_rotary_factor", None) or c.get("partial_rotary_factor") or 1.0)
    dims = int(head_dim * factor)
    if not 0 < dims <= head_dim or dims % 2:
        raise PmxError(f"{source}: partial_rotary_factor {factor} gives {dims} rotary dims of head_dim {head_dim}; "
                       f"expected an even number in [2, head_dim]")
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    kind = "longrope" if kind == "su" else kind
    if kind == "default":
        return theta, None, dims
    if kind not in ROPE_TYPES:
        raise PmxError(f"{source}: rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    scaling = {"rope_type": kind, **scaling}
    if kind in ("llama3", "yarn", "longrope") and not scaling.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = int(
            c.get("original_max_position_embeddings") or c.get("max_position_embeddings", 2048))
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            f = scaling.get(key)
            if not (isinstance(f, list) and len(f) == dims // 2 and all(isinstance(x, (int, float)) for x in f)):
                raise PmxError(f"{source}: rope_scaling {key!r} must be a list of {dims // 2} numbers (rotary dims "
                               f"/ 2), got {f!r}")
    return theta, scaling, dims


LAYER_KINDS = ("full_attention", "sliding_attention")


def _layer_kinds(c: dict, key: Optional[str], pattern: int, source: str) -> tuple[Optional[int], Optional[list]]:
    """(the sliding window, each layer's kind): (None, None) where no layer slides, (window, None) where every layer
    does, else (window, ["full_attention" | "sliding_attention", ...]). The kinds come from `layer_types`, else
    Qwen's `max_window_layers` (layers from it on slide), else a pattern (`sliding_window_pattern`, else the family's
    `pattern`: every pattern-th layer full, the others sliding, as Gemma's configs)."""
    if key is None or not c.get(key) or not c.get("sliding_window"):
        return None, None
    window, layers = int(c["sliding_window"]), int(c["num_hidden_layers"])
    kinds = c.get("layer_types")
    if kinds is None and "max_window_layers" in c:
        kinds = ["sliding_attention" if i >= int(c["max_window_layers"]) else "full_attention" for i in range(layers)]
    pattern = int(c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or pattern)
    if kinds is None and pattern:
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if kinds is None:
        return window, None
    if not isinstance(kinds, list) or len(kinds) != layers or any(k not in LAYER_KINDS for k in kinds):
        raise PmxError(f"{source}: layer_types must list {', '.join(LAYER_KINDS)} for each of the {layers} layers, "
                       f"got {kinds!r}")
    if "sliding_attention" not in kinds:
        return None, None
    return window, None if "full_attention" not in kinds else list(kinds)


@dataclass(frozen=True)
class DecoderFamily:
    name: str
    architectures: tuple
    qkv_bias: Optional[bool] = None              # None: from config "attention_bias"
    o_bias: Optional[bool] = None                # None: from config "attention_bias"
    sliding_window_key: Optional[str] = None     # config key whose truthiness enables "sliding_window"
    qk_norm: bool = False                        # per-head RMSNorm of q and k (self_attn.q_norm / k_norm)
    moe_module: Optional[str] = None             # MoE: HF module of router `gate` and `experts.{e}.w1/w2/w3`
    ignored: tuple = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)  # known, unused HF buffers
    gguf_architecture: Optional[str] = None      # general.architecture of this family's GGUF files (llama.cpp's)
    gguf_rotate_half: bool = False               # the GGUF keeps q/k rows rotate-half (llama.cpp's NEOX rope), as HF;
                                                 # else (llama) its converter permuted them to interleaved pairs
    gguf_defaults: tuple = ()                    # (key, value): what llama.cpp assumes where its GGUF has no key and
                                                 # the family's config defaults differ (Gemma 3: no window)
    gguf_norm_shift: float = 0.0                 # added to every norm weight by llama.cpp's converter (Gemma's 1: the
                                                 # file holds 1 + w), so taken off norm_offset
    gguf_score_scale_layers: Optional[tuple] = None  # llama.cpp's scale of the scores (no key holds it): set, 1 /
                                                 # sqrt(head_dim), or 1 / sqrt(hidden / heads) at these block counts
                                                 # (Gemma's 27B); None: the family's own (1 / sqrt(head_dim))
    config_defaults: tuple = ()                  # (key, value): what transformers' config class fills in where
                                                 # config.json has no such key (published configs leave them out)
    sliding_pattern: int = 0                     # without layer_types: every n-th layer full, the others sliding
    local_rope_key: Optional[str] = None         # the sliding layers' rope theta (a rope of their own where set)
    norm_offset: float = 0.0                     # RMSNorm multiplies by offset + weight (Gemma's 1 + w)
    post_norms: bool = False                     # post_attention_layernorm / post_feedforward_layernorm on the
                                                 # attention's and the MLP's outputs (Gemma's four norms a layer)
    scale_embeddings: bool = False               # the embeddings times sqrt(hidden_size)
    hf_modules: tuple = ()                       # (PMX module, HF module) where the family's differ from HF_SUFFIX
    fused_qkv: Optional[str] = None              # HF module of q | k | v in one tensor (Phi-3's self_attn.qkv_proj)
    fused_gate_up: Optional[str] = None          # HF module of gate | up in one tensor (Phi-3's mlp.gate_up_proj)
    hf_prefixes: tuple = ("model.",)             # where the decoder's tensors sit (the first one present is used)
    lm_heads: tuple = ("lm_head.weight",)        # the vocabulary projection's names
    text_config: bool = False                    # config.json's language model is its "text_config" (a multimodal
                                                 # checkpoint, whose other parts are not converted)
    left_out: tuple = ()                         # (regex, what): tensors of parts that are not converted, said so
    chat_template: Optional[str] = None          # the family's chat format where the checkpoint has no template
    chat_specials: tuple = ()                    # the special tokens the template writes

    def config(self, config: dict) -> dict:
        """The language model's config: the family's defaults under config.json's keys (a multimodal checkpoint's
        text_config, with the architecture and eos of the whole)."""
        c = config
        if self.text_config and isinstance(c.get("text_config"), dict):
            c = {**c["text_config"], "architectures": c.get("architectures"),
                 **({"eos_token_id": c["eos_token_id"]} if c.get("eos_token_id") is not None else {})}
        return {**dict(self.config_defaults), **c}

    def params(self, config: dict, dtype: str, source: str = "config.json", directory: Optional[Path] = None
               ) -> PmxParams:
        """pmx_params of `config` (read from `source`; `directory`: the checkpoint's, for files beside it)."""
        c = self.config(config)
        try:
            hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
            kv_heads = int(c.get("num_key_value_heads") or heads)
            head_dim = int(c.get("head_dim") or hidden // heads)
            theta, scaling, rotary_dims = _rope(c, head_dim, source, "full_attention")
            act = c.get("hidden_activation") or c.get("hidden_act") or "silu"
            if act not in HIDDEN_ACTS:
                raise PmxError(f"{source}: hidden activation {act!r} is not supported (expected one of "
                               f"{', '.join(HIDDEN_ACTS)})")
            if c.get("use_bidirectional_attention"):
                raise PmxError(f"{source}: use_bidirectional_attention is true (an embedding model); only causal "
                               f"attention is supported")
            attn_bias = bool(c.get("attention_bias", False))
            window, kinds = _layer_kinds(c, self.sliding_window_key, self.sliding_pattern, source)
            local = None
            if self.local_rope_key is not None and window is not None:
                local_c = {**c, "rope_theta": c.get(self.local_rope_key, 10000.0), "rope_scaling": None}
                local = _rope(local_c, head_dim, source, "sliding_attention")
            experts = int(c.get("num_local_experts") or 0) if self.moe_module else 0
            scalar = c.get("query_pre_attn_scalar")
            eos = ConfigKeys(c, source).eos(directory, generation_first=True)
            return PmxParams(
                model_type=self.name, architecture=c["architectures"][0],
                hidden_dim=hidden, intermediate_dim=int(c["intermediate_size"]),
                num_layers=int(c["num_hidden_layers"]), num_heads=heads, num_kv_heads=kv_heads,
                head_dim=head_dim, vocab_size=int(c["vocab_size"]), norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                rope_theta=theta, rope_scaling=scaling, rotary_dim=rotary_dims if rotary_dims != head_dim else None,
                max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
                qkv_bias=attn_bias if self.qkv_bias is None else self.qkv_bias,
                o_bias=attn_bias if self.o_bias is None else self.o_bias,
                ffn_bias=bool(c.get("mlp_bias", False)), sliding_window=window, layer_types=kinds, hidden_act=act,
                sliding_rope_theta=None if local is None or local[:2] == (theta, scaling) else local[0],
                sliding_rope_scaling=None if local is None or local[:2] == (theta, scaling) else local[1],
                norm_offset=self.norm_offset, post_norms=self.post_norms,
                embedding_scale=hidden ** 0.5 if self.scale_embeddings else 1.0,
                attention_scale=None if scalar is None else float(scalar) ** -0.5,
                attn_logit_softcapping=c.get("attn_logit_softcapping") or None,
                final_logit_softcapping=c.get("final_logit_softcapping") or None,
                qk_norm=self.qk_norm, num_experts=experts,
                num_experts_per_token=int(c["num_experts_per_tok"]) if experts else 0,
                tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                bos_token_id=c.get("bos_token_id"), eos_token_id=eos,
                pad_token_id=c.get("pad_token_id"), dtype=dtype,
            )
        except KeyError as e:
            raise PmxError(f"{source}: missing key {e.args[0]!r} needed for {self.name}") from None

    def hf_names(self, pmx_name: str) -> tuple:
        """Candidate HF names of a PMX tensor, the first present is used (Llama's naming, with this family's
        modules and prefixes)."""
        embed = tuple(f"{p}embed_tokens.weight" for p in self.hf_prefixes)
        if pmx_name == "tok_embeddings.weight":  # tied embeddings may be stored under either name
            return embed + self.lm_heads
        if pmx_name == "output.weight":
            return self.lm_heads + embed
        if pmx_name == "norm.weight":
            return tuple(f"{p}norm.weight" for p in self.hf_prefixes)
        _, i, *rest = pmx_name.split(".")
        module = {**HF_SUFFIX, **dict(self.hf_modules)}[".".join(rest[:-1])]
        return tuple(f"{p}layers.{i}.{module}.{rest[-1]}" for p in self.hf_prefixes)

    def tensor_sources(self, p: PmxParams) -> list[TensorSource]:
        """Every PMX tensor of an unsplit model, in file order, with its HF origin and expected shape."""
        out = []
        q, kv = p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim
        fused = {"wq": (self.fused_qkv, (q, kv, kv), 0), "wk": (self.fused_qkv, (q, kv, kv), 1),
                 "wv": (self.fused_qkv, (q, kv, kv), 2), "w1": (self.fused_gate_up, (p.intermediate_dim,) * 2, 0),
                 "w3": (self.fused_gate_up, (p.intermediate_dim,) * 2, 1)}
        for name, shape in pmx_tensors(p).items():
            module = name.split(".")[-2]
            rotary = {"wq": p.num_heads, "wk": p.num_kv_heads, "q_norm": 1, "k_norm": 1}.get(module, 0) \
                if ".attention." in name else 0  # q/k rows (and the q/k norm weights) to interleaved pairs
            dims = p.rotary_dims if rotary else 0
            if p.num_experts and ".feed_forward." in name:
                i, hf = name.split(".")[1], f"{self.hf_prefixes[0]}layers.{name.split('.')[1]}.{self.moe_module}"
                if module == "gate":
                    out.append(TensorSource(name, (f"{hf}.gate.weight",), shape))
                else:
                    experts = tuple(f"{hf}.experts.{e}.{module}.weight" for e in range(p.num_experts))
                    out.append(TensorSource(name, experts[:1], shape, stacked=experts))
                continue
            hf_module, sizes, k = fused.get(module, (None, (), 0)) if name.endswith(".weight") else (None, (), 0)
            if hf_module is not None and name.startswith("layers."):
                src = rows("", sizes, k)
                i = name.split(".")[1]
                out.append(TensorSource(name, tuple(f"{pre}layers.{i}.{hf_module}.weight" for pre in self.hf_prefixes),
                                        shape, rotary, dims, take=src.take, hf_shape=(src.hf_rows, *shape[1:])))
                continue
            out.append(TensorSource(name, self.hf_names(name), shape, rotary, dims))
        return out

    def is_ignored(self, hf_name: str) -> bool:
        return any(re.fullmatch(pat, hf_name) for pat in self.ignored)

    def left_out_part(self, hf_name: str) -> Optional[str]:
        """What part of a checkpoint `hf_name` belongs to that is not converted (said so), or None."""
        return next((what for pat, what in self.left_out if re.fullmatch(pat, hf_name)), None)

    def tokenizer_extras(self, directory: Path, params: PmxParams) -> dict:
        """Files (name -> text) the PMX directory gets beside the tokenizer files copied from `directory`: the
        family's chat template where the checkpoint has none, its special tokens listed."""
        if self.chat_template is None:
            return {}
        from model_zoo.chat import special_ids, tokenizer_config_with
        named = {}  # the texts of BOS and EOS, which the template writes as bos_token / eos_token
        for key, i in (("bos_token", params.bos_token_id), ("eos_token", (params.eos_ids or (None,))[0])):
            named.update({key: text for text in (special_ids(directory, [i]) if i is not None else {})})
        return tokenizer_config_with(directory, self.chat_template, special_ids(directory, self.chat_specials), named)

    # -- GGUF files: the same params and tensors from llama.cpp's keys and names ----------------------------------
    def gguf_config(self, meta: dict, tensors: dict, source: str, vectors: Optional[dict] = None) -> dict:
        """A transformers-style config (for :meth:`params`) from a GGUF file's metadata `meta` (key -> value),
        tensor shapes `tensors` (name -> shape) and the vectors llama.cpp keeps as tensors (`vectors`: name -> list,
        of GGUF_READ_INTO_PARAMS: llama3 rope's frequency factors, LongRoPE's long and short ones); where the file has
        no key, what llama.cpp assumes for the architecture (`gguf_defaults`, then the family's config defaults);
        what this family cannot run is refused naming the key."""
        a, vectors = self.gguf_architecture, vectors or {}
        keys = ConfigKeys({k[len(a) + 1:]: v for k, v in meta.items() if k.startswith(f"{a}.")}, source)
        hidden, heads = keys.int("embedding_length"), keys.int("attention.head_count")
        head_dim = keys.int("attention.key_length", hidden // heads)
        if keys.int("attention.value_length", head_dim) != head_dim:
            raise PmxError(f"{source}: {a}.attention.value_length = {keys.config['attention.value_length']} is not "
                           f"supported (values as wide as keys: {head_dim})")
        rotary = keys.int("rope.dimension_count", head_dim)
        if rotary > head_dim or rotary % 2:
            raise PmxError(f"{source}: {a}.rope.dimension_count = {rotary} is not supported (an even number of "
                           f"rotated dims, at most head_dim {head_dim})")
        embd = tensors.get("token_embd.weight")
        if embd is None:
            raise PmxError(f"{source}: has no tensor 'token_embd.weight'")
        experts = keys.int("expert_count", 0, minimum=0)
        theta = keys.float("rope.freq_base", 10000.0)
        layers = keys.int("block_count")
        config = {
            **dict(self.gguf_defaults),
            "architectures": [self.architectures[0]], "hidden_size": hidden,
            "intermediate_size": keys.int("feed_forward_length"), "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": keys.int("attention.head_count_kv", heads),
            "head_dim": head_dim, "vocab_size": keys.int("vocab_size", embd[0]),
            "rms_norm_eps": keys.float("attention.layer_norm_rms_epsilon"), "rope_theta": theta,
            "rope_scaling": _gguf_rope(keys, a, vectors, theta, rotary, source),
            "partial_rotary_factor": _factor_of(rotary, head_dim),
            "max_position_embeddings": keys.int("context_length", 2048), "hidden_act": "silu",
            "attention_bias": "blk.0.attn_q.bias" in tensors,
            "mlp_bias": "blk.0.ffn_gate.bias" in tensors,
            "tie_word_embeddings": "output.weight" not in tensors,
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "pad_token_id": meta.get(
                "tokenizer.ggml.padding_token_id"),
        }
        for key, name in (("attn_logit_softcapping", "attn_logit_softcapping"),
                          ("final_logit_softcapping", "final_logit_softcapping")):
            if key in keys.config:
                config[name] = keys.float(key)
        config.update(self._gguf_window(keys, layers))
        if "rope.freq_base_swa" in keys.config:  # the sliding layers' rope theta
            local = keys.float("rope.freq_base_swa")
            if self.local_rope_key is not None:
                config[self.local_rope_key] = local
            elif local != theta:
                raise PmxError(f"{source}: {a}.rope.freq_base_swa = {local} (a rope theta of the sliding layers' own) "
                               f"is not supported for {self.name}")
        if self.gguf_score_scale_layers is not None:  # llama.cpp's scale of the scores (no key holds it)
            config["query_pre_attn_scalar"] = hidden // heads if layers in self.gguf_score_scale_layers else head_dim
        if experts:
            config.update(num_local_experts=experts, num_experts_per_tok=keys.int("expert_used_count"))
        return config

    def _gguf_window(self, keys: "ConfigKeys", layers: int) -> dict:
        """The config's sliding window and layer kinds from `attention.sliding_window` (0: none) and llama.cpp's
        `attention.sliding_window_pattern` (an int n: layer i slides unless i % n == n - 1, every layer where n is 0;
        or a bool per layer), else the family's pattern; {} where the file has no window key."""
        if "attention.sliding_window" not in keys.config:
            return {}
        window = keys.int("attention.sliding_window", minimum=0)
        a = self.gguf_architecture
        if not window:
            return {"sliding_window": None}
        if self.sliding_window_key is None:
            raise PmxError(f"{keys.source}: {a}.attention.sliding_window = {window} is not supported for {self.name} "
                           f"(no sliding-window attention)")
        out = {"sliding_window": window, self.sliding_window_key: window}
        pattern = keys.config.get("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            if len(pattern) != layers or not all(isinstance(x, bool) for x in pattern):
                raise PmxError(f"{keys.source}: {a}.attention.sliding_window_pattern must hold a bool for each of the "
                               f"{layers} layers, got {pattern!r}")
            slides = pattern
        elif pattern is not None:
            n = keys.int("attention.sliding_window_pattern", minimum=0)
            slides = [n == 0 or i % n < n - 1 for i in range(layers)]
        else:
            return out
        out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in slides]
        return out

    def gguf_params(self, config: dict, dtype: str, source: str) -> PmxParams:
        """:meth:`params` of a :meth:`gguf_config`, the norms' offset less what llama.cpp's converter added to the
        weights (a Gemma GGUF's norms hold 1 + w: they are taken as they are)."""
        p = self.params(config, dtype, source=source)
        return p.replace(norm_offset=p.norm_offset - self.gguf_norm_shift)

    def gguf_sources(self, p: PmxParams, names: Optional[set] = None) -> list[TensorSource]:
        """:meth:`tensor_sources` with GGUF names (candidates: a tied lm head is `token_embd.weight`), q/k rows
        un-permuted only where the GGUF keeps them rotate-half. q | k | v are cut from `attn_qkv` where the file
        (`names`: its tensors) has it (Phi-3's, or any llama.cpp `--fuse-qkv` file), gate | up from `ffn_up` for a
        family whose checkpoints fuse them (llama.cpp keeps Phi-3's as it is)."""
        fused_qkv = names is not None and "blk.0.attn_qkv.weight" in names
        layout = replace(self, fused_qkv="attn_qkv" if fused_qkv else None,
                         fused_gate_up="ffn_up" if self.fused_gate_up else None)
        experts = p.num_experts > 0
        return [replace(src, hf_names=gguf_names(src.pmx_name, experts, src.take is not None),
                        rotary_heads=src.rotary_heads if self.gguf_rotate_half else 0,
                        rotary_dims=src.rotary_dims if self.gguf_rotate_half else 0)
                for src in layout.tensor_sources(p)]


GGUF_LAYER = {  # PMX module inside layers.{i} -> llama.cpp's tensor inside blk.{i}
    "attention_norm": "attn_norm", "ffn_norm": "ffn_norm", "attention.wq": "attn_q", "attention.wk": "attn_k",
    "attention.wv": "attn_v", "attention.wo": "attn_output", "attention.q_norm": "attn_q_norm",
    "attention.k_norm": "attn_k_norm", "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up",
    "feed_forward.w2": "ffn_down", "feed_forward.gate": "ffn_gate_inp",
    "post_attention_norm": "post_attention_norm", "post_ffn_norm": "post_ffw_norm",
}
GGUF_FUSED = {"attention.wq": "attn_qkv", "attention.wk": "attn_qkv", "attention.wv": "attn_qkv",
              "feed_forward.w1": "ffn_up", "feed_forward.w3": "ffn_up"}  # the parts of llama.cpp's fused tensors
GGUF_EXPERTS = {"feed_forward.w1": "ffn_gate_exps", "feed_forward.w3": "ffn_up_exps", "feed_forward.w2": "ffn_down_exps"}
GGUF_TOP = {"tok_embeddings.weight": ("token_embd.weight",), "output.weight": ("output.weight", "token_embd.weight"),
            "norm.weight": ("output_norm.weight",)}
# vectors llama.cpp stores as tensors, read into the params (gguf_config): llama3 rope's frequency factors, LongRoPE's
GGUF_READ_INTO_PARAMS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def gguf_names(pmx_name: str, experts: bool, fused: bool = False) -> tuple:
    """Candidate GGUF names of a PMX tensor (MoE experts: llama.cpp's stacked [E, out, in] tensors; `fused`: a part
    of a fused tensor)."""
    if pmx_name in GGUF_TOP:
        return GGUF_TOP[pmx_name]
    _, i, *rest = pmx_name.split(".")
    module = ".".join(rest[:-1])
    table = GGUF_EXPERTS if experts and module in GGUF_EXPERTS else GGUF_FUSED if fused else GGUF_LAYER
    name = table[module]
    return (f"blk.{i}.{name}.{rest[-1]}",)


def _factor_of(rotary: int, head_dim: int) -> float:
    """The partial_rotary_factor whose int(head_dim x factor) (transformers' rotary dims) is `rotary`: rotary /
    head_dim, or the next float above it where the product rounds below (30 / 44 x 44 < 30)."""
    import math
    f = rotary / head_dim
    return f if int(head_dim * f) == rotary else math.nextafter(f, 2.0)


def _gguf_rope(keys: "ConfigKeys", arch: str, vectors: dict, theta: float, rotary: int, source: str
               ) -> Optional[dict]:
    """rope_scaling (transformers' dict) of a GGUF: `rope.scaling.type` linear / yarn with its keys; llama3's
    frequency factors (`rope_freqs.weight`, which llama.cpp's converter computes from a llama3 rope_scaling) turned
    back into that dict; or LongRoPE's long and short factors (`rope_factors_long` / `_short.weight`, Phi-3's), with
    `rope.scaling.original_context_length` and the attention factor llama.cpp's converter computed
    (`rope.scaling.attn_factor`)."""
    kind = keys.config.get("rope.scaling.type", "none")
    factor = keys.config.get("rope.scaling.factor", keys.config.get("rope.scale_linear"))
    factors = vectors.get("rope_freqs.weight")
    longrope = [vectors.get(f"rope_factors_{k}.weight") for k in ("long", "short")]
    if factors is not None or any(f is not None for f in longrope):
        what = "rope_freqs.weight" if factors is not None else "rope_factors_long.weight"
        if kind not in ("none", None, "longrope") or (factors is not None and any(f is not None for f in longrope)):
            raise PmxError(f"{source}: both {what} and {arch}.rope.scaling.type {kind!r} (or another rope's factors); "
                           f"only one rope scaling is supported")
        if factors is not None:
            return llama3_rope_from_factors(factors, theta, rotary, source)
        for name, f in zip(("rope_factors_long.weight", "rope_factors_short.weight"), longrope):
            if f is None or len(f) != rotary // 2:
                raise PmxError(f"{source}: LongRoPE needs rope_factors_long.weight and rope_factors_short.weight of "
                               f"{rotary // 2} factors each (rotated dims / 2); {name} "
                               f"{'is missing' if f is None else f'has {len(f)}'}")
        out = {"rope_type": "longrope", "long_factor": [float(x) for x in longrope[0]],
               "short_factor": [float(x) for x in longrope[1]],
               "original_max_position_embeddings": keys.int("rope.scaling.original_context_length")}
        if "rope.scaling.attn_factor" in keys.config:
            out["attention_factor"] = keys.float("rope.scaling.attn_factor")
        return out
    if kind in ("none", None) and factor in (None, 1.0):
        return None
    if kind in ("none", None, "linear"):
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": keys.float("rope.scaling.factor"),
               "original_max_position_embeddings": keys.int("rope.scaling.original_context_length")}
        for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if key in keys.config:
                out[name] = keys.float(key)
        return out
    raise PmxError(f"{source}: {arch}.rope.scaling.type {kind!r} is not supported (supported: none, linear, yarn, "
                   f"llama3's rope_freqs.weight, LongRoPE's rope_factors_long / _short.weight)")


def llama3_rope_from_factors(factors: list, theta: float, head_dim: int, source: str) -> Optional[dict]:
    """The llama3 rope_scaling whose frequency factors (transformers' formula, which llama.cpp's converter writes as
    rope_freqs.weight: 1 for short wavelengths, `factor` for long ones, a smooth step between) are `factors`.
    low_freq_factor is taken as 1 (every Llama 3.x has it); high_freq_factor and the original context come from the
    factors of the smooth step (4 and their context where the step has a single factor); any mismatch is refused."""
    import math
    f = [float(x) for x in factors]
    if len(f) != head_dim // 2 or min(f) <= 0:
        raise PmxError(f"{source}: rope_freqs.weight must hold {head_dim // 2} positive factors, got {len(f)}")
    big = max(f)
    if big <= 1 + 1e-6:
        return None
    wave = [2 * math.pi * theta ** (2 * i / head_dim) for i in range(head_dim // 2)]
    smooth = [((1 / x - 1 / big) / (1 - 1 / big), w) for x, w in zip(f, wave) if 1 + 1e-4 < x < big * (1 - 1e-4)]
    low = 1.0

    def factors_of(high: float, ctx: float) -> list:
        out = []
        for w in wave:
            if w < ctx / high:
                out.append(1.0)
            elif w > ctx / low:
                out.append(big)
            else:
                s = (ctx / w - low) / (high - low)
                out.append(1 / ((1 - s) / big + s))
        return out

    guesses = []  # (high_freq_factor, original context): s (high - 1) = ctx / w - 1 at each point of the step
    if len(smooth) >= 2:
        (s1, w1), (s2, w2) = smooth[0], smooth[-1]
        den = s2 - s1 * w1 / w2
        a = (w1 / w2 - 1) / den if den else 0.0
        if a > 0:
            guesses.append((a + 1, w1 * (s1 * a + 1)))
    guesses += [(4.0, w * (s * 3 + 1)) for s, w in smooth[:1]]
    if not smooth:  # no step between the two: any context above 4x the longest unscaled wavelength and below the
        lo = 4 * max((w for x, w in zip(f, wave) if x <= 1 + 1e-4), default=0.0)  # shortest scaled one will do
        hi = min((w for x, w in zip(f, wave) if x >= big * (1 - 1e-4)), default=math.inf)
        guesses.append((4.0, 8192.0 if lo < 8192 < hi else (lo + min(hi, 2 * lo + 2)) / 2))
    for high, ctx in guesses:
        ctx = float(round(ctx))
        if all(abs(a - b) <= 1e-4 * b for a, b in zip(factors_of(high, ctx), f)):
            return {"rope_type": "llama3", "factor": big, "low_freq_factor": low,
                    "high_freq_factor": round(high, 6), "original_max_position_embeddings": int(ctx)}
    raise PmxError(f"{source}: rope_freqs.weight is not llama3's frequency factors for any high_freq_factor and "
                   f"original context (with low_freq_factor 1); this rope is not supported")


# --- families whose checkpoints are not in transformers' Llama naming -------------------------------------------------
REQUIRED = object()


class ConfigKeys:
    """Typed reads of a config.json that its family's code (not transformers) defines: each wrong, missing or
    unsupported key is a one-line error naming the file and the key."""

    def __init__(self, config: dict, source: str):
        self.config, self.source = config, source

    def _get(self, key: str, default: Any):
        if key in self.config and self.config[key] is not None:
            return self.config[key]
        if default is REQUIRED:
            raise PmxError(f"{self.source}: missing key {key!r}")
        return default

    def int(self, key: str, default: Any = REQUIRED, minimum: int = 1) -> int:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise PmxError(f"{self.source}: {key!r} must be an integer >= {minimum}, got {v!r}")
        return v

    def float(self, key: str, default: Any = REQUIRED) -> float:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise PmxError(f"{self.source}: {key!r} must be a positive number, got {v!r}")
        return float(v)

    def bool(self, key: str, default: Any = REQUIRED) -> bool:
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise PmxError(f"{self.source}: {key!r} must be true or false, got {v!r}")
        return v

    def expect(self, key: str, allowed: tuple, what: str) -> None:
        """The key is absent (or null) or one of `allowed`; anything else asks for what is not supported (`what`)."""
        v = self.config.get(key)
        if v is not None and v not in allowed:
            raise PmxError(f"{self.source}: {key!r} = {v!r} is not supported ({what})")

    def eos(self, directory: Optional[Path], generation_first: bool = False):
        """eos_token_id of config.json, else of generation_config.json beside it (an int or a list), else None;
        `generation_first`: generation_config.json's where it has one (what transformers' generate stops at)."""
        eos = self.config.get("eos_token_id")
        gen = Path(directory) / "generation_config.json" if directory is not None else None
        if (eos is None or generation_first) and gen is not None and gen.is_file():
            try:
                got = json.loads(gen.read_text()).get("eos_token_id")
            except (OSError, ValueError, AttributeError) as e:
                raise PmxError(f"{gen}: cannot read it as a JSON object ({e})") from None
            eos = got if got is not None else eos
        if eos is not None and not (isinstance(eos, int) or (isinstance(eos, list) and eos and
                                                             all(isinstance(e, int) for e in eos))):
            raise PmxError(f"{self.source}: 'eos_token_id' must be an integer or a list of them, got {eos!r}")
        return eos


@dataclass(frozen=True)
class Src:
    """Where one PMX tensor of a family comes from: the HF tensor `hf` ("{i}": the layer), all of it or the part
    `take` makes of it (`hf_rows`: the HF tensor's rows where `take` cuts rows)."""
    hf: str
    take: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    hf_rows: Optional[int] = None


def rows(hf: str, sizes: tuple, k: int, then: Optional[Callable] = None) -> Src:
    """Block k of the row blocks `sizes` of the fused HF tensor `hf` (e.g. q of [q; k; v], up of [gate; up])."""
    start, n = sum(sizes[:k]), sizes[k]

    def take(t: torch.Tensor) -> torch.Tensor:
        part = t.narrow(0, start, n)
        return part if then is None else then(part)
    return Src(hf, take, sum(sizes))


def table_sources(p: PmxParams, table: dict, rotate_half: bool) -> list[TensorSource]:
    """Every PMX tensor of an unsplit model (in file order) from a family's `table`: PMX name, with "layers.{i}."
    left out for a layer's tensors -> Src. `rotate_half`: the family's q/k rows (and biases) are rotate-half ones,
    un-permuted to interleaved pairs after `take`."""
    out = []
    for name, shape in pmx_tensors(p).items():
        parts = name.split(".")
        layer, key = (parts[1], ".".join(parts[2:])) if parts[0] == "layers" else (None, name)
        src = table[key]
        module = parts[-2]
        rot = {"wq": p.num_heads, "wk": p.num_kv_heads}.get(module, 0) if rotate_half and ".attention." in name else 0
        out.append(TensorSource(name, (src.hf.format(i=layer),), tuple(shape), rot, take=src.take,
                                hf_shape=None if src.hf_rows is None else (src.hf_rows, *shape[1:])))
    return out


def normalized_rows(t: torch.Tensor) -> torch.Tensor:
    """Each row divided by its L2 norm (torch.nn.functional.normalize), in float32: Baichuan 2's NormHead."""
    return torch.nn.functional.normalize(t.float(), dim=-1)
