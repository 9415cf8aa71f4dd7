"""Model families against transformers: rope scaling, Mistral's sliding window, Qwen3, Mixtral (MoE),
in one process, tensor-parallel, through split / merge, and through the scripts end to end."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.engine.model import load_shard
from runner.pmx.convert import convert, reshard
from runner.pmx.params import PmxParams
from test_engine import engine, hf_logits, prompts_and_conts, rel_err, run_tp
from tp_worker import teacher_forced_logits

ROOT = Path(__file__).resolve().parents[1]
ROPE = {  # llama_mha with max_position_embeddings 16: the 16 decode steps run past it
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
}
LAYOUTS = [dict(cache_layout=0, cache_mode=0), dict(cache_layout=2, cache_mode=1),
           dict(cache_layout=3, cache_mode=1, fused_kvcache=False), dict(cache_layout=1, fused_kvcache=False)]


def make(make_hf, name):
    if name in ROPE:
        return make_hf("llama_mha", rope_scaling=dict(ROPE[name]), max_position_embeddings=16)
    return make_hf(name)


@pytest.mark.parametrize("name", ["qwen3", "mixtral", "mistral_window", *ROPE])
def test_family_matches_transformers(make_hf, tmp_path, name):
    src, model = make(make_hf, name)
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    ref = hf_logits(model, prompts, conts)
    for options in LAYOUTS:
        got = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx", **options), prompts, conts))
        assert rel_err(got, ref) < 1e-4, (options, rel_err(got, ref))


def test_converted_params(make_hf, tmp_path):
    for name, want in [("qwen3", dict(qk_norm=True, head_dim=16, num_experts=0)),
                       ("mixtral", dict(num_experts=4, num_experts_per_token=2, qk_norm=False)),
                       ("mistral_window", dict(sliding_window=5)),
                       ("yarn", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 8}))]:
        src, _ = make(make_hf, name)
        convert(str(src), str(tmp_path / name), progress=False)
        p = PmxParams.load(tmp_path / name)
        assert {k: getattr(p, k) for k in want} == want, name
    _, w = load_shard(tmp_path / "mixtral", 0, torch.device("cpu"), torch.float32)
    assert w["layers.1.feed_forward.w1.weight"].shape == (4, 42, 64)  # experts stacked [E, out, in]
    assert w["layers.1.feed_forward.w2.weight"].shape == (4, 64, 42) and w["layers.1.feed_forward.gate.weight"].shape == (4, 64)


def test_sliding_window_changes_the_output(make_hf, tmp_path):
    """The window is really applied: the same weights without it give other logits (beyond 5 tokens)."""
    src, model = make_hf("mistral_window")
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    windowed = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx"), prompts, conts))
    p = PmxParams.load(tmp_path / "pmx")
    p.replace(sliding_window=None).save(tmp_path / "pmx")
    full = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx"), prompts, conts))
    assert rel_err(windowed, full) > 1e-2


@torch.no_grad()
def test_dynamic_ntk_matches_transformers_decoding(make_hf, tmp_path):
    """Dynamic NTK depends on the length so far: compare with transformers decoding token by token."""
    src, model = make_hf("llama_mha", rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8)
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    prompt, cont = prompts[0], conts[0]  # 7 prompt tokens, 16 steps: crosses 8 positions
    out = model(torch.tensor([prompt]), use_cache=True)
    ref = [out.logits[0, -1]]
    for t in cont:
        out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
        ref.append(out.logits[0, -1])
    ref = torch.stack(ref)[:, None]
    for options in LAYOUTS[:2]:
        got = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx", **options), [prompt], [cont]))
        assert rel_err(got, ref) < 1e-4, (options, rel_err(got, ref))


@pytest.mark.parametrize("name,n", [("qwen3", 2), ("qwen3", 4), ("mixtral", 2), ("mixtral", 4),
                                    ("mistral_window", 2), ("yarn", 2)])
def test_family_tensor_parallel(make_hf, tmp_path, name, n):
    src, model = make(make_hf, name)
    convert(str(src), str(tmp_path / "pmx"), progress=False)
    reshard(str(tmp_path / "pmx"), str(tmp_path / f"pmx{n}"), n, progress=False)
    reshard(str(tmp_path / f"pmx{n}"), str(tmp_path / "merged"), 1, progress=False)
    assert filecmp.cmp(tmp_path / "pmx" / "model.00.safetensors", tmp_path / "merged" / "model.00.safetensors",
                       shallow=False)  # merge(split(m)) == m, bit for bit
    prompts, conts = prompts_and_conts(model.config.vocab_size)
    ref = hf_logits(model, prompts, conts)
    tp1 = torch.stack(teacher_forced_logits(engine(tmp_path / "pmx"), prompts, conts))
    for options, got in zip(LAYOUTS[:3], run_tp(tmp_path, tmp_path / f"pmx{n}", n, LAYOUTS[:3], prompts, conts)):
        assert rel_err(got, ref) < 1e-4, (options, rel_err(got, ref))
        assert rel_err(got, tp1) < 1e-4


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "mixtral", "mistral_window", "llama3"])
def test_scripts_end_to_end_match_transformers_greedy(make_hf, tmp_path, name):
    """ConvertWeightToPmx.py -> Split.py -> mpirun -np 2 Demo.py: the greedy tokens of transformers."""
    from runner.engine.tokenizer import Tokenizer
    from runner.pmx.random_model import _tokenizer_json
    src, model = make_hf(name if name not in ROPE else "llama_mha", vocab_size=300,
                         **({"rope_scaling": dict(ROPE[name]), "max_position_embeddings": 64} if name in ROPE else {}))
    (src / "tokenizer.json").write_text(_tokenizer_json(300))
    py = sys.executable
    for cmd in ([py, ROOT / "scripts" / "ConvertWeightToPmx.py", "--input_dir", src, "--output_dir", tmp_path / "pmx"],
                [py, ROOT / "scripts" / "Split.py", "--input_dir", tmp_path / "pmx", "--num_shards", 2,
                 "--output_dir", tmp_path / "pmx2"],
                [ROOT / "scripts" / "mpirun.sh", "-np", 2, py, ROOT / "scripts" / "Demo.py", "--ckpt_dir",
                 tmp_path / "pmx2", "--prompt", "Once upon a time", "--max_gen_len", 12, "--show_ids"]):
        res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
    ids = eval(res.stdout.split("ids: ")[1].splitlines()[0])  # noqa: S307 (our own output)
    p = PmxParams.load(tmp_path / "pmx")
    prompt = Tokenizer(str(tmp_path / "pmx"), p.bos_token_id).encode("Once upon a time")
    eos = model.config.eos_token_id
    want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=eos,
                          pad_token_id=0)[0, len(prompt):].tolist()
    want = want[: want.index(eos)] if eos in want else want
    assert ids == want


def test_config_checks_sliding_window_kinds_and_rope_types():
    from model_zoo import family_for
    from runner.errors import PmxError
    base = dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, num_attention_heads=4, intermediate_size=8,
                num_hidden_layers=4, vocab_size=10, use_sliding_window=True, sliding_window=16)
    fam = family_for(base)
    assert fam.params({**base, "max_window_layers": 4}, "float32").sliding_window is None  # no layer slides
    assert fam.params({**base, "max_window_layers": 0}, "float32").sliding_window == 16   # every layer slides
    assert fam.params({**base, "use_sliding_window": False, "max_window_layers": 2}, "float32").sliding_window is None
    with pytest.raises(PmxError, match="some layers use a sliding window and others full attention"):
        fam.params({**base, "max_window_layers": 2}, "float32")
    with pytest.raises(PmxError, match="rope type 'longrope' is not supported"):
        fam.params({**base, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "float32")
    yarn = fam.params({**base, "max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 2.0}},
                      "float32").rope_scaling
    assert yarn["original_max_position_embeddings"] == 4096  # filled in as transformers does
