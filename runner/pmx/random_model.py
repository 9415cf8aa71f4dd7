"""Random-weight HF Llama checkpoints (with a small trained BPE tokenizer), for demos and benchmarks
on machines without real weights. Written tensor by tensor, so any size fits in memory."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from runner.errors import PmxError
from runner.pmx.store import DTYPE_NAMES, SafetensorsWriter, atomic_output_dir

CORPUS = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park. "
          "One day she saw a big red ball. I believe the meaning of life is to be kind. The cat sat on the mat. ")


def _tokenizer_json(vocab_size: int, specials: tuple = ()) -> str:
    """A byte-level BPE tokenizer.json of `vocab_size` tokens trained on a small corpus: <unk> <s> </s>, then the
    special tokens `specials` (a chat format's), then the pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", *specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer)
    # the small corpus gives a few hundred tokens: fill up to the model's vocabulary, as a real tokenizer would
    tok.add_special_tokens([f"<extra_{i}>" for i in range(vocab_size - tok.get_vocab_size())])
    # BOS first, as a Llama tokenizer.json's post-processor puts it (runner.engine.tokenizer's BOS rule)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok.to_str()


def make_random_model(output_dir: str, hidden_dim: int = 128, intermediate_dim: int = 344, num_layers: int = 2,
                      num_heads: int = 8, num_kv_heads: int = 4, vocab_size: int = 512, dtype: str = "float32",
                      seed: int = 0, overwrite: bool = False) -> Path:
    """Writes a random-weight `LlamaForCausalLM` checkpoint (config.json, model.safetensors, tokenizer.json)."""
    if hidden_dim % num_heads or num_heads % num_kv_heads:
        raise PmxError(f"--hidden_dim {hidden_dim} must be a multiple of --num_heads {num_heads}, and --num_heads "
                       f"a multiple of --num_kv_heads {num_kv_heads}")
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden_dim,
               intermediate_size=intermediate_dim, num_hidden_layers=num_layers, num_attention_heads=num_heads,
               num_key_value_heads=num_kv_heads, vocab_size=vocab_size, rms_norm_eps=1e-5, rope_theta=10000.0,
               max_position_embeddings=2048, torch_dtype=dtype, tie_word_embeddings=False, hidden_act="silu",
               bos_token_id=1, eos_token_id=2)
    hd = hidden_dim // num_heads
    shapes = {"model.embed_tokens.weight": (vocab_size, hidden_dim)}
    for i in range(num_layers):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (hidden_dim,),
                       f"{p}.self_attn.q_proj.weight": (num_heads * hd, hidden_dim),
                       f"{p}.self_attn.k_proj.weight": (num_kv_heads * hd, hidden_dim),
                       f"{p}.self_attn.v_proj.weight": (num_kv_heads * hd, hidden_dim),
                       f"{p}.self_attn.o_proj.weight": (hidden_dim, num_heads * hd),
                       f"{p}.post_attention_layernorm.weight": (hidden_dim,),
                       f"{p}.mlp.gate_proj.weight": (intermediate_dim, hidden_dim),
                       f"{p}.mlp.up_proj.weight": (intermediate_dim, hidden_dim),
                       f"{p}.mlp.down_proj.weight": (hidden_dim, intermediate_dim)})
    shapes.update({"model.norm.weight": (hidden_dim,), "lm_head.weight": (vocab_size, hidden_dim)})
    dt = DTYPE_NAMES[dtype]
    g = torch.Generator().manual_seed(seed)
    with atomic_output_dir(Path(output_dir), overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        w = SafetensorsWriter(tmp / "model.safetensors", [(k, dt, s) for k, s in shapes.items()], {"format": "pt"})
        for k, s in shapes.items():
            t = 1.0 + 0.1 * torch.randn(s, generator=g) if k.endswith("norm.weight") else \
                torch.randn(s, generator=g) / s[-1] ** 0.5
            w.write(k, t.to(dt))
        w.close()
        (tmp / "tokenizer.json").write_text(_tokenizer_json(vocab_size))
    return Path(output_dir)
