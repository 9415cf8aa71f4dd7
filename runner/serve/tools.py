"""Tool calls in OpenAI's shape: a chat request's `tools` go to the chat template (which writes them into the prompt,
as the model's own template does), and the completion comes back as `tool_calls`.

- tool_choice "none": the text as it is.
- "auto" (the default with tools): the text is searched for calls in the forms chat templates teach: Hermes / Qwen's
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, or the whole text one such JSON object (Llama 3's
  JSON tool calls; "parameters" taken for "arguments"); what is left is the message's content.
- "required", or a named function: the text is held to a JSON schema of the calls (structured output,
  runner.engine.structured), so it always parses: a named function's {"name", "arguments"} object, or for "required"
  an array of one or more calls of any of the tools.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Optional

from runner.serve.params import ParamError

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def choice_of(tool_choice, tools: list) -> str:
    """"none" | "auto" | "required" | a function's name, from the request's tool_choice (default: auto)."""
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return tool_choice or "auto"
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
        else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in names:
        raise ParamError("tool_choice", f"tool_choice must be none, auto, required or {{\"type\": \"function\", "
                                        f"\"function\": {{\"name\": one of {names}}}}}, got {json.dumps(tool_choice)}")
    return name


def _call_schema(fn: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             "arguments": fn.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"]}


def forced_spec(tools: list, choice: str, parallel: bool = True) -> Optional[dict]:
    """The structured-output spec that holds the text to the calls `choice` asks for (None: free text); one call
    at most unless `parallel` (the request's parallel_tool_calls)."""
    if choice in ("none", "auto"):
        return None
    fns = [t["function"] for t in tools]
    if choice == "required":
        return {"json": {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
                         "items": {"anyOf": [_call_schema(f) for f in fns]}}}
    return {"json": _call_schema(next(f for f in fns if f["name"] == choice))}


def _as_call(obj) -> Optional[dict]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def parse(text: str, choice: str, tools: list, parallel: bool = True) -> tuple[Optional[str], list]:
    """(content, tool_calls) of a completion under tool_choice `choice`; the first call only unless `parallel`."""
    if choice == "none":
        return text, []
    names = {t["function"]["name"] for t in tools}
    if choice != "auto":  # held to the schema: it parses, unless max_tokens cut it short
        try:
            data = json.loads(text)
        except ValueError:
            return text, []
        calls = [_as_call(c) for c in (data if isinstance(data, list) else [data])]
        return None, [c for c in calls if c is not None]
    calls = []
    for block in _HERMES.findall(text):
        try:
            call = _as_call(json.loads(block))
        except ValueError:
            continue
        if call is not None and call["function"]["name"] in names:
            calls.append(call)
    if calls:
        rest = _HERMES.sub("", text).strip()
        return rest or None, calls if parallel else calls[:1]
    try:
        call = _as_call(json.loads(text.strip()))
    except ValueError:
        call = None
    if call is not None and call["function"]["name"] in names:
        return None, [call]
    return text, []
