"""Baichuan 2 (7B, 13B) and Baichuan 1 (`BaichuanForCausalLM` / `BaiChuanForCausalLM`, Baichuan's own
modeling_baichuan.py through `auto_map`): `model.layers.{i}.self_attn.W_pack` = [q; k; v] rows, `o_proj`,
`mlp.gate_proj` / `up_proj` / `down_proj`, Llama's norms and embedding, `lm_head`.

Their config.json names neither the position encoding nor the head, so the model is told apart by this rule (from
`architectures` and these keys, never from sizes):
- position: rotary (rotate-half, base 10000) when the config has `max_position_embeddings` (Baichuan2-7B,
  Baichuan-7B), and always for `BaiChuanForCausalLM` (Baichuan-7B's spelling); ALiBi when it has only
  `model_max_length` (Baichuan2-13B, Baichuan-13B), which then gives the positions;
- head: Baichuan 2's NormHead (each row of `lm_head` divided by its L2 norm before use: done here, at conversion)
  when `vocab_size` is 125696 (Baichuan 2's vocabulary), a plain head otherwise (Baichuan 1: 64000).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from model_zoo.chat import baichuan_template, sentencepiece_ids, tokenizer_config_with
from model_zoo.decoder import ConfigKeys, DecoderFamily, Src, normalized_rows, rows, table_sources
from runner.errors import PmxError
from runner.pmx.params import PmxParams

L = "model.layers.{i}"
BAICHUAN2_VOCAB = 125696  # Baichuan 2's vocabulary: its models have a NormHead


def uses_alibi(config: dict) -> bool:
    return config["architectures"][0] != "BaiChuanForCausalLM" and "max_position_embeddings" not in config


def norm_head(config: dict) -> bool:
    return config.get("vocab_size") == BAICHUAN2_VOCAB


class BaichuanFamily(DecoderFamily):
    def params(self, config: dict, dtype: str, source: str = "config.json", directory: Optional[Path] = None
               ) -> PmxParams:
        k = ConfigKeys(config, source)
        k.expect("hidden_act", ("silu",), "expected 'silu'")
        k.expect("rope_scaling", (), "rope scaling")
        k.expect("num_key_value_heads", (config.get("num_attention_heads"),), "Baichuan's W_pack has as many KV "
                                                                              "heads as query heads")
        hidden, heads = k.int("hidden_size"), k.int("num_attention_heads")
        alibi = uses_alibi(config)
        positions = k.int("model_max_length") if alibi else k.int("max_position_embeddings")
        return PmxParams(
            model_type=self.name, architecture=config["architectures"][0], hidden_dim=hidden,
            intermediate_dim=k.int("intermediate_size"), num_layers=k.int("num_hidden_layers"), num_heads=heads,
            num_kv_heads=heads, head_dim=hidden // heads, vocab_size=k.int("vocab_size"),
            norm_eps=k.float("rms_norm_eps", 1e-6), rope_theta=10000.0,
            position_embedding="alibi" if alibi else "rotary", rotary_dim=0 if alibi else hidden // heads,
            max_position_embeddings=positions, tie_word_embeddings=k.bool("tie_word_embeddings", False),
            bos_token_id=config.get("bos_token_id"), eos_token_id=k.eos(directory),
            pad_token_id=config.get("pad_token_id"), dtype=dtype)

    def tensor_sources(self, p: PmxParams):
        qkv = (p.hidden_dim,) * 3
        head = Src("lm_head.weight", normalized_rows) if p.vocab_size == BAICHUAN2_VOCAB else Src("lm_head.weight")
        table = {"tok_embeddings.weight": Src("model.embed_tokens.weight"),
                 "attention_norm.weight": Src(f"{L}.input_layernorm.weight"),
                 "attention.wq.weight": rows(f"{L}.self_attn.W_pack.weight", qkv, 0),
                 "attention.wk.weight": rows(f"{L}.self_attn.W_pack.weight", qkv, 1),
                 "attention.wv.weight": rows(f"{L}.self_attn.W_pack.weight", qkv, 2),
                 "attention.wo.weight": Src(f"{L}.self_attn.o_proj.weight"),
                 "ffn_norm.weight": Src(f"{L}.post_attention_layernorm.weight"),
                 "feed_forward.w1.weight": Src(f"{L}.mlp.gate_proj.weight"),
                 "feed_forward.w3.weight": Src(f"{L}.mlp.up_proj.weight"),
                 "feed_forward.w2.weight": Src(f"{L}.mlp.down_proj.weight"),
                 "norm.weight": Src("model.norm.weight"), "output.weight": head}
        return table_sources(p, table, rotate_half=p.position_embedding == "rotary")

    def tokenizer_extras(self, directory: Path, params: PmxParams) -> dict:
        """Baichuan 2's chat prompt (user_token_id / assistant_token_id of generation_config.json, 195 / 196 as
        published) where the checkpoint has no template."""
        gen = Path(directory) / "generation_config.json"
        try:
            g = json.loads(gen.read_text()) if gen.is_file() else {}
        except (OSError, ValueError) as e:
            raise PmxError(f"{gen}: cannot read it as JSON ({e})") from None
        user, assistant = g.get("user_token_id"), g.get("assistant_token_id")
        eos = params.eos_ids[0] if params.eos_ids else None
        if not all(isinstance(t, int) for t in (user, assistant, eos)):
            return {}
        found = sentencepiece_ids(directory, (user, assistant, eos))
        pieces = {i: piece for piece, i in found.items()}
        if len(pieces) != 3:
            return {}
        return tokenizer_config_with(directory, baichuan_template(pieces[user], pieces[assistant], pieces[eos]),
                                     {pieces[user]: user, pieces[assistant]: assistant, pieces[eos]: eos})


BAICHUAN = BaichuanFamily(name="baichuan", architectures=("BaichuanForCausalLM", "BaiChuanForCausalLM"))
