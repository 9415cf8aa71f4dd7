"""GGUF files in: small random-weight GGUFs of each architecture (written by tests/gguf_files.py in llama.cpp's
layout) converted and run against transformers loading the same file, Q8_0 / Q4_0 / Q4_1 kept bit-exact, split
sets, llama3 rope, half precision kept half, the tokenizer, refusals; and the real SmolLM2-135M-Instruct (Q4_1)
against transformers at TP 1 and 3 (through the server, with its chat answer), and its perplexity."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

from conftest import ARCH_CONFIGS, SHARED_MODELS, make_published
from gguf_files import dequantized, llama3_factors, matrices, one_parse_per_file, sentencepiece_vocab, write_gguf
from runner.engine.tokenizer import Tokenizer
from runner.errors import PmxError
from runner.pmx.convert import PmxModel, convert, reshard
from runner.pmx.params import PmxParams
from runner.pmx.quant import dequantize, scheme_of
from runner.pmx.store import SafetensorsReader
from test_bad_input import run_cli
from test_engine import core, engine, hf_logits, prompts_and_conts, rel_err, run_tp
from test_families import hf_greedy
from tp_worker import teacher_forced_logits

pytest.importorskip("gguf", reason="the gguf package is not installed")
transformers = pytest.importorskip("transformers")
VOCAB = 300  # a byte-level vocabulary needs its 256 bytes and a few merges


def hf_model(arch: str, seed: int = 0, **overrides):
    """A random transformers model of tests/conftest.py's ARCH_CONFIGS[arch], norms and biases randomised."""
    cls_name, kwargs = ARCH_CONFIGS[arch]
    cfg = getattr(transformers, cls_name)(**{**kwargs, "vocab_size": VOCAB, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("norm.weight") else 0.0))
            if name.endswith("mlp.gate.weight"):  # a decisive router: no near-ties between experts
                p.mul_(50)
    return model


