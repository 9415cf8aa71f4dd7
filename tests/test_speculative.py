"""Speculative decoding (runner.engine.speculative, the core's verification step, Sampler.verify): the n-gram
proposer, greedy output token for token as without speculation, sampled output with the target's distribution."""

from __future__ import annotations

import pytest
import torch

from runner.engine.sampler import Sampler, SamplingParams
from runner.engine.speculative import NgramProposer
from runner.errors import PmxError
from test_engine import core


def test_ngram_proposer_takes_the_latest_longest_match():
    p = NgramProposer(k=3, n_max=3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3]) == [8, 7, 1]   # "1 2 3" last seen before 8 7 1
    assert p.propose([5, 6, 7, 5, 6]) == [7, 5, 6]                       # n = 2 ("5 6"), then what followed
    assert p.propose([4, 1, 2]) == []                                    # no earlier occurrence of anything
    assert p.propose([256, 1, 0, 0, 1]) == [0, 0, 1]                     # matches on token boundaries only
    assert NgramProposer(k=2, n_max=4, n_min=3).propose([1, 2, 9, 9, 1, 2]) == []  # 2-grams are below n_min
    assert p.propose([7]) == [] and p.propose([7, 7]) == [7]
    with pytest.raises(ValueError):
        NgramProposer(2, n_max=1, n_min=2)


@pytest.mark.parametrize("m", [1, 3])
def test_verify_keeps_the_target_distribution(m):
    """Rejection sampling with a deterministic guess: the first token follows p_0 exactly (accepted with p_0(x),
    else drawn from p_0 without x), and after an accepted guess the next follows p_1: frequencies of 6000 draws
    within 4 standard errors of the target's."""
    g = torch.Generator().manual_seed(m)
    logits = torch.randn(m + 1, 6, generator=g) * 1.5
    p = logits.softmax(-1)
    proposal = [int(p[j].argsort()[2]) for j in range(m)]  # a middling guess: accepted sometimes
    n = 6000
    first, second = torch.zeros(6), torch.zeros(6)
    s = Sampler(SamplingParams(temperature=1.0, seed=11))
    for _ in range(n):
        a, t = s.verify(logits, proposal)
        emitted = proposal[:a] + [t]
        first[emitted[0]] += 1
        if a >= 1:
            second[emitted[1]] += 1
    se = (p[0] * (1 - p[0]) / n).sqrt()
    assert ((first / n - p[0]).abs() <= 4 * se + 1e-3).all(), (first / n, p[0])
    got = second / second.sum()
    se1 = (p[1] * (1 - p[1]) / second.sum()).sqrt()
    assert ((got - p[1]).abs() <= 4 * se1 + 2e-3).all(), (got, p[1])


def test_greedy_verify_accepts_the_argmax_prefix():
    logits = torch.full((4, 5), -1.0)
    for j, t in enumerate([2, 4, 1, 3]):
        logits[j, t] = 5.0
    s = Sampler(SamplingParams())
    assert s.verify(logits, [2, 4, 1]) == (3, 3)
    assert s.verify(logits, [2, 0, 1]) == (1, 4)
    assert s.verify(logits, [0, 4, 1]) == (0, 2)


@pytest.mark.parametrize("options", [dict(), dict(cache_mode=1, cache_layout=2, quantized_cache=True),
                                     dict(num_speculative_tokens=7, prompt_lookup_max=2, fused_decode=False)])
def test_greedy_speculation_gives_the_same_tokens(stories, options):
    """On text that repeats, prompt-lookup guesses are mostly right: the engine takes several tokens a step, and
    every sequence's tokens are those it makes without speculation (batched with sequences that guess nothing)."""
    from runner.engine.tokenizer import Tokenizer
    tok = Tokenizer(str(stories / "pmx"))
    story = tok.encode("Lily and Tom went to the park. They played with a red ball. " * 3)
    cat = tok.encode("The cat sat on the mat. The cat sat on the mat. The cat")
    prompts = [story, tok.encode("Once upon a time"), cat, story[:40]]
    want = core(stories / "pmx", **options).generate(prompts, 64)
    eng = core(stories / "pmx", speculative="ngram", **options)
    assert eng.generate(prompts, 64) == want
    assert eng.proposed > eng.accepted >= 20
    alone, stats = core(stories / "pmx", speculative="ngram", **options), {}
    assert alone.generate([cat], 64, stats=stats) == want[2:3] and stats["steps"] < 0.8 * 64  # several tokens a step


