"""The server's request models (pydantic v2, as vLLM's protocol models): every field of every endpoint typed with its
range, so that a request is checked whole before anything runs, and `/openapi.json` describes exactly what is
taken (:func:`openapi`).

A body is parsed by pydantic's JSON parser (jiter: nesting deeper than 200 levels, invalid UTF-8 and numbers that do
not fit are refused as it reads); a lone surrogate (`"\\ud800"`) stops that parser without naming a field, so such a
body is read again by Python's parser and the field that holds it is named. Text holds no lone surrogates and no
NUL characters; free-form JSON values (schemas, template arguments) are held to the same. Unknown fields are left
out (OpenAI's clients send some this server has no use for). :func:`parse` gives the model or a
:class:`RequestError` naming the field, with a one-line message.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.json_schema import models_json_schema

from runner.serve.params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_PENALTY

MAX_PROMPTS = 64       # prompts of one completions request at most
MAX_STOPS = 64         # stop strings / stop token ids at most
MAX_TOKEN_ID = 2 ** 31  # token ids and counts below this (the vocabulary check comes after)
MAX_DEPTH = 200        # JSON nesting (pydantic's parser refuses deeper; Python's is held to the same here)
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "tools", "self", "bos_token", "eos_token",
                            "unk_token", "pad_token")  # what the server itself passes the chat template


class RequestError(ValueError):
    """A request that is not taken: a 400 naming `param` (None: the body as a whole)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


# -- text and free-form JSON ---------------------------------------------------------------------------------------
def _bad_char(s: str) -> Optional[str]:
    """What is wrong with a string (a NUL, a lone surrogate) or None."""
    if "\x00" in s:
        return f"holds a NUL character (at {s.index(chr(0))})"
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds a lone surrogate (\\u{ord(s[e.start]):04x} at {e.start}), which is not text"
    return None


def _text(s: str) -> str:
    bad = _bad_char(s)
    if bad:
        raise ValueError(bad)
    return s


def _json_value(v: Any) -> Any:
    """A free-form JSON value (a schema, template arguments) whose strings, keys included, are text."""
    stack = [(v, 0)]
    while stack:
        x, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"is nested deeper than {MAX_DEPTH} levels")
        if isinstance(x, str):
            _text(x)
        elif isinstance(x, dict):
            for k, y in x.items():
                _text(k)
                stack.append((y, depth + 1))
        elif isinstance(x, list):
            stack.extend((y, depth + 1) for y in x)
    return v


Text = Annotated[str, AfterValidator(_text)]
JsonValue = Annotated[Any, AfterValidator(_json_value)]
JsonObject = Annotated[dict[str, Any], AfterValidator(_json_value)]
TokenId = Annotated[int, Field(ge=0, lt=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Count = Annotated[int, Field(ge=1, lt=MAX_TOKEN_ID)]
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]


class _Model(BaseModel):
    """Strict JSON types (a string is no number, a number no bool), unknown fields left out."""
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class StreamOptions(_Model):
    include_usage: Optional[bool] = None


class JsonSchemaFormat(_Model):
    name: Optional[Text] = None
    description: Optional[Text] = None
    schema_: Optional[JsonObject] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class _Sampling(_Model):
    """What completions and chat completions share: the model, sampling, stops, streaming, structured output."""
    model: Optional[Text] = None
    temperature: Annotated[Optional[float], Field(ge=0, allow_inf_nan=False,
                                                  description="0: greedy; default 1")] = None
    top_p: Annotated[Optional[float], Field(gt=0, le=1, allow_inf_nan=False)] = None
    top_k: Annotated[Optional[int], Field(ge=-1, lt=MAX_TOKEN_ID, description="-1 or 0: off")] = None
    min_p: Optional[Probability] = None
    n: Annotated[Optional[int], Field(ge=1, le=MAX_N)] = None
    seed: Annotated[Optional[int], Field(ge=-2 ** 63, lt=2 ** 63)] = None
    stop: Union[Text, Annotated[list[Text], Field(max_length=MAX_STOPS)], None] = Field(
        default=None, description="a string or an array of strings")
    stop_token_ids: Annotated[Optional[list[TokenId]], Field(max_length=MAX_STOPS)] = None
    ignore_eos: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    presence_penalty: Annotated[Optional[float], Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)] = None
    frequency_penalty: Annotated[Optional[float], Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)] = None
    repetition_penalty: Annotated[Optional[float], Field(gt=0, allow_inf_nan=False, description="1: off")] = None
    logit_bias: Optional[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                              Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS,
                                                     allow_inf_nan=False)]]] = Field(
        default=None, description="token id (a decimal string) -> a bias added to its logit")
    prompt_logprobs: Annotated[Optional[int], Field(ge=0, le=MAX_LOGPROBS)] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[Text] = None
    best_of: Annotated[Optional[int], Field(ge=1, le=MAX_N)] = None
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[JsonObject] = None
    guided_json: Union[JsonObject, Text, None] = None
    guided_regex: Optional[Text] = None
    guided_choice: Optional[list[Text]] = None
    guided_grammar: Optional[Text] = None


