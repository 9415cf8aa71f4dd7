"""The engine against transformers on the same weights, in one process and tensor-parallel."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from runner.config import EngineConfig
from runner.engine.core import EngineCore
from runner.engine.model import Transformer, load_shard
from runner.engine.runners import Stepper
from runner.errors import PmxError
from runner.parallel.comm import SingleComm
from runner.pmx.convert import convert, reshard
from tp_worker import teacher_forced_logits

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16


def prompts_and_conts(vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    lens = (7, 1, 12)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    conts = [torch.randint(3, vocab, (STEPS,), generator=g).tolist() for _ in lens]
    return prompts, conts


@torch.no_grad()
def hf_logits(model, prompts, conts) -> torch.Tensor:
    """[STEPS + 1, B, V]: transformers' logits at the positions the engine produces them: each prompt and its
    continuation in one call; where the rope depends on the length so far (LongRoPE), as transformers decodes, the
    prompt and then one token a call over the cache."""
    per_seq = []
    rope = getattr(model.config, "rope_parameters", None) or {}
    for p, c in zip(prompts, conts):
        if rope.get("rope_type") == "longrope":
            out = model(torch.tensor([p]), use_cache=True)
            rows = [out.logits[0, -1]]
            for t in c[:STEPS]:
                out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
                rows.append(out.logits[0, -1])
            per_seq.append(torch.stack(rows).float())
            continue
        logits = model(torch.tensor([p + c])).logits[0].float()
        per_seq.append(logits[len(p) - 1: len(p) + STEPS])
    return torch.stack(per_seq, dim=1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def engine(pmx_dir, device="cpu", dtype=torch.float32, **options) -> Stepper:
    """One rank's model and its step runners, in this process."""
    config = EngineConfig(device=torch.device(device).type, **options)
    params, w = load_shard(pmx_dir, 0, torch.device(device), dtype)
    return Stepper(Transformer(params, w, SingleComm(), config), config)


def core(pmx_dir, **options) -> EngineCore:
    """One rank's engine core (continuous batching over the model), in this process."""
    stepper = engine(pmx_dir, **options)
    return EngineCore(stepper.model, stepper, stepper.config)


@pytest.mark.parametrize("arch", ["llama_mha", "llama_gqa_odd", "llama_bias", "mistral", "qwen2"])
def test_matches_transformers_every_cache_layout_and_mode(make_hf, tmp_path, arch):
    src, model = make_hf(arch)
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    ref = hf_logits(model, prompts, conts)
    for layout, mode, fused in itertools.product(range(4), (0, 1), (True, False)):
        got = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx", cache_layout=layout, cache_mode=mode,
                                                       fused_kvcache=fused), prompts, conts))
        assert rel_err(got, ref) < 1e-4, (layout, mode, fused, rel_err(got, ref))


def test_unfused_options_match(make_hf, tmp_path):
    src, model = make_hf("llama_gqa_odd")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    ref = hf_logits(model, prompts, conts)
    got = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx", fused_qkv=False, fused_ffn_glu=False,
                                                   friendly_gqa=True), prompts, conts))
    assert rel_err(got, ref) < 1e-4


def test_int8_cache_close_to_transformers(make_hf, tmp_path):
    src, model = make_hf("llama_mha")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    ref = hf_logits(model, prompts, conts)
    for layout, mode in itertools.product(range(4), (0, 1)):
        got = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx", quantized_cache=True, cache_layout=layout,
                                                       cache_mode=mode), prompts, conts))
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
        cos = torch.nn.functional.cosine_similarity(got.flatten(1), ref.flatten(1)).min()
        assert cos >= 0.999, float(cos)
        assert rel_err(got, ref) > 0  # it really is quantised


def run_tp(tmp_path, pmx, n, options, prompts, conts, launcher="mpirun", env=None, comm_backend="auto",
           with_info=False, spec_extra=None):
    """Rank 0's logits [option sets, steps, B, V] of tests/tp_worker.py on n ranks; with_info: and, per option set,
    which steps the engine took ({"fused_decode": bool, "seq_parallel": bool, "reduce_norm": calls, "in_place":
    calls whose partial was written in the shared area}: tests/tp_worker.py); spec_extra: more of the worker's
    spec (e.g. {"generate": n}: greedy ids too, in the info's "generated")."""
    out = tmp_path / f"logits-{launcher}-{n}-{uuid.uuid4().hex[:8]}.pt"
    launch_worker(n, [str(pmx), str(out), json.dumps(options),
                      json.dumps({"prompts": prompts, "conts": conts, **(spec_extra or {})}), comm_backend],
                  launcher, env)
    logits = torch.load(out, weights_only=True)
    return (logits, json.loads(Path(f"{out}.json").read_text())) if with_info else logits