def from_gguf(path: Path, config=None):
    """transformers' model of GGUF `path`, dequantised to float32 (with `config` rather than the one transformers
    reads from the file, where given)."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                             dtype=torch.float32).eval()


def logits_tol(qtype: str, exact: float) -> float:
    """The relative error allowed against transformers for a model of `qtype`: `exact` (float32 products), except int4
    where the CPU has AVX512-VNNI, whose kernel multiplies x in two int8 parts (~15 bits: test_quant_engine)."""
    from runner.kernels.cpu_ext import cpu_ops
    vnni = cpu_ops() is not None and int(torch.ops.pmx_cpu.int4_layout(32)) == 1
    return 1e-3 if vnni and qtype in ("Q4_0", "Q4_1") else exact


def logits(pmx_dir, vocab: int = VOCAB) -> torch.Tensor:
    prompts, conts = prompts_and_conts(vocab)
    return torch.stack(teacher_forced_logits(engine(pmx_dir), prompts, conts))


# --- each architecture against transformers on the same file ------------------------------------------------------
# transformers reads no head_dim from a qwen3 GGUF (its config's default, 128, as every Qwen3 has)
QWEN3_128 = dict(hidden_size=64, intermediate_size=96, head_dim=128)


@pytest.mark.parametrize("arch,gguf_arch,qtype,overrides", [
    ("llama_mha", "llama", "Q8_0", {}), ("llama_mha", "llama", "Q4_0", {}), ("llama_mha", "llama", "Q4_1", {}),
    ("llama_mha", "llama", "Q5_1", {}), ("qwen2", "qwen2", "Q8_0", dict(intermediate_size=96)),
    ("qwen3", "qwen3", "Q4_0", QWEN3_128)])
def test_matches_transformers_on_the_same_file(tmp_path, arch, gguf_arch, qtype, overrides):
    """The converted model's logits are transformers' on the same GGUF (dequantised to float32 there): Llama's q/k
    rows as llama.cpp permuted them, Qwen2's and Qwen3's as HF keeps them (biases, q/k norms); matrices whose rows hold
    whole blocks in the type, the rest float32. Q8_0 / Q4_0 / Q4_1 stay quantised, bit for bit (Q5_1: dequantised)."""
    model = hf_model(arch, **overrides)
    path = write_gguf(model, tmp_path / "m.gguf", gguf_arch, matrices(qtype))[0]
    lines = []
    convert(str(path), str(tmp_path / "pmx"), progress=False, report=lines.append)
    assert rel_err(logits(tmp_path / "pmx"), hf_logits(from_gguf(path), *prompts_and_conts(VOCAB))) < logits_tol(
        qtype, 2e-6)
    p = PmxParams.load(tmp_path / "pmx")
    scheme = scheme_of(p)
    if qtype == "Q5_1":
        assert scheme is None and f"{qtype}: " in lines[0] and "float32 (dequantised)" in lines[0]
        return
    leaf = scheme.for_tensor("layers.0.attention.wq.weight")
    assert (leaf.method, leaf.group_size, leaf.offset) == {"Q8_0": ("int8", 32, False), "Q4_0": ("int4", 32, False),
                                                           "Q4_1": ("int4", 32, True)}[qtype]
    assert any(ln.startswith(f"{qtype}: ") and ln.endswith("bit-exact") for ln in lines), lines


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_q8_0_q4_0_q4_1_are_bit_exact(tmp_path, qtype):
    """The stored integers and scales dequantise (runner.pmx.quant.dequantize) to gguf's own dequantiser's values
    exactly, for a Llama weight (rows as stored) and a Qwen2 q weight (rows un-permuted to interleaved pairs), and
    take the bytes llama.cpp's blocks take plus float32 scales (float16 in the file)."""
    from model_zoo.decoder import unpermute_rotary
    for arch, gguf_arch in (("llama_mha", "llama"), ("qwen2", "qwen2")):
        model = hf_model(arch, intermediate_size=96)
        path = write_gguf(model, tmp_path / f"{arch}.gguf", gguf_arch, matrices(qtype))[0]
        out = tmp_path / f"{arch}-pmx"
        convert(str(path), str(out), progress=False)
        rd = SafetensorsReader(out / "model.00.safetensors")
        for pmx, name, heads in (("layers.1.feed_forward.w2", "blk.1.ffn_down.weight", 0),
                                 ("layers.0.attention.wq", "blk.0.attn_q.weight", model.config.num_attention_heads),
                                 ("tok_embeddings", "token_embd.weight", 0)):
            parts = {k: rd.get(f"{pmx}.{k}") for k in ("qweight", "scale", "offset") if f"{pmx}.{k}" in rd.keys()}
            got = dequantize(parts["qweight"], parts["scale"], "int8" if qtype == "Q8_0" else "int4",
                             offset=parts.get("offset"))
            want = dequantized(path, name)
            if heads and gguf_arch == "qwen2":
                want = unpermute_rotary(want, heads)
            assert torch.equal(got, want), (arch, pmx)
            n, k = want.shape
            assert parts["qweight"].numel() == n * k // (1 if qtype == "Q8_0" else 2)
            assert parts["scale"].shape == (n, k // 32) and len(parts) == (3 if qtype == "Q4_1" else 2)


# --- the families of issue 38: Gemma 2, Gemma 3, Phi-3 / 3.5 / Phi-4-mini ------------------------------------------
# (tests/conftest.py PUBLISHED, tiny; llama.cpp takes Gemma's score scale from head_dim, and runs Gemma 3's files with
# five local layers to a global one: the models here are those llama.cpp's reading of their files describes)
NEW_FAMILIES = [
    # soft caps, post norms (1 + w in the file), GeGLU, local / global layers alternating; a sentencepiece vocabulary
    ("gemma2", "gemma2", "Q8_0", dict(query_pre_attn_scalar=16), dict(
        layer_types=["sliding_attention", "full_attention"], sliding_window=5,
        attn_logit_softcapping=float(np.float32(0.15)), final_logit_softcapping=0.5,  # (float32 in the file)
        attention_scale=0.25, norm_offset=0.0, post_norms=True, embedding_scale=8.0,
        hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)),
    # q/k norms (1 + w), one KV head, a linear-scaled global rope beside the local layers' own theta
    ("gemma3", "gemma3", "Q4_0", dict(num_hidden_layers=6, sliding_window_pattern=6), dict(
        layer_types=["sliding_attention"] * 5 + ["full_attention"], qk_norm=True, rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_rope_theta=10000.0, num_kv_heads=1,
        norm_offset=0.0, attention_scale=32 ** -0.5)),
    # attn_qkv and ffn_up (gate | up) cut apart, LongRoPE from rope_factors_long / _short across its switch
    ("phi3_5", "phi3", "Q8_0", {}, dict(rotary_dim=None, sliding_window=64, norm_offset=0.0, tie_word_embeddings=False)),
    # a partial rotary (rope.dimension_count 12 of 16), GQA, tied embeddings, o200k's pre-tokenizer
    ("phi4_mini", "phi3", "Q4_1", {}, dict(rotary_dim=12, num_kv_heads=2, tie_word_embeddings=True))]


END_OF_TURN = {"gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>", "phi3_5": "<|end|>"}


@pytest.mark.parametrize("name,gguf_arch,qtype,overrides,want", NEW_FAMILIES, ids=[c[0] for c in NEW_FAMILIES])
def test_new_families_match_transformers_on_the_same_file(tmp_path, name, gguf_arch, qtype, overrides, want):
    """A GGUF laid out as llama.cpp's converter writes each family (tests/gguf_files.py) converts to the model of its
    keys (the params `want`; LongRoPE's factors and attention factor from the file) with logits and greedy tokens of
    transformers loading the same file (with the model's config: transformers reads few of these keys); the matrices
    kept bit-exact (q's rows, cut from attn_qkv where fused, un-permuted over the rotated dims), the norms as the
    file holds them (Gemma's 1 + w, so no offset added again); the tokenizer encodes as transformers' of the file;
    generation stops at EOS and at the end-of-turn token, found by its text as llama.cpp finds it."""
    import tokenizers
    from model_zoo.decoder import unpermute_rotary
    _, model = make_published(name, tmp_path / "hf", **overrides)
    cfg = model.config
    tokenizer = None  # (a byte-level BPE)
    if name in END_OF_TURN:  # a sentencepiece vocabulary with the family's end-of-turn token (llama.cpp stops at it)
        tokenizer = sentencepiece_vocab(VOCAB)
        tokenizer["tokens"][-1], tokenizer["types"][-1] = END_OF_TURN[name], 3
    path = write_gguf(model, tmp_path / "m.gguf", gguf_arch, matrices(qtype), tokenizer=tokenizer, pre="gpt-4o")[0]
    lines = []
    convert(str(path), str(tmp_path / "pmx"), progress=False, report=lines.append)
    assert any(ln.startswith(f"{qtype}: ") and ln.endswith("bit-exact") for ln in lines), lines
    p = PmxParams.load(tmp_path / "pmx")
    assert {k: getattr(p, k) for k in want} == want
    assert p.eos_ids == ((2, VOCAB - 1) if name in END_OF_TURN else (2,))
    rope = getattr(cfg, "rope_parameters", {})
    if rope.get("rope_type") == "longrope":
        f32 = lambda xs: [float(np.float32(x)) for x in xs]  # noqa: E731 - as the file holds them
        assert p.rope_scaling == {"rope_type": "longrope", "long_factor": f32(rope["long_factor"]),
                                  "short_factor": f32(rope["short_factor"]), "original_max_position_embeddings": 8,
                                  "attention_factor": float(np.float32(2 ** 0.5))}  # sqrt(1 + ln 8 / ln 8)
    hf = from_gguf(path, cfg)
    prompts, conts = prompts_and_conts(VOCAB)
    assert rel_err(logits(tmp_path / "pmx"), hf_logits(hf, prompts, conts)) < logits_tol(qtype, 1e-5)
    assert core(tmp_path / "pmx").generate(prompts, 8) == hf_greedy(hf, prompts, 8)

    rd = SafetensorsReader(tmp_path / "pmx" / "model.00.safetensors")
    parts = {k: rd.get(f"layers.0.attention.wq.{k}") for k in ("qweight", "scale", "offset")
             if f"layers.0.attention.wq.{k}" in rd.keys()}
    got = dequantize(parts["qweight"], parts["scale"], "int8" if qtype == "Q8_0" else "int4",
                     offset=parts.get("offset"))
    q_rows = cfg.num_attention_heads * p.head_dim
    fused = gguf_arch == "phi3"
    want_q = dequantized(path, "blk.0.attn_qkv.weight" if fused else "blk.0.attn_q.weight")[:q_rows]
    assert torch.equal(got, unpermute_rotary(want_q, cfg.num_attention_heads, rotary_dims=p.rotary_dims))
    assert torch.equal(rd.get("layers.0.attention_norm.weight"), dequantized(path, "blk.0.attn_norm.weight"))
    text = "Once upon a time, in 2024, LILY's cat didn't play.  She loved the park"
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert Tokenizer(str(tmp_path / "pmx"), vocab_size=VOCAB).encode(text) == theirs(text).input_ids
    ours = tokenizers.Tokenizer.from_file(str(tmp_path / "pmx" / "tokenizer.json")).pre_tokenizer
    split = theirs.backend_tokenizer.pre_tokenizer  # (the pieces: this small vocabulary merges little)
    assert (ours is None) == (split is None)
    assert ours is None or ours.pre_tokenize_str(text) == split.pre_tokenize_str(text)


def _params_of_keys(arch: str, keys: dict, layers: int = 6, vectors: Optional[dict] = None) -> PmxParams:
    """The params a GGUF of `arch` with these `{arch}.*` keys (and a small model's required ones) converts to."""
    from model_zoo import family_for_gguf
    family = family_for_gguf(arch, False, "m.gguf")
    meta = {f"{arch}.{k}": v for k, v in {"embedding_length": 64, "attention.head_count": 4, "block_count": layers,
                                         "feed_forward_length": 96, "attention.layer_norm_rms_epsilon": 1e-6,
                                         **keys}.items()}
    config = family.gguf_config(meta, {"token_embd.weight": (300, 64)}, "m.gguf", vectors)
    return family.gguf_params(config, "float32", "m.gguf")


def test_new_families_gguf_keys():
    """What llama.cpp assumes of these families' files, read the same way: Gemma's score scale from head_dim, from
    hidden / heads at the 27B's block counts; attention.sliding_window_pattern as a period or a bool per layer;
    no window key: Gemma 2's 4096 on alternate layers, none for Gemma 3; a window of 0: none (Phi-4-mini's); what
    the family cannot run refused naming the key."""
    assert _params_of_keys("gemma2", {"attention.key_length": 32}).attention_scale == 32 ** -0.5
    assert _params_of_keys("gemma2", {"attention.key_length": 32}, layers=46).attention_scale == 16 ** -0.5
    assert _params_of_keys("gemma3", {"attention.key_length": 32}, layers=62).attention_scale == 16 ** -0.5
    gemma2 = _params_of_keys("gemma2", {}, layers=4)
    assert (gemma2.sliding_window, gemma2.layer_types) == (4096, ["sliding_attention", "full_attention"] * 2)
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)  # llama.cpp's defaults
    assert _params_of_keys("gemma3", {}).sliding_window is None
    assert _params_of_keys("gemma3", {"attention.sliding_window": 8}).layer_types == \
        ["sliding_attention"] * 5 + ["full_attention"]
    three = _params_of_keys("gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": 3})
    assert three.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    kinds = [True, False, False, True, True, False]
    listed = _params_of_keys("gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": kinds})
    assert listed.layer_types == ["sliding_attention" if k else "full_attention" for k in kinds]
    every = _params_of_keys("gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": 0})
    assert (every.sliding_window, every.layer_types) == (8, None)
    assert _params_of_keys("phi3", {"attention.sliding_window": 0}).sliding_window is None
    assert _params_of_keys("phi3", {"rope.dimension_count": 12}).rotary_dims == 12
    for arch, keys, vectors, words in (
            ("phi3", {"rope.freq_base_swa": 500.0}, None, "phi3.rope.freq_base_swa = 500.0"),
            ("llama", {"attention.sliding_window": 8}, None, "llama.attention.sliding_window = 8"),
            ("phi3", {"rope.dimension_count": 15}, None, "phi3.rope.dimension_count = 15"),
            ("gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": [True]}, None,
             "gemma3.attention.sliding_window_pattern must hold a bool for each of the 6 layers"),
            ("phi3", {"rope.scaling.original_context_length": 8}, {"rope_factors_long.weight": [1.0] * 8},
             "rope_factors_short.weight is missing")):
        with pytest.raises(PmxError, match=re.escape(words)):
            _params_of_keys(arch, keys, vectors=vectors)


