"""Chat templates and prompt text with special tokens.

The template is the model's own: `chat_template` in its `tokenizer_config.json` (a string, or a list
of named templates of which "default" is used), or a `chat_template.jinja` file beside it. It is
rendered with jinja2 the way transformers' `apply_chat_template` does (sandboxed, `trim_blocks`,
`lstrip_blocks`, loop controls, `raise_exception`, `tojson`, `strftime_now`; the special tokens as
`bos_token`, `eos_token`, ...), and the text is tokenized without adding BOS (the template writes
it), special token strings becoming their ids.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Optional

from runner.errors import PmxError

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_str(v) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


class ChatTemplate:
    def __init__(self, source: str, specials: dict, added: list, origin: str):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise PmxError(f"{origin}: the chat template does not parse: {e}") from None
        self.source, self.specials, self.added, self.origin = source, specials, added, origin

    def spec(self) -> list:
        """What ChatTemplate(*spec) makes again (in another process: the server's front end)."""
        return [self.source, self.specials, self.added, self.origin]

    @classmethod
    def load(cls, directory: Path, template_file: Optional[str] = None) -> Optional["ChatTemplate"]:
        """The template of the tokenizer files in `directory` (or the jinja file `template_file`, with the special
        tokens of `directory`), or None when there is none."""
        directory = Path(directory)
        if directory.is_file():
            directory = directory.parent
        cfg_path = directory / "tokenizer_config.json"
        cfg = {}
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text())
            except (OSError, ValueError) as e:
                raise PmxError(f"{cfg_path}: cannot read it as JSON ({e})") from None
        source, origin = cfg.get("chat_template"), str(cfg_path)
        if isinstance(source, list):  # named templates
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja_file = directory / "chat_template.jinja"
        if template_file is not None:
            try:
                source, origin = Path(template_file).read_text(), str(template_file)
            except (OSError, UnicodeDecodeError) as e:
                raise PmxError(f"{template_file}: cannot read the chat template ({getattr(e, 'strerror', None) or e})"
                               ) from None
        elif not source and jinja_file.is_file():
            source, origin = jinja_file.read_text(), str(jinja_file)
        if not isinstance(source, str) or not source:
            return None
        specials = {k: _token_str(cfg.get(k)) for k in SPECIAL_KEYS}
        added = [t["content"] for t in (cfg.get("added_tokens_decoder") or {}).values()
                 if isinstance(t, dict) and t.get("special") and isinstance(t.get("content"), str)]
        return cls(source, specials, added, origin)

    def render(self, messages: list, add_generation_prompt: bool = True, **kwargs) -> str:
        import jinja2
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.specials, **kwargs)
        except jinja2.exceptions.TemplateError as e:
            raise PmxError(f"the chat template failed on these messages: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise PmxError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None

    def encode(self, tokenizer, text: str) -> list[int]:
        """Token ids of rendered text: special token strings become their ids, the text between them is
        tokenized piece by piece without BOS (as transformers' sentencepiece Llama tokenizer does)."""
        specials = {s: tokenizer.token_id(s) for s in [*self.specials.values(), *self.added] if s}
        specials = {s: i for s, i in specials.items() if i is not None}
        if not specials:
            return tokenizer.encode(text, bos=False)
        pattern = "(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
        ids = []
        for part in re.split(pattern, text):
            if part in specials:
                ids.append(specials[part])
            elif part:
                ids.extend(tokenizer.encode(part, bos=False))
        return ids
