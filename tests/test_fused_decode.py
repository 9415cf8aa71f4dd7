"""The decode step in one C++ call (runner.engine.fused_decode, runner/kernels/cpu_decode.cpp): the same logits as the
torch step and transformers, for every feature the engine has on CPU, at TP=1 and TP=2; which engines take it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from runner.engine import fused_decode as fd
from runner.engine.plan import StepLengths
from runner.kernels import linear as linear_mod
from runner.kernels.cpu_ext import cpu_ops
from runner.pmx.convert import convert, reshard
from runner.pmx.quant import QuantScheme
from test_engine import engine, hf_logits, prompts_and_conts, rel_err, run_tp_batch
from test_quant_engine import model_tol
from tp_worker import teacher_forced_logits

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="this project's CPU kernels cannot be built here")


class Counted:
    """A step runner that counts the steps it runs for another."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, inner.name, []

    def accepts(self, plan, cache) -> bool:
        return self.inner.accepts(plan, cache)

    def __call__(self, *args):
        self.calls.append(1)
        return self.inner(*args)


def counted(stepper) -> list:
    """Counts the engine's one-call decode steps."""
    i = next(i for i, r in enumerate(stepper.runners) if isinstance(r, fd.OneCallDecode))
    stepper.runners[i] = Counted(stepper.runners[i])
    return stepper.runners[i].calls


def one_call(stepper):
    return next((r for r in stepper.runners if isinstance(r, fd.OneCallDecode)), None)


@pytest.mark.parametrize("arch,options", [
    ("llama_gqa_odd", dict(cache_layout=0)),
    ("llama_bias", dict(cache_layout=1, cache_mode=1)),             # q/k/v biases; pages out of order
    ("qwen3", dict(cache_layout=3, cache_mode=1)),                   # q/k norms
    ("mistral_window", dict(cache_layout=2)),                        # sliding window
    ("mistral_window", dict(cache_layout=1, cache_mode=1, quantized_cache=True)),  # int8 cache: rows quantised in C++
    ("qwen3", dict(cache_layout=0, quantized_cache=True)),
    ("gemma2", dict(cache_layout=1, cache_mode=1)),                 # GeGLU, post norms, soft caps, mixed layer kinds
    ("gemma3", dict(cache_layout=2, quantized_cache=True)),         # a rope per layer kind, q/k norms (1 + w)
    ("phi4_mini", dict(cache_layout=3)),                             # partial rotary, LongRoPE across its switch
])
def test_one_call_decode_matches_the_torch_step_and_transformers(make_hf, tmp_path, arch, options):
    """Teacher-forced decode of 3 sequences of different lengths: every decode step goes through the one call, and its
    logits are the eager torch step's (the same kernels, called one by one) and transformers'."""
    src, model = make_hf(arch)
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    fused = engine(tmp_path / "pmx", **options)
    calls = counted(fused)
    got = torch.stack(teacher_forced_logits(fused, prompts, conts))
    assert len(calls) == len(conts[0])  # every step but the prefill
    torch_step = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx", fused_decode=False, compile="off",
                                                          **options), prompts, conts))
    assert rel_err(got, torch_step) < 1e-5
    single = torch.stack(teacher_forced_logits(fused, prompts[1:2], conts[1:2]))  # batch 1
    assert rel_err(single, torch_step[:, 1:2]) < 1e-5
    if not options.get("quantized_cache"):
        assert rel_err(got, hf_logits(model, prompts, conts)) < 1e-4


@pytest.mark.parametrize("scheme", [None, QuantScheme("int8", 0, True), QuantScheme("int4", 32, True)])
def test_one_call_decode_on_packed_and_quantised_weights(make_hf, tmp_path, monkeypatch, scheme):
    """float32 weights packed at load (as every weight of a real model is: these test weights are under the size),
    and int8 / int4 weights, lm head included: the packed kernels of the eager step, chained."""
    monkeypatch.setattr(linear_mod, "PREPACK_MIN_NUMEL", 0)
    src, model = make_hf("llama_mha")
    convert(str(src), str(tmp_path / "q"), progress=False, quant=scheme)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    fused = engine(tmp_path / "q")
    if scheme is None:
        assert {m.kernel for m in fused.model.modules() if isinstance(m, linear_mod.Linear)} == {"pmx"}
    calls = counted(fused)
    got = torch.stack(teacher_forced_logits(fused, prompts, conts))
    assert len(calls) == len(conts[0])
    want = torch.stack(teacher_forced_logits(engine(tmp_path / "q", fused_decode=False, compile="off"), prompts, conts))
    assert rel_err(got, want) < model_tol(scheme.method if scheme else "float32")


