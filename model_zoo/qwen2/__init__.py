"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): biases on q/k/v (none on o), often tied embeddings and a
large rope_theta; sliding window only when `use_sliding_window` is true."""

from model_zoo.decoder import DecoderFamily

# GGUF: "qwen2" files keep HF's rotate-half q/k rows (llama.cpp runs them with its NEOX rope)
QWEN2 = DecoderFamily(name="qwen2", architectures=("Qwen2ForCausalLM",), qkv_bias=True, o_bias=False,
                      sliding_window_key="use_sliding_window", gguf_architecture="qwen2", gguf_rotate_half=True)
