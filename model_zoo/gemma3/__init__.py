"""Gemma 3, text (`Gemma3ForCausalLM`; and the language model of `Gemma3ForConditionalGeneration` checkpoints, from
their text_config and `language_model.*` tensors, the vision tower and the projector left out with a note): Gemma 2's
norms (x * (1 + w), four a layer), scaled embeddings and GeGLU, plus q and k RMS-normed per head (1 + w too) before
rotary; five sliding-window (local) layers to one full (global) one (`sliding_window_pattern` 6, or `layer_types`),
each kind with its rope: local rope_local_base_freq (10000), global rope_theta (1e6) with its rope_scaling; scores
scaled by query_pre_attn_scalar ** -0.5, no soft caps; head_dim x heads need not equal the hidden size; tied
embeddings. Missing keys take transformers' Gemma3TextConfig defaults (the published text_configs give few)."""

from model_zoo.chat import GEMMA_SPECIALS, GEMMA_TEMPLATE
from model_zoo.decoder import DecoderFamily
from model_zoo.gemma2 import GEMMA_MODULES

GEMMA3_DEFAULTS = (
    ("vocab_size", 262208), ("hidden_size", 2304), ("intermediate_size", 9216), ("num_hidden_layers", 26),
    ("num_attention_heads", 8), ("num_key_value_heads", 4), ("head_dim", 256),
    ("hidden_activation", "gelu_pytorch_tanh"), ("max_position_embeddings", 131072), ("rms_norm_eps", 1e-6),
    ("pad_token_id", 0), ("eos_token_id", 1), ("bos_token_id", 2), ("tie_word_embeddings", True),
    ("rope_theta", 1_000_000.0), ("rope_local_base_freq", 10_000.0), ("attention_bias", False),
    ("query_pre_attn_scalar", 256), ("sliding_window", 4096))

# GGUF: "gemma3" files as Gemma 2's (rotate-half q/k rows, norms and q/k norms as 1 + w, the 27B's scale: 62 layers);
# rope.freq_base is the global layers' theta (with rope.scaling linear), rope.freq_base_swa the local ones' (10000
# where no key says, unscaled); five local layers to one global (attention.sliding_window_pattern where the file has
# one); no attention.sliding_window key: no local layers (llama.cpp's converter leaves it out for pattern 1)
GEMMA3 = DecoderFamily(
    name="gemma3", architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    sliding_window_key="sliding_window", sliding_pattern=6, local_rope_key="rope_local_base_freq", qk_norm=True,
    config_defaults=GEMMA3_DEFAULTS, norm_offset=1.0, post_norms=True, scale_embeddings=True, hf_modules=GEMMA_MODULES,
    text_config=True, hf_prefixes=("model.", "language_model.model.", "model.language_model."),
    lm_heads=("lm_head.weight", "language_model.lm_head.weight"),
    left_out=((r"(model\.)?vision_tower\..*", "vision tower"),
              (r"(model\.)?multi_modal_projector\..*", "multimodal projector")),
    chat_template=GEMMA_TEMPLATE, chat_specials=GEMMA_SPECIALS, gguf_architecture="gemma3", gguf_rotate_half=True,
    gguf_defaults=(("sliding_window", None),), gguf_norm_shift=1.0, gguf_score_scale_layers=(62,))
