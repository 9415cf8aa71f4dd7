"""Qwen (v1: `QWenLMHeadModel`, Qwen's own modeling_qwen.py through `auto_map`): `transformer.wte`,
`transformer.h.{i}.ln_1`, `attn.c_attn` = [q; k; v] rows with bias (q/k rotate-half, un-permuted here), `attn.c_proj`
(no bias: `no_bias`), `ln_2`, `mlp.w1` (the up projection), `mlp.w2` (the gate: Qwen computes w1(x) * silu(w2(x))),
`mlp.c_proj` (down), `transformer.ln_f`, `lm_head`. Its config.json: `kv_channels` (head_dim), `intermediate_size`
(twice the MLP's real width), `layer_norm_epsilon`, `rotary_emb_base`, `rotary_pct` (1 as published),
`seq_length`, `use_dynamic_ntk`, `use_logn_attn`.

Past `seq_length` tokens Qwen's code scales each query at position p by log(p + 1) / log(seq_length)
(`use_logn_attn`: PMX's logn_scaling) and, with `use_dynamic_ntk`, raises the rotary base by an alpha it takes from
the prompt's length at the first step of a generation and keeps while it decodes: state per sequence that a
step's positions cannot tell (a preempted sequence's recomputed prompt would get another alpha). So a model with
`use_dynamic_ntk` takes at most `seq_length` positions (max_position_embeddings = seq_length: longer prompts and
generations are refused with the engine's message), where Qwen's alpha is 1 and the logn factor 1; without it,
`max_position_embeddings` positions, with the logn scaling past `seq_length`.

Qwen's tokenizer is `qwen.tiktoken` (runner.engine.tokenizer.QwenTokenizer); EOS is <|endoftext|>, and its chat
(ChatML) also stops at <|im_end|>.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from model_zoo.chat import CHATML_TEMPLATE, tokenizer_config_with
from model_zoo.decoder import ConfigKeys, DecoderFamily, Src, rows, table_sources
from runner.engine.tokenizer import QWEN_SPECIALS
from runner.errors import PmxError
from runner.pmx.params import PmxParams

L = "transformer.h.{i}"
QWEN_SPECIAL_START = 151643   # <|endoftext|> of the published qwen.tiktoken: its special tokens follow its ranks


def qwen_specials(directory: Optional[Path]) -> Optional[dict]:
    """{special token: id} of the directory's qwen.tiktoken: <|endoftext|>, <|im_start|>, <|im_end|>, then
    <|extra_0..204|>, numbered from the number of its ranks (151643 for the published file); None without one."""
    path = Path(directory) / "qwen.tiktoken" if directory is not None else None
    if path is None or not path.is_file():
        return None
    with open(path, "rb") as f:
        n = sum(1 for line in f if line.strip())
    return {t: n + i for i, t in enumerate(QWEN_SPECIALS)}


class QwenFamily(DecoderFamily):
    def params(self, config: dict, dtype: str, source: str = "config.json", directory: Optional[Path] = None
               ) -> PmxParams:
        k = ConfigKeys(config, source)
        k.expect("no_bias", (True,), "biases on c_proj and the MLP")
        k.expect("rotary_pct", (1, 1.0), "a partial rotary of rotate-half pairs")
        k.expect("rope_scaling", (), "rope scaling")
        hidden, heads = k.int("hidden_size"), k.int("num_attention_heads")
        head_dim = k.int("kv_channels", hidden // heads)
        if head_dim * heads != hidden:
            raise PmxError(f"{source}: 'kv_channels' = {head_dim} x 'num_attention_heads' = {heads} must equal "
                           f"'hidden_size' = {hidden} (Qwen splits c_attn's output in thirds of hidden_size)")
        inter = k.int("intermediate_size")
        if inter % 2:
            raise PmxError(f"{source}: 'intermediate_size' = {inter} must be even (Qwen's MLP is half of it wide)")
        seq = k.int("seq_length", 2048)
        ntk = k.bool("use_dynamic_ntk", False)
        positions = seq if ntk else k.int("max_position_embeddings", seq)
        specials = qwen_specials(directory) or {"<|endoftext|>": QWEN_SPECIAL_START,
                                                "<|im_end|>": QWEN_SPECIAL_START + 2}
        eos = k.eos(directory)  # <|endoftext|> as published (generation_config.json); ChatML's <|im_end|> too
        eos = [specials["<|endoftext|>"]] if eos is None else list(eos) if isinstance(eos, list) else [eos]
        eos += [specials["<|im_end|>"]] if specials["<|im_end|>"] not in eos else []
        return PmxParams(
            model_type=self.name, architecture=config["architectures"][0], hidden_dim=hidden,
            intermediate_dim=inter // 2,
            num_layers=k.int("num_hidden_layers"), num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
            vocab_size=k.int("vocab_size"), norm_eps=k.float("layer_norm_epsilon", 1e-6),
            rope_theta=k.float("rotary_emb_base", 10000.0), rotary_dim=head_dim, max_position_embeddings=positions,
            logn_scaling=seq if k.bool("use_logn_attn", False) and positions > seq else None, qkv_bias=True,
            tie_word_embeddings=k.bool("tie_word_embeddings", False), eos_token_id=eos,
            pad_token_id=config.get("pad_token_id"), dtype=dtype)

    def tensor_sources(self, p: PmxParams):
        qkv = (p.hidden_dim,) * 3
        table = {"tok_embeddings.weight": Src("transformer.wte.weight"),
                 "attention_norm.weight": Src(f"{L}.ln_1.weight"),
                 "attention.wo.weight": Src(f"{L}.attn.c_proj.weight"),
                 "ffn_norm.weight": Src(f"{L}.ln_2.weight"),
                 "feed_forward.w1.weight": Src(f"{L}.mlp.w2.weight"),     # Qwen's w2 is the gate (silu)
                 "feed_forward.w3.weight": Src(f"{L}.mlp.w1.weight"),     # and w1 the up projection
                 "feed_forward.w2.weight": Src(f"{L}.mlp.c_proj.weight"),
                 "norm.weight": Src("transformer.ln_f.weight"),
                 "output.weight": Src("transformer.wte.weight" if p.tie_word_embeddings else "lm_head.weight")}
        for n, w in enumerate(("wq", "wk", "wv")):
            for leaf in ("weight", "bias"):
                table[f"attention.{w}.{leaf}"] = rows(f"{L}.attn.c_attn.{leaf}", qkv, n)
        return table_sources(p, table, rotate_half=True)

    def tokenizer_extras(self, directory: Path, params: PmxParams) -> dict:
        """Qwen-Chat's ChatML prompt (its default system prompt) where the checkpoint has no template."""
        specials = qwen_specials(directory)
        if specials is None:
            return {}
        return tokenizer_config_with(directory, CHATML_TEMPLATE,
                                     {t: specials[t] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")})


QWEN = QwenFamily(name="qwen", architectures=("QWenLMHeadModel",),
                  ignored=(r"transformer\.rotary_emb\.inv_freq", r"transformer\.h\.\d+\.attn\.(masked_bias|bias)",
                           r"transformer\.h\.\d+\.attn\.rotary_emb\.inv_freq"))