def test_mixtral_experts_and_split_set(tmp_path):
    """A llama GGUF with stacked experts is Mixtral (compared with the transformers model it was written from, F32),
    and the same model written as a split set (-0000i-of-0000N.gguf) converts to the same bytes from its first part
    or its directory; a later part, or a set missing a part, is refused by name."""
    model = hf_model("mixtral")
    (tmp_path / "one").mkdir()
    one = write_gguf(model, tmp_path / "one" / "m.gguf", "llama")[0]
    convert(str(one), str(tmp_path / "pmx"), progress=False)
    assert PmxParams.load(tmp_path / "pmx").num_experts == 4
    assert rel_err(logits(tmp_path / "pmx"), hf_logits(model, *prompts_and_conts(VOCAB))) < 2e-6
    (tmp_path / "split").mkdir()
    parts = write_gguf(model, tmp_path / "split" / "m.gguf", "llama", split_max_tensors=8)
    assert len(parts) > 2 and parts[0].name.endswith("-00001-of-0000%d.gguf" % len(parts))
    for src in (parts[0], parts[0].parent):
        convert(str(src), str(tmp_path / "from_split"), progress=False, overwrite=True)
        assert (tmp_path / "from_split" / "model.00.safetensors").read_bytes() == \
            (tmp_path / "pmx" / "model.00.safetensors").read_bytes()
    with pytest.raises(PmxError, match="give its first part"):
        convert(str(parts[1]), str(tmp_path / "x"), progress=False)
    parts[-1].unlink()
    with pytest.raises(PmxError, match=f"{parts[-1].name} is missing"):
        convert(str(parts[0]), str(tmp_path / "x"), progress=False)
    assert not (tmp_path / "x").exists()


