"""Mixtral (`MixtralForCausalLM`): Mistral's attention with a sparse mixture-of-experts MLP. The router
`block_sparse_moe.gate` picks `num_experts_per_tok` of `num_local_experts` experts per token (softmax,
top-k, renormalised); expert e's `w1` (gate), `w3` (up) and `w2` (down) are stacked into PMX's
`feed_forward.{w1,w3,w2}.weight` of shape [E, out, in]."""

from model_zoo.decoder import DecoderFamily

# GGUF: a "llama" file with experts (llama.cpp's ffn_{gate,up,down}_exps, already stacked [E, out, in])
MIXTRAL = DecoderFamily(name="mixtral", architectures=("MixtralForCausalLM",), sliding_window_key="sliding_window",
                        moe_module="block_sparse_moe", gguf_architecture="llama")
