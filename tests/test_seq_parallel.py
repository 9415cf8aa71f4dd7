"""Sequence parallelism at TP > 1 on CPU (runner.engine.model.SeqParallel; reduce_norm in runner/kernels/cpu_comm.cpp):
the steps of the torch path keep the residual stream cut by rows between the ranks, and a row-parallel linear's
all-reduce, the residual add and the next RMSNorm are one collective. The logits are the same bits as with the
all-reduce and a norm on every row, and TP=1's within rounding. (The collective itself, against sums made locally:
tests/comm_worker.py.)"""

from __future__ import annotations

import pytest
import torch

from runner.pmx.convert import convert, reshard
from runner.pmx.quant import QuantScheme
from conftest import hf_maker
from test_engine import engine, prompts_and_conts, rel_err, run_tp, run_tp_batch
from test_quant_engine import model_tol
from tp_worker import teacher_forced_logits

SCHEMES = {"int8": QuantScheme("int8", 0, True), "int4": QuantScheme("int4", 16, True)}


# big enough that every float32 row-parallel shard is packed (PREPACK_MIN_NUMEL): partial sums written in place
WIDE = dict(hidden_size=256, head_dim=32, intermediate_size=320)


CASES = [("llama_gqa_odd", 2, None, "mpirun", WIDE), ("llama_gqa_odd", 4, None, "mpirun", WIDE),
         ("qwen3", 2, None, "torchrun", {}), ("llama_mha", 2, "int8", "mpirun", {}), ("llama_mha", 2, "int4", "mpirun", {})]
OPTIONS = [{"fused_decode": False}, {"fused_decode": False, "seq_parallel": False}]
TEST = "test_seq_parallel_gives_the_bits_of_all_reduce_and_norm"


def _case(make_hf, base, arch, n, quant, overrides):
    """(HF model, PMX dir, its split in n) of a case."""
    src, model = make_hf(arch, **overrides)
    convert(str(src), str(base / "pmx"), progress=False, quant=SCHEMES.get(quant))
    reshard(str(base / "pmx"), str(base / f"pmx{n}"), n, progress=False)
    return model, base / "pmx", base / f"pmx{n}"


@pytest.fixture(scope="module")
def mpirun_two_ranks(request, tmp_path_factory):
    """The cases of TEST at 2 ranks under mpirun that this session runs, in one launch (tests/tp_worker.py --batch):
    (arch, quant) -> (HF model, PMX dir, logits, info)."""
    base, cases = tmp_path_factory.mktemp("sp2"), {}
    for item in request.session.items:
        p = getattr(item, "callspec", None) and item.callspec.params
        if item.originalname == TEST and p["n"] == 2 and p["launcher"] == "mpirun":
            d = base / item.callspec.id
            cases[p["arch"], p["quant"]] = _case(hf_maker(d), d, p["arch"], 2, p["quant"], p["overrides"])
    results = run_tp_batch(base, 2, [(split, OPTIONS, *prompts_and_conts(model.config.vocab_size), None)
                                     for model, _, split in cases.values()])
    return {key: (model, pmx, *res) for (key, (model, pmx, _)), res in zip(cases.items(), results)}


@pytest.mark.parametrize("arch,n,quant,launcher,overrides", CASES)
def test_seq_parallel_gives_the_bits_of_all_reduce_and_norm(make_hf, request, tmp_path, arch, n, quant, launcher,
                                                            overrides):
    """Prompts of different lengths prefilled in one packed step (rows that do not divide among the ranks), then
    decode steps on the torch path (fused_decode off), every one through sequence parallelism: seq_parallel on and
    off give equal logits, TP=1's within rounding. Packed float32, int8 and int4 weights write their partial sums
    straight into the shared area; small float32 ones (plain F.linear, qwen3 here) are copied in. mpirun's and
    torchrun's communicators. (2 ranks under mpirun: every such case in one launch.)"""
    if (n, launcher) == (2, "mpirun"):
        model, pmx, (on, off), info = request.getfixturevalue("mpirun_two_ranks")[arch, quant]
    else:
        model, pmx, split = _case(make_hf, tmp_path, arch, n, quant, overrides)
        (on, off), info = run_tp(tmp_path, split, n, OPTIONS, *prompts_and_conts(model.config.vocab_size),
                                 launcher=launcher, with_info=True)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    tp1 = torch.stack(teacher_forced_logits(engine(pmx, fused_decode=False), prompts, conts))
    steps, layers = len(conts[0]) + 1, model.config.num_hidden_layers
    assert [i["seq_parallel"] for i in info] == [True, False]
    assert info[0]["reduce_norm"] == steps * 2 * layers and info[1]["reduce_norm"] == 0, info  # (layer 0's first
    assert info[0]["in_place"] == (0 if arch == "qwen3" else info[0]["reduce_norm"]), info    # norm: no sums)
    assert torch.equal(on, off)
    assert rel_err(on, tp1) < model_tol(quant or "float32")


def test_seq_parallel_only_where_it_is_the_same_model(make_hf, tmp_path):
    """Row-parallel biases (added once, after the all-reduce) and --kernels reference keep the all-reduce; so does a
    single rank, which has nothing to reduce. With one-call decode on, prefill still takes it. (Both models' TP=2 runs
    in one launch.)"""
    bias, bias_pmx, bias2 = _case(make_hf, tmp_path / "bias", "llama_bias", 2, None, {})
    gqa, _, gqa2 = _case(make_hf, tmp_path / "gqa", "llama_gqa_odd", 2, None, {})
    prompts, conts = prompts_and_conts(bias.config.vocab_size)
    (got, info), (_, gqa_info) = run_tp_batch(tmp_path, 2, [
        (bias2, [{}, {"kernels": "reference"}], prompts, conts, None),
        (gqa2, [{}, {"kernels": "reference"}], *prompts_and_conts(gqa.config.vocab_size), None)])
    tp1 = torch.stack(teacher_forced_logits(engine(bias_pmx), prompts, conts))
    assert engine(bias_pmx).runners[-1].sp is None  # (one rank: nothing to reduce)
    assert [i["seq_parallel"] for i in info] == [False, False]
    for g in got:
        assert rel_err(g, tp1) < 1e-5
    assert [(i["fused_decode"], i["seq_parallel"]) for i in gqa_info] == [(True, True), (False, False)]
    layers = gqa.config.num_hidden_layers
    assert gqa_info[0]["reduce_norm"] == 2 * layers and gqa_info[1]["reduce_norm"] == 0, gqa_info  # the prefill only
