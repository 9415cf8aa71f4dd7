"""Tokenizers: a sentencepiece `tokenizer.model` or a HF `tokenizer.json` (the `tokenizers` library); and two
kinds whose tokenization is a family's own code, recognised from the files: ChatGLM's sentencepiece model with its
special tokens after its pieces and the `[gMASK]` `sop` prompt prefix (tokenizer_config.json's tokenizer_class
ChatGLMTokenizer), and Qwen's `qwen.tiktoken`, read with tiktoken (:class:`ChatGLMTokenizer`, :class:`QwenTokenizer`).
`Tokenizer(path, ...)` opens whichever kind `path` holds.

The BOS rule, one for every command (Demo, perplexity, LLM, the server, the benchmarks), is transformers' own
(`AutoTokenizer(dir)(text)`, checked on stories260k and tinystories-656k): a `tokenizer.json` adds what its
post-processor puts before the text (tinystories-656k: `<|start_story|>`; a Qwen2 tokenizer: nothing); a
sentencepiece model adds its BOS unless the `tokenizer_config.json` beside it says `"add_bos_token": false`
(transformers 5 adds none when that file is missing; Meta's Llama code, ppl.pmx and llama.cpp add it, as here).
"""

from __future__ import annotations

import base64
import json
import unicodedata
from pathlib import Path
from typing import Optional

from runner.errors import PmxError

# ChatGLM2/3's special tokens: numbered after the sentencepiece pieces, in this order (tokenization_chatglm.py)
CHATGLM_SPECIALS = ("[MASK]", "[gMASK]", "[sMASK]", "sop", "eop", "<|system|>", "<|user|>", "<|assistant|>",
                    "<|observation|>")
# Qwen's special tokens: numbered after the ranks of qwen.tiktoken (151643 of them as published), and its
# pre-tokenizing pattern (tokenization_qwen.py)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>") + tuple(f"<|extra_{i}|>" for i in range(205))
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def _kind(path) -> Optional[type]:
    """The tokenizer class for what `path` (a file, or a directory holding one) holds, where not the plain one."""
    p = Path(path)
    d = p if p.is_dir() else p.parent
    if p.name == "qwen.tiktoken" or (p.is_dir() and (p / "qwen.tiktoken").is_file()
                                     and not any((p / n).is_file() for n in ("tokenizer.model", "tokenizer.json"))):
        return QwenTokenizer
    if (p.name == "tokenizer.model" or (p.is_dir() and (p / "tokenizer.model").is_file())) \
            and (d / "tokenizer_config.json").is_file():
        try:
            cls = json.loads((d / "tokenizer_config.json").read_text()).get("tokenizer_class")
        except (OSError, ValueError, AttributeError):
            return None
        return ChatGLMTokenizer if cls == "ChatGLMTokenizer" else None
    return None


class Tokenizer:
    """encode(text) -> ids with BOS first where the tokenizer adds one (the module's rule); decode(ids) -> text.
    `path` is a file or a directory holding one. `bos_id` / `eos_id` (the model's, from pmx_params.json) name those
    tokens where the tokenizer's files do not; whether BOS is added is the tokenizer's own rule.

    With `vocab_size` (the model's), the tokenizer must fit the model: at most vocab_size tokens, and more
    than half of it (models pad their vocabulary to a round size, they never double it), so that another
    model's tokenizer is refused at load rather than failing at decode.
    """

    def __new__(cls, path: str, *args, **kwargs):
        kind = _kind(path) if cls is Tokenizer else None
        return super().__new__(kind or cls)

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
        _fits(self, vocab_size)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """The ids of `text`, after the tokens the tokenizer puts first (its BOS) unless bos=False (a chat
        template's text, which writes its own)."""
        ids = self._sp.encode(text) if self._sp else self._hf.encode(text, add_special_tokens=False).ids
        return (list(self._prefix) if bos else []) + list(ids)

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


def _fits(tok: Tokenizer, vocab_size: Optional[int]) -> None:
    if vocab_size is not None and not vocab_size // 2 < tok.size <= vocab_size:
        raise PmxError(f"{tok.path}: the tokenizer has {tok.size} tokens, which does not fit the model's vocabulary "
                       f"of {vocab_size} (pmx_params.json vocab_size): it belongs to another model")


def _file(path: str, name: str) -> Path:
    p = Path(path)
    p = p / name if p.is_dir() else p
    if not p.is_file():
        raise PmxError(f"{p}: tokenizer file not found (expected {name})")
    return p


