"""The serving layer without HTTP: SamplingParams, chat templates, incremental detokenization, metrics, and the
offline `LLM` API on stories260k (the scheduler under it: test_scheduler.py)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from runner.engine import sampler
from runner.errors import PmxError
from runner.kernels.reference import PAGE_SIZE
from runner.serve.metrics import EngineStats, FrontendMetrics
from runner.serve.params import ParamError, SamplingParams

REFERENCE_IDS = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408, 419, 292,
                 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426]
REFERENCE_TEXT = (", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, "
                  "red ball.")
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] + '\\n' }}"
                 "{% elif m['role'] == 'user' %}{{ m['content'] }}{% elif m['role'] == 'assistant' %}"
                 "{{ m['content'] + eos_token }}{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                 "{% endfor %}")


def with_chat_template(pmx: Path, out: Path, template: str = CHAT_TEMPLATE) -> Path:
    """A copy of a PMX directory whose tokenizer_config.json carries `template`."""
    shutil.copytree(pmx, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return out


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    """{"pmx": stories260k as PMX, "chat": the same with a chat template}."""
    from conftest import shared_model_path
    from runner.pmx.convert import convert
    base = tmp_path_factory.mktemp("serve")
    convert(str(shared_model_path("stories260k")), str(base / "pmx"), progress=False)
    return {"pmx": base / "pmx", "chat": with_chat_template(base / "pmx", base / "chat")}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for these tiny models (no oversubscription on a busy 2-core box); restored after."""
    import torch
    n = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # what open_session gives each rank
        yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llm(stories):
    from runner import LLM
    with LLM(str(stories["chat"]), kv_cache_tokens=4096, max_batch=16) as m:
        yield m


# -- SamplingParams --------------------------------------------------------------------------------
def test_sampling_params_are_vllm_shaped_and_extend_the_engines():
    p = SamplingParams(max_tokens=5, stop="x", top_k=-1)
    assert isinstance(p, sampler.SamplingParams)
    assert (p.temperature, p.top_p, p.top_k, p.n, p.stop, p.logprobs) == (1.0, 1.0, 0, 1, ("x",), None)
    assert SamplingParams().max_tokens == 16
    c = SamplingParams(temperature=0.5, seed=10, n=3).for_choice(2, seed=99)
    assert (c.temperature, c.seed) == (0.5, 12) and type(c) is sampler.SamplingParams
    for bad, param in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(n=0), "n"),
                       (dict(max_tokens=0), "max_tokens"), (dict(logprobs=21), "logprobs"), (dict(stop=[""]), "stop"),
                       (dict(top_k="3"), "top_k"), (dict(seed=2 ** 70), "seed"), (dict(max_tokens=True), "max_tokens")]:
        with pytest.raises(ParamError) as e:
            SamplingParams(**bad)
        assert e.value.param == param and param in str(e.value)


# -- chat templates, detokenization, metrics --------------------------------------------------------
def test_chat_template_renders_as_transformers_does(shared_model, tmp_path):
    """The same text as transformers' apply_chat_template (tinystories-656k's tokenizer.json, a template that
    uses loop, filters, bos/eos and add_generation_prompt)."""
    from transformers import AutoTokenizer

    from runner.serve.chat import ChatTemplate
    src = shared_model("tinystories-656k")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, tmp_path / name)
    template = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}{{ bos_token }}{% endif %}"
                "{% if m['role'] == 'system' %}{{ bos_token + m['content'] | trim }}\n{% elif m['role'] == 'user' %}"
                "User: {{ m['content'] }}\n{% else %}Assistant: {{ m['content'] + eos_token }}\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}Assistant:{% endif %}")
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    msgs = [{"role": "system", "content": " Be nice. "}, {"role": "user", "content": "A story about a cat"},
            {"role": "assistant", "content": "Once upon a time"}, {"role": "user", "content": "More!"}]
    ours = ChatTemplate.load(tmp_path)
    for gen in (True, False):
        assert ours.render(msgs, gen) == AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=gen)


