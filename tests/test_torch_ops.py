"""The fast torch kernels (the CPU path) against the reference over odd shapes, every cache layout and mode."""

from __future__ import annotations

import itertools

import pytest
import torch

from runner.kernels import reference as ref
from runner.kernels import torch_ops


@pytest.mark.parametrize("T,H,KV,D", [(1, 4, 4, 8), (5, 6, 2, 16), (3, 3, 1, 6)])
def test_rotary_in_place_on_fused_qkv(T, H, KV, D):
    """q and k rotated in one call where the fused GEMM left them (strided rows), in place."""
    qkv = torch.randn(T, (H + 2 * KV) * D)
    before = qkv.clone()
    pos = torch.tensor([0, 3, 17, 4, 900])[:T]
    cos, sin = ref.rope_cos_sin(pos, ref.rope_inv_freq(D, 1e4))
    x = qkv[:, : (H + KV) * D].view(T, H + KV, D)
    got = torch_ops.apply_rotary(x, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()  # in place
    want = ref.apply_rotary(before[:, : (H + KV) * D].view(T, H + KV, D), cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (H + KV) * D:], before[:, (H + KV) * D:])  # v untouched


def test_rotary_falls_back_for_half_precision():
    x = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    cos, sin = ref.rope_cos_sin(torch.arange(3), ref.rope_inv_freq(8, 1e4))
    assert torch.equal(torch_ops.apply_rotary(x, cos, sin), ref.apply_rotary(x, cos, sin))


@pytest.mark.parametrize("layout,quant", list(itertools.product(range(4), (False, True))))
def test_kv_store_and_load_every_layout(layout, quant):
    L, rows, KV, D = 3, 40, 2, 16
    dtype = torch.int8 if quant else torch.float32
    caches = [torch.zeros(ref.cache_shape(layout, L, rows, KV, D), dtype=dtype) for _ in range(2)]
    scales = [torch.zeros(ref.cache_shape(layout, L, rows, KV, D // 8), dtype=torch.float16) if quant else None
              for _ in range(2)]
    k, v = torch.randn(5, KV, D), torch.randn(5, KV, D)
    slots = torch.tensor([3, 39, 0, 17, 8])
    torch_ops.kv_store(caches[0], scales[0], layout, 2, k, v, slots)
    ref.kv_store(caches[1], scales[1], layout, 2, k, v, slots)
    assert torch.equal(caches[0], caches[1])
    if quant:
        assert torch.equal(scales[0], scales[1])
    hist = torch.tensor([[17, 3, 3], [0, 8, 39]])
    got = torch_ops.kv_load(caches[0], scales[0], layout, 2, hist, torch.float32)
    want = ref.kv_load(caches[1], scales[1], layout, 2, hist, torch.float32)
    for g, w in zip(got, want):
        assert g.shape == (2, 3, KV, D) and torch.equal(g, w)


@pytest.mark.parametrize("H,KV,S,N", [(4, 4, 1, 9), (6, 2, 5, 5), (8, 1, 3, 11), (4, 2, 1, 1)])
@pytest.mark.parametrize("masked", [False, True])
def test_attend_matches_reference(H, KV, S, N, masked):
    B, D = 3, 16
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, KV, N, D), torch.randn(B, KV, N, D)
    mask = None
    if masked:  # each query sees a prefix of the keys that ends at its own position (a continued chunk)
        ends = torch.randint(1, N + 1, (B, 1, S, 1))
        mask = torch.arange(N)[None, None, None, :] < ends
    causal = S == N and not masked
    torch.testing.assert_close(torch_ops.attend(q, k, v, mask, causal), ref.attend(q, k, v, mask, causal),
                               rtol=1e-5, atol=1e-5)
