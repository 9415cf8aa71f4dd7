"""Replay one dumped step on every rank: time it and check it against the dump.

`python -m runner replay --ckpt_dir D --dump_dir DUMP --step S --output_dir OUT` (and, per rank under
mpirun, `scripts/benchmark.sh S`). Each rank loads its shard, reads `DUMP/rank_{r}/step{S}_*.bin`
(the step's inputs as they were before the step, the KV cache contents and scales included), runs
the engine's forward on them, writes the logits as float32 to `OUT/rank_{r}/`, then warms up and
profiles for at least `min_profiling_seconds`. Rank 0 prints one line per rank: latency
min / mean / max, max |diff|, cosine and SNR against the dumped logits. The exit status is 1 when a
rank is beyond tolerance.

The engine config comes from the `engine.json` the dumper writes beside the steps; without it (a
ppl.pmx dump) it is read off the tensors: an int8 cache means quantised, a 2-D cachestarts paged,
the cache's shape gives the layout (--cache_layout picks one where the shape fits several), a non-empty
attn_mask the explicit-mask path. --device, --comm_backend, --collective_timeout and a --dtype other than auto
(the dumped run's) apply on top.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Annotated, Optional

import torch

from runner.args import DumpDir, Fields, MinProfilingSeconds, Range, ReplayOutputDir, ReplayStep, Warmup
from runner.config import EngineConfig
from runner.engine.dump import STEP_INPUTS, load_rank_step, write_tensor
from runner.engine.session import check_world_size, open_session
from runner.errors import PmxError
from runner.parallel.launch import detect
from runner.kernels.reference import cache_shape
from runner.pmx.params import PmxParams
from runner.pmx.store import check_apart, dtype_name

@dataclass(frozen=True)
class Agreement:
    """How close `out` is to the reference `ref` (both flattened to float64)."""
    max_abs: float
    cosine: float
    snr_db: float    # 10 log10(sum ref^2 / sum (out - ref)^2); inf when identical
    mse: float

    @classmethod
    def of(cls, out: torch.Tensor, ref: torch.Tensor) -> "Agreement":
        a, b = out.detach().double().flatten().cpu(), ref.detach().double().flatten().cpu()
        if a.numel() == 0:
            return cls(0.0, 1.0, math.inf, 0.0)
        d = a - b
        noise, signal = float(d.pow(2).sum()), float(b.pow(2).sum())
        na, nb = float(a.norm()), float(b.norm())
        cos = 1.0 if na == 0 and nb == 0 else (float(a @ b) / (na * nb) if na and nb else 0.0)
        snr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal else -math.inf)
        return cls(float(d.abs().max()), cos, snr, noise / a.numel())


def infer_options(params: PmxParams, world_size: int, t: dict, meta: Optional[dict],
                  layout_hint: int = 0) -> EngineConfig:
    """The engine config a dump was made with: from its engine.json, else read off its tensors (`layout_hint`: the
    layout to take where the cache's shape fits several)."""
    if meta is not None:
        known = {f.name for f in fields(EngineConfig)}
        return EngineConfig(**{k: v for k, v in meta.get("options", {}).items() if k in known})
    kv = t["kv_cache"]
    explicit_mask = t["attn_mask"].numel() > 0
    kv_heads, layers, hd = max(params.num_kv_heads // world_size, 1), params.num_layers, params.head_dim
    # layout l keeps the token axis at position l
    layouts = [lay for lay in range(4) if kv.dim() == 5 and
               cache_shape(lay, layers, kv.shape[lay], kv_heads, hd) == tuple(kv.shape)]
    if len(layouts) > 1 and layout_hint in layouts:
        layouts = [layout_hint]
    if len(layouts) != 1:
        raise PmxError(f"kv_cache of shape {list(kv.shape)} fits cache layouts {layouts or 'none'} for this model "
                       f"({layers} layers, {kv_heads} KV heads per rank, head_dim {hd}); pass --cache_layout")
    return EngineConfig(quantized_cache=kv.dtype == torch.int8, cache_mode=1 if t["cachestarts"].dim() == 2 else 0,
                        cache_layout=layouts[0], auto_causal=not explicit_mask, fused_kvcache=not explicit_mask)


def _check_against_dump(o: EngineConfig, t: dict, rank_dir: Path) -> None:
    """The options must describe the dumped cache; say which disagrees rather than fail inside the step."""
    if o.quantized_cache != (t["kv_cache"].dtype == torch.int8) or o.quantized_cache != ("kv_scale" in t):
        raise PmxError(f"{rank_dir}: kv_cache is {t['kv_cache'].dtype} (kv_scale {'present' if 'kv_scale' in t else 'absent'}) "
                       f"but quantized_cache={o.quantized_cache}")
    if (t["cachestarts"].dim() == 2) != (o.cache_mode == 1):
        raise PmxError(f"{rank_dir}: cachestarts has shape {list(t['cachestarts'].shape)}, which does not fit "
                       f"cache_mode={o.cache_mode} (offset: [B], paged: [B, pages])")


def check_dump_fits(params: PmxParams, o: EngineConfig, world_size: int, t: dict, rank_dir: Path,
                    ckpt_dir: str) -> None:
    """The dumped step must be one of this model at this rank count: say what differs rather than fail in the step."""
    kv, kvh = t["kv_cache"], max(params.num_kv_heads // world_size, 1)
    rows = kv.shape[o.cache_layout] if kv.dim() == 5 else -1
    want = cache_shape(o.cache_layout, params.num_layers, rows, kvh, params.head_dim)
    if tuple(kv.shape) != tuple(want):
        raise PmxError(f"{rank_dir}: kv_cache has shape {list(kv.shape)}, but {ckpt_dir} on {world_size} rank(s) "
                       f"with cache_layout={o.cache_layout} needs {list(want)} ({params.num_layers} layers, {kvh} KV "
                       f"heads per rank, head_dim {params.head_dim}): the dump was made with another model")
    if t["logits"].dim() != 2 or t["logits"].shape[-1] != params.vocab_size:
        raise PmxError(f"{rank_dir}: logits have shape {list(t['logits'].shape)}, but {ckpt_dir} has a vocabulary of "
                       f"{params.vocab_size}: the dump was made with another model")
    ids = t["token_ids"]
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < params.vocab_size):
        raise PmxError(f"{rank_dir}: token_ids reach {int(ids.max())}, outside {ckpt_dir}'s vocabulary "
                       f"[0, {params.vocab_size}): the dump was made with another model")


def dumped_dtype(meta: dict) -> str:
    """The --dtype that runs a step as the dumped run did: its compute dtype, or auto where that kept its linear
    weights narrower than the compute (float32 on CPU over a half-precision checkpoint, which is what auto does)."""
    return "auto" if meta.get("weight_dtype", meta["dtype"]) != meta["dtype"] else meta["dtype"]


def replay(ckpt_dir: str, dump_dir: DumpDir, step: ReplayStep, output_dir: ReplayOutputDir = "out/replay", warmup: Warmup = 2,
           min_profiling_seconds: MinProfilingSeconds = 1.0, min_snr: float = 60.0,
           min_cosine: Annotated[float, Range(-1, 1)] = 0.9999,
           config: Annotated[EngineConfig, Fields("device", "dtype", "cache_layout", "comm_backend",
                                                  "collective_timeout")] = EngineConfig()) -> int:
    """Replay a dumped step on every rank (run it under the same mpirun -np N as the dump); time it and
    check its logits against the dump. Exit status 1 when a rank is beyond tolerance.

    Args:
        ckpt_dir: the PMX directory the dump was made with (split into N shards).
        min_snr: pass threshold in dB (identical logits always pass).
        min_cosine: pass threshold for the cosine similarity.

    Everything about the launch, the dump and the model is checked before the first collective: the rank
    count against the model's shards and the dump's engine.json, this rank's dump folder, and the dumped
    tensors against the model.
    """
    check_apart(Path(output_dir), {"--dump_dir": Path(dump_dir), "--ckpt_dir": Path(ckpt_dir)}, nested_ok=True)
    env = detect()
    rank_dir, meta, t = load_rank_step(dump_dir, step, env.rank, env.world_size, "replay")
    params = PmxParams.load(Path(ckpt_dir))
    check_world_size(ckpt_dir, params, env)
    dumped = infer_options(params, env.world_size, t, meta, config.cache_layout)
    dtype = config.dtype if config.dtype != "auto" else (dumped_dtype(meta) if meta else (
        "auto" if t["kv_cache"].dtype == torch.int8 else dtype_name(t["kv_cache"].dtype)))
    options = replace(dumped, device=config.device, dtype=dtype, comm_backend=config.comm_backend,
                      collective_timeout=config.collective_timeout)
    _check_against_dump(options, t, rank_dir)
    check_dump_fits(params, options, env.world_size, t, rank_dir, ckpt_dir)
    sess = open_session(ckpt_dir, options)
    dev = sess.device
    inputs = {n: t[n].to(dev) for n in STEP_INPUTS if n in t}
    inputs.setdefault("kv_scale", None)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def timed() -> float:
        sync()
        t0 = time.perf_counter()
        sess.stepper.forward(**inputs)
        sync()
        return time.perf_counter() - t0

    logits = sess.stepper.forward(**inputs)  # the cache as dumped; later runs rewrite the same rows identically
    warm = [timed() for _ in range(max(warmup, 1))]
    per_iter = sum(warm) / len(warm)
    n = torch.tensor([max(1, math.ceil(min_profiling_seconds / max(per_iter, 1e-9)))], dtype=torch.int64)
    n = int(sess.comm.broadcast_(n.to(dev) if dev.type == "cuda" else n)[0])  # every rank runs as many steps
    times = [timed() for _ in range(n)]
    write_tensor(Path(output_dir) / f"rank_{env.rank}", int(step), "logits", logits.float(), "the replayed logits")
    agree = Agreement.of(logits, t["logits"])
    row = torch.tensor([[min(times), sum(times) / n, max(times), agree.max_abs, agree.cosine, agree.snr_db, n]],
                       dtype=torch.float64, device=dev)
    rows = sess.comm.all_gather(row, dim=0).cpu().tolist()
    failed = [r for r, x in enumerate(rows) if not (x[3] == 0 or (x[5] >= min_snr and x[4] >= min_cosine))]
    sess.log(f"replay of step {step} from {dump_dir}: {env.world_size} rank(s), {dev.type}, {dtype}, "
             f"{options.cache_layout=}, {options.cache_mode=}, {options.quantized_cache=}".replace("options.", ""))
    sess.log(f"{'rank':>4}  {'min(ms)':>9} {'mean(ms)':>9} {'max(ms)':>9} {'iters':>6}  {'max|diff|':>10} "
             f"{'cosine':>9} {'SNR(dB)':>8}  verdict")
    for r, (mn, mean, mx, diff, cos, snr, iters) in enumerate(rows):
        verdict = "exact" if diff == 0 else ("FAIL" if r in failed else "ok")
        sess.log(f"{r:>4}  {mn * 1e3:9.3f} {mean * 1e3:9.3f} {mx * 1e3:9.3f} {int(iters):>6}  {diff:10.3g} "
                 f"{cos:9.6f} {snr:8.2f}  {verdict}")
    sess.log(f"outputs: {output_dir}/rank_*/step{step}_logits-*-fp32.bin")
    if failed:
        sess.log(f"FAIL: rank(s) {failed} beyond tolerance (SNR >= {min_snr} dB and cosine >= {min_cosine}, "
                 f"or identical)")
    sess.close()
    return 1 if failed else 0