class CompletionRequest(_Sampling):
    """POST /v1/completions (OpenAI's, with vLLM's extra sampling and structured-output fields)."""
    prompt: Union[Text, TokenIds, Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]] = Field(
        description=f"a string, an array of 1 to {MAX_PROMPTS} strings, an array of token ids or an array of 1 to "
                    f"{MAX_PROMPTS} arrays of token ids")
    max_tokens: Optional[Count] = None
    logprobs: Annotated[Optional[int], Field(ge=0, le=MAX_LOGPROBS)] = None
    echo: Optional[bool] = None
    suffix: Optional[Text] = None
    tools: Optional[list[JsonValue]] = None


class TextPart(_Model):
    type: Literal["text"]
    text: Text


class Message(_Model):
    """A chat message: a role, content (text or text parts), and whatever else the chat template reads."""
    model_config = ConfigDict(strict=True, extra="allow")
    role: Text
    content: Union[Text, list[TextPart], None] = Field(default=None, description="a string or an array of text parts")
    name: Optional[Text] = None
    tool_calls: Optional[list[JsonObject]] = None
    tool_call_id: Optional[Text] = None

    @model_validator(mode="after")
    def _extras_are_text(self) -> "Message":
        for k, v in (self.__pydantic_extra__ or {}).items():
            _text(k)
            _json_value(v)
        return self

    def for_template(self) -> dict:
        """The message as the chat template reads it: content parts joined into one text."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "\n".join(p.text for p in self.content)
        out.setdefault("content", None)
        return out


class FunctionDef(_Model):
    name: Annotated[Text, Field(min_length=1)]
    description: Optional[Text] = None
    parameters: Optional[JsonObject] = None
    strict: Optional[bool] = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: Text


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


def _template_kwargs(kw: Optional[dict]) -> Optional[dict]:
    bad = [k for k in kw or () if k in RESERVED_TEMPLATE_KWARGS]
    if bad:
        raise ValueError(f"{bad[0]!r} is the server's own argument of the chat template; reserved: "
                         f"{', '.join(RESERVED_TEMPLATE_KWARGS)}")
    return kw


TemplateKwargs = Annotated[Optional[dict[Text, JsonValue]], AfterValidator(_template_kwargs)]


class _Chat(_Model):
    """A conversation to render with the model's chat template."""
    messages: Annotated[list[Message], Field(min_length=1)]
    add_generation_prompt: Optional[bool] = None
    chat_template_kwargs: TemplateKwargs = None


class ChatCompletionRequest(_Sampling, _Chat):
    """POST /v1/chat/completions (OpenAI's, with vLLM's extra fields)."""
    max_tokens: Optional[Count] = None
    max_completion_tokens: Optional[Count] = None
    logprobs: Optional[bool] = None
    top_logprobs: Annotated[Optional[int], Field(ge=0, le=MAX_LOGPROBS)] = None
    tools: Annotated[Optional[list[Tool]], Field(min_length=1)] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    echo: Optional[bool] = None
    functions: Optional[list[JsonValue]] = None


class TokenizeRequest(_Model):
    """POST /tokenize (vLLM's): a prompt's token ids, or a conversation's after its chat template."""
    model: Optional[Text] = None
    prompt: Optional[Text] = None
    add_special_tokens: Optional[bool] = None
    messages: Annotated[Optional[list[Message]], Field(min_length=1)] = None
    add_generation_prompt: Optional[bool] = None
    chat_template_kwargs: TemplateKwargs = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give prompt (a string) or messages, one of them")
        return self


class DetokenizeRequest(_Model):
    """POST /detokenize (vLLM's): the text of token ids."""
    model: Optional[Text] = None
    tokens: list[TokenId]