def test_chat_template_special_tokens_and_errors(stories):
    from runner.engine.tokenizer import Tokenizer
    from runner.serve.chat import ChatTemplate
    assert ChatTemplate.load(stories["pmx"]) is None  # stories260k ships none
    t, tok = ChatTemplate.load(stories["chat"]), Tokenizer(str(stories["chat"]))
    text = t.render([{"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": "Hi"}])
    assert text == "<s>Once upon a time" + "Hi</s>"
    assert t.encode(tok, text) == [1] + tok.encode("Once upon a timeHi", bos=False) + [2]
    with pytest.raises(PmxError, match="unknown role tool"):
        t.render([{"role": "tool", "content": "x"}])


def test_incremental_detokenizer_matches_whole_decode(stories):
    from runner.engine.tokenizer import Tokenizer
    from runner.serve.output import IncrementalDetokenizer
    tok = Tokenizer(str(stories["pmx"]))
    prompt = tok.encode("Once upon a time")
    rng = random.Random(1)
    gen = REFERENCE_IDS + [rng.randrange(3, 512) for _ in range(200)]  # byte pieces, odd joins
    d = IncrementalDetokenizer(tok, prompt)
    text = "".join(d.add(t) for t in gen)
    whole = tok.decode(prompt + gen)
    assert whole.startswith(tok.decode(prompt)) and text == whole[len(tok.decode(prompt)):]


def test_metrics_render_prometheus_text():
    """The front end's metrics (prometheus_client) with the engine's latest snapshot among them, under the same
    names as ever, and HTTP responses counted by status code."""
    from prometheus_client.parser import text_string_to_metric_families
    stats = EngineStats()
    stats.set(kv_pages_used=3, kv_pages_free=5)
    stats.inc("generation_tokens_total", 7)
    with pytest.raises(KeyError):
        stats.inc("kv_pages_used")  # a gauge is set, not counted
    m = FrontendMetrics()
    m.finished("stop")
    m.observe_latency(ttft=0.03, itl=None)
    m.observe_latency(ttft=0.3, itl=None)
    m.observe_latency(ttft=None, itl=0.002, more=2)
    m.responses.labels("400").inc()
    m.update_engine(stats.snapshot())
    text = m.render().decode()
    assert 'pmx_requests_total{reason="stop"} 1.0' in text and "pmx_kv_pages_used 3.0" in text
    assert "pmx_generation_tokens_total 7.0" in text and 'pmx_http_responses_total{code="400"} 1.0' in text
    assert 'pmx_time_to_first_token_seconds_bucket{le="0.04"} 1.0' in text
    assert 'pmx_time_to_first_token_seconds_bucket{le="+Inf"} 2.0' in text
    assert "pmx_time_to_first_token_seconds_count 2.0" in text and "pmx_inter_token_latency_seconds_count 3.0" in text
    assert "# TYPE pmx_inter_token_latency_seconds histogram" in text
    kinds = {f.name: f.type for f in text_string_to_metric_families(text)}  # (it parses as Prometheus text)
    assert kinds["pmx_requests"] == "counter" and kinds["pmx_requests_waiting"] == "gauge"


# -- the offline API ------------------------------------------------------------------------------
def test_llm_generate_reference_text(llm):
    from runner import SamplingParams as Public
    assert Public is SamplingParams
    out = llm.generate(["Once upon a time", "Lily"], SamplingParams(max_tokens=40, temperature=0))
    assert [len(o.outputs) for o in out] == [1, 1]
    first = out[0].outputs[0]
    assert first.token_ids == REFERENCE_IDS and first.text == REFERENCE_TEXT and first.finish_reason == "length"
    assert out[0].prompt == "Once upon a time" and out[0].prompt_token_ids == [1, 403, 407, 261, 378]
    again = llm.generate([[1, 403, 407, 261, 378]], SamplingParams(max_tokens=40, temperature=0))  # token ids
    assert again[0].outputs[0].token_ids == REFERENCE_IDS


