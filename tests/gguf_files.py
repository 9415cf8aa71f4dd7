"""Small GGUF files for the tests, written with gguf's GGUFWriter from a transformers model's weights the way
llama.cpp's convert_hf_to_gguf.py lays them out: its tensor names, Llama's q/k rows permuted to interleaved pairs
(its LlamaModel.permute; qwen2 / qwen3 / gemma2 / gemma3 / phi3 keep HF's rows), experts stacked [E, out, in], Gemma's
norms as 1 + w, Phi-3's fused q | k | v and gate | up, its metadata keys per architecture, and a tokenizer (a
byte-level BPE trained here, or a sentencepiece-style vocabulary with scores)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import gguf
import numpy as np
import torch

LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "block_sparse_moe.gate": "ffn_gate_inp",
         "mlp.gate": "ffn_gate_inp"}
GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
ARCH_LAYER = {  # where an architecture's names differ from LAYER (gguf-py's tensor_mapping for it)
    "gemma2": GEMMA_LAYER, "gemma3": GEMMA_LAYER,
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}}
NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}  # llama.cpp's Gemma converters add 1 to every norm weight
CORPUS = "Once upon a time there was a little girl named Lily. She loved to play outside in the park with her cat. "


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF's rotate-half q/k rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model, arch: str) -> dict:
    """{GGUF name: float32 array} of a transformers model, in llama.cpp's layout."""
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    shift = NORM_SHIFT.get(arch, 0.0)
    names = {**LAYER, **ARCH_LAYER.get(arch, {})}
    out = {"token_embd.weight": sd.pop("model.embed_tokens.weight"),
           "output_norm.weight": sd.pop("model.norm.weight") + np.float32(shift)}
    lm = sd.pop("lm_head.weight", None)
    if lm is not None and not cfg.tie_word_embeddings:
        out["output.weight"] = lm
    for name, w in sd.items():
        if "rotary_emb" in name:
            continue
        _, _, i, *rest = name.split(".")
        module, leaf = ".".join(rest[:-1]), rest[-1]
        if module == "mlp.experts":  # transformers 5 holds experts stacked: gate_up_proj [E, 2F, D], down_proj
            if leaf == "gate_up_proj":
                out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = np.split(w, 2, axis=1)
            else:
                out[f"blk.{i}.ffn_down_exps.weight"] = w
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg.num_attention_heads if module.endswith("q_proj") else cfg.num_key_value_heads
            w = permute(w, heads)
        if name.endswith("norm.weight"):
            w = w + np.float32(shift)
        out[f"blk.{i}.{names[module]}.{leaf}"] = w
    return out


