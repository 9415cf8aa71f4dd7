"""CUDA graphs of the decode step (runner.engine.graphs): buckets, the persistent inputs a graph reads and their
padding (runner.engine.plan.DecodeInputs), on any device; the capture and replay themselves on CUDA only."""

from __future__ import annotations

import pytest
import torch

from runner.config import EngineConfig
from runner.engine.graphs import CudaGraphs, bucket_of
from runner.engine.plan import DecodeInputs, PlanSpec, StepLengths, make_plan
from runner.kernels import reference as ref
from runner.pmx.convert import convert
from test_engine import core, engine

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device (torch.cuda.is_available() is False)")
PAGE = ref.PAGE_SIZE


def test_buckets_are_powers_of_two():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 200, 256, 257)] == [1, 2, 4, 4, 8, 8, 16, 256, 256, 512]
    with pytest.raises(ValueError):
        bucket_of(0)


def _spec(paged: bool, max_pos: int = 3 * PAGE, D: int = 8) -> PlanSpec:
    return PlanSpec((ref.Rotary(D, 10000.0, None, max_pos, torch.device("cpu")),), torch.device("cpu"), paged, (0,),
                    packed=False, read_cache_in_prefill=False, gather_prefill=False, gather_decode=False)


def _decode(kvlens, caches, tokens=None) -> StepLengths:
    return StepLengths(tokens or [7] * len(kvlens), [1] * len(kvlens), [n - 1 for n in kvlens], caches, len(kvlens))


@pytest.mark.parametrize("paged", [False, True])
def test_bucket_inputs_hold_the_plan_and_pad_the_bucket(paged):
    """A decode step written into its bucket's buffers: the first B rows are make_plan's plan of the step, the rest
    padding (token 0, slot -1, no history); a smaller batch of the same bucket re-pads the rows it leaves."""
    spec = _spec(paged)
    inputs = DecodeInputs(spec, bucket_of)
    caches3 = [[PAGE, 0], [0], [2 * PAGE]] if paged else [0, 300, 700]
    tokens, plan = inputs.write([7, 8, 9], [129, 4, 16], caches3)
    want = make_plan(_decode([130, 5, 17], caches3, [7, 8, 9]), spec)
    buf = inputs.owner(plan)
    assert buf.size == 4 and tokens.tolist() == [7, 8, 9] and buf.tokens.tolist() == [7, 8, 9, 0]
    assert plan.decode_only and plan.decode.kv_slots is None and plan.decode.batch == 4
    assert plan.slots.tolist() == want.slots.tolist() + [-1] and plan.decode.kvlens.tolist() == [130, 5, 17, 0]
    assert torch.equal(plan.cos[:, :3], want.cos) and torch.equal(plan.sin[:, :3], want.sin)
    assert not plan.cos[:, 3:].any() and not plan.sin[:, 3:].any()
    if paged:
        assert plan.decode.cachestarts.tolist() == [[PAGE, 0, 0], [0, 0, 0], [2 * PAGE, 0, 0], [0, 0, 0]]
    else:
        assert plan.decode.cachestarts.tolist() == [0, 300, 700, 0]
    _, again = inputs.write([5, 6, 7, 8], [8, 8, 8, 8], [[0]] * 4 if paged else [0, 10, 20, 30])
    _, plan2 = inputs.write([5, 6, 7], [8, 8, 8], [[2 * PAGE]] * 3 if paged else [40, 50, 60])
    assert again is plan2 is plan and buf.tokens.tolist() == [5, 6, 7, 0] and plan.slots.tolist()[3] == -1
    assert plan.decode.kvlens.tolist() == [9, 9, 9, 0]
    _, one = inputs.write([1], [3], [[0]] if paged else [0])
    assert inputs.owner(one).size == 1 and one is not plan


