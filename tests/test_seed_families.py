"""The seed's families (ChatGLM2/3, InternLM, InternLM2, Baichuan 1/2 7B and 13B, Qwen v1) from checkpoints in their
publishers' layouts (tests/seed_families.py: safetensors and .bin, single and sharded), against their references on
the same weights: teacher-forced logits within 1e-4 (every cache layout and mode, ppl.pmx's unfused attention, the
int8 cache), greedy generation of 24 tokens at TP 1, 2 and 4 (3 for 6 heads), split / merge bit for bit, int8
weights; that each new feature (partial rotary, ALiBi, NormHead, logn scaling) matters, and which step runner runs
it; config errors naming the key; the tokenizers and chat templates."""

from __future__ import annotations

import filecmp
import json
import re
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
from test_engine import STEPS, asked_for, core, engine, prompts_and_conts, rel_err, run_tp, run_tp_batch
from tp_worker import teacher_forced_logits

ROOT = Path(__file__).resolve().parents[1]
GEN = 24  # greedy tokens compared
FORMATS = {  # each variant from another of the layouts conversion reads: (format, files)
    "chatglm3": ("safetensors", 2), "chatglm2_mha": ("bin", 1), "internlm": ("bin", 3), "internlm2": ("safetensors", 1),
    "baichuan2_7b": ("bin", 2), "baichuan2_13b": ("safetensors", 3), "baichuan_7b": ("bin", 1),
    "baichuan_13b": ("safetensors", 1),
    "qwen": ("safetensors", 4), "qwen_logn": ("bin", 2)}
ALL_CACHES = [dict(cache_layout=0, cache_mode=0), dict(cache_layout=1, cache_mode=1), dict(cache_layout=2),
              dict(cache_layout=3, cache_mode=1), dict(cache_layout=0, fused_kvcache=False),
              dict(cache_layout=3, cache_mode=1, fused_kvcache=False)]
TP = [(name, 2) for name in sf.VARIANTS] + [("chatglm3", 4)] + [  # (the rest: --extended)
    pytest.param(name, n, marks=pytest.mark.extended) for name, n in (("qwen_logn", 4), ("baichuan2_7b", 4), ("baichuan2_13b", 3))]  # 6 heads; at 4 ranks: ChatGLM3's 2 KV heads replicated, Qwen's logn, Baichuan's NormHead


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


TP_OPTIONS = [dict(cache_layout=0), dict(cache_layout=2, cache_mode=1), dict(cache_layout=1, fused_kvcache=False)]


INT8_TP2 = ("chatglm3", "baichuan2_13b", "qwen_logn")  # test_int8_weights_run's variants also run at TP 2
INT8 = QuantScheme("int8", 0, True)


@pytest.fixture(scope="module")
def two_ranks(models, request, tmp_path_factory):
    """The TP = 2 runs of every family this session's tests ask for, in one mpirun (tests/tp_worker.py --batch):
    test_tensor_parallel_greedy_and_split_merge's, name -> (split dir, logits, info), and test_int8_weights_run's
    (weights quantised as that test does), ("int8", name) -> (split dir, logits, info)."""
    names = asked_for(request, "test_tensor_parallel_greedy_and_split_merge", 2)
    int8 = [n for n in asked_for(request, "test_int8_weights_run") if n in INT8_TP2]
    base, jobs = tmp_path_factory.mktemp("tp2"), []
    for name in names:
        pmx, ref = models(name)
        reshard(str(pmx), str(base / name), 2, progress=False)
        jobs.append((base / name, TP_OPTIONS, *prompts_and_conts(ref.vocab_size), {"generate": GEN}))
    for name in int8:
        pmx, ref = models(name)
        quantize_model(str(pmx), str(base / f"{name}-int8"), INT8, progress=False)
        reshard(str(base / f"{name}-int8"), str(base / f"{name}-int8-2"), 2, progress=False)
        jobs.append((base / f"{name}-int8-2", [{}], *prompts_and_conts(ref.vocab_size), None))
    keys = names + [("int8", name) for name in int8]
    return {key: (job[0], *res) for key, job, res in zip(keys, jobs, run_tp_batch(base, 2, jobs))}


