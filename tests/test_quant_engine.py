"""Weight-only quantised weights in the engine: every kernel against the reference (dequantise, then matmul),
compiled decode, tensor parallel, MoE, the real checkpoints, dumps / replay and perplexity."""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from runner.config import EngineConfig
from runner.engine.core import EngineCore
from runner.engine.fused_decode import OneCallDecode
from runner.engine.model import Transformer, random_shard
from runner.engine.perplexity import chunks, evaluate, perplexity, windows
from runner.engine.runners import Compiled, Stepper
from runner.errors import PmxError
from runner.kernels.linear import Linear
from runner.kernels.quant_linear import (CPU_KERNEL_MAX_ROWS, QuantLinear, QuantWeight, aten_int4_takes, cpu_ops,
                                         make_linear, packed_args, quant_embedding, reference_linear)
from runner.parallel.comm import SingleComm
from runner.parallel.layers import ParallelEmbedding
from runner.pmx.convert import convert, quantize_model, reshard
from runner.pmx.quant import QuantScheme, quantize
from runner.pmx.params import PmxParams
from runner.pmx.shard import sharded_params
from runner.pmx.store import SafetensorsReader
from conftest import hf_maker, shared_model_path
from test_bad_input import run_cli
from test_engine import core, engine, hf_logits, prompts_and_conts, rel_err, run_tp, run_tp_batch
from tp_worker import teacher_forced_logits

STORY = Path(__file__).parent / "data" / "story.txt"
CPU_KERNELS = ["cpu", "aten"] if cpu_ops() is not None else ["aten"]


def snr_db(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.square().sum() / (got - ref).square().sum()))


def model_tol(method: str) -> float:
    """Relative error allowed between a model's logits on two kernel sets: int4 on AVX512-VNNI multiplies by x in
    two int8 parts (about 15 bits: test_cpu_kernels_match_reference), everything else in float32."""
    return 2e-4 if method == "int4" else 1e-5


def weight(method: str, n: int, k: int, group: int = 0, seed: int = 0, offset: bool = False) -> QuantWeight:
    """A random weight quantised with the scheme (method, group[, offsets])."""
    g = torch.Generator().manual_seed(seed)
    scheme = QuantScheme(method, group, offset=offset)
    q, s, *o = quantize(torch.randn(n, k, generator=g) * 0.05, scheme)
    return QuantWeight(q, s, scheme, offset=o[0] if o else None)


# --- kernels against the reference ------------------------------------------------------------------
# (method, group, offsets): int4 groups of 2 take layout 0 on any CPU; int8 in groups and int4 with offsets are
# GGUF's Q8_0 and Q4_1
SCHEMES = [("int8", 0, False), ("int8", 32, False), ("int8", 8, False), ("int4", 32, False), ("int4", 8, False),
           ("int4", 2, False), ("int4", 32, True), ("int4", 2, True)]


def cpu_cases():
    """(kernel, method, group, offset, n, k); aten only where it takes the scheme and shape (per-channel int8;
    symmetric int4 in groups of 32..256, N a multiple of 16: elsewhere the engine runs the reference)."""
    for kernel, (method, group, offset), (n, k) in itertools.product(CPU_KERNELS, SCHEMES,
                                                                      [(1, 64), (70, 96), (130, 256), (64, 128)]):
        w = weight(method, n, k, group, offset=offset)
        if kernel != "aten" or (method == "int8" and not group) or aten_int4_takes(w):
            yield kernel, method, group, offset, n, k


