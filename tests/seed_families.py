"""Small random checkpoints of the seed's families written as their publishers lay them out (config.json with its
own keys and `auto_map`, tensor names and packing, tokenizer files), each with its reference on the same weights:
a transformers-native model (GlmForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM) and, where the family has what no
transformers model has, that part as the family's modeling code computes it (Baichuan-13B's ALiBi as a 4-D additive
mask built as modeling_baichuan.py builds it, on a Llama with rotary turned off; Qwen's logn scaling of the queries
as modeling_qwen.py applies it, on Qwen2).

`build(name, directory, fmt, num_files, seed)` -> Reference. The names: VARIANTS.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import transformers

from conftest import save_state_dict

CORPUS = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park. "
          "One day she saw a big red ball. I believe the meaning of life is to be kind. The cat sat on the mat. ")


@dataclass
class Reference:
    """The reference model on the checkpoint's weights: logits of whole sequences and greedy generation."""
    model: object                                    # a transformers model, eval mode
    mask: Optional[Callable[[int], torch.Tensor]] = None      # ALiBi: the [1, H, L, L] additive mask of L tokens
    q_scale: Optional[Callable[[int], torch.Tensor]] = None   # logn: the [L] factor of each query
    hooks: list = field(default_factory=list)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @torch.no_grad()
    def forward(self, ids: list) -> torch.Tensor:
        """[L, V] float32 logits of the sequence `ids` (one forward pass, no cache)."""
        scale = None if self.q_scale is None else self.q_scale(len(ids))
        handles = []
        if scale is not None:  # Qwen: query * logn[position], after c_attn (q_proj with its bias): before rotary,
            for layer in self.model.model.layers:   # which commutes with a scalar per position
                handles.append(layer.self_attn.q_proj.register_forward_hook(
                    lambda m, args, out: out * scale[None, :, None].to(out.dtype)))
        try:
            kw = {} if self.mask is None else {"attention_mask": self.mask(len(ids))}
            return self.model(torch.tensor([ids]), **kw).logits[0].float()
        finally:
            for h in handles:
                h.remove()

    def logits(self, prompts, conts, steps: int) -> torch.Tensor:
        """[steps + 1, B, V]: the logits at the positions the engine produces them (as test_engine.hf_logits)."""
        return torch.stack([self.forward(p + c)[len(p) - 1: len(p) + steps] for p, c in zip(prompts, conts)], dim=1)

    def greedy(self, prompt: list, n: int, eos=()) -> list:
        """n greedy tokens after `prompt` (fewer where an `eos` id comes; it is left out), each from a whole forward
        pass over the sequence so far."""
        ids, out = list(prompt), []
        for _ in range(n):
            t = int(self.forward(ids)[-1].argmax())
            if t in eos:
                break
            out.append(t)
            ids.append(t)
        return out


