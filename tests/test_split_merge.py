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


@pytest.mark.parametrize("arch", ["llama_gqa_odd", "llama_bias", "qwen2", "gemma3", "phi4_mini"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_random_roundtrip_odd_sizes(make_hf, tmp_path, arch, n):
    """Split in n (Gemma 3's one KV head on every rank, Phi-4-mini's 2 on pairs of ranks at 4; 8 ranks refused for
    4 heads), re-cut in 2, merged: the same bytes."""
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


# --- which model and which shard: safetensors metadata -------------------------------------------------
def shard_meta(path) -> dict:
    from runner.pmx.store import SafetensorsReader
    return SafetensorsReader(path).metadata()


@pytest.fixture
def stories_splits(shared_model, tmp_path):
    """stories260k unsplit and split in 2, and the same model with one weight changed, split in 2."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    convert(str(shared_model("stories260k")), str(tmp_path / "full"), progress=False)
    reshard(str(tmp_path / "full"), str(tmp_path / "s2"), 2, progress=False)
    other = tmp_path / "other_full"
    other.mkdir()
    for f in (tmp_path / "full").iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    with safe_open(str(other / "model.00.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    sd["norm.weight"] += 1
    save_file(sd, str(other / "model.00.safetensors"))  # no metadata: as written before it existed
    reshard(str(other), str(tmp_path / "other_s2"), 2, progress=False)
    return tmp_path


def test_every_shard_records_its_rank_the_shard_count_and_the_model(stories_splits):
    t = stories_splits
    full, s0, s1 = (shard_meta(p) for p in (t / "full/model.00.safetensors", t / "s2/model.00.safetensors",
                                            t / "s2/model.01.safetensors"))
    assert (full["pmx_rank"], full["pmx_num_shards"]) == ("0", "1") and len(full["pmx_fingerprint"]) == 32
    assert (s0["pmx_rank"], s0["pmx_num_shards"], s1["pmx_rank"], s1["pmx_num_shards"]) == ("0", "2", "1", "2")
    assert full["pmx_fingerprint"] == s0["pmx_fingerprint"] == s1["pmx_fingerprint"]  # one model, whatever the split
    assert shard_meta(t / "other_s2/model.00.safetensors")["pmx_fingerprint"] != s0["pmx_fingerprint"]
    reshard(str(t / "other_s2"), str(t / "other_merged"), 1, progress=False)  # shards without metadata still merge
    assert shard_meta(t / "other_merged/model.00.safetensors")["pmx_fingerprint"] != full["pmx_fingerprint"]


def swap_in(dst, name, src):
    (dst / name).write_bytes((src / name).read_bytes())


@pytest.mark.parametrize("damage,message", [
    ("swap", r"model.00.safetensors: holds shard 1 \(its pmx_rank metadata\), but its name says shard 0: the shard "
             r"files were renamed or swapped"),
    ("other_model", r"model.01.safetensors: comes from another model than .*model.00.safetensors .*shards of "
                    r"different models are mixed"),
    ("other_split", r"model.01.safetensors: is one of 4 shards \(pmx_num_shards\), but pmx_params.json says "
                    r"num_shards=2: shards of different splits are mixed"),
])
def test_swapped_or_mixed_shards_are_refused(stories_splits, damage, message):
    t = stories_splits
    s2 = t / "s2"
    if damage == "swap":
        (s2 / "model.00.safetensors").rename(s2 / "tmp")
        (s2 / "model.01.safetensors").rename(s2 / "model.00.safetensors")
        (s2 / "tmp").rename(s2 / "model.01.safetensors")
    elif damage == "other_model":  # same shapes, other weights
        for name in ("pmx_params.json", "model.01.safetensors"):
            swap_in(s2, name, t / "other_s2")
    else:
        reshard(str(t / "full"), str(t / "s4"), 4, progress=False)
        swap_in(s2, "model.01.safetensors", t / "s4")
    with pytest.raises(PmxError, match=message):
        reshard(str(s2), str(t / "merged"), 1, progress=False)
    assert not (t / "merged").exists()


def test_a_shard_is_checked_when_the_engine_loads_it(stories_splits):
    from runner.engine.session import open_session
    t = stories_splits
    (t / "full" / "model.00.safetensors").write_bytes((t / "s2" / "model.01.safetensors").read_bytes())
    with pytest.raises(PmxError, match="model.00.safetensors: holds shard 1 .* renamed or swapped"):
        open_session(str(t / "full"))


@pytest.mark.parametrize("edit,message", [
    (dict(num_layers=4), r"its tensors do not match .*pmx_params.json: missing \[\], unexpected \['layers.4."),
    (dict(vocab_size=500), r"tensor 'tok_embeddings.weight' is \[512, 64\] unsplit, but .*pmx_params.json gives "
                          r"\[500, 64\] \(was pmx_params.json edited\?\)"),
])
def test_split_and_merge_check_the_params_against_the_tensors(stories_splits, edit, message):
    import json
    t = stories_splits
    for d in ("full", "s2"):
        path = t / d / "pmx_params.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(PmxError, match=message):
        reshard(str(t / "s2"), str(t / "merged"), 1, progress=False)
    with pytest.raises(PmxError, match=message):
        reshard(str(t / "full"), str(t / "split"), 2, progress=False)
    assert not (t / "merged").exists() and not (t / "split").exists()


def test_wrong_rank_count_suggests_only_what_works(make_hf, tmp_path):
    """A model split in 2 started on 3 ranks used to suggest `Split.py --num_shards 3`, which fails for 4 heads:
    the error offers -np 2 and the counts the model can be cut into; on 4 ranks, the split for 4, which works."""
    from runner.engine.session import check_world_size
    from runner.parallel.launch import LaunchEnv
    src, _ = make_hf("llama_mha")  # 4 query heads, 4 KV heads
    convert(str(src), str(tmp_path / "pmx_2"), num_shards=2, progress=False)
    params = PmxParams.load(tmp_path / "pmx_2")
    check_world_size("m", params, LaunchEnv("mpi", 0, 2, 0, 2))
    with pytest.raises(PmxError) as e:
        check_world_size("m", params, LaunchEnv("mpi", 0, 3, 0, 3))
    assert str(e.value) == ("m: the model is split into 2 shard(s) but 3 rank(s) were started; launch -np 2 (it "
                            "cannot be split for 3 ranks: num_heads=4 is not divisible by 3; it can be for 1, 2 or 4)")
    with pytest.raises(PmxError, match="cannot be honoured"):
        reshard(str(tmp_path / "pmx_2"), str(tmp_path / "pmx_3"), 3, progress=False)
    with pytest.raises(PmxError) as e:
        check_world_size("m", params, LaunchEnv("mpi", 0, 4, 0, 4))
    assert str(e.value).endswith("; launch -np 2 or split it with scripts/Split.py --num_shards 4")
    reshard(str(tmp_path / "pmx_2"), str(tmp_path / "pmx_4"), 4, progress=False)