def test_bucket_inputs_refuse_what_does_not_fit():
    """A page table wider than the model's positions and a position past the rotary tables are planned in full."""
    inputs = DecodeInputs(_spec(True, max_pos=PAGE))                        # one page per sequence
    assert inputs.write([1], [3], [[0, PAGE]]) is None
    assert inputs.write([1], [PAGE], [[0]]) is None
    assert inputs.write([1], [3], [[0]]) is not None


def test_padded_decode_step_matches_the_step(make_hf, tmp_path):
    """The graph's body on a bucket's inputs (3 sequences padded to 4), run eagerly on the Triton kernels (the
    interpreter on CPU): the logits of the real rows as the plain step's, and the padding row writes nothing."""
    pytest.importorskip("runner.kernels.triton_ops", reason="triton is not installed")
    src, model = make_hf("qwen2")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    eng = engine(tmp_path / "pmx", "cuda" if CUDA else "cpu", kernels="triton", cache_layout=2, cache_mode=1,
                 cuda_graphs=False)
    assert not any(isinstance(r, CudaGraphs) for r in eng.runners)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (5, 1, 9)]
    caches = [[2 * PAGE], [0], [PAGE]]
    cache = eng.cache(*eng.model.new_cache(3 * PAGE))
    eng.run(*eng.plan(StepLengths([t for p in prompts for t in p], [len(p) for p in prompts], [0, 0, 0], caches, 0)),
            cache)
    step = StepLengths([11, 12, 13], [1, 1, 1], [len(p) for p in prompts], caches, 3)
    kv = cache.data
    before, kv_step = kv.clone(), kv.clone()
    want = eng.run(*eng.plan(step), eng.cache(kv_step, None))
    tokens, plan = DecodeInputs(eng.spec, bucket_of).write(step.tokens, step.start, step.caches)
    got = eng.model(torch.tensor([11, 12, 13, 0], device=tokens.device), plan, cache)  # (the bucket's 4 rows)
    assert got.shape[0] == 4 and torch.isfinite(got).all()
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv, kv_step, rtol=1e-6, atol=1e-6)
    new_rows = plan.slots[:3].tolist()
    untouched = torch.ones(kv.shape[2], dtype=torch.bool, device=kv.device)
    untouched[new_rows] = False
    assert torch.equal(kv[:, :, untouched], before[:, :, untouched])   # (L, 2, MaxT, KV, D): nothing else written
    assert not torch.equal(kv[:, :, new_rows], before[:, :, new_rows])


def test_cuda_graphs_flag():
    assert EngineConfig().cuda_graphs is True and EngineConfig(cuda_graphs=False).cuda_graphs is False
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
    eager = engine(tmp_path / "pmx", "cuda", dtype, cuda_graphs=False, **options)
    graphed = engine(tmp_path / "pmx", "cuda", dtype, **options)
    graphs = graphed.runners[0]
    assert isinstance(graphs, CudaGraphs) and not any(isinstance(r, CudaGraphs) for r in eager.runners)
    for batch in (3, 1):                                                       # buckets 4 and 1
        want = torch.stack(teacher_forced_logits(eager, prompts[:batch], conts[:batch]))
        got = torch.stack(teacher_forced_logits(graphed, prompts[:batch], conts[:batch]))
        assert graphs.buckets == [bucket_of(batch)]
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@needs_cuda
def test_cuda_graphs_generation_as_eager(make_hf, tmp_path):
    """Greedy generation with 3 prompts and room for 2 (the third joins when the first two finish): decode steps
    in buckets 2 and 1, the same tokens as eager."""
    src, model = make_hf("llama_mha")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts = [[5, 6, 7], [9] * 11, [3, 4]]
    outs = []
    for graphs in (False, True):
        eng = core(tmp_path / "pmx", device="cuda", dtype=torch.float16, cuda_graphs=graphs, max_batch=2)
        outs.append(eng.generate(prompts, 12))
        if graphs:
            buckets = eng.stepper.runners[0].buckets
            assert set(buckets) <= {1, 2} and buckets
    assert outs[0] == outs[1]