@pytest.mark.parametrize("kernel,method,group,offset,n,k", list(cpu_cases()))
def test_cpu_kernels_match_reference(kernel, method, group, offset, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)  # the same inputs in every run, whatever ran before
    w = weight(method, n, k, group, offset=offset)
    bias = torch.randn(n, generator=g)
    lin = QuantLinear(w, bias, kernel=kernel)
    # Errors are measured against the size of the products each output sums, sum |x| |W| + |bias| (the forward error
    # of a float32 dot product scales with it): a single output channel can cancel to near zero, where an error
    # relative to the result means nothing (with n = 1, max |result| was 1e-3 of that in 1 case of 300 and the
    # relative error 3e-4). float32 products throughout, except the AVX512-VNNI int4 path (layout 1), which
    # multiplies by x quantised per row and group to two int8 parts: |x - x^| <= max|x over the group| / (127 * 256)
    # per element, so its error is bounded by that times |W|, plus float32 rounding.
    vnni = (method, lin.layout) == ("int4", 1)
    wabs = w.dequantize().abs().T

    def err(got, x, want):
        x2 = x.reshape(-1, k)
        size = x2.abs() @ wabs + bias.abs()
        if not vnni:
            return float((got - want).abs().max() / size.max())
        amax = x2.view(x2.shape[0], -1, group).abs().amax(-1).repeat_interleave(group, -1)   # per element's group
        bound = amax @ wabs / (127 * 256) + 1e-6 * size
        return ((got - want).reshape(bound.shape).abs() / bound).max().item()

    tol = 1.0 if vnni else 2e-6  # float32: the worst of 300 seeds x 5 batch sizes was 7.7e-7
    for m in (1, 3, 16, 33, 70):  # 33, 70: past CPU_KERNEL_MAX_ROWS, dequantise per block + float GEMM
        x = torch.randn(m, k, generator=g)
        want = reference_linear(x, w, bias)
        assert err(lin(x), x, want) < tol, (m, err(lin(x), x, want))
    x3 = torch.randn(2, 3, k, generator=g)  # leading dims are kept
    assert err(lin(x3), x3, reference_linear(x3, w, bias)) < tol


@pytest.mark.skipif(cpu_ops() is None, reason="the CPU kernels cannot be built here (no compiler)")
def test_cpu_kernel_under_torch_compile():
    """The compiled decode step calls the kernel as an op of its own (fake implementation for shapes)."""
    lins = [QuantLinear(weight("int8", 100, 64), None), QuantLinear(weight("int4", 72, 64, 32, seed=1), None),
            QuantLinear(weight("int8", 100, 64, 32), None), QuantLinear(weight("int4", 72, 64, 32, offset=True), None)]
    for lin in lins:
        torch._dynamo.reset()
        f = torch.compile(lin, fullgraph=True, dynamic=True)
        for m in (1, 4, 7):
            x = torch.randn(m, 64)
            assert torch.equal(f(x), lin(x))