def _randomize(model, seed: int) -> None:
    """HF inits norms to 1 and biases to 0: randomise them so the tests see them (as conftest.make_hf)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if name.endswith("norm.weight") else 0.0))


def _model(cls_name: str, seed: int, **cfg):
    config = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))(**cfg)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).eval()
    _randomize(model, seed)
    return model


def _write(directory: Path, config: dict, sd: dict, fmt: str, num_files: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_state_dict({k: v.detach().clone().contiguous() for k, v in sd.items()}, directory, fmt, num_files)
    return directory


def _layers(model):
    return model.model.layers


# --- tokenizers in the families' formats ------------------------------------------------------------------------------
def sentencepiece_model(path: Path, vocab_size: int, symbols=()) -> int:
    """Trains a small sentencepiece BPE model on CORPUS into `path`; returns its piece count."""
    import io

    import sentencepiece as spm
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS.split(". ") * 20), model_writer=buf,
                                   vocab_size=vocab_size, model_type="bpe", user_defined_symbols=list(symbols),
                                   byte_fallback=True, character_coverage=1.0, minloglevel=2)
    path.write_bytes(buf.getvalue())
    return spm.SentencePieceProcessor(model_file=str(path)).get_piece_size()


def qwen_tiktoken(path: Path) -> int:
    """A small qwen.tiktoken: the 256 bytes, then every prefix (2+ bytes) of CORPUS's words with their leading
    space, so each has a merge path; returns the number of ranks."""
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    for word in CORPUS.replace(".", " .").split(" "):
        for piece in (word, " " + word):
            raw = piece.encode()
            for n in range(2, len(raw) + 1):
                if raw[:n] not in seen:
                    seen.add(raw[:n])
                    tokens.append(raw[:n])
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    return len(tokens)


# --- the families --------------------------------------------------------------------------------------------------
def chatglm(d: Path, fmt: str, num_files: int, seed: int, glm3: bool = True, multi_query: bool = True,
            rope_ratio: float = 1.0) -> Reference:
    """ChatGLM2/3: GlmForCausalLM's q/k/v (rotary on the first half of each head, interleaved pairs, as ChatGLM's)
    packed into query_key_value, gate/up into dense_h_to_4h."""
    d.mkdir(parents=True, exist_ok=True)
    pieces = sentencepiece_model(d / "tokenizer.model", 300)
    vocab = pieces + 9 + 3  # ChatGLM's 9 special tokens after the pieces; padded
    H, KV, hd, D, F, layers = 4, 2 if multi_query else 4, 16, 48, 72, 2   # heads x head_dim (64) != hidden (48)
    model = _model("GlmForCausalLM", seed, vocab_size=vocab, hidden_size=D, intermediate_size=F,
                   num_hidden_layers=layers, num_attention_heads=H, num_key_value_heads=KV, head_dim=hd,
                   attention_bias=True, rms_norm_eps=1e-5, max_position_embeddings=128, pad_token_id=0,
                   eos_token_id=2, bos_token_id=1, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0 * rope_ratio,
                                    "partial_rotary_factor": 0.5})
    sd = {"transformer.embedding.word_embeddings.weight": model.model.embed_tokens.weight,
          "transformer.rotary_pos_emb.inv_freq": 1.0 / (10000 ** (torch.arange(0, hd // 2, 2).float() / (hd // 2))),
          "transformer.encoder.final_layernorm.weight": model.model.norm.weight,
          "transformer.output_layer.weight": model.lm_head.weight}
    for i, layer in enumerate(_layers(model)):
        a, p = layer.self_attn, f"transformer.encoder.layers.{i}"
        sd.update({f"{p}.input_layernorm.weight": layer.input_layernorm.weight,
                   f"{p}.self_attention.query_key_value.weight": torch.cat([a.q_proj.weight, a.k_proj.weight,
                                                                             a.v_proj.weight]),
                   f"{p}.self_attention.query_key_value.bias": torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
                   f"{p}.self_attention.dense.weight": a.o_proj.weight,
                   f"{p}.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
                   f"{p}.mlp.dense_h_to_4h.weight": layer.mlp.gate_up_proj.weight,
                   f"{p}.mlp.dense_4h_to_h.weight": layer.mlp.down_proj.weight})
    config = {"_name_or_path": "THUDM/chatglm3-6b" if glm3 else "THUDM/chatglm2-6b", "model_type": "chatglm",
              "architectures": ["ChatGLMModel"],
              "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig",
                           "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
                           "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
                           "AutoModelForSeq2SeqLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
                           "AutoModelForSequenceClassification": "modeling_chatglm.ChatGLMForSequenceClassification"},
              "add_bias_linear": False, "add_qkv_bias": True, "apply_query_key_layer_scaling": True,
              "apply_residual_connection_post_layernorm": False, "attention_dropout": 0.0,
              "attention_softmax_in_fp32": True, "bias_dropout_fusion": True, "ffn_hidden_size": F,
              "fp32_residual_connection": False, "hidden_dropout": 0.0, "hidden_size": D, "kv_channels": hd,
              "layernorm_epsilon": 1e-05, "multi_query_attention": multi_query, "multi_query_group_num": 2,
              "num_attention_heads": H, "num_layers": layers, "original_rope": True, "padded_vocab_size": vocab,
              "post_layer_norm": True, "rmsnorm": True, "seq_length": 128, "use_cache": True, "torch_dtype": "float32",
              "transformers_version": "4.30.2", "tie_word_embeddings": False, "eos_token_id": 2, "pad_token_id": 0}
    if rope_ratio != 1.0:
        config["rope_ratio"] = rope_ratio
    (d / "tokenizer_config.json").write_text(json.dumps({
        "name_or_path": config["_name_or_path"], "remove_space": False, "do_lower_case": False,
        "tokenizer_class": "ChatGLMTokenizer", "padding_side": "left",
        "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLMTokenizer", None]}}))
    roles = ', "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"' if glm3 else ""
    (d / "tokenization_chatglm.py").write_text(  # the publisher's tokenizer code (only its special tokens matter)
        f'special_tokens = ["[MASK]", "[gMASK]", "[sMASK]", "sop", "eop"{roles}]\n')
    _write(d, config, sd, fmt, num_files)
    return Reference(model)


def internlm(d: Path, fmt: str, num_files: int, seed: int) -> Reference:
    """InternLM (v1): Llama's names with biases on q, k, v and o."""
    d.mkdir(parents=True, exist_ok=True)
    pieces = sentencepiece_model(d / "tokenizer.model", 300, symbols=("<eoh>", "<eoa>"))
    H, D, F, layers = 4, 64, 96, 2
    model = _model("LlamaForCausalLM", seed, vocab_size=pieces + 4, hidden_size=D, intermediate_size=F,
                   num_hidden_layers=layers, num_attention_heads=H, num_key_value_heads=H, attention_bias=True,
                   rms_norm_eps=1e-6, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                   tie_word_embeddings=False)
    sd = dict(model.state_dict())  # Llama with attention_bias: biases on q, k, v and o, as InternLM's `bias`
    config = {"architectures": ["InternLMForCausalLM"],
              "auto_map": {"AutoConfig": "configuration_internlm.InternLMConfig",
                           "AutoModel": "modeling_internlm.InternLMForCausalLM",
                           "AutoModelForCausalLM": "modeling_internlm.InternLMForCausalLM"},
              "bias": True, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": D,
              "initializer_range": 0.02, "intermediate_size": F, "max_position_embeddings": 64,
              "model_type": "internlm", "num_attention_heads": H, "num_hidden_layers": layers, "pad_token_id": 0,
              "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "float32",
              "transformers_version": "4.29.2", "use_cache": True, "vocab_size": pieces + 4}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "InternLMTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "auto_map": {"AutoTokenizer": ["tokenization_internlm.InternLMTokenizer", None]}}))
    _write(d, config, sd, fmt, num_files)
    return Reference(model)


