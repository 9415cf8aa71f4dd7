"""Bad input: a clear error naming the file or tensor, a non-zero exit, and nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from jobs import run_cli_here as run_cli  # (in this process; run_cli_process: a process of its own)


def run_cli_process(*args) -> subprocess.CompletedProcess:
    """`python -m runner ARGS` in a process of its own."""
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
    assert_fails_cleanly(run_cli_process("convert", "--input_dir", src, "--output_dir", out), out,
                         src / "config.json", "missing")


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


@pytest.mark.parametrize("n,needle", [(3, "num_heads=8 is not divisible by 3"),
                                      (0, "--num_shards must be >= 1, got 0")])
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


# --- filesystem errors: one line naming the output, exit 2, nothing left behind --------------------------
def cli(capfd, *args) -> str:
    """Runs a command in this process; returns its stderr (it must fail with status 2)."""
    from runner.cli import main
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    err = capfd.readouterr().err
    assert e.value.code == 2, err
    return err


def nothing_left(parent, name: str) -> bool:
    return not [p for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.")]


@pytest.fixture
def pmx_copy(stories, tmp_path):
    """A copy of stories260k as PMX (one shard), to write beside or over."""
    import shutil
    return Path(shutil.copytree(stories / "pmx", tmp_path / "in" / "pmx"))


@pytest.fixture
def tmpfs(tmp_path):
    """mount_tmpfs(options) -> a fresh tmpfs mount point (skips where mounting is not permitted)."""
    mounted = []

    def mount(options: str):
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        if res.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({res.stderr.decode().strip()})")
        mounted.append(point)
        return point
    yield mount
    for point in mounted:  # a file left open on it would keep it busy: that is a failure too
        res = subprocess.run(["umount", str(point)], capture_output=True)
        if res.returncode:
            subprocess.run(["umount", "-l", str(point)], capture_output=True)
            pytest.fail(f"{point} could not be unmounted: {res.stderr.decode().strip()}")


@pytest.mark.parametrize("case,cause", [("read_only", "Read-only file system"), ("full", "No space left on device")])
def test_read_only_or_full_filesystem(pmx_copy, tmpfs, capfd, case, cause):
    point = tmpfs("ro,size=1m" if case == "read_only" else "size=8k")
    out = point / "out"
    err = cli(capfd, "split", "--input_dir", pmx_copy, "--num_shards", 2, "--output_dir", out)
    assert err == f"error: {out}: cannot write the output ({cause})\n"
    assert list(point.iterdir()) == []


def test_a_mount_point_cannot_be_replaced(pmx_copy, tmpfs, capfd):
    point = tmpfs("size=1m")
    (point / "keep").write_text("mine")
    err = cli(capfd, "split", "--input_dir", pmx_copy, "--num_shards", 2, "--output_dir", point, "--overwrite")
    assert err == f"error: {point}: is a mount point and cannot be replaced; write into a directory inside it\n"
    assert [p.name for p in point.iterdir()] == ["keep"] and nothing_left(point.parent, "nothing")
    assert not [p for p in point.parent.iterdir() if p.name.startswith(f".{point.name}.")]


def test_an_output_under_proc(pmx_copy, capfd):
    err = cli(capfd, "split", "--input_dir", pmx_copy, "--num_shards", 2, "--output_dir", "/proc/pmx-out")
    assert err.startswith("error: /proc/pmx-out: cannot write the output (") and err.count("\n") == 1


def test_disk_full_while_writing_leaves_nothing(pmx_copy, tmp_path, capfd, monkeypatch):
    import errno

    from runner.pmx.store import SafetensorsWriter
    calls = []

    def full(self, name, tensor):
        calls.append(name)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(SafetensorsWriter, "write", full)
    out = tmp_path / "deep" / "er" / "out"
    err = cli(capfd, "split", "--input_dir", pmx_copy, "--num_shards", 2, "--output_dir", out)
    assert err == f"error: {out}: cannot write the output (No space left on device)\n"
    assert not (tmp_path / "deep").exists()  # the parents it made are gone too


def test_dump_and_replay_outputs_fail_cleanly(stories, tmp_path, capfd):
    err = cli(capfd, "generate", "--ckpt_dir", stories / "pmx", "--max_gen_len", 2, "--dump_tensor_path",
              "/proc/pmx-dump", "--progress", "false")
    assert err.startswith("error: /proc/pmx-dump/rank_0/engine.json: cannot write the dump's engine.json (") \
        and err.count("\n") == 1, err
    out = tmp_path / "replay"
    err = cli(capfd, "replay", "--ckpt_dir", stories / "pmx", "--dump_dir", stories / "dump1", "--step", 1,
              "--output_dir", "/proc/pmx-replay", "--min_profiling_seconds", 0)
    assert err.startswith("error: /proc/pmx-replay/rank_0/step1_logits-1_512-fp32.bin: cannot write the replayed "
                          "logits (") and err.count("\n") == 1, err
    assert not out.exists()


# --- guards ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where,how", [("same", "is the same directory as"), ("inside", "is inside"),
                                      ("parent", "contains")])
def test_output_overlapping_the_input_is_refused(pmx_copy, capfd, where, how):
    out = {"same": pmx_copy, "inside": pmx_copy / "sub", "parent": pmx_copy.parent}[where]
    before = sorted(p.name for p in pmx_copy.iterdir())
    err = cli(capfd, "split", "--input_dir", pmx_copy, "--num_shards", 2, "--output_dir", out, "--overwrite")
    assert err == f"error: --output_dir {out} {how} --input_dir {pmx_copy}; write the output somewhere else\n"
    assert sorted(p.name for p in pmx_copy.iterdir()) == before


def test_replay_output_over_the_dump_is_refused(stories, capfd):
    err = cli(capfd, "replay", "--ckpt_dir", stories / "pmx", "--dump_dir", stories / "dump1", "--step", 1,
              "--output_dir", stories / "dump1")
    assert "is the same directory as --dump_dir" in err


def test_a_tokenizer_that_does_not_parse(stories, tmp_path, capfd):
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"\x00garbage" * 10)
    err = cli(capfd, "generate", "--ckpt_dir", stories / "pmx", "--tokenizer_path", bad)
    assert err.startswith(f"error: {bad}: not a sentencepiece tokenizer.model (") and err.count("\n") == 1
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    err = cli(capfd, "generate", "--ckpt_dir", stories / "pmx", "--tokenizer_path", bad)
    assert err.startswith(f"error: {bad}: not a HF tokenizer.json (") and err.count("\n") == 1


def test_another_models_tokenizer_is_refused(stories, shared_model, capfd):
    tiny = shared_model("tinystories-656k")
    err = cli(capfd, "generate", "--ckpt_dir", stories / "pmx", "--tokenizer_path", tiny / "tokenizer.json")
    assert err == (f"error: {tiny / 'tokenizer.json'}: the tokenizer has 2048 tokens, which does not fit the model's "
                   f"vocabulary of 512 (pmx_params.json vocab_size): it belongs to another model\n")


def test_replay_against_another_model_is_refused(stories, shared_model, tmp_path, capfd):
    from runner.pmx.convert import convert
    convert(str(shared_model("tinystories-656k")), str(tmp_path / "tiny"), progress=False)
    err = cli(capfd, "replay", "--ckpt_dir", tmp_path / "tiny", "--dump_dir", stories / "dump1", "--step", 1,
              "--output_dir", tmp_path / "out")
    assert f"{stories / 'dump1' / 'rank_0'}: kv_cache has shape" in err
    assert "the dump was made with another model" in err
    assert not (tmp_path / "out").exists()