@pytest.mark.parametrize("name,n", TP)
def test_tensor_parallel_greedy_and_split_merge(models, request, tmp_path, name, n):
    """TP = n: logits as the reference's and TP = 1's, the same 24 greedy tokens, and merge(split(m)) == m (TP = 2:
    every family in one launch)."""
    pmx, ref = models(name)
    prompts, conts = prompts_and_conts(ref.vocab_size)
    if n == 2:
        split, logits, info = request.getfixturevalue("two_ranks")[name]
    else:
        split = tmp_path / "split"
        reshard(str(pmx), str(split), n, progress=False)
        logits, info = run_tp(tmp_path, split, n, TP_OPTIONS, prompts, conts, with_info=True,
                              spec_extra={"generate": GEN})
    reshard(str(split), str(tmp_path / "merged"), 1, progress=False)
    assert filecmp.cmp(pmx / "model.00.safetensors", tmp_path / "merged" / "model.00.safetensors", shallow=False)
    want = ref.logits(prompts, conts, STEPS)
    greedy = [ref.greedy(p, GEN) for p in prompts]
    for opts, got, i in zip(TP_OPTIONS, logits, info):
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


# --- tokenizers and chat -----------------------------------------------------------------------------------------------
def test_chatglm_tokenizer(models):
    """[gMASK] sop and the sentencepiece pieces of the text (no BOS); the special tokens numbered after the pieces;
    their text inside a prompt stays text; decode leaves them out."""
    import sentencepiece as spm

    from runner.engine.tokenizer import CHATGLM_SPECIALS, ChatGLMTokenizer, Tokenizer
    pmx, _ = models("chatglm3")
    p = PmxParams.load(pmx)
    tok = Tokenizer(str(pmx), p.bos_token_id, p.eos_ids[0], p.vocab_size)
    sp = spm.SentencePieceProcessor(model_file=str(pmx / "tokenizer.model"))
    n = sp.get_piece_size()
    assert isinstance(tok, ChatGLMTokenizer) and tok.size == n + 9 and p.bos_token_id is None
    text = "Once upon a time there was a sop"
    ids = tok.encode(text)
    assert ids == [n + 1, n + 3] + sp.encode(text) and n + 3 not in ids[2:]       # [gMASK] sop
    assert tok.decode(ids) == text and tok.encode(text, bos=False) == sp.encode(text)
    assert [tok.token_id(t) for t in CHATGLM_SPECIALS] == list(range(n, n + 9))
    assert tok.token_text(n + 6) == "<|user|>" and p.eos_ids == (2, n + 6, n + 8)  # ChatGLM3 stops at <|user|> too
    with pytest.raises(PmxError, match="the tokenizer has .* which does not fit the model's vocabulary of 100"):
        Tokenizer(str(pmx), vocab_size=100)


def test_qwen_tokenizer(models, tmp_path):
    """qwen.tiktoken read with tiktoken: Qwen's pattern and merges, special tokens after the ranks (their text in a
    prompt becomes them, as Qwen's tokenizer does), NFC normalisation, no BOS; a bad file is refused in one line."""
    from runner.engine.tokenizer import QwenTokenizer, Tokenizer
    pmx, _ = models("qwen")
    p = PmxParams.load(pmx)
    tok = Tokenizer(str(pmx), p.bos_token_id, p.eos_ids[0], p.vocab_size)
    ranks = sum(1 for line in (pmx / "qwen.tiktoken").read_text().splitlines() if line)
    assert isinstance(tok, QwenTokenizer) and tok.eos_id == ranks and p.eos_ids == (ranks, ranks + 2)
    text = "Once upon a time, Lily saw a big red ball.\n"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) / 2 and tok.decode(ids) == text          # merged, and back
    assert tok.encode("Once") == [tok.token_id("Once")] and tok.token_text(tok.token_id(" upon")) == " upon"
    assert tok.encode("<|im_start|>user") == [ranks + 1] + tok.encode("user")
    assert tok.encode("caf\u0065\u0301") == tok.encode("caf\u00e9")                  # NFC
    assert tok.decode(ids + [ranks, ranks + 2]) == text                             # special tokens left out
    (tmp_path / "qwen.tiktoken").write_text("not base64!! 0\n")
    with pytest.raises(PmxError, match="not a qwen.tiktoken file of 'base64-token rank' lines"):
        Tokenizer(str(tmp_path))