def test_llm_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Once upon a time"}], SamplingParams(max_tokens=40, temperature=0))
    assert out[0].prompt_token_ids == [1, 403, 407, 261, 378] and out[0].outputs[0].text == REFERENCE_TEXT


def test_llm_sampling_seeds_stops_logprobs(llm):
    p = SamplingParams(n=3, max_tokens=30, temperature=0.9, top_p=0.9, seed=5)
    a, b = llm.generate("Once upon a time", p)[0].outputs, llm.generate("Once upon a time", p)[0].outputs
    assert [o.token_ids for o in a] == [o.token_ids for o in b]              # seeded: reproducible
    assert len({tuple(o.token_ids) for o in a}) > 1                          # choices differ (seed + index)
    stop = llm.generate("Once upon a time", SamplingParams(max_tokens=40, temperature=0, stop=["Lily", "zzz"]))
    o = stop[0].outputs[0]
    assert (o.text, o.finish_reason, o.stop_reason) == (", there was a little girl named ", "stop", "Lily")
    kept = llm.generate("Once upon a time", SamplingParams(max_tokens=40, temperature=0, stop=["Lily"],
                                                           include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == ", there was a little girl named Lily"
    lp = llm.generate("Once upon a time", SamplingParams(max_tokens=5, temperature=0, logprobs=3))[0].outputs[0]
    assert len(lp.logprobs) == 5 and all(len(e) == 3 for e in lp.logprobs)
    for tid, e in zip(lp.token_ids, lp.logprobs):  # greedy: the chosen token ranks first
        assert e[tid].rank == 1 and e[tid].logprob == max(x.logprob for x in e.values()) <= 0
    assert lp.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(lp.token_ids, lp.logprobs)))
    tok = llm.generate("Once upon a time", SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[426]))
    o = tok[0].outputs[0]  # like EOS: the token ends the completion and is left out
    assert (o.token_ids, o.finish_reason, o.stop_reason) == (REFERENCE_IDS[:10], "stop", 426)


