"""The seed's families (ChatGLM2/3, InternLM, InternLM2, Baichuan 1/2 7B and 13B, Qwen v1) from checkpoints in their
publishers' layouts (tests/seed_families.py: safetensors and .bin, single and sharded), against their references on
the same weights: teacher-forced logits within 1e-4 (every cache layout and mode, ppl.pmx's unfused attention, the
int8 cache), greedy generation of 24 tokens at TP 1, 2 and 4 (3 for 6 heads), split / merge bit for bit, int8
weights; that each new feature (partial rotary, ALiBi, NormHead, logn scaling) matters, and which step runner runs
it; config errors naming the key; the tokenizers and chat templates."""

from __future__ import annotations

import filecmp
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import seed_families as sf
from runner.engine.plan import StepLengths
from runner.errors import PmxError
from runner.pmx.convert import convert, quantize_model, reshard
from runner.pmx.params import PmxParams
from runner.pmx.quant import QuantScheme
from test_engine import STEPS, core, engine, prompts_and_conts, rel_err, run_tp
from tp_worker import teacher_forced_logits

ROOT = Path(__file__).resolve().parents[1]
GEN = 24  # greedy tokens compared
FORMATS = {  # each variant from another of the layouts conversion reads: (format, files)
    "chatglm3": ("safetensors", 2), "chatglm2_mha": ("bin", 1), "internlm": ("bin", 3), "internlm2": ("safetensors", 1),
    "baichuan2_7b": ("bin", 2), "baichuan2_13b": ("safetensors", 3), "baichuan_7b": ("bin", 1),
    "qwen": ("safetensors", 4), "qwen_logn": ("bin", 2)}
ALL_CACHES = [dict(cache_layout=0, cache_mode=0), dict(cache_layout=1, cache_mode=1), dict(cache_layout=2),
              dict(cache_layout=3, cache_mode=1), dict(cache_layout=0, fused_kvcache=False),
              dict(cache_layout=3, cache_mode=1, fused_kvcache=False)]
