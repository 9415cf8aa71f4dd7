"""Model families against transformers: rope scaling, Mistral's sliding window, Qwen3, Mixtral (MoE), Gemma 2 and 3,
Phi-3 / 3.5 / 4-mini (their published config.json layouts: tests/conftest.py PUBLISHED), in one process,
tensor-parallel, through split / merge, and through the scripts end to end."""

from __future__ import annotations

import filecmp
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.engine.model import load_shard
from runner.pmx.convert import convert, reshard
from runner.pmx.params import PmxParams
from runner.pmx.quant import QuantScheme
from conftest import hf_maker
from test_engine import asked_for, core, engine, hf_logits, prompts_and_conts, rel_err, run_tp, run_tp_batch
from tp_worker import teacher_forced_logits

ROOT = Path(__file__).resolve().parents[1]
ROPE = {  # llama_mha with max_position_embeddings 16: the 16 decode steps run past it
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
}
LAYOUTS = [dict(cache_layout=0, cache_mode=0), dict(cache_layout=2, cache_mode=1),
           dict(cache_layout=3, cache_mode=1, fused_kvcache=False), dict(cache_layout=1, fused_kvcache=False)]
INT8 = dict(quantized_cache=True, cache_layout=1, cache_mode=1)
NEW = {  # the published layouts of the families of issue 38, and the cache settings each runs in here (each gets the
    # others through the tensor-parallel, one-call decode and export tests)
    "gemma2": [LAYOUTS[0], LAYOUTS[1], LAYOUTS[3], INT8],  # soft caps, GeGLU, post norms, local / global layers
    "gemma3": [LAYOUTS[0], LAYOUTS[2], INT8],  # q/k norms, a rope per layer kind, one KV head
    "gemma3_mm": [LAYOUTS[1]],           # Gemma3ForConditionalGeneration's language model, Gemma3TextConfig defaults
    "phi3": [LAYOUTS[0], INT8],          # fused qkv / gate_up, a window on every layer
    "phi3_5": [LAYOUTS[1], LAYOUTS[3]],  # LongRoPE across its switch
    "phi4_mini": [LAYOUTS[2], INT8],     # partial rotary, GQA, LongRoPE, tied embeddings
}


def _longrope_of(name: str) -> dict:
    """The rope_scaling conversion writes for PUBLISHED[name]'s LongRoPE."""
    from conftest import PUBLISHED
    c = PUBLISHED[name]
    r = {k: v for k, v in c["rope_scaling"].items() if k != "type"}
    return {"rope_type": "longrope", **r, "original_max_position_embeddings": c["original_max_position_embeddings"]}


def make(make_hf, name):
    if name in ROPE:
        return make_hf("llama_mha", rope_scaling=dict(ROPE[name]), max_position_embeddings=16)
    return make_hf(name)


@pytest.mark.parametrize("name", ["qwen3", "mixtral", "mistral_window", *ROPE, *NEW])
def test_family_matches_transformers(make_hf, tmp_path, name):
    """Teacher-forced logits against transformers' on the same weights in each cache setting (the int8 cache: the same
    argmax, cosine >= 0.999); the new families' greedy tokens against transformers' generate too."""
    src, model = make(make_hf, name)
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    ref = hf_logits(model, prompts, conts)
    for options in NEW.get(name, LAYOUTS):
        got = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx", **options), prompts, conts))
        if options.get("quantized_cache"):  # (Gemma 2's capped logits have near ties an int8 cache may swap)
            assert 0 < rel_err(got, ref) < 2e-2, rel_err(got, ref)
            assert torch.nn.functional.cosine_similarity(got.flatten(1), ref.flatten(1)).min() >= 0.999
        else:
            assert rel_err(got, ref) < 1e-4, (options, rel_err(got, ref))
    if name in NEW:
        assert core(tmp_path / "pmx").generate(prompts, 12) == hf_greedy(model, prompts, 12)


