"""Mistral (`MistralForCausalLM`): Llama's layout, plus sliding-window attention when the config
sets `sliding_window`."""

from model_zoo.decoder import DecoderFamily

MISTRAL = DecoderFamily(name="mistral", architectures=("MistralForCausalLM",), sliding_window_key="sliding_window")
