"""OpenAI's HTTP API over the engine, in the shapes vLLM serves: `/v1/completions`,
`/v1/chat/completions` (both with `stream: true` as server-sent events ending `data: [DONE]`),
`/v1/models`, `/health`, `/metrics`.

Bad requests get OpenAI-style JSON errors, `{"error": {"message", "type", "param", "code"}}`: 400 for
invalid JSON, wrong types, out-of-range values and prompts that do not fit; 404 for an unknown model
or path; 503 with Retry-After when the waiting queue is full or the server is shutting down. A client
that goes away has its request cancelled (its pages freed) at once, streamed or not.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from runner.errors import PmxError
from runner.serve.engine import CompletionOutput, RequestOutput
from runner.serve.params import MAX_LOGPROBS, ParamError, SamplingParams, is_int, is_number
from runner.serve.tools import check_tools, choice_of, forced_spec
from runner.serve.tools import parse as parse_tools

MAX_PROMPTS = 64


class ApiError(Exception):
    TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The HTTP client disconnected."""


# -- request fields ------------------------------------------------------------------------------
_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (is_int, "an integer"),
    "number": (is_number, "a number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
    "list": (lambda v: isinstance(v, list), "an array"),
    "stop": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
             "a string or an array of strings"),
}


def field(body: dict, name: str, kind: str, default=None):
    """body[name] checked against `kind` (null or absent: `default`); a 400 naming the field otherwise."""
    v = body.get(name)
    if v is None:
        return default
    ok, what = _KINDS[kind]
    if not ok(v):
        raise ApiError(400, f"{name} must be {what}, got {json.dumps(v)[:60]}", name)
    return v


def _unsupported(body: dict) -> None:
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        if field(body, name, "number", neutral) != neutral:
            raise ApiError(400, f"{name} is not supported by this server (only {neutral})", name)
    if field(body, "logit_bias", "dict"):
        raise ApiError(400, "logit_bias is not supported by this server", "logit_bias")
    for name in ("suffix", "functions"):
        if body.get(name):
            raise ApiError(400, f"{name} is not supported by this server", name)


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured(body: dict) -> tuple:
    """(the structured_outputs spec of a request, or None; the field it came from): response_format (OpenAI's
    json_object / json_schema), vLLM's structured_outputs, or its older guided_json / guided_regex / guided_choice /
    guided_grammar; one of them at most."""
    given = [name for name in ("response_format", "structured_outputs", *GUIDED) if body.get(name) is not None]
    if len(given) > 1:
        raise ApiError(400, f"give one of {', '.join(given)}", given[1])
    if not given:
        return None, None
    name = given[0]
    if name in GUIDED:
        return {GUIDED[name]: body[name]}, name
    if name == "structured_outputs":
        return field(body, name, "dict"), name
    fmt = field(body, name, "dict")
    kind = fmt.get("type")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return {"json_object": True}, name
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ApiError(400, "response_format.json_schema must be an object with a schema object", name)
        return {"json": spec.get("schema", {})}, name
    raise ApiError(400, f"response_format.type must be text, json_object or json_schema, got {json.dumps(kind)}",
                   name)


def sampling(body: dict, max_tokens, logprobs, forced: Optional[dict] = None,
             prompt_logprobs: Optional[int] = None) -> tuple[SamplingParams, Optional[str]]:
    """The request's SamplingParams, and the field its structured-output spec came from (`forced`: the spec that
    tool_choice "required" or a named function imposes); out-of-range values become a 400 naming the field."""
    _unsupported(body)
    spec, spec_field = structured(body)
    if forced is not None:
        if spec is not None:
            raise ApiError(400, f"{spec_field} cannot be combined with tool_choice required or a named function",
                           spec_field)
        spec, spec_field = forced, "tools"
    n = field(body, "n", "int", 1)
    best_of = field(body, "best_of", "int")
    if best_of is not None and best_of != n:
        raise ApiError(400, "best_of other than n is not supported by this server", "best_of")
    try:
        return SamplingParams(
            n=n, max_tokens=max_tokens, temperature=field(body, "temperature", "number", 1.0),
            top_p=field(body, "top_p", "number", 1.0), top_k=field(body, "top_k", "int", 0),
            seed=field(body, "seed", "int"), stop=field(body, "stop", "stop", ()),
            stop_token_ids=field(body, "stop_token_ids", "list", ()),
            ignore_eos=field(body, "ignore_eos", "bool", False),
            logprobs=logprobs, structured_outputs=spec,
            prompt_logprobs=field(body, "prompt_logprobs", "int", prompt_logprobs),
            include_stop_str_in_output=field(body, "include_stop_str_in_output", "bool", False)), spec_field
    except ParamError as e:
        raise ApiError(400, str(e), spec_field if e.param == "structured_outputs" else e.param) from None


