"""HF -> PMX conversion checked against the HF weights (transformers as the reference)."""

from __future__ import annotations

import json

import pytest
import torch

from model_zoo.decoder import hf_names, permute_rotary, unpermute_rotary
from runner.pmx.convert import PmxModel, convert
from runner.pmx.params import PmxParams

def hf_name(pmx: str) -> str:
    return hf_names(pmx)[0]


def assert_matches_hf(pmx_dir, model):
    """Every PMX tensor, with the rotary permutation undone, equals the HF one bit for bit; none missing."""
    pm = PmxModel(pmx_dir)
    p = pm.params
    sd = model.state_dict()
    expected = {hf_name(n) for n in pm.keys}
    assert expected == set(sd), f"tensor sets differ: {sorted(expected ^ set(sd))}"
    for name in pm.keys:
        t = pm.get_merged(name)
        if ".wq." in name:
            t = permute_rotary(t, p.num_heads)
        elif ".wk." in name:
            t = permute_rotary(t, p.num_kv_heads)
        ref = sd[hf_name(name)]
        assert t.dtype == ref.dtype and torch.equal(t, ref), name


@pytest.mark.parametrize("arch", ["llama_mha", "llama_gqa_odd", "llama_bias", "mistral", "qwen2"])
@pytest.mark.parametrize("fmt,num_files", [("safetensors", 1), ("safetensors", 3), ("bin", 1), ("bin", 2)])
def test_convert_matches_hf(make_hf, tmp_path, arch, fmt, num_files):
    src, model = make_hf(arch, fmt=fmt, num_files=num_files)
    p = convert(str(src), str(tmp_path / "pmx"), progress=False)
    assert p.num_shards == 1 and p.dtype == "float32"
    assert_matches_hf(tmp_path / "pmx", model)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert (p.num_heads, p.num_kv_heads, p.head_dim) == (cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)
    assert p.tie_word_embeddings == cfg.tie_word_embeddings
    assert PmxParams.load(tmp_path / "pmx") == p


def test_qwen2_params(make_hf, tmp_path):
    src, _ = make_hf("qwen2")
    p = convert(str(src), str(tmp_path / "pmx"), progress=False)
    assert (p.model_type, p.qkv_bias, p.o_bias, p.rope_theta) == ("qwen2", True, False, 1e6)


def test_llama3_rope_scaling_kept(make_hf, tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
    src, _ = make_hf("llama_mha", rope_scaling=dict(scaling), max_position_embeddings=1024)
    p = convert(str(src), str(tmp_path / "pmx"), progress=False)
    assert p.rope_scaling == scaling and p.max_position_embeddings == 1024


def test_convert_with_dtype_and_shards(make_hf, tmp_path):
    src, model = make_hf("llama_gqa_odd")
    p = convert(str(src), str(tmp_path / "pmx"), dtype="bfloat16", num_shards=4, progress=False)
    assert (p.dtype, p.num_shards, p.kv_replication) == ("bfloat16", 4, 2)
    assert p.padded_dims == {"intermediate_dim": 72, "vocab_size": 80}
    pm = PmxModel(tmp_path / "pmx")
    ref = unpermute_rotary(model.state_dict()["model.layers.1.self_attn.k_proj.weight"], 2).bfloat16()
    assert torch.equal(pm.get_merged("layers.1.attention.wk.weight"), ref)


def test_rotary_permutation_roundtrip():
    w = torch.randn(4 * 6, 5)
    assert torch.equal(permute_rotary(unpermute_rotary(w, 4), 4), w)
    # interleaved layout: pairs (2j, 2j+1) of a head come from rows j and d/2 + j of HF's layout
    hf = torch.arange(8.0)[:, None]  # one head, d = 8
    assert unpermute_rotary(hf, 1).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("name,tied_key", [("stories260k", "model.embed_tokens.weight"),
                                           ("tinystories-656k", "lm_head.weight")])
def test_real_checkpoints_tied_embeddings(shared_model, tmp_path, name, tied_key):
    from safetensors.torch import load_file
    src = shared_model(name)
    p = convert(str(src), str(tmp_path / "pmx"), progress=False)
    sd = load_file(str(src / "model.safetensors"))
    assert set(sd) & {"model.embed_tokens.weight", "lm_head.weight"} == {tied_key}
    pm = PmxModel(tmp_path / "pmx")
    assert torch.equal(pm.get_merged("tok_embeddings.weight"), sd[tied_key])
    assert torch.equal(pm.get_merged("output.weight"), sd[tied_key])
    assert p.tie_word_embeddings and p.vocab_size == sd[tied_key].shape[0]
    copied = {f.name for f in (tmp_path / "pmx").iterdir()}
    assert copied >= {"pmx_params.json", "model.00.safetensors"}
    assert ("tokenizer.model" in copied) == (src / "tokenizer.model").exists()
    assert ("tokenizer.json" in copied) == (src / "tokenizer.json").exists()
    assert json.loads((tmp_path / "pmx" / "pmx_params.json").read_text())["format_version"] == 1
