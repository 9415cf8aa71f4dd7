"""Tokenizers: a sentencepiece `tokenizer.model` or a HF `tokenizer.json` (the `tokenizers` library)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from runner.errors import PmxError


class Tokenizer:
    """encode(text) -> ids with BOS first; decode(ids) -> text. `path` is a file or a directory holding one.

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
                self.bos_id = bos_id if bos_id is not None else self._hf.token_to_id("<s>")
                self.eos_id = eos_id if eos_id is not None else self._hf.token_to_id("</s>")
            else:
                import sentencepiece as spm
                self._sp = spm.SentencePieceProcessor(model_file=str(p))
                self._hf = None
                self.size = self._sp.get_piece_size()
                self.bos_id = bos_id if bos_id is not None else self._sp.bos_id()
                self.eos_id = eos_id if eos_id is not None else self._sp.eos_id()
        except Exception as e:  # noqa: BLE001 (sentencepiece and tokenizers raise plain RuntimeError / OSError)
            kind = "a HF tokenizer.json" if p.suffix == ".json" else "a sentencepiece tokenizer.model"
            raise PmxError(f"{p}: not {kind} ({' '.join(str(e).split())[:200]})") from None
        if vocab_size is not None and not vocab_size // 2 < self.size <= vocab_size:
            raise PmxError(f"{p}: the tokenizer has {self.size} tokens, which does not fit the model's vocabulary of "
                           f"{vocab_size} (pmx_params.json vocab_size): it belongs to another model")

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = self._sp.encode(text) if self._sp else self._hf.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos and self.bos_id is not None and self.bos_id >= 0 else []) + list(ids)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size() if self._sp else self._hf.get_vocab_size()

    def token_id(self, text: str):
        """The id of the token spelled `text` (e.g. a special token such as "<s>"), or None."""
        if self._sp:
            i = self._sp.piece_to_id(text)
            return i if self._sp.id_to_piece(i) == text else None
        return self._hf.token_to_id(text)

    def grammar_vocab(self) -> tuple[list, str, bool]:
        """What a grammar library needs to map text onto tokens (runner.engine.structured): each token as the
        tokenizer stores it, the vocabulary's kind (xgrammar's names: BYTE_FALLBACK for "▁"-spaced pieces with
        <0xNN> bytes, BYTE_LEVEL for GPT-2's byte alphabet, RAW) and whether encoding prepends a space. Special
        tokens (<unk>, <s>, ...) are "": no text maps onto them."""
        if self._sp:
            sp = self._sp
            return ["" if sp.is_control(i) or sp.is_unknown(i) else sp.id_to_piece(i) for i in range(self.size)], \
                "BYTE_FALLBACK", True
        spec = json.loads(self._hf.to_str())
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        vocab = [""] * self.size
        for text, i in self._hf.get_vocab(with_added_tokens=True).items():
            vocab[i] = "" if i in special else text
        kinds = json.dumps(spec.get("decoder")) + json.dumps(spec.get("pre_tokenizer"))
        kind = "BYTE_LEVEL" if '"ByteLevel"' in kinds else "BYTE_FALLBACK" if '"ByteFallback"' in kinds else "RAW"
        return vocab, kind, '"Prepend"' in json.dumps(spec.get("normalizer"))

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
