"""CUDA graphs of the decode step (runner.engine.graphs): buckets, the static inputs a graph reads and their
padding, on any device; the capture and replay themselves on CUDA only."""

from __future__ import annotations

import pytest
import torch

from runner.engine.cache import KVCache
from runner.engine.graphs import StaticDecodeInputs, bucket_of
from runner.engine.model import EngineOptions, Transformer, load_shard
from runner.engine.plan import make_plan
from runner.kernels import reference as ref
from runner.parallel.comm import SingleComm
from runner.pmx.convert import convert

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device (torch.cuda.is_available() is False)")
PAGE = ref.PAGE_SIZE


def test_buckets_are_powers_of_two():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 200, 256, 257)] == [1, 2, 4, 4, 8, 8, 16, 256, 256, 512]
    with pytest.raises(ValueError):
        bucket_of(0)


def _decode_plan(kvlens, caches, paged, D=8):
    rotary = ref.Rotary(D, 10000.0, None, 4096, torch.device("cpu"))
    return make_plan([1] * len(kvlens), [n - 1 for n in kvlens], caches, len(kvlens), paged=paged, rotary=rotary,
                     device=torch.device("cpu"))


@pytest.mark.parametrize("paged", [False, True])
def test_static_inputs_hold_the_plan_and_pad_the_bucket(paged):
    """The first B rows are the step's, the rest padding (token 0, slot -1, no history); a smaller batch loaded
    after a larger one re-pads the rows it leaves."""
    caches3 = [[PAGE, 0], [0], [3 * PAGE]] if paged else [0, 300, 700]
    plan3 = _decode_plan([130, 5, 17], caches3, paged)
    inputs = StaticDecodeInputs(4, 4, 3 if paged else None, torch.device("cpu"))
    assert inputs.plan.decode_only and inputs.plan.decode.kv_slots is None and inputs.plan.decode.batch == 4
    tokens3 = torch.tensor([7, 8, 9])
    inputs.load(tokens3, plan3)
    assert inputs.tokens.tolist() == [7, 8, 9, 0]
    assert inputs.slots.tolist() == plan3.slots.tolist() + [-1]
    assert inputs.kvlens.tolist() == [130, 5, 17, 0]
    assert torch.equal(inputs.cos[:3], plan3.cos) and torch.equal(inputs.sin[:3], plan3.sin)
    assert not inputs.cos[3:].any() and not inputs.sin[3:].any()
    if paged:
        assert inputs.cachestarts.tolist() == [[PAGE, 0, 0], [0, 0, 0], [3 * PAGE, 0, 0], [0, 0, 0]]
    else:
        assert inputs.cachestarts.tolist() == [0, 300, 700, 0]
    plan1 = _decode_plan([9], [[2 * PAGE]] if paged else [40], paged)
    inputs.load(torch.tensor([5]), plan1)
    assert inputs.tokens.tolist() == [5, 0, 0, 0] and inputs.slots.tolist()[1:] == [-1, -1, -1]
    assert inputs.kvlens.tolist() == [9, 0, 0, 0]
    assert inputs.cachestarts.tolist() == ([[2 * PAGE, 0, 0]] + [[0, 0, 0]] * 3 if paged else [40, 0, 0, 0])