def stream_flags(body: dict) -> tuple[bool, bool]:
    stream = field(body, "stream", "bool", False)
    opts = field(body, "stream_options", "dict", {})
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ApiError(400, "stream_options.include_usage must be a boolean", "stream_options")
    if opts and not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    return stream, include_usage


# -- the engine, as the handlers see it ----------------------------------------------------------
class Subscription:
    """The deltas of one HTTP request's engine requests (one per prompt), delivered from the engine thread."""

    def __init__(self, client, request_ids: list):
        self.client, self.loop = client, asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pending = set(request_ids)

    def deliver(self, deltas: list) -> None:
        """Engine thread: hands a step's deltas over to the handler's loop."""
        Subscription.deliver_all([(self, deltas)])

    @staticmethod
    def deliver_all(batches: list) -> None:
        """Engine thread: hands a step's deltas over, [(subscription, deltas), ...], in one wake-up of each loop
        (a wake-up is a write to the loop's socket, and on its way back from that write the engine thread may wait
        for the loop's thread to let go of the GIL: once per step, not once per stream)."""
        by_loop: dict = {}
        for sub, deltas in batches:
            by_loop.setdefault(sub.loop, []).append((sub.queue, deltas))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    async def deltas(self, receive) -> AsyncIterator[list]:
        """The deltas as they come until every request finished; ClientGone (and the requests cancelled)
        if the client disconnects first."""
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            while self.pending:
                get = asyncio.ensure_future(self.queue.get())
                done, _ = await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    raise ClientGone()
                batch = get.result()
                self.pending -= {d.request_id for d in batch if d.usage is not None}
                yield batch
        finally:
            watcher.cancel()
            if self.pending:
                self.client.cancel(sorted(self.pending))


def _put_all(items: list) -> None:
    for queue, deltas in items:
        queue.put_nowait(deltas)


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(Response):
    """Server-sent events from an async iterator of `data:` payloads; stops (cancelling) when the client goes."""

    def __init__(self, events: AsyncIterator[str]):  # no content-length: the stream ends with the connection
        self.status_code, self.background, self.events = 200, None, events
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            async for data in self.events:
                await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        except (ClientGone, OSError):
            pass
        finally:
            await self.events.aclose()


# -- response shapes ------------------------------------------------------------------------------
def _raw_logprobs(ids: list, entries: list) -> list:
    """Logprobs ({token_id: Logprob} per token, or None) back as the engine's (token_id, logprob, [(id, logprob),
    ...]); (token_id, None, None) for a position without (a prompt's first)."""
    raw = []
    for tid, entry in zip(ids, entries):
        if entry is None:
            raw.append((tid, None, None))
            continue
        top = sorted((lp.rank, i, lp.logprob) for i, lp in entry.items() if lp.rank > 0)
        raw.append((tid, entry[tid].logprob, [(i, v) for _, i, v in top]))
    return raw


