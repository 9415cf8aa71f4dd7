"""Weight-only quantisation: the arithmetic, the tensor layout, convert / quantize, split / merge and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from runner.errors import PmxError
from runner.pmx.convert import PmxModel, convert, quantize_model, reshard
from runner.pmx.params import PmxParams
from runner.pmx.quant import (QuantScheme, dequantize, pack_int4, quantize_int4, quantize_int8, quantized_tensors,
                              scheme_from_flags, unpack_int4)
from runner.pmx.store import SafetensorsReader
from test_bad_input import assert_fails_cleanly, run_cli
from test_split_merge import assert_same_model

INT8, INT4 = QuantScheme("int8"), QuantScheme("int4", 16)


# --- arithmetic ----------------------------------------------------------------------------------
def test_int8_per_channel_round_trip():
    w = torch.randn(37, 53) * torch.linspace(0.01, 3, 37)[:, None]
    w[5] = 0  # an all-zero row: scale 0, exactly zero back
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (37,) and s[5] == 0
    assert torch.equal(q.abs().amax(1)[torch.arange(37) != 5], torch.full((36,), 127, dtype=torch.int8))
    err = (dequantize(q, s, "int8") - w).abs()
    assert torch.all(err <= s[:, None] / 2 + 1e-7) and torch.all(err[5] == 0)


def test_int4_groups_pack_and_error():
    w = torch.randn(3, 10, 64)  # leading (expert) dims too
    q, s = quantize_int4(w, 16)
    assert q.dtype == torch.uint8 and q.shape == (3, 10, 32) and s.shape == (3, 10, 4)
    nib = unpack_int4(q)
    assert torch.equal(pack_int4(nib), q) and int(nib.max()) <= 15
    assert torch.equal(nib[..., 0], q[..., 0] & 15) and torch.equal(nib[..., 1], q[..., 0] >> 4)  # 2j low, 2j+1 high
    wg = w.unflatten(-1, (4, 16))
    err = (dequantize(q, s, "int4").unflatten(-1, (4, 16)) - wg).abs()
    inside = (wg / s[..., None] >= -8) & (wg / s[..., None] <= 7)
    assert torch.all(err[inside] <= (s[..., None] / 2 + 1e-6).expand_as(err)[inside])  # half a step unless clipped
    plain = wg.abs().amax(-1, keepdim=True) / 7  # ppl.pmx's scale: the searched one is never worse per group
    plain_err = ((torch.round(wg / plain).clamp(-8, 7) * plain - wg) ** 2).sum(-1)
    assert torch.all((err ** 2).sum(-1) <= plain_err + 1e-6) and (err ** 2).sum() < 0.95 * plain_err.sum()
    with pytest.raises(PmxError, match="multiple of group_size 16"):
        quantize_int4(torch.randn(4, 24), 16)


def test_scheme_flags_and_validation():
    assert scheme_from_flags(None) is None
    assert scheme_from_flags("int8", group_size=64) == QuantScheme("int8", 0, True, True)  # int8 is per channel
    assert scheme_from_flags("int4", 32, False, False) == QuantScheme("int4", 32, False, False)
    for args, msg in [(("int3",), "--quantize must be int8 or int4"), (("int4", 7), "--group_size"),
                      ((None, 128, True), "--quantize_output needs"), ((None, 128, None, True), "--quantize_embedding"),
                      (("int8", 0, None, "yes"), "--quantize_embedding must be True or False")]:
        with pytest.raises(PmxError, match=msg):
            scheme_from_flags(*args)
    with pytest.raises(PmxError, match="quantization"):
        QuantScheme.from_dict({"method": "int8", "bits": 8})
    assert INT4.quantizes("layers.3.feed_forward.w2.weight") and not INT4.quantizes("layers.0.feed_forward.gate.weight")
    assert INT4.quantizes("output.weight") and INT4.quantizes("tok_embeddings.weight")  # by default
    floats = QuantScheme("int4", 16, False, False)
    assert not floats.quantizes("output.weight") and not floats.quantizes("tok_embeddings.weight")
    # a pmx_params.json written before quantize_embedding (or quantize_output) existed: those stayed float
    assert QuantScheme.from_dict({"method": "int8", "group_size": 0, "quantize_output": True}) == \
        QuantScheme("int8", 0, True, False)
    assert QuantScheme.from_dict({"method": "int4", "group_size": 32}) == QuantScheme("int4", 32, False, False)


def test_grouped_int8_offsets_and_per_weight_schemes():
    """The schemes GGUF files bring: int8 in groups (a scale per group of input columns), int4 with an offset per group
    (W = nibble x scale + offset), and one scheme covering a model that mixes them (`tensors`: the weights stored
    otherwise, null for float); its pmx_params dict round-trips, and a scheme without them writes neither key."""
    w = torch.randn(6, 64)
    q, s = quantize_int8(w, 32)
    assert s.shape == (6, 2) and torch.equal(dequantize(q, s, "int8"), (q.float().view(6, 2, 32) * s[..., None])
                                             .view(6, 64))
    from runner.pmx.quant import quantize_int4_offset, tensor_dtype
    q, s, o = quantize_int4_offset(w, 32)
    back = dequantize(q, s, "int4", offset=o)
    assert o.shape == s.shape == (6, 2) and torch.equal(back.view(6, 2, 32).amin(-1), o)
    assert float((back - w).abs().max()) <= float(s.max()) / 2 + 1e-6
    with pytest.raises(PmxError, match="offsets are an int4"):
        QuantScheme("int8", 32, offset=True)
    q41, q80 = QuantScheme("int4", 32, offset=True), QuantScheme("int8", 32)
    leaves = {f"layers.0.{m}": q41 for m in ("attention.wq", "attention.wk", "feed_forward.w2")}
    leaves.update({"tok_embeddings": q80, "output": q80, "layers.0.attention.wv": None})
    scheme = QuantScheme.of_tensors(leaves)
    assert (scheme.method, scheme.group_size, scheme.offset) == ("int4", 32, True)
    assert scheme.tensors == {"tok_embeddings": q80.leaf_dict(), "output": q80.leaf_dict(),
                              "layers.0.attention.wv": None}
    assert QuantScheme.from_dict(scheme.to_dict()) == scheme
    assert scheme.for_tensor("layers.0.attention.wq.weight") == q41.leaf()
    assert scheme.for_tensor("tok_embeddings.weight") == q80 and scheme.for_tensor("layers.0.attention.wv.weight") \
        is None and scheme.for_tensor("norm.weight") is None
    shapes = quantized_tensors(scheme, {"layers.0.attention.wq.weight": (8, 64), "layers.0.attention.wv.weight": (8, 64),
                                        "tok_embeddings.weight": (10, 64)})
    assert shapes == {"layers.0.attention.wq.qweight": (8, 32), "layers.0.attention.wq.scale": (8, 2),
                      "layers.0.attention.wq.offset": (8, 2), "layers.0.attention.wv.weight": (8, 64),
                      "tok_embeddings.qweight": (10, 64), "tok_embeddings.scale": (10, 2)}
    p = PmxParams(model_type="llama", hidden_dim=64, intermediate_dim=64, num_layers=1, num_heads=4, num_kv_heads=4,
                  head_dim=16, vocab_size=10, norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                  dtype="float16", quantization=scheme.to_dict())
    assert tensor_dtype(p, "tok_embeddings.qweight", torch.float16) == torch.int8
    assert tensor_dtype(p, "layers.0.attention.wq.offset", torch.float16) == torch.float32
    assert tensor_dtype(p, "layers.0.attention.wv.weight", torch.float16) == torch.float16
    assert set(INT8.to_dict()) == {"method", "group_size", "quantize_output", "quantize_embedding"}
    assert QuantScheme.of_tensors({"output": None, "layers.0.attention.wq": None}) is None
    with pytest.raises(PmxError, match="not a weight that can be quantised"):
        QuantScheme("int8", tensors={"norm": None})


# --- convert, quantize, split, merge ---------------------------------------------------------------
def linear_bytes(directory, kinds) -> int:
    rd = SafetensorsReader(directory / "model.00.safetensors")
    return sum(rd.get(n).numel() * rd.get(n).element_size() for n in rd.keys() if n.rsplit(".", 1)[-1] in kinds)


@pytest.mark.parametrize("scheme,ratio", [(INT8, 0.25), (QuantScheme("int4", 64), 0.125)])
def test_convert_quantized_layout_and_size(make_hf, tmp_path, scheme, ratio):
    src, _ = make_hf("llama_mha", intermediate_size=128)
    convert(str(src), str(tmp_path / "f"), progress=False)
    p = convert(str(src), str(tmp_path / "q"), progress=False, quant=scheme)
    assert PmxParams.load(tmp_path / "q") == p and p.quantization == scheme.to_dict()
    rd = SafetensorsReader(tmp_path / "q" / "model.00.safetensors")
    assert rd.dtype("layers.0.attention.wq.qweight") == scheme.qdtype
    assert rd.dtype("layers.1.feed_forward.w2.scale") == torch.float32
    assert "layers.0.attention.wq.weight" not in rd.keys() and rd.dtype("output.qweight") == scheme.qdtype
    assert rd.dtype("tok_embeddings.qweight") == scheme.qdtype and "tok_embeddings.weight" not in rd.keys()
    f, q = linear_bytes(tmp_path / "f", {"weight"}) - linear_bytes(tmp_path / "q", {"weight"}), \
        linear_bytes(tmp_path / "q", {"qweight", "scale"})
    assert ratio <= q / f <= ratio * 1.3, q / f  # a quarter / an eighth of fp32, plus the scales
    # quantize on an existing float PMX model gives the same bytes
    quantize_model(str(tmp_path / "f"), str(tmp_path / "q2"), scheme, progress=False)
    assert_same_model(tmp_path / "q", tmp_path / "q2")


@pytest.mark.parametrize("scheme", [INT8, QuantScheme("int4", 16, True)])
@pytest.mark.parametrize("n", [2, 4])
def test_split_merge_bit_exact(make_hf, tmp_path, scheme, n):
    src, _ = make_hf("llama_mha")  # 4 heads x 16, intermediate 96: per rank 48 / 24 columns at n = 2 / 4
    if scheme.method == "int4" and n == 4:
        scheme = QuantScheme("int4", 8, True)
    convert(str(src), str(tmp_path / "q"), progress=False, quant=scheme)
    reshard(str(tmp_path / "q"), str(tmp_path / "s"), n, progress=False)
    reshard(str(tmp_path / "s"), str(tmp_path / "m"), 1, progress=False, expect_input_shards=n)
    assert_same_model(tmp_path / "q", tmp_path / "m")
    full, split = PmxModel(tmp_path / "q"), PmxModel(tmp_path / "s")
    wq, w2 = "layers.0.attention.wq", "layers.1.feed_forward.w2"
    rows = full.readers[0].shape(f"{wq}.qweight")[0] // n
    for r in range(n):  # column-parallel: weight and scale rows together; row-parallel: qweight by columns
        rd = split.readers[r]
        assert torch.equal(rd.get(f"{wq}.qweight"), full.get_merged(f"{wq}.qweight")[r * rows:(r + 1) * rows])
        assert torch.equal(rd.get(f"{wq}.scale"), full.get_merged(f"{wq}.scale")[r * rows:(r + 1) * rows])
        cols = full.readers[0].shape(f"{w2}.qweight")[1] // n
        assert torch.equal(rd.get(f"{w2}.qweight"), full.get_merged(f"{w2}.qweight")[:, r * cols:(r + 1) * cols])
        if scheme.method == "int8":  # one scale per full row: replicated on every rank
            assert torch.equal(rd.get(f"{w2}.scale"), full.get_merged(f"{w2}.scale"))
        emb, cols = "tok_embeddings", full.readers[0].shape("tok_embeddings.qweight")[1] // n  # by hidden columns
        assert torch.equal(rd.get(f"{emb}.qweight"), full.get_merged(f"{emb}.qweight")[:, r * cols:(r + 1) * cols])
        groups = full.readers[0].shape(f"{emb}.scale")[-1] // n if scheme.method == "int4" else None
        assert torch.equal(rd.get(f"{emb}.scale"), full.get_merged(f"{emb}.scale") if groups is None else
                           full.get_merged(f"{emb}.scale")[:, r * groups:(r + 1) * groups])


def test_int4_padding_falls_on_group_boundaries(make_hf, tmp_path):
    """intermediate 62 over 4 ranks pads to 64: whole zero groups with scale 0, removed again by merge."""
    src, _ = make_hf("llama_mha", intermediate_size=62)
    convert(str(src), str(tmp_path / "q"), progress=False, quant=QuantScheme("int4", 2))
    sp = reshard(str(tmp_path / "q"), str(tmp_path / "s"), 4, progress=False)
    assert sp.padded_dims["intermediate_dim"] == 64
    last = PmxModel(tmp_path / "s").readers[3]
    assert last.shape("layers.0.feed_forward.w2.qweight") == (64, 8)  # 16 columns, 2 of them padding
    assert torch.all(last.get("layers.0.feed_forward.w2.scale")[:, -1] == 0)
    assert torch.all(last.get("layers.0.feed_forward.w1.scale")[-2:] == 0)
    reshard(str(tmp_path / "s"), str(tmp_path / "m"), 1, progress=False)
    assert_same_model(tmp_path / "q", tmp_path / "m")


def test_split_that_cuts_a_group_is_refused(make_hf, tmp_path):
    src, _ = make_hf("llama_mha")  # w2: 96 input columns, 48 per rank at 2 ranks
    convert(str(src), str(tmp_path / "q"), progress=False, quant=QuantScheme("int4", 32))
    out = tmp_path / "s"
    res = run_cli("split", "--input_dir", tmp_path / "q", "--num_shards", 2, "--output_dir", out)
    assert_fails_cleanly(res, out, "layers.*.feed_forward.w2", "group_size 32", "num_shards=2", "48")
    with pytest.raises(PmxError, match="group_size 32"):  # also while converting straight into shards
        convert(str(src), str(tmp_path / "c"), num_shards=2, progress=False, quant=QuantScheme("int4", 32))


def test_int4_group_size_error_lists_every_size_that_fits(shared_model, tmp_path):
    """stories260k (input dims 64 and 172) used to fail at 128, then at 64, ...: one error now lists 2 and 4, and
    each size it lists quantises the model."""
    convert(str(shared_model("stories260k")), str(tmp_path / "fp"), progress=False)
    out = tmp_path / "q"
    res = run_cli("quantize", "--input_dir", tmp_path / "fp", "--output_dir", out, "--quantize", "int4",
                  "--group_size", 128)
    assert_fails_cleanly(res, out, "group_size 128", "group sizes that divide every input dim: 2, 4")
    for g in (2, 4):
        quantize_model(str(tmp_path / "fp"), str(tmp_path / f"q{g}"), QuantScheme("int4", g), progress=False)
    with pytest.raises(PmxError, match=r"no int4 group size divides every input dim \(their common divisor is 1\)"):
        quantized_tensors(QuantScheme("int4", 2), {"layers.0.attention.wq.weight": (8, 64),
                                                   "layers.0.feed_forward.w2.weight": (64, 171)})


def test_merge_refuses_differing_int8_scale_replicas(make_hf, tmp_path):
    src, _ = make_hf("llama_mha")
    convert(str(src), str(tmp_path / "s"), num_shards=2, progress=False, quant=INT8)
    f = tmp_path / "s" / "model.01.safetensors"
    rd = SafetensorsReader(f)
    begin = rd._data_start + rd._header["layers.0.attention.wo.scale"]["data_offsets"][0]
    data = bytearray(f.read_bytes())
    data[begin + 1] ^= 0x40  # one bit of one replicated scale
    f.write_bytes(bytes(data))
    with pytest.raises(PmxError, match="layers.0.attention.wo.scale.*shard 1 differs"):
        reshard(str(tmp_path / "s"), str(tmp_path / "m"), 1, progress=False)


# --- the command line ------------------------------------------------------------------------------
def test_cli_quantize_and_convert_flags(make_hf, tmp_path):
    src, _ = make_hf("llama_mha")
    res = run_cli("convert", "--input_dir", src, "--output_dir", tmp_path / "q", "--quantize", "int4",
                  "--group_size", 16, "--quantize_output", "True")
    assert res.returncode == 0, res.stderr
    assert PmxParams.load(tmp_path / "q").quantization == {"method": "int4", "group_size": 16, "quantize_output": True,
                                                           "quantize_embedding": True}
    res = run_cli("convert", "--input_dir", src, "--output_dir", tmp_path / "q0", "--quantize", "int8",
                  "--quantize_output", "False", "--quantize_embedding", "False")
    assert res.returncode == 0, res.stderr
    assert SafetensorsReader(tmp_path / "q0" / "model.00.safetensors").dtype("output.weight") == torch.float32
    convert(str(src), str(tmp_path / "f"), num_shards=2, progress=False)
    res = subprocess.run([sys.executable, "scripts/Quantize.py", "--input_dir", tmp_path / "f", "--output_dir",
                          tmp_path / "q8", "--quantize", "int8"], capture_output=True, text=True)
    assert res.returncode == 0 and "quantized" in res.stdout, res.stderr
    assert PmxParams.load(tmp_path / "q8").num_shards == 2  # split as the input was

    for args, needles in [
        (["--quantize", "int3"], ["--quantize must be one of int8, int4", "int3"]),
        (["--quantize", "int4", "--group_size", 5], ["--group_size", "5"]),
        (["--quantize", "int4", "--group_size", 128], ["tok_embeddings.weight", "group_size 128", "64"]),
    ]:
        out = tmp_path / "bad"
        assert_fails_cleanly(run_cli("quantize", "--input_dir", tmp_path / "f", "--output_dir", out, *args), out,
                             *needles)
    out = tmp_path / "again"
    assert_fails_cleanly(run_cli("quantize", "--input_dir", tmp_path / "q", "--output_dir", out), out,
                         "already quantised")


def test_params_quantization_is_strict(make_hf, tmp_path):
    src, _ = make_hf("llama_mha")
    convert(str(src), str(tmp_path / "q"), progress=False, quant=INT8)
    path = tmp_path / "q" / "pmx_params.json"
    d = json.loads(path.read_text())
    for bad, msg in (({"method": "int8", "group_size": -32}, "group_size must be a non-negative integer"),
                     ({"method": "int8", "offset": True}, "offsets are an int4"),
                     ({"method": "int8", "tensors": {"layers.0.attention.wq": {"method": "int5"}}},
                      "method must be one of")):
        path.write_text(json.dumps({**d, "quantization": bad}))
        with pytest.raises(PmxError, match=msg):
            PmxParams.load(tmp_path / "q")
    # a scheme that parses but does not match the tensors (int8 in groups of 32: scales [N, K/32], not [N]) is refused
    # by name where the model is read
    path.write_text(json.dumps({**d, "quantization": {**INT8.to_dict(), "group_size": 32}}))
    with pytest.raises(PmxError, match=r"tensor .tok_embeddings.scale. is \[101\] unsplit, but .* gives \[101, 2\]"):
        reshard(str(tmp_path / "q"), str(tmp_path / "q1"), 1, progress=False)