TP = [(name, 2) for name in sf.VARIANTS] + [(name, 4) for name in sf.VARIANTS if name != "baichuan2_13b"] + \
     [("baichuan2_13b", 3)]  # 6 heads


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(name) -> (PMX dir, Reference): each variant written in its layout and converted, once per module."""
    base, made = tmp_path_factory.mktemp("seed"), {}

    def get(name):
        if name not in made:
            fmt, files = FORMATS[name]
            ref = sf.build(name, base / name / "hf", fmt, files)
            convert(str(base / name / "hf"), str(base / name / "pmx"), progress=False)
            made[name] = (base / name / "pmx", ref)
        return made[name]
    return get


@pytest.mark.parametrize("name", list(sf.VARIANTS))
def test_matches_reference_every_cache_and_greedy(models, name):
    pmx, ref = models(name)
    prompts, conts = prompts_and_conts(ref.vocab_size)
    want = ref.logits(prompts, conts, STEPS)
    for options in ALL_CACHES:
        got = torch.stack(teacher_forced_logits(engine(pmx, **options), prompts, conts))
        assert rel_err(got, want) < 1e-4, (options, rel_err(got, want))
    if PmxParams.load(pmx).head_dim % 8 == 0:
        int8 = torch.stack(teacher_forced_logits(engine(pmx, quantized_cache=True, cache_layout=1, cache_mode=1),
                                                 prompts, conts))
        cos = torch.nn.functional.cosine_similarity(int8.flatten(1), want.flatten(1)).min()
        agree = (int8.argmax(-1) == want.argmax(-1)).float().mean()  # (Baichuan 2's 125696 unit rows: near ties)
        assert cos >= 0.999 and agree >= 0.9 and 0 < rel_err(int8, want) < 2e-2, (float(cos), float(agree))
    greedy = core(pmx).generate(prompts, GEN)
    assert greedy == [ref.greedy(p, GEN) for p in prompts]


@pytest.mark.parametrize("name,n", TP)
def test_tensor_parallel_greedy_and_split_merge(models, tmp_path, name, n):
    """TP = n: logits as the reference's and TP = 1's, the same 24 greedy tokens, and merge(split(m)) == m."""
    pmx, ref = models(name)
    reshard(str(pmx), str(tmp_path / "split"), n, progress=False)
    reshard(str(tmp_path / "split"), str(tmp_path / "merged"), 1, progress=False)
    assert filecmp.cmp(pmx / "model.00.safetensors", tmp_path / "merged" / "model.00.safetensors", shallow=False)
    prompts, conts = prompts_and_conts(ref.vocab_size)
    want = ref.logits(prompts, conts, STEPS)
    options = [dict(cache_layout=0), dict(cache_layout=2, cache_mode=1), dict(cache_layout=1, fused_kvcache=False)]
    logits, info = run_tp(tmp_path, tmp_path / "split", n, options, prompts, conts, with_info=True,
                          spec_extra={"generate": GEN})
    greedy = [ref.greedy(p, GEN) for p in prompts]
    for opts, got, i in zip(options, logits, info):
        assert rel_err(got, want) < 1e-4, (opts, rel_err(got, want))
        assert i["generated"] == greedy, opts
        assert i["fused_decode"] == opts.get("fused_kvcache", True)  # the one-call step, collectives in C++


def test_features_matter(models, tmp_path):
    """Each new feature changes the logits: the same weights without it are 10x the tests' tolerance (1e-4) and more
    from the reference (so the tests above do test it): ChatGLM's partial rotary, Baichuan-13B's ALiBi, Baichuan 2's
    NormHead, Qwen's logn."""
    prompts, conts = prompts_and_conts(64)

    def without(name, **changes):
        pmx, ref = models(name)
        out = tmp_path / name
        out.mkdir()
        for f in pmx.iterdir():
            (out / f.name).write_bytes(f.read_bytes())
        PmxParams.load(pmx).replace(**changes).save(out)
        want = ref.logits(prompts, conts, STEPS)
        return rel_err(torch.stack(teacher_forced_logits(engine(out), prompts, conts)), want)

    assert without("chatglm3", rotary_dim=16) > 1e-3                   # all of head_dim rotated instead of half
    assert without("qwen_logn", logn_scaling=None) > 1e-3              # positions past seq_length 8 unscaled
    pmx, ref = models("baichuan2_13b")
    prompts13, conts13 = prompts_and_conts(ref.vocab_size)
    no_alibi = sf.Reference(ref.model)                                 # the reference without its ALiBi mask
    got = torch.stack(teacher_forced_logits(engine(pmx), prompts13, conts13))
    assert rel_err(got, no_alibi.logits(prompts13, conts13, STEPS)) > 1e-3
    from runner.engine.model import load_shard
    from runner.pmx.hf import HFCheckpoint
    _, w = load_shard(pmx, 0, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(w["output.weight"].norm(dim=-1), torch.ones(125696))   # NormHead: unit rows,
    stored = HFCheckpoint(pmx.parent / "hf").get("lm_head.weight").norm(dim=-1)       # from rows that are not
    assert (stored - 1).abs().min() > 0.1


class Counting:
    """A step runner that counts the steps it runs (wraps one of a Stepper's)."""

    def __init__(self, runner):
        self.runner, self.name, self.steps = runner, runner.name, 0

    def accepts(self, plan, cache):
        return self.runner.accepts(plan, cache)

    def __call__(self, tokens, plan, cache):
        self.steps += 1
        return self.runner(tokens, plan, cache)


@pytest.mark.parametrize("name", ["chatglm3", "baichuan2_13b", "qwen_logn"])
def test_which_runner_runs_the_new_features(models, name):
    """The one-call CPU decode step runs a partial rotary and ALiBi (the same logits as the eager step), and declines
    the decode steps whose queries logn scales (past seq_length): the eager step runs those."""
    pmx, ref = models(name)
    prompts, conts = prompts_and_conts(ref.vocab_size)
    eager = torch.stack(teacher_forced_logits(engine(pmx, fused_decode=False), prompts, conts))
    stepper = engine(pmx)
    assert stepper.describe() == "decode steps: one-call C++ decode, else eager; other steps: eager"
    stepper.runners = [Counting(r) for r in stepper.runners]
    got = torch.stack(teacher_forced_logits(stepper, prompts, conts))
    assert rel_err(got, eager) < 1e-5 and rel_err(got, ref.logits(prompts, conts, STEPS)) < 1e-4
    one_call, eager_runner = stepper.runners
    logn = PmxParams.load(pmx).logn_scaling
    if logn is None:
        assert (one_call.steps, eager_runner.steps) == (STEPS, 1)         # every decode step, and the prefill
    else:  # decode step k places tokens at len(prompt) + k - 1: past 8 for the 12-token prompt from the start
        late = sum(1 for k in range(1, STEPS + 1) if max(len(p) + k - 1 for p in prompts) >= logn)
        assert late > 0 and (one_call.steps, eager_runner.steps) == (STEPS - late, 1 + late)
        plan = stepper.plan(StepLengths([3], [1], [logn], [0], 1))[1]
        assert plan.q_scale is not None and not one_call.runner.accepts(plan, stepper.cache(
            *stepper.model.new_cache(64)))


@pytest.mark.parametrize("name", ["chatglm3", "baichuan2_13b", "qwen_logn"])
def test_compiled_decode_step_runs_the_new_features(models, name):
    """torch.compile of the decode step (fullgraph: a graph break would raise) gives the eager step's logits, with a
    partial rotary, ALiBi and logn-scaled queries."""
    from runner.engine.runners import Compiled
    torch._dynamo.reset()
    try:
        pmx, ref = models(name)
        prompts, conts = prompts_and_conts(ref.vocab_size)
        eager = torch.stack(teacher_forced_logits(engine(pmx, fused_decode=False, compile="off"), prompts, conts))
        compiled = engine(pmx, fused_decode=False, compile="on")
        assert any(isinstance(r, Compiled) for r in compiled.runners)
        compiled.runners = [Counting(r) for r in compiled.runners]
        got = torch.stack(teacher_forced_logits(compiled, prompts, conts))
        assert compiled.runners[0].steps == STEPS and rel_err(got, eager) < 1e-5
    finally:
        torch._dynamo.reset()