@pytest.mark.parametrize("method,group,offset", [("int8", 0, False), ("int4", 16, False), ("int4", 32, False),
                                                 ("int8", 32, False), ("int8", 16, False), ("int4", 32, True),
                                                 ("int4", 16, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_matches_reference(method, group, offset, dtype):
    """Runs compiled on CUDA, under the Triton interpreter on CPU (where the kernel multiplies bfloat16 tiles as
    float32 copies: the interpreter's own bfloat16 tl.dot is broken)."""
    triton_quant = pytest.importorskip("runner.kernels.triton_quant", reason="triton is not installed")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = [dtype] + ([torch.bfloat16] if dtype == torch.float16 else [])
    for (m, n, k), dt in itertools.product([(1, 70, 64), (20, 33, 96)], dtypes):
        w = weight(method, n, k, group, offset=offset)
        w = QuantWeight(w.qweight.to(dev), w.scale.to(dev), w.scheme, offset=None if w.offset is None else
                        w.offset.to(dev))
        x = torch.randn(m, k, device=dev).to(dt)
        got = triton_quant.quant_matmul(x, w.qweight, w.scale, method, group, w.offset)
        want = reference_linear(x.float(), w)
        tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dt]  # bf16: 8 bits of mantissa
        assert got.dtype == dt and rel_err(got.float(), want) < tol
    assert not triton_quant.takes_group(QuantScheme("int4", 8)) and triton_quant.takes_group(QuantScheme("int8"))


# --- the engine ----------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", [QuantScheme("int8", 0, True), QuantScheme("int4", 32, True)])
def test_engine_kernels_compiled_and_reference_agree(make_hf, tmp_path, scheme):
    """The one-call decode step (runner.engine.fused_decode), the compiled torch step and the reference kernels give
    the same logits; and the quantised model stays close to the float one."""
    src, model = make_hf("llama_mha")
    convert(str(src), str(tmp_path / "q"), progress=False, quant=scheme)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    ref = torch.stack(teacher_forced_logits(engine(tmp_path / "q", kernels="reference"), prompts, conts))
    fused_engine = engine(tmp_path / "q", compile="off")
    assert isinstance(fused_engine.runners[0], OneCallDecode)
    fast = torch.stack(teacher_forced_logits(fused_engine, prompts, conts))
    torch._dynamo.reset()
    compiled_engine = engine(tmp_path / "q", compile="on", fused_decode=False)
    assert isinstance(compiled_engine.runners[0], Compiled)
    compiled = torch.stack(teacher_forced_logits(compiled_engine, prompts, conts))
    torch._dynamo.reset()
    tol = model_tol(scheme.method)
    assert rel_err(fast, ref) < tol and rel_err(compiled, ref) < tol
    assert snr_db(fast, hf_logits(model, prompts, conts)) > (30 if scheme.method == "int8" else 12)
    assert rel_err(fast, hf_logits(model, prompts, conts)) > 1e-4  # really quantised


TP_CASES = {  # case: (HF overrides, scheme, ranks)
    "int8": ({}, QuantScheme("int8", 0, True), 2),
    "int4": ({}, QuantScheme("int4", 16, True), 2),
    "int4_padded": ({"intermediate_size": 62}, QuantScheme("int4", 2), 4),
}


def _tp_case(make_hf, base: Path, case: str):
    """(HF model, the quantised PMX dir, split in the case's ranks) of a test_quantized_tensor_parallel case."""
    overrides, scheme, n = TP_CASES[case]
    src, model = make_hf("llama_mha", **overrides)
    convert(str(src), str(base / "q"), progress=False, quant=scheme)
    reshard(str(base / "q"), str(base / f"q{n}"), n, progress=False)
    return model, base / "q", base / f"q{n}"


def _moe_case(make_hf, base: Path):
    """(HF model, the int8 Mixtral PMX dir, split in 2) of test_quantized_moe."""
    src, model = make_hf("mixtral")
    convert(str(src), str(base / "q"), progress=False, quant=QuantScheme("int8"))
    reshard(str(base / "q"), str(base / "q2"), 2, progress=False)
    return model, base / "q", base / "q2"


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    """This module's 2-rank mpirun runs of tests/tp_worker.py that this session asks for, in one launch (--batch):
    test_quantized_tensor_parallel's 2-rank cases, case -> (the case as _tp_case gives it, logits), and
    test_quantized_moe's, "moe" -> (the case as _moe_case gives it, logits)."""
    base, cases, jobs = tmp_path_factory.mktemp("qtp2"), {}, []
    for item in request.session.items:
        if item.originalname == "test_quantized_tensor_parallel" and TP_CASES[item.callspec.params["case"]][2] == 2:
            name = item.callspec.params["case"]
            cases[name] = case = _tp_case(hf_maker(base / name), base / name, name)
            jobs.append((case[2], [{}, {"kernels": "reference"}], *prompts_and_conts(case[0].config.vocab_size), None))
        elif item.originalname == "test_quantized_moe":
            cases["moe"] = case = _moe_case(hf_maker(base / "moe"), base / "moe")
            jobs.append((case[2], [{}], *prompts_and_conts(case[0].config.vocab_size), None))
    return {key: (case, logits) for (key, case), (logits, _) in zip(cases.items(), run_tp_batch(base, 2, jobs))}


@pytest.mark.parametrize("case", list(TP_CASES))
def test_quantized_tensor_parallel(make_hf, request, tmp_path, case):
    """TP = 2 (TP = 4 with int4 groups over a padded intermediate dim) under mpirun: as TP = 1, fast and reference
    kernels alike. (TP = 2: in the module's one 2-rank launch.)"""
    _, scheme, n = TP_CASES[case]
    if n == 2:
        (model, pmx, _), got = request.getfixturevalue("two_ranks")[case]
    else:
        model, pmx, split = _tp_case(make_hf, tmp_path, case)
        got = run_tp(tmp_path, split, n, [{}, {"kernels": "reference"}], *prompts_and_conts(model.config.vocab_size))
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    tp1 = torch.stack(teacher_forced_logits(engine(pmx), prompts, conts))
    assert len(got) == 2
    for g in got:
        assert rel_err(g, tp1) < model_tol(scheme.method)


def test_quantized_moe(request):
    """Mixtral: the stacked experts quantised (router float), TP = 2 as TP = 1, close to the float model. (TP = 2: in
    the module's one 2-rank launch.)"""
    (model, q, _), got = request.getfixturevalue("two_ranks")["moe"]
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    tp1 = torch.stack(teacher_forced_logits(engine(q), prompts, conts))
    assert snr_db(tp1, hf_logits(model, prompts, conts)) > 30
    assert rel_err(got[0], tp1) < 1e-5


def test_random_quantized_shard_runs():
    """bench --random_weights with a quantised params file: each rank's weights made and quantised in place."""
    p = PmxParams(model_type="llama", hidden_dim=64, intermediate_dim=128, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=16, vocab_size=80, norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                  dtype="float32", quantization=QuantScheme("int4", 32).to_dict())
    w = random_shard(sharded_params(p, 1), 0, torch.device("cpu"), torch.float32)
    assert w["layers.0.feed_forward.w2.qweight"].dtype == torch.uint8
    assert {"output.qweight", "tok_embeddings.qweight"} <= set(w) and "output.weight" not in w  # quantised by default
    c = EngineConfig()
    m = Transformer(sharded_params(p, 1), w, SingleComm(), c)
    out = EngineCore(m, Stepper(m, c), c).generate([[1, 2, 3]], 4)
    assert len(out[0]) == 4


# --- the quantised embedding ----------------------------------------------------------------------
@pytest.mark.parametrize("method,group,offset", [("int8", 0, False), ("int4", 16, False), ("int4", 2, False),
                                                 ("int8", 32, False), ("int4", 32, True)])
def test_quantised_embedding_rows_are_the_dequantised_rows(method, group, offset):
    """ParallelEmbedding on a QuantWeight gathers rows of the dequantised weight, bit for bit: by the spec on CPU and by
    the Triton kernel (compiled on CUDA, under the interpreter on CPU, which truncates to bfloat16 where GPUs round)."""
    w = weight(method, 50, 64, group, offset=offset)
    ids = torch.tensor([[3, 49, 0], [7, 7, 12]])
    assert torch.equal(ParallelEmbedding(w, 64, SingleComm())(ids), w.dequantize()[ids])
    triton_quant = pytest.importorskip("runner.kernels.triton_quant", reason="triton is not installed")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    o = None if w.offset is None else w.offset.to(dev)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        got = triton_quant.quant_embedding(ids.to(dev), w.qweight.to(dev), w.scale.to(dev), method, group, dt,
                                           o).cpu()
        want = quant_embedding(ids, w.qweight, w.scale, method, group, dt, w.offset)
        assert got.shape == (2, 3, 64) and got.dtype == dt
        if dt == torch.bfloat16 and dev.type == "cpu":
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
        else:
            assert torch.equal(got, want)
    assert triton_quant.quant_embedding(torch.empty(0, dtype=torch.int64), w.qweight, w.scale, method, group,
                                        torch.float32).shape == (0, 64)


def test_the_triton_set_gathers_the_embedding_with_its_kernel(make_hf, tmp_path):
    """--kernels triton: the model's embedding lookups run the Triton gather (on CUDA where there is one, else under
    the interpreter)."""
    pytest.importorskip("runner.kernels.triton_quant", reason="triton is not installed")
    src, model = make_hf("llama_mha")
    convert(str(src), str(tmp_path / "q"), progress=False, quant=QuantScheme("int4", 16))
    from runner.kernels import triton_quant
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    eng = engine(tmp_path / "q", dev, kernels="triton", compile="off")
    assert eng.model.tok_embeddings.quant_rows is triton_quant.quant_embedding
    ids = torch.tensor([1, 5, 9])
    ref = engine(tmp_path / "q", kernels="reference").model.tok_embeddings
    assert torch.equal(eng.model.tok_embeddings(ids.to(dev)).cpu(), ref(ids))


def test_quantised_embedding_size_and_files_written_before_it(make_hf, tmp_path):
    """The embedding (V x D) takes a quarter (int8: a row scale each) or an eighth (int4: a scale per group) of its
    float32 bytes plus scales. A model quantised before the embedding could be (its pmx_params.json without
    quantize_embedding) reads as one whose embedding is float: it loads, runs as before, splits and merges."""
    src, model = make_hf("llama_mha", vocab_size=256)
    V, D = 256, 64
    for scheme, want in ((QuantScheme("int8"), V * D + 4 * V), (QuantScheme("int4", 16), V * D // 2 + 4 * V * D // 16)):
        convert(str(src), str(tmp_path / scheme.method), progress=False, quant=scheme)
        rd = SafetensorsReader(tmp_path / scheme.method / "model.00.safetensors")
        assert rd.nbytes("tok_embeddings.qweight") + rd.nbytes("tok_embeddings.scale") == want
    old = tmp_path / "old"
    convert(str(src), str(old), progress=False, quant=QuantScheme("int8", 0, True, False))
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    before = torch.stack(teacher_forced_logits(engine(old), prompts, conts))
    params = json.loads((old / "pmx_params.json").read_text())
    del params["quantization"]["quantize_embedding"]
    (old / "pmx_params.json").write_text(json.dumps(params))
    assert SafetensorsReader(old / "model.00.safetensors").dtype("tok_embeddings.weight") == torch.float32
    assert torch.equal(torch.stack(teacher_forced_logits(engine(old), prompts, conts)), before)
    reshard(str(old), str(tmp_path / "old2"), 2, progress=False)
    reshard(str(tmp_path / "old2"), str(tmp_path / "old1"), 1, progress=False)
    a, b = SafetensorsReader(old / "model.00.safetensors"), SafetensorsReader(tmp_path / "old1" / "model.00.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a.get(k), b.get(k)) for k in a.keys())  # (the fingerprint
    assert PmxParams.load(tmp_path / "old1").quantization == params["quantization"]  # hashes the edited params)
    new = torch.stack(teacher_forced_logits(engine(tmp_path / "int8"), prompts, conts))  # embedding quantised too
    assert 30 < snr_db(new, before) < math.inf


# --- the real checkpoints -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tinystories-656k as float, int8 and int4 (groups of 32) PMX models."""
    src = shared_model_path("tinystories-656k")
    d = tmp_path_factory.mktemp("tiny")
    convert(str(src), str(d / "fp32"), progress=False)
    quantize_model(str(d / "fp32"), str(d / "int8"), QuantScheme("int8"), progress=False)
    quantize_model(str(d / "fp32"), str(d / "int4"), QuantScheme("int4", 32), progress=False)
    return d


def test_tinystories_int8_snr_and_greedy_text(tiny):
    """The issue's bar: int8 logits at SNR >= 25 dB against fp32, and the same greedy text for 20+ tokens."""
    prompts, conts = prompts_and_conts(2048)
    ref = torch.stack(teacher_forced_logits(engine(tiny / "fp32"), prompts, conts))
    int8 = torch.stack(teacher_forced_logits(engine(tiny / "int8"), prompts, conts))
    int4 = torch.stack(teacher_forced_logits(engine(tiny / "int4"), prompts, conts))
    assert snr_db(int8, ref) >= 25, snr_db(int8, ref)
    assert 8 < snr_db(int4, ref) < snr_db(int8, ref)
    from runner.engine.tokenizer import Tokenizer
    prompt = Tokenizer(str(tiny / "fp32")).encode("Once upon a time")
    want = core(tiny / "fp32").generate([prompt], 32)
    got = core(tiny / "int8").generate([prompt], 32)
    assert len(want[0]) == 32 and got == want


def test_perplexity_windows_and_values(tiny):
    spans = list(windows(20, 8, 3))
    scored = [t for _, end, first in spans for t in range(first, end)]
    assert scored == list(range(1, 20)) and all(end - begin <= 8 for begin, end, _ in spans)
    fp32 = perplexity(str(tiny / "fp32"), str(STORY), window=128, stride=64)
    int8 = perplexity(str(tiny / "int8"), str(STORY), window=128, stride=64)
    assert 1 < fp32["perplexity"] < 30 and fp32["tokens"] == int8["tokens"] > 300
    assert abs(int8["perplexity"] / fp32["perplexity"] - 1) < 0.05
    m = core(tiny / "fp32")  # one window over everything = the plain causal-LM loss of transformers
    ids = list(range(3, 60))
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(shared_model_path("tinystories-656k")).eval()
    with torch.no_grad():
        want = float(hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss)
    assert abs(evaluate(m, ids, 64, 32)["nll"] - want) < 1e-4
    # llama-perplexity's chunks: whole chunks, the tokens after the middle scored, each chunk's first token BOS
    assert list(chunks(20, 8)) == [(0, 8, 5), (8, 16, 13)]
    got, nll = evaluate(m, ids, 16, 8, "chunks", bos=1), 0.0
    with torch.no_grad():
        for b in range(0, len(ids) - 15, 16):
            chunk = [1] + ids[b + 1: b + 16]
            logits = hf(torch.tensor([chunk])).logits[0]
            nll += float(torch.nn.functional.cross_entropy(logits[8:15], torch.tensor(chunk[9:16]), reduction="sum"))
    assert got["tokens"] == 3 * 7 and abs(got["nll"] - nll / 21) < 1e-4


def test_perplexity_bad_input(tiny, tmp_path):
    res = run_cli("perplexity", "--ckpt_dir", tiny / "int8", "--text_file", STORY, "--window", 4096)
    assert res.returncode == 2 and "--window" in res.stderr and "512" in res.stderr, res.stderr
    res = run_cli("perplexity", "--ckpt_dir", tiny / "int8", "--text_file", tmp_path / "none.txt")
    assert res.returncode == 2 and "none.txt" in res.stderr and "Traceback" not in res.stderr
    with pytest.raises(PmxError, match="--stride"):
        perplexity(str(tiny / "int8"), str(STORY), window=16, stride=16)


def test_quantized_dump_and_replay(tiny, tmp_path):
    """A TP = 2 int8 run dumps its steps; benchmark.sh's replay runs them again bit for bit."""
    from test_replay import mpirun
    reshard(str(tiny / "int8"), str(tmp_path / "int8_2"), 2, progress=False)
    root = Path(__file__).resolve().parents[1]
    res = mpirun(2, sys.executable, root / "scripts" / "Demo.py", "--ckpt_dir", tmp_path / "int8_2", "--prompt",
                 "Once upon a time", "--max_gen_len", 8, "--dump_tensor_path", tmp_path / "dump", "--dump_steps", "0,3")
    assert res.returncode == 0, res.stderr[-3000:]
    res = mpirun(2, root / "scripts" / "benchmark.sh", 3,
                 env={"MODEL_PATH": str(tmp_path / "int8_2"), "TEST_DATA_DIR": str(tmp_path / "dump"),
                      "OUTPUT_DIR": str(tmp_path / "replay"), "MIN_PROFILING_SECONDS": "0.1",
                      "PYTHON": sys.executable})
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]


@pytest.mark.skipif(cpu_ops() is None, reason="this project's CPU extension could not be built here")
@pytest.mark.parametrize("method,group,offset", [("float32", 0, False), ("int8", 0, False), ("int8", 32, False),
                                                 ("int4", 32, False), ("int4", 2, False), ("int4", 32, True)])
@pytest.mark.parametrize("m", [1, 3, 16, CPU_KERNEL_MAX_ROWS + 8])
def test_linear_into_writes_what_the_layer_returns(method, group, offset, m):
    """pmx_cpu.linear_into_ (sequence parallelism's GEMM into a shared-memory area, the one-call decode step's linears)
    on a packed layer of any kind: the bits the layer's own forward returns, at streaming and at prefill
    (dequantising) row counts; a wrong buffer is refused by name."""
    lin = Linear(torch.randn(130, 96) * 0.05, kernel="pmx") if method == "float32" else \
        make_linear(weight(method, 130, 96, group, offset=offset))
    args, x = packed_args(lin), torch.randn(m, 96)
    assert args is not None and args[2] == {"float32": 32, "int8": 8, "int4": 4}[method]
    out = torch.full((m, 130), float("nan"))
    torch.ops.pmx_cpu.linear_into_(x, *args, 130, CPU_KERNEL_MAX_ROWS, out)
    assert torch.equal(out, lin(x))
    with pytest.raises(RuntimeError, match="linear_into_: out must be contiguous float32 of"):
        torch.ops.pmx_cpu.linear_into_(x, *args, 130, CPU_KERNEL_MAX_ROWS, torch.empty(m, 129))
    with pytest.raises(RuntimeError, match=r"linear_into_: x must be contiguous float32 \[M, 96\]"):
        torch.ops.pmx_cpu.linear_into_(torch.randn(m, 95), *args, 130, CPU_KERNEL_MAX_ROWS, out)