@dataclass
class Job:
    """One HTTP request: its engine requests (one per prompt), n completions each."""
    kind: str                  # "completion" | "chat"
    id: str
    model: str
    created: int
    prompts: list              # [(text or None, ids)]
    params: SamplingParams
    token_text: Callable[[int], str]
    echo: bool = False
    spec_field: Optional[str] = None   # the request field its structured-output spec came from
    tools: Optional[list] = None       # chat: the request's tools, and its tool_choice (runner.serve.tools)
    tool_choice: str = "none"
    parallel_tool_calls: bool = True
    echoed: str = ""                   # chat with echo: the last (assistant) message, which the reply continues

    @property
    def calls_tools(self) -> bool:
        """The completions are searched for tool calls (and streamed whole, once finished)."""
        return bool(self.tools) and self.tool_choice != "none"

    def message(self, text: str, finish_reason: Optional[str]) -> tuple[dict, Optional[str]]:
        """A chat completion's message, its tool calls parsed out, and its finish_reason."""
        text = self.echoed + text
        if not self.calls_tools:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = parse_tools(text, self.tool_choice, self.tools, self.parallel_tool_calls)
        msg = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        return msg, ("tool_calls" if calls and finish_reason == "stop" else finish_reason)

    def request_ids(self) -> list:
        return [f"{self.id}-{i}" for i in range(len(self.prompts))]

    def index(self, request_id: str, choice: int) -> int:
        return int(request_id.rsplit("-", 1)[1]) * self.params.n + choice

    def usage(self, usages: list) -> dict:
        p, c = sum(u[0] for u in usages), sum(u[1] for u in usages)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def logprobs(self, raw: list, offset: int) -> Optional[dict]:
        if self.params.logprobs is None:
            return None
        text = self.token_text
        if self.kind == "chat":
            def item(i, lp):
                t = text(i)
                return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
            return {"content": [{**item(tid, lp), "top_logprobs": [item(i, v) for i, v in top]}
                                for tid, lp, top in raw]}
        tokens = [text(tid) for tid, _, _ in raw]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in raw],
                "top_logprobs": [None if top is None else {text(i): v for i, v in top} for _, _, top in raw],
                "text_offset": offsets}

    def head(self, chunk: bool) -> dict:
        obj = {"completion": "text_completion", "chat": "chat.completion.chunk" if chunk else "chat.completion"}
        return {"id": self.id, "object": obj[self.kind], "created": self.created, "model": self.model}

    def response(self, results: dict) -> dict:
        choices, usages = [], []
        for rid, res in results.items():
            usages.append((len(res.prompt_token_ids), sum(len(o.token_ids) for o in res.outputs)))
            prompt_text = res.prompt or ""
            echoed = _raw_logprobs(res.prompt_token_ids, res.prompt_logprobs) if self.echo and \
                res.prompt_logprobs is not None else []  # echo with logprobs: the prompt's tokens come first
            for out in res.outputs:
                c = {"index": self.index(rid, out.index)}
                lps = self.logprobs(echoed + _raw_logprobs(out.token_ids, out.logprobs or []),
                                    len(prompt_text) if self.echo and not echoed else 0)
                reason = out.finish_reason
                if self.kind == "chat":
                    msg, reason = self.message(out.text, reason)
                    c.update(message=msg, logprobs=lps)
                else:
                    c.update(text=(prompt_text if self.echo else "") + out.text, logprobs=lps)
                c.update(finish_reason=reason, stop_reason=out.stop_reason)
                if self.params.prompt_logprobs is not None:  # vLLM's field: per prompt token, None for the first
                    c["prompt_logprobs"] = [None if e is None else {str(i): {
                        "logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                        for i, lp in e.items()} for e in res.prompt_logprobs or []]
                choices.append(c)
        choices.sort(key=lambda c: c["index"])
        return {**self.head(False), "choices": choices, "usage": self.usage(usages)}

    def chunk(self, choices: list, **extra) -> str:
        return json.dumps({**self.head(True), "choices": choices, **extra}, ensure_ascii=False, separators=(",", ":"))


def _aborted() -> ApiError:
    return ApiError(503, "the server is shutting down; the request was cancelled", headers={"Retry-After": "1"})


# -- the app ----------------------------------------------------------------------------------------
@dataclass
class ApiContext:
    client: Any                # runner.serve.server.AsyncEngine: check / submit / cancel / accepting
    tokenizer: Any
    chat_template: Any
    model_name: str
    max_model_len: int
    metrics: Any
    created: int
    vocab_size: int


def build_app(ctx: ApiContext) -> Starlette:
    async def read_body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = field(body, "model", "str")
        if model is not None and model != ctx.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        return body

    def encode_prompts(prompt) -> list:
        if isinstance(prompt, str):
            return [(prompt, ctx.tokenizer.encode(prompt))]
        if isinstance(prompt, list) and prompt:
            if all(is_int(t) for t in prompt):
                return [(None, list(prompt))]
            if len(prompt) <= MAX_PROMPTS and all(isinstance(p, str) for p in prompt):
                return [(p, ctx.tokenizer.encode(p)) for p in prompt]
            if len(prompt) <= MAX_PROMPTS and all(isinstance(p, list) and p and all(map(is_int, p)) for p in prompt):
                return [(None, list(p)) for p in prompt]
        raise ApiError(400, f"prompt must be a string, an array of 1 to {MAX_PROMPTS} strings, an array of token "
                            f"ids or an array of arrays of token ids", "prompt")

    def chat_prompt(body: dict, tools: Optional[list] = None) -> tuple:
        messages = field(body, "messages", "list")
        if not messages:
            raise ApiError(400, "messages must be a non-empty array", "messages")
        msgs = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, "each message must be an object with a string role", "messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ApiError(400, "only text content parts are supported", "messages")
                content = "\n".join(p["text"] for p in content)
            elif content is not None and not isinstance(content, str):
                raise ApiError(400, "message content must be a string or an array of text parts", "messages")
            msgs.append({**m, "content": content})
        if ctx.chat_template is None:
            raise ApiError(400, f"the model `{ctx.model_name}` has no chat template (its tokenizer_config.json "
                                f"holds no chat_template); use /v1/completions with your own prompt text")
        kwargs = {**field(body, "chat_template_kwargs", "dict", {}), **({"tools": tools} if tools else {})}
        try:
            text = ctx.chat_template.render(msgs, field(body, "add_generation_prompt", "bool", True), **kwargs)
        except PmxError as e:
            raise ApiError(400, str(e), "messages") from None
        return text, ctx.chat_template.encode(ctx.tokenizer, text)

    async def run(request: Request, job: Job, stream: bool, include_usage: bool) -> Response:
        for _, ids in job.prompts:
            try:
                ctx.client.check(ids, job.params)
            except ParamError as e:  # (a structured-output spec's error names the field it came from)
                raise ApiError(400, str(e), job.spec_field if e.param == "structured_outputs" else e.param) from None
        sub = ctx.client.submit(job.request_ids(), [ids for _, ids in job.prompts], job.params)
        if stream:
            return EventStream(events(request, job, sub, include_usage))
        results = {rid: RequestOutput(rid, text, ids, [CompletionOutput(k) for k in range(job.params.n)])
                   for rid, (text, ids) in zip(job.request_ids(), job.prompts)}
        try:
            async with aclosing(sub.deltas(request.receive)) as deltas:
                async for batch in deltas:
                    for d in batch:
                        results[d.request_id].apply(d, job.token_text)
        except ClientGone:
            return Response(status_code=499)
        if any(o.finish_reason == "abort" for r in results.values() for o in r.outputs):
            raise _aborted()
        return JSONResponse(job.response(results))

    async def events(request: Request, job: Job, sub: Subscription, include_usage: bool) -> AsyncIterator[str]:
        n, offsets, usages, held = job.params.n, {}, [], {}
        if job.kind == "chat":
            yield job.chunk([{"index": i, "delta": {"role": "assistant", "content": "" if job.calls_tools else job.echoed}, "logprobs": None,
                              "finish_reason": None} for i in range(n * len(job.prompts))])
        elif job.echo:
            yield job.chunk([{"index": i * n + k, "text": text, "logprobs": None,
                              "finish_reason": None} for i, (text, ids) in enumerate(job.prompts) for k in range(n)])
        async with aclosing(sub.deltas(request.receive)) as deltas:
            async for batch in deltas:
                choices = []
                for d in batch:
                    if d.usage is not None:
                        usages.append(d.usage)
                    if d.finish_reason == "abort":
                        yield json.dumps(_aborted().body())
                        return
                    i = job.index(d.request_id, d.index)
                    lps = job.logprobs(d.logprobs, offsets.get(i, 0)) if d.token_ids else None
                    offsets[i] = offsets.get(i, 0) + sum(len(job.token_text(t)) for t in d.token_ids)
                    c, reason = {"index": i}, d.finish_reason
                    if job.calls_tools:  # tool calls: the text held until its end, then the parsed message
                        held[i] = held.get(i, "") + d.text
                        if reason is None:
                            continue
                        msg, reason = job.message(held.pop(i), reason)
                        c["delta"] = {k: msg[k] for k in ("content", "tool_calls") if msg.get(k) is not None}
                        for k, call in enumerate(c["delta"].get("tool_calls", [])):
                            call["index"] = k
                    elif job.kind == "chat":
                        c["delta"] = {"content": d.text} if d.text else {}
                    else:
                        c["text"] = d.text
                    c.update(logprobs=lps, finish_reason=reason, stop_reason=d.stop_reason)
                    choices.append(c)
                if choices:
                    yield job.chunk(choices)
        if include_usage:
            yield job.chunk([], usage=job.usage(usages))

    async def completions(request: Request) -> Response:
        body = await read_body(request)
        if body.get("tools"):
            raise ApiError(400, "tools are for /v1/chat/completions", "tools")
        prompts = encode_prompts(body.get("prompt"))
        logprobs = field(body, "logprobs", "int")
        echo = field(body, "echo", "bool", False)
        if echo:  # (token-id prompts echo their decoded text)
            prompts = [(text if text is not None else ctx.tokenizer.decode(ids), ids) for text, ids in prompts]
        stream, include_usage = stream_flags(body)
        params, spec_field = sampling(body, field(body, "max_tokens", "int", 16), logprobs,
                                      prompt_logprobs=logprobs if echo and logprobs is not None else None)
        if params.prompt_logprobs is not None and stream:
            raise ApiError(400, "prompt logprobs (echo with logprobs, prompt_logprobs) are not streamed by this "
                                "server; ask without stream", "echo" if echo else "prompt_logprobs")
        job = Job("completion", f"cmpl-{uuid.uuid4().hex}", ctx.model_name, int(time.time()), prompts, params,
                  ctx.tokenizer.token_text, echo, spec_field)
        return await run(request, job, stream, include_usage)

    async def chat_completions(request: Request) -> Response:
        body = await read_body(request)
        max_tokens = field(body, "max_completion_tokens", "int", field(body, "max_tokens", "int"))
        want = field(body, "logprobs", "bool", False)
        top = field(body, "top_logprobs", "int")
        if top is not None and not want:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        tools, choice = None, "none"
        parallel = field(body, "parallel_tool_calls", "bool", True)
        try:
            if body.get("tools") is not None:
                tools = check_tools(body["tools"])
                choice = choice_of(body.get("tool_choice"), tools)
            elif body.get("tool_choice") not in (None, "none"):
                raise ParamError("tool_choice", "tool_choice needs tools")
        except ParamError as e:
            raise ApiError(400, str(e), e.param) from None
        params, spec_field = sampling(body, max_tokens, (top or 0) if want else None,
                                      forced_spec(tools, choice, parallel) if tools else None)
        stream, include_usage = stream_flags(body)
        if params.prompt_logprobs is not None and stream:
            raise ApiError(400, "prompt_logprobs are not streamed by this server; ask without stream",
                           "prompt_logprobs")
        prompt = chat_prompt(body, tools)
        last = body["messages"][-1]
        echoed = last.get("content") if field(body, "echo", "bool", False) and last.get("role") == "assistant" and \
            isinstance(last.get("content"), str) else ""  # vLLM's echo: the reply continues the last message
        job = Job("chat", f"chatcmpl-{uuid.uuid4().hex}", ctx.model_name, int(time.time()), [prompt],
                  params, ctx.tokenizer.token_text, spec_field=spec_field, tools=tools, tool_choice=choice,
                  parallel_tool_calls=parallel, echoed=echoed)
        return await run(request, job, stream, include_usage)

    async def tokenize(request: Request) -> Response:
        """vLLM's /tokenize: a prompt's (or chat messages') token ids, their count and the model's positions."""
        body = await read_body(request)
        if body.get("messages") is not None:
            _, ids = chat_prompt(body)
        else:
            prompt = field(body, "prompt", "str")
            if prompt is None:
                raise ApiError(400, "prompt (a string) or messages is required", "prompt")
            ids = ctx.tokenizer.encode(prompt, bos=field(body, "add_special_tokens", "bool", True))
        return JSONResponse({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids,
                             "token_strs": [ctx.tokenizer.token_text(i) for i in ids]})

    async def detokenize(request: Request) -> Response:
        """vLLM's /detokenize: the text of token ids."""
        body = await read_body(request)
        tokens = field(body, "tokens", "list")
        if tokens is None or not all(is_int(t) and 0 <= t < ctx.vocab_size for t in tokens):
            raise ApiError(400, f"tokens must be an array of token ids in [0, {ctx.vocab_size})", "tokens")
        return JSONResponse({"prompt": ctx.tokenizer.decode(tokens)})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "pmx-runner",
             "root": ctx.model_name, "parent": None, "max_model_len": ctx.max_model_len}]})

    async def health(request: Request) -> Response:
        if not ctx.client.accepting:
            return ApiError(503, "the server is shutting down").response()
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    async def on_api_error(request: Request, e: ApiError) -> Response:
        ctx.metrics.inc("requests_rejected_total")
        return e.response()

    async def on_http_error(request: Request, e: HTTPException) -> Response:
        return ApiError(e.status_code, str(e.detail)).response()

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={ApiError: on_api_error, HTTPException: on_http_error})