@torch.no_grad()
def hf_greedy(model, prompts: list, n: int) -> list:
    """transformers' greedy continuation of each prompt: n tokens (an eos does not stop it, as the engine's generate
    with no stop ids)."""
    model.generation_config.eos_token_id = None
    return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts]


def test_converted_params(make_hf, tmp_path):
    for name, want in [("qwen3", dict(qk_norm=True, head_dim=16, num_experts=0)),
                       ("mixtral", dict(num_experts=4, num_experts_per_token=2, qk_norm=False)),
                       ("mistral_window", dict(sliding_window=5)),
                       ("yarn", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 8})),
                       ("gemma2", dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                                       norm_offset=1.0, post_norms=True, embedding_scale=8.0,
                                       attention_scale=24 ** -0.5, attn_logit_softcapping=0.15,
                                       final_logit_softcapping=0.5, hidden_act="gelu_pytorch_tanh",
                                       tie_word_embeddings=True, sliding_rope_theta=None, eos_token_id=[1, 107])),
                       ("gemma3", dict(layer_types=["sliding_attention", "full_attention"], qk_norm=True,
                                       rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
                                       sliding_rope_theta=10000.0, sliding_rope_scaling=None, num_kv_heads=1,
                                       head_dim=32, attn_logit_softcapping=None)),
                       # Gemma3TextConfig's defaults where the published text_config has no key
                       ("gemma3_mm", dict(num_heads=8, num_kv_heads=4, head_dim=256, attention_scale=1 / 16,
                                          layer_types=None, sliding_window=5, rope_theta=1e6,
                                          sliding_rope_theta=10000.0, max_position_embeddings=131072,
                                          tie_word_embeddings=True, eos_token_id=[1, 106])),
                       ("phi3", dict(sliding_window=5, layer_types=None, rope_scaling=None, rotary_dim=None)),
                       ("phi4_mini", dict(rotary_dim=12, num_kv_heads=2, sliding_window=64, tie_word_embeddings=True,
                                          rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 8,
                                                        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.4],
                                                        "long_factor": [1.0, 1.5, 2.2, 3.1, 4.4, 6.0]}))]:
        src, _ = make(make_hf, name)
        convert(str(src), str(tmp_path / name), progress=False)
        p = PmxParams.load(tmp_path / name)
        assert {k: getattr(p, k) for k in want} == want, name
    _, w = load_shard(tmp_path / "mixtral", 0, torch.device("cpu"), torch.float32)
    assert w["layers.1.feed_forward.w1.weight"].shape == (4, 42, 64)  # experts stacked [E, out, in]
    assert w["layers.1.feed_forward.w2.weight"].shape == (4, 64, 42) and w["layers.1.feed_forward.gate.weight"].shape == (4, 64)


@pytest.mark.parametrize("name,change", [
    ("mistral_window", dict(sliding_window=None)),
    ("gemma2", dict(attn_logit_softcapping=None)),      # soft caps that cap: each changes the logits
    ("gemma2", dict(final_logit_softcapping=None)),
    ("gemma2", dict(layer_types=None)),                  # the global layer sees past the window
    ("gemma3", dict(sliding_rope_theta=None)),           # the local layers' rope is their own
    ("phi3_5", dict(rope_scaling={**_longrope_of("phi3_5"), "long_factor": _longrope_of("phi3_5")["short_factor"]})),
])
def test_features_change_the_output(make_hf, tmp_path, name, change):
    """Each feature is really applied: the same weights without it are ten times further from transformers than the
    1e-4 the tests against it hold, over sequences that cross the window (5) and LongRoPE's switch (8 positions)."""
    src, model = make(make_hf, name)
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    PmxParams.load(tmp_path / "pmx").replace(**change).save(tmp_path / "pmx")
    without = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx"), prompts, conts))
    assert rel_err(without, hf_logits(model, prompts, conts)) > 1e-3