def launch_worker(n: int, args: list, launcher: str = "mpirun", env=None, timeout: float = 300) -> None:
    """tests/tp_worker.py ARGS on n ranks under mpirun or torchrun; fails the test with its stderr if it fails."""
    worker = [str(ROOT / "tests" / "tp_worker.py"), *args]
    cmd = [str(ROOT / "scripts" / "mpirun.sh"), "-np", str(n), sys.executable, *worker] if launcher == "mpirun" else \
        [sys.executable, "-m", "runner.parallel.torchrun", "--standalone", "--nproc_per_node", str(n), *worker]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert res.returncode == 0, res.stderr[-3000:]


def run_tp_batch(tmp_path, n, jobs: list, launcher="mpirun") -> list:
    """run_tp(..., with_info=True) for each job (pmx, options, prompts, conts, spec_extra[, env]) on the same n ranks
    in one launch (tests/tp_worker.py --batch; `env`: variables set in the ranks while that job runs, e.g.
    {"PMX_SHM_COMM": "0"}): [(logits, info)] in the jobs' order."""
    tag = uuid.uuid4().hex[:8]
    spec = [{"ckpt": str(pmx), "out": str(tmp_path / f"logits-batch-{tag}-{i}.pt"), "options": options,
             "spec": {"prompts": prompts, "conts": conts, **(extra or {})}, "env": dict(env[0]) if env else {}}
            for i, (pmx, options, prompts, conts, extra, *env) in enumerate(jobs)]
    (tmp_path / f"batch-{tag}.json").write_text(json.dumps(spec))
    launch_worker(n, ["--batch", str(tmp_path / f"batch-{tag}.json")], launcher, timeout=120 + 60 * len(jobs))
    return [(torch.load(j["out"], weights_only=True), json.loads(Path(j["out"] + ".json").read_text())) for j in spec]


def asked_for(request, test: str, n: int | None = None) -> list:
    """The `name` parameters of this session's cases of `test` (at n ranks, where given: its `n` parameter), for a
    fixture running them in one launch."""
    return [item.callspec.params["name"] for item in request.session.items
            if item.originalname == test and (n is None or item.callspec.params["n"] == n)]


ALL_CACHES = [{"cache_layout": l, "cache_mode": m, "fused_kvcache": f}
              for l, m, f in itertools.product(range(4), (0, 1), (True, False))]


def _tp_case(make_hf, base: Path, arch: str, n: int):
    """(HF model, its PMX dir, split in n, the worker's option sets, whether they include the int8 cache) of a case
    of test_tensor_parallel_matches_transformers."""
    src, model = make_hf(arch)
    convert(str(src), str(base / "pmx"), progress=False)
    reshard(str(base / "pmx"), str(base / f"pmx{n}"), n, progress=False)
    with_int8 = model.config.head_dim % 8 == 0 if hasattr(model.config, "head_dim") else True
    option_sets = ALL_CACHES + ([{"quantized_cache": True, "cache_layout": 1, "cache_mode": 1}] if with_int8 else [])
    return model, base / "pmx", base / f"pmx{n}", option_sets, with_int8


HALF_TP_OPTIONS = [{}, {"fused_decode": False}, {"fused_decode": False, "seq_parallel": False}]


def _half_case(make_hf, base: Path):
    """(HF model, its bfloat16 PMX dir, split in 2) of test_half_precision_tensor_parallel_matches_one_rank: an MLP of
    2 x 64 channels a rank, which the gate | up projection activates in bfloat16 where the CPU has AVX512-BF16."""
    src, model = make_hf("llama_gqa_odd", **{**HALF_CPU_SHAPE, "intermediate_size": 256})
    convert(str(src), str(base / "pmx"), dtype="bfloat16", progress=False)
    reshard(str(base / "pmx"), str(base / "pmx2"), 2, progress=False)
    return model, base / "pmx", base / "pmx2"


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    """This module's 2-rank mpirun runs of tests/tp_worker.py that this session asks for, in one launch (--batch):
    test_tensor_parallel_matches_transformers's cases at n = 2, arch -> (the case as _tp_case gives it, logits, info),
    and test_half_precision_tensor_parallel_matches_one_rank's, "half" -> (the case as _half_case gives it, logits,
    info)."""
    from conftest import hf_maker
    base, cases, jobs = tmp_path_factory.mktemp("tp2"), {}, []
    for item in request.session.items:
        if item.originalname == "test_tensor_parallel_matches_transformers" and item.callspec.params["n"] == 2:
            arch = item.callspec.params["arch"]
            cases[arch] = case = _tp_case(hf_maker(base / arch), base / arch, arch, 2)
            jobs.append((case[2], case[3], *prompts_and_conts(case[0].config.vocab_size), None))
        elif item.originalname == "test_half_precision_tensor_parallel_matches_one_rank":
            cases["half"] = case = _half_case(hf_maker(base / "half"), base / "half")
            jobs.append((case[2], HALF_TP_OPTIONS, *prompts_and_conts(case[0].config.vocab_size), None))
    return {key: (case, *res) for (key, case), res in zip(cases.items(), run_tp_batch(base, 2, jobs))}


