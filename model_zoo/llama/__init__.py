"""Llama 1/2/3/3.1/3.2 (`LlamaForCausalLM`): attention_bias and mlp_bias from the config, rope
scaling kept as the HF dict, explicit head_dim honoured."""

from model_zoo.decoder import DecoderFamily

LLAMA = DecoderFamily(name="llama", architectures=("LlamaForCausalLM",))