def test_llama3_rope_from_rope_freqs(tmp_path):
    """llama.cpp stores a llama3 rope_scaling as frequency factors (rope_freqs.weight): read back into the same dict,
    the model gives transformers' logits with that rope_scaling."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    model = hf_model("llama_mha", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                     rope_parameters={**rope, "rope_theta": 500000.0})
    factors = llama3_factors(64, 500000.0)
    assert 1 < factors[16] < 8  # the smooth step between short and long wavelengths is there to fit
    path = write_gguf(model, tmp_path / "m.gguf", extra={"rope_freqs.weight": ("F32", factors)})[0]
    convert(str(path), str(tmp_path / "pmx"), progress=False)
    assert PmxParams.load(tmp_path / "pmx").rope_scaling == rope
    assert rel_err(logits(tmp_path / "pmx"), hf_logits(model, *prompts_and_conts(VOCAB))) < 2e-6


def test_half_precision_stays_half(tmp_path, make_hf):
    """F16 / BF16 GGUF matrices and bf16 / fp16 safetensors are written at their width (--dtype auto), never widened;
    the F16 model runs (upcast at load here) with transformers' logits of the same file."""
    model = hf_model("llama_mha")
    for type_name, dtype in (("F16", torch.float16), ("BF16", torch.bfloat16)):
        path = write_gguf(model, tmp_path / f"{type_name}.gguf", qtype=lambda n, s: type_name)[0]
        convert(str(path), str(tmp_path / type_name), progress=False)
        rd = SafetensorsReader(tmp_path / type_name / "model.00.safetensors")
        assert PmxParams.load(tmp_path / type_name).dtype == str(dtype).replace("torch.", "")
        assert {rd.dtype(k) for k in rd.keys()} == {dtype}
        want = dequantized(path, "blk.0.ffn_up.weight").to(dtype)
        assert torch.equal(rd.get("layers.0.feed_forward.w3.weight"), want)
    hf = from_gguf(tmp_path / "F16.gguf")
    with torch.no_grad():  # the file's F32 norms are float16 in the float16 model, as in an HF float16 checkpoint
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(p.half().float())
    assert rel_err(logits(tmp_path / "F16"), hf_logits(hf, *prompts_and_conts(VOCAB))) < 2e-6
    for dt in ("bfloat16", "float16"):
        src, _ = make_hf("llama_mha", torch_dtype=dt)
        convert(str(src), str(tmp_path / f"hf-{dt}"), progress=False)
        assert SafetensorsReader(tmp_path / f"hf-{dt}" / "model.00.safetensors").dtype(
            "layers.0.attention.wq.weight") == getattr(torch, dt)