@torch.no_grad()
def test_dynamic_ntk_matches_transformers_decoding(make_hf, tmp_path):
    """Dynamic NTK depends on the length so far: compare with transformers decoding token by token."""
    src, model = make_hf("llama_mha", rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8)
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    prompt, cont = prompts[0], conts[0]  # 7 prompt tokens, 16 steps: crosses 8 positions
    out = model(torch.tensor([prompt]), use_cache=True)
    ref = [out.logits[0, -1]]
    for t in cont:
        out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
        ref.append(out.logits[0, -1])
    ref = torch.stack(ref)[:, None]
    for options in LAYOUTS[:2]:
        got = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx", **options), [prompt], [cont]))
        assert rel_err(got, ref) < 1e-4, (options, rel_err(got, ref))


def _tp_case(make_hf, base: Path, name: str, n: int):
    """(HF model, its PMX dir, split in n, the worker's option sets, prompts, conts, spec extras) of a TP case."""
    src, model = make(make_hf, name)
    convert(str(src), str(base / "pmx"), progress=False)
    reshard(str(base / "pmx"), str(base / f"pmx{n}"), n, progress=False)
    new = name in NEW
    return (model, base / "pmx", base / f"pmx{n}", LAYOUTS[:3] + ([INT8] if new else []),
            *prompts_and_conts(model.config.vocab_size), {"generate": 12} if new else None)


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    """test_family_tensor_parallel's cases at n = 2 that this session runs, in one mpirun (tests/tp_worker.py
    --batch): name -> (the case as _tp_case gives it, logits, info)."""
    names = asked_for(request, "test_family_tensor_parallel", 2)
    base = tmp_path_factory.mktemp("tp2")
    cases = {name: _tp_case(hf_maker(base / name), base / name, name, 2) for name in names}
    results = run_tp_batch(base, 2, [(split, *rest) for _, _, split, *rest in cases.values()])
    return {name: (cases[name], *res) for name, res in zip(names, results)}


@pytest.mark.parametrize("name,n", [("qwen3", 2), pytest.param("qwen3", 4, marks=pytest.mark.extended), ("mixtral", 2), ("mixtral", 4),
                                    ("mistral_window", 2), ("yarn", 2), ("gemma2", 2), ("gemma3", 2),
                                    ("phi4_mini", 2)])
def test_family_tensor_parallel(make_hf, request, tmp_path, name, n):
    """Split / merge bit for bit, then n ranks under mpirun against transformers and TP=1 in three cache settings;
    the new families also with the int8 cache and greedy (Gemma 3's one KV head replicated on both ranks). (n = 2:
    every family in one launch.)"""
    if n == 2:
        case, results, info = request.getfixturevalue("two_ranks")[name]
    else:
        case = _tp_case(make_hf, tmp_path, name, n)
        results, info = run_tp(tmp_path, case[2], n, case[3], *case[4:6], with_info=True, spec_extra=case[6])
    model, pmx, split, _, prompts, conts, _ = case
    reshard(str(split), str(tmp_path / "merged"), 1, progress=False)
    assert filecmp.cmp(pmx / "model.00.safetensors", tmp_path / "merged" / "model.00.safetensors",
                       shallow=False)  # merge(split(m)) == m, bit for bit
    ref = hf_logits(model, prompts, conts)
    tp1 = torch.stack(teacher_forced_logits(engine(pmx), prompts, conts))
    new = name in NEW
    for opts, got in zip(LAYOUTS[:3], results):
        assert rel_err(got, ref) < 1e-4, (opts, rel_err(got, ref))
        assert rel_err(got, tp1) < 1e-4
    if new:
        assert 0 < rel_err(results[-1], ref) < 2e-2
        assert torch.nn.functional.cosine_similarity(results[-1].flatten(1), ref.flatten(1)).min() >= 0.999
        assert info[0]["generated"] == hf_greedy(model, prompts, 12)
        assert all(i["fused_decode"] for i in info[:2])  # the one-call C++ step serves their decode steps
        assert PmxParams.load(split).kv_replication == (2 if name == "gemma3" else 1)


