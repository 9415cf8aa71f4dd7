"""Reference ops checked against transformers / plain definitions, over odd shapes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from model_zoo.decoder import unpermute_rotary
from runner.kernels import reference as ref
from runner.kernels.cpu_ext import bf16_k_pairs, cpu_ops, pack_blocks, unpack_blocks
from runner.kernels.linear import Linear
from runner.parallel.comm import SingleComm
from runner.parallel.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear


def test_rms_norm_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    x, skip = torch.randn(5, 37), torch.randn(5, 37)
    norm = LlamaRMSNorm(37, eps=1e-5)
    norm.weight.data = torch.randn(37)
    y, r = ref.skip_rms_norm(x, skip, norm.weight.data, 1e-5)
    assert torch.equal(r, x + skip)
    torch.testing.assert_close(y, norm(x + skip), rtol=1e-6, atol=1e-6)


ROPE_CASES = [None, {"rope_type": "linear", "factor": 4.0},
              {"rope_type": "dynamic", "factor": 3.0},
              {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
              {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
              {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 16,
               "beta_slow": 2, "mscale": 1.2, "mscale_all_dim": 0.8, "truncate": False},
              {"rope_type": "longrope", "original_max_position_embeddings": 32, "short_factor": [1, 1.2, 1.5, 2, 3, 4],
               "long_factor": [1, 2, 4, 8, 16, 32]}]


@pytest.mark.parametrize("scaling", ROPE_CASES, ids=lambda c: "default" if not c else c["rope_type"])
@pytest.mark.parametrize("max_pos", [64, 512])
def test_rotary_matches_transformers(scaling, max_pos):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    H, D, T = 3, 12, 9
    cfg = LlamaConfig(hidden_size=H * D, num_attention_heads=H, head_dim=D, max_position_embeddings=max_pos,
                      rope_scaling=dict(scaling) if scaling else None, rope_theta=500.0)
    pos = torch.tensor([0, 1, 2, 7, 100, 101, 300, 5, 6])  # beyond max_pos=64: dynamic NTK rescales the base
    q = torch.randn(1, H, T, D)  # HF rotate-half layout
    cos, sin = LlamaRotaryEmbedding(cfg)(q, pos[None])
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    # (transformers takes the step's longest sequence for every token: LongRoPE's long factors here, 301 > 32)
    ends = torch.full_like(pos, int(pos.max()) + 1)
    c, s = ref.Rotary(D, 500.0, scaling, max_pos, torch.device("cpu")).cos_sin(pos, seq_end=ends)
    x = unpermute_rotary(q[0].transpose(0, 1).reshape(T, H * D).T, H).T.reshape(T, H, D)  # to interleaved
    got = ref.apply_rotary(x, c, s)
    want_i = unpermute_rotary(want[0].transpose(0, 1).reshape(T, H * D).T, H).T.reshape(T, H, D)
    torch.testing.assert_close(got, want_i, rtol=1e-5, atol=1e-5)


def test_dynamic_ntk_only_rescales_beyond_max_positions():
    rot = ref.Rotary(16, 1e4, {"rope_type": "dynamic", "factor": 2.0}, 32, torch.device("cpu"))
    short, long = torch.arange(20), torch.arange(50)
    torch.testing.assert_close(rot.cos_sin(short)[0], ref.rope_cos_sin(short, ref.rope_inv_freq(16, 1e4))[0])
    assert not torch.allclose(rot.cos_sin(long)[0][:20], rot.cos_sin(short)[0])


def test_unknown_rope_scaling_is_refused():
    with pytest.raises(NotImplementedError, match="'mrope' is not supported"):
        ref.rope_inv_freq(8, 1e4, {"rope_type": "mrope", "factor": 2.0})


def test_longrope_switches_per_sequence_at_original_max():
    """A token of a sequence that reaches past original_max in the step takes the long factors (a prompt longer than
    it from its first token), a decoding one from position original_max on; the tables are a decoding token's."""
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 8, "short_factor": [1.0, 2.0],
               "long_factor": [3.0, 5.0]}
    rot = ref.Rotary(4, 1e4, scaling, 64, torch.device("cpu"))
    short, long = (ref.rope_inv_freq(4, 1e4, scaling, 64, n) for n in (8, 9))
    scale = math.sqrt(1 + math.log(64 / 8) / math.log(8))
    assert rot.scale == pytest.approx(scale) and not torch.allclose(short, long)
    pos = torch.tensor([3, 7, 8, 20])
    for ends, longs in ((pos + 1, [False, False, True, True]), (torch.tensor([12, 12, 12, 21]), [True] * 4),
                        (torch.tensor([5, 8, 9, 21]), [False, False, True, True])):
        c, _ = rot.cos_sin(pos, seq_end=ends)
        for i, is_long in enumerate(longs):
            want = ref.rope_cos_sin(pos[i:i + 1], long if is_long else short, scale)[0]
            torch.testing.assert_close(c[i:i + 1], want)
    assert torch.equal(rot.cos_sin(pos)[0], rot.cos_sin(pos, seq_end=pos + 1)[0])