def test_requantise_and_split_a_q8_0_model(tmp_path):
    """--quantize re-quantises what was dequantised (Q5_0 -> int8 per channel) and keeps Q8_0 as it is, in one model;
    a Q8_0 model split in 2 (int8 groups cut with the row-parallel columns, never inside a group) gives TP = 1's
    logits, and merges back bit for bit."""
    from runner.pmx.quant import QuantScheme
    model = hf_model("llama_mha", intermediate_size=128)
    mixed = write_gguf(model, tmp_path / "mixed.gguf",
                       qtype=lambda n, s: "Q5_0" if "ffn" in n else "Q8_0" if s[-1] % 32 == 0 else "F32")[0]
    lines = []
    convert(str(mixed), str(tmp_path / "mixed"), progress=False, quant=QuantScheme("int8"), report=lines.append)
    scheme = scheme_of(PmxParams.load(tmp_path / "mixed"))
    assert scheme.for_tensor("layers.0.feed_forward.w1.weight") == QuantScheme("int8").leaf()
    assert scheme.for_tensor("layers.0.attention.wq.weight") == QuantScheme("int8", 32).leaf()
    assert any(ln.startswith("Q5_0: 6 tensors -> int8 per channel (dequantised, --quantize)") for ln in lines), lines
    tp1 = logits(tmp_path / "mixed")
    assert rel_err(tp1, hf_logits(from_gguf(mixed), *prompts_and_conts(VOCAB))) < 0.05  # re-quantised: close only
    reshard(str(tmp_path / "mixed"), str(tmp_path / "mixed2"), 2, progress=False)
    prompts, conts = prompts_and_conts(VOCAB)
    assert rel_err(run_tp(tmp_path, tmp_path / "mixed2", 2, [{}], prompts, conts)[0], tp1) < 1e-5
    reshard(str(tmp_path / "mixed2"), str(tmp_path / "mixed1"), 1, progress=False)
    assert (tmp_path / "mixed1" / "model.00.safetensors").read_bytes() == \
        (tmp_path / "mixed" / "model.00.safetensors").read_bytes()