def test_one_call_decode_tensor_parallel(make_hf, tmp_path):
    """TP=2 under mpirun: the all-reduces and the embedding / logits all-gathers run from C++ on the shared-memory
    workspace; logits as TP=1's and as the torch step's at TP=2. Without shared memory (PMX_SHM_COMM=0) the engine
    keeps the torch step, with the same logits."""
    src, model = make_hf("llama_gqa_odd")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    reshard(str(tmp_path / "pmx"), str(tmp_path / "pmx2"), 2, progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    tp1 = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx", fused_decode=False), prompts, conts))
    split = tmp_path / "pmx2"
    ((fused, torch_step), info), (no_shm, info_no_shm) = run_tp_batch(tmp_path, 2, [  # one launch, two sessions
        (split, [{"cache_layout": 1}, {"cache_layout": 1, "fused_decode": False}], prompts, conts, None),
        (split, [{"cache_layout": 1}], prompts, conts, None, {"PMX_SHM_COMM": "0"})])
    assert [(i["shm"], i["fused_decode"]) for i in info + info_no_shm] == [(True, True), (True, False), (False, False)]
    assert rel_err(fused, tp1) < 1e-5 and rel_err(torch_step, tp1) < 1e-5
    assert rel_err(no_shm[0], tp1) < 1e-5


def test_which_engines_take_the_one_call_step(make_hf, tmp_path):
    src, _ = make_hf("llama_gqa_odd")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    stepper = engine(tmp_path / "pmx")
    runner, why_not = one_call(stepper), fd.OneCallDecode.why_not
    assert runner is not None and runner.name == "one-call C++ decode"
    cache = stepper.cache(*stepper.model.new_cache(64))
    assert runner.accepts(stepper.plan(StepLengths([3], [1], [4], [0], 1))[1], cache)
    assert not runner.accepts(stepper.plan(StepLengths([3, 4], [2], [0], [0], 0))[1], cache)  # a prefill step
    off = engine(tmp_path / "pmx", fused_decode=False)
    assert why_not(off.model) == "turned off (fused_decode=False)" and one_call(off) is None
    assert "does not read the cache in place" in why_not(engine(tmp_path / "pmx", kernels="reference").model)
    assert why_not(engine(tmp_path / "pmx", fused_qkv=False).model) == \
        "layer 0 has split_qkv, which it does not support"
    assert why_not(engine(tmp_path / "pmx", fused_ffn_glu=False).model) == \
        "layer 0 has split_gate_up, which it does not support"
    model = stepper.model
    model.rotary.inv_freq = model.rotary.inv_freq[:-1]  # rotary on the first head_dim - 2 dims only: the step has it
    assert fd.layer_features(model, 0).position == "rotary_partial" and why_not(model) is None
    src, _ = make_hf("mixtral")
    convert(str(src), str(tmp_path / "moe"), progress=False)
    assert why_not(engine(tmp_path / "moe").model) == "layer 0 has moe, which it does not support"


@pytest.mark.parametrize("arch,options", [("llama_gqa_odd", dict(cache_layout=0)),
                                          ("mistral_window", dict(cache_layout=2, cache_mode=1, quantized_cache=True))])
def test_a_verify_step_runs_as_decode_rows_in_one_call(make_hf, tmp_path, arch, options):
    """Speculative decoding's verify step (StepLengths.rowwise: sequences decoding several tokens, every row's logits)
    runs as the one-call decode step over a row per token, and gives the eager step's logits for every row: a row
    sees the keys of the rows before it in the same step, not those after."""
    src, model = make_hf(arch)
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    fused, eager = engine(tmp_path / "pmx", **options), engine(tmp_path / "pmx", fused_decode=False, compile="off",
                                                                   **options)
    paged, g = options.get("cache_mode") == 1, torch.Generator().manual_seed(3)
    caches = [[256, 0], [128]] if paged else [0, 100]
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (140, 9)]
    guesses = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (4, 1)]
    got = []
    for stepper in (fused, eager):
        cache = stepper.cache(*stepper.model.new_cache(512))
        stepper.run(*stepper.plan(StepLengths(prompts[0] + prompts[1], [140, 9], [0, 0], caches, 0)), cache)
        calls = counted(stepper) if stepper is fused else []
        b = StepLengths(guesses[0] + guesses[1], [4, 1], [140, 9], caches, 0, (True, True), rowwise=stepper is fused)
        got.append(stepper.run(*stepper.plan(b), cache))
        assert len(calls) == (stepper is fused)
    assert got[0].shape == (5, model.config.vocab_size) and rel_err(got[0], got[1]) < 1e-5


