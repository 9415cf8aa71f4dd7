"""The step: host plan + device step; the compiled decode step; varlen prefill in mixed steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runner.config import EngineConfig
from runner.engine.model import Transformer, load_shard
from runner.engine.plan import DecodeInputs, PlanSpec, StepLengths, make_plan
from runner.engine.runners import Compiled, Stepper
from runner.errors import PmxError
from runner.kernels import linear as linear_mod
from runner.kernels.cpu_ext import cpu_ops
from runner.kernels.reference import PAGE_SIZE, Rotary
from runner.parallel.comm import SingleComm
from runner.pmx.convert import convert, reshard
from test_engine import engine, hf_logits, prompts_and_conts, rel_err, run_tp_batch
from tp_worker import teacher_forced_logits


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiles(stepper: Stepper) -> bool:
    return any(isinstance(r, Compiled) for r in stepper.runners)


@pytest.mark.parametrize("arch,options,linear", [
    ("llama_gqa_odd", dict(cache_layout=0), "pmx"),
    ("llama_bias", dict(cache_layout=1), "pmx"),
    ("qwen3", dict(cache_layout=3, cache_mode=1, quantized_cache=True), "plain"),
])
def test_compiled_decode_step_matches_eager_and_transformers(make_hf, tmp_path, monkeypatch, arch, options, linear):
    """Decode steps run under torch.compile(fullgraph=True) (a graph break would raise), with masked histories of
    different lengths (3 prompts), and (the first case) the single-sequence graph; logits as eager's and
    transformers'. `pmx`: every linear on this project's CPU kernel (the default for real models; these test models
    are under its size). (Each graph is a cold compile of ~15 s on a fresh machine: the cases share no graph.)"""
    if linear == "pmx":
        if cpu_ops() is None:
            pytest.skip("this project's CPU kernels cannot be built here (no compiler)")
        monkeypatch.setattr(linear_mod, "PREPACK_MIN_NUMEL", 0)
    src, model = make_hf(arch)
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    eager = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx", compile="off", **options), prompts, conts))
    compiled_engine = engine(tmp_path / "pmx", compile="on", fused_decode=False, **options)
    assert compiles(compiled_engine)
    assert {m.kernel for m in compiled_engine.model.modules() if isinstance(m, linear_mod.Linear)} == {linear}
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = torch.stack(teacher_forced_logits(compiled_engine, prompts, conts))
    assert rel_err(got, eager) < 1e-5
    if arch == "llama_gqa_odd":
        single = torch.stack(teacher_forced_logits(compiled_engine, prompts[:1], conts[:1]))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before >= 2  # B > 1 with a mask, and B = 1
        assert rel_err(single, eager[:, :1]) < 1e-5
    if not options.get("quantized_cache"):
        assert rel_err(got, hf_logits(model, prompts, conts)) < 1e-4


def test_compiled_engines_never_share_graphs(make_hf, tmp_path):
    """The compiled step keeps no guards on the module tree (they cost 0.5 ms a step), so each engine has a code
    object of its own: a second engine with the same shapes but another constant (norm eps) in the same process
    compiles its own graph and gets its own logits, not the first one's. (One sequence: one graph an engine.)"""
    src, model = make_hf("llama_gqa_odd")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    prompts, conts = prompts[:1], conts[:1]
    params, w = load_shard(tmp_path / "pmx", 0, torch.device("cpu"), torch.float32)
    logits = {}
    def stepper(p, **options):
        c = EngineConfig(**options)
        return Stepper(Transformer(p, dict(w), SingleComm(), c), c)

    for eps in (1e-5, 0.5):
        p = dataclasses.replace(params, norm_eps=eps)
        eager = torch.stack(teacher_forced_logits(stepper(p, compile="off"), prompts, conts))
        logits[eps] = torch.stack(teacher_forced_logits(stepper(p, compile="on", fused_decode=False), prompts, conts))
        assert rel_err(logits[eps], eager) < 1e-5
    assert rel_err(logits[0.5], logits[1e-5]) > 1e-3