def internlm2(d: Path, fmt: str, num_files: int, seed: int, dynamic: Optional[float] = None) -> Reference:
    """InternLM2: a GQA Llama whose q/k/v are packed per KV head into wqkv, [q x group, k, v] head blocks."""
    d.mkdir(parents=True, exist_ok=True)
    pieces = sentencepiece_model(d / "tokenizer.model", 300, symbols=("<|im_start|>", "<|im_end|>"))
    H, KV, D, F, layers = 8, 2, 64, 80, 2
    hd, G = D // H, H // KV
    positions = 16 if dynamic else 64
    scaling = {"type": "dynamic", "factor": dynamic} if dynamic else None
    model = _model("LlamaForCausalLM", seed, vocab_size=pieces + 2, hidden_size=D, intermediate_size=F,
                   num_hidden_layers=layers, num_attention_heads=H, num_key_value_heads=KV, rms_norm_eps=1e-5,
                   max_position_embeddings=positions, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2,
                   pad_token_id=2, tie_word_embeddings=False,
                   rope_scaling=None if scaling is None else {"rope_type": "dynamic", "factor": dynamic})
    sd = {"model.tok_embeddings.weight": model.model.embed_tokens.weight, "model.norm.weight": model.model.norm.weight,
          "output.weight": model.lm_head.weight}
    for i, layer in enumerate(_layers(model)):
        a, p = layer.self_attn, f"model.layers.{i}"
        q, k, v = (w.reshape(KV, -1, hd, D) for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight))
        sd.update({f"{p}.attention.wqkv.weight": torch.cat([q, k, v], dim=1).reshape(KV * (G + 2) * hd, D),
                   f"{p}.attention.wo.weight": a.o_proj.weight,
                   f"{p}.attention_norm.weight": layer.input_layernorm.weight,
                   f"{p}.ffn_norm.weight": layer.post_attention_layernorm.weight,
                   f"{p}.feed_forward.w1.weight": layer.mlp.gate_proj.weight,
                   f"{p}.feed_forward.w3.weight": layer.mlp.up_proj.weight,
                   f"{p}.feed_forward.w2.weight": layer.mlp.down_proj.weight})
    config = {"architectures": ["InternLM2ForCausalLM"],
              "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config",
                           "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM",
                           "AutoModel": "modeling_internlm2.InternLM2ForCausalLM"},
              "bias": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": D,
              "initializer_range": 0.02, "intermediate_size": F, "max_position_embeddings": positions,
              "model_type": "internlm2", "num_attention_heads": H, "num_hidden_layers": layers,
              "num_key_value_heads": KV, "pad_token_id": 2, "rms_norm_eps": 1e-05, "rope_scaling": scaling,
              "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "float32",
              "transformers_version": "4.33.2", "use_cache": True, "vocab_size": pieces + 2}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "InternLM2Tokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "auto_map": {"AutoTokenizer": ["tokenization_internlm2.InternLM2Tokenizer", None]}}))
    _write(d, config, sd, fmt, num_files)
    return Reference(model)


