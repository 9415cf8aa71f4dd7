"""Triton kernels against the torch reference over odd shapes x dtypes (per-dtype tolerances).

On CPU they run under the Triton interpreter (conftest sets TRITON_INTERPRET=1), with small shapes;
on a GPU the same tests run compiled, with the larger shapes too."""

from __future__ import annotations

import math

import pytest
import torch

triton_ops = pytest.importorskip("runner.kernels.triton_ops", reason="triton is not installed")
from runner.kernels import reference as ref  # noqa: E402
from matrix import pairwise  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def close(got, want, dtype, scale=1.0, rounded=None):
    """got within TOL (x scale) of want; `rounded`: a float32 value that both sides rounded to `dtype` on the way (a
    product before its residual was added), whose rounding may differ by an ulp of its own magnitude either way."""
    tol = TOL[dtype] * scale
    if rounded is None:
        return torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    err, bound = (got.float() - want.float()).abs(), tol + tol * want.float().abs() + \
        2 * torch.finfo(dtype).eps * rounded.float().abs()
    assert (err <= bound).all(), f"{int((err > bound).sum())} of {err.numel()} off: worst {(err - bound).max().item()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,D", [(1, 8), (5, 37), (3, 130)] + ([(64, 4096)] if CUDA else []))
def test_skip_rms_norm(dtype, rows, D):
    x, skip = torch.randn(rows, D, device=DEV, dtype=dtype), torch.randn(rows, D, device=DEV, dtype=dtype)
    w = (torch.randn(D, device=DEV) * 0.5 + 1).to(dtype)
    y, r = triton_ops.skip_rms_norm(x, skip, w, 1e-5)
    y_ref, r_ref = ref.skip_rms_norm(x, skip, w, 1e-5)
    if dtype == torch.bfloat16 and not CUDA:  # the interpreter truncates to bf16 where GPUs round to nearest
        close(r, r_ref, dtype)
    else:
        assert torch.equal(r, r_ref)
    close(y, y_ref, dtype, scale=4)
    y0, r0 = triton_ops.skip_rms_norm(x, None, w, 1e-6)
    assert r0 is x
    close(y0, ref.rms_norm(x, w, 1e-6), dtype, scale=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,heads,D", [(1, 1, 2), (7, 3, 12), (4, 5, 64)] + ([(300, 32, 128)] if CUDA else []))
def test_rotary_in_place_on_strided_q_and_k(dtype, T, heads, D):
    qkv = torch.randn(T, (heads + 2) * D, device=DEV, dtype=dtype)  # q (heads) and k (2 heads) share rows
    q, k = qkv[:, : heads * D].view(T, heads, D), qkv[:, heads * D:].view(T, 2, D)
    want_q, want_k = (ref.apply_rotary(t.clone(), *_cos_sin(T, D)) for t in (q, k))
    cos, sin = _cos_sin(T, D)
    assert triton_ops.apply_rotary(q, cos, sin) is q and triton_ops.apply_rotary(k, cos, sin) is k
    close(q, want_q, dtype)
    close(k, want_k, dtype)


def _cos_sin(T, D):
    pos = torch.arange(T, device=DEV) * 7 + 3
    return ref.rope_cos_sin(pos, ref.rope_inv_freq(D, 1e4).to(DEV))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,F", [(1, 3), (6, 50), (2, 1500)])
def test_swiglu_on_fused_halves(dtype, rows, F):
    gate_up = torch.randn(rows, 2 * F, device=DEV, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)  # views with row stride 2F, as the fused GEMM leaves them
    close(triton_ops.swiglu(gate, up), ref.swiglu(gate, up), dtype, scale=2)
    close(triton_ops.geglu(gate, up), ref.geglu(gate, up), dtype, scale=2)  # GeGLU: the kernel with GELU's tanh


def _cache(layout, layers, rows, kv, D, quant, dtype):
    shape = ref.cache_shape(layout, layers, rows, kv, D)
    if not quant:
        return torch.zeros(shape, device=DEV, dtype=dtype), None
    return (torch.zeros(shape, device=DEV, dtype=torch.int8),
            torch.zeros(ref.cache_shape(layout, layers, rows, kv, D // 8), device=DEV, dtype=torch.float16))


@pytest.mark.parametrize("layout,quant,dtype", pairwise(range(4), (False, True), DTYPES, full=CUDA))
def test_kv_store_every_layout(layout, quant, dtype):
    T, KV, D, rows = 5, 3, 16, 40
    k, v = torch.randn(T, KV, D, device=DEV, dtype=dtype) * 3, torch.randn(T, KV, D, device=DEV, dtype=dtype)
    k[0, 0, :8] = 0  # an all-zero group
    slots = torch.tensor([3, 17, 0, 39, 21], device=DEV)
    got, got_s = _cache(layout, 2, rows, KV, D, quant, dtype)
    want, want_s = _cache(layout, 2, rows, KV, D, quant, dtype)
    triton_ops.kv_store(got, got_s, layout, 1, k, v, slots)
    ref.kv_store(want, want_s, layout, 1, k, v, slots)
    if quant:
        assert (got.int() - want.int()).abs().max() <= 1  # a division rounding at a .5 boundary at most
        assert (got != want).float().mean() < 0.01
        torch.testing.assert_close(got_s, want_s, rtol=1e-3, atol=0)
    else:
        assert torch.equal(got, want)


def _filled_cache(mode, quant, dtype, KV, D, kvlens, layout=2):
    """A cache holding random histories of lengths kvlens (stored by the reference), offset (mode 0) or paged
    (mode 1, pages out of order, a sequence over two pages); returns cache, scale, cachestarts and the
    histories as the reference reads them back."""
    if mode == 0:
        starts = torch.tensor([0] + kvlens[:-1], device=DEV).cumsum(0)
        rows = sum(kvlens) + 1
    else:
        pages = [-(-n // ref.PAGE_SIZE) for n in kvlens]
        nxt, table = 0, []
        for cnt in pages:
            table.append(list(range(nxt + (cnt - 1) * ref.PAGE_SIZE, nxt - 1, -ref.PAGE_SIZE)))
            nxt += max(cnt, 1) * ref.PAGE_SIZE
        maxp = max(len(t) for t in table)
        starts = torch.tensor([t + [0] * (maxp - len(t)) for t in table], device=DEV)
        rows = nxt
    cache, scale = _cache(layout, 1, rows, KV, D, quant, dtype)
    kv_all = []
    for b, n in enumerate(kvlens):  # fill each sequence's history through the reference store
        pos = torch.arange(n, device=DEV)
        slots = ref.token_slots(starts, pos, torch.full_like(pos, b), mode)
        k, v = torch.randn(n, KV, D, device=DEV, dtype=dtype), torch.randn(n, KV, D, device=DEV, dtype=dtype)
        ref.kv_store(cache, scale, layout, 0, k, v, slots)
        kv_all.append(ref.kv_load(cache, scale, layout, 0, slots, dtype))
    return cache, scale, starts, kv_all


def _packed_reference(q, kv_all, seqlens, kvlens, window, alibi=None, softcap=0.0):
    kh, vh = torch.cat([k for k, _ in kv_all]), torch.cat([v for _, v in kv_all])
    seqstarts = torch.tensor([0] + seqlens, device=DEV).cumsum(0)
    kvstarts = torch.tensor([0] + kvlens, device=DEV).cumsum(0)
    start = torch.tensor(kvlens, device=DEV) - torch.tensor(seqlens, device=DEV)
    return ref.attention_packed(q, kh, vh, seqstarts, kvstarts, start, sliding_window=window, alibi=alibi,
                                softcap=softcap)


@pytest.mark.parametrize("mode,quant,dtype,H,KV,D,window", pairwise(
    [0, 1], [False, True], DTYPES, [(4, 2, 16, None), (6, 1, 24, 5), (3, 3, 8, None)], full=CUDA))
def test_decode_attention_matches_packed_reference(mode, quant, dtype, H, KV, D, window):
    """One program per (sequence, KV head, split) over the whole query group (tl.dot), 3 splits merged by the
    merge kernel."""
    torch.manual_seed(0)
    kvlens = [9, 1, 140, 33]  # one sequence spans two pages
    cache, scale, starts, kv_all = _filled_cache(mode, quant, dtype, KV, D, kvlens)
    q = torch.randn(len(kvlens), H, D, device=DEV, dtype=dtype)
    got = triton_ops.decode_attention(q, cache, scale, 2, 0, starts, torch.tensor(kvlens, device=DEV), mode,
                                      window, splits=ref.DecodeSplits(3))
    close(got, _packed_reference(q, kv_all, [1] * len(kvlens), kvlens, window), dtype, scale=2)


@pytest.mark.parametrize("mode,quant,dtype,H,KV,num_splits,window", pairwise(
    [0, 1], [False, True], DTYPES, [(6, 6, 3, None), (5, 1, 1, None), (8, 2, 2, 40)], full=CUDA))
def test_decode_attention_alibi(mode, quant, dtype, H, KV, num_splits, window):
    """ALiBi (Baichuan-13B): slope_h x (j - (kvlen - 1)) added to each score, the slopes of head counts that are and
    are not powers of two, split or not, with a sliding window too."""
    torch.manual_seed(3)
    D, kvlens = 16, [9, 1, 140, 33]
    cache, scale, starts, kv_all = _filled_cache(mode, quant, dtype, KV, D, kvlens)
    q = torch.randn(len(kvlens), H, D, device=DEV, dtype=dtype)
    slopes = torch.tensor(ref.alibi_slopes(H), device=DEV)
    got = triton_ops.decode_attention(q, cache, scale, 2, 0, starts, torch.tensor(kvlens, device=DEV), mode, window,
                                      splits=ref.DecodeSplits(num_splits), mods=ref.ScoreMods(slopes))
    want = _packed_reference(q, kv_all, [1] * len(kvlens), kvlens, window, slopes)
    close(got, want, dtype, scale=2)
    assert (want - _packed_reference(q, kv_all, [1] * len(kvlens), kvlens, window)).abs().max() > 0.1  # it matters


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_alibi(mode, quant, dtype):
    """ALiBi in the varlen flash kernel: each (token, head) row with its head's slope and its own position."""
    torch.manual_seed(4)
    H, KV, D, S, starts = 6, 3, 16, 20, [0, 100]
    kvlens = [p + S for p in starts]
    cache, scale, cstarts, kv_all = _filled_cache(mode, quant, dtype, KV, D, kvlens)
    q = torch.randn(len(starts) * S, H, D, device=DEV, dtype=dtype)
    slopes = torch.tensor(ref.alibi_slopes(H), device=DEV)
    got = triton_ops.prefill_attention(q, cache, scale, 2, 0, cstarts, torch.tensor(kvlens, device=DEV), mode, S,
                                       mods=ref.ScoreMods(slopes))
    close(got, _packed_reference(q, kv_all, [S] * len(starts), kvlens, None, slopes), dtype, scale=2)


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_and_prefill_attention_soft_cap(quant, dtype):
    """Gemma 2's soft cap c tanh(s / c) on the scores (in natural units, before the log2 ones the kernels run in), in
    the decode kernel (split, with a sliding window) and the prefill kernel (paged), over scores past the cap."""
    torch.manual_seed(5)
    H, KV, D, cap = 4, 2, 16, 1.5
    kvlens = [9, 70]
    cache, scale, starts, kv_all = _filled_cache(0, quant, dtype, KV, D, kvlens)
    q = 3 * torch.randn(len(kvlens), H, D, device=DEV, dtype=dtype)
    got = triton_ops.decode_attention(q, cache, scale, 2, 0, starts, torch.tensor(kvlens, device=DEV), 0, 40,
                                      splits=ref.DecodeSplits(2), mods=ref.ScoreMods(softcap=cap))
    want = _packed_reference(q, kv_all, [1, 1], kvlens, 40, softcap=cap)
    close(got, want, dtype, scale=2)
    assert (want - _packed_reference(q, kv_all, [1, 1], kvlens, 40)).abs().max() > 0.1  # it matters
    S = 6
    cache, scale, cstarts, kv_all = _filled_cache(1, quant, dtype, KV, D, [3 + S])
    q = 3 * torch.randn(S, H, D, device=DEV, dtype=dtype)
    got = triton_ops.prefill_attention(q, cache, scale, 2, 0, cstarts, torch.tensor([3 + S], device=DEV), 1, S,
                                       mods=ref.ScoreMods(softcap=cap))
    close(got, _packed_reference(q, kv_all, [S], [3 + S], None, softcap=cap), dtype, scale=2)


def test_alibi_slopes_are_baichuans():
    """The standard slopes (Press et al.), as modeling_baichuan.py's _get_interleave: a geometric series for a power
    of two; otherwise that of the power below, then every other slope of twice it (40 heads: Baichuan-13B)."""
    import seed_families
    for n in (1, 2, 6, 8, 12, 32, 40, 64):
        assert ref.alibi_slopes(n) == pytest.approx(seed_families.baichuan_slopes(n), rel=1e-12)
    assert ref.alibi_slopes(8) == pytest.approx([2 ** -(i + 1) for i in range(8)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,R", [(16, 8), (64, 32), (24, 8)])
def test_partial_rotary(dtype, D, R):
    """A partial rotary (ChatGLM: the first half of each head): the first R dims of q and k turn in interleaved
    pairs, the other D - R pass through bit for bit; the rotated k is what the cache gets."""
    T, H, KV, rows = 5, 4, 2, 40
    qkv = torch.randn(T, (H + 2 * KV) * D, device=DEV, dtype=dtype) * 3
    q, k, v = (t.view(T, -1, D) for t in qkv.split([H * D, KV * D, KV * D], dim=-1))
    pos = torch.arange(T, device=DEV) * 7 + 3
    cos, sin = ref.rope_cos_sin(pos, ref.rope_inv_freq(R, 1e4).to(DEV))       # [T, R / 2]
    want_q, want_k = ref.apply_rotary(q.clone(), cos, sin), ref.apply_rotary(k.clone(), cos, sin)
    assert torch.equal(want_q[..., R:], q[..., R:]) and not torch.equal(want_q[..., :R], q[..., :R])
    slots = torch.tensor([3, 17, 8, 39, 21], device=DEV)
    want_c, _ = _cache(1, 2, rows, KV, D, False, dtype)
    ref.kv_store(want_c, None, 1, 1, want_k, v, slots)
    got_c, _ = _cache(1, 2, rows, KV, D, False, dtype)
    q0, k0 = q.clone(), k.clone()
    triton_ops.rotary_kv_store(q, k, v, cos, sin, got_c, None, 1, 1, slots)
    close(q, want_q, dtype)
    close(k, want_k, dtype)
    assert torch.equal(q[..., R:], q0[..., R:]) and torch.equal(k[..., R:], k0[..., R:])
    close(got_c, want_c, dtype)
    x = q0.clone()
    assert triton_ops.apply_rotary(x, cos, sin) is x
    close(x, want_q, dtype)


@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_decode_attention_splits_and_padding_rows(num_splits):
    """Any split count gives the same result (one split: no merge kernel); a padding row (length 0, as a CUDA
    graph's bucket pads the batch) attends to nothing and gives zeros, not NaN."""
    torch.manual_seed(1)
    dtype, H, KV, D, kvlens = torch.float16, 8, 2, 32, [200, 3, 64]
    cache, scale, starts, kv_all = _filled_cache(1, True, dtype, KV, D, kvlens)
    q = torch.randn(len(kvlens) + 1, H, D, device=DEV, dtype=dtype)
    starts = torch.cat((starts, torch.zeros_like(starts[:1])))
    got = triton_ops.decode_attention(q, cache, scale, 2, 0, starts, torch.tensor(kvlens + [0], device=DEV), 1,
                                      splits=ref.DecodeSplits(num_splits))
    close(got[:-1], _packed_reference(q[:-1], kv_all, [1] * len(kvlens), kvlens, None), dtype, scale=2)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))


def test_decode_splits_fixed_per_batch():
    """The split count depends on the batch size (a CUDA graph bucket), the KV heads and the SMs only."""
    assert triton_ops.decode_splits(1, 32, 132) == 9         # Llama-2-7B on an H100: 32 x 9 programs
    assert triton_ops.decode_splits(1, 8, 132) == triton_ops.MAX_SPLITS
    assert triton_ops.decode_splits(64, 32, 132) == 1
    assert triton_ops.decode_splits(4, 8, triton_ops.sm_count(torch.device("cpu"))) == 1


@pytest.mark.parametrize("mode,quant,dtype,H,KV,D,window,S,starts", pairwise([0, 1], [False, True], DTYPES, [
    (4, 2, 16, None, 40, (0, 100)),   # 80 (token, head) rows: two row blocks; a chunk crossing a page
    (6, 1, 24, 5, 7, (3, 0)),         # sliding window
    (3, 3, 8, None, 3, (130, 1)),     # continued chunks
], full=CUDA))
def test_prefill_attention_matches_packed_reference(mode, quant, dtype, H, KV, D, window, S, starts):
    """The varlen flash kernel: n sequences of S new tokens (fresh or continuing) over their keys in the cache."""
    torch.manual_seed(2)
    kvlens = [p + S for p in starts]
    cache, scale, cstarts, kv_all = _filled_cache(mode, quant, dtype, KV, D, kvlens)
    q = torch.randn(len(starts) * S, H, D, device=DEV, dtype=dtype)
    got = triton_ops.prefill_attention(q, cache, scale, 2, 0, cstarts, torch.tensor(kvlens, device=DEV), mode, S,
                                       window)
    close(got, _packed_reference(q, kv_all, [S] * len(starts), kvlens, window), dtype, scale=2)


@pytest.mark.parametrize("layout,quant,dtype", pairwise(range(4), (False, True), DTYPES, full=CUDA))
def test_rotary_kv_store_one_launch(layout, quant, dtype):
    """q and k rotated in place in the fused qkv output, the rotated k and v written to the cache: the reference's
    apply_rotary then kv_store; a row with slot -1 (CUDA graph padding) is rotated but not stored."""
    T, H, KV, D, rows = 5, 4, 2, 16, 40
    qkv = torch.randn(T, (H + 2 * KV) * D, device=DEV, dtype=dtype) * 3
    q, k, v = (t.view(T, -1, D) for t in qkv.split([H * D, KV * D, KV * D], dim=-1))
    cos, sin = _cos_sin(T, D)
    slots = torch.tensor([3, 17, -1, 39, 21], device=DEV)
    want_q, want_k = ref.apply_rotary(q.clone(), cos, sin), ref.apply_rotary(k.clone(), cos, sin)
    want, want_s = _cache(layout, 2, rows, KV, D, quant, dtype)
    keep = slots >= 0
    ref.kv_store(want, want_s, layout, 1, want_k[keep], v[keep], slots[keep])
    got, got_s = _cache(layout, 2, rows, KV, D, quant, dtype)
    triton_ops.rotary_kv_store(q, k, v, cos, sin, got, got_s, layout, 1, slots)
    close(q, want_q, dtype)
    close(k, want_k, dtype)
    if quant:
        truncated = dtype == torch.bfloat16 and not CUDA  # the interpreter truncates the rotated k to bf16
        assert (got.int() - want.int()).abs().max() <= 1  # a division rounding at a .5 boundary at most
        assert (got != want).float().mean() < (0.5 if truncated else 0.01)
        torch.testing.assert_close(got_s, want_s, rtol=1e-2 if truncated else 1e-3, atol=0)
    else:
        close(got, want, dtype)


@pytest.mark.parametrize("dtype,N,K,blocks", [(dt, n, k, None) for dt in DTYPES for n, k in [(40, 300), (33, 512)]]
                         + [(DTYPES[1], 40, 300, triton_ops.decode_blocks_linear(16384, 300, None))]
                         + ([(dt, 4096, 11008, None) for dt in DTYPES] if CUDA else []))
def test_decode_linear_matches_torch(dtype, N, K, blocks):
    """decode_linear against the float32 product: plain, with a bias, and with SwiGLU taken from a fused gate/up
    input (rounded to the input dtype first, as the swiglu kernel's output is); K off the block size included;
    `blocks`: the wide-N tile (16 rows a program, which N >= 16384 takes) on a small N (its dtype paths are the
    narrow tile's)."""
    g, rows = torch.Generator().manual_seed(N * 1000 + K), triton_ops.DECODE_LINEAR_ROWS
    w = (torch.randn(N, K, generator=g) * 0.1).to(DEV, dtype)
    b = torch.randn(N, generator=g).to(DEV, dtype)
    for bias, swiglu in ((None, False), (b, False), (None, True), (b, True)):
        x = torch.randn(rows, 2 * K if swiglu else K, generator=g).to(DEV, dtype)
        a = x.float()
        if swiglu:
            gate, up = a.chunk(2, dim=-1)
            a = (torch.nn.functional.silu(gate) * up).to(dtype).float()
        want = a @ w.float().T + (0 if bias is None else bias.float())
        got = triton_ops.decode_linear(x, w, bias, swiglu=swiglu, blocks=blocks)
        assert got.dtype == dtype and got.shape == (rows, N)
        err = float((got.float() - want).abs().max() / want.abs().max())
        assert err < TOL[dtype], (bias is None, swiglu, err)
    with pytest.raises(ValueError, match=f"takes 1 row of {K} columns; got \\(2, {K}\\)"):
        triton_ops.decode_linear(torch.zeros(2, K, device=DEV, dtype=dtype), w)


def test_down_projection_takes_the_swiglu_input():
    """A row-parallel layer on the small-rows kernel takes the fused gate/up output with swiglu=True (one row);
    more rows, or no such kernel, and it refuses (the MLP activates first)."""
    from runner.kernels.linear import Linear
    from runner.parallel.comm import SingleComm
    from runner.parallel.layers import RowParallelLinear
    w = (torch.randn(24, 40) * 0.1).to(DEV, torch.float16)
    row = RowParallelLinear(w, torch.randn(24).to(DEV, torch.float16), SingleComm())
    gate_up = torch.randn(1, 80).to(DEV, torch.float16)
    assert not row.takes_swiglu(gate_up)
    with pytest.raises(ValueError, match="swiglu / norm / residual / rotary need a small-rows kernel"):
        row(gate_up, swiglu=True)
    row.linear.use_small_rows(triton_ops.decode_linear, triton_ops.DECODE_LINEAR_ROWS)
    assert row.takes_swiglu(gate_up) and not row.takes_swiglu(torch.randn(2, 80).to(DEV, torch.float16))
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up).half().float() @ w.float().T + row.bias.float()
    close(row(gate_up, swiglu=True).float(), want, torch.float16)
    with pytest.raises(ValueError, match="no plain weight"):
        Linear(torch.randn(256, 256), kernel="pmx").use_small_rows(triton_ops.decode_linear, 16)


@pytest.mark.parametrize("name", ["chatglm3", "baichuan2_13b", "qwen_logn"])
def test_engine_with_triton_kernels_runs_the_seed_families(tmp_path, name):
    """The engine on the Triton kernels with a partial rotary (ChatGLM3), ALiBi over the cache in prefill and decode
    (Baichuan-13B) and logn-scaled queries (Qwen) against the families' references; a prompt prefilled in chunks
    (the later chunks attend over the cache through the varlen flash kernel)."""
    import seed_families
    from runner.pmx.convert import convert
    from test_engine import engine, prompts_and_conts, rel_err, STEPS
    from tp_worker import teacher_forced_logits
    model = seed_families.build(name, tmp_path / "hf")
    convert(str(tmp_path / "hf"), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.vocab_size)
    conts = [c[:2] for c in conts]  # 2 decode steps (the flash-decoding kernel over a growing cache)
    want = model.logits(prompts, conts, 2)
    eng = engine(tmp_path / "pmx", DEV, kernels="triton", cache_layout=3, cache_mode=1, quantized_cache=False)
    assert eng.model.ops.name == "triton"
    got = torch.stack(teacher_forced_logits(eng, prompts, conts)).cpu()
    assert rel_err(got, want) < 1e-4, rel_err(got, want)
    from runner.engine.plan import StepLengths
    prompt, cache = prompts[2], eng.cache(*eng.model.new_cache(ref.PAGE_SIZE))   # 12 tokens in chunks of 5, 5, 2:
    for p0 in range(0, len(prompt), 5):                                         # the later ones over the cache
        chunk = prompt[p0:p0 + 5]
        tokens, plan = eng.plan(StepLengths(chunk, [len(chunk)], [p0], [[0]], 0))
        assert plan.prefill[0].plain_causal == (p0 == 0)
        last = eng.run(tokens, plan, cache)[0].cpu()
    assert rel_err(last, want[0, 2]) < 1e-4, rel_err(last, want[0, 2])


@pytest.mark.parametrize("arch,options,steps", [
    ("llama_gqa_odd", dict(cache_layout=3, cache_mode=1), 4),
    ("gemma2", dict(cache_layout=2, cache_mode=1), 2),  # soft caps, GeGLU, a windowed layer (5) and a full one
])
def test_engine_with_triton_kernels_matches_transformers(make_hf, tmp_path, arch, options, steps):
    """The whole engine on the Triton kernels (decode steps through the flash-decoding kernel)."""
    from runner.pmx.convert import convert
    from test_engine import engine, hf_logits, prompts_and_conts, rel_err
    from tp_worker import teacher_forced_logits
    src, model = make_hf(arch)
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    conts = [c[:steps] for c in conts]
    ref_logits = hf_logits(model, prompts, conts)[: steps + 1]
    eng = engine(tmp_path / "pmx", DEV, kernels="triton", **options)
    assert eng.model.ops.name == "triton" and eng.model.ops.decode_attention is triton_ops.decode_attention
    got = torch.stack(teacher_forced_logits(eng, prompts, conts)).cpu()
    assert rel_err(got, ref_logits) < 1e-4, (options, rel_err(got, ref_logits))


LOWP_TOL = {torch.float16: 1e-2, torch.bfloat16: 3e-2}  # max |logit error| / max |logit|, int8 cache included


@pytest.mark.parametrize("arch,options,dtype", [
    ("llama_mha", dict(cache_layout=1, cache_mode=1, quantized_cache=True), torch.float16),
    ("mistral_window", dict(cache_layout=3), torch.bfloat16),  # sliding window 5: windowed prefill and decode
])
def test_engine_half_precision_matches_transformers(make_hf, tmp_path, dtype, arch, options):
    """The engine in float16 / bfloat16 on the Triton kernels against transformers in float32 on the same weights:
    a packed prefill of 3 prompts, 3 decode steps, and a prompt prefilled in chunks (continued chunks attend over
    the cache through the varlen flash kernel). transformers itself in the same dtype is about as far off."""
    from runner.engine.plan import StepLengths
    from runner.pmx.convert import convert
    from test_engine import engine, hf_logits, prompts_and_conts, rel_err
    from tp_worker import teacher_forced_logits
    src, model = make_hf(arch)
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    conts = [c[:3] for c in conts]
    want = hf_logits(model, prompts, conts)                                  # (4, 3, V) float32
    eng = engine(tmp_path / "pmx", DEV, dtype, kernels="triton", **options)
    assert eng.model.ops.name == "triton" and eng.model.dtype == dtype
    got = torch.stack(teacher_forced_logits(eng, prompts, conts)).cpu()
    assert rel_err(got, want) < LOWP_TOL[dtype], rel_err(got, want)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= (1.0 if dtype == torch.float16 else 0.9)
    prompt = prompts[2]                                                      # 12 tokens in chunks of 5, 5, 2
    cache = eng.cache(*eng.model.new_cache(ref.PAGE_SIZE))
    for p0 in range(0, len(prompt), 5):
        chunk = prompt[p0:p0 + 5]
        tokens, plan = eng.plan(StepLengths(chunk, [len(chunk)], [p0], [[0]] if options.get("cache_mode") else [0], 0))
        assert plan.prefill[0].plain_causal == (p0 == 0 and not options.get("quantized_cache"))  # else: the cache
        last = eng.run(tokens, plan, cache)[0].cpu()
    assert rel_err(last, want[0, 2]) < LOWP_TOL[dtype], rel_err(last, want[0, 2])


def test_kernels_option():
    """The kernel sets declare what they have: the CPU torch set reads histories in place (float32 only), the Triton
    set walks the cache and fuses rotary with the cache store, the reference has none of the optional ops."""
    from runner.config import EngineConfig
    from runner.errors import PmxError
    from runner.kernels import torch_ops
    from runner.kernels.cpu_ext import cpu_ops
    from runner.kernels.sets import kernel_set
    cpu = torch.device("cpu")
    auto = kernel_set("auto", cpu, torch.float32)
    assert auto.name == "torch" and auto.attend is torch_ops.attend
    assert (auto.decode_attention_rows is not None) == (cpu_ops() is not None) and auto.decode_attention is None
    assert kernel_set("torch", cpu, torch.bfloat16).decode_attention_rows is None
    spec = kernel_set("reference", DEV, torch.float32)
    assert spec.attend is ref.attend and not spec.reads_history_in_place and spec.rotary_kv_store is None
    tri = kernel_set("triton", DEV, torch.float16)
    assert tri.decode_attention is triton_ops.decode_attention and tri.attend is torch_ops.attend
    assert tri.reads_history_in_place and tri.prefill_attention is not None
    with pytest.raises(PmxError, match="--kernels must be one of auto, triton, torch, reference"):
        EngineConfig(kernels="cuda")


# --- the decode-step fusions (runner.kernels.linear.SmallRows: norm, residual, rotary + cache store, quantised weights;
# the split merge inside decode attention) ---------------------------------------------------------------------------
def test_decode_linear_norm_in_and_residual_out():
    """norm=(g, eps): the product is of reference.rms_norm(x); residual: added to the rounded output (fused gate/up
    with SwiGLU too); the row's RMS comes from the loads of every program, so K off the block size is covered."""
    g_ = torch.Generator().manual_seed(5)
    shapes = [(torch.float16, (40, 300)), (torch.bfloat16, (24, 1030)), (torch.float32, (17, 64))]
    for dtype, (N, K) in shapes + ([(torch.float16, (22016, 4096)), (torch.bfloat16, (4096, 11008))] if CUDA else []):
        w = (torch.randn(N, K, generator=g_) * 0.1).to(DEV, dtype)
        x = (torch.randn(1, K, generator=g_) * 3).to(DEV, dtype)
        g = (torch.rand(K, generator=g_) + 0.5).to(DEV, dtype)
        res = torch.randn(1, N, generator=g_).to(DEV, dtype)
        got = triton_ops.decode_linear(x, w, None, norm=(g, 1e-5), residual=res)
        prod = ref.rms_norm(x, g, 1e-5).float() @ w.float().T  # (K = 11008 in bfloat16: |prod| ~ 10, an ulp 0.06)
        close(got, prod.to(dtype).float() + res.float(), dtype, scale=4, rounded=prod)
        gu = torch.randn(1, 2 * K, generator=g_).to(DEV, dtype)
        gate, up = gu.float().chunk(2, dim=-1)
        prod = (torch.nn.functional.silu(gate) * up).to(dtype).float() @ w.float().T
        close(triton_ops.decode_linear(gu, w, None, swiglu=True, residual=res), prod.to(dtype).float() + res.float(),
              dtype, scale=4, rounded=prod)


@pytest.mark.parametrize("method,group,offset", [("int8", 0, False), ("int8", 32, False), ("int4", 128, False),
                                                 ("int4", 32, True), ("int4", 1024, False)])
def test_decode_linear_streams_quantised_weights(method, group, offset):
    """int8 per channel or in groups, int4 in groups with or without offsets (GGUF's Q8_0 / Q4_1): the product of the
    dequantised weight (runner.pmx.quant's arithmetic), groups narrower than the kernel's tile and wider (1024)."""
    from runner.kernels.linear import QuantRows
    from runner.pmx.quant import quantize_int4, quantize_int8, unpack_int4
    g_ = torch.Generator().manual_seed(6)
    N, K = (4096, 11264 if group == 1024 else 11008) if CUDA else (24, 2048 if group == 1024 else 256)
    w = torch.randn(N, K, generator=g_) * 0.1
    if method == "int8" and not group:
        q, s = quantize_int8(w)
        deq, off = q.float() * s[:, None], None
    elif method == "int8":
        s = w.view(N, -1, group).abs().amax(-1) / 127
        q = torch.round(w.view(N, -1, group) / s[..., None]).clamp(-127, 127).to(torch.int8).view(N, K)
        deq, off = (q.float().view(N, -1, group) * s[..., None]).view(N, K), None
    else:
        q, s = quantize_int4(w, group)
        off = torch.randn(s.shape, generator=g_) * 0.01 if offset else None
        nib = unpack_int4(q).float().view(N, -1, group)
        deq = (nib * s[..., None] + off[..., None] if offset else (nib - 8) * s[..., None]).view(N, K)
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(1, K, generator=g_).to(DEV, dtype)
        quant = QuantRows(s.to(DEV), None if off is None else off.to(DEV), method, group)
        got = triton_ops.decode_linear(x, q.to(DEV), None, quant=quant)
        close(got, x.float() @ deq.to(DEV).T, dtype, scale=4)
    if offset:  # the norm and the residual around a quantised product
        g, res = (torch.rand(K, generator=g_) + 0.5).to(DEV, dtype), torch.randn(1, N, generator=g_).to(DEV, dtype)
        got = triton_ops.decode_linear(x, q.to(DEV), None, norm=(g, 1e-5), residual=res, quant=quant)
        want = (ref.rms_norm(x, g, 1e-5).float() @ deq.to(DEV).T).to(dtype).float() + res.float()
        close(got, want, dtype, scale=4)


@pytest.mark.parametrize("quant,layout,R", [(False, 0, 16), (True, 2, 16), (False, 3, 8), (True, 1, 8)])
def test_decode_linear_rotary_epilogue(quant, layout, R):
    """The qkv linear with its norm and bias, then rotary (a partial one too: R of 16 dims) and the K/V store as its
    epilogue: the output (q, k rotated; v) and the cache (float, or int8 in groups) as linear, then
    reference.apply_rotary and reference.kv_store; slot -1 (a CUDA graph's padding) stores nothing."""
    from runner.kernels.linear import RotaryStore
    g_ = torch.Generator().manual_seed(7)
    dtype, H, KV, D, K = torch.float16, 4, 2, 16, 48
    N = (H + 2 * KV) * D
    w, b = (torch.randn(N, K, generator=g_) * 0.3).to(DEV, dtype), torch.randn(N, generator=g_).to(DEV, dtype)
    x, g = torch.randn(1, K, generator=g_).to(DEV, dtype), (torch.rand(K, generator=g_) + 0.5).to(DEV, dtype)
    cos, sin = ref.rope_cos_sin(torch.tensor([5], device=DEV), ref.rope_inv_freq(R, 1e4).to(DEV))
    h = (ref.rms_norm(x, g, 1e-5).float() @ w.float().T + b.float()).to(dtype)
    q, k, v = (t.view(1, -1, D) for t in h.split([H * D, KV * D, KV * D], dim=-1))
    q, k = ref.apply_rotary(q.clone(), cos, sin), ref.apply_rotary(k.clone(), cos, sin)
    for slot in (7, -1):
        got_c, got_s = _cache(layout, 2, 20, KV, D, quant, dtype)
        want_c, want_s = _cache(layout, 2, 20, KV, D, quant, dtype)
        slots = torch.tensor([slot], device=DEV)
        got = triton_ops.decode_linear(x, w, b, norm=(g, 1e-5), rotary=RotaryStore(cos, sin, slots, got_c, got_s,
                                                                                   layout, 1, H, KV, D))
        close(got, torch.cat([t.reshape(1, -1) for t in (q, k, v)], dim=-1), dtype, scale=2)
        if slot < 0:
            assert not got_c.any()
            continue
        ref.kv_store(want_c, want_s, layout, 1, k, v, slots)
        if quant:
            assert (got_c.int() - want_c.int()).abs().max() <= 1 and got_c.count_nonzero() > 0
            torch.testing.assert_close(got_s, want_s, rtol=2e-3, atol=0)
        else:
            close(got_c, want_c, dtype, scale=2)


def test_decode_attention_merges_inside():
    """DecodeSplits' tickets: the last program of each (sequence, KV head) merges the splits (no merge kernel): the same
    output as the merge kernel's, and the counts left at zero for the next launch (a CUDA graph's replay)."""
    torch.manual_seed(8)
    dtype, H, KV, D, kvlens = torch.float16, 8, 2, 32, [200, 3, 64]
    cache, scale, starts, _ = _filled_cache(1, True, dtype, KV, D, kvlens)
    starts = torch.cat((starts, torch.zeros_like(starts[:1])))
    q, kl = torch.randn(4, H, D, device=DEV, dtype=dtype), torch.tensor(kvlens + [0], device=DEV)
    want = triton_ops.decode_attention(q, cache, scale, 2, 0, starts, kl, 1, splits=ref.DecodeSplits(5))
    counts = torch.zeros(4 * KV, dtype=torch.int32, device=DEV)
    for _ in range(3 if CUDA else 1):
        got = triton_ops.decode_attention(q, cache, scale, 2, 0, starts, kl, 1, splits=ref.DecodeSplits(5, counts))
        assert torch.equal(got, want) and not counts.any()
    if CUDA:  # the programs of a launch race for real here: 32 splits of a long history, the same bits every launch
        kvlens = [4000, 2500]
        cache, scale, starts, _ = _filled_cache(1, False, dtype, 8, 128, kvlens)
        q, kl = torch.randn(2, 32, 128, device=DEV, dtype=dtype), torch.tensor(kvlens, device=DEV)
        want = triton_ops.decode_attention(q, cache, scale, 2, 0, starts, kl, 1, splits=ref.DecodeSplits(32))
        counts = torch.zeros(2 * 8, dtype=torch.int32, device=DEV)
        first = triton_ops.decode_attention(q, cache, scale, 2, 0, starts, kl, 1, splits=ref.DecodeSplits(32, counts))
        close(first, want, dtype)
        for _ in range(50):
            assert torch.equal(triton_ops.decode_attention(q, cache, scale, 2, 0, starts, kl, 1,
                                                           splits=ref.DecodeSplits(32, counts)), first)
        assert not counts.any()


def test_engine_decode_fusions_match_transformers(make_hf, tmp_path):
    """Batch-1 decode steps with the norms inside the linears (each linear before a norm adding the residual), rotary
    + cache store as the qkv linear's epilogue (with its bias, into an int8 paged cache) and the split merge inside
    decode attention, against transformers; no norm kernel runs in a fused step, the split tickets are left at zero."""
    from runner.pmx.convert import convert
    from test_engine import engine, hf_logits, prompts_and_conts, rel_err
    from tp_worker import teacher_forced_logits
    src, model = make_hf("qwen2")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    prompts, conts = prompts[:1], [conts[0][:1]]                    # a prefill step, then one decode step
    want = hf_logits(model, prompts, conts)
    on = engine(tmp_path / "pmx", DEV, torch.float16, kernels="triton", prepack=False, cache_layout=3, cache_mode=1,
                quantized_cache=True)
    norms = []
    for layer in on.model.layers:
        layer.attention_norm.register_forward_hook(lambda *a: norms.append(1))
    got = torch.stack(teacher_forced_logits(on, prompts, conts)).cpu()
    assert len(norms) == on.model.params.num_layers          # the prefill step's only: the decode steps fused them
    assert not on.model.layers[0].attention.split_counts.any()
    assert rel_err(got, want) < LOWP_TOL[torch.float16], rel_err(got, want)


def test_row_parallel_residual_added_once():
    """A row-parallel layer's fused residual at TP 2: rank 0's kernel adds it to its partial sum, rank 1's does not, so
    the all-reduced sum (here added up by hand) is x W^T + b + residual once; unfused ranks add it after the
    all-reduce."""
    from runner.parallel.comm import SingleComm
    from runner.parallel.layers import RowParallelLinear

    class Rank(SingleComm):  # the all-reduce left to the test: each rank's own partial sum
        def __init__(self, rank):
            self.rank = rank
    g_ = torch.Generator().manual_seed(9)
    w, x = (torch.randn(24, 64, generator=g_) * 0.1).half(), torch.randn(1, 64, generator=g_).half()
    b, res = torch.randn(24, generator=g_).half(), torch.randn(1, 24, generator=g_).half()
    want = (x.float() @ w.float().T + b.float()).half().float() + res.float()
    parts = []
    for r in (0, 1):
        layer = RowParallelLinear(w[:, 32 * r: 32 * (r + 1)].contiguous().to(DEV), b.to(DEV), Rank(r))
        layer.linear.use_small_rows(triton_ops.decode_linear, triton_ops.DECODE_LINEAR_ROWS)
        parts.append(layer(x[:, 32 * r: 32 * (r + 1)].to(DEV), residual=res.to(DEV)).float())
    close(parts[0] + parts[1] - b.float().to(DEV), want.to(DEV), torch.float16, scale=4)   # (b: once, after)
    unfused = RowParallelLinear(w.to(DEV), b.to(DEV), Rank(0))
    close(unfused(x.to(DEV), residual=res.to(DEV)), want.to(DEV), torch.float16, scale=4)