def test_swiglu():
    g, u = torch.randn(4, 7), torch.randn(4, 7)
    torch.testing.assert_close(ref.swiglu(g, u), g * torch.sigmoid(g) * u)


def test_int8_quantisation():
    x = torch.randn(3, 5, 16) * 4
    x[0, 0, :8] = 0  # an all-zero group: scale floored at 1e-5
    q, s = ref.quantize_int8(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == (3, 5, 2)
    assert q.abs().max() <= 127 and float(s[0, 0, 0]) == pytest.approx(1e-5, rel=1e-2)
    expect = x.unflatten(-1, (-1, 8)).abs().amax(-1) / 127
    torch.testing.assert_close(s.float(), expect.clamp_min(1e-5), rtol=1e-3, atol=1e-6)
    back = ref.dequantize_int8(q, s, torch.float32)
    assert (back - x).abs().max() <= (s.float().max() * 0.51 + 1e-3)


@pytest.mark.parametrize("layout", range(4))
def test_cache_layouts(layout):
    L, T, KV, D = 3, 20, 2, 8
    cache = torch.zeros(ref.cache_shape(layout, L, T, KV, D))
    k, v = torch.randn(4, KV, D), torch.randn(4, KV, D)
    slots = torch.tensor([3, 4, 10, 19])
    ref.kv_store(cache, None, layout, 1, k, v, slots)
    # the documented raw layout
    raw_k = {0: lambda t: cache[t, 1, 0], 1: lambda t: cache[1, t, 0], 2: lambda t: cache[1, 0, t],
             3: lambda t: cache[1, 0, :, t]}[layout]
    for i, t in enumerate(slots.tolist()):
        assert torch.equal(raw_k(t), k[i])
    k2, v2 = ref.kv_load(cache, None, layout, 1, slots, torch.float32)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert cache.count_nonzero() == 2 * k.numel()


def test_paged_slots():
    cachestarts = torch.tensor([[256, 0], [128, 384]])
    pos = torch.tensor([0, 127, 128, 130, 5])
    bot = torch.tensor([0, 0, 0, 1, 1])
    assert ref.token_slots(cachestarts, pos, bot, 1).tolist() == [256, 383, 0, 386, 133]
    assert ref.token_slots(torch.tensor([10, 50]), pos, bot, 0).tolist() == [10, 137, 138, 180, 55]


def test_attention_packed_against_sdpa():
    H, KV, D = 4, 2, 8
    lens, starts = [1, 5, 3], [6, 0, 2]  # a decoding sequence, a fresh prompt, a chunk continuing at 2
    kvl = [s + n for s, n in zip(starts, lens)]
    q = torch.randn(sum(lens), H, D)
    k, v = torch.randn(sum(kvl), KV, D), torch.randn(sum(kvl), KV, D)
    ss = torch.tensor([0] + lens).cumsum(0)
    ks = torch.tensor([0] + kvl).cumsum(0)
    out = ref.attention_packed(q, k, v, ss, ks, torch.tensor(starts))
    for b in range(3):
        qb = q[ss[b]:ss[b + 1]].transpose(0, 1)
        kb = k[ks[b]:ks[b + 1]].transpose(0, 1).repeat_interleave(2, 0)
        vb = v[ks[b]:ks[b + 1]].transpose(0, 1).repeat_interleave(2, 0)
        mask = torch.ones(lens[b], kvl[b], dtype=torch.bool).tril(diagonal=starts[b])
        want = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[ss[b]:ss[b + 1]], want, rtol=1e-5, atol=1e-5)
    windowed = ref.attention_packed(q, k, v, ss, ks, torch.tensor(starts), sliding_window=2)
    # the decoding token at position 6 with window 2 sees positions 5 and 6 only
    kb, vb = k[ks[0]:ks[1]][5:7].repeat_interleave(2, 1), v[ks[0]:ks[1]][5:7].repeat_interleave(2, 1)
    w = (q[0][None] * kb).sum(-1) / math.sqrt(D)
    torch.testing.assert_close(windowed[0], (w.softmax(0)[..., None] * vb).sum(0), rtol=1e-5, atol=1e-5)


class CountingComm(SingleComm):
    def __init__(self):
        self.calls = 0

    def all_reduce_(self, t):
        self.calls += 1
        return t


def test_parallel_layers_single_rank():
    comm = SingleComm()
    w, b, x = torch.randn(6, 4), torch.randn(6), torch.randn(3, 4)
    torch.testing.assert_close(ColumnParallelLinear(w, b, comm)(x), x @ w.T + b)
    torch.testing.assert_close(RowParallelLinear(w, b, comm)(x), x @ w.T + b)
    emb = torch.randn(10, 5)
    assert torch.equal(ParallelEmbedding(emb, 5, comm)(torch.tensor([3, 1])), emb[[3, 1]])


LINEAR_KERNELS = (["pmx"] if cpu_ops() is not None else []) + (["onednn"] if torch.backends.mkldnn.is_available() else [])