def test_export_of_a_converted_gguf(tmp_path):
    """A converted GGUF whose weights are stored four ways (q, k, o Q8_0, v Q4_0, the MLP Q4_1, vectors F32) exports
    as the engine runs it: Q8_0 as ppl.pmx's Woqu int8 linears in groups of 32, Q4_0 as Woqu int4 in groups of 32,
    Q4_1 dequantised into float linears (ppl.pmx's zero point is an integer nibble, not a float offset), q / k / v
    unfused as the engine leaves them (stored differently); the opmx graph in onnxruntime and the standard-ops graph
    in a stock session give the engine's logits and cache on a mixed step."""
    import onnx
    from runner.config import EngineConfig
    from runner.kernels.cpu_ext import cpu_ops
    from runner.onnx.export import export
    from test_export import MIXED, assert_caches_agree, check_slices, onnxruntime_against_the_engine, rel
    model = hf_model("llama_mha")
    path = write_gguf(model, tmp_path / "m.gguf", qtype=lambda n, s: "F32" if s[-1] % 32 else "Q4_1" if "ffn" in n
                      else "Q4_0" if "attn_v" in n else "Q8_0")[0]
    pmx = tmp_path / "pmx"
    convert(str(path), str(pmx), progress=False)
    scheme = scheme_of(PmxParams.load(pmx))
    leaves = {b: scheme.for_tensor(f"layers.0.{b}.weight") for b in ("attention.wq", "attention.wv", "feed_forward.w1")}
    assert [(x.method, x.group_size, x.offset) for x in leaves.values()] == \
        [("int8", 32, False), ("int4", 32, False), ("int4", 32, True)]
    # the engine's int4 kernel multiplies activations quantised to ~15 bits where it has AVX512-VNNI (test_export)
    vnni = cpu_ops() is not None and int(torch.ops.pmx_cpu.int4_layout(32)) == 1
    cfg = EngineConfig()
    for opset in ("opmx", "standard"):
        export(str(pmx), str(tmp_path / opset), opset=opset, progress=False, config=cfg)
        got, want, feeds, ours = onnxruntime_against_the_engine(pmx, tmp_path / opset, cfg, MIXED,
                                                                standard=opset == "standard")
        assert rel(got, want) <= (2e-3 if vnni else 1e-5), (opset, rel(got, want))
        assert_caches_agree(feeds, ours)
    check_slices(tmp_path / "opmx", 1)
    graph = onnx.load(str(tmp_path / "opmx" / "model_slice_0" / "model.onnx")).graph
    linears = {}
    for node in graph.node:
        if node.op_type.endswith("ParallelLinear"):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            linears[node.input[1]] = (node.op_type, attrs.get("quant_data_type", b"").decode(), attrs.get("group_size"))
    assert linears["layers.0.attention.wq.qweight"] == ("WoquColumnParallelLinear", "int8", 32)
    assert linears["layers.0.attention.wv.qweight"] == ("WoquColumnParallelLinear", "int4", 32)
    assert linears["layers.0.attention.wo.qweight"] == ("WoquRowParallelLinear", "int8", 32)
    assert linears["layers.0.feed_forward.wu.weight"] == ("ColumnParallelLinear", "", None)
    assert linears["layers.0.feed_forward.w2.weight"] == ("RowParallelLinear", "", None)


# --- the tokenizer ------------------------------------------------------------------------------------------------
def test_tokenizer_from_the_metadata(tmp_path):
    """A byte-level BPE (pre-tokenizer smollm: digits one by one) and a sentencepiece vocabulary become tokenizer.json
    files that encode as transformers' tokenizer of the same GGUF (BOS as tokenizer.ggml.add_bos_token says, by
    default for sentencepiece); special tokens, add_bos_token and the chat template go into tokenizer_config.json."""
    model = hf_model("llama_mha")
    template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    bpe = write_gguf(model, tmp_path / "bpe.gguf", pre="smollm", chat_template=template)[0]
    spm = write_gguf(model, tmp_path / "spm.gguf", tokenizer=sentencepiece_vocab(VOCAB))[0]
    text = "Once upon a time there was a little girl named Lily. She loved the park"
    for path, bos in ((bpe, False), (spm, True)):
        out = tmp_path / f"{path.stem}-pmx"
        convert(str(path), str(out), progress=False)
        ours = Tokenizer(str(out), vocab_size=VOCAB)
        theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        assert ours.encode(text) == theirs(text).input_ids and (ours.encode(text)[0] == 1) == bos
        assert ours.decode(ours.encode(text)) == text
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        assert cfg["add_bos_token"] is bos and (cfg["bos_token"], cfg["eos_token"]) == ("<s>", "</s>")
    assert json.loads((tmp_path / "bpe-pmx" / "tokenizer_config.json").read_text())["chat_template"] == template
    ours = Tokenizer(str(tmp_path / "bpe-pmx"), vocab_size=VOCAB)
    assert [ours.token_text(i) for i in ours.encode("a 2024")] == ["a", " ", "2", "0", "2", "4"]  # llama.cpp's smollm


