"""The server's defences without a server process: the request models against fuzzed bodies (hypothesis, bounded),
sampling at the extremes of every value the models admit, one request's failure in the engine ending that request
alone, and an unexpected handler exception answered as a JSON 500 whose id the log line carries."""

from __future__ import annotations

import json
import logging
import math

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.engine.sampler import NonFiniteLogits, Sampler
from runner.engine.sampling_params import SamplingParams as EngineParams
from runner.serve.params import SamplingParams
from runner.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestError,
                                   TokenizeRequest, parse)
from test_serve import REFERENCE_TEXT, one_thread, stories  # noqa: F401 (fixtures)

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))

# -- request models ---------------------------------------------------------------------------------------------------
DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("model, raw, param, needle", [
    (CompletionRequest, b'{"prompt": "a\\ud800b", "max_tokens": 4}', "prompt", "lone surrogate"),
    (ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages", "surrogate"),
    (TokenizeRequest, b'{"prompt": "a\\udfffb"}', "prompt", "lone surrogate"),
    (CompletionRequest, b'{"model": "\\ud800", "prompt": "x"}', "model", "lone surrogate"),
    (CompletionRequest, b'{"prompt": "a\\u0000b"}', "prompt", "NUL"),
    (CompletionRequest, b'{"prompt": ' + DEEP + b"}", None, "recursion limit"),
    (CompletionRequest, b'{"prompt": "x", "unknown": ' + DEEP + b"}", None, "recursion limit"),
    (ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": '
                            b'{"add_generation_prompt": false}}', "chat_template_kwargs", "reserved"),
    (TokenizeRequest, b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"self": 1}}',
     "chat_template_kwargs", "reserved"),
    (CompletionRequest, b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", "temperature", "finite"),
    (CompletionRequest, b'{"prompt": "x", "top_p": 1e400}', "top_p", "finite"),
    (CompletionRequest, b'{"prompt": [[1, 2, 3]], "n": 65}', "n", "less than or equal to 64"),
    (CompletionRequest, b'{"prompt": [1, 2, 99999999999]}', "prompt", "less than 2147483648"),
    (CompletionRequest, b'{"prompt": "x", "logit_bias": {"7": 101}}', "logit_bias", "less than or equal to 100"),
    (CompletionRequest, b'{"prompt": "x", "stream": "yes"}', "stream", "valid boolean"),
    (DetokenizeRequest, b'{"tokens": [1, -1]}', "tokens", "greater than or equal to 0"),
    (CompletionRequest, b"[1, 2]", None, "JSON object"),
    (CompletionRequest, b'{"prompt": "\xff"}', None, "not valid JSON"),
])
def test_bad_bodies_are_refused_naming_the_field(model, raw, param, needle):
    with pytest.raises(RequestError) as e:
        parse(model, raw)
    assert e.value.param == param and needle in str(e.value) and "\n" not in str(e.value), str(e.value)


_BAD_TEXT = st.sampled_from(["\ud800", "a\udfffb", "\x00", "x\x00y", "\U0010ffff", "é", ""])
_TEXT = st.one_of(st.text(max_size=8), _BAD_TEXT)
_NUMBER = st.one_of(st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([1e-300, 5e-324, 1e300, -0.0, 2 ** 31, 2 ** 63]))
_JSON = st.recursive(st.one_of(st.none(), st.booleans(), _NUMBER, _TEXT),
                     lambda inner: st.one_of(st.lists(inner, max_size=4),
                                             st.dictionaries(_TEXT, inner, max_size=4)), max_leaves=12)
_FIELDS = sorted({*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields, "role", "content", "type"})


def _body(draw_fields: dict) -> bytes:
    text = json.dumps(draw_fields, allow_nan=True)  # (surrogates escaped as \\ud800; NaN as a bare constant)
    return text.encode()


