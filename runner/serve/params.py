"""`SamplingParams` of the offline API and the server, in vLLM's shape.

It extends the engine's :class:`runner.engine.sampling_params.SamplingParams` (temperature, top_k, top_p, min_p,
seed, the penalties and logit_bias: the same fields with the same meaning, so it goes wherever that one goes, e.g. to
a :class:`~runner.engine.sampler.Sampler`) with what a request asks for: max_tokens, n, stop strings and token ids,
logprobs, ignore_eos. Its defaults are vLLM's (and OpenAI's): temperature 1.0, max_tokens 16. `top_k` -1 (vLLM's
"off") is taken as 0. Checking one needs no torch (the server's front end has none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from runner.engine import sampling_params
from runner.engine.structured import SpecError, check_spec
from runner.errors import PmxError

MAX_LOGPROBS = 20
MAX_N = 64
MAX_PENALTY = 2.0      # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-100, 100] (OpenAI's range)


class ParamError(PmxError):
    """A bad request value; `param` names the field (for the server's error body)."""

    def __init__(self, param: Optional[str], message: str):
        super().__init__(message)
        self.param = param


def is_int(x) -> bool:
    """An integer, and not a bool (JSON's true is no count)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    """A finite number, and not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams(sampling_params.SamplingParams):
    """How to sample one request: the engine's sampling fields plus the request's limits and stops.

    Args:
        n: how many completions of the prompt (each its own sequence).
        max_tokens: new tokens at most per completion; None: up to the model's positions.
        temperature: 0 is greedy; > 0 samples from softmax(logits / temperature).
        top_p: nucleus mass (1: off).
        top_k: keep the k most likely tokens (0 or -1: off).
        min_p: drop the tokens less likely than min_p times the most likely one (0: off).
        repetition_penalty: > 0; the logits of tokens in the prompt or the output are divided by it (positive ones)
            or multiplied (negative ones); 1: off.
        frequency_penalty, presence_penalty: in [-2, 2]; subtracted from a token's logit per time it was generated,
            and once if it was generated at all.
        logit_bias: {token id: bias in [-100, 100]} added to the logits.
        seed: sampling seed; completion i of a request uses seed + i. None: a random seed.
        stop: strings that end a completion (not included in its text unless include_stop_str_in_output).
        stop_token_ids: token ids that end a completion, like EOS.
        ignore_eos: keep going past EOS (until max_tokens or a stop).
        logprobs: also return the log-probabilities of this many most likely tokens per new token (0: the
            chosen token's only); None: none.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        prompt_logprobs: also return the log-probability of each prompt token after the ones before it, with this
            many most likely tokens per position (vLLM's; the request's prompt is scored once beside its
            completions); None: none.
        structured_outputs: keep the text to a JSON schema, any JSON object, a regex, an EBNF grammar or a choice
            ({"json": schema} | {"json_object": true} | {"regex": ...} | {"grammar": ...} | {"choice": [...]}, as
            vLLM's; runner.engine.structured).
    """
    temperature: float = 1.0
    n: int = 1
    max_tokens: Optional[int] = 16
    stop: Union[str, tuple, list, None] = ()
    stop_token_ids: Union[tuple, list, None] = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: Optional[int] = None
    structured_outputs: Optional[dict] = None

    def __post_init__(self):
        def need(ok: bool, name: str, what: str, value) -> None:
            if not ok:
                raise ParamError(name, f"{name} must be {what}, got {value!r}")

        need(is_number(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0", self.temperature)
        need(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        need(is_int(self.top_k) and self.top_k >= -1, "top_k", "an integer >= -1 (-1 or 0: off)", self.top_k)
        need(is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]", self.min_p)
        need(is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
             "a finite number > 0", self.repetition_penalty)
        for name in ("frequency_penalty", "presence_penalty"):
            need(is_number(getattr(self, name)) and abs(getattr(self, name)) <= MAX_PENALTY, name,
                 f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", getattr(self, name))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        need(all(isinstance(kv, (tuple, list)) and len(kv) == 2 and _token_key(kv[0]) is not None and is_number(kv[1])
                 and abs(kv[1]) <= MAX_LOGIT_BIAS for kv in bias), "logit_bias",
             f"an object of token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", self.logit_bias)
        object.__setattr__(self, "logit_bias", tuple(sorted((_token_key(t), float(b)) for t, b in bias)) or None)
        need(self.seed is None or (is_int(self.seed) and -2 ** 63 <= self.seed < 2 ** 63), "seed",
             "an integer in [-2**63, 2**63) or null", self.seed)
        need(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"an integer in [1, {MAX_N}]", self.n)
        need(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
             "an integer >= 1 or null", self.max_tokens)
        need(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
             f"an integer in [0, {MAX_LOGPROBS}] or null", self.logprobs)
        need(self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and
                                              0 <= self.prompt_logprobs <= MAX_LOGPROBS), "prompt_logprobs",
             f"an integer in [0, {MAX_LOGPROBS}] or null", self.prompt_logprobs)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        need(all(isinstance(s, str) and s for s in stop), "stop", "a non-empty string or a list of them", self.stop)
        ids = tuple(self.stop_token_ids or ())
        need(all(is_int(t) and t >= 0 for t in ids), "stop_token_ids", "a list of token ids", self.stop_token_ids)
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "a boolean", self.ignore_eos)
        need(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output", "a boolean",
             self.include_stop_str_in_output)
        if self.structured_outputs is not None:
            try:
                check_spec(self.structured_outputs)
            except SpecError as e:
                raise ParamError("structured_outputs", str(e)) from None
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "top_k", max(self.top_k, 0))
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", ids)
        super().__post_init__()

    def for_choice(self, index: int, seed: int) -> sampling_params.SamplingParams:
        """The engine's sampling params of completion `index`: seeded with this request's seed + index, or
        without one with `seed` (drawn per request) + index."""
        return sampling_params.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                      seed=(seed if self.seed is None else self.seed) + index, min_p=self.min_p,
                                      repetition_penalty=self.repetition_penalty,
                                      frequency_penalty=self.frequency_penalty,
                                      presence_penalty=self.presence_penalty, logit_bias=self.logit_bias)


def _token_key(t) -> Optional[int]:
    """A logit_bias key as a token id: an integer >= 0, or its decimal string (JSON object keys are strings)."""
    if isinstance(t, str) and t.isascii() and t.isdigit() and len(t) < 20:
        t = int(t)
    return t if is_int(t) and 0 <= t < 2 ** 63 else None