# (Llama 3's and Qwen2's layers are these families' with fewer features: test_family_matches_transformers and the
# real models run them; Qwen3's, Mixtral's and Mistral's scripts: --extended, the same scripts on other families, whose
# conversion and TP = 2 the in-process tests and test_family_tensor_parallel's one launch check)
@pytest.mark.parametrize("name", [pytest.param("qwen3", marks=pytest.mark.extended),
                                  pytest.param("mixtral", marks=pytest.mark.extended),
                                  pytest.param("mistral_window", marks=pytest.mark.extended), "gemma3"])
def test_scripts_end_to_end_match_transformers_greedy(make_hf, tmp_path, name):
    """ConvertWeightToPmx.py -> Split.py -> mpirun -np 2 Demo.py: the greedy tokens of transformers; Gemma 3's dumped
    prefill and decode steps replay bit for bit through mpirun -np 2 benchmark.sh."""
    from runner.engine.tokenizer import Tokenizer
    from runner.pmx.random_model import _tokenizer_json
    src, model = make_hf(name if name not in ROPE else "llama_mha", vocab_size=300,
                         **({"rope_scaling": dict(ROPE[name]), "max_position_embeddings": 64} if name in ROPE else {}))
    (src / "tokenizer.json").write_text(_tokenizer_json(300))
    py, dump = sys.executable, ["--dump_tensor_path", tmp_path / "dump", "--dump_steps", "0,5"] if name in NEW else []
    for cmd in ([py, ROOT / "scripts" / "ConvertWeightToPmx.py", "--input_dir", src, "--output_dir", tmp_path / "pmx"],
                [py, ROOT / "scripts" / "Split.py", "--input_dir", tmp_path / "pmx", "--num_shards", 2,
                 "--output_dir", tmp_path / "pmx2"],
                [ROOT / "scripts" / "mpirun.sh", "-np", 2, py, ROOT / "scripts" / "Demo.py", "--ckpt_dir",
                 tmp_path / "pmx2", "--prompt", "Once upon a time", "--max_gen_len", 12, "--show_ids", *dump]):
        res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
    ids = eval(res.stdout.split("ids: ")[1].splitlines()[0])  # noqa: S307 (our own output)
    p = PmxParams.load(tmp_path / "pmx")
    prompt = Tokenizer(str(tmp_path / "pmx"), p.bos_token_id).encode("Once upon a time")
    want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=list(p.eos_ids),
                          pad_token_id=0)[0, len(prompt):].tolist()
    want = next((want[:i] for i, t in enumerate(want) if t in p.eos_ids), want)
    assert ids == want
    if dump:
        res = subprocess.run([str(ROOT / "scripts" / "mpirun.sh"), "-np", "2", str(ROOT / "scripts" / "benchmark.sh"),
                              "5"], capture_output=True, text=True, timeout=300, cwd=ROOT, env={
            **os.environ, "MODEL_PATH": str(tmp_path / "pmx2"), "TEST_DATA_DIR": str(tmp_path / "dump"),
            "OUTPUT_DIR": str(tmp_path / "out"), "MIN_PROFILING_SECONDS": "0.05", "WARMUP_ITERATIONS": "1",
            "PYTHON": py})
        rows = [ln.split() for ln in res.stdout.splitlines() if ln.strip().startswith(("0 ", "1 "))]
        assert res.returncode == 0 and len(rows) == 2 and all(r[-1] == "exact" for r in rows), res.stdout + res.stderr