# rows 1..6 are the kernel's register tiles, 10, 17 and 32 several passes over k chunks of a streamed block, 40 and 70
# prefill (k chunks in L2, half precision widened per chunk; 70: a last pass of 4 rows), k 2049 and 4100 more than one
# k chunk, n off multiples of 64 and of the 16-channel panels
@pytest.mark.parametrize("shape", [(1, 1031, 517), (3, 700, 1111), (17, 2049, 257), (2, 5, 777, 1024),
                                   (40, 4100, 130), (6, 64, 64), (32, 300, 200), (70, 520, 100)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel,dtype", [(k, torch.float32) for k in LINEAR_KERNELS] + (
    [("pmx", torch.bfloat16), ("pmx", torch.float16)] if "pmx" in LINEAR_KERNELS else []))
def test_linear_prepacked_matches_f_linear(shape, bias, kernel, dtype):
    """float32 inputs on a weight packed at its width (float32, or bfloat16 / float16 widened in registers) against
    F.linear in float32 on the weight's values."""
    *lead, n_in, n_out = shape
    w, b, x = torch.randn(n_out, n_in).to(dtype), torch.randn(n_out) if bias else None, torch.randn(*lead, n_in)
    lin = Linear(w, b, kernel=kernel)
    assert lin.kernel == kernel and lin.packed is not None and lin.weight is None
    assert lin.packed.dtype == dtype and torch.equal(lin.dense_weight(), w)
    y = lin(x)
    assert y.shape == (*lead, n_out) and y.dtype == torch.float32
    # where the CPU has AVX512-BF16, bfloat16 weights take x rounded to bfloat16 (vdpbf16ps; cpu_gemm.cpp)
    rounded = dtype == torch.bfloat16 and kernel == "pmx" and bf16_k_pairs()
    ref = torch.nn.functional.linear(x.bfloat16().float() if rounded else x, w.float(), b)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()  # fp32 summation order only
    assert torch.equal(Linear(w.float(), b, prepack=False)(x), torch.nn.functional.linear(x, w.float(), b))


def test_linear_picks_this_projects_kernel_on_cpu():
    w = torch.randn(1024, 1024)
    assert Linear(w).kernel == ("pmx" if cpu_ops() is not None else "onednn")
    assert Linear(torch.randn(8, 16), min_numel=0).kernel == Linear(w).kernel
    with pytest.raises(ValueError, match="kernel must be one of"):
        Linear(w, kernel="mkl")


def test_linear_falls_back_to_onednn_without_the_extension(monkeypatch):
    """Where this project's CPU extension cannot be built (no compiler), float32 layers run on oneDNN."""
    import runner.kernels.linear as linear_mod
    monkeypatch.setattr(linear_mod, "cpu_ops", lambda: None)
    w, x = torch.randn(1024, 1024), torch.randn(3, 1024)
    lin = Linear(w)
    assert lin.kernel == ("onednn" if torch.backends.mkldnn.is_available() else "plain")
    ref = torch.nn.functional.linear(x, w)
    assert (lin(x) - ref).abs().max() <= 1e-5 * ref.abs().max()
    with pytest.raises(RuntimeError, match="needs this project's CPU extension"):
        Linear(w, kernel="pmx")


def test_linear_packs_half_precision_at_its_width_and_keeps_small_weights_plain():
    """A half-precision weight packs at its width for this project's kernel (oneDNN's takes float32 only); a small one
    stays plain and, under float32 inputs, is widened on each call."""
    w = torch.randn(1024, 1024, dtype=torch.bfloat16)
    if cpu_ops() is not None:
        assert Linear(w).kernel == "pmx" and Linear(w).packed.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="does not take torch.bfloat16"):
        Linear(w, kernel="onednn")
    small = torch.randn(64, 100)
    assert Linear(small).packed is None
    torch.testing.assert_close(Linear(small)(torch.ones(2, 100)), torch.ones(2, 100) @ small.T)
    half = small.half()
    assert Linear(half).kernel == "plain" and Linear(half)(torch.ones(2, 100)).dtype == torch.float32
    torch.testing.assert_close(Linear(half)(torch.ones(2, 100)), torch.ones(2, 100) @ half.float().T)


def test_row_parallel_sums_partials_then_adds_bias_once():
    """Two ranks simulated: each holds half of W's columns; the sum of partials + b equals the full layer."""
    w, b, x = torch.randn(6, 8), torch.randn(6), torch.randn(3, 8)
    parts = [RowParallelLinear(w[:, :4], b, CountingComm()), RowParallelLinear(w[:, 4:], b, CountingComm())]
    partial = [torch.nn.functional.linear(x[:, :4], w[:, :4]), torch.nn.functional.linear(x[:, 4:], w[:, 4:])]
    torch.testing.assert_close(partial[0] + partial[1] + b, x @ w.T + b)
    parts[0](x[:, :4])
    assert parts[0].comm.calls == 1
    with pytest.raises(ValueError, match="adds it after the all-reduce: no sequence parallelism"):
        parts[0](x[:, :4], sp=object())  # a bias cannot ride on partial sums that a SeqParallel norm reduces
    assert parts[0].comm.calls == 1


