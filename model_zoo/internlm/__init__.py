"""InternLM (v1: `InternLMForCausalLM`, Shanghai AI Lab's modeling_internlm.py through `auto_map`): Llama's tensor
names and rotate-half rotary, with biases on q, k, v and o when the config's `bias` is true (as published). Rotary
from the config's `rotary` dict where present (`base`; `type` "origin", or "dynamic" NTK with `scaling_factor`, the
same formula as transformers' dynamic rope), else base 10000."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from model_zoo.chat import INTERNLM_TEMPLATE, sentencepiece_ids, tokenizer_config_with
from model_zoo.decoder import ConfigKeys, DecoderFamily
from runner.errors import PmxError
from runner.pmx.params import PmxParams


class InternLMFamily(DecoderFamily):
    def params(self, config: dict, dtype: str, source: str = "config.json", directory: Optional[Path] = None
               ) -> PmxParams:
        k = ConfigKeys(config, source)
        k.expect("hidden_act", ("silu",), "expected 'silu'")
        k.expect("rope_scaling", (), "InternLM sets its rotary in the 'rotary' dict")
        rotary = config.get("rotary") or {}
        if not isinstance(rotary, dict):
            raise PmxError(f"{source}: 'rotary' must be a JSON object, got {rotary!r}")
        r = ConfigKeys(rotary, f"{source} 'rotary'")
        r.expect("type", ("origin", "dynamic"), "rotary types: origin, dynamic")
        scaling = ({"rope_type": "dynamic", "factor": r.float("scaling_factor", 1.0)}
                   if rotary.get("type") == "dynamic" else None)
        hidden, heads = k.int("hidden_size"), k.int("num_attention_heads")
        bias = k.bool("bias", True)
        return PmxParams(
            model_type=self.name, architecture=config["architectures"][0], hidden_dim=hidden,
            intermediate_dim=k.int("intermediate_size"), num_layers=k.int("num_hidden_layers"), num_heads=heads,
            num_kv_heads=k.int("num_key_value_heads", heads), head_dim=hidden // heads, vocab_size=k.int("vocab_size"),
            norm_eps=k.float("rms_norm_eps", 1e-6), rope_theta=r.float("base", 10000.0), rope_scaling=scaling,
            rotary_dim=hidden // heads, max_position_embeddings=k.int("max_position_embeddings", 2048),
            qkv_bias=bias, o_bias=bias, tie_word_embeddings=k.bool("tie_word_embeddings", False),
            bos_token_id=config.get("bos_token_id"), eos_token_id=k.eos(directory),
            pad_token_id=config.get("pad_token_id"), dtype=dtype)

    def tokenizer_extras(self, directory: Path, params: PmxParams) -> dict:
        """InternLM-chat's prompt (<|User|>: ... <eoh>, <|Bot|>: ... <eoa>) where the checkpoint has no template."""
        ids = sentencepiece_ids(directory, ("<eoh>", "<eoa>"))
        return tokenizer_config_with(directory, INTERNLM_TEMPLATE, ids) if ids else {}


INTERNLM = InternLMFamily(name="internlm", architectures=("InternLMForCausalLM",))