class ChatGLMTokenizer(Tokenizer):
    """ChatGLM2/3's tokenizer: the sentencepiece pieces, then the special tokens CHATGLM_SPECIALS numbered after them;
    a prompt is [gMASK] sop + the pieces of its text (no BOS); special-token text in a prompt stays text, as in
    ChatGLM's tokenizer (a chat template's special tokens are mapped by runner.serve.chat, listed in the PMX
    directory's tokenizer_config.json)."""

    def __init__(self, path: str, bos_id: Optional[int] = None, eos_id: Optional[int] = None,
                 vocab_size: Optional[int] = None):
        self.path = _file(path, "tokenizer.model")
        import sentencepiece as spm
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except Exception as e:  # noqa: BLE001 (sentencepiece raises plain RuntimeError / OSError)
            raise PmxError(f"{self.path}: not a sentencepiece tokenizer.model ({' '.join(str(e).split())[:200]})") \
                from None
        self._hf, self.pieces = None, self._sp.get_piece_size()
        self.specials = {t: self.pieces + i for i, t in enumerate(CHATGLM_SPECIALS)}
        self.size = self.pieces + len(self.specials)
        self.prefix = [self.specials["[gMASK]"], self.specials["sop"]]
        self.bos_id = None
        self.eos_id = eos_id if eos_id is not None else self._sp.eos_id()
        _fits(self, vocab_size)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """[gMASK] sop (where `bos`: the start of a prompt) + the pieces of `text`."""
        return (self.prefix if bos else []) + list(self._sp.encode(text))

    @property
    def vocab_size(self) -> int:
        return self.size

    def token_id(self, text: str):
        return self.specials[text] if text in self.specials else super().token_id(text)

    def token_text(self, token_id: int) -> str:
        names = {i: t for t, i in self.specials.items()}
        return names[token_id] if token_id in names else super().token_text(token_id)

    def decode(self, ids: list[int]) -> str:
        """Text of the pieces among `ids` (special tokens, EOS and padded rows left out)."""
        return self._sp.decode([i for i in ids if 0 <= i < self.pieces and i != self.eos_id])


class QwenTokenizer(Tokenizer):
    """Qwen's tokenizer: `qwen.tiktoken` (base64 token, rank per line) as a tiktoken BPE with Qwen's pattern, its
    special tokens QWEN_SPECIALS numbered after the ranks. Text is NFC-normalised and special-token text in it
    becomes the special token, as QWenTokenizer.tokenize does by default; there is no BOS."""

    def __init__(self, path: str, bos_id: Optional[int] = None, eos_id: Optional[int] = None,
                 vocab_size: Optional[int] = None):
        self.path = _file(path, "qwen.tiktoken")
        try:
            import tiktoken
        except ImportError as e:
            raise PmxError(f"{self.path}: reading a qwen.tiktoken needs tiktoken ({e}); pip install tiktoken") from None
        try:
            ranks = {base64.b64decode(tok, validate=True): int(rank)
                     for tok, rank in (line.split() for line in self.path.read_bytes().splitlines() if line.strip())}
            self.specials = {t: len(ranks) + i for i, t in enumerate(QWEN_SPECIALS)}
            self._enc = tiktoken.Encoding("qwen", pat_str=QWEN_PATTERN, mergeable_ranks=ranks,
                                          special_tokens=self.specials)
        except Exception as e:  # noqa: BLE001 (a bad line: ValueError / binascii.Error; tiktoken: ValueError)
            raise PmxError(f"{self.path}: not a qwen.tiktoken file of 'base64-token rank' lines "
                           f"({' '.join(str(e).split())[:200]})") from None
        self._sp = self._hf = None
        self.ranks, self.size = len(ranks), len(ranks) + len(self.specials)
        self.bos_id = None
        self.eos_id = eos_id if eos_id is not None else self.specials["<|endoftext|>"]
        _fits(self, vocab_size)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return self._enc.encode(unicodedata.normalize("NFC", text), allowed_special="all", disallowed_special=())

    @property
    def vocab_size(self) -> int:
        return self.size

    def token_id(self, text: str):
        if text in self.specials:
            return self.specials[text]
        try:
            return self._enc.encode_single_token(text.encode())
        except KeyError:
            return None

    def token_text(self, token_id: int) -> str:
        if token_id >= self.ranks:
            return next((t for t, i in self.specials.items() if i == token_id), "")
        return self._enc.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens (EOS among them) and padded rows left out."""
        return self._enc.decode([i for i in ids if 0 <= i < self.ranks], errors="replace")


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
