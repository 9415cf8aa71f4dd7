"""Serving beyond the basics, through the official `openai` client on 127.0.0.1: structured output (JSON schema,
JSON object, regex, choice), tool calls, a chat template from a file, /tokenize and /detokenize, prefix caching and
prompt-lookup speculative decoding on stories260k (which ships no chat template); one process and mpirun -np 2."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from runner.pmx.convert import reshard
from runner.serve.tools import parse
from test_serve import REFERENCE_IDS, REFERENCE_TEXT, one_thread, stories  # noqa: F401 (fixtures)
from test_server import LONG_PROMPT, start

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "examples" / "chat_template.jinja"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog", "bird"]}, "maxItems": 3},
    "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "floor": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["city", "floor"]}},
    "required": ["name", "age", "pets", "home"]}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}  # small: the tools go in the prompt, and stories260k reads 512 tokens at most
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"]}}}
FLAGS = ("--chat_template", TEMPLATE, "--speculative", "ngram", "--kv_cache_tokens", 4096, "--max_batch", 8)


@pytest.fixture(scope="module")
def srv(stories, tmp_path_factory):
    server = start(tmp_path_factory.mktemp("feat1"), "single", 1, stories["pmx"], *FLAGS)
    try:
        yield server
        server.stop()
    finally:
        server.job.cleanup()


def chat(server, content: str, **kw):
    return server.client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": content}],
                                                 temperature=kw.pop("temperature", 0), **kw)


def json_object_prefix(text: str) -> bool:
    """Whether `text` begins a compact JSON object (xgrammar's matcher over characters, no tokenizer)."""
    import xgrammar
    grammar = xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    return xgrammar.testing._get_matcher_from_grammar(grammar).accept_string(text)


def test_json_object_prefix_check_can_fail():
    assert json_object_prefix('{"a": "b') and json_object_prefix('{"a": 1}')
    assert not json_object_prefix('{a') and not json_object_prefix('["a"]')


def check_structured(server) -> None:
    """Every structured response parses and validates, sampled or greedy, streamed or not."""
    for temperature in (0, 0.9):
        r = chat(server, "Tell me about Lily", max_tokens=150, temperature=temperature, n=2, seed=3,
                 response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
        for c in r.choices:
            jsonschema.validate(json.loads(c.message.content), SCHEMA)
            assert c.finish_reason == "stop"
    r = server.client.completions.create(model=server.model, prompt="The cat", max_tokens=400, temperature=0.9,
                                         seed=1, n=3, extra_body={"response_format": {"type": "json_object"}})
    for c in r.choices:  # any object: whole where it stopped, a prefix of one where it ran out of max_tokens
        assert c.finish_reason in ("stop", "length") and json_object_prefix(c.text), c.text
        assert c.finish_reason == "length" or isinstance(json.loads(c.text), dict)
    text = "".join(ch.choices[0].delta.content or "" for ch in chat(
        server, "Lily", max_tokens=150, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}) if ch.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def check_tool_calls(server) -> None:
    for tools, choice, names, most in (([WEATHER], "required", {"weather"}, 100), ([WEATHER, TIME], {
            "type": "function", "function": {"name": "time"}}, {"time"}, 50)):  # within stories260k's 512
        r = chat(server, "Weather in Paris?", max_tokens=most, tools=tools, tool_choice=choice,
                 parallel_tool_calls=False)  # stories260k would call on and on
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls, c
        for call in c.message.tool_calls:
            assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
            schema = (WEATHER if call.function.name == "weather" else TIME)["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)
    calls = {}
    for ch in chat(server, "Weather?", max_tokens=100, tools=[WEATHER], tool_choice="required", stream=True,
                   parallel_tool_calls=False):
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            calls.setdefault(d.index, {"name": "", "arguments": ""})
            calls[d.index]["name"] += d.function.name or ""
            calls[d.index]["arguments"] += d.function.arguments or ""
    assert len(calls) == 1 and all(c["name"] == "weather" for c in calls.values())
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), WEATHER["function"]["parameters"])
    none = chat(server, "Once upon a time", max_tokens=10, tools=[WEATHER], tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.message.content and none.finish_reason == "length"


def test_structured_output(srv):
    check_structured(srv)
    r = srv.client.completions.create(model=srv.model, prompt="The cat", max_tokens=20, temperature=0,
                                      extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == "-"
    r = srv.client.completions.create(model=srv.model, prompt="Is it?", max_tokens=20, temperature=0,
                                      extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].text in ("yes", "no", "maybe")
    r = srv.client.completions.create(model=srv.model, prompt="Is it?", max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"grammar": 'root ::= "a" | "bc"'}})
    assert r.choices[0].text in ("a", "bc")


@pytest.mark.parametrize("body, field, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "xml"}}, "response_format", "'json_object' or 'json_schema'"),
    ({"guided_choice": []}, "guided_choice", "non-empty array"),
    ({"guided_regex": "(", "max_tokens": 5}, "guided_regex", "does not compile"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "give one of"),
    ({"tools": [{"type": "function"}]}, "tools", "tools.0.function: Field required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "weather"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_bad_structured_requests_are_a_400_naming_the_field(srv, body, field, needle):
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=30, json={
        "model": srv.model, "messages": [{"role": "user", "content": "hi"}], **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field and needle in err["message"], err


def test_tool_calls(srv):
    check_tool_calls(srv)


def test_tool_call_parser():
    tools = [WEATHER, TIME]
    content, calls = parse('I will check. <tool_call>{"name": "time", "arguments": {"zone": "utc"}}</tool_call>',
                           "auto", tools)
    assert content == "I will check." and calls[0]["function"] == {"name": "time", "arguments": '{"zone": "utc"}'}
    content, calls = parse('{"name": "weather", "parameters": {"city": "Oslo", "unit": "c"}}', "auto", tools)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    assert parse('{"name": "unknown", "arguments": {}}', "auto", tools) == ('{"name": "unknown", "arguments": {}}', [])
    assert parse("<tool_call>not json</tool_call> hello", "auto", tools)[1] == []
    assert parse("plain text", "auto", tools) == ("plain text", [])


def test_chat_template_tokenize_detokenize(srv):
    r = chat(srv, "Once upon a time", max_tokens=8)
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    t = httpx.post(f"{srv.url}/tokenize", json={"prompt": "Once upon a time"}, timeout=10).json()
    assert t["tokens"] == [1, 403, 407, 261, 378] and t["count"] == 5 and t["max_model_len"] == 512
    assert httpx.post(f"{srv.url}/detokenize", json={"tokens": t["tokens"]}, timeout=10).json()["prompt"] == \
        "Once upon a time"
    msgs = httpx.post(f"{srv.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert msgs.json()["count"] > 3
    bad = httpx.post(f"{srv.url}/detokenize", json={"tokens": [1, 99999]}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_speculation_and_prefix_caching_keep_the_reference(srv):
    """With prompt-lookup speculation and prefix caching on, greedy output is the reference's; a repeated long prompt
    takes its cached pages; text that repeats has guesses accepted."""
    c = srv.client
    r = c.completions.create(model=srv.model, prompt="Once upon a time", max_tokens=40, temperature=0)
    assert r.choices[0].text == REFERENCE_TEXT
    ids = c.completions.create(model=srv.model, prompt=[1, 403, 407, 261, 378], max_tokens=40, temperature=0,
                               logprobs=0).choices[0].logprobs
    assert len(ids.tokens) == len(REFERENCE_IDS)
    hits = srv.metric("prefix_cache_hits_total")
    first = c.completions.create(model=srv.model, prompt=LONG_PROMPT, max_tokens=16, temperature=0).choices[0].text
    again = c.completions.create(model=srv.model, prompt=LONG_PROMPT, max_tokens=16, temperature=0).choices[0].text
    assert first == again and srv.metric("prefix_cache_hits_total") - hits >= 2
    assert srv.metric("prefix_cache_tokens_saved_total") == 128 * srv.metric("prefix_cache_hits_total")
    story = "The cat sat on the mat. " * 6
    whole = c.completions.create(model=srv.model, prompt=story, max_tokens=60, temperature=0).choices[0].text
    assert srv.metric("spec_decode_accepted_tokens_total") > 0
    chunks = [ch.choices for ch in c.completions.create(model=srv.model, prompt=story, max_tokens=60, temperature=0,
                                                         stream=True) if ch.choices]
    assert all(len(x) == 1 for x in chunks) and len(chunks) < 60  # a step's accepted guesses in one chunk
    assert "".join(x[0].text for x in chunks) == whole


@pytest.mark.parametrize("launcher", ["mpich", "torchrun"])
def test_every_feature_on_two_ranks(stories, tmp_path, launcher):
    """The same requests under mpirun -np 2 and torchrun: structured output, tool calls, speculation and prefix
    caching run in lockstep on both ranks; greedy text is the one-process reference; SIGTERM stops the server (and,
    under torchrun, the agent without its traceback) within 30 s."""
    reshard(str(stories["pmx"]), str(tmp_path / "pmx2"), 2, progress=False)
    server = start(tmp_path, launcher, 2, tmp_path / "pmx2", *FLAGS)
    try:
        check_structured(server)
        check_tool_calls(server)
        r = server.client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=40,
                                             temperature=0)
        assert r.choices[0].text == REFERENCE_TEXT
        server.client.completions.create(model=server.model, prompt=LONG_PROMPT, max_tokens=4, temperature=0)
        server.client.completions.create(model=server.model, prompt=LONG_PROMPT, max_tokens=4, temperature=0)
        assert server.metric("prefix_cache_hits_total") >= 2
        assert server.stop(launcher_rc=(0, 1) if launcher == "torchrun" else (0,)) < 30
        if launcher == "torchrun":  # (it ends with status 1 when signalled, by design): scripts/torchrun.sh's one
            # line, not the agent's 25-line traceback
            tail = server.job.stderr[server.job.stderr.index("server stopped"):].splitlines()
            assert tail[-1] == "torchrun: stopped by SIGTERM; its workers were stopped with it"
            assert "Traceback" not in server.job.stderr, server.job.stderr
    finally:
        server.job.cleanup()


def test_client_errors_do_not_stop_the_server(srv):
    with pytest.raises(openai.BadRequestError):
        chat(srv, "hi", response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}})
    assert chat(srv, "Once upon a time", max_tokens=4).choices[0].finish_reason == "length"


def test_echo_with_logprobs_scores_the_prompt(srv, stories):
    """lm-eval-harness's loglikelihood request (echo, logprobs, max_tokens 1, token ids): the prompt's tokens come
    first with their log-probabilities (None for the first), the same as the engine's teacher-forced logits give;
    prompt_logprobs in vLLM's shape; chat echo continues the last assistant message."""
    import torch

    from runner.config import EngineConfig
    from runner.engine.session import open_session
    ids = [1, 403, 407, 261, 378, 263, 380, 270]
    r = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
        "model": srv.model, "prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = torch.tensor(lp["token_logprobs"][1:len(ids)])
    want = []
    open_session(str(stories["pmx"])).core.score(
        [ids], lambda i, first, logits: want.extend(torch.log_softmax(logits.float(), -1)[
            torch.arange(logits.shape[0]), torch.tensor(ids[first + 1:first + 1 + logits.shape[0]] + [0] * max(
                0, first + 1 + logits.shape[0] - len(ids)))].tolist()))
    assert torch.allclose(got, torch.tensor(want[:len(ids) - 1]), atol=1e-4), (got, want)
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert r["choices"][0]["text"].startswith("Once upon a time")
    r = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
        "model": srv.model, "prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}).json()
    pl = r["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids) and abs(pl[1]["403"]["logprob"] - want[0]) < 1e-4
    bad = httpx.post(f"{srv.url}/v1/completions", timeout=30, json={
        "model": srv.model, "prompt": "x", "echo": True, "logprobs": 1, "stream": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "echo"
    c = srv.client.chat.completions.create(model=srv.model, max_tokens=5, temperature=0, extra_body={
        "echo": True, "add_generation_prompt": False},
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}])
    assert c.choices[0].message.content.startswith("Once upon") and len(c.choices[0].message.content) > 9