@pytest.mark.parametrize("arch,n", [("llama_gqa_odd", 2), ("llama_gqa_odd", 4), ("qwen2", 2),
                                    pytest.param("qwen2", 4, marks=pytest.mark.extended), pytest.param("llama_bias", 4, marks=pytest.mark.extended)])
def test_tensor_parallel_matches_transformers(make_hf, request, tmp_path, arch, n):
    """TP = n against transformers and TP = 1, for every cache layout, both cache modes, both attentions,
    and the int8 cache. (n = 2: every architecture in one launch.)"""
    if n == 2:
        (model, pmx, _, option_sets, with_int8), results, _ = request.getfixturevalue("two_ranks")[arch]
    else:
        model, pmx, split, option_sets, with_int8 = _tp_case(make_hf, tmp_path, arch, n)
        results = run_tp(tmp_path, split, n, option_sets, *prompts_and_conts(model.config.vocab_size))
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    ref = hf_logits(model, prompts, conts)
    tp1 = torch.stack(teacher_forced_logits(engine(pmx), prompts, conts))
    for options, got in zip(ALL_CACHES, results):
        assert rel_err(got, ref) < 1e-4, (options, rel_err(got, ref))
        assert rel_err(got, tp1) < 1e-4
    if with_int8:
        int8 = results[-1]
        assert torch.equal(int8.argmax(-1), ref.argmax(-1))
        assert torch.nn.functional.cosine_similarity(int8.flatten(1), ref.flatten(1)).min() >= 0.999
    else:
        with pytest.raises(PmxError, match="head_dim divisible by 8"):
            engine(pmx, quantized_cache=True)