def _chat_prompt(pmx, messages):
    from runner import LLM, SamplingParams
    with LLM(str(pmx), kv_cache_tokens=1024) as llm:
        out = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0))[0]
        return out.prompt_token_ids, out.outputs[0].token_ids


def test_chat_templates_build_the_families_prompts(models):
    """/v1/chat/completions' prompt for each family whose chat format is in its code (the template conversion wrote
    into tokenizer_config.json) is the ids that code builds: ChatGLM3's build_chat_input, ChatGLM2's build_prompt,
    Qwen's make_context (ChatML), Baichuan 2's build_chat_input; InternLM2's own template is kept."""
    import sentencepiece as spm

    from runner.engine.tokenizer import Tokenizer
    msgs = [{"role": "user", "content": "Once upon a time"}]
    pmx, _ = models("chatglm3")
    sp, tok = spm.SentencePieceProcessor(model_file=str(pmx / "tokenizer.model")), Tokenizer(str(pmx))
    n = sp.get_piece_size()
    ids, gen = _chat_prompt(pmx, msgs)
    assert ids == [n + 1, n + 3, n + 6] + sp.encode("\n") + sp.encode("Once upon a time") + [n + 7] and len(gen) > 0
    pmx, _ = models("chatglm2_mha")
    ids, _ = _chat_prompt(pmx, msgs + [{"role": "assistant", "content": "there"}, {"role": "user", "content": "Lily"}])
    want = "[Round 1]\n\n问：Once upon a time\n\n答：there\n\n[Round 2]\n\n问：Lily\n\n答："
    assert ids == Tokenizer(str(pmx)).encode(want)
    pmx, _ = models("qwen")
    tok = Tokenizer(str(pmx))
    start, end, nl = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>"), tok.encode("\n")
    ids, _ = _chat_prompt(pmx, msgs)
    assert ids == ([start] + tok.encode("system") + nl + tok.encode("You are a helpful assistant.") + [end] + nl +
                   [start] + tok.encode("user") + nl + tok.encode("Once upon a time") + [end] + nl + [start] +
                   tok.encode("assistant") + nl)
    pmx, _ = models("baichuan2_7b")
    sp = spm.SentencePieceProcessor(model_file=str(pmx / "tokenizer.model"))
    gen_cfg = json.loads((pmx / "generation_config.json").read_text())
    ids, _ = _chat_prompt(pmx, msgs)
    assert ids == [gen_cfg["user_token_id"]] + sp.encode("Once upon a time") + [gen_cfg["assistant_token_id"]]
    pmx, _ = models("internlm2")
    assert "<|im_start|>assistant" in json.loads((pmx / "tokenizer_config.json").read_text())["chat_template"]


# --- quantisation, the scripts, dump / replay, bench, serve ----------------------------------------------------------
def snr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(10 * torch.log10(want.pow(2).sum() / (got - want).pow(2).sum()))


