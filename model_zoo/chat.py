"""Chat formats of the families whose chat prompt is built by their own code rather than by a `chat_template` in
tokenizer_config.json, written as Jinja templates that give the same text (and, tokenized by
runner/serve/chat.py with the special tokens listed, the same ids).

Conversion adds the family's template to the PMX directory's tokenizer_config.json where the checkpoint has none,
and lists the special tokens the template uses in its `added_tokens_decoder` (as transformers writes them), so
that /v1/chat/completions works for these models. A template the checkpoint has is kept as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from runner.engine.tokenizer import CHATGLM_SPECIALS
from runner.errors import PmxError

__all__ = ["CHATGLM_SPECIALS"]
# ChatGLM3 (tokenizer_config.json of THUDM/chatglm3-6b; build_chat_input: <|role|> "\n" content)
CHATGLM3_TEMPLATE = (
    "{% for message in messages %}{% if loop.first %}[gMASK]sop<|{{ message['role'] }}|>\n {{ message['content'] }}"
    "{% else %}<|{{ message['role'] }}|>\n {{ message['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# ChatGLM2 (modeling_chatglm.py build_prompt: "[Round n]\n\n问：query\n\n答：response\n\n", after [gMASK] sop)
CHATGLM2_TEMPLATE = (
    "[gMASK]sop{% set ns = namespace(round=0) %}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{% set ns.round = ns.round + 1 %}[Round {{ ns.round }}]\n\n问：{{ message['content'] }}\n\n答："
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}\n\n{% endif %}{% endfor %}")
# Qwen (qwen_generation_utils.make_context, chat_format "chatml"; its default system prompt)
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# InternLM2-chat (its tokenizer_config.json)
INTERNLM2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# InternLM-chat (v1, modeling_internlm.py build_inputs: "<|User|>:query<eoh>\n<|Bot|>:response<eoa>\n")
INTERNLM_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}<|System|>:"
    "{{ message['content'] }}\n{% elif message['role'] == 'user' %}<|User|>:{{ message['content'] }}<eoh>\n<|Bot|>:"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}<eoa>\n{% endif %}{% endfor %}")


# Gemma 2 / 3 (google/gemma-3-*-it's template, text content): turns as <start_of_turn>role ... <end_of_turn>, the
# assistant's role "model", a system message prepended to the first user turn
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + "
    "'\n\n' %}{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}{% set loop_messages = "
    "messages %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] "
    "| trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
GEMMA_SPECIALS = ("<start_of_turn>", "<end_of_turn>")
# Phi-3 / 3.5 (microsoft/Phi-3-mini-4k-instruct's template): <|role|> "\n" content <|end|> "\n"
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] in ('system', 'user', 'assistant') %}{{ '<|' + "
    "message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt "
    "%}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
PHI3_SPECIALS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


def special_ids(directory: Optional[Path], pieces) -> dict:
    """{piece: id} of the pieces (a special token's text, or an id for its text) the directory's tokenizer has:
    tokenizer.json's added tokens and vocabulary, else tokenizer.model's pieces."""
    path = Path(directory) / "tokenizer.json" if directory is not None else None
    if path is None or not path.is_file():
        return sentencepiece_ids(directory, pieces)
    try:
        tok = json.loads(path.read_text())
        vocab = (tok.get("model") or {}).get("vocab")
        vocab = {**(vocab if isinstance(vocab, dict) else {}),
                 **{t["content"]: t["id"] for t in tok.get("added_tokens") or []}}
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as e:
        raise PmxError(f"{path}: cannot read it as a tokenizer.json ({e})") from None
    text = {i: t for t, i in vocab.items()}
    found = {}
    for piece in pieces:
        t = text.get(piece) if isinstance(piece, int) else piece
        if t in vocab:
            found[t] = vocab[t]
    return found


def baichuan_template(user: str, assistant: str, eos: str) -> str:
    """Baichuan 2 chat (generation_utils.build_chat_input): a system prompt as plain text, then user_token_id +
    query, assistant_token_id + response + eos, ending with assistant_token_id; `user`, `assistant`, `eos` are
    those tokens' pieces."""
    return ("{% for message in messages %}{% if message['role'] == 'user' %}" + user + "{{ message['content'] }}"
            "{% elif message['role'] == 'assistant' %}" + assistant + "{{ message['content'] }}" + eos +
            "{% else %}{{ message['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}" + assistant +
            "{% endif %}")


def tokenizer_config_with(directory: Path, template: Optional[str], specials: dict, named: Optional[dict] = None
                          ) -> dict:
    """{"tokenizer_config.json": text}: the checkpoint's tokenizer_config.json (or an empty one) with `template` as
    its chat_template where it has none (neither there nor in chat_template.jinja), the special tokens
    `specials` (text -> id) added to its added_tokens_decoder where missing, and with the template, the `named` ones
    (e.g. "bos_token" -> its text) where it names none; {} where nothing is to add."""
    path = Path(directory) / "tokenizer_config.json"
    try:
        cfg = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise PmxError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise PmxError(f"{path}: expected a JSON object")
    changed = False
    if template and not cfg.get("chat_template") and not (Path(directory) / "chat_template.jinja").is_file():
        cfg["chat_template"], changed = template, True
        for key, text in (named or {}).items():
            if cfg.get(key) is None:
                cfg[key] = text
    added = dict(cfg.get("added_tokens_decoder") or {})
    have = {t.get("content") for t in added.values() if isinstance(t, dict)}
    for text, i in specials.items():
        if text not in have and str(i) not in added:
            added[str(i)] = {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": True}
            changed = True
    if not changed:
        return {}
    cfg["added_tokens_decoder"] = added
    return {"tokenizer_config.json": json.dumps(cfg, indent=2, ensure_ascii=False) + "\n"}


def sentencepiece_ids(directory: Optional[Path], pieces) -> dict:
    """{piece: id} of the pieces the directory's tokenizer.model has (none without one)."""
    path = Path(directory) / "tokenizer.model" if directory is not None else None
    if path is None or not path.is_file():
        return {}
    import sentencepiece as spm
    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except Exception as e:  # noqa: BLE001 (sentencepiece raises plain RuntimeError / OSError)
        raise PmxError(f"{path}: not a sentencepiece model ({' '.join(str(e).split())[:200]})") from None
    found = {}
    for piece in pieces:
        i = sp.piece_to_id(piece) if isinstance(piece, str) else piece
        if 0 <= i < sp.get_piece_size() and (not isinstance(piece, str) or sp.id_to_piece(i) == piece):
            found[sp.id_to_piece(i)] = i
    return found


def sentencepiece_size(directory: Optional[Path]) -> Optional[int]:
    """Pieces of the directory's tokenizer.model, or None without one."""
    path = Path(directory) / "tokenizer.model" if directory is not None else None
    if path is None or not path.is_file():
        return None
    import sentencepiece as spm
    try:
        return spm.SentencePieceProcessor(model_file=str(path)).get_piece_size()
    except Exception as e:  # noqa: BLE001
        raise PmxError(f"{path}: not a sentencepiece model ({' '.join(str(e).split())[:200]})") from None