HALF_CPU_SHAPE = dict(hidden_size=128, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      vocab_size=300)  # every linear packed (>= PREPACK_MIN_NUMEL), N and K off multiples of 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_keeps_its_width_on_cpu(make_hf, tmp_path, dtype):
    """--dtype auto on CPU keeps a bfloat16 / float16 checkpoint's linear weights and embedding at their width, packed
    for this project's kernels, with norms, activations and the KV cache in float32: the logits match transformers
    computing in float32 on the same weights, on the eager step and the one-call C++ decode step alike; --dtype float32
    upcasts every weight, to the same logits up to float32 summation order. Where the CPU has AVX512-BF16, bfloat16
    weights multiply their input rounded to bfloat16 (vdpbf16ps, exact to that rounding: test_kernels): the logits
    then stay within the rounding's own spread of the float32 ones (~2e-3 of the largest here; transformers with
    every linear's input rounded the same way is as far, its own float32 differences flipping some roundings)."""
    from runner.engine.session import open_session
    from runner.kernels.cpu_ext import bf16_k_pairs
    from runner.kernels.linear import Linear
    src, model = make_hf("llama_gqa_odd", **HALF_CPU_SHAPE)
    convert(str(src), str(tmp_path / "pmx"), dtype=str(dtype).removeprefix("torch."), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    ref = hf_logits(model.to(dtype).float(), prompts, conts)  # (the checkpoint's values, float32 arithmetic)
    rounded = dtype == torch.bfloat16 and bf16_k_pairs()
    tolerance = {"auto": 5e-3 if rounded else 1e-4, "float32": 1e-4}
    got = {}
    for flag, fused in (("auto", True), ("auto", False), ("float32", True)):
        sess = open_session(str(tmp_path / "pmx"), EngineConfig(dtype=flag, fused_decode=fused))
        m = sess.model
        linears = [x for x in m.modules() if isinstance(x, Linear)]
        want = dtype if flag == "auto" else torch.float32
        assert (m.dtype, m.weight_dtype, m.new_cache(8)[0].dtype) == (torch.float32, want, torch.float32)
        assert len(linears) == 9 and all(x.kernel == "pmx" and x.packed.dtype == want for x in linears)
        assert m.tok_embeddings.weight.dtype == want and m.norm.weight.dtype == torch.float32
        assert ("one-call C++ decode" in sess.stepper.describe()) == fused
        got[flag, fused] = torch.stack(teacher_forced_logits(sess.stepper, prompts, conts))
        assert rel_err(got[flag, fused], ref) < tolerance[flag], (flag, fused, rel_err(got[flag, fused], ref))
        sess.close()
    assert rel_err(got["auto", True], got["float32", True]) < (5e-3 if rounded else 1e-5)


def test_bf16_steps_fuse_the_norms_and_the_activation_into_the_linears(make_hf, tmp_path, monkeypatch):
    """On bfloat16 weights with AVX512-BF16 a step runs no norm kernel and no float32 MLP activation: each RMSNorm is
    computed as the next linear rounds its input, the residual added as the linear before it stores its output, and
    SwiGLU as the gate | up projection stores its output, in bfloat16 (what the down projection's dot products round it
    to). The logits equal those of the unfused step bit for bit (the same float32 values, rounded the same way), and
    transformers' within bfloat16's spread."""
    from runner.engine.session import open_session
    from runner.kernels.cpu_ext import bf16_k_pairs, cpu_ops
    from runner.kernels.linear import Linear
    if cpu_ops() is None or not bf16_k_pairs():
        pytest.skip("bfloat16 dot products need this project's CPU kernels on a CPU with AVX512-BF16")
    src, model = make_hf("llama_gqa_odd", **{**HALF_CPU_SHAPE, "intermediate_size": 256})
    convert(str(src), str(tmp_path / "pmx"), dtype="bfloat16", progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    ref = hf_logits(model.to(torch.bfloat16).float(), prompts, conts)
    calls = []  # the norm op's calls, and the linears' that return the activation in bfloat16
    norm_op, linear_op = torch.ops.pmx_cpu.skip_rms_norm, torch.ops.pmx_cpu.linear_f32_fused
    monkeypatch.setattr(torch.ops.pmx_cpu, "skip_rms_norm", lambda *a: calls.append("norm") or norm_op(*a))
    monkeypatch.setattr(torch.ops.pmx_cpu, "linear_f32_fused",
                        lambda *a: (calls.append("glu") if a[-1] is True else None) or linear_op(*a))
    got = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(Linear, "takes_glu_out", lambda self, x: False)
        sess = open_session(str(tmp_path / "pmx"), EngineConfig(fused_decode=False, norm_in_linears=fused))
        calls.clear()
        got[fused] = torch.stack(teacher_forced_logits(sess.stepper, prompts, conts))
        sess.close()
        assert ("norm" in calls, "glu" in calls) == (not fused, fused), calls
        assert rel_err(got[fused], ref) < 5e-3
    assert torch.equal(got[True], got[False])


def test_matrix_dtype_is_the_checkpoints_only_where_the_cpu_kernels_read_it(monkeypatch):
    """auto on CPU: a half-precision checkpoint's own width for the linear weights where this project's kernels are
    built and prepacking is on; otherwise (and for --dtype float32, a float32 checkpoint) the compute dtype."""
    from runner.engine import session
    from runner.kernels.cpu_ext import cpu_ops
    cpu = torch.device("cpu")
    want = torch.bfloat16 if cpu_ops() is not None else torch.float32
    assert session.pick_matrix_dtype("auto", "bfloat16", cpu) == want
    assert session.pick_matrix_dtype("auto", "float16", cpu) == (torch.float16 if want != torch.float32 else want)
    for flags in (("float32", "bfloat16", cpu), ("auto", "float32", cpu)):
        assert session.pick_matrix_dtype(*flags) == torch.float32
    assert session.pick_matrix_dtype("auto", "bfloat16", cpu, prepack=False) == torch.float32
    assert session.pick_matrix_dtype("auto", "bfloat16", torch.device("cuda")) == torch.bfloat16  # (compute dtype)
    monkeypatch.setattr(session, "cpu_ops", lambda: None)
    assert session.pick_matrix_dtype("auto", "bfloat16", cpu) == torch.float32


def test_half_precision_tensor_parallel_matches_one_rank(request, tmp_path):
    """A bfloat16 checkpoint at TP = 2 (weights at their width on each rank, the one-call step and sequence
    parallelism) against TP = 1 and transformers in float32. (TP = 2: in the module's one 2-rank launch.) Where the CPU
    has AVX512-BF16 the linears multiply their input rounded to bfloat16, and the rounding's spread (~2e-3: see
    test_half_precision_checkpoint_keeps_its_width_on_cpu) is the tolerance of both."""
    from runner.kernels.cpu_ext import bf16_k_pairs
    (model, pmx, _), tp2, info = request.getfixturevalue("two_ranks")["half"]
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    ref = hf_logits(model.to(torch.bfloat16).float(), prompts, conts)
    tp1 = run_tp(tmp_path, pmx, 1, [{}], prompts, conts)[0]
    assert [i["weight_dtype"] for i in info] == ["torch.bfloat16"] * 3
    assert [(i["fused_decode"], i["seq_parallel"]) for i in info] == [(True, True), (False, True), (False, False)]
    rounded = bf16_k_pairs()
    for got in tp2:
        assert rel_err(got, tp1) < (5e-3 if rounded else 1e-5) and rel_err(got, ref) < (5e-3 if rounded else 1e-4)


def test_tensor_parallel_under_torchrun(make_hf, tmp_path):
    src, model = make_hf("llama_gqa_odd")
    convert(str(src), str(tmp_path / "pmx2"), num_shards=2, progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    got = run_tp(tmp_path, tmp_path / "pmx2", 2, [{"cache_layout": 1}], prompts, conts, launcher="torchrun")[0]
    assert rel_err(got, hf_logits(model, prompts, conts)) < 1e-4


def test_decode_reads_a_cache_of_another_float_dtype(make_hf, tmp_path):
    """A float32 engine stepping on a float16 cache (ppl.pmx's forward with a cache of the caller's dtype): decode
    reads it (gathered and cast, where the in-place CPU kernel takes float32 and int8 caches only), with the
    same logits, to float16 rounding, as on a float32 cache."""
    src, _ = make_hf("llama_gqa_odd")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    m = engine(tmp_path / "pmx", compile="off")
    T = 5
    outs = []
    for cache in (m.model.new_cache(64)[0], m.model.new_cache(64)[0].half()):
        m.forward(torch.arange(3, 3 + T), torch.empty(0), torch.tensor([0, T]), torch.tensor([0, T]),
                  torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), torch.tensor([T]), torch.tensor([T]), cache)
        outs.append(m.forward(torch.tensor([9]), torch.empty(0), torch.tensor([0, 1]), torch.tensor([0, T + 1]),
                              torch.tensor([0]), torch.tensor([1]), torch.tensor([T]), torch.tensor([1]),
                              torch.tensor([T + 1]), cache))
    assert rel_err(outs[1], outs[0]) < 1e-2


def test_cpu_cache_budget_is_shared_by_the_ranks_of_a_host_and_counts_the_draft(monkeypatch):
    """Without --kv_cache_tokens a CPU cache gets a quarter of the host's available memory: shared by the ranks on
    each host (every rank's cache is written at a server's start), a draft model's cache of as many rows counted in."""
    from types import SimpleNamespace
    from runner.engine import cache as cache_mod
    from runner.engine.cache import CPU_CACHE_MEMORY_FRACTION, CacheBudget
    from runner.kernels.reference import PAGE_SIZE
    monkeypatch.setattr(cache_mod, "available_memory", lambda: 1 << 34)
    page = 1 << 20

    def budget(world, machines, draft_page=None):
        draft = [] if draft_page is None else [SimpleNamespace(page_bytes=lambda: draft_page)]
        me = SimpleNamespace(config=SimpleNamespace(kv_cache_tokens=None, paged=True),
                             model=SimpleNamespace(device=torch.device("cpu")),
                             comm=SimpleNamespace(world_size=world, machines=machines, broadcast_=lambda t: t),
                             page_bytes=lambda: page)
        return CacheBudget.rows(me, 10 ** 9, draft)

    alone = budget(1, 1)
    assert alone == int((1 << 34) * CPU_CACHE_MEMORY_FRACTION // page) * PAGE_SIZE
    assert budget(4, 1) == alone // 4 and budget(4, 2) == alone // 2 and budget(3, 2) == alone // 2
    assert budget(1, 1, draft_page=page) == alone // 2
    assert budget(1, 1, draft_page=page) < budget(1, 1, draft_page=page // 8) < alone