def test_compiled_decode_step_tensor_parallel(make_hf, tmp_path, request):
    """TP=2 under mpirun: the shared-memory all-reduce / all-gather ops inside the compiled graph; logits as TP=1's.
    With --extended also mpi4py's (PMX_SHM_COMM=0, what ranks on different hosts take), the same bits both ways
    (a + b on 2 ranks): in the same launch, each way a session of its own (its communicator, its engine and compiled
    step), the second opened under PMX_SHM_COMM=0. (Each way is two cold compiles, one a rank, ~45 core-s on a fresh
    machine; mpi4py's collectives run in the eager step in test_multihost and test_comm.)"""
    src, model = make_hf("llama_gqa_odd")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    reshard(str(tmp_path / "pmx"), str(tmp_path / "pmx2"), 2, progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    tp1 = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx", compile="off"), prompts, conts))
    job = (tmp_path / "pmx2", [{"compile": "on", "fused_decode": False, "cache_layout": 1}], prompts, conts, None)
    both = request.config.getoption("--extended")
    runs = run_tp_batch(tmp_path, 2, [job, (*job, {"PMX_SHM_COMM": "0"})] if both else [job])
    got, info = runs[0]
    assert [i["shm"] for i in info] == [True]
    assert rel_err(got[0], tp1) < 1e-5
    if both:
        over_mpi, info_mpi = runs[1]
        assert [i["shm"] for i in info_mpi] == [False]
        assert torch.equal(over_mpi[0], got[0])


def test_the_compiled_step_is_made_on_the_first_step_it_takes(make_hf, tmp_path):
    """Where the one-call C++ step serves every decode step, the compiled runner stands behind it and never calls
    torch.compile; with the one-call step off, the first decode step makes it (here the eager model stands in for
    what torch.compile returns: the tests above compile)."""
    if cpu_ops() is None:
        pytest.skip("this project's CPU kernels cannot be built here (no compiler)")
    src, model = make_hf("llama_gqa_odd")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    prompts, conts = prompts[:1], [c[:2] for c in conts[:1]]
    for fused, made in ((True, False), (False, True)):
        stepper = engine(tmp_path / "pmx", compile="on", fused_decode=fused)
        (compiled,) = [r for r in stepper.runners if isinstance(r, Compiled)]
        compiled._compile = lambda: compiled.model
        assert compiled.fn is None
        teacher_forced_logits(stepper, prompts, conts)
        assert (compiled.fn is compiled.model) == made


def test_compile_auto_is_off_for_small_models(make_hf, tmp_path):
    src, _ = make_hf("llama_mha")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    assert not compiles(engine(tmp_path / "pmx"))
    with pytest.raises(PmxError, match="--compile must be one of auto, on, off"):
        EngineConfig(compile="yes")


def run_steps(model, steps, rows=256):
    """steps: [(seqlens, start_pos, caches, num_decoding, tokens)] through the ppl.pmx forward."""
    kv_cache, kv_scale = model.model.new_cache(rows)
    out = []
    for seqlens, start, caches, n_dec, tokens in steps:
        kvlens = [s + n for s, n in zip(start, seqlens)]
        out.append(model.forward(torch.tensor(tokens), torch.empty(0), torch.tensor([0] + seqlens).cumsum(0),
                                 torch.tensor([0] + kvlens).cumsum(0), torch.tensor(caches), torch.tensor([n_dec]),
                                 torch.tensor(start), torch.tensor([max(seqlens)]), torch.tensor([max(kvlens)]),
                                 kv_cache, kv_scale))
    return out


@pytest.mark.parametrize("arch", ["llama_gqa_odd", "mistral_window"])
def test_mixed_steps_match_the_reference(make_hf, tmp_path, arch):
    """Decoding sequences, fresh prompts of equal and unequal lengths and a continued chunk in one step, against
    the reference kernels on ppl.pmx's unfused path (each sequence alone), and against the same sequences run
    in steps of their own."""
    src, model = make_hf(arch)
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    g = torch.Generator().manual_seed(3)
    tok = lambda n: torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    A, B, C, D, E = tok(6), tok(3), tok(11), tok(6), tok(6)
    caches = [0, 40, 80, 120, 160]
    steps = [  # step 0: A, B and C's first chunk; step 1: A, B decode, C's second chunk, D and E fresh (equal)
        ([6, 3, 4], [0, 0, 0], caches[:3], 0, A + B + C[:4]),
        ([1, 1, 7, 6, 6], [6, 3, 4, 0, 0], caches, 2, tok(2) + C[4:] + D + E),
        ([1] * 5, [7, 4, 11, 6, 6], caches, 5, tok(5)),
    ]
    fast = run_steps(engine(tmp_path / "pmx"), steps)
    spec = run_steps(engine(tmp_path / "pmx", kernels="reference", fused_kvcache=False), steps)
    for a, b in zip(fast, spec):
        assert rel_err(a, b) < 1e-5
    alone = run_steps(engine(tmp_path / "pmx"), [([6], [0], [0], 0, A), ([1], [6], [0], 1, steps[1][4][:1])])
    assert rel_err(fast[1][0], alone[1][0]) < 1e-5


def test_bad_step_inputs_are_refused(make_hf, tmp_path):
    src, _ = make_hf("llama_mha")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    m = engine(tmp_path / "pmx")
    kv, _ = m.model.new_cache(32)
    with pytest.raises(PmxError, match="kvstarts must equal start_pos"):
        m.forward(torch.tensor([5, 6]), torch.empty(0), torch.tensor([0, 2]), torch.tensor([0, 5]), torch.tensor([0]),
                  torch.tensor([0]), torch.tensor([0]), torch.tensor([2]), torch.tensor([5]), kv)
    with pytest.raises(PmxError, match="decode one token"):
        m.forward(torch.tensor([5, 6]), torch.empty(0), torch.tensor([0, 2]), torch.tensor([0, 2]), torch.tensor([0]),
                  torch.tensor([1]), torch.tensor([0]), torch.tensor([2]), torch.tensor([2]), kv)


def spec(paged: bool, in_place: bool = True, window=None) -> PlanSpec:
    return PlanSpec((Rotary(16, 10000.0, None, 4096, torch.device("cpu")),), torch.device("cpu"), paged, (window or 0,),
                    packed=False, read_cache_in_prefill=False, gather_prefill=True, gather_decode=not in_place)


@pytest.mark.parametrize("paged", [False, True], ids=["offset", "paged"])
@pytest.mark.parametrize("start", [[7], [4, 300, 130]])
def test_decode_inputs_plan_is_the_general_plan(paged, start):
    """The decode step written into persistent buffers (numpy, no torch call on the host) is make_plan's plan for a
    kernel that reads the history in place from cachestarts: every field, dtype and value; the page table padded
    with 0 to the buffers' width. The next step of the same batch size rewrites the same tensors."""
    if paged:
        caches = [[PAGE_SIZE * (3 * b + j) for j in range(s // PAGE_SIZE + 1)][::-1] for b, s in enumerate(start)]
    else:
        caches = [1000 * b + 5 for b in range(len(start))]
    tokens = [11 + b for b in range(len(start))]
    sp = spec(paged)
    bufs = DecodeInputs(sp)
    ids, plan = bufs.write(tokens, start, caches)
    want = make_plan(StepLengths(tokens, [1] * len(start), start, caches, len(start)), sp)
    assert ids.tolist() == tokens and plan.decode_only and plan.last is None and plan.prefill == ()
    for got, exp in ((plan.slots, want.slots), (plan.cos, want.cos), (plan.sin, want.sin),
                     (plan.decode.kvlens, want.decode.kvlens)):
        assert got.dtype == exp.dtype and torch.equal(got, exp)
    assert plan.decode.kv_slots is None and want.decode.kv_slots is None
    cs = plan.decode.cachestarts
    if paged:
        width = want.decode.cachestarts.shape[1]
        assert cs.shape == (len(start), 4096 // PAGE_SIZE) and torch.equal(cs[:, :width], want.decode.cachestarts)
        assert not cs[:, width:].any()
    else:
        assert torch.equal(cs, want.decode.cachestarts)
    ids2, plan2 = bufs.write([t + 1 for t in tokens], [s + 1 for s in start], caches)
    assert plan2 is plan and bufs.owner(plan) is not None and torch.equal(plan.decode.kvlens, want.decode.kvlens + 1)
    assert bufs.owner(want) is None
    assert bufs.write(tokens, [4096], caches[:1]) is None  # past the rotary tables: the caller plans it in full
    if paged:
        assert bufs.write(tokens[:1], start[:1], [[0] * 33]) is None  # a page table wider than the buffers


@pytest.mark.parametrize("window", [None, 3])
def test_gathered_decode_plan_masks_histories_of_different_lengths(window):
    """Kernels that attend over gathered rows get each history's rows, padded by repeating its last one, and a mask
    where the lengths differ or the window cuts."""
    caches = [0, 100]
    plan = make_plan(StepLengths([1, 2], [1, 1], [1, 4], caches, 2), spec(False, in_place=False, window=window))
    d = plan.decode
    assert d.kv_slots.tolist() == [[0, 1, 1, 1, 1], [100, 101, 102, 103, 104]]
    seen = [[True, True, False, False, False], [True] * 5] if window is None else \
        [[True, True, False, False, False], [False, False, True, True, True]]
    assert d.masks[window or 0][:, 0, 0].tolist() == seen


def test_engine_decode_steps_match_forward(make_hf, tmp_path):
    """The engine's decode steps (Stepper.plan of its ints: persistent buffers, attention over the cache from the
    offsets) give the logits of ppl.pmx's forward on the same inputs, to the bit, eager and compiled."""
    src, model = make_hf("llama_gqa_odd")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    for compile_ in ("off", "on"):
        m = engine(tmp_path / "pmx", compile=compile_)
        kv, _ = m.model.new_cache(64)
        prompt = [3, 17, 5, 9, 30]
        m.forward(torch.tensor(prompt), torch.empty(0), torch.tensor([0, 5]), torch.tensor([0, 5]), torch.tensor([2]),
                  torch.tensor([0]), torch.tensor([0]), torch.tensor([5]), torch.tensor([5]), kv)
        kv2 = kv.clone()
        for k, tok in enumerate([7, 8, 9]):
            got = m.run(*m.plan(StepLengths([tok], [1], [5 + k], [2], 1)), m.cache(kv, None))
            want = m.forward(torch.tensor([tok]), torch.empty(0), torch.tensor([0, 1]), torch.tensor([0, 6 + k]),
                             torch.tensor([2]), torch.tensor([1]), torch.tensor([5 + k]), torch.tensor([1]),
                             torch.tensor([6 + k]), kv2)
            assert torch.equal(got, want) and torch.equal(kv, kv2), (compile_, k)


def test_greedy_ids_are_torch_argmax():
    """numpy's argmax on CPU (the first index where tied), torch's elsewhere."""
    from runner.engine.sampler import greedy_ids
    logits = torch.randn(5, 1000)
    logits[2, 10] = logits[2, 500] = logits[2].max() + 1  # a tie: the first wins
    assert greedy_ids(logits) == logits.argmax(-1).tolist() and greedy_ids(logits)[2] == 10
    assert greedy_ids(logits.double()) == logits.argmax(-1).tolist()


def test_a_plan_without_cache_rows_is_refused_on_a_cache_the_kernel_cannot_read(make_hf, tmp_path):
    """A CPU engine plans decode steps without a row table (its kernel reads float32 / int8 caches in place); such a
    plan run on a float16 cache is refused by the kernel with a clear error, not misread (ppl.pmx's forward on a
    float16 cache gathers its rows instead: test_engine)."""
    if cpu_ops() is None:
        pytest.skip("this project's CPU kernels cannot be built here (no compiler)")
    src, _ = make_hf("llama_gqa_odd")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    m = engine(tmp_path / "pmx", compile="off")
    tokens, plan = m.plan(StepLengths([5], [1], [3], [0], 1))
    assert plan.decode.kv_slots is None
    kv, _ = m.model.new_cache(8)
    with pytest.raises(RuntimeError, match="must be float32"):
        m.run(tokens, plan, m.cache(kv.half(), None))


def test_the_chain_is_built_from_what_the_engine_declares(make_hf, tmp_path):
    """Which runner serves which step follows the config and the kernel set's declared ops, and the Stepper says so:
    the one-call step where the CPU kernels read histories in place, torch.compile when asked for, eager always last;
    a mixture of experts declines the one-call step by name."""
    from runner.engine.fused_decode import OneCallDecode
    from runner.engine.runners import Eager
    src, _ = make_hf("llama_gqa_odd")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    kinds = lambda s: [type(r) for r in s.runners]  # noqa: E731
    fast = engine(tmp_path / "pmx")
    assert kinds(fast) == ([OneCallDecode, Eager] if cpu_ops() is not None else [Eager])
    assert kinds(engine(tmp_path / "pmx", compile="on", fused_decode=False)) == [Compiled, Eager]
    assert kinds(engine(tmp_path / "pmx", kernels="reference", compile="on")) == [Compiled, Eager]
    assert fast.describe().startswith("decode steps: one-call C++ decode, else eager; other steps: eager") or \
        cpu_ops() is None
    assert fast.decode_inputs is not None and engine(tmp_path / "pmx", kernels="reference").decode_inputs is None
    src, _ = make_hf("mixtral")
    convert(str(src), str(tmp_path / "moe"), progress=False)
    moe = engine(tmp_path / "moe")
    assert kinds(moe) == [Eager] and OneCallDecode.why_not(moe.model) == "layer 0 has moe, which it does not support"