def _vma_flags(addr: int) -> dict:
    """The /proc/self/smaps fields of the mapping holding `addr`."""
    fields, inside = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside:
            fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux /proc needed")
def test_packed_weights_sit_in_memory_advised_for_huge_pages():
    """A 3 MB weight is packed into a mapping of its own with MADV_HUGEPAGE (smaps: THPeligible 1, unless the
    kernel has THP off); strided inputs are copied right; small tensors stay ordinary contiguous copies."""
    from runner.kernels.cpu_ext import HUGE_PAGE_MIN_BYTES, huge_page_copy
    w = torch.randn(1024, 768)
    packed = pack_blocks(w)
    assert torch.equal(unpack_blocks(packed, 1024), w)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    assert packed.data_ptr() % (2 << 20) == 0  # starts on a huge page: its whole 2 MiB chunks can be huge pages
    if thp.exists() and "[never]" not in thp.read_text():
        assert _vma_flags(packed.data_ptr()).get("THPeligible") == "1"
    t = torch.randn(HUGE_PAGE_MIN_BYTES // 4, 3)[:, 1:]  # strided, large
    h = huge_page_copy(t)
    assert h.is_contiguous() and torch.equal(h, t)
    small = torch.randn(8, 4).t()
    assert torch.equal(huge_page_copy(small), small) and huge_page_copy(small).is_contiguous()


needs_ext = pytest.mark.skipif(cpu_ops() is None, reason="the CPU kernels cannot be built here (no compiler)")


@needs_ext
def test_bfloat16_blocks_take_the_layout_of_the_machines_kernels():
    """Where the CPU has AVX512-BF16 a bfloat16 block holds its k-rows in pairs (a 32-bit word (w[2p, c], w[2p+1, c])
    a channel, an odd K's last row plainly) for vdpbf16ps; elsewhere, inside each group of g channels (two vectors),
    channel i then g/2 + i, for the kernels' shift-and-mask widening. Unpacking gives the weight back, and the kernels
    read it in that order (the linear tests above, every tile)."""
    from runner.kernels.cpu_ext import bf16_pair_channels
    n = torch.arange(130, dtype=torch.float32)[:, None]
    w = (n + 1000 * torch.arange(3, dtype=torch.float32)).bfloat16()  # [130, 3]: channel n, row k holds n + 1000 k
    packed = pack_blocks(w)
    assert packed.shape == (3, 3, 64) and packed.dtype == torch.bfloat16
    if bf16_k_pairs():
        # rows 0 and 1 of block 1 as pairs, channel by channel; the odd K's row 2 plainly
        assert packed[1, :2].flatten().float().tolist() == w[64:128, :2].flatten().float().tolist()
        assert packed[1, 2].float().tolist() == w[64:128, 2].float().tolist()
        assert packed[2, :2].flatten().float().tolist()[:6] == w[128:130, :2].flatten().float().tolist() + [0, 0]
    else:
        g = bf16_pair_channels()
        assert g in (16, 32)
        want = [64 + gi * g + h * g // 2 + i for gi in range(64 // g) for i in range(g // 2) for h in (0, 1)]
        assert packed[1, 0].float().tolist() == want
        assert packed[2, 0, :4].tolist() == [128, 0, 129, 0]  # the padding rows' zeros take their places too
    assert torch.equal(unpack_blocks(packed, 130), w)
    even = w[:, :2].contiguous()
    assert torch.equal(unpack_blocks(pack_blocks(even), 130), even)
    assert torch.equal(unpack_blocks(pack_blocks(w.half()), 130), w.half())  # float16: plain order


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 70])
def test_linear_fuses_swiglu_norm_and_residual_at_any_rows(dtype, rows):
    """This project's kernel takes the work around a product (linear_f32_fused): the down projection's input as the
    fused gate | up output, x = silu(g) * u computed as it loads; x normed by an RMSNorm weight on the way in; a
    residual added to the output (on bfloat16 weights with AVX512-BF16: in cache, as x is rounded for the dot products
    and as the output is stored; there `fuses` says so, for the model's fused step). Each equals the ops it replaces,
    and bad inputs are refused by name."""
    K, N = 1031, 130
    w, gu, x, res = torch.randn(N, K).to(dtype), torch.randn(rows, 2 * K), torch.randn(rows, K), torch.randn(rows, N)
    nw = torch.rand(K) + 0.5
    lin = Linear(w, torch.randn(N))
    assert lin.kernel == "pmx" and lin.takes_swiglu(gu) and not lin.takes_swiglu(gu[:, :K])
    assert lin.fuses(x) == (dtype == torch.bfloat16 and bf16_k_pairs())
    tol = dict(rtol=1e-6, atol=1e-6 * float(lin(x).abs().max()))
    want = lin(torch.ops.pmx_cpu.swiglu(gu[:, :K], gu[:, K:]))
    # (bfloat16 dot products: silu at bfloat16's precision, ~1e-5, as x is rounded: a few roundings go the other way)
    glu_tol = dict(rtol=0, atol=2e-3 * float(want.abs().max())) if lin.dot_bf16 else tol
    torch.testing.assert_close(lin(gu, swiglu=True), want, **glu_tol)
    torch.testing.assert_close(lin(gu, swiglu=True, residual=res), want + res, **glu_tol)
    normed, _ = torch.ops.pmx_cpu.skip_rms_norm(x, None, nw, 1e-5)
    torch.testing.assert_close(lin(x, norm=(nw, 1e-5)), lin(normed), **tol)
    torch.testing.assert_close(lin(x, norm=(nw, 1e-5), residual=res), lin(normed) + res, **tol)
    torch.testing.assert_close(lin(x, residual=res), lin(x) + res, **tol)
    with pytest.raises(RuntimeError, match="x must be contiguous float32"):
        torch.ops.pmx_cpu.linear_f32_fused(gu[:, 1:].contiguous(), lin.packed, N, True)
    with pytest.raises(RuntimeError, match="norm must be a contiguous float32 weight of 1031"):
        torch.ops.pmx_cpu.linear_f32_fused(x, lin.packed, N, False, nw[1:], 1e-5)
    with pytest.raises(RuntimeError, match=rf"residual must be contiguous float32 \[{rows}, 130\]"):
        torch.ops.pmx_cpu.linear_f32_fused(x, lin.packed, N, False, None, 0.0, res[:, 1:].contiguous())
    with pytest.raises(ValueError, match="no rotary epilogue"):
        lin(x, residual=res, rotary=object())
    # (a bfloat16 x is the pairs of bfloat16 dot products, of an even K: 1031 is odd)
    with pytest.raises(RuntimeError, match="a bfloat16 x goes to bfloat16 weights on AVX512-BF16 with an even K"):
        lin(x.bfloat16())


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 70])
def test_gate_up_returns_its_activation_for_the_down_projection(rows, dtype):
    """A fused gate | up layer (2 F outputs, F a multiple of 64) on this project's kernel returns silu(g) u [rows, F]
    (glu_out: each block's activation computed in cache, the [rows, 2 F] output never stored): float32, the SwiGLU op's
    result bit for bit; on bfloat16 weights with AVX512-BF16, bfloat16 within its rounding of the float32 activation,
    which the down projection takes as its x with the result of the same values in float32 bit for bit (they are the
    pairs its dot products read)."""
    K, F = 200, 128
    gate_up, down = (Linear(torch.randn(n, k).to(dtype), kernel="pmx") for n, k in ((2 * F, K), (96, F)))
    x = torch.randn(rows, K)
    assert gate_up.takes_glu_out(x) and not Linear(torch.randn(200, K).to(dtype), kernel="pmx").takes_glu_out(x)
    y = gate_up(x)
    act = gate_up(x, glu_out=True)
    assert act.shape == (rows, F) and act.dtype == (torch.bfloat16 if gate_up.dot_bf16 else torch.float32)
    if not gate_up.dot_bf16:
        assert torch.equal(act, torch.ops.pmx_cpu.swiglu(y[:, :F], y[:, F:]))
        return
    want = torch.nn.functional.silu(y[:, :F]) * y[:, F:]
    assert ((act.float() - want).abs() <= 2 ** -8 * want.abs() + 1e-6).all()
    assert torch.equal(down(act), down(act.float()))
    with pytest.raises(RuntimeError, match="glu_out needs"):
        torch.ops.pmx_cpu.linear_f32_fused(x, Linear(torch.randn(192, K).to(dtype), kernel="pmx").packed, 192,
                                           glu_out=True)