# --- refusals -----------------------------------------------------------------------------------------------------
def test_unsupported_architecture_type_or_tokenizer_is_one_line(tmp_path):
    """A GGUF of an architecture, tensor type or pre-tokenizer that cannot be converted: one line naming it (exit
    status 2 from the command), nothing written."""
    import gguf
    model = hf_model("llama_mha")
    bad_arch = write_gguf(model, tmp_path / "falcon.gguf", "falcon")[0]
    q8_1 = np.zeros((VOCAB, 64 // 32 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1][1]), dtype=np.uint8)
    bad_type = write_gguf(model, tmp_path / "q81.gguf", extra={"token_embd.weight": ("Q8_1", q8_1)})[0]
    bad_pre = write_gguf(model, tmp_path / "pre.gguf", pre="falcon")[0]
    res = run_cli("convert", "--input_dir", bad_arch, "--output_dir", tmp_path / "out")  # one through the command
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "GGUF architecture 'falcon'" in lines[0], res.stderr
    assert "supported: gemma2, gemma3, llama, llama with experts, phi3, qwen2" in lines[0] and str(bad_arch) in lines[0]
    for path, words in ((bad_type, ["'token_embd.weight'", "type Q8_1"]),
                        (bad_pre, ["tokenizer.ggml.pre 'falcon'", "smollm"])):
        with pytest.raises(PmxError) as e:
            convert(str(path), str(tmp_path / "out"), progress=False)
        assert "\n" not in str(e.value) and str(path) in str(e.value) and all(w in str(e.value) for w in words)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))]
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(bad_arch.read_bytes())
    with pytest.raises(PmxError, match="holds several GGUF models"):
        convert(str(tmp_path / "two"), str(tmp_path / "out"), progress=False)


# --- the real model: SmolLM2-135M-Instruct, Q4_1 ------------------------------------------------------------------
SMOL = SHARED_MODELS / "smollm2-135m-instruct"
SMOL_FILE = SMOL / "SmolLM2-135M-Instruct.Q4_1.gguf"
CAPITAL = [504, 3575, 282, 4649, 314]                        # "The capital of France is" (SOURCE.md)
CAPITAL_NEXT = [7042, 30, 198, 198, 504, 2988, 314, 42]      # " Paris.\n\nThe answer is:" (SOURCE.md, transformers)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """SmolLM2-135M-Instruct converted from its GGUF (and split in 3), with transformers' model of the same file (the
    file's metadata parsed once for both)."""
    if not SMOL_FILE.is_file():
        pytest.skip(f"{SMOL_FILE} not found: the real checkpoints live in ../shared/models beside the project")
    d = tmp_path_factory.mktemp("smol")
    with one_parse_per_file():
        convert(str(SMOL), str(d / "pmx"), progress=False)
        hf = from_gguf(SMOL_FILE)
    reshard(str(d / "pmx"), str(d / "pmx_3"), 3, progress=False)
    with torch.no_grad():
        want = hf.generate(torch.tensor([CAPITAL]), max_new_tokens=8, do_sample=False)[0, len(CAPITAL):].tolist()
    assert want == CAPITAL_NEXT
    return d, hf, want


def test_smollm2_greedy_tokens_equal_transformers_tp1(smol):
    """Greedy tokens of the converted Q4_1 model (its linears int4 with offsets, its embedding and lm head int8 in
    groups of 32) equal transformers' on the same file at TP 1, on the one-call C++ decode step and on the eager
    runner."""
    from dataclasses import replace
    from runner.engine.core import EngineCore
    from runner.engine.runners import Stepper
    d, _, want = smol
    stepper = engine(d / "pmx")
    assert EngineCore(stepper.model, stepper, stepper.config).generate([CAPITAL], 8)[0] == want
    eager = replace(stepper.config, fused_decode=False, compile="off")  # the same model on the eager runner
    assert EngineCore(stepper.model, Stepper(stepper.model, eager), eager).generate([CAPITAL], 8)[0] == want