def test_served_speculation_keeps_every_token_of_the_last_step(stories):
    """The serving engine (LLM): a step that accepts guesses and then ends the sequence (its length, or a stop id
    among the accepted guesses) gives the completion all of that step's tokens, as without speculation."""
    from runner import LLM, SamplingParams
    prompts = ["The cat sat on the mat. The cat sat on the mat. The cat", "Tom had a red ball", "Once upon a time"]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (37, 61, 140)]
    params.append(SamplingParams(max_tokens=100, temperature=0, stop_token_ids=[426]))  # "."

    def run(**spec):
        with LLM(str(stories / "pmx"), max_batch=4, kv_cache_tokens=2048, **spec) as llm:
            return [(o.token_ids, o.finish_reason) for sp in params for r in llm.generate(prompts, sp)
                    for o in r.outputs]
    want, got = run(), run(speculative="ngram")
    assert [len(t) for t, f in want[:9]] == [37] * 3 + [61] * 3 + [140] * 3
    assert got == want


def test_speculation_flags_are_checked():
    with pytest.raises(PmxError, match="--speculative must be one of off, ngram"):
        from runner.config import EngineConfig
        EngineConfig(speculative="medusa")
    with pytest.raises(PmxError, match="--prompt_lookup_min"):
        EngineConfig(prompt_lookup_min=5, prompt_lookup_max=2)


