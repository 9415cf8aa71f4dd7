"""The fast torch kernels (the CPU path) against the reference over odd shapes, every cache layout and mode."""

from __future__ import annotations

import itertools

import pytest
import torch

from runner.kernels import reference as ref
from runner.kernels import torch_ops
from runner.kernels.cpu_ext import cpu_ops

needs_cpu_ops = pytest.mark.skipif(cpu_ops() is None, reason="this project's CPU kernels cannot be built here")


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


def rotary_tolerance(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """|C++ - reference| allowed per element of x [T, heads, D]: 2^-22 (|a cos| + |b sin|) for a cos - b sin (and so
    for a sin + b cos). The reference rounds both products; the compiler may fuse one product into the subtraction
    (an FMA, one rounding fewer): the results then differ by at most ~3 roundings of 2^-24 relative to those terms."""
    T, nh, D = x.shape
    a, b = x.view(T, nh, D // 2, 2).abs().unbind(-1)
    c, s = cos.abs()[:, None], sin.abs()[:, None]
    return 2.0 ** -22 * torch.stack((a * c + b * s, a * s + b * c), -1).view(T, nh, D)


@needs_cpu_ops
@pytest.mark.parametrize("T,heads,D,stride", [(1, 1, 2, None), (7, 3, 10, None), (5, 3, 34, 5 * 34), (0, 2, 8, None),
                                              (4, 9, 128, 12 * 128)])
def test_rotary_op_matches_the_reference(T, heads, D, stride):
    """pmx_cpu::rotary_ (the one-call decode step's rotary) in place, on contiguous and strided rows (a view of a wider
    qkv row), at positions up to 10^5, within :func:`rotary_tolerance` of reference.apply_rotary."""
    rows = torch.randn(T, stride or heads * D) * 4
    x = rows[:, : heads * D].view(T, heads, D)
    before, tail = x.clone(), rows[:, heads * D:].clone()
    cos, sin = ref.rope_cos_sin(torch.randint(0, 100_000, (T,)), ref.rope_inv_freq(D, 1e6))
    want = ref.apply_rotary(before, cos, sin)
    torch.ops.pmx_cpu.rotary_(x, cos, sin)
    assert ((x - want).abs() <= rotary_tolerance(before, cos, sin)).all()
    assert torch.equal(rows[:, heads * D:], tail)


def test_rotary_falls_back_for_half_precision():
    x = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    cos, sin = ref.rope_cos_sin(torch.arange(3), ref.rope_inv_freq(8, 1e4))
    assert torch.equal(torch_ops.apply_rotary(x, cos, sin), ref.apply_rotary(x, cos, sin))


def empty_caches(layout, quant, L, rows, KV, D, n=2):
    dtype = torch.int8 if quant else torch.float32
    return ([torch.zeros(ref.cache_shape(layout, L, rows, KV, D), dtype=dtype) for _ in range(n)],
            [torch.zeros(ref.cache_shape(layout, L, rows, KV, D // 8), dtype=torch.float16) if quant else None
             for _ in range(n)])


@needs_cpu_ops
@pytest.mark.parametrize("layout,quant", list(itertools.product(range(4), (False, True))))
@pytest.mark.parametrize("T,KV,D", [(1, 1, 8), (7, 3, 24), (33, 2, 136)])
def test_kv_store_op_matches_the_reference_bit_for_bit(layout, quant, T, KV, D):
    """pmx_cpu::kv_store_ (the one-call decode step's K/V store and int8 quantiser) writes the reference's bits, every
    other row untouched: k and v as the fused qkv GEMM leaves them (strided rows), values from 1e-8 to 1e3 (the
    1e-5 scale floor, all-zero groups) and ties at .5."""
    torch.manual_seed(T)
    caches, scales = empty_caches(layout, quant, 3, 50, KV, D)
    qkv = torch.randn(T, 4 * KV * D) * 10.0 ** torch.randint(-8, 4, (T, 1)).float()
    qkv[0, : 8] = 0
    k, v = qkv[:, KV * D: 2 * KV * D].view(T, KV, D), qkv[:, 2 * KV * D: 3 * KV * D].view(T, KV, D)
    k[-1, 0, :8] = torch.tensor([127.0, 0.5, -0.5, 1.5, 2.5, -2.5, 3.5, 126.5])   # scale 1: round half to even
    slots = torch.randperm(50)[:T]
    torch.ops.pmx_cpu.kv_store_(caches[0], scales[0], layout, 1, k, v, slots)
    ref.kv_store(caches[1], scales[1], layout, 1, k, v, slots)
    assert torch.equal(caches[0], caches[1])
    if quant:
        assert torch.equal(scales[0], scales[1])
        # the reference divides by the float32 scale, not the float16 one it stores: the test tells them apart
        g = torch.stack((k, v)).unflatten(-1, (-1, 8))
        s16 = (g.abs().amax(-1) / 127.0).clamp_min(1e-5).half().float()[..., None]
        alt = torch.round(g / s16).clamp(-127, 127).to(torch.int8).flatten(-2)
        assert T < 7 or not torch.equal(alt, torch.stack(ref.kv_load(caches[1], None, layout, 1, slots, torch.int8)))


@needs_cpu_ops
def test_kv_store_op_refuses_rows_outside_the_cache():
    caches, _ = empty_caches(2, False, 2, 10, 1, 8, n=1)
    with pytest.raises(RuntimeError, match="cache row 10 is outside the cache's 10 rows"):
        torch.ops.pmx_cpu.kv_store_(caches[0], None, 2, 0, torch.randn(1, 1, 8), torch.randn(1, 1, 8),
                                    torch.tensor([10]))


@pytest.mark.parametrize("layout,quant", list(itertools.product(range(4), (False, True))))
def test_kv_store_and_load_every_layout(layout, quant):
    L, rows, KV, D = 3, 40, 2, 16
    caches, scales = empty_caches(layout, quant, L, rows, KV, D)
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


# (B, H, KV, S, D, causal, softcap): MHA and GQA, a prompt of one key block and several (blocks of 64 keys on AVX-512,
# 32 on AVX2) with rows left over from the tiles, head dims off the vector width (72, 80, 40) and past four vectors
# (128), a soft cap, no causal mask
@needs_cpu_ops
@pytest.mark.parametrize("case", [(1, 8, 2, 200, 64, True, 0.0), (2, 4, 4, 37, 72, True, 0.0),
                                  (1, 6, 3, 70, 128, True, 0.0), (3, 4, 1, 65, 80, False, 0.0),
                                  (1, 4, 2, 100, 40, True, 50.0), (1, 4, 2, 100, 64, True, 5.0),
                                  (2, 2, 1, 2, 16, True, 0.0)])
def test_prefill_attention_in_cpp_matches_reference(case, monkeypatch):
    """A fresh prompt's attention (no mask; causal or not) runs this project's flash attention in C++ on float32 CPU
    tensors, on the strided views the fused qkv GEMM leaves, and equals the reference's softmax(q k^T) v; with its
    products in bfloat16 (attend's `bf16`, where the CPU has AVX512-BF16) within that rounding's spread of it."""
    B, H, KV, S, D, causal, softcap = case
    qkv = torch.randn(B, S, H + 2 * KV, D)  # (rows of the fused qkv output: every view strided)
    q, k, v = (t.transpose(1, 2) for t in qkv.split([H, KV, KV], dim=2))
    want = ref.attend(q, k, v, None, causal, softcap)

    def elsewhere(*args, **kwargs):
        raise AssertionError("attend took torch's or the reference's attention")
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", elsewhere)
    monkeypatch.setattr(ref, "attend", elsewhere)
    got = torch_ops.attend(q, k, v, None, causal, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.shape == (B, H, S, D)
    # bfloat16 products where the CPU has AVX512-BF16 and head_dim is a multiple of 16: within the rounding's spread
    # of float32 (and not float32's result); elsewhere the float32 kernel's own result
    half = torch_ops.attend(q, k, v, None, causal, softcap, bf16=True)
    if torch.ops.pmx_cpu.prefill_attention_bf16() and D % 16 == 0:
        err = float((half - want).abs().max() / want.abs().max())
        assert 1e-5 < err < 1e-2, err
        # the output in bfloat16 (for a linear of bfloat16 dot products): the float32 one rounded to nearest even
        half16 = torch_ops.attend(q, k, v, None, causal, softcap, bf16=True, bf16_out=True)
        assert half16.dtype == torch.bfloat16 and torch.equal(half16, half.bfloat16())
    else:
        assert torch.equal(half, got)
        assert torch.equal(torch_ops.attend(q, k, v, None, causal, softcap, bf16=True, bf16_out=True), got)
    with pytest.raises(RuntimeError, match="a bfloat16 output comes with bfloat16 products"):
        torch.ops.pmx_cpu.prefill_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 1.0, causal,
                                            0.0, False, True)
    with pytest.raises(RuntimeError, match="H a multiple of KV"):
        torch.ops.pmx_cpu.prefill_attention(q.transpose(1, 2), k.transpose(1, 2)[:, :, :0], v.transpose(1, 2)[:, :, :0],
                                            1.0, causal, 0.0)


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
