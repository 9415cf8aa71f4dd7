"""Step dumps, replay (benchmark.sh), dump comparison and the throughput benchmark."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.config import EngineConfig
from runner.engine.compare import compare
from runner.engine.dump import META_FILE, TensorDumper, load_meta, load_step, read_dump_file
from runner.engine.replay import Agreement, infer_options, replay
from runner.errors import PmxError
from jobs import run_cli_here
from test_engine import core

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def mpirun(n, *cmd, env=None, launcher=None):
    extra = {"MPIRUN": launcher} if launcher else {}
    return run([ROOT / "scripts" / "mpirun.sh", "-np", n, *cmd], env={**(env or {}), **extra})


# --- the dumper and its reader -------------------------------------------------------------------
def test_dump_names_shapes_and_dtypes_round_trip(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(2, 4).half(), "c": torch.randn(7).bfloat16(),
               "d": torch.randint(-127, 127, (2, 3, 4), dtype=torch.int8), "e": torch.arange(6),
               "empty": torch.empty(0), "scalar": torch.tensor(7)}
    d = TensorDumper(str(tmp_path), rank=3, steps=[2, 5], meta={"options": {"cache_layout": 2}})
    assert d.wants(2) and d.wants(5) and not d.wants(3)
    d.dump(5, tensors)
    names = sorted(p.name for p in (tmp_path / "rank_3").iterdir())
    assert names == sorted([META_FILE, "step5_a-3_5-fp32.bin", "step5_b-2_4-fp16.bin", "step5_c-7-bf16.bin",
                            "step5_d-2_3_4-int8.bin", "step5_e-6-int64.bin", "step5_empty-0-fp32.bin",
                            "step5_scalar-1-int64.bin"])
    back = load_step(str(tmp_path / "rank_3"), 5)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t.reshape(back[k].shape)), k
    assert load_meta(str(tmp_path / "rank_3")) == {"options": {"cache_layout": 2}}
    raw = np.fromfile(tmp_path / "rank_3" / "step5_a-3_5-fp32.bin", np.float32)  # readable without this project
    assert np.array_equal(raw, tensors["a"].numpy().ravel())
    with pytest.raises(PmxError, match="no tensors dumped for step 4.*holds steps \\[5\\]"):
        load_step(str(tmp_path / "rank_3"), 4)


def test_dump_reader_rejects_a_file_whose_size_does_not_match_its_name(tmp_path):
    path = tmp_path / "step0_logits-2_3-fp32.bin"
    path.write_bytes(b"\0" * 20)
    with pytest.raises(PmxError, match="holds 20 bytes, its name says \\[2, 3\\] fp32 = 24 bytes"):
        read_dump_file(path)


def test_agreement_metrics():
    ref = torch.tensor([1.0, -2.0, 3.0, 0.5])
    same = Agreement.of(ref.clone(), ref)
    assert same.max_abs == 0 and same.snr_db == float("inf") and same.cosine == pytest.approx(1.0) and same.mse == 0
    noisy = Agreement.of(ref + torch.tensor([0.01, 0, 0, 0]), ref)
    assert noisy.max_abs == pytest.approx(0.01) and noisy.snr_db == pytest.approx(10 * np.log10(14.25 / 1e-4), rel=1e-4)
    assert Agreement.of(-ref, ref).cosine == pytest.approx(-1.0)


# --- the Demo's dumps, replayed -----------------------------------------------------------------------
def test_demo_dumps_every_input_of_the_chosen_steps(stories):
    meta = json.loads((stories / "dump2" / "rank_1" / META_FILE).read_text())
    assert meta["world_size"] == 2 and meta["dtype"] == "float32" and meta["options"]["cache_layout"] == 0
    for r in (0, 1):
        files = sorted(p.name for p in (stories / "dump2" / f"rank_{r}").glob("step*.bin"))
        assert sorted({f.split("_", 1)[0] for f in files}) == ["step0", "step1", "step39"]
        t = load_step(str(stories / "dump2" / f"rank_{r}"), 0)
        assert set(t) == {"token_ids", "attn_mask", "seqstarts", "kvstarts", "cachestarts", "decoding_batches",
                          "start_pos", "max_seqlen", "max_kvlen", "kv_cache", "logits"}  # no kv_scale: fp cache
        n = t["token_ids"].shape[0]  # the prompt, prefilled in step 0
        assert t["seqstarts"].tolist() == [0, n] and t["kvstarts"].tolist() == [0, n]
        assert t["decoding_batches"].tolist() == [0] and t["max_seqlen"].tolist() == [n]
        assert t["kv_cache"].shape == (n + 40, 5, 2, 2, 8)  # layout 0: (MaxT, L, 2, KV heads / 2, head_dim)
        assert t["logits"].shape == (1, 512) and t["logits"].dtype == torch.float32
        late = load_step(str(stories / "dump2" / f"rank_{r}"), 39)
        assert late["token_ids"].shape == (1,) and late["start_pos"].tolist() == [n + 38]
        assert late["decoding_batches"].tolist() == [1]


@pytest.mark.parametrize("step", [0, 1, 39])
def test_benchmark_sh_replays_each_rank_bit_exactly(stories, tmp_path, step):
    env = {"MODEL_PATH": str(stories / "pmx_2"), "TEST_DATA_DIR": str(stories / "dump2"),
           "OUTPUT_DIR": str(tmp_path / "out"), "MIN_PROFILING_SECONDS": "0.05", "WARMUP_ITERATIONS": "1",
           "PYTHON": sys.executable}  # the interpreter under test, in any checkout
    res = mpirun(2, ROOT / "scripts" / "benchmark.sh", step, env=env)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    rows = [ln.split() for ln in res.stdout.splitlines() if ln.strip().startswith(("0 ", "1 "))]
    assert [r[0] for r in rows] == ["0", "1"] and all(r[-1] == "exact" and float(r[5]) == 0 for r in rows), res.stdout
    assert all(0 < float(r[1]) <= float(r[2]) <= float(r[3]) for r in rows)  # min <= mean <= max latency, in ms
    for r in (0, 1):
        out = np.fromfile(tmp_path / "out" / f"rank_{r}" / f"step{step}_logits-1_512-fp32.bin", np.float32)
        ref = np.fromfile(stories / "dump2" / f"rank_{r}" / f"step{step}_logits-1_512-fp32.bin", np.float32)
        assert np.array_equal(out, ref)


def test_replay_fails_when_the_dump_disagrees(stories, tmp_path):
    dump = tmp_path / "dump"
    shutil.copytree(stories / "dump2", dump)
    logits = dump / "rank_1" / "step1_logits-1_512-fp32.bin"
    x = np.fromfile(logits, np.float32)
    x[7] += 1.0
    x.tofile(logits)
    res = mpirun(2, sys.executable, "-m", "runner", "replay", "--ckpt_dir", stories / "pmx_2", "--dump_dir", dump,
                 "--step", 1, "--output_dir", tmp_path / "out", "--min_profiling_seconds", 0)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "FAIL: rank(s) [1]" in res.stdout and " exact" in res.stdout  # rank 0 still exact


def test_benchmark_sh_errors(stories, tmp_path):
    res = run([ROOT / "scripts" / "benchmark.sh", "x"])
    assert res.returncode == 2 and "usage" in res.stderr
    env = {"MODEL_PATH": str(stories / "pmx_2"), "TEST_DATA_DIR": str(tmp_path / "nothing")}
    res = run([ROOT / "scripts" / "benchmark.sh", "1"], env=env)
    assert res.returncode == 2 and "has no rank_0" in res.stderr
    res = run_cli_here("replay", "--ckpt_dir", stories / "pmx", "--dump_dir", stories / "dump1", "--step", 7,
                       "--output_dir", tmp_path / "o")  # (an error path of the command: in this process)
    assert res.returncode == 2 and "no tensors dumped for step 7" in res.stderr and "[0, 1, 39]" in res.stderr


@pytest.mark.skipif(not Path("/usr/bin/mpirun").exists() or
                    b"Open MPI" not in subprocess.run(["/usr/bin/mpirun", "--version"], capture_output=True).stdout,
                    reason="Open MPI (Debian's openmpi-bin) is not installed; MPICH is covered above")
def test_benchmark_sh_under_open_mpi(stories, tmp_path):
    env = {"MODEL_PATH": str(stories / "pmx_2"), "TEST_DATA_DIR": str(stories / "dump2"),
           "OUTPUT_DIR": str(tmp_path / "out"), "MIN_PROFILING_SECONDS": "0.05"}
    res = mpirun(2, ROOT / "scripts" / "benchmark.sh", 1, env=env, launcher="/usr/bin/mpirun")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.count(" exact") == 2


# --- replay in-process, over cache variants ----------------------------------------------------------
@pytest.mark.parametrize("options", [dict(quantized_cache=True, cache_layout=2, cache_mode=1),
                                     dict(cache_layout=3, cache_mode=1),
                                     dict(cache_layout=1, auto_causal=False, fused_kvcache=False)])
@pytest.mark.parametrize("with_meta", [True, False])
def test_replay_of_cache_variants_is_exact(stories, tmp_path, options, with_meta):
    opts = EngineConfig(**options)
    eng = core(stories / "pmx", **options)
    meta = {"options": {k: getattr(opts, k) for k in options}, "dtype": "float32"} if with_meta else None
    dumper = TensorDumper(str(tmp_path / "dump"), 0, [0, 3], meta=meta)
    prompts = [[1, 403, 407, 261], [1, 300, 301]]  # two sequences: step 3 decodes both
    eng.generate(prompts, 6, dumper=dumper)
    for step in (0, 3):
        t = load_step(str(tmp_path / "dump" / "rank_0"), step)
        if step == 0 or options.get("auto_causal", True):  # a decode-only step carries no mask to read it from
            assert infer_options(eng.model.params, 1, t, None) == opts
        assert replay(str(stories / "pmx"), str(tmp_path / "dump"), step, str(tmp_path / "out"),
                      warmup=0, min_profiling_seconds=0) == 0


# --- compare ------------------------------------------------------------------------------------------
def test_compare_tp1_against_tp2_logits(stories, capsys):
    assert compare(str(stories / "dump1"), str(stories / "dump2"), tensors="logits") == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("all ")]   # the 2 ranks gathered (issue 29 item 7)
    assert [r[1] for r in rows] == ["0", "1", "39"] and "shards were gathered" in out
    assert all(float(r[6]) >= 60 and r[-1] == "pass" for r in rows), out  # SNR >= 60 dB in fp32


def test_compare_identical_trees_pass_and_a_perturbed_tensor_fails(stories, tmp_path, capsys):
    assert compare(str(stories / "dump2"), str(stories / "dump2"), csv=str(tmp_path / "c.csv")) == 0
    lines = (tmp_path / "c.csv").read_text().splitlines()
    assert lines[0] == "rank,step,tensor,shape,max_abs_diff,cosine,snr_db,mse,verdict"
    assert len(lines) == 1 + 2 * 3 * 11 and all(ln.endswith(",pass") for ln in lines[1:])
    b = tmp_path / "b"
    shutil.copytree(stories / "dump2", b)
    kv = next((b / "rank_1").glob("step39_kv_cache-*.bin"))
    x = np.fromfile(kv, np.float32)
    x[: x.size // 2] *= 1.5
    x.tofile(kv)
    tok = next((b / "rank_0").glob("step1_token_ids-*.bin"))
    np.array([5], np.int64).tofile(tok)
    capsys.readouterr()
    assert compare(str(stories / "dump2"), str(b)) == 1
    fails = [ln.split()[:3] for ln in capsys.readouterr().out.splitlines() if ln.endswith("FAIL")]
    assert fails == [["rank_0", "1", "token_ids"], ["rank_1", "39", "kv_cache"]]


def test_compare_cli_exit_status_and_errors(stories, tmp_path):
    res = run([sys.executable, "-m", "runner", "compare", stories / "dump1", stories / "dump2", "--tensors", "logits",
               "--metric", "cosine"])
    assert res.returncode == 0 and "3 compared (cosine >= 0.999), 0 failed" in res.stdout
    res = run_cli_here("compare", stories / "dump1", tmp_path / "missing")  # (the error paths in this process)
    assert res.returncode == 2 and "missing: dump directory not found" in res.stderr
    res = run_cli_here("compare", stories / "dump1", stories / "dump2", "--metric", "l2")
    assert res.returncode == 2 and "--metric must be one of snr, cosine, mse" in res.stderr


# --- bench --------------------------------------------------------------------------------------------
def check_csv(stdout: str, batches: list[int]) -> list[list[float]]:
    lines = stdout.strip().splitlines()
    assert lines[0] == "batch,prefill(ms),decode(ms),avg(ms),tps,mem(gib)", stdout
    rows = [[float(x) for x in ln.split(",")] for ln in lines[1:]]
    assert [int(r[0]) for r in rows] == batches
    for b, prefill, decode, avg, tps, mem in rows:
        assert prefill > 0 and decode > 0 and avg > 0 and mem > 0.05
        assert tps == pytest.approx(b * 1e3 / avg, rel=0.01)  # tps = batch x gen_len / total, avg = total / gen_len
    return rows


def test_bench_random_weights_under_mpirun(tmp_path):
    from runner.pmx.params import PmxParams
    params = PmxParams(model_type="llama", hidden_dim=64, intermediate_dim=100, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, vocab_size=250, norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=256, dtype="float32")
    params.save(tmp_path)
    res = mpirun(2, sys.executable, "-m", "runner", "bench", tmp_path / "pmx_params.json", "--random_weights",
                 "--batch_sizes", "1,3,8", "--gen_len", 12, "--csv", tmp_path / "b.csv")
    assert res.returncode == 0, res.stderr[-3000:]
    check_csv(res.stdout, [1, 3, 8])
    assert (tmp_path / "b.csv").read_text().strip() == res.stdout.strip()
    assert "bench: batch 8 (3/3) run 1/1" in res.stderr and "2 rank(s)" in res.stderr


def test_bench_script_with_a_checkpoint_and_a_tokens_file(stories, tmp_path):
    (tmp_path / "tokens_input_8").write_text("1 403 407 261 298 315 421 395\n1,300,301\n")
    env = {"MODEL_PATH": str(stories / "pmx_2"), "TP": "2", "BATCH_SIZES": "1 4", "GEN_LEN": "10",
           "TOKENS_FILE": str(tmp_path / "tokens_input_8")}
    res = run([ROOT / "scripts" / "benchmark_llama.sh"], env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    check_csv(res.stdout, [1, 4])
    (tmp_path / "bad").write_text("1 2 x\n")
    res = run_cli_here("bench", stories / "pmx", "--tokens_file", tmp_path / "bad")  # (the error paths in this process)
    assert res.returncode == 2 and "bad:1: expected token ids" in res.stderr
    res = run_cli_here("bench", stories / "pmx", "--batch_sizes", "1,0")
    assert res.returncode == 2 and "--batch_sizes must be positive integers" in res.stderr


def test_a_half_precision_checkpoint_replays_as_it_ran(tmp_path):
    """A bfloat16 checkpoint's run on CPU (auto: float32 compute, linear weights at their width) records both dtypes
    in its dump's meta, and replay runs its steps the same way (auto again, not float32 weights): bit for bit."""
    from runner.engine.demo import run_meta
    from runner.engine.replay import dumped_dtype
    from runner.engine.session import open_session
    from runner.pmx.convert import convert
    from runner.pmx.random_model import make_random_model
    make_random_model(str(tmp_path / "hf"), hidden_dim=128, intermediate_dim=200, num_heads=4, num_kv_heads=2,
                      vocab_size=512, dtype="bfloat16")
    convert(str(tmp_path / "hf"), str(tmp_path / "pmx"), progress=False)
    sess = open_session(str(tmp_path / "pmx"))
    meta = run_meta(sess)
    assert (meta["dtype"], meta["weight_dtype"], dumped_dtype(meta)) == ("float32", "bfloat16", "auto")
    sess.core.generate([[1, 403, 407, 261], [1, 300, 301]], 6,
                         dumper=TensorDumper(str(tmp_path / "dump"), 0, [0, 3], meta=meta))
    sess.close()
    for step in (0, 3):
        assert replay(str(tmp_path / "pmx"), str(tmp_path / "dump"), step, str(tmp_path / "out"), warmup=0,
                      min_profiling_seconds=0) == 0
        got, want = (read_dump_file(next((d / "rank_0").glob(f"step{step}_logits-*"))) for d in (tmp_path / "out",
                                                                                                  tmp_path / "dump"))
        assert torch.equal(got, want)