def test_config_checks_sliding_window_kinds_and_rope_types():
    from model_zoo import family_for
    from runner.errors import PmxError
    base = dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, num_attention_heads=4, intermediate_size=8,
                num_hidden_layers=4, vocab_size=10, use_sliding_window=True, sliding_window=16)
    fam = family_for(base)
    assert fam.params({**base, "max_window_layers": 4}, "float32").sliding_window is None  # no layer slides
    assert fam.params({**base, "max_window_layers": 0}, "float32").sliding_window == 16   # every layer slides
    assert fam.params({**base, "use_sliding_window": False, "max_window_layers": 2}, "float32").sliding_window is None
    mixed = fam.params({**base, "max_window_layers": 2}, "float32")  # layers of both kinds: each its own
    assert mixed.sliding_window == 16 and mixed.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    assert [mixed.layer_window(i) for i in range(4)] == [0, 0, 16, 16] and mixed.uniform_window is None
    with pytest.raises(PmxError, match="layer_types must list full_attention, sliding_attention for each of the 4"):
        fam.params({**base, "layer_types": ["full_attention"] * 3}, "float32")
    with pytest.raises(PmxError, match="rope_scaling 'short_factor' must be a list of 8 numbers"):
        fam.params({**base, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "float32")
    with pytest.raises(PmxError, match="rope type 'mrope' is not supported"):
        fam.params({**base, "rope_scaling": {"rope_type": "mrope"}}, "float32")
    with pytest.raises(PmxError, match="hidden activation 'gelu' is not supported"):
        fam.params({**base, "hidden_act": "gelu"}, "float32")
    with pytest.raises(PmxError, match="partial_rotary_factor 0.3125 gives 5 rotary dims of head_dim 16"):
        fam.params({**base, "partial_rotary_factor": 0.3125}, "float32")
    yarn = fam.params({**base, "max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 2.0}},
                      "float32").rope_scaling
    assert yarn["original_max_position_embeddings"] == 4096  # filled in as transformers does


CHATS = {  # the family's template where the checkpoint has none: the prompt text it renders for one user turn
    "gemma3": ("<s><start_of_turn>user\nBe brief.\n\nOnce upon a time<end_of_turn>\n<start_of_turn>model\n",
               ("<start_of_turn>", "<end_of_turn>")),
    "phi3": ("<|system|>\nBe brief.<|end|>\n<|user|>\nOnce upon a time<|end|>\n<|assistant|>\n",
             ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")),
}


@pytest.mark.parametrize("name", list(CHATS))
def test_chat_template_and_server(make_hf, tmp_path, name):
    """A checkpoint without a chat template gets its family's (Gemma's turns, Phi-3's roles) at conversion, with its
    special tokens: the offline LLM's chat prompt is the family's format, its special tokens one id each, and its
    greedy answer transformers'; for Gemma 3, `python -m runner serve` answers /v1/chat/completions the same."""
    import openai

    from jobs import Job
    from runner import LLM, SamplingParams
    from runner.pmx.random_model import _tokenizer_json
    text, specials = CHATS[name]
    src, model = make_hf(name, bos_token_id=1)
    (src / "tokenizer.json").write_text(_tokenizer_json(300, specials))
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon a time"}]
    with LLM(str(tmp_path / "pmx"), kv_cache_tokens=1024) as llm:
        out = llm.chat(msgs, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert out.prompt == text
    ids = out.prompt_token_ids
    assert [i for i in ids if i in (3, 4, 5, 6)] == [3 + specials.index(t) for t in re.findall(
        "|".join(re.escape(t) for t in specials), text)]  # each special token one id (3.. in the tokenizer)
    assert out.outputs[0].token_ids == hf_greedy(model, [ids], 6)[0]
    if name != "gemma3":
        return
    job = Job([sys.executable, "-m", "runner", "serve", "--ckpt_dir", tmp_path / "pmx", "--host", "127.0.0.1",
               "--port", 0, "--served_model_name", "g", "--kv_cache_tokens", 1024], tmp_path, {"OMP_NUM_THREADS": "1"})
    try:
        job.wait_for("serving ", 180)
        url = re.search(r"serving .* at (http://127\.0\.0\.1:\d+)", job.stderr).group(1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="g", messages=msgs, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == out.outputs[0].text and r.usage.prompt_tokens == len(ids)
    finally:
        job.cleanup()


@pytest.mark.parametrize("name,scheme", [("gemma3", QuantScheme("int4", 32, True)),
                                         ("phi4_mini", QuantScheme("int8", 0))])
def test_quantised_families(make_hf, tmp_path, name, scheme):
    """Weight-only int8 / int4 (the tied embedding too): the one-call decode step's logits the reference kernels', and
    close to transformers' float model."""
    from test_quant_engine import model_tol, snr_db
    src, model = make_hf(name)
    convert(str(src), str(tmp_path / "q"), progress=False, quant=scheme)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    fast_engine = engine(tmp_path / "q")
    assert any(r.name == "one-call C++ decode" for r in fast_engine.runners)
    fast = torch.stack(teacher_forced_logits(fast_engine, prompts, conts))
    ref = torch.stack(teacher_forced_logits(engine(tmp_path / "q", kernels="reference"), prompts, conts))
    assert rel_err(fast, ref) < model_tol(scheme.method)
    hf = hf_logits(model, prompts, conts)  # (int4 in groups of 32 of these random weights: ~9 dB, int8 ~31)
    assert snr_db(fast, hf) > (25 if scheme.method == "int8" else 7) and rel_err(fast, hf) > 1e-4


def test_speculation_and_prefix_caching_with_layers_of_both_kinds(make_hf, tmp_path):
    """Gemma 2 (a windowed layer of 5, a full one; soft caps): prompt-lookup speculation's verify steps and a prefix
    shared from the cache's pages (300 tokens, two full pages) keep the greedy tokens computed without them, in the
    float and the int8 cache."""
    from runner import LLM
    from runner.pmx.random_model import _tokenizer_json
    from runner.serve.params import SamplingParams
    src, model = make_hf("gemma2")
    (src / "tokenizer.json").write_text(_tokenizer_json(300))
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    g = torch.Generator().manual_seed(2)
    motif = torch.randint(3, 300, (9,), generator=g).tolist()
    prompts = [motif * 4, torch.randint(3, 300, (20,), generator=g).tolist()]
    for options in ({}, dict(cache_mode=1, cache_layout=2, quantized_cache=True)):
        want = core(tmp_path / "pmx", **options).generate(prompts, 24)
        spec = core(tmp_path / "pmx", speculative="ngram", **options)
        assert spec.generate(prompts, 24) == want and spec.proposed > 0
    prefix = torch.randint(3, 300, (300,), generator=g).tolist()
    prompts = [prefix + [5, 6, 7], prefix + [8, 9]]
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for options in ({}, dict(quantized_cache=True)):
        with LLM(str(tmp_path / "pmx"), kv_cache_tokens=8 * 128, enable_prefix_caching=False, **options) as plain:
            want = [plain.generate([q], p)[0].outputs[0].token_ids for q in prompts]
        with LLM(str(tmp_path / "pmx"), kv_cache_tokens=8 * 128, **options) as llm:
            got = [llm.generate([q], p)[0].outputs[0].token_ids for q in prompts]
            assert llm.engine.core.scheduler.allocator.hits == 2  # the second prompt took the first's 2 full pages
        assert got == want


@pytest.mark.parametrize("name", ["gemma3", "phi4_mini"])
def test_configs_saved_by_transformers_5_convert_alike(make_hf, tmp_path, name):
    """The same model saved by transformers 5 (rope_parameters per layer type, layer_types written out) converts to
    the params and tensors of its published config.json."""
    src, model = make_hf(name)
    model.save_pretrained(tmp_path / "t5")
    for d, out in ((src, "published"), (tmp_path / "t5", "saved")):
        convert(str(d), str(tmp_path / out), progress=False)
    assert PmxParams.load(tmp_path / "saved") == PmxParams.load(tmp_path / "published")
    a, b = (load_shard(tmp_path / d, 0, torch.device("cpu"), torch.float32)[1] for d in ("saved", "published"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