@needs_ext
@pytest.mark.parametrize("layout", range(4))
@pytest.mark.parametrize("case", [(4, 2, 64, 64, False), (2, 1, 80, 32, False), (3, 3, 128, 128, True),
                                  (4, 2, 64, 64, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_linear_rotates_and_stores_as_its_epilogue(case, layout, dtype):
    """The qkv linear on this project's kernel takes rotary and the cache store as its epilogue at any rows
    (linear_f32_qkv, each block's rows rotated and stored while in cache): q, k, v and the cache (float32, or int8
    with its scales) equal those of the linear followed by rotary_ and kv_store_ bit for bit, for MHA and GQA, a
    head_dim off the vector width with a partial rotary (80, 32 of it rotated), heads of two blocks (128)."""
    H, KV, D, R, quant = case
    from runner.engine.cache import new_cache
    K, M, layer = 96, 70, 1
    lin = Linear(torch.randn((H + 2 * KV) * D, K).to(dtype), kernel="pmx")
    x, norm = torch.randn(M, K), torch.rand(K) + 0.5
    cos, sin = torch.rand(M, R // 2), torch.rand(M, R // 2)
    slots = torch.randperm(100)[:M]
    caches = [new_cache(layout, 2, 100, KV, D, torch.float32, torch.device("cpu"), quant) for _ in range(2)]
    normed, _ = torch.ops.pmx_cpu.skip_rms_norm(x, None, norm, 1e-5)
    want = lin(normed)
    qk = want.view(M, H + 2 * KV, D)[:, : H + KV, :R]
    torch.ops.pmx_cpu.rotary_(qk, cos, sin)
    kv = want.view(M, H + 2 * KV, D)[:, H:]
    torch.ops.pmx_cpu.kv_store_(caches[0][0], caches[0][1], layout, layer, kv[:, :KV], kv[:, KV:], slots)
    got = torch.ops.pmx_cpu.linear_f32_qkv(x, lin.packed, lin.out_features, norm, 1e-5, cos, sin, caches[1][0],
                                           caches[1][1], layout, layer, slots)
    assert torch.equal(got, want) and torch.equal(caches[1][0], caches[0][0])
    assert not quant or torch.equal(caches[1][1], caches[0][1])
    wide = new_cache(layout, 2, 100, H + KV, D, torch.float32, torch.device("cpu"), False)[0]  # (too many KV heads)
    with pytest.raises(RuntimeError, match="must be \\(heads \\+ 2 kv_heads\\) head_dim for the cache's"):
        torch.ops.pmx_cpu.linear_f32_qkv(x, lin.packed, lin.out_features, None, 0.0, cos, sin, wide, None, layout,
                                         layer, slots)
    with pytest.raises(RuntimeError, match="outside the cache's 100 rows"):
        torch.ops.pmx_cpu.linear_f32_qkv(x, lin.packed, lin.out_features, None, 0.0, cos, sin, caches[1][0],
                                         caches[1][1], layout, layer, slots + 100)


# (B, H, KV, D, N, window): MHA and GQA, head_dim with a tail past 16 lanes, one row, a sliding window inside and
# outside the history; one sequence with a long history is cut into parts that run in parallel and are merged; short
# heads and GQA of 4 query heads per KV head have their scores computed 16 positions at a time
@needs_ext
@pytest.mark.parametrize("int8", [False, True], ids=["f32_cache", "int8_cache"])
@pytest.mark.parametrize("layout", range(4))
@pytest.mark.parametrize("case", [(1, 12, 12, 64, 65, 0), (3, 16, 4, 64, 300, 0), (2, 8, 2, 72, 37, 16),
                                  (4, 4, 4, 128, 1, 0), (1, 6, 3, 64, 300, 100), (1, 8, 2, 64, 300, 0),
                                  (1, 4, 1, 32, 20, 64), (2, 8, 4, 16, 300, 0), (3, 8, 8, 16, 130, 50)])
def test_cpu_decode_attention_matches_attend_over_gathered_rows(layout, case, int8):
    """The CPU kernel that reads history rows in place (torch_ops.decode_attention_rows) against gathering them and
    the torch attention (torch_ops.kv_load + attend with the plan's mask): scattered rows, lengths that differ per
    sequence, row tables padded with rows that must never be read; float32 and int8 caches."""
    from runner.kernels import torch_ops
    B, H, KV, D, N, window = case
    g = torch.Generator().manual_seed(layout)
    cache = torch.randn(ref.cache_shape(layout, 3, 512, KV, D), generator=g)
    scale = None
    if int8:
        cache, scale = ref.quantize_int8(cache)
    q = torch.randn(B, H, D, generator=g)
    lens = torch.randint(1, N + 1, (B,), generator=g)
    lens[0] = N
    past = torch.arange(N)[None] >= lens[:, None]
    rows = torch.stack([torch.randperm(512, generator=g)[:N] for _ in range(B)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)  # up to 4 parts per sequence, whatever the machine has
        got = torch_ops.decode_attention_rows(q, cache, scale, layout, 1, rows.masked_fill(past, 10**9), lens,
                                              window or None)
    finally:
        torch.set_num_threads(threads)
    k, v = torch_ops.kv_load(cache, scale, layout, 1, rows, torch.float32)                # (B, N, KV, D)
    seen = ~past & (torch.arange(N)[None] >= lens[:, None] - window if window else True)
    want = torch_ops.attend(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), seen[:, None, None], False)[:, :, 0]
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()


@needs_ext
@pytest.mark.parametrize("int8", [False, True], ids=["f32_cache", "int8_cache"])
@pytest.mark.parametrize("h,kv,d,n", [(12, 12, 64, 24), (16, 4, 64, 40), (8, 2, 16, 9), (6, 3, 64, 63)],
                         ids=["mha", "gqa", "blocked_short_heads", "odd_kv"])
def test_cpu_decode_attention_shares_heads_out_to_the_bit(int8, h, kv, d, n):
    """A lone sequence whose history is too short to cut into parts has its KV heads shared out between the threads:
    each head's result is the bits one thread gives (and the torch attention's within float rounding)."""
    from runner.kernels import torch_ops
    g = torch.Generator().manual_seed(n)
    cache = torch.randn(ref.cache_shape(0, 2, 128, kv, d), generator=g)
    scale = None
    if int8:
        cache, scale = ref.quantize_int8(cache)
    q, rows, lens = torch.randn(1, h, d, generator=g), torch.randperm(128, generator=g)[None, :n], torch.tensor([n])
    threads = torch.get_num_threads()
    try:
        got = {}
        for t in (1, 2, 4):
            torch.set_num_threads(t)
            got[t] = torch_ops.decode_attention_rows(q, cache, scale, 0, 1, rows, lens, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[1], got[2]) and torch.equal(got[1], got[4])
    k, v = torch_ops.kv_load(cache, scale, 0, 1, rows, torch.float32)
    want = torch_ops.attend(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), None, False)[:, :, 0]
    assert (got[1] - want).abs().max() <= 2e-6 * want.abs().max()


@needs_ext
@pytest.mark.parametrize("paged", [False, True], ids=["offsets", "pages"])
@pytest.mark.parametrize("window", [0, 50])
def test_cpu_decode_attention_reads_rows_from_offsets_and_page_starts(paged, window):
    """Without a row table the kernel works each position's row out from the plan's cachestarts: an offset per
    sequence, or its page starts (pages out of order, a table padded past the pages in use); the same result as the
    row table of those positions, to the bit."""
    from runner.kernels import torch_ops
    P = ref.PAGE_SIZE
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(ref.cache_shape(0, 2, 8 * P, 2, 64), generator=g)
    lens = torch.tensor([300, 5, 129])
    q = torch.randn(3, 8, 64, generator=g)
    if paged:
        starts = torch.tensor([[5 * P, 0, 7 * P], [2 * P, 0, 0], [P, 6 * P, 0]])
        pos = torch.arange(300)
        table = starts.gather(1, (pos // P)[None].expand(3, -1)) + pos % P
        rows, page_size = starts, P
    else:
        starts = torch.tensor([600, 0, 310])
        table, rows, page_size = starts[:, None] + torch.arange(300), starts, 0
    table = table.masked_fill(torch.arange(300)[None] >= lens[:, None], 0)
    got = torch_ops.decode_attention_rows(q, cache, None, 0, 1, rows, lens, window or None, page_size)
    want = torch_ops.decode_attention_rows(q, cache, None, 0, 1, table, lens, window or None)
    assert torch.equal(got, want)


@needs_ext
@pytest.mark.parametrize("paged", [False, True], ids=["offsets", "pages"])
@pytest.mark.parametrize("window,int8,alibi", [(0, False, False), (40, True, False), (0, False, True)],
                         ids=["plain", "window_int8", "alibi"])
@pytest.mark.parametrize("kv,d", [(2, 32), (8, 64), (4, 16)], ids=["blocked_gqa", "dot_mha", "blocked_short_heads"])
def test_cpu_decode_attention_rows_of_one_sequence_attend_together(paged, window, int8, alibi, kv, d):
    """The rows of a verify step (one sequence's tokens at consecutive positions over one history, each seeing the
    positions up to its own) are attended as a group that reads each history row once: the same result as each row
    alone, to the bit where neither cuts the history into parts (one thread), within float rounding where they do;
    for heads whose scores are computed 16 positions at a time (short heads, or several query heads per KV head) and
    for those computed a dot product at a time."""
    from runner.kernels import torch_ops
    P = ref.PAGE_SIZE
    g = torch.Generator().manual_seed(11)
    cache = torch.randn(ref.cache_shape(0, 2, 8 * P, kv, d), generator=g)
    scale = None
    if int8:
        cache, scale = ref.quantize_int8(cache)
    # sequence A: 5 rows at 200..204; B: one row; C: 3 rows at 7..9; D: 2 rows whose positions are not consecutive
    lens = torch.tensor([201, 202, 203, 204, 205, 60, 8, 9, 10, 50, 52])
    seq = [0, 0, 0, 0, 0, 1, 2, 2, 2, 3, 3]
    if paged:
        starts = torch.tensor([[5 * P, 0], [2 * P, 0], [P, 0], [6 * P, 0]])[seq]
        page_size = P
    else:
        starts, page_size = torch.tensor([600, 300, 10, 400])[seq], 0
    q = torch.randn(len(seq), 8, d, generator=g)
    slopes = torch.rand(8, generator=g) if alibi else None
    threads = torch.get_num_threads()
    try:
        for n in (1, 4):
            torch.set_num_threads(n)
            got = torch_ops.decode_attention_rows(q, cache, scale, 0, 1, starts, lens, window or None, page_size,
                                                  slopes)
            alone = torch.cat([torch_ops.decode_attention_rows(q[i:i + 1], cache, scale, 0, 1, starts[i:i + 1],
                                                               lens[i:i + 1], window or None, page_size, slopes)
                               for i in range(len(seq))])
            if n == 1:
                assert torch.equal(got, alone)
            else:
                assert (got - alone).abs().max() <= 2e-6 * alone.abs().max()
    finally:
        torch.set_num_threads(threads)


@needs_ext
def test_cpu_decode_attention_refuses_bad_rows_and_lengths():
    from runner.kernels import torch_ops
    cache, q = torch.zeros(ref.cache_shape(0, 2, 16, 2, 16)), torch.zeros(1, 2, 16)
    with pytest.raises(RuntimeError, match="cache row 16 of sequence 0 is outside the cache's 16 rows"):
        torch_ops.decode_attention_rows(q, cache, None, 0, 0, torch.tensor([[0, 16]]), torch.tensor([2]), None)
    with pytest.raises(RuntimeError, match=r"kvlens\[0\] = 3 must be in \[1, 2\]"):
        torch_ops.decode_attention_rows(q, cache, None, 0, 0, torch.tensor([[0, 1]]), torch.tensor([3]), None)
    with pytest.raises(RuntimeError, match="cache row 16 of sequence 0 is outside"):  # offset 10 + 7 rows
        torch_ops.decode_attention_rows(q, cache, None, 0, 0, torch.tensor([10]), torch.tensor([7]), None)
    with pytest.raises(RuntimeError, match="cache row 16 of sequence 0 is outside"):  # 2nd page of 8 rows at 16
        torch_ops.decode_attention_rows(q, cache, None, 0, 0, torch.tensor([[0, 16]]), torch.tensor([10]), None, 8)
    with pytest.raises(RuntimeError, match="rows must be int64 with a contiguous last dim"):
        torch_ops.decode_attention_rows(q, cache, None, 0, 0, torch.tensor([0]), torch.tensor([2]), None, 8)


@needs_ext
@pytest.mark.parametrize("shape", [(512, 1024), (1, 768), (3, 5, 100), (7, 13)])
def test_cpu_skip_rms_norm_and_swiglu_match_the_spec(shape):
    """The eager CPU kernels of torch_ops (one pass each, cpu_step.cpp) against the reference: every row, widths with
    a tail past 16 lanes, with and without a residual; SwiGLU on the strided halves of a fused gate/up output."""
    from runner.kernels import torch_ops
    x, skip, w = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    for s in (None, skip):
        y, r = torch_ops.skip_rms_norm(x, s, w, 1e-5)
        y0, r0 = ref.skip_rms_norm(x, s, w, 1e-5)
        assert torch.equal(r, r0) and (s is not None or r is x)
        assert (y - y0).abs().max() <= 2e-6 * y0.abs().max()
    fused = torch.randn(*shape[:-1], 2 * shape[-1]) * 6                # gate | up, as the fused GEMM leaves them
    gate, up = fused.split(shape[-1], dim=-1)
    want = ref.swiglu(gate, up)
    assert (torch_ops.swiglu(gate, up) - want).abs().max() <= 1e-6 * want.abs().max()
    assert torch.equal(torch_ops.swiglu(gate.double(), up.double()), ref.swiglu(gate.double(), up.double()))
    want = ref.geglu(gate, up)  # GeGLU: gelu_tanh(g) = g sigmoid(2u) in the kernel
    assert (torch_ops.geglu(gate, up) - want).abs().max() <= 2e-6 * want.abs().max()
    y, w = torch_ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5)  # (a post norm: no residual)
    assert (y - w).abs().max() <= 2e-6 * w.abs().max()


@needs_ext
@pytest.mark.parametrize("int8", [False, True])
def test_cpu_decode_attention_soft_caps_the_scores(int8):
    """Gemma 2's cap c tanh(s / c) on the scores, in the C++ kernel (rows read in place) and in the torch attention
    (decode and prefill), against the reference over the same rows; with scores past the cap, so capping matters."""
    from runner.kernels import torch_ops
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(ref.cache_shape(2, 2, 256, 2, 32), generator=g)
    scale = None
    if int8:
        cache, scale = ref.quantize_int8(cache)
    q, lens = 3 * torch.randn(3, 4, 32, generator=g), torch.tensor([40, 7, 100])
    starts = torch.tensor([0, 50, 120])
    rows = starts[:, None] + torch.arange(100)
    k, v = ref.kv_load(cache, scale, 2, 1, rows, torch.float32)                                  # (B, N, KV, D)
    seen = (torch.arange(100)[None] < lens[:, None])[:, None, None]
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    want = ref.attend(q[:, :, None], k, v, seen, False, softcap=2.0)[:, :, 0]
    got = torch_ops.decode_attention_rows(q, cache, scale, 2, 1, starts, lens, None, softcap=2.0)
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()
    assert (got - ref.attend(q[:, :, None], k, v, seen, False)[:, :, 0]).abs().max() > 1e-2 * want.abs().max()
    assert (torch_ops.attend(q[:, :, None], k, v, seen, False, softcap=2.0)[:, :, 0] - want).abs().max() <= \
        2e-6 * want.abs().max()
    qs = 3 * torch.randn(3, 4, 5, 32, generator=g)  # prefill: 5 queries over 5 keys, causal
    want = ref.attend(qs, k[:, :, :5], v[:, :, :5], None, True, softcap=2.0)
    assert (torch_ops.attend(qs, k[:, :, :5], v[:, :, :5], None, True, softcap=2.0) - want).abs().max() <= \
        2e-6 * want.abs().max()
