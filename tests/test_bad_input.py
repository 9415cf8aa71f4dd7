"""Bad input: a clear error naming the file or tensor, a non-zero exit, and nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "runner", *map(str, args)], capture_output=True, text=True)


def assert_fails_cleanly(res, out_dir, *needles):
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert str(n) in res.stderr, f"{n!r} not in {res.stderr!r}"
    assert not out_dir.exists(), "partial output left behind"
    assert not [p for p in out_dir.parent.iterdir() if p.name.startswith(f".{out_dir.name}.")], "temp dir left"


def test_missing_config(make_hf, tmp_path):
    src, _ = make_hf("llama_mha")
    (src / "config.json").unlink()
    out = tmp_path / "out"
    assert_fails_cleanly(run_cli("convert", "--input_dir", src, "--output_dir", out), out, src / "config.json",
                         "missing")


def test_unknown_architecture(make_hf, tmp_path):
    src, _ = make_hf("llama_mha")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    assert_fails_cleanly(run_cli("convert", "--input_dir", src, "--output_dir", out), out, "GPTNeoXForCausalLM",
                         "LlamaForCausalLM")


def test_index_names_missing_file(make_hf, tmp_path):
    src, _ = make_hf("llama_mha", num_files=3)
    victim = sorted(src.glob("model-*.safetensors"))[1]
    victim.unlink()
    out = tmp_path / "out"
    assert_fails_cleanly(run_cli("convert", "--input_dir", src, "--output_dir", out), out, victim.name,
                         "model.safetensors.index.json")


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_safetensors(make_hf, tmp_path, damage):
    src, _ = make_hf("llama_mha")
    f = src / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100] if damage == "truncate" else b"\xff" * 8 + data[8:])
    out = tmp_path / "out"
    assert_fails_cleanly(run_cli("convert", "--input_dir", src, "--output_dir", out), out, f,
                         "not a valid safetensors file")


def test_unexpected_shape(make_hf, tmp_path):
    src, _ = make_hf("llama_mha")
    sd = load_file(str(src / "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(sd, str(src / "model.safetensors"))
    out = tmp_path / "out"
    assert_fails_cleanly(run_cli("convert", "--input_dir", src, "--output_dir", out), out,
                         "model.layers.1.mlp.up_proj.weight", "[95, 64]", "[96, 64]")


def test_missing_tensor(make_hf, tmp_path):
    src, _ = make_hf("llama_mha")
    sd = load_file(str(src / "model.safetensors"))
    del sd["model.layers.0.self_attn.v_proj.weight"]
    save_file(sd, str(src / "model.safetensors"))
    out = tmp_path / "out"
    assert_fails_cleanly(run_cli("convert", "--input_dir", src, "--output_dir", out), out,
                         "model.layers.0.self_attn.v_proj.weight")


def test_unexpected_extra_tensor(make_hf, tmp_path):
    src, _ = make_hf("llama_mha")
    sd = load_file(str(src / "model.safetensors"))
    sd["model.layers.0.self_attn.mystery.weight"] = torch.zeros(3)
    save_file(sd, str(src / "model.safetensors"))
    out = tmp_path / "out"
    assert_fails_cleanly(run_cli("convert", "--input_dir", src, "--output_dir", out), out,
                         "model.layers.0.self_attn.mystery.weight", "unexpected")


def test_known_unused_buffer_is_not_an_error(make_hf, tmp_path):
    src, _ = make_hf("llama_mha")
    sd = load_file(str(src / "model.safetensors"))
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(sd, str(src / "model.safetensors"))
    assert run_cli("convert", "--input_dir", src, "--output_dir", tmp_path / "out").returncode == 0


@pytest.fixture
def pmx_dir(make_hf, tmp_path):
    src, _ = make_hf("llama_gqa_odd")  # 8 heads, 2 KV heads
    res = run_cli("convert", "--input_dir", src, "--output_dir", tmp_path / "pmx")
    assert res.returncode == 0, res.stderr
    return tmp_path / "pmx"


@pytest.mark.parametrize("n,needle", [(3, "num_heads=8 is not divisible by 3"), (0, "--num_shards must be >= 1, got 0")])
def test_impossible_num_shards(pmx_dir, tmp_path, n, needle):
    out = tmp_path / "split"
    assert_fails_cleanly(run_cli("split", "--input_dir", pmx_dir, "--num_shards", n, "--output_dir", out), out,
                         needle)


def test_merge_with_wrong_num_shards(pmx_dir, tmp_path):
    assert run_cli("split", "--input_dir", pmx_dir, "--num_shards", 4, "--output_dir", tmp_path / "s4").returncode == 0
    out = tmp_path / "merged"
    assert_fails_cleanly(run_cli("merge", "--input_dir", tmp_path / "s4", "--num_shards", 2, "--output_dir", out),
                         out, "--num_shards 2", "num_shards=4")


def test_merge_with_a_shard_missing(pmx_dir, tmp_path):
    assert run_cli("split", "--input_dir", pmx_dir, "--num_shards", 2, "--output_dir", tmp_path / "s2").returncode == 0
    (tmp_path / "s2" / "model.01.safetensors").unlink()
    out = tmp_path / "merged"
    assert_fails_cleanly(run_cli("merge", "--input_dir", tmp_path / "s2", "--num_shards", 2, "--output_dir", out),
                         out, "model.01.safetensors", "not found")


def test_output_dir_not_empty(make_hf, pmx_dir, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = run_cli("split", "--input_dir", pmx_dir, "--num_shards", 2, "--output_dir", out)
    assert res.returncode == 2 and str(out) in res.stderr and "--overwrite" in res.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    res = run_cli("split", "--input_dir", pmx_dir, "--num_shards", 2, "--output_dir", out, "--overwrite")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.glob("model.*")) == ["model.00.safetensors", "model.01.safetensors"]


def test_unknown_params_key(pmx_dir, tmp_path):
    params = json.loads((pmx_dir / "pmx_params.json").read_text())
    params["hiden_dim"] = 3
    (pmx_dir / "pmx_params.json").write_text(json.dumps(params))
    out = tmp_path / "s2"
    assert_fails_cleanly(run_cli("split", "--input_dir", pmx_dir, "--num_shards", 2, "--output_dir", out), out,
                         "pmx_params.json", "hiden_dim")
