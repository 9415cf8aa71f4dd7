"""The BOS rule (runner.engine.tokenizer): transformers' own tokenizer on the real checkpoints decides, and every
command (Demo, perplexity, LLM, the server's loader, benchmarks/quant_accuracy.py) encodes a prompt the same way."""

from __future__ import annotations

import json
import shutil

import pytest

from runner.engine.tokenizer import Tokenizer
from runner.pmx.convert import convert

TEXT = "Once upon a time, Lily saw a big red ball."


def _copy(src, dst, names):
    dst.mkdir()
    for n in names:
        if (src / n).exists():
            shutil.copy(src / n, dst / n)
    return dst


def test_tokenizer_json_adds_what_transformers_adds(shared_model, tmp_path):
    """tinystories-656k's tokenizer.json: its post-processor puts <|start_story|> (id 1) first, as
    AutoTokenizer does; without that post-processor neither adds anything, whatever bos_token_id says."""
    from transformers import AutoTokenizer
    src = shared_model("tinystories-656k")
    files = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    want = AutoTokenizer.from_pretrained(src)(TEXT).input_ids
    assert want[0] == 1
    assert Tokenizer(str(src)).encode(TEXT) == want  # what quant_accuracy.py builds (no ids from the params)
    assert Tokenizer(str(src), 1, 2).encode(TEXT) == want  # what the commands build
    bare = _copy(src, tmp_path / "no_post_processor", files)
    tj = json.loads((bare / "tokenizer.json").read_text())
    (bare / "tokenizer.json").write_text(json.dumps({**tj, "post_processor": None}))
    want = AutoTokenizer.from_pretrained(bare)(TEXT).input_ids
    assert want[0] != 1
    assert Tokenizer(str(bare), 1, 2).encode(TEXT) == want
    assert Tokenizer(str(src)).encode(TEXT, bos=False) == want  # a chat template's text: the template writes BOS


def test_sentencepiece_adds_bos_unless_its_config_says_not(shared_model, tmp_path):
    """stories260k: transformers gives [1, 403, 407, 261, 378] for "Once upon a time" (SOURCE.md, transformers
    5.23); `"add_bos_token": false` in tokenizer_config.json takes BOS away, as in transformers."""
    src = shared_model("stories260k")
    assert Tokenizer(str(src)).encode("Once upon a time") == [1, 403, 407, 261, 378]
    off = _copy(src, tmp_path / "off", ("tokenizer.model", "tokenizer_config.json"))
    cfg = json.loads((off / "tokenizer_config.json").read_text())
    (off / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": False}))
    assert Tokenizer(str(off), 1, 2).encode("Once upon a time") == [403, 407, 261, 378]
    try:  # transformers reads a sentencepiece model only with protobuf installed (not a dependency here)
        import google.protobuf  # noqa: F401
    except ImportError:
        return
    from transformers import AutoTokenizer
    for d in (src, off):
        assert Tokenizer(str(d)).encode(TEXT) == AutoTokenizer.from_pretrained(d)(TEXT).input_ids


@pytest.mark.parametrize("name", ["tinystories-656k", "stories260k"])
def test_every_command_encodes_a_prompt_alike(shared_model, tmp_path, name):
    """Demo's first step (its dumped token_ids), perplexity's token count, LLM's prompt ids and the server's
    tokenizer all equal Tokenizer(dir).encode, the tokenizer benchmarks/quant_accuracy.py makes."""
    from runner import LLM, SamplingParams
    from runner.config import EngineConfig
    from runner.engine.demo import generate
    from runner.engine.dump import load_step
    from runner.engine.perplexity import perplexity
    from runner.serve.loader import load
    pmx = tmp_path / "pmx"
    convert(str(shared_model(name)), str(pmx), progress=False)
    want = Tokenizer(str(pmx)).encode(TEXT)
    assert want[0] == 1
    generate(str(pmx), prompt=TEXT, max_gen_len=2, dump_tensor_path=str(tmp_path / "dump"), dump_steps="0",
             progress=False)
    assert load_step(str(tmp_path / "dump" / "rank_0"), 0)["token_ids"].tolist() == want
    (tmp_path / "text.txt").write_text(TEXT)
    assert perplexity(str(pmx), str(tmp_path / "text.txt"), window=64, stride=32)["tokens"] == len(want) - 1
    with LLM(str(pmx), kv_cache_tokens=1024) as llm:
        assert llm.generate(TEXT, SamplingParams(max_tokens=1))[0].prompt_token_ids == want
    loaded = load(str(pmx), None, EngineConfig(kv_cache_tokens=1024))
    try:
        assert loaded.tokenizer.encode(TEXT) == want
    finally:
        loaded.session.close()
