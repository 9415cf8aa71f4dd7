"""`python -m runner onnx_replay` (what `scripts/benchmark.sh STEP` runs when MODEL_PATH is an export): replay one
dumped step on every rank in onnxruntime, through the rank's opmx export (runner.onnx.ort), as pplnn replays it.

Each rank feeds `DUMP/rank_{r}/step{S}_*.bin` to `EXPORT/model_slice_{r}/model.onnx`, writes the logits (and, with
--dump_layers, each layer's values) as float32 `.bin` to `OUT/rank_{r}/`, warms up, profiles for at least
--min_profiling_seconds, and rank 0 prints each rank's latency and its logits' difference to the dump. The updated
KV cache is checked against the next step's dumped cache where that step was dumped (the cache after step S is the
cache before step S+1). Exit status 1 when a rank's logits are off by more than --rtol of their largest magnitude,
or its cache differs.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Annotated, Optional

import torch

from runner.args import DumpDir, Fields, MinProfilingSeconds, Range, ReplayOutputDir, ReplayStep, Warmup
from runner.config import EngineConfig
from runner.engine.dump import STEP_INPUTS, dump_files, load_rank_step, load_step, write_tensor
from runner.engine.layer_dump import HEAD_OPS, LAYER_OPS
from runner.engine.replay import Agreement
from runner.errors import PmxError
from runner.kernels.reference import cache_shape
from runner.onnx.export import PARAMS_JSON, SLICE_DIR
from runner.parallel.comm import collective_timeout, make_comm
from runner.parallel.launch import detect, set_cpu_threads
from runner.pmx.store import check_apart



def layer_values(slice_dir: Path, num_layers: int) -> tuple:
    """The names of the layer values an export's graph holds (runner.onnx.export): each layer's `qkv` (or `q`, `k`,
    `v` where unfused) and the other dump names."""
    import onnx
    have = {o for n in onnx.load(str(Path(slice_dir) / "model.onnx"), load_external_data=False).graph.node
            for o in n.output}
    names = tuple(f"layer{i}_{op}" for i in range(num_layers) for op in ("qkv", *LAYER_OPS) if f"layer{i}_{op}" in have)
    missing = [f"layer{i}_{op}" for i in range(num_layers) for op in ("attention_norm", "attention", "o", "ffn")
               if f"layer{i}_{op}" not in names]
    if missing:
        raise PmxError(f"{slice_dir}: has no values {missing[:3]} to dump (re-export it with this project's Export.py)")
    return names


def layer_dump(outs: dict, num_layers: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """{layer{i}_{op}: tensor} of runner.engine.layer_dump's ops from a replay's graph values: q, k, v and attention
    by heads ([T, heads, head_dim]; q, k, v cut from the fused qkv output as the engine's dump cuts them)."""
    out = {}
    for i in range(num_layers):
        values = {op: outs[f"layer{i}_{op}"] for op in ("qkv", *LAYER_OPS) if f"layer{i}_{op}" in outs}
        if "qkv" in values:
            values.update(zip("qkv", values.pop("qkv").split([heads * head_dim, kv_heads * head_dim,
                                                               kv_heads * head_dim], dim=-1)))
        for op in LAYER_OPS:
            t = values[op]
            out[f"layer{i}_{op}"] = t.reshape(t.shape[0], -1, head_dim) if op in HEAD_OPS else t
    return out


def is_export(path: str) -> bool:
    return (Path(path) / PARAMS_JSON).is_file() and (Path(path) / SLICE_DIR.format(0)).is_dir()


def load_export_params(export_path: str) -> dict:
    path = Path(export_path) / PARAMS_JSON
    if not path.is_file():
        raise PmxError(f"{export_path}: has no {PARAMS_JSON}; not an export (write one with scripts/Export.py)")
    try:
        params = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PmxError(f"{path}: not valid JSON ({e})") from None
    for key in ("num_shards", "opset", "engine", "num_layers", "head_dim", "num_kv_heads", "vocab_size"):
        if key not in params:
            raise PmxError(f"{path}: lacks {key!r}; re-export with this project's scripts/Export.py")
    return params


def _check_dump(ep: dict, world: int, t: dict, rank_dir: Path, export_path: str) -> None:
    e = ep["engine"]
    kvh = max(ep["num_kv_heads"] // world, 1)
    kv = t["kv_cache"]
    want = cache_shape(e["cache_layout"], ep["num_layers"], kv.shape[e["cache_layout"]] if kv.dim() == 5 else -1, kvh,
                       ep["head_dim"])
    if tuple(kv.shape) != tuple(want) or (kv.dtype == torch.int8) != e["quantized_cache"]:
        raise PmxError(f"{rank_dir}: kv_cache is {list(kv.shape)} {kv.dtype}, but {export_path} was exported for "
                       f"{list(want)} ({'int8' if e['quantized_cache'] else ep['dtype']}, cache_layout "
                       f"{e['cache_layout']}): the dump was made with another model or other cache flags")
    if (t["cachestarts"].dim() == 2) != (e["cache_mode"] == 1):
        raise PmxError(f"{rank_dir}: cachestarts {list(t['cachestarts'].shape)} does not fit {export_path}'s "
                       f"cache_mode {e['cache_mode']}")
    if t["attn_mask"].numel() and e["auto_causal"]:
        raise PmxError(f"{rank_dir}: the step has an explicit attn_mask, but {export_path} was exported with "
                       f"--auto_causal true")
    if t["logits"].shape[-1] != ep["vocab_size"]:
        raise PmxError(f"{rank_dir}: logits {list(t['logits'].shape)} do not fit {export_path}'s vocabulary of "
                       f"{ep['vocab_size']}")


def onnx_replay(export_path: str, dump_dir: DumpDir, step: ReplayStep, output_dir: ReplayOutputDir = "out/replay", warmup: Warmup = 2,
                min_profiling_seconds: MinProfilingSeconds = 1.0,
                rtol: Annotated[float, Range(0)] = 1e-5, dump_layers: bool = False,
                config: Annotated[EngineConfig, Fields("comm_backend", "collective_timeout")] = EngineConfig()) -> int:
    """Replay a dumped step in onnxruntime through each rank's opmx export (under the same mpirun -np N as the dump);
    time it and check its logits and updated cache against the dump. Exit status 1 when a rank disagrees.

    Args:
        export_path: the --export_path of scripts/Export.py (model_slice_r/model.onnx per rank, params.json).
        rtol: pass mark: max |logits - dumped| <= rtol * max |dumped|.
        dump_layers: also write each layer's values (layer{i}_{op}: attention_norm q k v attention o ffn_norm
            residual ffn), for `compare --per_layer` against the engine's --dump_layers.
    """
    check_apart(Path(output_dir), {"--dump_dir": Path(dump_dir), "--export_path": Path(export_path)}, nested_ok=True)
    env = detect()
    ep = load_export_params(export_path)
    if ep["opset"] != "opmx":
        raise PmxError(f"{export_path}: is a {ep['opset']} export; onnx_replay runs opmx exports (a standard one runs "
                       f"in a plain onnxruntime session)")
    if ep["num_shards"] != env.world_size:
        raise PmxError(f"{export_path}: was exported for {ep['num_shards']} rank(s) but {env.world_size} were started; "
                       f"launch -np {ep['num_shards']}")
    rank_dir, meta, t = load_rank_step(dump_dir, step, env.rank, env.world_size, "the export")
    _check_dump(ep, env.world_size, t, rank_dir, export_path)
    after = load_step(str(rank_dir), int(step) + 1) if any(s == int(step) + 1 for s, _ in dump_files(rank_dir)) \
        else None
    set_cpu_threads(env)
    comm = make_comm(env, torch.device("cpu"), config.comm_backend, collective_timeout(config.collective_timeout))
    from runner.onnx.ort import OpmxSession
    path = Path(export_path) / SLICE_DIR.format(env.rank)
    graph_values = layer_values(path, ep["num_layers"]) if dump_layers else ()
    sess = OpmxSession(path, comm, graph_values, threads=torch.get_num_threads())
    feeds = {n: t[n].clone() for n in STEP_INPUTS if n in t}
    comm.sync()
    outs = sess.run(feeds)
    logits = outs["logits"]
    cache_diff = _cache_check(feeds, after)

    def timed() -> float:
        t0 = time.perf_counter()
        sess.run(feeds)
        return time.perf_counter() - t0

    warm = [timed() for _ in range(max(warmup, 1))]
    n = torch.tensor([max(1, math.ceil(min_profiling_seconds / max(sum(warm) / len(warm), 1e-9)))])
    n = int(comm.broadcast_(n)[0])
    times = [timed() for _ in range(n)]
    out_dir = Path(output_dir) / f"rank_{env.rank}"
    write_tensor(out_dir, int(step), "logits", logits.float(), "the replayed logits")
    if dump_layers:
        heads = (ep["num_heads"] // env.world_size, max(ep["num_kv_heads"] // env.world_size, 1), ep["head_dim"])
        for name, value in layer_dump(outs, ep["num_layers"], *heads).items():
            write_tensor(out_dir, int(step), name, value, "the replayed layer values")
    agree = Agreement.of(logits, t["logits"])
    rel = agree.max_abs / max(float(t["logits"].abs().max()), 1e-30)
    cache_d, cache_ok = cache_diff if cache_diff is not None else (-1.0, True)
    row = torch.tensor([[min(times), sum(times) / n, max(times), agree.max_abs, rel, agree.cosine, agree.snr_db, n,
                         cache_d, float(cache_ok)]], dtype=torch.float64)
    rows = comm.all_gather(row, dim=0).tolist()
    failed = [r for r, x in enumerate(rows) if x[4] > rtol or not x[9]]
    if env.rank == 0:
        print(f"onnxruntime replay of step {step} from {dump_dir}: {env.world_size} rank(s), {export_path}, "
              f"cache_layout={ep['engine']['cache_layout']}, cache_mode={ep['engine']['cache_mode']}, "
              f"quantized_cache={ep['engine']['quantized_cache']}", flush=True)
        print(f"{'rank':>4}  {'min(ms)':>9} {'mean(ms)':>9} {'max(ms)':>9} {'iters':>6}  {'max|diff|':>10} "
              f"{'rel':>9} {'cosine':>9} {'SNR(dB)':>8}  {'cache':>12}  verdict", flush=True)
        for r, (mn, mean, mx, diff, rl, cos, snr, iters, cd, _) in enumerate(rows):
            cache = "not checked" if cd < 0 else ("exact" if cd == 0 else f"{cd:.2g} off")
            print(f"{r:>4}  {mn * 1e3:9.3f} {mean * 1e3:9.3f} {mx * 1e3:9.3f} {int(iters):>6}  {diff:10.3g} {rl:9.2g} "
                  f"{cos:9.6f} {snr:8.2f}  {cache:>12}  {'FAIL' if r in failed else 'ok'}", flush=True)
        if rows[0][8] < 0:
            print(f"cache: step {int(step) + 1} was not dumped, so the updated cache was not checked "
                  f"(dump consecutive steps, e.g. --dump_steps {step},{int(step) + 1})", flush=True)
        print(f"outputs: {output_dir}/rank_*/step{step}_logits-*-fp32.bin", flush=True)
        if failed:
            print(f"FAIL: rank(s) {failed}: logits off by more than {rtol} of their magnitude, or the cache differs",
                  flush=True)
    comm.close()
    return 1 if failed else 0


def _cache_check(feeds: dict, after: Optional[dict]) -> Optional[tuple[float, bool]]:
    """(max |cache after the replayed step - the next step's dumped cache|, within tolerance), None when that step
    was not dumped. A float cache passes within 1e-5 of its magnitude (the linears round differently from the
    engine's kernels), an int8 one within one quantisation step (a value on a rounding boundary may go either way),
    its float16 scales within 1e-3 relative."""
    if after is None or "kv_cache" not in after:
        return None
    got, want = feeds["kv_cache"], after["kv_cache"]
    if got.shape != want.shape:
        return float("inf"), False
    d = (got.float() - want.float()).abs().max().item()
    ok = d <= (1.0 if got.dtype == torch.int8 else 1e-5 * max(want.float().abs().max().item(), 1e-30))
    if "kv_scale" in feeds and "kv_scale" in after:
        s, ws = feeds["kv_scale"].float(), after["kv_scale"].float()
        ok = ok and bool(((s - ws).abs() <= 1e-3 * ws.abs().clamp_min(1e-5)).all())
    return d, ok