@pytest.mark.parametrize("name", list(sf.VARIANTS))
def test_int8_weights_run(models, request, tmp_path, name):
    """Weight-only int8 (runner.pmx.quant), the lm head too: close to the reference, really quantised, and at TP 2
    as at TP 1."""
    pmx, ref = models(name)
    quantize_model(str(pmx), str(tmp_path / "q"), INT8, progress=False)
    prompts, conts = prompts_and_conts(ref.vocab_size)
    want = ref.logits(prompts, conts, STEPS)
    got = torch.stack(teacher_forced_logits(engine(tmp_path / "q"), prompts, conts))
    assert 1e-4 < rel_err(got, want) and snr_db(got, want) > 25, snr_db(got, want)
    if name in INT8_TP2:  # (in the module's one 2-rank launch; the same quantisation, done there)
        _, tp2, _ = request.getfixturevalue("two_ranks")["int8", name]
        assert rel_err(tp2[0], got) < 1e-4


def _run(cmd, env=None, timeout=300) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("name", ["chatglm3", pytest.param("qwen", marks=pytest.mark.extended),
                                  pytest.param("baichuan_13b", marks=pytest.mark.extended)])
def test_scripts_generate_dump_replay_and_bench(models, tmp_path, name):
    """ConvertWeightToPmx.py -> Split.py -> mpirun -np 2 Demo.py (the family's tokenizer encodes the prompt): the
    reference's greedy tokens; the dumped steps replay bit for bit through benchmark.sh. (`runner bench` under
    mpirun: test_replay's, on stories260k.)"""
    from runner.engine.tokenizer import Tokenizer
    converted, ref = models(name)
    src, py = converted.parent / "hf", sys.executable
    pmx, pmx2, dump = tmp_path / "pmx", tmp_path / "pmx2", tmp_path / "dump"
    for cmd in ([py, ROOT / "scripts" / "ConvertWeightToPmx.py", "--input_dir", src, "--output_dir", pmx],
                [py, ROOT / "scripts" / "Split.py", "--input_dir", pmx, "--num_shards", 2, "--output_dir", pmx2],
                [ROOT / "scripts" / "mpirun.sh", "-np", 2, py, ROOT / "scripts" / "Demo.py", "--ckpt_dir", pmx2,
                 "--prompt", "Once upon a time", "--max_gen_len", GEN, "--show_ids", "--dump_tensor_path", dump,
                 "--dump_steps", "0,1,5"]):
        res = _run(cmd)
        assert res.returncode == 0, res.stderr[-3000:]
    ids = json.loads(res.stdout.split("ids: ")[1].splitlines()[0])
    p = PmxParams.load(pmx)
    prompt = Tokenizer(str(pmx), p.bos_token_id, p.eos_ids[0], p.vocab_size).encode("Once upon a time")
    assert ids == ref.greedy(prompt, GEN, eos=p.eos_ids) and len(ids) >= 5
    res = _run([ROOT / "scripts" / "mpirun.sh", "-np", 2, ROOT / "scripts" / "benchmark.sh", 5],
               env={"MODEL_PATH": str(pmx2), "TEST_DATA_DIR": str(dump), "OUTPUT_DIR": str(tmp_path / "out"),
                    "MIN_PROFILING_SECONDS": "0.05", "WARMUP_ITERATIONS": "1", "PYTHON": py})
    rows = [ln.split() for ln in res.stdout.splitlines() if ln.strip().startswith(("0 ", "1 "))]
    assert res.returncode == 0 and len(rows) == 2 and all(r[-1] == "exact" for r in rows), res.stdout + res.stderr


