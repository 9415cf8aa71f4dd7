"""Phi-3 / 3.5 / Phi-4-mini (`Phi3ForCausalLM`): Llama's layer with q, k, v in one HF tensor (`self_attn.qkv_proj`,
rows q | k | v) and gate, up in another (`mlp.gate_up_proj`, rows gate | up), cut apart at conversion; LongRoPE
(rope_scaling type "longrope", or "su": short and long factors per rotary dim, switched by the sequence's length
against original_max_position_embeddings, cos and sin scaled by its attention factor); a partial rotary
(partial_rotary_factor: Phi-4-mini rotates 96 of 128 dims); a sliding window on every layer where the config has
one (Phi-3-mini-4k: 2047). Missing keys take transformers' Phi3Config defaults."""

from model_zoo.chat import PHI3_SPECIALS, PHI3_TEMPLATE
from model_zoo.decoder import DecoderFamily

PHI3_DEFAULTS = (("vocab_size", 32064), ("max_position_embeddings", 4096), ("original_max_position_embeddings", 4096),
                 ("rms_norm_eps", 1e-5), ("bos_token_id", 1), ("eos_token_id", 32000), ("pad_token_id", 32000),
                 ("tie_word_embeddings", False), ("rope_theta", 10000.0))

# GGUF: llama.cpp's "phi3" files keep HF's rotate-half q/k rows (its NEOX rope), q | k | v fused as `attn_qkv` and
# gate | up as `ffn_up`; rope.dimension_count is the partial rotary (Phi-4-mini's 96 of 128); LongRoPE's factors are the
# tensors rope_factors_long / _short.weight, with rope.scaling.original_context_length and .attn_factor; a
# sliding_window of 0 is none (Phi-4-mini); a window is kept as the model has it (llama.cpp runs phi3 files without)
PHI3 = DecoderFamily(name="phi3", architectures=("Phi3ForCausalLM",), sliding_window_key="sliding_window",
                     fused_qkv="self_attn.qkv_proj", fused_gate_up="mlp.gate_up_proj", config_defaults=PHI3_DEFAULTS,
                     chat_template=PHI3_TEMPLATE, chat_specials=PHI3_SPECIALS, gguf_architecture="phi3",
                     gguf_rotate_half=True)