class ErrorBody(_Model):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(_Model):
    """Every refusal, in OpenAI's shape."""
    error: ErrorBody


# -- parsing -------------------------------------------------------------------------------------------------------
_UNION_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|nullable|union|literal|tagged-union|lax-or-strict|"
                        r"json-or-python|constrained-\w+|function-\w+|list\[.*\]|dict\[.*\]|literal\[.*\]|"
                        r"function-\w+\[.*\]|nullable\[.*\]|[A-Z]\w*)$")


def _path(loc: tuple) -> list:
    """An error's location without pydantic's union branch names (as a client wrote it)."""
    out = []
    for i, part in enumerate(loc):
        if isinstance(part, str) and i > 0 and _UNION_TAG.match(part):
            continue
        out.append(part)
    return out


def _summary(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _error(e: ValidationError, model: type) -> RequestError:
    """A ValidationError as one line naming the field: the deepest of its errors (a union's branch that got
    furthest), or the field's description where every branch failed at its top."""
    errors = e.errors(include_url=False, include_context=False)
    paths = [_path(x["loc"]) for x in errors]
    k = max(range(len(errors)), key=lambda i: (len(paths[i]), errors[i]["type"] == "value_error"))
    err, path = errors[k], paths[k]
    if not path:
        if err["type"] == "model_type":
            return RequestError("the request body must be a JSON object")
        return RequestError(str(err["msg"]).removeprefix("Value error, "))
    param = str(path[0])
    field = model.model_fields.get(param)
    where = ".".join(str(p) for p in path)
    if len(path) == 1 and sum(p[:1] == path for p in paths) > 1 and field is not None and field.description \
            and err["type"] != "value_error":
        return RequestError(f"{param} must be {field.description}, got {_summary(err.get('input'))}", param)
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] not in ("missing", "value_error") and "input" in err:
        msg += f", got {_summary(err['input'])}"
    return RequestError(f"{where}: {msg}", param)


def parse(model: type, raw: bytes):
    """The request `model` in body `raw`, or RequestError."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first["type"] != "json_invalid":
            raise _error(e, model) from None
        why = str(first.get("ctx", {}).get("error", first["msg"]))
    if "escape" not in why and "unicode" not in why:  # (jiter's words for a lone surrogate)
        raise RequestError(f"the request body is not valid JSON ({why})")
    try:  # a lone surrogate: Python's parser reads it, and the field that holds it is named
        obj = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise RequestError(f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise _error(e, model) from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def openapi(title: str, version: str) -> dict:
    """The OpenAPI 3.1 description of the server's endpoints, the request models' JSON schemas in it."""
    models = [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, ErrorResponse]
    _, top = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")

    def ref(m: type) -> dict:
        return {"$ref": f"#/components/schemas/{m.__name__}"}

    errors = {str(code): {"description": what, "content": {"application/json": {"schema": ref(ErrorResponse)}}}
              for code, what in ((400, "an invalid request, naming the field"), (404, "an unknown model"),
                                 (408, "the body came too slowly"), (413, "a body over --max_request_bytes"),
                                 (503, "busy or shutting down: retry later (Retry-After)"))}
    json_or_events = {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "string"}}}

    def post(model: type, summary: str, streams: bool = False) -> dict:
        ok = json_or_events if streams else {"application/json": {"schema": {"type": "object"}}}
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": ref(model)}}}, "responses": {"200": {"description": "the result",
                                                                               "content": ok}, **errors}}}

    def get(summary: str, media: str = "application/json") -> dict:
        return {"get": {"summary": summary, "responses": {"200": {"description": summary, "content": {
            media: {"schema": {"type": "object" if media == "application/json" else "string"}}}}}}}

    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": {
        "/v1/completions": post(CompletionRequest, "text completion", streams=True),
        "/v1/chat/completions": post(ChatCompletionRequest, "chat completion", streams=True),
        "/tokenize": post(TokenizeRequest, "token ids of a prompt or a conversation"),
        "/detokenize": post(DetokenizeRequest, "text of token ids"),
        "/v1/models": get("the served model"),
        "/health": {"get": {"summary": "200 while serving, 503 while shutting down", "responses": {
            "200": {"description": "serving"}, "503": errors["503"]}}},
        "/metrics": get("Prometheus metrics", "text/plain"),
    }, "components": {"schemas": top["$defs"]}}