def test_serve_chat_completions(models, tmp_path):
    """`python -m runner serve` on a ChatGLM3 model: /v1/chat/completions renders its template (the [gMASK] sop
    <|user|> ... <|assistant|> prompt) and answers what the offline API answers; /v1/completions too."""
    import openai

    from jobs import Job
    from runner import LLM, SamplingParams
    pmx, _ = models("chatglm3")
    msgs = [{"role": "user", "content": "Once upon a time"}]
    with LLM(str(pmx), kv_cache_tokens=1024) as llm:
        want = llm.chat(msgs, SamplingParams(max_tokens=8, temperature=0))[0]
        text = llm.generate("Lily", SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    job = Job([sys.executable, "-m", "runner", "serve", "--ckpt_dir", pmx, "--host", "127.0.0.1", "--port", 0,
               "--served_model_name", "glm", "--kv_cache_tokens", 1024], tmp_path, {"OMP_NUM_THREADS": "1"})
    try:
        job.wait_for("serving ", 180)
        url = re.search(r"serving .* at (http://127\.0\.0\.1:\d+)", job.stderr).group(1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="glm", messages=msgs, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == want.outputs[0].text
        assert r.usage.prompt_tokens == len(want.prompt_token_ids) and r.usage.completion_tokens == 8
        c = client.completions.create(model="glm", prompt="Lily", max_tokens=8, temperature=0)
        assert c.choices[0].text == text
    finally:
        job.cleanup()


# --- rope past the trained length, and config errors --------------------------------------------------------------------
@torch.no_grad()
def test_internlm2_dynamic_ntk_as_internlm2_decodes(tmp_path):
    """InternLM2's dynamic NTK past max_position_embeddings (16 here): the base recomputed from the length so far at
    every step, the keys of earlier steps kept as they were rotated, as InternLM2's module does while one sequence
    decodes (and transformers' dynamic rope, the reference); the engine's inv_freq is InternLM2's formula."""
    from runner.kernels import reference as ref_ops
    ref = sf.internlm2(tmp_path / "hf", "safetensors", 1, 0, dynamic=2.0)
    convert(str(tmp_path / "hf"), str(tmp_path / "pmx"), progress=False)
    p = PmxParams.load(tmp_path / "pmx")
    assert p.rope_scaling == {"rope_type": "dynamic", "factor": 2.0} and p.max_position_embeddings == 16
    hd, base, L = p.head_dim, p.rope_theta, 23   # InternLM2DynamicNTKScalingRotaryEmbedding._set_cos_sin_cache
    want_base = base * ((2.0 * L / 16) - (2.0 - 1)) ** (hd / (hd - 2))
    want = 1.0 / (want_base ** (torch.arange(0, hd, 2).float() / hd))
    torch.testing.assert_close(ref_ops.rope_inv_freq(hd, base, p.rope_scaling, 16, L), want)
    prompts, conts = prompts_and_conts(ref.vocab_size)
    prompt, cont = prompts[0], conts[0]   # 7 prompt tokens and 16 steps: past 16 positions
    out = ref.model(torch.tensor([prompt]), use_cache=True)
    want_logits = [out.logits[0, -1]]
    for t in cont:
        out = ref.model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
        want_logits.append(out.logits[0, -1])
    want_logits = torch.stack(want_logits)[:, None]
    for options in (dict(), dict(cache_layout=2, cache_mode=1)):
        got = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx", **options), [prompt], [cont]))
        assert rel_err(got, want_logits) < 1e-4, (options, rel_err(got, want_logits))


def test_qwen_positions(models, tmp_path):
    """Qwen's dynamic NTK takes its alpha from a generation's first step, state a step cannot tell: a model with
    use_dynamic_ntk takes seq_length positions (longer prompts refused, generation stopped there); without it, its
    max_position_embeddings, with the logn scaling past seq_length (test_matches_reference: qwen_logn)."""
    pmx, ref = models("qwen")
    p = PmxParams.load(pmx)
    assert (p.max_position_embeddings, p.logn_scaling) == (64, None)
    pmx_logn, _ = models("qwen_logn")
    assert (PmxParams.load(pmx_logn).max_position_embeddings, PmxParams.load(pmx_logn).logn_scaling) == (64, 8)
    eng = core(pmx)
    with pytest.raises(PmxError, match="prompt 0 has 70 tokens; the model takes at most 64 positions"):
        eng.generate([list(range(3, 73))], 4)
    assert len(eng.generate([list(range(3, 63))], 10)[0]) == 4
    cfg = json.loads((pmx.parent / "hf" / "config.json").read_text())
    from model_zoo import family_for
    longer = {**cfg, "seq_length": 32, "max_position_embeddings": 128}
    assert family_for(longer).params(longer, "float32").max_position_embeddings == 32
    assert family_for(longer).params({**longer, "use_dynamic_ntk": False}, "float32").max_position_embeddings == 128


BAD_CONFIGS = [  # variant, change to config.json, the one-line error
    ("chatglm3", {"pre_seq_len": 128}, r"config.json: 'pre_seq_len' = 128 is not supported \(a P-tuning v2 prefix\)"),
    ("chatglm3", {"rmsnorm": False}, r"'rmsnorm' = False is not supported \(LayerNorm instead of RMSNorm\)"),
    ("chatglm3", {"quantization_bit": 4}, r"'quantization_bit' = 4 is not supported"),
    ("chatglm3", {"position_encoding_2d": True}, r"'position_encoding_2d' is ChatGLM-6B's"),
    ("chatglm3", {"num_layers": "two"}, r"'num_layers' must be an integer >= 1, got 'two'"),
    ("chatglm3", {"ffn_hidden_size": None}, r"config.json: missing key 'ffn_hidden_size'"),
    ("chatglm3", {"kv_channels": 18}, r"'kv_channels' = 18: rotary turns half of each head"),
    ("internlm", {"rotary": {"type": "xpos", "base": 10000}}, r"'rotary': 'type' = 'xpos' is not supported"),
    ("internlm", {"bias": "yes"}, r"'bias' must be true or false, got 'yes'"),
    ("internlm2", {"rope_scaling": {"type": "yarn", "factor": 2.0}}, r"'rope_scaling' type 'yarn' is not supported"),
    ("internlm2", {"hidden_act": "gelu"}, r"'hidden_act' = 'gelu' is not supported"),
    ("baichuan2_13b", {"model_max_length": None}, r"config.json: missing key 'model_max_length'"),
    ("baichuan2_7b", {"num_key_value_heads": 2}, r"'num_key_value_heads' = 2 is not supported"),
    ("qwen", {"rotary_pct": 0.5}, r"'rotary_pct' = 0.5 is not supported \(a partial rotary of rotate-half pairs\)"),
    ("qwen", {"no_bias": False}, r"'no_bias' = False is not supported"),
    ("qwen", {"kv_channels": 8}, r"'kv_channels' = 8 x 'num_attention_heads' = 4 must equal 'hidden_size' = 64"),
    ("qwen", {"layer_norm_epsilon": -1}, r"'layer_norm_epsilon' must be a positive number, got -1"),
]


@pytest.mark.parametrize("name,change,error", BAD_CONFIGS)
def test_bad_config_key_is_one_line_naming_it(models, tmp_path, name, change, error):
    pmx, _ = models(name)
    src = tmp_path / "hf"
    src.mkdir()
    for f in (pmx.parent / "hf").iterdir():
        (src / f.name).symlink_to(f)
    cfg = {**json.loads((pmx.parent / "hf" / "config.json").read_text()), **change}
    (src / "config.json").unlink()
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PmxError, match=error):
        convert(str(src), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_bad_config_through_the_script(models, tmp_path):
    """The script: exit status 2, one line naming the file and the key, nothing written."""
    pmx, _ = models("qwen")
    src = tmp_path / "hf"
    src.mkdir()
    for f in (pmx.parent / "hf").iterdir():
        if f.name != "config.json":
            (src / f.name).symlink_to(f)
    (src / "config.json").write_text(json.dumps({**json.loads((pmx.parent / "hf" / "config.json").read_text()),
                                                 "rotary_pct": 0.25}))
    res = _run([sys.executable, ROOT / "scripts" / "ConvertWeightToPmx.py", "--input_dir", src, "--output_dir",
                tmp_path / "out"])
    assert res.returncode == 2 and not (tmp_path / "out").exists()
    assert res.stderr.strip().splitlines()[-1] == (f"error: {src}/config.json: 'rotary_pct' = 0.25 is not supported "
                                                   f"(a partial rotary of rotate-half pairs)")