def baichuan_slopes(n: int) -> list:
    """modeling_baichuan.py's _get_interleave, as published."""
    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + baichuan_slopes(2 * closest)[0::2][: n - closest]


def baichuan_alibi_mask(n_head: int, max_pos: int) -> torch.Tensor:
    """modeling_baichuan.py's _gen_alibi_mask, as published: [H, L, L] = slope_h x j, -inf above the diagonal."""
    slopes = torch.Tensor(baichuan_slopes(n_head))
    position_point = torch.arange(max_pos) - max_pos + 1
    position_point = position_point.unsqueeze(0).unsqueeze(0).expand(n_head, -1, -1)
    diag = torch.diag(position_point[0])
    position_point = position_point - diag.unsqueeze(0).unsqueeze(0).transpose(-1, -2)
    alibi = slopes.unsqueeze(1).unsqueeze(1) * position_point
    alibi = alibi.view(n_head, 1, max_pos)
    alibi_mask = torch.triu(torch.zeros([max_pos, max_pos]).float().fill_(float("-inf")), 1)
    return alibi_mask.unsqueeze(0) + alibi


def baichuan(d: Path, fmt: str, num_files: int, seed: int, alibi: bool, v2: bool = True) -> Reference:
    """Baichuan 2-7B (rotary), 2-13B (ALiBi, with a head count that is not a power of two), Baichuan-7B and -13B (v1,
    a plain head):
    q/k/v packed into W_pack; Baichuan 2's lm_head stored as trained and normalised by its NormHead (the reference's
    lm_head is the normalised one). A vocabulary of 125696 is what tells Baichuan 2 (and its NormHead) apart, so
    these models have it (with a small hidden size)."""
    d.mkdir(parents=True, exist_ok=True)
    pieces = sentencepiece_model(d / "tokenizer.model", 300, symbols=("<reserved_106>", "<reserved_107>"))
    H, D, F, layers = (6, 48, 80, 2) if alibi else (4, 32, 64, 2)
    vocab = 125696 if v2 else pieces + 3
    model = _model("LlamaForCausalLM", seed, vocab_size=vocab, hidden_size=D, intermediate_size=F,
                   num_hidden_layers=layers, num_attention_heads=H, num_key_value_heads=H, rms_norm_eps=1e-6,
                   max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                   tie_word_embeddings=False, attn_implementation="eager")
    trained_head = model.lm_head.weight.detach().clone() * 3                # as stored: not unit rows
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.nn.functional.normalize(trained_head) if v2 else trained_head)
        if alibi:  # rotary off: cos 1, sin 0 at every position
            model.model.rotary_emb.inv_freq.zero_()
            model.model.rotary_emb.original_inv_freq.zero_()
    sd = {"model.embed_tokens.weight": model.model.embed_tokens.weight, "model.norm.weight": model.model.norm.weight,
          "lm_head.weight": trained_head}
    for i, layer in enumerate(_layers(model)):
        a, p = layer.self_attn, f"model.layers.{i}"
        sd.update({f"{p}.self_attn.W_pack.weight": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                   f"{p}.self_attn.o_proj.weight": a.o_proj.weight,
                   f"{p}.input_layernorm.weight": layer.input_layernorm.weight,
                   f"{p}.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
                   f"{p}.mlp.gate_proj.weight": layer.mlp.gate_proj.weight,
                   f"{p}.mlp.up_proj.weight": layer.mlp.up_proj.weight,
                   f"{p}.mlp.down_proj.weight": layer.mlp.down_proj.weight})
        if not alibi and not v2:  # Baichuan-7B's checkpoints carry the rotary buffer
            sd[f"{p}.self_attn.rotary_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, D // H, 2).float() / (D // H)))
    config = {"architectures": ["BaichuanForCausalLM" if v2 or alibi else "BaiChuanForCausalLM"],
              "auto_map": {"AutoConfig": "configuration_baichuan.BaichuanConfig",
                           "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM"},
              "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": D, "initializer_range": 0.02,
              "intermediate_size": F, "model_max_length": 64, "model_type": "baichuan", "num_attention_heads": H,
              "num_hidden_layers": layers, "pad_token_id": 0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
              "torch_dtype": "float32", "transformers_version": "4.29.2", "use_cache": True, "vocab_size": vocab,
              "z_loss_weight": 0}
    if alibi:
        config["gradient_checkpointing"] = False
    else:
        config["max_position_embeddings"] = 64
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BaichuanTokenizer", "add_bos_token": False, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>",
        "auto_map": {"AutoTokenizer": ["tokenization_baichuan.BaichuanTokenizer", None]}}))
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    (d / "generation_config.json").write_text(json.dumps({
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "user_token_id": sp.piece_to_id("<reserved_106>"),
        "assistant_token_id": sp.piece_to_id("<reserved_107>"), "max_new_tokens": 2048}))
    _write(d, config, sd, fmt, num_files)
    mask = (lambda L: baichuan_alibi_mask(H, L)[None]) if alibi else None
    return Reference(model, mask=mask)