@FUZZ
@given(fields=st.dictionaries(st.one_of(st.sampled_from(_FIELDS), _TEXT), _JSON, max_size=6),
       model=st.sampled_from([CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest]))
def test_fuzzed_bodies_parse_or_are_refused_in_one_line(fields, model):
    """Any JSON object of the models' own field names and arbitrary values (lone surrogates, NULs, huge and
    non-finite numbers, nesting): a model whose text is all valid, or one RequestError line; nothing else."""
    try:
        body = parse(model, _body(fields))
    except RequestError as e:
        assert str(e) and "\n" not in str(e) and len(str(e)) < 600
        return
    for value in json.dumps(body.model_dump(mode="json")):  # (what passed holds no surrogate, no NUL)
        assert value != "\x00"
    json.dumps(body.model_dump(mode="json")).encode("utf-8")


@FUZZ
@given(raw=st.binary(max_size=64))
def test_fuzzed_bytes_are_refused_in_one_line(raw):
    try:
        parse(CompletionRequest, raw)
    except RequestError as e:
        assert "\n" not in str(e)


# -- sampling ---------------------------------------------------------------------------------------------------------
_EXTREME = st.sampled_from([0.0, 5e-324, 1e-300, 1e-30, 1.0, 1e30, 1e300, 1.7e308])


@FUZZ
@given(temperature=_EXTREME, top_p=st.sampled_from([5e-324, 1e-300, 0.5, 1.0]),
       min_p=st.sampled_from([0.0, 1e-300, 0.5, 1.0]), top_k=st.sampled_from([0, 1, 2, 2 ** 31 - 1]),
       presence=st.sampled_from([-2.0, 0.0, 2.0]), frequency=st.sampled_from([-2.0, 0.0, 2.0]),
       repetition=st.sampled_from([5e-324, 1e-300, 0.5, 1.0, 2.0, 1e300, 1.7e308]),
       bias=st.dictionaries(st.integers(0, 63), st.sampled_from([-100.0, -1.0, 0.0, 100.0]), max_size=8),
       logits=st.lists(st.one_of(st.floats(-1e38, 1e38), st.sampled_from([float("inf"), float("-inf"),
                                                                           float("nan"), 3e38])),
                       min_size=64, max_size=64),
       history=st.lists(st.integers(0, 63), max_size=20), seed=st.integers(0, 2 ** 32))
def test_sampling_is_safe_for_every_admitted_value(temperature, top_p, min_p, top_k, presence, frequency, repetition,
                                                   bias, logits, history, seed):
    """Every value the request models admit (tiny and huge temperatures, penalties at their bounds, logit biases of
    +-100, top_p / min_p at their bounds), on logits holding inf and NaN: a token of the vocabulary, never an
    exception (which would end the request) and never a distribution that is not one; a row of NaN alone is a
    broken model's, said so."""
    request = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k, seed=seed,
                             presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
                             logit_bias={str(k): v for k, v in bias.items()})
    sampler = Sampler(request.for_choice(0, seed), history=[1, 2] + history, prompt_len=2)
    x = torch.tensor([logits], dtype=torch.float32)
    if x.isnan().all():  # (no number to draw from: a broken model, said so)
        with pytest.raises(NonFiniteLogits):
            sampler(x)
        return
    token = int(sampler(x)[0])
    assert 0 <= token < 64
    if temperature > 0:
        p = sampler.probs(x)
        assert torch.isfinite(p).all() and (p >= 0).all() and math.isclose(float(p.sum()), 1.0, rel_tol=1e-4)


