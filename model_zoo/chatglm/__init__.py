"""ChatGLM2-6B / ChatGLM3-6B (`ChatGLMModel`, THUDM's own modeling_chatglm.py through `auto_map`).

Its config.json keys: `num_layers`, `kv_channels` (head_dim), `multi_query_group_num` (KV heads, with
`multi_query_attention`), `ffn_hidden_size`, `padded_vocab_size`, `layernorm_epsilon`, `seq_length` (positions),
`rope_ratio` (rotary base 10000 x rope_ratio: the 32k / 128k models), `add_qkv_bias`. Tensors:
`transformer.encoder.layers.{i}.self_attention.query_key_value` = [q; k; v] rows (with bias), `dense`,
`mlp.dense_h_to_4h` = [gate; up], `dense_4h_to_h`, `input_layernorm`, `post_attention_layernorm`,
`transformer.encoder.final_layernorm`, `transformer.embedding.word_embeddings`, `transformer.output_layer` (and the
buffer `transformer.rotary_pos_emb.inv_freq`, recomputed). Rotary turns the first half of each head's dims in
interleaved pairs, the layout PMX stores, so q/k rows are kept as they are; the rest pass through (rotary_dim =
head_dim / 2). The prompt starts with `[gMASK]` `sop` (runner.engine.tokenizer.ChatGLMTokenizer); ChatGLM3's chat
also stops at <|user|> and <|observation|>.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from model_zoo.chat import (CHATGLM2_TEMPLATE, CHATGLM3_TEMPLATE, CHATGLM_SPECIALS, sentencepiece_size,
                            tokenizer_config_with)
from model_zoo.decoder import ConfigKeys, DecoderFamily, Src, rows, table_sources
from runner.errors import PmxError
from runner.pmx.params import PmxParams

L = "transformer.encoder.layers.{i}"


def is_chatglm3(directory: Optional[Path]) -> bool:
    """ChatGLM3 and ChatGLM2 share config keys and the tokenizer's file; ChatGLM3's tokenizer code (or config) has
    the <|role|> tokens."""
    if directory is None:
        return False
    files = [Path(directory) / n for n in ("tokenization_chatglm.py", "tokenizer_config.json")]
    return any(f.is_file() and "<|user|>" in f.read_text(errors="replace") for f in files)


class ChatGLMFamily(DecoderFamily):
    def params(self, config: dict, dtype: str, source: str = "config.json", directory: Optional[Path] = None
               ) -> PmxParams:
        k = ConfigKeys(config, source)
        if "position_encoding_2d" in config or "inner_hidden_size" in config:
            raise PmxError(f"{source}: 'position_encoding_2d' is ChatGLM-6B's (the first version: 2D positions, "
                           f"GeLU, LayerNorm), which is not supported; ChatGLM2/3 are")
        for key, want, what in (("rmsnorm", (True,), "LayerNorm instead of RMSNorm"),
                                ("post_layer_norm", (True,), "no final norm"),
                                ("apply_residual_connection_post_layernorm", (False,), "a residual after the norm"),
                                ("add_bias_linear", (False,), "biases on dense / dense_h_to_4h / dense_4h_to_h"),
                                ("pre_seq_len", (), "a P-tuning v2 prefix"),
                                ("quantization_bit", (0,), "weights quantised by THUDM's code; convert the float "
                                                           "checkpoint and use --quantize"),
                                ("rope_scaling", (), "rope scaling")):
            k.expect(key, want, what)
        hidden, heads = k.int("hidden_size"), k.int("num_attention_heads")
        head_dim = k.int("kv_channels", hidden // heads)
        kv_heads = k.int("multi_query_group_num") if k.bool("multi_query_attention", False) else heads
        if head_dim % 4:
            raise PmxError(f"{source}: 'kv_channels' = {head_dim}: rotary turns half of each head in pairs, so it "
                           f"must be a multiple of 4")
        eos, size = k.eos(directory), sentencepiece_size(directory)
        if size is not None and is_chatglm3(directory):  # ChatGLM3's chat stops at these too
            eos = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
            eos += [size + CHATGLM_SPECIALS.index(t) for t in ("<|user|>", "<|observation|>")
                    if size + CHATGLM_SPECIALS.index(t) not in eos]
        return PmxParams(
            model_type=self.name, architecture=config["architectures"][0], hidden_dim=hidden,
            intermediate_dim=k.int("ffn_hidden_size"), num_layers=k.int("num_layers"), num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=k.int("padded_vocab_size"),
            norm_eps=k.float("layernorm_epsilon", 1e-5), rope_theta=10000.0 * k.float("rope_ratio", 1.0),
            rotary_dim=head_dim // 2, max_position_embeddings=k.int("seq_length"),
            qkv_bias=k.bool("add_qkv_bias", False), hidden_act="silu", eos_token_id=eos,
            pad_token_id=config.get("pad_token_id"), dtype=dtype)

    def tensor_sources(self, p: PmxParams):
        qkv = (p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim, p.num_kv_heads * p.head_dim)
        gate_up = (p.intermediate_dim, p.intermediate_dim)
        table = {"tok_embeddings.weight": Src("transformer.embedding.word_embeddings.weight"),
                 "attention_norm.weight": Src(f"{L}.input_layernorm.weight"),
                 "attention.wo.weight": Src(f"{L}.self_attention.dense.weight"),
                 "ffn_norm.weight": Src(f"{L}.post_attention_layernorm.weight"),
                 "feed_forward.w1.weight": rows(f"{L}.mlp.dense_h_to_4h.weight", gate_up, 0),
                 "feed_forward.w3.weight": rows(f"{L}.mlp.dense_h_to_4h.weight", gate_up, 1),
                 "feed_forward.w2.weight": Src(f"{L}.mlp.dense_4h_to_h.weight"),
                 "norm.weight": Src("transformer.encoder.final_layernorm.weight"),
                 "output.weight": Src("transformer.output_layer.weight")}
        for n, w in enumerate(("wq", "wk", "wv")):
            for leaf in ("weight", "bias"):
                table[f"attention.{w}.{leaf}"] = rows(f"{L}.self_attention.query_key_value.{leaf}", qkv, n)
        return table_sources(p, table, rotate_half=False)  # q/k rows already are interleaved pairs

    def tokenizer_extras(self, directory: Path, params: PmxParams) -> dict:
        """ChatGLM3's chat template (<|role|> tokens) or ChatGLM2's ([Round n] prompt) where the checkpoint has none,
        with the special tokens it uses listed."""
        size = sentencepiece_size(directory)
        if size is None:
            return {}
        template = CHATGLM3_TEMPLATE if is_chatglm3(directory) else CHATGLM2_TEMPLATE
        return tokenizer_config_with(directory, template, {t: size + i for i, t in enumerate(CHATGLM_SPECIALS)})


CHATGLM = ChatGLMFamily(name="chatglm", architectures=("ChatGLMModel", "ChatGLMForConditionalGeneration"),
                        ignored=(r"transformer\.rotary_pos_emb\.inv_freq",))
