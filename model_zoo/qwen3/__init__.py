"""Qwen3 (`Qwen3ForCausalLM`): per-head RMSNorm of q and k before rotary (`q_norm`, `k_norm`), an
explicit head_dim (head_dim x heads need not equal the hidden size), biases only when
`attention_bias`; sliding window only when `use_sliding_window` is true."""

from model_zoo.decoder import DecoderFamily

QWEN3 = DecoderFamily(name="qwen3", architectures=("Qwen3ForCausalLM",), qk_norm=True,
                      sliding_window_key="use_sliding_window")
