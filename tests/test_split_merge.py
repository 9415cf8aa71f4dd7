"""Split and merge: one shard-spec table, merge(split(m, N)) == m bit for bit."""

from __future__ import annotations

import filecmp

import pytest
import torch

from runner.errors import PmxError
from runner.pmx.convert import PmxModel, convert, reshard
from runner.pmx.params import PmxParams


def assert_same_model(a, b):
    for f in ("model.00.safetensors",):
        assert filecmp.cmp(a / f, b / f, shallow=False), f"{f} differs"
    assert PmxParams.load(a) == PmxParams.load(b)


@pytest.mark.parametrize("name", ["stories260k", "tinystories-656k"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_real_roundtrip(shared_model, tmp_path, name, n):
    convert(str(shared_model(name)), str(tmp_path / "full"), progress=False)
    sp = reshard(str(tmp_path / "full"), str(tmp_path / "split"), n, progress=False)
    assert sp.num_shards == n and len(list((tmp_path / "split").glob("model.*.safetensors"))) == n
    reshard(str(tmp_path / "split"), str(tmp_path / "merged"), 1, progress=False, expect_input_shards=n)
    assert_same_model(tmp_path / "full", tmp_path / "merged")


def test_stories260k_padding_and_kv_replication(shared_model, tmp_path):
    convert(str(shared_model("stories260k")), str(tmp_path / "full"), progress=False)
    sp = reshard(str(tmp_path / "full"), str(tmp_path / "s8"), 8, progress=False)
    assert sp.padded_dims == {"intermediate_dim": 176} and sp.kv_replication == 2
    full, s8 = PmxModel(tmp_path / "full"), PmxModel(tmp_path / "s8")
    wk = full.get_merged("layers.0.attention.wk.weight")  # [4 heads * 8, 64]
    for r in range(8):  # rank r holds KV head r // 2 (its query heads r, which use KV head r // 2)
        assert torch.equal(s8.readers[r].get("layers.0.attention.wk.weight"), wk[(r // 2) * 8:(r // 2 + 1) * 8])
    w1_last = s8.readers[7].get("layers.0.feed_forward.w1.weight")  # rows 154..175, the last 4 are padding
    assert w1_last.shape == (22, 64) and torch.all(w1_last[-4:] == 0)
    assert torch.equal(w1_last[:-4], full.get_merged("layers.0.feed_forward.w1.weight")[154:])


@pytest.mark.parametrize("arch", ["llama_gqa_odd", "llama_bias", "qwen2"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_random_roundtrip_odd_sizes(make_hf, tmp_path, arch, n):
    src, model = make_hf(arch)
    p = convert(str(src), str(tmp_path / "full"), progress=False)
    if p.num_heads % n:
        with pytest.raises(PmxError, match="num_heads"):
            reshard(str(tmp_path / "full"), str(tmp_path / "split"), n, progress=False)
        return
    reshard(str(tmp_path / "full"), str(tmp_path / "split"), n, progress=False)
    # re-cut a split model into another count, then merge: still the same bytes
    reshard(str(tmp_path / "split"), str(tmp_path / "re"), 2, progress=False)
    reshard(str(tmp_path / "re"), str(tmp_path / "merged"), 1, progress=False)
    assert_same_model(tmp_path / "full", tmp_path / "merged")
