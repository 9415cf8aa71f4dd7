"""Multi-rank CUDA logic on the one GPU a test machine has (skipped without CUDA).

NCCL refuses two ranks on one device, but gloo takes CUDA tensors: a 2-rank run on one GPU with
`--comm_backend gloo` exercises everything of tensor parallelism on CUDA but NCCL itself (sharded Triton
kernels, all-reduce and all-gather of CUDA tensors, every rank sampling the same token with no broadcast).
NCCL itself runs at TP=1 (`--comm_backend nccl`), where its all-reduce is captured in the CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from runner.pmx.convert import convert, reshard
from test_engine import hf_logits, prompts_and_conts, rel_err, run_tp
from test_generate import REFERENCE, demo, ids_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="multi-rank CUDA runs need a CUDA device (torch.cuda.is_available() is False)")

OPTIONS = [{"cache_layout": 0}, {"cache_layout": 3, "cache_mode": 1}, {"cache_layout": 1, "quantized_cache": True}]


def test_gloo_tp2_on_one_gpu_matches_tp1_and_transformers(make_hf, tmp_path):
    """Teacher-forced logits (prefill + decode steps, three cache set-ups): TP=2 over gloo on one GPU against
    TP=1 on that GPU and against transformers on the CPU."""
    src, model = make_hf("qwen2")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    reshard(str(tmp_path / "pmx"), str(tmp_path / "pmx2"), 2, progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    ref = hf_logits(model, prompts, conts)
    tp1 = run_tp(tmp_path, tmp_path / "pmx", 1, OPTIONS, prompts, conts, launcher="torchrun")
    tp2 = run_tp(tmp_path, tmp_path / "pmx2", 2, OPTIONS, prompts, conts, launcher="torchrun",
                 comm_backend="gloo")
    assert tp1.shape == tp2.shape == (len(OPTIONS), *ref.shape)
    for options, one, two in zip(OPTIONS, tp1, tp2):
        tol = 2e-2 if options.get("quantized_cache") else 5e-3   # float32 on the GPU: tf32 dots in attention
        assert rel_err(one, ref) < tol, (options, rel_err(one, ref))
        assert rel_err(two, one) < tol, (options, rel_err(two, one))
        assert torch.equal(two.argmax(-1), ref.argmax(-1)), options


@pytest.mark.parametrize("launcher,n,flags", [("single", 1, ()), ("single", 1, ("--comm_backend", "nccl")),
                                              ("single", 1, ("--comm_backend", "nccl", "--cuda_graphs", "false")),
                                              ("torchrun", 2, ("--comm_backend", "gloo"))])
def test_real_model_on_cuda_gives_the_reference_ids(shared_model, tmp_path, launcher, n, flags):
    """stories260k on CUDA: the 40 greedy ids of transformers, alone, with NCCL at TP=1 (graphs and eager), and
    on 2 ranks sharing the GPU over gloo."""
    src = shared_model("stories260k")
    convert(str(src), str(tmp_path / "s1"), progress=False)
    ckpt = tmp_path / "s1"
    if n > 1:
        reshard(str(ckpt), str(tmp_path / f"s{n}"), n, progress=False)
        ckpt = tmp_path / f"s{n}"
    res = demo(launcher, n, ckpt, "--prompt", "Once upon a time", "--max_gen_len", 40, "--show_ids",
               "--device", "cuda", *flags)
    assert res.returncode == 0, res.stderr[-3000:]
    assert ids_of(res.stdout) == [REFERENCE["stories260k"]], res.stdout
    assert f"{n} rank(s), cuda" in res.stderr, res.stderr[-2000:]