def byte_level_vocab(vocab_size: int) -> dict:
    """A byte-level BPE (tokenizers' trainer on a small corpus) of exactly `vocab_size` tokens: 0 <unk>, 1 <s>,
    2 </s> (control), then bytes and merges, padded with control tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer)
    import json
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [3 if t in ("<unk>", "<s>", "</s>") or t.startswith("<extra_") else 1 for t in tokens]
    return dict(model="gpt2", tokens=tokens, merges=merges, types=types, bos=1, eos=2, unk=0)


def sentencepiece_vocab(vocab_size: int) -> dict:
    """A Llama-style sentencepiece vocabulary of `vocab_size` tokens: <unk> <s> </s>, the 256 byte tokens, then
    whole-word and letter pieces with descending scores (no merges: transformers derives them from the scores)."""
    words = sorted({"\u2581" + w.strip(".") for w in CORPUS.split()} | {"\u2581"} | set(CORPUS.replace(" ", "")))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = [w for w in words if w not in tokens][: vocab_size - len(tokens)]
    tokens, types = tokens + pieces, types + [1] * len(pieces)
    tokens += [f"<unused_{i}>" for i in range(vocab_size - len(tokens))]
    types += [5] * (vocab_size - len(types))
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return dict(model="llama", tokens=tokens, scores=scores, types=types, bos=1, eos=2, unk=0)


def write_gguf(model, path: Path, arch: str = "llama", qtype: Callable[[str, tuple], str] = lambda n, s: "F32",
               tokenizer: Optional[dict] = None, split_max_tensors: int = 0, pre: str = "gpt-2",
               extra: Optional[dict] = None, chat_template: Optional[str] = None) -> list[Path]:
    """Writes `model` (a transformers Llama / Mixtral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 / Phi-3) as a GGUF file of
    architecture `arch`, each tensor in the type `qtype(name, shape)` names (F32, F16, BF16, or one gguf quantises:
    Q8_0, Q4_0, Q4_1, Q5_0, ...), `extra` tensors added as given ({name: (type, array)}); split into parts of
    `split_max_tensors` tensors where set. Returns the files written."""
    cfg = model.config
    tokenizer = tokenizer or byte_level_vocab(cfg.vocab_size)
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    tensors = {n: ("F32", a) for n, a in gguf_tensors(model, arch).items()}
    for key, value in hparams(cfg, arch).items():
        if isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        elif isinstance(value, int):
            w.add_uint32(f"{arch}.{key}", value)
        else:
            w.add_float32(f"{arch}.{key}", value)
    tensors.update(rope_tensors(cfg, arch))
    w.add_string("tokenizer.ggml.model", tokenizer["model"])
    if tokenizer["model"] == "gpt2":
        w.add_string("tokenizer.ggml.pre", pre)
        w.add_token_merges(tokenizer["merges"])
    else:
        w.add_token_scores(tokenizer["scores"])
    w.add_token_list(tokenizer["tokens"])
    w.add_token_types(tokenizer["types"])
    w.add_uint32("tokenizer.ggml.bos_token_id", tokenizer["bos"])
    w.add_uint32("tokenizer.ggml.eos_token_id", tokenizer["eos"])
    w.add_uint32("tokenizer.ggml.unknown_token_id", tokenizer["unk"])
    if "add_bos" in tokenizer:
        w.add_bool("tokenizer.ggml.add_bos_token", tokenizer["add_bos"])
    if chat_template:
        w.add_chat_template(chat_template)
    tensors = {n: (qtype(n, a.shape) if a.ndim >= 2 else "F32", a) for n, (_, a) in tensors.items()}
    tensors.update(extra or {})
    for name, (type_name, a) in tensors.items():
        t = gguf.GGMLQuantizationType[type_name]
        if type_name == "F32":
            w.add_tensor(name, a.astype(np.float32))
        elif type_name == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            data = a if a.dtype == np.uint8 else gguf.quants.quantize(a.astype(np.float32), t)
            w.add_tensor(name, data, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(Path(path))


def _rope(cfg) -> tuple[dict, dict]:
    """(the full layers' rope parameters, the sliding layers') of a transformers config, either style."""
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    if "full_attention" in rp:
        return rp["full_attention"], rp.get("sliding_attention", {})
    return rp or {"rope_theta": getattr(cfg, "rope_theta", 10000.0)}, {}


def hparams(cfg, arch: str) -> dict:
    """The `{arch}.*` keys llama.cpp's converter writes for a transformers config (its set_gguf_parameters): key ->
    str, int (uint32) or float (float32)."""
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope, local = _rope(cfg)
    out = {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
           "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
           "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
           "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps)}
    if arch == "gemma2":  # Gemma2Model: no rope keys (llama.cpp's default theta, 10000, is Gemma 2's)
        out.update({"attention.key_length": hd, "attention.value_length": hd,
                    "attn_logit_softcapping": float(cfg.attn_logit_softcapping),
                    "final_logit_softcapping": float(cfg.final_logit_softcapping),
                    "attention.sliding_window": cfg.sliding_window})
    elif arch == "gemma3":  # TextModel's keys (rope scaling of the full layers, both thetas), then Gemma3Model's
        if rope.get("rope_type") == "linear":
            out.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(rope["factor"])})
        out.update({"rope.freq_base": float(rope["rope_theta"]), "attention.key_length": hd,
                    "attention.value_length": hd})
        if "rope_theta" in local:
            out["rope.freq_base_swa"] = float(local["rope_theta"])
        if cfg.final_logit_softcapping:
            out["final_logit_softcapping"] = float(cfg.final_logit_softcapping)
        if getattr(cfg, "sliding_window_pattern", None) != 1:
            out["attention.sliding_window"] = cfg.sliding_window
    elif arch == "phi3":  # Phi3MiniModel: the rotated dims, LongRoPE's context and attention factor, the window
        rotated = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
        orig = rope.get("original_max_position_embeddings", getattr(cfg, "original_max_position_embeddings", None)
                        or cfg.max_position_embeddings)
        out.update({"rope.scaling.original_context_length": orig, "rope.dimension_count": rotated,
                    "rope.freq_base": float(rope["rope_theta"]), "attention.sliding_window": cfg.sliding_window or 0})
        scale = cfg.max_position_embeddings / orig
        if rope.get("long_factor"):
            out["rope.scaling.attn_factor"] = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
    else:  # llama, qwen2, qwen3
        out.update({"attention.key_length": hd, "attention.value_length": hd, "rope.dimension_count": hd,
                    "vocab_size": cfg.vocab_size, "rope.freq_base": float(rope.get("rope_theta", 10000.0))})
        if getattr(cfg, "num_local_experts", 0):
            out.update({"expert_count": cfg.num_local_experts, "expert_used_count": cfg.num_experts_per_tok})
    return out


def rope_tensors(cfg, arch: str) -> dict:
    """The rope vectors llama.cpp's converter writes as tensors: Phi-3's LongRoPE factors."""
    rope, _ = _rope(cfg)
    if arch != "phi3" or not rope.get("long_factor"):
        return {}
    return {f"rope_factors_{k}.weight": ("F32", np.array(rope[f"{k}_factor"], dtype=np.float32))
            for k in ("long", "short")}


def matrices(type_name: str, block: int = 32) -> Callable[[str, tuple], str]:
    """qtype: every matrix whose rows hold whole blocks in `type_name`, the rest F32 (as llama.cpp falls back)."""
    return lambda name, shape: type_name if shape[-1] % block == 0 else "F32"


def dequantized(path: Path, name: str) -> torch.Tensor:
    """Tensor `name` of GGUF `path` as gguf's dequantiser gives it (float32, torch order)."""
    r = gguf.GGUFReader(path)
    t = next(t for t in r.tensors if t.name == name)
    return torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(
        tuple(int(d) for d in reversed(t.shape))).copy())


def llama3_factors(head_dim: int, theta: float, factor: float = 8.0, low: float = 1.0, high: float = 4.0,
                   context: int = 8192) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter writes it for a llama3 rope_scaling."""
    out = []
    for i in range(head_dim // 2):
        wave = 2 * math.pi * theta ** (2 * i / head_dim)
        if wave < context / high:
            out.append(1.0)
        elif wave > context / low:
            out.append(factor)
        else:
            s = (context / wave - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


@contextmanager
def one_parse_per_file() -> Iterator[None]:
    """While it lasts, gguf.GGUFReader parses each file once: transformers' loader (for its config, then for its
    weights) would otherwise parse the same metadata twice, ~5 s apiece for SmolLM2's 49152 tokens and merges on 2
    cores (the converter has a parser of its own, runner.pmx.gguf.read_gguf). The readers are read-only views of the memory-mapped file, so sharing one changes nothing."""
    real, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real
