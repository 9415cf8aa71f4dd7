"""Qwen3 (`Qwen3ForCausalLM`): per-head RMSNorm of q and k before rotary (`q_norm`, `k_norm`), an
explicit head_dim (head_dim x heads need not equal the hidden size), biases only when
`attention_bias`; sliding window only when `use_sliding_window` is true."""

from model_zoo.decoder import DecoderFamily

# GGUF: "qwen3" files keep HF's rotate-half q/k rows (llama.cpp runs them with its NEOX rope)
QWEN3 = DecoderFamily(name="qwen3", architectures=("Qwen3ForCausalLM",), qk_norm=True,
                      sliding_window_key="use_sliding_window", gguf_architecture="qwen3", gguf_rotate_half=True)