def test_layer_features_are_declared_or_declined_by_name():
    """Each layer's features against the step's declared ones: what it lacks (MoE, linears it cannot run) is named,
    in the layer where it first appears; ALiBi, a partial rotary, GeGLU, post norms and soft-capped scores it has."""
    supported = torch.classes.pmx_cpu.DecodeModel.features()
    plain = fd.LayerFeatures(position="rotary", mlp="swiglu", linears="packed_linears", split_qkv=False,
                             split_gate_up=False, qkv_bias=True, o_bias=True, ffn_bias=True, qk_norm=True,
                             post_norms=True, sliding_window=True, attn_softcap=True)
    assert plain.names() == ["rotary", "swiglu", "packed_linears", "qkv_bias", "o_bias", "ffn_bias", "qk_norm",
                             "post_norms", "sliding_window", "attn_softcap"]
    assert fd.first_unsupported([plain, plain], supported) is None
    for change in (dict(position="alibi"), dict(position="rotary_partial"), dict(mlp="geglu")):
        assert fd.first_unsupported([plain, replace(plain, **change)], supported) is None
    for change, name in [(dict(mlp="moe"), "moe"), (dict(linears="other_linears"), "other_linears")]:
        assert fd.first_unsupported([plain, replace(plain, **change)], supported) == \
            f"layer 1 has {name}, which it does not support"


def test_the_description_is_checked_by_layer_and_field(make_hf, tmp_path):
    """A description that does not fit together is refused naming the decoder layer and the field."""
    src, _ = make_hf("qwen3")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    model = engine(tmp_path / "pmx").model
    a = model.layers[1].attention
    a.wo, a.q_norm = model.layers[1].feed_forward.w2, a.q_norm[:-1]
    with pytest.raises(RuntimeError, match="decoder layer 1: q_norm and k_norm must be both absent or contiguous "
                                           f"float32 \\[{a.head_dim}\\]"):
        fd.OneCallDecode(model)
    a.q_norm = model.layers[0].attention.q_norm
    with pytest.raises(RuntimeError, match="decoder layer 1: wo must be row-parallel"):
        fd.OneCallDecode(model)


def test_one_call_decode_refuses_bad_steps_by_name(make_hf, tmp_path):
    src, _ = make_hf("llama_gqa_odd")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    stepper = engine(tmp_path / "pmx")
    cache, vocab = stepper.cache(*stepper.model.new_cache(64)), stepper.model.params.vocab_size
    toks, plan = stepper.plan(StepLengths([3], [1], [4], [0], 1))
    with pytest.raises(RuntimeError, match=f"token id {vocab} is outside the vocabulary"):
        stepper.run(torch.tensor([vocab]), plan, cache)
    toks, plan = stepper.plan(StepLengths([3], [1], [4], [62], 1))  # history rows 62..66 of a 64-row cache
    with pytest.raises(RuntimeError, match="cache row 64 of sequence 0 is outside the cache's 64 rows"):
        stepper.run(toks, plan, cache)
