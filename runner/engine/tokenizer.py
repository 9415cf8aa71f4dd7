"""Tokenizers: a sentencepiece `tokenizer.model` or a HF `tokenizer.json` (the `tokenizers` library).

The BOS rule, one for every command (Demo, perplexity, LLM, the server, the benchmarks), is transformers' own
(`AutoTokenizer(dir)(text)`, checked on stories260k and tinystories-656k): a `tokenizer.json` adds what its
post-processor puts before the text (tinystories-656k: `<|start_story|>`; a Qwen2 tokenizer: nothing); a
sentencepiece model adds its BOS unless the `tokenizer_config.json` beside it says `"add_bos_token": false`
(transformers 5 adds none when that file is missing; Meta's Llama code, ppl.pmx and llama.cpp add it, as here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from runner.errors import PmxError


class Tokenizer:
    """encode(text) -> ids with BOS first where the tokenizer adds one (the module's rule); decode(ids) -> text.
    `path` is a file or a directory holding one. `bos_id` / `eos_id` (the model's, from pmx_params.json) name those
    tokens where the tokenizer's files do not; whether BOS is added is the tokenizer's own rule.

    With `vocab_size` (the model's), the tokenizer must fit the model: at most vocab_size tokens, and more
    than half of it (models pad their vocabulary to a round size, they never double it), so that another
    model's tokenizer is refused at load rather than failing at decode.
    """

    def __init__(self, path: str, bos_id: Optional[int] = None, eos_id: Optional[int] = None,
                 vocab_size: Optional[int] = None):
        p = Path(path)
        if p.is_dir():
            found = [p / n for n in ("tokenizer.model", "tokenizer.json") if (p / n).is_file()]
            if not found:
                raise PmxError(f"{p}: holds neither tokenizer.model nor tokenizer.json")
            p = found[0]
        if not p.is_file():
            raise PmxError(f"{p}: tokenizer file not found (expected tokenizer.model or tokenizer.json)")
        self.path = p
        try:
            if p.suffix == ".json":
                from tokenizers import Tokenizer as HFTokenizer
                self._hf = HFTokenizer.from_file(str(p))
                self._sp = None
                self.size = self._hf.get_vocab_size(with_added_tokens=True)
                self._prefix = _post_processor_prefix(self._hf)
                own_bos = self._prefix[0] if len(self._prefix) == 1 else self._hf.token_to_id("<s>")
                self.bos_id = bos_id if bos_id is not None else own_bos
                self.eos_id = eos_id if eos_id is not None else self._hf.token_to_id("</s>")
            else:
                import sentencepiece as spm
                self._sp = spm.SentencePieceProcessor(model_file=str(p))
                self._hf = None
                self.size = self._sp.get_piece_size()
                self.bos_id = bos_id if bos_id is not None else self._sp.bos_id()
                self.eos_id = eos_id if eos_id is not None else self._sp.eos_id()
                adds = _config(p.parent).get("add_bos_token", True) is not False
                self._prefix = [self.bos_id] if adds and self.bos_id is not None and self.bos_id >= 0 else []
        except Exception as e:  # noqa: BLE001 (sentencepiece and tokenizers raise plain RuntimeError / OSError)
            kind = "a HF tokenizer.json" if p.suffix == ".json" else "a sentencepiece tokenizer.model"
            raise PmxError(f"{p}: not {kind} ({' '.join(str(e).split())[:200]})") from None
        if vocab_size is not None and not vocab_size // 2 < self.size <= vocab_size:
            raise PmxError(f"{p}: the tokenizer has {self.size} tokens, which does not fit the model's vocabulary of "
                           f"{vocab_size} (pmx_params.json vocab_size): it belongs to another model")

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """The ids of `text`, after the tokens the tokenizer puts first (its BOS) unless bos=False (a chat
        template's text, which writes its own)."""
        ids = self._sp.encode(text) if self._sp else self._hf.encode(text, add_special_tokens=False).ids
        return (list(self._prefix) if bos else []) + list(ids)

    @property
    def adds_bos(self) -> bool:
        return bool(self._prefix)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size() if self._sp else self._hf.get_vocab_size()

    def token_id(self, text: str):
        """The id of the token spelled `text` (e.g. a special token such as "<s>"), or None."""
        if self._sp:
            i = self._sp.piece_to_id(text)
            return i if self._sp.id_to_piece(i) == text else None
        return self._hf.token_to_id(text)

    def token_text(self, token_id: int) -> str:
        """The text of one token as it appears in a decoded string (its leading space kept)."""
        if self._sp:
            piece = self._sp.id_to_piece(token_id)
            if self._sp.is_byte(token_id):
                return chr(int(piece[3:-1], 16)) if int(piece[3:-1], 16) < 128 else piece
            return piece.replace("\u2581", " ")
        return self._hf.decode([token_id], skip_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, BOS / EOS left out, and ids past the tokenizer's end (a padded vocabulary's rows)."""
        ids = [i for i in ids if i not in (self.bos_id, self.eos_id) and 0 <= i < self.size]
        if self._sp:
            return self._sp.decode(ids)
        text = self._hf.decode(ids, skip_special_tokens=True)
        return text[1:] if text.startswith(" ") else text  # the space its "prepend ▁" normaliser added


def _post_processor_prefix(hf) -> list[int]:
    """The ids a tokenizer.json's post-processor puts before the text (as transformers' encode does), found by
    encoding one character with and without it; any it puts after (an EOS) are not added to a prompt."""
    plain = hf.encode("a", add_special_tokens=False).ids
    full = hf.encode("a", add_special_tokens=True).ids
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
    return full[:at]


def _config(directory: Path) -> dict:
    """tokenizer_config.json beside the tokenizer ({} when absent or unreadable)."""
    try:
        cfg = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}
