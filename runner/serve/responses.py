"""The shapes of OpenAI's (and vLLM's) responses: a completion or chat completion whole, or as stream chunks, from the
text deltas of its engine requests (runner.serve.output)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Optional

from runner.serve.params import SamplingParams
from runner.serve.tools import parse as parse_tools


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
    arrival: float = 0.0               # when the request came (time.monotonic()): its time to first token counts from it

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
