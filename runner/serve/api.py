"""OpenAI's HTTP API over the engine, in the shapes vLLM serves: `/v1/completions`, `/v1/chat/completions` (both with
`stream: true` as server-sent events ending `data: [DONE]`), `/v1/models`, `/tokenize`, `/detokenize`, `/health`,
`/metrics`, and `/openapi.json` (the request models of runner.serve.protocol).

Every failure is an answer in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a
request that is invalid or can never run (naming the field), 404 for an unknown model or path, 405 for a wrong
method, 408 for a body that comes too slowly, 413 for a body over --max_request_bytes (answered from its
Content-Length, before it is read), 503 with Retry-After for "retry later and it will work" (the queue is full,
the server is shutting down), and 500 with an id, which the log line of the failure carries, for anything
unexpected (the server goes on). A client that goes away has its requests cancelled (their pages freed) at once,
and is one log line.

The handlers run on the front end's event loop, beside every open stream, so nothing they do there grows with a
request's size: a body is read within its limits, long text is tokenized and chat templates rendered in worker
threads (the tokenizers let go of the GIL), and text too long to fit the model is refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runner.errors import PmxError
from runner.serve.client import ClientGone, EngineClient, EngineRefused, Subscription
from runner.serve.output import CompletionOutput, RequestOutput
from runner.serve.params import ParamError, SamplingParams
from runner.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestError,
                                   TokenizeRequest, openapi, parse)
from runner.serve.responses import Job
from runner.serve.tools import choice_of, forced_spec

log = logging.getLogger("pmx.serve")

INLINE_TEXT = 4096      # characters of text tokenized (templates rendered) on the event loop; more: in a thread
BYTES_PER_TOKEN_SLACK = 4  # text longer than positions x longest token x this is refused untokenized


class ApiError(Exception):
    TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
             408: "timeout_error", 413: "invalid_request_error", 500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class Gone(Exception):
    """The client went away while its request was read or answered: no response is due."""


def refused(e: EngineRefused, job: Optional[Job] = None) -> ApiError:
    """The engine's refusal; a structured-output spec's error names the field the spec came from."""
    retry = {"Retry-After": "1"} if e.status == 503 else None
    param = job.spec_field if job is not None and e.param == "structured_outputs" else e.param
    return ApiError(e.status, e.message, param, retry)


def _aborted() -> ApiError:
    return ApiError(503, "the server is shutting down; the request was cancelled", headers={"Retry-After": "1"})


def _failed(job: Job, error: Optional[str]) -> ApiError:
    log.error("error %s: the engine could not finish the request: %s", job.id, error)
    return ApiError(500, f"the engine could not finish the request (error id {job.id}): {error}")


@dataclass
class ApiContext:
    client: EngineClient
    tokenizer: Any
    chat_template: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    max_waiting: int
    metrics: Any               # runner.serve.metrics.FrontendMetrics
    created: int
    max_request_bytes: int
    body_timeout: float        # seconds a request's body may take to arrive
    max_token_bytes: int = 64  # the longest token's text, in UTF-8 bytes


class EventStream(Response):
    """Server-sent events from an async iterator of `data:` payloads; stops (cancelling) when the client goes. An
    unexpected failure mid-stream ends it with an error event carrying an id that the log line carries too."""

    def __init__(self, events: AsyncIterator[str], metrics):
        self.status_code, self.background, self.events, self.metrics = 200, None, events, metrics
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            async for data in self.events:
                await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})
        except (ClientGone, OSError):
            self.metrics.disconnects.inc()
            _gone(scope, "during its stream")
            return
        except Exception:  # noqa: BLE001 - the stream has started: the failure is told in it
            err = _internal(scope)
            await send({"type": "http.response.body", "body": f"data: {json.dumps(err.body())}\n\n".encode(),
                        "more_body": True})
        finally:
            await self.events.aclose()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _who(scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "a client"


def _gone(scope, when: str) -> None:
    log.info("client %s went away %s (%s %s)", _who(scope), when, scope.get("method"), scope.get("path"))


def _internal(scope, exc: Optional[BaseException] = None) -> ApiError:
    """An unexpected failure of a handler: logged with an id, answered with the same (`exc` is marked logged)."""
    if exc is not None:
        exc.pmx_logged = True
    eid = uuid.uuid4().hex[:16]
    log.error("error %s in %s %s from %s:\n%s", eid, scope.get("method"), scope.get("path"), _who(scope),
              traceback.format_exc().rstrip())
    return ApiError(500, f"internal error (error id {eid}); the server goes on")


class Api:
    """The endpoints, over an ApiContext."""

    def __init__(self, ctx: ApiContext):
        self.ctx = ctx
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="pmx-tokenize")
        self.max_text_bytes = ctx.max_model_len * ctx.max_token_bytes * BYTES_PER_TOKEN_SLACK
        self.openapi = openapi("pmx-runner", "1")

    # -- reading a request ----------------------------------------------------------------------------------------
    async def read(self, request: Request, model: type):
        """The body as `model`: 413 from its Content-Length (before reading) or as it grows past the limit, 408 when
        it takes longer than body_timeout, Gone when the client leaves meanwhile, 400 naming the field."""
        limit = self.ctx.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise ApiError(413, f"the request body ({length} bytes) is over this server's limit of {limit} bytes "
                                f"(--max_request_bytes)", headers={"Connection": "close"})
        chunks, size = [], 0

        async def collect() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the request body is over this server's limit of {limit} bytes "
                                        f"(--max_request_bytes)", headers={"Connection": "close"})
                chunks.append(chunk)

        try:
            await asyncio.wait_for(collect(), self.ctx.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.ctx.body_timeout:g} s",
                           headers={"Connection": "close"}) from None
        except ClientDisconnect:
            _gone(request.scope, "while sending its request")
            raise Gone() from None
        try:
            body = parse(model, b"".join(chunks))
        except RequestError as e:
            raise ApiError(400, str(e), e.param) from None
        if getattr(body, "model", None) not in (None, self.ctx.model_name):
            raise ApiError(404, f"The model `{body.model}` does not exist.", "model")
        return body

    async def encode(self, text: str, param: str, bos: bool = True) -> list:
        """Token ids of `text`; in a worker thread when long; refused untokenized when it cannot fit the model."""
        size = len(text.encode("utf-8"))
        if size > self.max_text_bytes:
            raise ApiError(400, f"{param}: {size} bytes of text cannot fit this model's {self.ctx.max_model_len} "
                                f"positions (a token covers at most {self.ctx.max_token_bytes} bytes)", param)
        if len(text) <= INLINE_TEXT:
            return self.ctx.tokenizer.encode(text, bos=bos)
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: self.ctx.tokenizer.encode(text,
                                                                                                              bos=bos))

    def check_ids(self, ids: list, param: str) -> list:
        bad = [t for t in ids if t >= self.ctx.vocab_size]
        if bad:
            raise ApiError(400, f"{param} holds token ids {bad[:3]} outside the vocabulary [0, {self.ctx.vocab_size})",
                           param)
        if len(ids) >= self.ctx.max_model_len:
            raise ApiError(400, f"this model's maximum context length is {self.ctx.max_model_len} tokens; the {param} "
                                f"has {len(ids)}, which leaves no room for a completion", param)
        return ids

    async def prompts(self, prompt) -> list:
        """[(text or None, ids)] of a completions request's prompt."""
        if isinstance(prompt, str):
            return [(prompt, self.check_ids(await self.encode(prompt, "prompt"), "prompt"))]
        if isinstance(prompt[0], int):
            return [(None, self.check_ids(prompt, "prompt"))]
        if isinstance(prompt[0], str):
            return [(p, self.check_ids(await self.encode(p, "prompt"), "prompt")) for p in prompt]
        return [(None, self.check_ids(p, "prompt")) for p in prompt]

    async def chat_prompt(self, body, tools: Optional[list] = None) -> tuple:
        """(text, ids) of a conversation after the model's chat template."""
        ctx = self.ctx
        if ctx.chat_template is None:
            raise ApiError(400, f"the model `{ctx.model_name}` has no chat template (its tokenizer_config.json "
                                f"holds no chat_template); use /v1/completions with your own prompt text")
        msgs = [m.for_template() for m in body.messages]
        gen = body.add_generation_prompt is not False
        kwargs = {**(body.chat_template_kwargs or {}), **({"tools": tools} if tools else {})}

        def render() -> tuple:
            text = ctx.chat_template.render(msgs, gen, **kwargs)
            if len(text.encode("utf-8")) > self.max_text_bytes:
                return text, None
            return text, ctx.chat_template.encode(ctx.tokenizer, text)

        try:
            if sum(len(m.get("content") or "") for m in msgs) <= INLINE_TEXT:
                text, ids = render()
            else:
                text, ids = await asyncio.get_running_loop().run_in_executor(self.pool, render)
        except PmxError as e:
            raise ApiError(400, str(e), "messages") from None
        if ids is None:
            raise ApiError(400, f"messages: the conversation's {len(text.encode())} bytes of text cannot fit this "
                                f"model's {ctx.max_model_len} positions", "messages")
        return text, self.check_ids(ids, "messages")

    def sampling(self, body, max_tokens: Optional[int], logprobs: Optional[int], forced: Optional[dict] = None,
                 prompt_logprobs: Optional[int] = None) -> tuple[SamplingParams, Optional[str]]:
        """The request's SamplingParams, and the field its structured-output spec came from (`forced`: the spec that
        tool_choice "required" or a named function imposes); a 400 naming the field otherwise."""
        spec, spec_field = structured(body)
        if forced is not None:
            if spec is not None:
                raise ApiError(400, f"{spec_field} cannot be combined with tool_choice required or a named function",
                               spec_field)
            spec, spec_field = forced, "tools"
        n = 1 if body.n is None else body.n
        if body.best_of is not None and body.best_of != n:
            raise ApiError(400, "best_of other than n is not supported by this server", "best_of")

        def given(value, default):
            return default if value is None else value

        try:
            return SamplingParams(
                n=n, max_tokens=max_tokens, temperature=given(body.temperature, 1.0), top_p=given(body.top_p, 1.0),
                top_k=given(body.top_k, 0), min_p=given(body.min_p, 0.0), seed=body.seed,
                stop=given(body.stop, ()), stop_token_ids=given(body.stop_token_ids, ()),
                ignore_eos=given(body.ignore_eos, False), logprobs=logprobs, structured_outputs=spec,
                prompt_logprobs=given(body.prompt_logprobs, prompt_logprobs),
                include_stop_str_in_output=given(body.include_stop_str_in_output, False),
                presence_penalty=given(body.presence_penalty, 0.0),
                frequency_penalty=given(body.frequency_penalty, 0.0),
                repetition_penalty=given(body.repetition_penalty, 1.0), logit_bias=body.logit_bias), spec_field
        except ParamError as e:
            raise ApiError(400, str(e), spec_field if e.param == "structured_outputs" else e.param) from None

    @staticmethod
    def stream_flags(body) -> tuple[bool, bool]:
        stream = bool(body.stream)
        opts = body.stream_options
        if opts is not None and not stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
        return stream, bool(opts is not None and opts.include_usage)

    # -- running a job --------------------------------------------------------------------------------------------
    async def run(self, request: Request, job: Job, stream: bool, include_usage: bool) -> Response:
        if len(job.prompts) * job.params.n > self.ctx.max_waiting:
            raise ApiError(400, f"{len(job.prompts)} prompt(s) x n={job.params.n} make "
                                f"{len(job.prompts) * job.params.n} sequences; this server queues at most "
                                f"{self.ctx.max_waiting} (--max_waiting)", "n")
        if await request.is_disconnected():  # (a client that sent its request and left: the engine never sees it)
            _gone(request.scope, "before its request ran")
            raise Gone()
        try:
            sub = self.ctx.client.submit(job.request_ids(), [ids for _, ids in job.prompts], job.params, job.arrival)
        except EngineRefused as e:
            raise refused(e) from None
        if stream:
            first = await self.first(request, sub, job)
            return EventStream(self.events(request, job, first, include_usage), self.ctx.metrics)
        results = {rid: RequestOutput(rid, text, ids, [CompletionOutput(k) for k in range(job.params.n)])
                   for rid, (text, ids) in zip(job.request_ids(), job.prompts)}
        error = None
        try:
            async with aclosing(sub.deltas(request.receive)) as deltas:
                async for batch in deltas:
                    for d in batch:
                        results[d.request_id].apply(d, job.token_text)
                        error = d.error or error
        except ClientGone:
            _gone(request.scope, "before its answer")
            raise Gone() from None
        except EngineRefused as e:
            raise refused(e, job) from None
        outs = [o for r in results.values() for o in r.outputs]
        if any(o.finish_reason == "error" for o in outs):
            raise _failed(job, error)
        if any(o.finish_reason == "abort" for o in outs):
            raise _aborted()
        if sum(len(o.token_ids) for o in outs) > 2048:  # (a large answer is built and encoded in a thread)
            body = await asyncio.get_running_loop().run_in_executor(self.pool, _encode_json, job.response(results))
            return Response(body, media_type="application/json")
        return JSONResponse(job.response(results))

    @staticmethod
    async def first(request: Request, sub: Subscription, job: Job) -> AsyncIterator[list]:
        """A stream's deltas, its first batch awaited before the response starts: a request the engine refuses is
        still an HTTP error (400 naming the field, 503), not a stream of one error event."""
        deltas = sub.deltas(request.receive)
        try:
            first = await deltas.__anext__()
        except EngineRefused as e:
            await deltas.aclose()
            raise refused(e, job) from None
        except ClientGone:
            await deltas.aclose()
            _gone(request.scope, "before its stream began")
            raise Gone() from None
        except StopAsyncIteration:
            first = []

        async def rest() -> AsyncIterator[list]:
            try:
                yield first
                async for batch in deltas:
                    yield batch
            finally:
                await deltas.aclose()

        return rest()

    async def events(self, request: Request, job: Job, batches: AsyncIterator[list],
                     include_usage: bool) -> AsyncIterator[str]:
        n, offsets, usages, held = job.params.n, {}, [], {}
        if job.kind == "chat":
            yield job.chunk([{"index": i, "delta": {"role": "assistant", "content": "" if job.calls_tools else
                                                    job.echoed}, "logprobs": None, "finish_reason": None}
                             for i in range(n * len(job.prompts))])
        elif job.echo:
            yield job.chunk([{"index": i * n + k, "text": text, "logprobs": None, "finish_reason": None}
                             for i, (text, ids) in enumerate(job.prompts) for k in range(n)])
        try:
            async with aclosing(batches):
                async for batch in batches:
                    choices = self.stream_choices(job, batch, offsets, usages, held)
                    if isinstance(choices, ApiError):
                        yield json.dumps(choices.body())
                        return
                    if choices:
                        yield job.chunk(choices)
        except EngineRefused as e:  # (the engine went away mid-stream)
            yield json.dumps(refused(e).body())
            return
        if include_usage:
            yield job.chunk([], usage=job.usage(usages))

    @staticmethod
    def stream_choices(job: Job, batch: list, offsets: dict, usages: list, held: dict):
        """The stream chunk's choices of a batch of deltas, or the ApiError that ends the stream."""
        choices = []
        for d in batch:
            if d.usage is not None:
                usages.append(d.usage)
            if d.finish_reason in ("abort", "error"):
                return _aborted() if d.finish_reason == "abort" else _failed(job, d.error)
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
        return choices

    # -- the endpoints --------------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body: CompletionRequest = await self.read(request, CompletionRequest)
        if body.tools:
            raise ApiError(400, "tools are for /v1/chat/completions", "tools")
        if body.suffix:
            raise ApiError(400, "suffix is not supported by this server", "suffix")
        stream, include_usage = self.stream_flags(body)
        echo = bool(body.echo)
        params, spec_field = self.sampling(body, 16 if body.max_tokens is None else body.max_tokens, body.logprobs,
                                           prompt_logprobs=body.logprobs if echo and body.logprobs is not None
                                           else None)
        if params.prompt_logprobs is not None and stream:
            raise ApiError(400, "prompt logprobs (echo with logprobs, prompt_logprobs) are not streamed by this "
                                "server; ask without stream", "echo" if echo else "prompt_logprobs")
        prompts = await self.prompts(body.prompt)
        if echo:  # (token-id prompts echo their decoded text)
            prompts = [(text if text is not None else self.ctx.tokenizer.decode(ids), ids) for text, ids in prompts]
        job = Job("completion", f"cmpl-{uuid.uuid4().hex}", self.ctx.model_name, int(time.time()), prompts, params,
                  self.ctx.tokenizer.token_text, echo, spec_field, arrival=arrival)
        return await self.run(request, job, stream, include_usage)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body: ChatCompletionRequest = await self.read(request, ChatCompletionRequest)
        if body.functions:
            raise ApiError(400, "functions are not supported by this server; use tools", "functions")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        want, top = bool(body.logprobs), body.top_logprobs
        if top is not None and not want:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        tools, choice = None, "none"
        parallel = body.parallel_tool_calls is not False
        if body.tools is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools]
            tool_choice = body.tool_choice if isinstance(body.tool_choice, (str, type(None))) else \
                body.tool_choice.model_dump()
            try:
                choice = choice_of(tool_choice, tools)
            except ParamError as e:
                raise ApiError(400, str(e), e.param) from None
        elif body.tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        params, spec_field = self.sampling(body, max_tokens, (top or 0) if want else None,
                                           forced_spec(tools, choice, parallel) if tools else None)
        stream, include_usage = self.stream_flags(body)
        if params.prompt_logprobs is not None and stream:
            raise ApiError(400, "prompt_logprobs are not streamed by this server; ask without stream",
                           "prompt_logprobs")
        prompt = await self.chat_prompt(body, tools)
        last = body.messages[-1]
        echoed = last.content if body.echo and last.role == "assistant" and isinstance(last.content, str) else ""
        job = Job("chat", f"chatcmpl-{uuid.uuid4().hex}", self.ctx.model_name, int(time.time()), [prompt], params,
                  self.ctx.tokenizer.token_text, spec_field=spec_field, tools=tools, tool_choice=choice,
                  parallel_tool_calls=parallel, echoed=echoed, arrival=arrival)
        return await self.run(request, job, stream, include_usage)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt's (or chat messages') token ids, their count and the model's positions."""
        body: TokenizeRequest = await self.read(request, TokenizeRequest)
        if body.messages is not None:
            _, ids = await self.chat_prompt(body)
        else:
            ids = await self.encode(body.prompt, "prompt", bos=body.add_special_tokens is not False)
        return JSONResponse({"count": len(ids), "max_model_len": self.ctx.max_model_len, "tokens": ids,
                             "token_strs": [self.ctx.tokenizer.token_text(i) for i in ids]})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: the text of token ids."""
        body: DetokenizeRequest = await self.read(request, DetokenizeRequest)
        if any(t >= self.ctx.vocab_size for t in body.tokens):
            raise ApiError(400, f"tokens must be an array of token ids in [0, {self.ctx.vocab_size})", "tokens")
        if len(body.tokens) > INLINE_TEXT:
            text = await asyncio.get_running_loop().run_in_executor(self.pool, self.ctx.tokenizer.decode, body.tokens)
        else:
            text = self.ctx.tokenizer.decode(body.tokens)
        return JSONResponse({"prompt": text})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.ctx.model_name, "object": "model", "created": self.ctx.created, "owned_by": "pmx-runner",
             "root": self.ctx.model_name, "parent": None, "max_model_len": self.ctx.max_model_len}]})

    async def health(self, request: Request) -> Response:
        if not self.ctx.client.accepting:
            return ApiError(503, "the server is shutting down").response()
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        return Response(self.ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi_json(self, request: Request) -> Response:
        return JSONResponse(self.openapi)

    def routes(self) -> list:
        return [Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]), Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/openapi.json", self.openapi_json, methods=["GET"])]


def structured(body) -> tuple:
    """(the structured_outputs spec of a request, or None; the field it came from): response_format (OpenAI's
    json_object / json_schema), vLLM's structured_outputs, or its older guided_json / guided_regex / guided_choice /
    guided_grammar; one of them at most."""
    guided = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
    given = [name for name in ("response_format", "structured_outputs", *guided) if getattr(body, name) is not None]
    if len(given) > 1:
        raise ApiError(400, f"give one of {', '.join(given)}", given[1])
    if not given:
        return None, None
    name = given[0]
    if name in guided:
        return {guided[name]: getattr(body, name)}, name
    if name == "structured_outputs":
        return body.structured_outputs, name
    fmt = body.response_format
    if fmt.type == "text":
        return None, None
    if fmt.type == "json_object":
        return {"json_object": True}, name
    if fmt.json_schema is None:
        raise ApiError(400, "response_format.json_schema must be an object with a schema object", name)
    return {"json": fmt.json_schema.schema_ or {}}, name


def _encode_json(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


class Guard:
    """The outermost layer of the app: an exception no handler caught is a JSON 500 with an id that its log line
    carries (the server goes on); a client gone mid-request is a log line; every response is counted by status."""

    def __init__(self, app, metrics, api: Optional[Api] = None):
        self.app, self.metrics, self.api = app, metrics, api

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counted(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.responses.labels(str(message["status"])).inc()
                if 400 <= message["status"] < 499 or message["status"] == 503:
                    self.metrics.rejected.inc()
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except OSError:  # (the socket went while a response was written)
            self.metrics.disconnects.inc()
            _gone(scope, "while it was answered")
        except Exception as e:  # noqa: BLE001 - a handler's bug: answered, logged with the same id
            if getattr(e, "pmx_logged", False):  # (answered by the app's own handler, which logged it)
                return
            err = _internal(scope, e)
            if not started:
                try:
                    await err.response()(scope, receive, counted)
                except OSError:
                    pass


def make_app(routes: list, metrics, api: Optional[Api] = None) -> Guard:
    """Starlette over `routes` with the error shapes of this module, inside a Guard."""
    async def on_api_error(request: Request, e: ApiError) -> Response:
        return e.response()

    async def on_http_error(request: Request, e: HTTPException) -> Response:
        return ApiError(e.status_code, str(e.detail)).response()

    async def on_gone(request: Request, e: Gone) -> Response:  # (nginx's "client closed request": no one reads it)
        metrics.disconnects.inc()
        return Response(status_code=499)

    async def on_bug(request: Request, e: Exception) -> Response:  # (Starlette re-raises it after: Guard sees it)
        return _internal(request.scope, e).response()

    app = Starlette(routes=routes, exception_handlers={ApiError: on_api_error, HTTPException: on_http_error,
                                                       Gone: on_gone, Exception: on_bug})
    return Guard(app, metrics, api)


def build_app(ctx: ApiContext) -> Guard:
    api = Api(ctx)
    return make_app(api.routes(), ctx.metrics, api)
