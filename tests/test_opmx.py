"""Reading ppl.pmx's own exports (opmx_params.json + model.pth) into PMX."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.errors import PmxError
from runner.pmx.convert import convert
from runner.pmx.params import PmxParams
from runner.pmx.store import SafetensorsReader

ROOT = Path(__file__).resolve().parents[1]


def ppl_export(pmx_dir: Path, out: Path, params_name: str = "opmx_params.json", **extra) -> Path:
    """What ppl.pmx's ConvertWeightToOpmx.py writes for the same model: its params keys and one model.pth."""
    p = PmxParams.load(pmx_dir)
    rd = SafetensorsReader(pmx_dir / "model.00.safetensors")
    out.mkdir()
    torch.save({k: rd.get(k) for k in rd.keys()}, out / "model.pth")
    keys = dict(hidden_dim=p.hidden_dim, num_heads=p.num_heads, num_layers=p.num_layers, norm_eps=p.norm_eps,
                vocab_size=p.vocab_size, num_kv_heads=p.num_kv_heads, head_dim=p.head_dim,
                intermediate_dim=p.intermediate_dim, max_position_embeddings=p.max_position_embeddings,
                rope_theta=p.rope_theta, **extra)
    (out / params_name).write_text(json.dumps(keys))
    return out


@pytest.mark.parametrize("params_name", ["opmx_params.json", "pmx_params.json"])  # new and old ppl.pmx names
def test_ppl_export_converts_to_the_same_tensors(make_hf, tmp_path, params_name):
    src, _ = make_hf("llama_gqa_odd")
    convert(str(src), str(tmp_path / "ref"), progress=False)
    ppl = ppl_export(tmp_path / "ref", tmp_path / "ppl", params_name)
    (ppl / "tokenizer.model").write_bytes(b"sp")  # tokenizer files travel along
    convert(str(ppl), str(tmp_path / "out2"), num_shards=2, progress=False)
    out = PmxParams.load(tmp_path / "out2")
    ref = PmxParams.load(tmp_path / "ref")
    assert (out.architecture, out.num_shards, out.dtype) == ("ppl.pmx", 2, ref.dtype)
    assert out.replace(architecture="", model_type="", num_shards=1, kv_replication=1, padded_dims={},
                       bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False) == \
        ref.replace(architecture="", model_type="", bos_token_id=None, eos_token_id=None, pad_token_id=None,
                    tie_word_embeddings=False)
    from runner.pmx.convert import reshard
    reshard(str(tmp_path / "out2"), str(tmp_path / "merged"), 1, progress=False)
    a, b = SafetensorsReader(tmp_path / "ref" / "model.00.safetensors"), SafetensorsReader(tmp_path / "merged" / "model.00.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a.get(k), b.get(k)) for k in a.keys())
    assert (tmp_path / "out2" / "tokenizer.model").read_bytes() == b"sp"


def test_ppl_export_errors(make_hf, tmp_path):
    src, _ = make_hf("llama_mha")
    convert(str(src), str(tmp_path / "ref"), progress=False)
    bad = ppl_export(tmp_path / "ref", tmp_path / "bad", auto_causal=True)
    with pytest.raises(PmxError, match="unknown key\\(s\\) \\['auto_causal'\\]"):
        convert(str(bad), str(tmp_path / "o1"), progress=False)
    split = ppl_export(tmp_path / "ref", tmp_path / "split")
    (split / "model.pth").rename(split / "model.00.pth")
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "ConvertWeightToPmx.py"), "--input_dir", str(split),
                          "--output_dir", str(tmp_path / "o2")], capture_output=True, text=True)
    assert res.returncode == 2 and "merge them with ppl.pmx's Merge.py first" in res.stderr
    assert not (tmp_path / "o2").exists()
    short = ppl_export(tmp_path / "ref", tmp_path / "short")
    sd = torch.load(short / "model.pth", weights_only=True)
    del sd["layers.1.ffn_norm.weight"]
    torch.save(sd, short / "model.pth")
    with pytest.raises(PmxError, match="missing \\['layers.1.ffn_norm.weight'\\]"):
        convert(str(short), str(tmp_path / "o3"), progress=False)
