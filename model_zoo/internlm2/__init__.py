"""InternLM2 (`InternLM2ForCausalLM`, modeling_internlm2.py through `auto_map`): `model.tok_embeddings`,
`attention.wqkv` packed per KV head as [q x (heads / KV heads), k, v] blocks of head_dim rows (unpacked here into
wq, wk, wv, the q/k rows from rotate-half into interleaved pairs), `attention.wo`, `feed_forward.w1` (gate) / `w3`
(up) / `w2` (down), `attention_norm`, `ffn_norm`, `model.norm`, `output`; biases when `bias` is true.

`rope_scaling` {"type": "dynamic", "factor": f} is InternLM2's dynamic NTK: past max_position_embeddings the base
becomes theta (f L / M - (f - 1))^(d / (d - 2)) for a sequence of L positions, recomputed as it grows. Its module
computes this once per forward from the longest sequence so far and keeps the last one even for a later, shorter
sequence (state carried between requests); the engine computes it from each step's longest sequence (what
InternLM2 gives a sequence generated on its own, from a fresh model), as for Llama's dynamic rope."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from model_zoo.chat import INTERNLM2_TEMPLATE, sentencepiece_ids, tokenizer_config_with
from model_zoo.decoder import ConfigKeys, DecoderFamily, Src, _rope, table_sources
from runner.errors import PmxError
from runner.pmx.params import PmxParams

L = "model.layers.{i}"


def unpack_wqkv(kv_heads: int, groups: int, head_dim: int, which: int):
    """wqkv rows [(KV (groups + 2) head_dim), ...] -> q (which 0: the `groups` blocks of each KV head, in head
    order), k (1) or v (2)."""
    def take(t: torch.Tensor) -> torch.Tensor:
        blocks = t.reshape(kv_heads, groups + 2, head_dim, *t.shape[1:])        # (KV, G + 2, hd, ...)
        part = blocks[:, :groups] if which == 0 else blocks[:, groups + which - 1]
        return part.reshape(-1, *t.shape[1:])
    return take


class InternLM2Family(DecoderFamily):
    def params(self, config: dict, dtype: str, source: str = "config.json", directory: Optional[Path] = None
               ) -> PmxParams:
        k = ConfigKeys(config, source)
        k.expect("hidden_act", ("silu",), "expected 'silu'")
        scaling = config.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise PmxError(f"{source}: 'rope_scaling' must be null or a JSON object, got {scaling!r}")
        if scaling and scaling.get("type", scaling.get("rope_type")) not in ("dynamic", "linear"):
            raise PmxError(f"{source}: 'rope_scaling' type {scaling.get('type')!r} is not supported (InternLM2 has "
                           f"dynamic and linear)")
        hidden, heads = k.int("hidden_size"), k.int("num_attention_heads")
        theta, rope, _ = _rope(config, hidden // heads, source)
        bias = k.bool("bias", False)
        return PmxParams(
            model_type=self.name, architecture=config["architectures"][0], hidden_dim=hidden,
            intermediate_dim=k.int("intermediate_size"), num_layers=k.int("num_hidden_layers"), num_heads=heads,
            num_kv_heads=k.int("num_key_value_heads", heads), head_dim=hidden // heads, vocab_size=k.int("vocab_size"),
            norm_eps=k.float("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=rope, rotary_dim=hidden // heads,
            max_position_embeddings=k.int("max_position_embeddings", 2048), qkv_bias=bias, o_bias=bias,
            tie_word_embeddings=k.bool("tie_word_embeddings", False), bos_token_id=config.get("bos_token_id"),
            eos_token_id=k.eos(directory), pad_token_id=config.get("pad_token_id"), dtype=dtype)

    def tensor_sources(self, p: PmxParams):
        KV, hd = p.num_kv_heads, p.head_dim
        G = p.num_heads // KV
        packed = KV * (G + 2) * hd
        table = {"tok_embeddings.weight": Src("model.tok_embeddings.weight"),
                 "attention_norm.weight": Src(f"{L}.attention_norm.weight"),
                 "attention.wo.weight": Src(f"{L}.attention.wo.weight"),
                 "attention.wo.bias": Src(f"{L}.attention.wo.bias"),
                 "ffn_norm.weight": Src(f"{L}.ffn_norm.weight"),
                 "feed_forward.w1.weight": Src(f"{L}.feed_forward.w1.weight"),
                 "feed_forward.w3.weight": Src(f"{L}.feed_forward.w3.weight"),
                 "feed_forward.w2.weight": Src(f"{L}.feed_forward.w2.weight"),
                 "norm.weight": Src("model.norm.weight"),
                 "output.weight": Src("model.tok_embeddings.weight" if p.tie_word_embeddings else "output.weight")}
        for n, w in enumerate(("wq", "wk", "wv")):
            for leaf in ("weight", "bias"):
                table[f"attention.{w}.{leaf}"] = Src(f"{L}.attention.wqkv.{leaf}", unpack_wqkv(KV, G, hd, n), packed)
        return table_sources(p, table, rotate_half=True)

    def tokenizer_extras(self, directory: Path, params: PmxParams) -> dict:
        """InternLM2-chat's template where the checkpoint has none (it is in its tokenizer_config.json)."""
        ids = sentencepiece_ids(directory, ("<|im_start|>", "<|im_end|>"))
        return tokenizer_config_with(directory, INTERNLM2_TEMPLATE, ids) if ids else {}


INTERNLM2 = InternLM2Family(name="internlm2", architectures=("InternLM2ForCausalLM",),
                            ignored=(r"model\.layers\.\d+\.attention\.rotary_emb\.inv_freq",))