def test_llm_preemption_gives_the_same_tokens(stories, llm):
    """A cache of 2 pages for 6 sequences of ~200 tokens: sequences are preempted and recomputed, and the
    greedy tokens are those of a run with room for all."""
    from runner import LLM
    prompts = ["Once upon a time", "Lily", "The cat", "Tom had a", "One day", "A big dog"]
    p = SamplingParams(max_tokens=180, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    with LLM(str(stories["pmx"]), kv_cache_tokens=2 * PAGE_SIZE, max_batch=4, max_num_batched_tokens=64) as small:
        got = [o.outputs[0].token_ids for o in small.generate(prompts, p)]
        assert small.engine.core.scheduler.preemptions > 0
        assert small.engine.core.scheduler.allocator.free == 2
        with pytest.raises(ParamError, match="3 KV-cache pages of 128 tokens; this server's cache has 2"):
            small.generate("Once", SamplingParams(max_tokens=300))  # could never run alone
    assert got == want


def _resident_share(t) -> float:
    """The share of the memory pages under CPU tensor t that are resident (mincore)."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    start = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * -(-length // mmap.PAGESIZE))()
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / len(vec)


@pytest.mark.parametrize("options", [{}, {"quantized_cache": True}])
def test_llm_cache_is_resident_before_the_first_request(stories, options):
    """The serving cache is a pool its requests walk through: every page of it is written at load (touch_cache), so
    no step pays a page fault for it; a cache reserved by a plain run is taken as it is first written instead."""
    from runner import LLM
    with LLM(str(stories["pmx"]), kv_cache_tokens=128 * PAGE_SIZE, max_batch=4, **options) as m:
        c = m.engine.core.cache
        assert c.data.numel() * c.data.element_size() >= 4 << 20  # (in memory of its own, not torch's allocator)
        assert [_resident_share(t) for t in (c.data, c.scale) if t is not None] == [1.0] * (1 + bool(options))
        m.engine.core.reserve(2 * c.rows)  # a larger cache, not yet touched
        assert _resident_share(m.engine.core.cache.data) < 0.5


@pytest.mark.parametrize("options", [{}, {"quantized_cache": True, "cache_layout": 3}, {"cache_layout": 1}])
def test_llm_prefix_caching_reuses_a_shared_prompt_and_keeps_the_tokens(stories, llm, options):
    """Prompts sharing a 300-token prefix: the later ones take the first's two full pages instead of computing
    them (the metrics count the hits), and every completion is the one computed without prefix caching; in each
    cache layout, the int8 cache included."""
    import contextlib

    from runner import LLM
    from runner.engine.tokenizer import Tokenizer
    tok = Tokenizer(str(stories["pmx"]))
    story = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play outside. " * 20)
    prefix = story[:300]
    prompts = [prefix + tok.encode(q, bos=False) for q in (" The cat", " One day", " Tom had a big")]
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(str(stories["pmx"]), kv_cache_tokens=16 * PAGE_SIZE, enable_prefix_caching=False, **options) as plain:
        want = [[o.outputs[0].token_ids for o in plain.generate([q], p)] for q in prompts]
    with contextlib.ExitStack() as stack:
        if options:
            llm = stack.enter_context(LLM(str(stories["pmx"]), kv_cache_tokens=16 * PAGE_SIZE, **options))
        cache = llm.engine.core.scheduler.allocator
        hits = cache.hits
        got = [[o.outputs[0].token_ids for o in llm.generate([q], p)] for q in prompts]
    assert got == want
    assert cache.hits - hits == 2 + 2  # the second and third prompts each took the first's 2 full pages


def test_llm_bad_requests(llm):
    with pytest.raises(ParamError, match="maximum context length is 512"):
        llm.generate([[1] * 600], SamplingParams(max_tokens=1))
    with pytest.raises(ParamError, match="outside the vocabulary"):
        llm.generate([[1, 9999]], SamplingParams())


def test_llm_under_mpirun_every_rank_gets_the_results(stories, tmp_path):
    """The same script on 2 ranks (mpirun): rank 0 schedules, both get the reference text."""
    import sys

    from jobs import launch_cmd, run_job
    from runner.pmx.convert import reshard
    reshard(str(stories["pmx"]), str(tmp_path / "pmx2"), 2, progress=False)
    script = tmp_path / "offline.py"
    script.write_text(
        "import json, os, sys\n"
        "from runner import LLM, SamplingParams\n"
        "with LLM(sys.argv[1], kv_cache_tokens=1024) as llm:\n"
        "    outs = llm.generate(['Once upon a time', 'Lily'], SamplingParams(max_tokens=40, temperature=0))\n"
        "    more = llm.generate('Lily', SamplingParams(max_tokens=8, temperature=0.8, seed=1, n=2))\n"
        "    result = [[o.outputs[0].text for o in outs], [c.token_ids for c in more[0].outputs]]\n"
        "with open(f\"{sys.argv[2]}/rank_{os.environ['PMI_RANK']}.json\", 'w') as f:\n"
        "    json.dump(result, f)\n")
    cmd, env = launch_cmd("mpich", 2, sys.executable, script, tmp_path / "pmx2", tmp_path)
    rc, out, err, _ = run_job(cmd, tmp_path, {**env, "OMP_NUM_THREADS": "1"}, timeout=180)
    assert rc == 0, err[-2000:]
    r0, r1 = (json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1 and r0[0][0] == REFERENCE_TEXT and len(r0[1]) == 2


@pytest.mark.parametrize("flags, message", [
    (dict(port="abc"), "--port must be an integer, got 'abc'"),
    (dict(port=70000), "--port must be in [0, 65535], got 70000"), (dict(max_batch=0), "--max_batch must be >= 1"),
    (dict(max_batch=8, max_num_batched_tokens=4), "must be at least --max_batch"),
    (dict(kv_cache_tokens=10), "at least one page (128)"), (dict(max_waiting=0), "--max_waiting must be"),
    (dict(drain_timeout=-1), "--drain_timeout must be"), (dict(gpu_memory_utilization=2), "(0, 1]")])
def test_serve_flags_are_checked_before_anything_loads(flags, message, tmp_path, capfd):
    """Bad serve flags (its own and the engine's) are refused by name, exit 2, before the model is looked at."""
    from test_bad_input import cli
    args = [a for k, v in flags.items() for a in (f"--{k}", v)]
    err = cli(capfd, "serve", "--ckpt_dir", tmp_path / "no-model", *args)
    assert message in err and "no-model" not in err


def test_llm_structured_output(stories, llm):
    """Offline: SamplingParams.structured_outputs holds the text to a JSON schema or a choice; a bad schema is a
    ParamError naming the field."""
    import json
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"]}
    outs = llm.generate(["Once upon a time", "Lily"], SamplingParams(max_tokens=60, temperature=0.8, seed=2,
                                                                     structured_outputs={"json": schema}))
    for o in outs:
        got = json.loads(o.outputs[0].text)
        assert set(got) == {"name", "n"} and isinstance(got["n"], int) and len(got["name"]) <= 8
    pick = llm.generate("Is it?", SamplingParams(max_tokens=10, structured_outputs={"choice": ["yes", "no"]}))
    assert pick[0].outputs[0].text in ("yes", "no")
    with pytest.raises(ParamError, match='^json does not compile: Unsupported type "nonsense"') as e:
        llm.generate("x", SamplingParams(structured_outputs={"json": {"type": "nonsense"}}))
    assert e.value.param == "structured_outputs"


def test_llm_prompt_logprobs_whole_even_with_a_cached_prefix(stories, llm):
    """prompt_logprobs: one entry per prompt token (None first), the same on a second run of a 300-token prompt whose
    pages are then in the prefix cache (the scored prompt takes none of them), and while completions run beside."""
    from runner.engine.tokenizer import Tokenizer
    tok = Tokenizer(str(stories["pmx"]))
    ids = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play outside. " * 12)[:300]
    p = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1, n=2)
    runs = [llm.generate([ids], p)[0] for _ in range(2)]
    for r in runs:
        assert len(r.prompt_logprobs) == 300 and r.prompt_logprobs[0] is None
        assert all(ids[k] in r.prompt_logprobs[k] and len(r.prompt_logprobs[k]) <= 2 for k in range(1, 300))
        assert len(r.outputs) == 2 and all(len(o.token_ids) == 3 for o in r.outputs)
    a, b = ([e[ids[k]].logprob for k, e in enumerate(r.prompt_logprobs) if k] for r in runs)
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    with pytest.raises(ParamError, match="prompt_logprobs must be an integer in"):
        SamplingParams(prompt_logprobs=-1)


def test_llm_random_weights_from_params_alone(tmp_path):
    """random_weights (serve --random_weights, what benchmarks/gpu_session.sh serves on a GPU): a directory holding only
    pmx_params.json and a tokenizer serves random weights of its shapes, the same ones every time (seeded)."""
    from runner.pmx.params import PmxParams
    from runner.pmx.random_model import _tokenizer_json
    from runner.serve.llm import LLM
    PmxParams(model_type="llama", hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=16, vocab_size=300, norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=256,
              dtype="float32").save(tmp_path)
    (tmp_path / "tokenizer.json").write_text(_tokenizer_json(300))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = []
    for _ in range(2):
        with LLM(str(tmp_path), random_weights=True, kv_cache_tokens=PAGE_SIZE, max_batch=2, device="cpu") as m:
            outs.append(m.generate([[1, 5, 9, 12]], params)[0].outputs[0].token_ids)
    assert len(outs[0]) == 6 and outs[0] == outs[1]
    with pytest.raises(PmxError, match="model.00.safetensors|shard"):
        LLM(str(tmp_path), kv_cache_tokens=PAGE_SIZE, device="cpu")
