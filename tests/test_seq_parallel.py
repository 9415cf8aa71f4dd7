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
from test_engine import engine, prompts_and_conts, rel_err, run_tp
from test_quant_engine import model_tol
from tp_worker import teacher_forced_logits

SCHEMES = {"int8": QuantScheme("int8", 0, True), "int4": QuantScheme("int4", 16, True)}


# big enough that every float32 row-parallel shard is packed (PREPACK_MIN_NUMEL): partial sums written in place
WIDE = dict(hidden_size=256, head_dim=32, intermediate_size=320)


@pytest.mark.parametrize("arch,n,quant,launcher,overrides", [("llama_gqa_odd", 2, None, "mpirun", WIDE),
                                                             ("llama_gqa_odd", 4, None, "mpirun", WIDE),
                                                             ("qwen3", 2, None, "torchrun", {}),
                                                             ("llama_mha", 2, "int8", "mpirun", {}),
                                                             ("llama_mha", 2, "int4", "mpirun", {})])
def test_seq_parallel_gives_the_bits_of_all_reduce_and_norm(make_hf, tmp_path, arch, n, quant, launcher, overrides):
    """Prompts of different lengths prefilled in one packed step (rows that do not divide among the ranks), then
    decode steps on the torch path (fused_decode off), every one through sequence parallelism: seq_parallel on and
    off give equal logits, TP=1's within rounding. Packed float32, int8 and int4 weights write their partial sums
    straight into the shared area; small float32 ones (plain F.linear, qwen3 here) are copied in. mpirun's and
    torchrun's communicators."""
    src, model = make_hf(arch, **overrides)
    convert(str(src), str(tmp_path / "pmx"), progress=False, quant=SCHEMES.get(quant))
    reshard(str(tmp_path / "pmx"), str(tmp_path / f"pmx{n}"), n, progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    tp1 = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx", fused_decode=False), prompts, conts))
    options = [{"fused_decode": False}, {"fused_decode": False, "seq_parallel": False}]
    (on, off), info = run_tp(tmp_path, tmp_path / f"pmx{n}", n, options, prompts, conts, launcher=launcher,
                             with_info=True)
    steps, layers = len(conts[0]) + 1, model.config.num_hidden_layers
    assert [i["seq_parallel"] for i in info] == [True, False]
    assert info[0]["reduce_norm"] == steps * 2 * layers and info[1]["reduce_norm"] == 0, info  # (layer 0's first
    assert info[0]["in_place"] == (0 if arch == "qwen3" else info[0]["reduce_norm"]), info    # norm: no sums)
    assert torch.equal(on, off)
    assert rel_err(on, tp1) < model_tol(quant or "float32")


def test_seq_parallel_only_where_it_is_the_same_model(make_hf, tmp_path):
    """Row-parallel biases (added once, after the all-reduce) and --kernels reference keep the all-reduce; so does a
    single rank, which has nothing to reduce. With one-call decode on, prefill still takes it."""
    src, model = make_hf("llama_bias")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    reshard(str(tmp_path / "pmx"), str(tmp_path / "pmx2"), 2, progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    tp1 = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx"), prompts, conts))
    assert engine(tmp_path / "pmx").runners[-1].sp is None  # (one rank: nothing to reduce)
    got, info = run_tp(tmp_path, tmp_path / "pmx2", 2, [{}, {"kernels": "reference"}], prompts, conts, with_info=True)
    assert [i["seq_parallel"] for i in info] == [False, False]
    for g in got:
        assert rel_err(g, tp1) < 1e-5
    src, model = make_hf("llama_gqa_odd")
    convert(str(src), str(tmp_path / "gqa"), progress=False)
    reshard(str(tmp_path / "gqa"), str(tmp_path / "gqa2"), 2, progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    _, info = run_tp(tmp_path, tmp_path / "gqa2", 2, [{}, {"kernels": "reference"}], prompts, conts, with_info=True)
    assert [(i["fused_decode"], i["seq_parallel"]) for i in info] == [(True, True), (False, False)]
    layers = model.config.num_hidden_layers
    assert info[0]["reduce_norm"] == 2 * layers and info[1]["reduce_norm"] == 0, info  # the prefill step only