def qwen(d: Path, fmt: str, num_files: int, seed: int, seq_length: int = 64, logn: bool = True,
         ntk: bool = True) -> Reference:
    """Qwen (v1): Qwen2ForCausalLM's q/k/v (with biases) packed into c_attn, its gate as w2 and up as w1, the
    config's intermediate_size twice the MLP's width. With `logn` and without `ntk`, queries past seq_length are
    scaled by log_{seq_length}(position + 1), as modeling_qwen.py's logn_tensor does."""
    d.mkdir(parents=True, exist_ok=True)
    ranks = qwen_tiktoken(d / "qwen.tiktoken")
    vocab = ranks + 208 + 24
    H, D, F, layers = 4, 64, 88, 2
    model = _model("Qwen2ForCausalLM", seed, vocab_size=vocab, hidden_size=D, intermediate_size=F,
                   num_hidden_layers=layers, num_attention_heads=H, num_key_value_heads=H, rms_norm_eps=1e-6,
                   max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False,
                   bos_token_id=None, eos_token_id=ranks, pad_token_id=ranks)
    sd = {"transformer.wte.weight": model.model.embed_tokens.weight, "transformer.ln_f.weight": model.model.norm.weight,
          "lm_head.weight": model.lm_head.weight}
    for i, layer in enumerate(_layers(model)):
        a, p = layer.self_attn, f"transformer.h.{i}"
        sd.update({f"{p}.ln_1.weight": layer.input_layernorm.weight,
                   f"{p}.attn.c_attn.weight": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                   f"{p}.attn.c_attn.bias": torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
                   f"{p}.attn.c_proj.weight": a.o_proj.weight,
                   f"{p}.ln_2.weight": layer.post_attention_layernorm.weight,
                   f"{p}.mlp.w1.weight": layer.mlp.up_proj.weight, f"{p}.mlp.w2.weight": layer.mlp.gate_proj.weight,
                   f"{p}.mlp.c_proj.weight": layer.mlp.down_proj.weight})
    config = {"architectures": ["QWenLMHeadModel"],
              "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig",
                           "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
              "attn_dropout_prob": 0.0, "bf16": False, "emb_dropout_prob": 0.0, "fp16": False, "fp32": True,
              "hidden_size": D, "intermediate_size": 2 * F, "initializer_range": 0.02, "kv_channels": D // H,
              "layer_norm_epsilon": 1e-06, "max_position_embeddings": 64, "model_type": "qwen", "no_bias": True,
              "num_attention_heads": H, "num_hidden_layers": layers, "onnx_safe": None, "rotary_emb_base": 10000,
              "rotary_pct": 1.0, "scale_attn_weights": True, "seq_length": seq_length, "tie_word_embeddings": False,
              "tokenizer_class": "QWenTokenizer", "transformers_version": "4.32.0", "use_cache": True,
              "use_dynamic_ntk": ntk, "use_flash_attn": "auto", "use_logn_attn": logn, "vocab_size": vocab}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "model_max_length": 8192, "tokenizer_class": "QWenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]}}))
    (d / "generation_config.json").write_text(json.dumps({
        "chat_format": "chatml", "eos_token_id": ranks, "pad_token_id": ranks, "stop_words_ids": [[ranks]],
        "max_new_tokens": 512, "do_sample": False}))
    _write(d, config, sd, fmt, num_files)
    q_scale = None
    if logn and not ntk:
        q_scale = lambda L: torch.tensor([math.log(i, seq_length) if i > seq_length else 1  # noqa: E731
                                          for i in range(1, L + 1)])
    return Reference(model, q_scale=q_scale)


VARIANTS: dict = {  # name: (builder, kwargs)
    "chatglm3": (chatglm, {}),
    "chatglm2_mha": (chatglm, dict(glm3=False, multi_query=False, rope_ratio=50.0)),
    "internlm": (internlm, {}),
    "internlm2": (internlm2, {}),
    "baichuan2_7b": (baichuan, dict(alibi=False)),
    "baichuan2_13b": (baichuan, dict(alibi=True)),
    "baichuan_7b": (baichuan, dict(alibi=False, v2=False)),
    "baichuan_13b": (baichuan, dict(alibi=True, v2=False)),
    "qwen": (qwen, {}),
    "qwen_logn": (qwen, dict(seq_length=8, ntk=False)),
}


def build(name: str, directory: Path, fmt: str = "safetensors", num_files: int = 1, seed: int = 0) -> Reference:
    fn, kwargs = VARIANTS[name]
    return fn(Path(directory), fmt, num_files, seed, **kwargs)