def test_smollm2_through_the_server_at_tp3(smol, tmp_path):
    """The model split in 3 behind the server (mpirun): greedy tokens equal transformers' token for token (a
    completion of the prompt's ids, each token's text from logprobs), and a chat answered with the model's own
    template (ChatML with its default system prompt: 37 ids)."""
    from test_server import start
    d, _, want = smol
    tok = Tokenizer(str(d / "pmx"))
    srv = start(tmp_path, "mpich", 3, d / "pmx_3", "--kv_cache_tokens", 2048, "--compile", "off")
    try:
        r = srv.client.completions.create(model=srv.model, prompt=CAPITAL, max_tokens=8, temperature=0, logprobs=1)
        assert r.choices[0].logprobs.tokens == [tok.token_text(i) for i in want], r.choices[0].logprobs.tokens
        assert r.choices[0].text == " Paris.\n\nThe answer is:"
        r = srv.client.chat.completions.create(model=srv.model, temperature=0, max_tokens=20, messages=[
            {"role": "user", "content": "What is the capital of France?"}])
        assert r.choices[0].message.content == "The capital of France is Paris." and r.usage.prompt_tokens == 37
        srv.stop()
    finally:
        srv.job.cleanup()


def test_smollm2_perplexity_equals_transformers(smol, tmp_path):
    """`runner perplexity` (windows of 64, stride 32) within 1e-4 relative of transformers' on the same token ids and
    windows."""
    from runner.engine.perplexity import perplexity, windows
    d, hf, _ = smol
    story = Path(__file__).parent / "data" / "story.txt"
    text = story.read_text()[:400]
    (tmp_path / "t.txt").write_text(text)
    ours = perplexity(str(d / "pmx"), str(tmp_path / "t.txt"), window=64, stride=32)
    ids = Tokenizer(str(d / "pmx")).encode(text)
    nll, count = 0.0, 0
    with torch.no_grad():
        for begin, end, first in windows(len(ids), 64, 32):
            logp = torch.log_softmax(hf(torch.tensor([ids[begin:end]])).logits[0].double(), -1)
            for t in range(first, end):
                nll -= float(logp[t - 1 - begin, ids[t]])
                count += 1
    want = float(np.exp(nll / count))
    assert ours["tokens"] == count and abs(ours["perplexity"] / want - 1) < 1e-4, (ours, want)


def test_the_reader_agrees_with_gguf_and_refuses_a_bad_file_by_name(tmp_path):
    """This project's GGUF reader gives gguf's reader's metadata (every value type the files carry: strings, integers,
    floats, arrays of numbers and of strings) and tensors (type, shape, offset, bytes); a file that is not GGUF,
    is cut short in its metadata or in its tensors, is refused naming the file."""
    import gguf
    from runner.pmx.gguf import SMALL_ARRAY, GGUFCheckpoint
    model = hf_model("llama_mha")
    path = write_gguf(model, tmp_path / "m.gguf", qtype=lambda n, s: "Q8_0" if n.endswith("attn_q.weight") else "F16",
                      pre="smollm", chat_template="{{ m }}")[0]
    ours, theirs = GGUFCheckpoint([path]), gguf.GGUFReader(path)
    assert ours.meta == {k: v.contents() for k, v in theirs.fields.items()
                         if len(v.data) <= SMALL_ARRAY and not k.startswith("GGUF.")}
    assert ours.token_count == len(theirs.fields["tokenizer.ggml.tokens"].data) == VOCAB
    assert {type(v) for v in ours.meta.values()} >= {str, int, float, list}
    assert len(ours.tensors) == len(theirs.tensors)
    for t in theirs.tensors:
        o = ours.tensors[t.name]
        assert (o.type, o.shape, o.offset) == (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                                               int(t.data_offset))
        assert o.data.dtype == t.data.dtype and np.array_equal(o.data, t.data)
    data = path.read_bytes()
    last = max(t.offset + t.data.nbytes for t in ours.tensors.values())
    for name, body, says in (("foreign.gguf", b"GGUX" + data[4:], "not GGUF"), ("meta.gguf", data[:2000], ""),
                             ("tensors.gguf", data[:last - 1], "runs past the end of the file")):
        (tmp_path / name).write_bytes(body)
        with pytest.raises(PmxError, match=rf"{name}: not a readable GGUF file \(.*{re.escape(says)}"):
            GGUFCheckpoint([tmp_path / name])