def noisy_copy(src, dst, scale: float):
    """A draft that guesses wrong now and then: `src`'s PMX weights with noise added, the tokenizer kept."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(0)
    w = load_file(str(dst / "model.00.safetensors"))
    save_file({k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.dim() == 2 else v
               for k, v in w.items()}, str(dst / "model.00.safetensors"))
    return dst


@pytest.mark.parametrize("options", [dict(), dict(cache_mode=1, quantized_cache=True),
                                     dict(fused_decode=False, num_speculative_tokens=3)])
def test_draft_model_speculation_gives_the_same_tokens(stories, tmp_path, options):
    """A draft model's guesses, verified: every sequence's greedy tokens are those without speculation. The model as
    its own draft is right nearly always (several tokens a step); a noisy copy is wrong often (its cache rolled back
    and recomputed after each rejection) and still changes no token."""
    from runner.config import EngineConfig
    from runner.engine.session import open_session
    from runner.engine.tokenizer import Tokenizer
    pmx = stories / "pmx"
    tok = Tokenizer(str(pmx))
    prompts = [tok.encode("Once upon a time"), tok.encode("Lily and Tom went to the park. They"),
               tok.encode("The cat sat on the mat.")]
    want = open_session(str(pmx), EngineConfig(**options)).core.generate(prompts, 48)
    noisy = noisy_copy(pmx, tmp_path / "noisy", 0.15)
    for draft, lo, hi in ((pmx, 0.9, 1.0), (noisy, 0.1, 0.8)):
        eng = open_session(str(pmx), EngineConfig(speculative="draft", speculative_model=str(draft),
                                                  **options)).core
        stats = {}
        assert eng.generate(prompts, 48, stats=stats) == want
        assert lo <= eng.accepted / eng.proposed <= hi, (draft, eng.accepted, eng.proposed)
        if draft == pmx:
            assert stats["steps"] < 0.5 * 48
        again = eng.generate(prompts[:1], 48)  # a second run: the draft's cache made anew with the target's
        assert again == want[:1]


def test_draft_model_is_checked(stories, tmp_path):
    from runner.config import EngineConfig
    from runner.engine.session import open_session
    from runner.pmx.convert import reshard
    with pytest.raises(PmxError, match="--speculative draft and --speculative_model DIR go together"):
        EngineConfig(speculative="draft")
    with pytest.raises(PmxError, match="go together"):
        EngineConfig(speculative_model=str(stories / "pmx"))
    reshard(str(stories / "pmx"), str(tmp_path / "two"), 2, progress=False)
    with pytest.raises(PmxError, match="split into 2 shards; each rank runs it whole: merge it"):
        open_session(str(stories / "pmx"), EngineConfig(speculative="draft", speculative_model=str(tmp_path / "two")))
    other = noisy_copy(stories / "pmx", tmp_path / "other", 0.0)
    (other / "tokenizer.model").write_bytes(b"not the same")
    with pytest.raises(PmxError, match="tokenizer.model differs from the target's"):
        open_session(str(stories / "pmx"), EngineConfig(speculative="draft", speculative_model=str(other)))


@pytest.mark.parametrize("launcher", ["mpich"])  # (torchrun's ranks: test_generate, test_server)
def test_speculation_on_two_ranks_keeps_the_one_rank_text(stories, tmp_path, launcher):
    """Demo under 2 ranks with the draft whole on each rank (its guesses broadcast from rank 0) and with prompt
    lookup: the greedy text of one rank without speculation."""
    import sys

    from jobs import launch_cmd, run_cli_here, run_job
    flags = ["--prompt", "Lily and Tom went to the park. They", "--max_gen_len", 40, "--temperature", 0]
    demo = [sys.executable, "scripts/Demo.py", *flags]
    one = run_cli_here("generate", "--ckpt_dir", stories / "pmx", *flags)  # (Demo.py's generate, in this process)
    assert one.returncode == 0, one.stderr
    want = one.stdout
    noisy = noisy_copy(stories / "pmx", tmp_path / "noisy", 0.15)
    for flags in (("--speculative", "draft", "--speculative_model", noisy), ("--speculative", "ngram")):
        cmd, env = launch_cmd(launcher, 2, *demo, "--ckpt_dir", stories / "pmx_2", *flags)
        rc, out, err, _ = run_job(cmd, tmp_path, {"OMP_NUM_THREADS": "1", **env}, timeout=180)
        assert rc == 0, err
        assert out == want, (flags, out, want)


def test_llm_speculation_keeps_every_token(stories):
    """Through the offline API (the server's engine): a verification step that ends a completion (its length, or
    a stop among the accepted guesses) still delivers every token before the end, so the outputs are those
    without speculation, whatever max_tokens is."""
    from runner.serve.llm import LLM
    from runner.serve.params import SamplingParams
    prompts = ["The cat sat on the mat. The cat sat on the mat. The cat",
               "Lily and Tom went to the park. They played with a red ball. " * 2]
    runs = {}
    for spec in ("off", "ngram"):
        with LLM(str(stories / "pmx"), speculative=spec) as llm:
            runs[spec] = [[(c.token_ids, c.finish_reason) for o in llm.generate(prompts, SamplingParams(
                temperature=0, max_tokens=m, ignore_eos=ignore)) for c in o.outputs]
                for m in (3, 7, 13, 40) for ignore in (True, False)]
            if spec == "ngram":
                assert llm.engine.core.accepted >= 20
    assert runs["ngram"] == runs["off"]
    assert all(len(ids) == m for (ids, _), m in zip([r[0] for r in runs["off"][0::2]], (3, 7, 13, 40)))


def test_sampled_speculation_keeps_the_target_distribution(stories):
    """At temperature 2 with top_k 20, on a prompt whose n-gram guesses are right about 60% of the time: the first
    token (no guess) and the second after the likeliest first (guessed, verified by rejection sampling) have the
    frequencies of the target's distribution, computed from its top-20 logprobs (within 4 standard errors; taking
    every guess would give the guess ~100%)."""
    import collections
    import math

    from runner.serve.llm import LLM
    from runner.serve.params import SamplingParams
    T, N = 2.0, 1600
    with LLM(str(stories / "pmx"), speculative="ngram") as llm:
        ids = llm.tokenizer.encode("The cat sat on the mat. The cat sat on the mat. The cat sat on the")

        def target(prompt):  # the top-20 tokens' probabilities at temperature T, as top_k=20 samples them
            lp = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=20))[0].outputs[0]
            top = {i: v.logprob / T for i, v in lp.logprobs[0].items()}
            z = sum(math.exp(v) for v in top.values())
            return {i: math.exp(v) / z for i, v in top.items()}

        p1 = target(ids)
        a = max(p1, key=p1.get)
        p2 = target(ids + [a])
        before = llm.engine.core.accepted, llm.engine.core.proposed
        outs = llm.generate([ids] * (N // 50), [SamplingParams(n=50, temperature=T, top_k=20, seed=1000 * i,
                                                               max_tokens=3, ignore_eos=True) for i in range(N // 50)])
        accepted, proposed = llm.engine.core.accepted - before[0], llm.engine.core.proposed - before[1]
    toks = [c.token_ids for o in outs for c in o.outputs]
    assert all(len(t) == 3 for t in toks)
    assert proposed > N // 4 and 20 < accepted < proposed, (accepted, proposed)  # guessed, not always right
    guess = max(p2, key=p2.get)
    assert 0.4 < p2[guess] < 0.85, p2[guess]
    for p, got in ((p1, [t[0] for t in toks]), (p2, [t[1] for t in toks if t[0] == a])):
        n, count = len(got), collections.Counter(got)
        assert n > 150
        for tok in sorted(p, key=p.get, reverse=True)[:6]:
            se = math.sqrt(p[tok] * (1 - p[tok]) / n)
            assert abs(count[tok] / n - p[tok]) <= 4 * se + 0.005, (tok, count[tok] / n, p[tok], n)
