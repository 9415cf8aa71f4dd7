"""Gemma 2 (`Gemma2ForCausalLM`): Llama's attention and MLP layout with Gemma's differences, all read from the
config: RMSNorm as x * (1 + w) in float32; four norms a layer (input, post-attention, pre- and post-feed-forward:
the attention's and the MLP's outputs normed before their residual adds); the embeddings scaled by sqrt(hidden);
scores scaled by query_pre_attn_scalar ** -0.5 and soft-capped (attn_logit_softcapping), the logits too
(final_logit_softcapping); GeGLU with GELU's tanh form; sliding-window (local) and full (global) layers alternating,
the first local; tied embeddings. Missing keys take transformers' Gemma2Config defaults."""

from model_zoo.chat import GEMMA_SPECIALS, GEMMA_TEMPLATE
from model_zoo.decoder import DecoderFamily

GEMMA_MODULES = (("ffn_norm", "pre_feedforward_layernorm"),)  # (post_attention_norm: post_attention_layernorm)
GEMMA2_DEFAULTS = (
    ("vocab_size", 256000), ("hidden_size", 2304), ("intermediate_size", 9216), ("num_hidden_layers", 26),
    ("num_attention_heads", 8), ("num_key_value_heads", 4), ("head_dim", 256),
    ("hidden_activation", "gelu_pytorch_tanh"), ("max_position_embeddings", 8192), ("rms_norm_eps", 1e-6),
    ("pad_token_id", 0), ("eos_token_id", 1), ("bos_token_id", 2), ("tie_word_embeddings", True),
    ("rope_theta", 10000.0), ("attention_bias", False), ("query_pre_attn_scalar", 256), ("sliding_window", 4096),
    ("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0))

# GGUF: llama.cpp's "gemma2" files keep HF's rotate-half q/k rows (its NEOX rope) and hold every norm as 1 + w (its
# converter adds the 1); no key holds the scores' scale: llama.cpp takes 1 / sqrt(head_dim), 1 / sqrt(hidden / heads)
# for the 27B (46 layers), whose query_pre_attn_scalar that is; the soft caps and the window (4096 where no key says)
# from its keys, local and global layers alternating (attention.sliding_window_pattern where the file has one)
GEMMA2 = DecoderFamily(name="gemma2", architectures=("Gemma2ForCausalLM",), sliding_window_key="sliding_window",
                       sliding_pattern=2, config_defaults=GEMMA2_DEFAULTS, norm_offset=1.0, post_norms=True,
                       scale_embeddings=True, hf_modules=GEMMA_MODULES, chat_template=GEMMA_TEMPLATE,
                       chat_specials=GEMMA_SPECIALS, gguf_architecture="gemma2", gguf_rotate_half=True,
                       gguf_norm_shift=1.0, gguf_score_scale_layers=(46,))