@pytest.mark.parametrize("paged", [False, True])
def test_staged_inputs_equal_the_loaded_plan(paged):
    """stage() (the step's ints written with numpy, two copies) fills the buffers exactly as load() of make_plan's
    plan, padding included, after a larger step; it refuses a batch past the bucket, a wider page table and a
    position past the rotary tables."""
    D = 8
    rotary = ref.Rotary(D, 10000.0, None, 4096, torch.device("cpu"))
    tables = (rotary.cos_table.numpy(), rotary.sin_table.numpy())
    staged = StaticDecodeInputs(4, D // 2, 3 if paged else None, torch.device("cpu"))
    loaded = StaticDecodeInputs(4, D // 2, 3 if paged else None, torch.device("cpu"))
    steps = [([7, 8, 9, 4], [130, 5, 17, 300], [[PAGE, 0], [0], [3 * PAGE], [4 * PAGE, 5 * PAGE, 6 * PAGE]]
              if paged else [0, 300, 700, 1000]),
             ([5, 6], [9, 200], [[2 * PAGE], [PAGE, 0]] if paged else [40, 900])]
    for tokens, kvlens, caches in steps:
        plan = _decode_plan(kvlens, caches, paged, D)
        loaded.load(torch.tensor(tokens), plan)
        assert staged.stage(tokens, [n - 1 for n in kvlens], caches, *tables) and staged.staged == len(tokens)
        for name in ("tokens", "slots", "kvlens", "cachestarts", "cos", "sin"):
            assert torch.equal(getattr(staged, name), getattr(loaded, name)), name
    assert not staged.stage([1] * 5, [3] * 5, [[0]] * 5 if paged else [0] * 5, *tables)
    assert not staged.stage([1], [tables[0].shape[0]], [[0]] if paged else [0], *tables)
    if paged:
        assert not staged.stage([1], [3], [[0, PAGE, 2 * PAGE, 3 * PAGE]], *tables)


def test_static_inputs_refuse_what_does_not_fit():
    inputs = StaticDecodeInputs(2, 4, 1, torch.device("cpu"))
    big = _decode_plan([3, 3, 3], [[0], [PAGE], [2 * PAGE]], True)
    wide = _decode_plan([200], [[0, PAGE]], True)                         # two pages, the table holds one
    prefill = make_plan([4], [0], [[0]], 0, paged=True, rotary=ref.Rotary(8, 1e4, None, 64, torch.device("cpu")),
                        device=torch.device("cpu"))
    for tokens, plan in ((torch.tensor([1, 2, 3]), big), (torch.tensor([1]), wide), (torch.tensor([1] * 4), prefill)):
        assert not inputs.fits(tokens, plan)
        with pytest.raises(ValueError, match="does not fit"):
            inputs.load(tokens, plan)


def _engine(pmx, device="cpu", dtype=torch.float32, **options):
    params, w = load_shard(pmx, 0, torch.device(device), dtype)
    return Transformer(params, w, SingleComm(), EngineOptions(kernels="triton", **options))


def test_padded_decode_step_matches_the_step(make_hf, tmp_path):
    """The graph's body on the bucket's static inputs (3 sequences padded to 4), run eagerly on the Triton kernels
    (interpreter on CPU): the logits of the real rows as the plain step's, and the padding row writes nothing."""
    pytest.importorskip("runner.kernels.triton_ops", reason="triton is not installed")
    src, model = make_hf("qwen2")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    eng = _engine(tmp_path / "pmx", "cuda" if CUDA else "cpu", cache_layout=2, cache_mode=1, cuda_graphs=False)
    assert eng._graphs is None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (5, 1, 9)]
    caches = [[2 * PAGE], [0], [PAGE]]
    kv, _ = eng.new_cache(3 * PAGE)
    eng.step(torch.tensor([t for p in prompts for t in p]),
             eng.plan([len(p) for p in prompts], [0, 0, 0], caches, 0), kv, None)
    tokens = torch.tensor([11, 12, 13])
    plan = eng.plan([1, 1, 1], [len(p) for p in prompts], caches, 3)
    before, kv_step = kv.clone(), kv.clone()
    want = eng.step(tokens, plan, kv_step, None)
    inputs = StaticDecodeInputs(4, eng.head_dim // 2, 4, eng.device)
    inputs.load(tokens, plan)
    got = eng._run(inputs.tokens, inputs.plan, KVCache(kv, None, 2, eng.ops))
    assert got.shape[0] == 4 and torch.isfinite(got).all()
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv, kv_step, rtol=1e-6, atol=1e-6)
    new_rows = plan.slots.tolist()
    untouched = torch.ones(kv.shape[2], dtype=torch.bool, device=kv.device)
    untouched[new_rows] = False
    assert torch.equal(kv[:, :, untouched], before[:, :, untouched])   # (L, 2, MaxT, KV, D): nothing else written
    assert not torch.equal(kv[:, :, new_rows], before[:, :, new_rows])


def test_cuda_graphs_flag():
    assert EngineOptions().cuda_graphs is True and EngineOptions(cuda_graphs=False).cuda_graphs is False
    from runner.args import help_text
    from runner.engine.demo import generate
    assert "--cuda_graphs" in help_text(generate, "generate")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("options", [dict(cache_layout=0), dict(cache_layout=3, cache_mode=1, quantized_cache=True)])
def test_cuda_graphs_replay_matches_eager(make_hf, tmp_path, dtype, options):
    """Decode steps replayed from CUDA graphs give the eager step's logits, for the buckets a batch passes through."""
    from test_engine import prompts_and_conts
    from tp_worker import teacher_forced_logits
    src, model = make_hf("llama_mha")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    eager = _engine(tmp_path / "pmx", "cuda", dtype, cuda_graphs=False, **options)
    graphed = _engine(tmp_path / "pmx", "cuda", dtype, **options)
    assert eager._graphs is None and graphed._graphs is not None
    for batch in (3, 1):                                                       # buckets 4 and 1
        want = torch.stack(teacher_forced_logits(eager, prompts[:batch], conts[:batch]))
        got = torch.stack(teacher_forced_logits(graphed, prompts[:batch], conts[:batch]))
        assert graphed._graphs.buckets == [bucket_of(batch)]
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@needs_cuda
def test_cuda_graphs_generation_as_eager(make_hf, tmp_path):
    """Greedy generation with 3 prompts and room for 2 (the third joins when the first two finish): decode steps
    in buckets 2 and 1, the same tokens as eager."""
    from runner.engine.generator import Generator
    src, model = make_hf("llama_mha")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts = [[5, 6, 7], [9] * 11, [3, 4]]
    outs = []
    for graphs in (False, True):
        eng = _engine(tmp_path / "pmx", "cuda", torch.float16, cuda_graphs=graphs)
        outs.append(Generator(eng, max_batch=2).generate(prompts, 12))
        if graphs:
            assert set(eng._graphs.buckets) <= {1, 2} and eng._graphs.buckets
    assert outs[0] == outs[1]
