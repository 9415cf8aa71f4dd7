"""Generation end to end: the real checkpoints' reference ids at every TP size, dynamic batching,
sampling (ranks that die: test_faults.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.engine.core import EngineCore
from runner.engine.sampler import NonFiniteLogits, Sampler, SamplingParams
from runner.engine.tokenizer import Tokenizer
from runner.pmx.convert import convert, reshard
from jobs import run_cli_here
from test_engine import core

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = {  # ../shared/models/*/SOURCE.md: prompt "Once upon a time", 40 greedy ids
    "stories260k": [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408, 419,
                    292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268,
                    388, 426],
    "tinystories-656k": [313, 598, 303, 1049, 1468, 267, 628, 333, 94, 1210, 263, 251, 604, 94, 1030, 94, 1030, 94,
                         436, 220, 1053, 615, 303, 328, 552, 319, 1269, 163, 1945, 897, 645, 1188, 108, 319, 135, 448,
                         563, 1799, 1380, 1067],
}


@pytest.fixture(scope="module")
def split_models(tmp_path_factory):
    """{(name, n): pmx dir} for the real checkpoints, split 1, 2, 4, 8 ways."""
    from conftest import SHARED_MODELS
    out = {}
    base = tmp_path_factory.mktemp("real")
    for name in REFERENCE:
        src = SHARED_MODELS / name
        if not (src / "config.json").is_file():
            continue
        convert(str(src), str(base / name / "s1"), progress=False)
        for n in (2, 4, 8):
            reshard(str(base / name / "s1"), str(base / name / f"s{n}"), n, progress=False)
            out[(name, n)] = base / name / f"s{n}"
        out[(name, 1)] = base / name / "s1"
    return out


def demo(launcher: str, n: int, ckpt: Path, *flags) -> subprocess.CompletedProcess:
    args = [str(ROOT / "scripts" / "Demo.py"), "--ckpt_dir", str(ckpt), *map(str, flags)]
    if launcher == "mpirun":
        cmd = [str(ROOT / "scripts" / "mpirun.sh"), "-np", str(n), sys.executable, *args]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "runner.parallel.torchrun", "--standalone", "--nproc_per_node", str(n), *args]
    else:
        cmd = [sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def ids_of(stdout: str) -> list[list[int]]:
    return [eval(m) for m in re.findall(r"^ids: (\[.*\])$", stdout, re.M)]  # noqa: S307 (our own output)


# The default run: each model at 2 ranks under mpirun, and stories260k in one process. The rest (--extended) are rank
# counts and launchers through the same code: tinystories-656k in one process, torchrun (whose generation the default
# run checks in test_engine, test_multihost, test_serve_features and the README's blocks), and 8 ranks.
CASES = [("stories260k", "single", 1), ("stories260k", "mpirun", 2),
         pytest.param("stories260k", "torchrun", 4, marks=pytest.mark.extended),
         pytest.param("stories260k", "mpirun", 8, marks=pytest.mark.extended)] \
    + [pytest.param("tinystories-656k", "single", 1, marks=pytest.mark.extended), ("tinystories-656k", "mpirun", 2),
       pytest.param("tinystories-656k", "torchrun", 2, marks=pytest.mark.extended)]


@pytest.mark.parametrize("name,launcher,n", CASES)
def test_real_model_reference_ids(split_models, name, launcher, n):
    if (name, n) not in split_models:
        pytest.skip(f"../shared/models/{name} not found")
    res = demo(launcher, n, split_models[(name, n)], "--prompt", "Once upon a time", "--max_gen_len", 40,
               "--show_ids")
    assert res.returncode == 0, res.stderr[-3000:]
    assert ids_of(res.stdout) == [REFERENCE[name]], res.stdout  # printed once: only rank 0 writes output
    assert res.stdout.startswith("prepared 1 prompts\n")  # before generating
    # progress on stderr, from rank 0 only: loading its shard, then sequences done and tokens/s; no warnings
    assert res.stderr.count("loading model.00.safetensors: 100%") == 1 and "model.01" not in res.stderr
    assert re.search(r"generating: 100%.*1/1 .*40 tokens, [0-9.]+ tokens/s", res.stderr), res.stderr
    assert "Warning" not in res.stderr.replace("OMP_NUM_THREADS", ""), res.stderr


def test_comm_backend_flag(split_models):
    """--comm_backend gloo gives one rank a torch.distributed group (on CPU here) and the same ids; a backend that
    does not exist is refused by name before anything loads."""
    if ("stories260k", 1) not in split_models:
        pytest.skip("../shared/models/stories260k not found")
    res = demo("single", 1, split_models[("stories260k", 1)], "--prompt", "Once upon a time", "--max_gen_len", 40,
               "--show_ids", "--comm_backend", "gloo")
    assert res.returncode == 0, res.stderr[-3000:]
    assert ids_of(res.stdout) == [REFERENCE["stories260k"]]
    res = run_cli_here("generate", "--ckpt_dir", split_models[("stories260k", 1)], "--comm_backend", "ucc")  # (the
    # flags are read before anything loads: Demo.py's generate in this process)
    assert res.returncode == 2 and "--comm_backend must be one of auto, mpi, torch, nccl, gloo, got 'ucc'" in res.stderr


def stories_engine(split_models, **options) -> EngineCore:
    if ("stories260k", 1) not in split_models:
        pytest.skip("../shared/models/stories260k not found")
    return core(split_models[("stories260k", 1)], **options)


@pytest.mark.parametrize("options", [dict(context_chunking=False, max_batch=8),
                                     dict(cache_mode=1, cache_layout=2, context_chunk_size=5, max_batch=2),
                                     dict(fused_kvcache=False, context_chunk_size=3, max_batch=1),
                                     dict(max_num_batched_tokens=4, context_chunk_size=3, max_batch=3)])
def test_unaligned_batch_equals_each_alone(split_models, options):
    """Prompts of different lengths batched together (waiting for room, prefilled in chunks) generate what each
    does alone."""
    tok = Tokenizer(str(split_models[("stories260k", 1)] / "tokenizer.model"))
    prompts = [tok.encode(t) for t in ("Once upon a time", "The cat", "Lily and Tom went to the big park with")]
    alone = [stories_engine(split_models).generate([p], 24)[0] for p in prompts]
    together = stories_engine(split_models, **options).generate(prompts, 24)
    assert together == alone
    assert alone[0] == REFERENCE["stories260k"][:24]


def test_eos_stops_and_frees(split_models):
    eng = stories_engine(split_models)
    tok = Tokenizer(str(split_models[("stories260k", 1)] / "tokenizer.model"))
    p = tok.encode("Once upon a time")
    out = eng.generate([p, p], 40, stop_ids=[REFERENCE["stories260k"][10]])
    assert out == [REFERENCE["stories260k"][:10]] * 2
    assert eng.scheduler.allocator.used == 0 and not eng.has_work()


def test_progress_counts_the_tokens_the_summary_counts(split_models):
    """Demo's bar and its summary line agree (issue 29 item 7: 135 against 134): a sequence that ends on EOS counts
    the tokens it returns, not the EOS; every sequence is counted done once."""
    eng = stories_engine(split_models)
    tok = Tokenizer(str(split_models[("stories260k", 1)] / "tokenizer.model"))
    prompts = [tok.encode(t) for t in ("Once upon a time", "The cat", "Once upon a time")]
    calls = []
    out = eng.generate(prompts, 40, stop_ids=[REFERENCE["stories260k"][10]],
                       progress=lambda new, done: calls.append((new, done)))
    assert [len(o) for o in out][::2] == [10, 10] and len(out[1]) <= 40  # two end on the stop token, one maybe not
    assert sum(new for new, _ in calls) == sum(len(o) for o in out), (calls, out)
    assert calls[-1][1] == len(prompts) and [d for _, d in calls] == sorted(d for _, d in calls)


def test_sampling_seeded_and_bounded():
    logits = torch.randn(4, 50)
    a = Sampler(SamplingParams(temperature=0.8, top_k=5, seed=3))(logits)
    b = Sampler(SamplingParams(temperature=0.8, top_k=5, seed=3))(logits)
    assert torch.equal(a, b)
    top5 = logits.topk(5).indices
    for _ in range(20):
        s = Sampler(SamplingParams(temperature=1.0, top_k=5))(logits)
        assert all(int(t) in top5[i].tolist() for i, t in enumerate(s))
    peaked = torch.full((1, 10), -10.0)
    peaked[0, 7] = 10.0
    assert Sampler(SamplingParams(temperature=1.0, top_p=0.5))(peaked).item() == 7
    assert torch.equal(Sampler(SamplingParams())(logits), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-30, 1e300, 1.7e308])
def test_sampling_safe_at_extreme_temperatures(temperature):
    """A temperature of 1e-300 used to overflow logits / temperature into inf and NaN probabilities (multinomial
    raised, and the server's engine loop with it): tiny ones now draw the argmax, huge ones stay a distribution."""
    logits = torch.randn(3, 64) * 30
    logits[1, 5] = float("-inf")
    for top_k, top_p in ((0, 1.0), (5, 0.5), (1, 1e-9)):
        s = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=1))
        p = s.probs(logits)
        assert p.isfinite().all() and (p >= 0).all() and (p.sum(-1) > 0).all(), (temperature, top_k, top_p)
        tok = s(logits)
        if temperature < 1e-20 or top_k == 1:
            assert torch.equal(tok, logits.argmax(-1))
        accepted, nxt = s.verify(logits, [int(logits[0].argmax())])
        assert 0 <= accepted <= 1 and 0 <= nxt < 64


