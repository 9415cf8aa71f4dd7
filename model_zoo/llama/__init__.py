"""Llama 1/2/3/3.1/3.2 (`LlamaForCausalLM`): attention_bias and mlp_bias from the config, rope
scaling kept as the HF dict, explicit head_dim honoured."""

from model_zoo.decoder import DecoderFamily

# GGUF: llama.cpp's "llama" files (Llama 1/2/3, Mistral, SmolLM, ...), q/k permuted to interleaved pairs by its converter
LLAMA = DecoderFamily(name="llama", architectures=("LlamaForCausalLM",), gguf_architecture="llama")
