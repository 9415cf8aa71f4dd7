"""Structured output: a sequence's tokens kept to a JSON schema, any JSON object, a regular expression, an EBNF grammar
or a set of choices, by masking its logits before each token is sampled (runner.engine.core).

The masks come from xgrammar (the library vLLM and SGLang default to): a grammar is compiled once per spec against the
tokenizer's vocabulary (sentencepiece pieces with byte fallback, or a tokenizer.json's tokens), and each sequence walks
it with a matcher of its own. (llguidance, the other well-kept choice and the lighter install, was tried first: its
tokenizer wrapper mishandled sentencepiece's "▁" word prefix of the shipped model, allowing only "▁" before a JSON
object and then refusing it. Both fill a mask in tens of microseconds a token here.) Every rank builds the same
matcher and applies the same mask, so the ranks keep sampling the same tokens.

A spec is a dict with one key, as vLLM's structured outputs: {"json": schema (dict or JSON text)}, {"json_object":
True}, {"regex": pattern}, {"grammar": EBNF with a `root` rule}, {"choice": [strings]}.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

KINDS = ("json", "json_object", "regex", "grammar", "choice")


class SpecError(ValueError):
    """A spec that does not compile; `kind` names its key."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Constraint:
    """One sequence's walk through a compiled grammar."""

    def __init__(self, compiled, vocab_size: int, stop_ids: list):
        import xgrammar as xgr
        self._xgr, self.vocab_size = xgr, vocab_size
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: "torch.Tensor") -> "torch.Tensor":
        """logits [vocab] with the tokens the grammar does not allow next set to -inf (a copy)."""
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        out = logits.float().cpu().clone()[None]
        self._xgr.apply_token_bitmask_inplace(out, self.bitmask)
        return out[0]

    def accept(self, token: int) -> bool:
        """Takes the sampled token; True once the grammar is complete (the token was its stop)."""
        self.matcher.accept_token(token)
        return self.matcher.is_terminated()


class Grammars:
    """Compiles specs for one tokenizer (runner.engine.tokenizer.Tokenizer) and a model's vocabulary size; compiled
    grammars are cached by spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list):
        try:
            import xgrammar as xgr
        except ImportError as e:
            raise SpecError("structured_outputs", f"structured output needs xgrammar ({e}); install it with "
                                                  f"pip install 'pmx-runner[structured]'") from None
        self.vocab_size, self.stop_ids = vocab_size, list(stop_ids)
        vocab, kind, prefix_space = tokenizer.grammar_vocab()
        info = xgr.TokenizerInfo(vocab, xgr.VocabType[kind], vocab_size=vocab_size,
                                 stop_token_ids=self.stop_ids, add_prefix_space=prefix_space)
        self.compiler = xgr.GrammarCompiler(info)
        self._compiled = functools.lru_cache(maxsize=64)(self._compile)

    def constraint(self, spec: dict) -> Constraint:
        """A fresh matcher for `spec` (compiled on first use; SpecError naming the key where it does not compile, or
        where no token of this vocabulary can begin it: a tokenizer without the characters it needs)."""
        import torch  # (here, not at the top: checking a spec's shape, check_spec, needs no torch)
        c = Constraint(self.compiled(spec), self.vocab_size, self.stop_ids)
        if not torch.isfinite(c.mask(torch.zeros(self.vocab_size))).any():
            kind = next(iter(spec))
            raise SpecError(kind, f"{kind}: no token of this model's vocabulary can begin text it accepts (the "
                                  f"tokenizer lacks the characters it needs)")
        return c

    def compiled(self, spec: dict):
        kind, value = check_spec(spec)
        return self._compiled(kind, json.dumps(value))  # (property order kept: it is the output's order)

    def _compile(self, kind: str, value_json: str):
        value, c = json.loads(value_json), self.compiler
        try:
            if kind == "json":
                return c.compile_json_schema(value if isinstance(value, str) else json.dumps(value),
                                             any_whitespace=False)
            if kind == "json_object":  # any JSON object, written compactly (no whitespace for a model to loop on)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(value)
            if kind == "grammar":
                return c.compile_grammar(value)
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in value))  # choice
        except (RuntimeError, ValueError, TypeError) as e:
            why = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", " ".join(str(e).split()))  # (xgrammar's log prefix)
            raise SpecError(kind, f"{kind} does not compile: {why[:300]}") from None


def check_spec(spec: Optional[dict]) -> tuple:
    """(kind, value) of a spec; SpecError naming what is wrong with its shape."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise SpecError("structured_outputs", f"structured_outputs must be an object with one of the keys "
                                              f"{', '.join(KINDS)}, got {json.dumps(spec)[:80]}")
    kind, value = next(iter(spec.items()))
    ok = {"json": isinstance(value, (dict, str)), "json_object": value is True, "regex": isinstance(value, str),
          "grammar": isinstance(value, str),
          "choice": isinstance(value, list) and value and all(isinstance(s, str) for s in value)}[kind]
    if not ok:
        want = {"json": "a JSON schema (object or JSON text)", "json_object": "true", "regex": "a string",
                "grammar": "an EBNF string", "choice": "a non-empty array of strings"}[kind]
        raise SpecError(kind, f"{kind} must be {want}, got {json.dumps(value)[:80]}")
    if kind == "json" and isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as e:
            raise SpecError(kind, f"json is not valid JSON ({e})") from None
    return kind, value