def test_sampling_survives_nonfinite_logits():
    logits = torch.randn(3, 16)
    logits[1] = float("-inf")  # (every token forbidden: its greedy token, not an exception)
    logits[2, 3] = float("inf")
    tok = Sampler(SamplingParams(temperature=0.7, seed=0))(logits)
    assert tok.shape == (3,) and tok[2].item() == 3 and all(0 <= t < 16 for t in tok.tolist())
    logits[0, 5] = float("nan")  # read as -inf
    assert Sampler(SamplingParams(temperature=0.7, seed=0))(logits)[0].item() != 5
    logits[0] = float("nan")  # a broken model: said so, for a sampled row and an adjusted greedy one
    for params in (SamplingParams(temperature=0.7, seed=0), SamplingParams(temperature=0, presence_penalty=1.0)):
        with pytest.raises(NonFiniteLogits, match="logits are all NaN in 1 of 3 row"):
            Sampler(params, history=[1, 2])(logits)


def test_sampled_generation_same_on_all_ranks(split_models):
    if ("stories260k", 2) not in split_models:
        pytest.skip("../shared/models/stories260k not found")
    flags = ("--prompt", "Once upon a time", "--max_gen_len", 30, "--temperature", 0.9, "--top_p", 0.9, "--seed", 7,
             "--show_ids")
    a = demo("mpirun", 2, split_models[("stories260k", 2)], *flags)
    b = run_cli_here("generate", "--ckpt_dir", split_models[("stories260k", 1)], *flags)  # (one rank: in this process)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert ids_of(a.stdout) == ids_of(b.stdout) and ids_of(a.stdout)[0] != REFERENCE["stories260k"][:30]


def test_wrong_number_of_ranks(split_models):
    if ("stories260k", 2) not in split_models:
        pytest.skip("../shared/models/stories260k not found")
    res = demo("single", 1, split_models[("stories260k", 2)])
    assert res.returncode == 2 and "split into 2 shard(s) but 1 rank(s)" in res.stderr