def test_penalties_and_bias_move_the_choice():
    """The adjustments do what they say on a row the model is sure of: a bias of -100 takes the favourite out, a
    presence penalty turns away from what was generated, a repetition penalty from what the prompt holds."""
    x = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    assert int(Sampler(EngineParams())(x)[0]) == 1
    assert int(Sampler(EngineParams(logit_bias=((1, -100.0),)))(x)[0]) == 2
    assert int(Sampler(EngineParams(presence_penalty=2.0), history=[0, 1], prompt_len=1)(x)[0]) == 2
    assert int(Sampler(EngineParams(presence_penalty=2.0), history=[1, 0], prompt_len=1)(x)[0]) == 1  # (prompt)
    assert int(Sampler(EngineParams(repetition_penalty=2.0), history=[1], prompt_len=1)(x)[0]) == 2
    assert int(Sampler(EngineParams(frequency_penalty=0.6), history=[0, 1, 1], prompt_len=1)(x)[0]) == 2
    probs = Sampler(EngineParams(temperature=1.0, min_p=0.3)).probs(x)
    assert (probs[0] > 0).tolist() == [False, True, True, False]  # p / p_max: e^-1 > 0.3 > e^-4
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)


# -- one request's failure --------------------------------------------------------------------------------------------
def test_a_request_whose_sampling_fails_ends_alone(stories):
    """A sequence whose sampling raises ends with finish "error" and the reason; the request beside it in the same
    steps goes on to the reference text, and the engine serves the next one."""
    from runner import LLM
    from runner.serve.output import TextProcessor
    with LLM(str(stories["pmx"]), kv_cache_tokens=1024) as llm:
        eng, out = llm.engine, TextProcessor(llm.tokenizer)
        ids = llm.tokenizer.encode("Once upon a time")
        for rid, temperature in (("bad", 0.8), ("good", 0.0)):
            p = SamplingParams(max_tokens=40, temperature=temperature)
            eng.add_request(rid, ids, p)
            out.add(rid, ids, p)

        def boom(logits):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")

        bad = eng.requests["bad"].choices[0]
        bad.sampler = type("Failing", (), {"__call__": staticmethod(boom), "plain_greedy": False,
                                           "params": bad.sampler.params})()
        texts, reasons, errors = {}, {}, {}
        while eng.has_work():
            deltas, cancels = out.process(eng.step())
            for d in deltas:
                texts[d.request_id] = texts.get(d.request_id, "") + d.text
                reasons[d.request_id] = d.finish_reason or reasons.get(d.request_id)
                errors[d.request_id] = d.error or errors.get(d.request_id)
            assert not cancels
        assert reasons == {"bad": "error", "good": "length"} and texts["good"] == REFERENCE_TEXT
        assert "RuntimeError: probability tensor" in errors["bad"]
        assert not eng.requests and eng.core.scheduler.allocator.used == 0
        again = llm.generate("Once upon a time", SamplingParams(max_tokens=40, temperature=0))
        assert again[0].outputs[0].text == REFERENCE_TEXT


def test_an_unexpected_handler_exception_is_a_json_500_with_the_logged_id(caplog):
    """A bug in a handler: a JSON 500 in OpenAI's shape whose id the log line carries; the app answers the next
    request."""
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from runner.serve.api import make_app
    from runner.serve.metrics import FrontendMetrics

    async def bug(request):
        raise KeyError("a handler's bug")

    async def fine(request):
        return PlainTextResponse("ok")

    metrics = FrontendMetrics()
    app = make_app([Route("/bug", bug), Route("/fine", fine)], metrics)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/bug"), await c.get("/fine")

    import asyncio
    with caplog.at_level(logging.ERROR, logger="pmx.serve"):
        r, ok = asyncio.run(main())
    err = r.json()["error"]
    assert r.status_code == 500 and err["code"] == 500 and err["type"] == "internal_error"
    eid = err["message"].split("error id ")[1].split(")")[0]
    logged = [rec.getMessage() for rec in caplog.records if eid in rec.getMessage()]
    assert len(logged) == 1 and "KeyError" in logged[0] and "GET /bug" in logged[0]
    assert ok.status_code == 200 and ok.text == "ok"
    assert 'pmx_http_responses_total{code="500"} 1.0' in metrics.render().decode()
